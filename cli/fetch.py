"""`vramgraph fetch`: download the model files a workflow needs and the models folder lacks.

    vramgraph fetch WORKFLOW.json|IMAGE.png ... [--model NAME ...] [--models DIR] [--dry-run]

What to fetch: the model files the workflow loads (its loader nodes' file inputs) that are not found where
`run` would look (nodes/modelpaths.py), each from the URL the workflow embeds (ComfyUI's `properties.models`)
or the built-in list (nodes/sources.py); `--model NAME` names a file of the built-in list. Where: the first
folder searched for the file's kind (an `is_default` folder of extra_model_paths.yaml, else the models
folder's `diffusion_models/`, `text_encoders/` or `vae/`, made if missing).

How: a Hugging Face Hub URL through `huggingface_hub` (the optional extra `vramgraph[fetch]`; $HF_ENDPOINT and
$HF_TOKEN are honoured), into a `.vramgraph-fetch/` folder beside the target, so an interrupted download resumes
on the next run, then moved into place; another URL over plain HTTP(S), into `NAME.part`, resumed with a Range
request. Either shows a progress bar. The SHA-256 is checked when known (the workflow's `hash`, or the Hub's
ETag of a large file, which is its SHA-256); a file that does not match is removed. A gated repository (the
FLUX.2 [klein] 9B files) is refused with what its page requires and the token variable to set.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..nodes.files import Folders, safe_name
from ..nodes.modelpaths import LEGACY
from ..nodes.sources import BUILTIN, TOKEN_PAGE, Source, builtin, needed_files, workflow_sources

log = logging.getLogger("vramgraph")
STAGING = ".vramgraph-fetch"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20


@dataclass(frozen=True)
class Wanted:
    """One file to fetch: its source and where it goes."""

    source: Source
    target: Path


def add_parser(sub: Any) -> argparse.ArgumentParser:
    f = sub.add_parser("fetch", help="download the model files a workflow (or PNG) needs and the models folder lacks")
    f.add_argument("workflow", nargs="*", help="workflow JSON or PNG: fetch the model files it loads that are missing")
    f.add_argument("--model", action="append", default=[], metavar="NAME",
                   help="a file of the built-in list (repeatable): " + ", ".join(s.name for s in BUILTIN))
    f.add_argument("--dry-run", action="store_true", help="list what would be fetched, where, and how big")
    f.add_argument("--models", action="append", default=None, help="the models folder to fetch into (repeatable)")
    f.add_argument("--extra-model-paths-config", dest="extra_model_paths", action="extend", nargs="+", default=[],
                   metavar="YAML", help="ComfyUI's extra_model_paths.yaml (its is_default folders come first)")
    f.add_argument("--config", default=None, help="JSON config with models")
    f.add_argument("--json", action="store_true", help="errors as JSON")
    return f


# ------------------------------------------------------------------------------------------ what

def _clean_folder(directory: str, what: str) -> str:
    folder = LEGACY.get(directory.strip("/"), directory.strip("/"))
    if not folder or not safe_name(folder) or "/" in folder:
        raise ValueError(f"{what}: the folder '{directory}' is not a models subfolder name")
    return folder


def sources_of(workflow: str | Path) -> list[Source]:
    """The model files `workflow` (JSON or PNG) loads, each with its source: the one it embeds, else the built-in
    one. A file with neither is refused naming it."""
    from ..api.pipeline import load
    from ..nodes import ENGINE_NODES

    wf = load(workflow)  # a file, or a shipped workflow's name
    embedded = workflow_sources(wf.ui)
    out, unknown = [], []
    for folder, name in needed_files(wf.prompt, ENGINE_NODES):
        found = embedded.get(name) or builtin(name)
        if found is None:
            unknown.append(f"{name} ({folder}/)")
        else:
            out.append(found if found.name == name else Source(name, folder, found.url, found.sha256, found.size,
                                                               found.gated))
    if unknown:
        raise ValueError(f"{workflow}: no download address for {', '.join(unknown)}: the workflow embeds none "
                         "(ComfyUI's properties.models) and vramgraph knows none; put the file(s) in the models "
                         "folder yourself")
    return out


def wanted(folders: Folders, sources: list[Source]) -> tuple[list[Wanted], list[Path]]:
    """The sources not found under `folders`, with their targets, and the paths of those already there."""
    todo, present = [], []
    for s in dict((s.name, s) for s in sources).values():
        folder = _clean_folder(s.folder, s.name)
        if not safe_name(s.name):
            raise ValueError(f"'{s.name}': not a file name a models folder can hold")
        try:
            present.append(folders.resolve(folder, s.name))
        except FileNotFoundError:
            todo.append(Wanted(s, folders.download_dir(folder) / s.name))
    return todo, present


# ------------------------------------------------------------------------------------------ how

def _hub_api() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError("fetching from the Hugging Face Hub needs huggingface_hub: pip install 'vramgraph[fetch]' "
                         "(or pip install huggingface_hub)") from None
    return huggingface_hub


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None  # read per call: the library reads it once, at its import


def _gated(s: Source, error: Exception) -> ValueError:
    hub = s.hub
    page = hub.page if hub else s.url
    license_ = f" ({s.gated})" if s.gated else ""
    token = "the token in $HF_TOKEN has no access yet; " if os.environ.get("HF_TOKEN") else ""
    return ValueError(f"{s.name}: the repository is gated{license_}: {token}open {page}, log in and accept its "
                      f"license, then make a read token at {TOKEN_PAGE} and set HF_TOKEN=<token> "
                      f"(or run `hf auth login`) and fetch again")


def remote_size(s: Source) -> int | None:
    """The file's size as its server says (a HEAD request), else the built-in size, else None."""
    hub = s.hub
    try:
        if hub is not None:
            api = _hub_api()
            url = api.hf_hub_url(hub.repo, hub.path, revision=hub.revision, endpoint=_endpoint())
            return api.get_hf_file_metadata(url, endpoint=_endpoint()).size or s.size
        with urllib.request.urlopen(urllib.request.Request(s.url, method="HEAD"), timeout=10) as r:
            length = r.headers.get("Content-Length")
            return int(length) if length else s.size
    except Exception as e:  # offline, gated, ...: the dry run says what it knows
        log.debug("size of %s: %s", s.url, e)
        return s.size


def _hub_download(w: Wanted) -> str | None:
    """Download a Hub file to `w.target` (resumable in its staging folder); returns the SHA-256 the Hub gives."""
    api = _hub_api()
    from huggingface_hub import errors

    hub = w.source.hub
    staging = w.target.parent / STAGING
    try:
        url = api.hf_hub_url(hub.repo, hub.path, revision=hub.revision, endpoint=_endpoint())
        etag = api.get_hf_file_metadata(url, endpoint=_endpoint()).etag
        got = api.hf_hub_download(hub.repo, hub.path, revision=hub.revision, local_dir=staging,
                                  endpoint=_endpoint())
    except errors.GatedRepoError as e:
        raise _gated(w.source, e) from None
    except errors.RepositoryNotFoundError as e:
        hint = " (a private or gated repository: set HF_TOKEN)" if not os.environ.get("HF_TOKEN") else ""
        raise ValueError(f"{w.source.name}: the repository {hub.repo} was not found{hint} ({_short(e)})") from None
    except (errors.EntryNotFoundError, errors.RevisionNotFoundError) as e:
        raise ValueError(f"{w.source.name}: {hub.path} is not in {hub.repo} at {hub.revision} ({_short(e)})") \
            from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise ValueError(f"{w.source.name}: download from {url} failed ({_short(e)}); run fetch again to "
                         "resume") from None
    os.replace(got, w.target)
    shutil.rmtree(staging, ignore_errors=True)
    return etag if etag and SHA256.match(etag) else None


def _http_download(w: Wanted) -> None:
    """Download a plain URL to `w.target` through `NAME.part`, resuming a part left by an earlier run."""
    from tqdm import tqdm

    part = w.target.with_name(w.target.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    request = urllib.request.Request(w.source.url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            if have and r.status != 206:  # the server ignored the range: start over
                have = 0
            total = r.headers.get("Content-Length")
            total = int(total) + have if total else None
            with part.open("ab" if have else "wb") as f, tqdm(total=total, initial=have, unit="B", unit_scale=True,
                                                            unit_divisor=1024, desc=w.source.name) as bar:
                for chunk in iter(lambda: r.read(CHUNK), b""):
                    f.write(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as e:
        raise ValueError(f"{w.source.name}: {w.source.url} answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"{w.source.name}: download from {w.source.url} failed ({_short(e)}); run fetch again "
                         "to resume") from None
    if total is not None and part.stat().st_size != total:
        raise ValueError(f"{w.source.name}: got {part.stat().st_size} of {total} bytes; run fetch again to resume")
    os.replace(part, w.target)


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def download(w: Wanted) -> Path:
    """Fetch one file into place, its checksum checked when known; nothing is left at the target on failure."""
    w.target.parent.mkdir(parents=True, exist_ok=True)
    hub_sha = _hub_download(w) if w.source.hub is not None else _http_download(w)
    expected = (w.source.sha256 or hub_sha or "").lower()
    if expected:
        got = sha256_of(w.target)
        if got != expected:
            w.target.unlink()
            raise ValueError(f"{w.source.name}: SHA-256 {got} is not the expected {expected}; the download was "
                             "removed, fetch again")
        log.info("%s: SHA-256 checked", w.source.name)
    return w.target


# ------------------------------------------------------------------------------------------ command

def _size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def run_fetch(args: argparse.Namespace, folders: Folders) -> int:
    sources: list[Source] = []
    for name in args.model:
        known = builtin(name)
        if known is None:
            import difflib

            close = difflib.get_close_matches(name, [s.name for s in BUILTIN], n=1)
            raise ValueError(f"--model {name}: not in the built-in list" +
                             (f"; did you mean '{close[0]}'?" if close else
                              f" ({', '.join(s.name for s in BUILTIN)})"))
        sources.append(known)
    for w in args.workflow:
        sources += sources_of(w)
    if not sources:
        raise ValueError("name what to fetch: a workflow (JSON or PNG), or --model NAME")
    todo, present = wanted(folders, sources)
    for p in present:
        log.info("present: %s", p)
    if not todo:
        log.info("nothing to fetch")
        return 0
    if args.dry_run:
        for w in todo:
            gated = f"  [gated: {w.source.gated}; needs HF_TOKEN]" if w.source.gated else ""
            print(f"{w.source.name}  {_size(remote_size(w.source))}  -> {w.target}  from {w.source.url}{gated}")
        return 0
    failed = []
    for w in todo:
        log.info("fetching %s -> %s", w.source.url, w.target)
        try:
            print(download(w))
        except ValueError as e:
            log.error("%s", e)
            failed.append(str(e))
    if failed:
        raise ValueError(failed[0] if len(failed) == 1 else f"{len(failed)} files not fetched: " + " | ".join(failed))
    return 0
