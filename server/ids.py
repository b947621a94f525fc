"""Names that come from clients (or from broker messages) are data, never paths.

A prompt id is accepted in ComfyUI's shape: a UUID (what ComfyUI and its front end make), or 1 to MAX_PROMPT_ID
characters of ASCII letters, digits, `_`, `-` and `.`, not starting with a dot. Anything else is refused (`..`,
absolute paths, `/`, empty or dot names, unicode look-alikes, control characters, very long ids), at the frontend
(POST /prompt) and again at the worker, which never trusts a message.

A fleet worker writes a prompt's images into `<output>/<prompt_id>/`. Such a folder is *ours* only when we made it:
`claim` creates it with a marker file (`.vramgraph-prompt`, holding the id) and, when it exists already, empties it
only if it is a real folder (not a link) directly inside the output folder whose marker names that same id. A
folder of the same name that we did not make (a user's `portraits/`, the temp folder) is never removed or written
into: `NotOurs` says so, and the prompt is refused with that reason. An output node's filename_prefix must stay
inside that folder too (`unsafe_prefix`: no absolute names, no '..').
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from ..nodes.files import safe_name

log = logging.getLogger("vramgraph.server")
MAX_PROMPT_ID = 64
MARKER = ".vramgraph-prompt"
_SAFE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
RULE = (f"a prompt_id is a UUID or 1 to {MAX_PROMPT_ID} ASCII letters, digits, '_', '-' and '.' (not first); "
        "send none and the server makes one")


class BadId(ValueError):
    """A prompt id that is not in the accepted shape (see the module doc)."""


class NotOurs(OSError):
    """`<output>/<prompt_id>` exists and was not made by vramgraph for that prompt: it is left alone."""


def is_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value.lower() and len(value) == 36
    except ValueError:
        return False


def prompt_id_problem(value: object) -> str | None:
    """Why `value` is not an acceptable prompt id, or None when it is one."""
    if not isinstance(value, str):
        return f"got a JSON {type(value).__name__}, not a string"
    if is_uuid(value):
        return None
    if not value:
        return "it is empty"
    if len(value) > MAX_PROMPT_ID:
        return f"it is {len(value)} characters long (at most {MAX_PROMPT_ID})"
    if not value.isascii():
        return "it has characters outside ASCII"
    if _SAFE.fullmatch(value) is None:
        return "it has a character other than letters, digits, '_', '-' and '.', or starts with a dot"
    return None


def check_prompt_id(value: object, what: str = "prompt_id") -> str:
    """`value` when it is an acceptable prompt id (module doc); BadId naming the reason and the rule otherwise."""
    problem = prompt_id_problem(value)
    if problem is not None:
        shown = repr(value)[:80] if isinstance(value, str) else type(value).__name__
        raise BadId(f"{what} {shown} is refused: {problem}; {RULE}")
    return value  # type: ignore[return-value]


def prompt_folder(root: Path, pid: str) -> Path:
    """`<root>/<pid>` for an acceptable id, checked to be a direct child of `root` (BadId otherwise)."""
    check_prompt_id(pid)
    path = Path(root) / pid
    if path.parent != Path(root) or path.name != pid:
        raise BadId(f"prompt_id {pid!r} does not name one folder inside the output folder; {RULE}")
    return path


def is_ours(root: Path, pid: str) -> bool:
    """Whether `<root>/<pid>` is a folder vramgraph made for prompt `pid` (module doc)."""
    path = prompt_folder(root, pid)
    marker = path / MARKER
    try:
        if path.is_symlink() or not path.is_dir() or marker.is_symlink() or not marker.is_file():
            return False
        if path.resolve().parent != Path(root).resolve():
            return False
        return marker.read_text(encoding="utf-8") == pid
    except (OSError, UnicodeDecodeError):
        return False


def taken_by_others(root: Path, pid: str) -> bool:
    """Whether `<root>/<pid>` exists (even as a broken link) and is not ours: a prompt with that id must be refused."""
    path = prompt_folder(root, pid)
    return (path.is_symlink() or path.exists()) and not is_ours(root, pid)


def claim(root: Path, pid: str) -> Path:
    """The empty folder `<root>/<pid>` with our marker: made, or emptied when it is ours (an earlier attempt's
    files). NotOurs when that name is taken by something we did not make; nothing is removed then."""
    path = prompt_folder(root, pid)
    if path.is_symlink() or path.exists():
        if not is_ours(root, pid):
            raise NotOurs(f"the output folder already has {pid!r}, which vramgraph did not make for this prompt; it "
                          "is left alone: send the prompt again with another prompt_id (or none)")
        shutil.rmtree(path)  # never follows links inside (shutil's fd-based walk); `path` itself is no link
    Path(root).mkdir(parents=True, exist_ok=True)
    path.mkdir()
    fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(pid)
    return path


def unsafe_prefix(prompt: dict, nodes: Any) -> str | None:
    """Why an output node's filename_prefix would leave the prompt's own folder `<output>/<prompt_id>/` (an absolute
    name, or one with '..'), naming the node and the fix; None when every prefix stays inside it."""
    for node, spec in prompt.items():
        cls = nodes.get(spec.get("class_type")) if isinstance(spec, dict) else None
        prefix = spec.get("inputs", {}).get("filename_prefix") if cls is not None else None
        if getattr(cls, "OUTPUT_NODE", False) and isinstance(prefix, str) and not safe_name(prefix.replace("\\", "/")):
            return (f"node {node} ({spec.get('class_type')}): filename_prefix {prefix[:80]!r} leads out of the "
                    "prompt's own output folder; give a relative name without '..'")
    return None


__all__ = ["MARKER", "MAX_PROMPT_ID", "BadId", "NotOurs", "check_prompt_id", "claim", "is_ours", "is_uuid",
           "prompt_folder", "prompt_id_problem", "taken_by_others", "unsafe_prefix"]
