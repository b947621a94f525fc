"""What frontends and workers check on disk: the shared output folder's handshake, and the model files a worker holds.

Handshake: each worker writes `<output>/.vramgraph-fleet/<worker id>.json` (its id and a random token, written to a
temporary name and renamed) when it starts, and sends the token in every heartbeat. A frontend that sees a worker
reads that file from *its* output folder: when the file is missing or holds another token, the two machines do not
share the output folder, and the images the worker writes would never reach /view. `serve --broker` waits up to
`--handshake-wait` seconds at start for a worker and refuses to start when the first one fails the check; a worker
that fails it later is listed under "unshared" in GET /vramgraph/fleet and logged.

Capability: a worker can run a model set when every model file of the set (by file name) is in one of its models
folders; it takes prompts of those sets only, and says which in its heartbeat (`can`), so the frontend lists the
sets that no live worker can run (`no_worker` in GET /vramgraph/fleet). Their prompts wait in the broker.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from .ids import prompt_id_problem

HANDSHAKE_DIR = ".vramgraph-fleet"


def handshake_path(output: Path, worker: str) -> Path | None:
    """The handshake file of `worker` under `output`, or None when the id is not a safe file name."""
    return None if prompt_id_problem(worker) else Path(output) / HANDSHAKE_DIR / f"{worker}.json"


def write_handshake(output: Path, worker: str) -> str:
    """Write this worker's handshake file (module doc); returns its token. ValueError for an unsafe worker id."""
    path = handshake_path(output, worker)
    if path is None:
        raise ValueError(f"--id {worker[:80]!r}: a worker id is 1 to 64 ASCII letters, digits, '_', '-' and '.'")
    token = secrets.token_hex(16)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps({"worker": worker, "token": token}))
    part.replace(path)
    return token


def handshake_problem(output: Path, worker: Any, token: Any) -> str | None:
    """Why this frontend cannot read what `worker` writes into the output folder, or None when it can."""
    path = handshake_path(output, worker) if isinstance(worker, str) else None
    if path is None or not isinstance(token, str) or not token:
        return f"worker {str(worker)[:80]!r} sent no usable handshake"
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return (f"worker {worker} writes its images into an output folder this frontend cannot see ({path} is "
                "missing): give the frontend and the workers the same output folder (one path, or one network mount)")
    except (OSError, ValueError) as e:
        return f"cannot read worker {worker}'s handshake file {path} ({type(e).__name__}); check its permissions"
    if not isinstance(found, dict) or found.get("token") != token:
        return (f"{path} was written by another worker {worker} (its token differs): the output folders are not "
                "shared, or two workers use one id")
    return None


def held_files(folders: Any) -> set[str]:
    """The names (no parent folders) of every model file and folder under the models folders of `folders`."""
    from ..nodes.files import MODEL_EXTENSIONS

    names: set[str] = set()
    for root in folders.models:
        if not Path(root).is_dir():
            continue
        for dirpath, dirs, files in os.walk(root, followlinks=True):
            names.update(f for f in files if f.endswith(MODEL_EXTENSIONS))
            names.update(dirs)  # checkpoint folders (diffusers layout) are named by their folder
            if dirpath.count(os.sep) - str(root).count(os.sep) >= 6:  # deep enough for any models layout; no loops
                dirs.clear()
    return names


def can_run(models: list[str], files: set[str]) -> bool:
    """Whether every model of a set (portable names, "kind:file") is a file this machine holds."""
    return bool(models) and all(m.partition(":")[2] in files for m in models)


def missing_outputs(entry: dict, folders: Any) -> list[str]:
    """The images a history entry names that are not in this machine's output (or temp) folder."""
    missing = []
    for ui in (entry.get("outputs") or {}).values():
        for im in (ui or {}).get("images", []) if isinstance(ui, dict) else []:
            if not isinstance(im, dict) or not isinstance(im.get("filename"), str):
                continue
            root = folders.output if im.get("type") == "output" else folders.temp
            path = Path(root) / str(im.get("subfolder") or "") / im["filename"]
            if not path.is_file():
                missing.append(f"{im.get('subfolder') or ''}/{im['filename']}".lstrip("/"))
    return missing


__all__ = ["HANDSHAKE_DIR", "can_run", "handshake_path", "handshake_problem", "held_files", "missing_outputs",
           "write_handshake"]
