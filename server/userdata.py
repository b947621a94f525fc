"""Settings and user files kept under `--user-dir`, as ComfyUI's `app/user_manager.py` and `app_settings.py` keep them.

    GET  /settings, /settings/{id}          the settings (`<user_dir>/default/comfy.settings.json`)
    POST /settings (an object: merged), /settings/{id} (any JSON value)
    GET  /userdata?dir=&recurse=&full_info=&split=, /v2/userdata?path=   the files of a folder
    GET  /userdata/{file}                   a file, as a download (user.css inline, as CSS)
    POST /userdata/{file}?overwrite=&full_info=   the body written to the file (409 when overwrite=false and it exists)
    DELETE /userdata/{file}, POST /userdata/{file}/move/{dest}?overwrite=&full_info=
    GET  /users, POST /users                one user, "default" (ComfyUI without --multi-user)

`{file}` is a path inside the user's folder, '/'-separated or URL-encoded (`workflows%2Fa.json`). Every write is
confined to that folder and checked as uploads are: no absolute path, no `..`, no backslash, drive or control
character, no component longer than 255 characters; no symbolic link on the way (a link inside the folder could
point anywhere) nor as the target; at most MAX_FILE_BYTES per body; a `.json` file or a setting must be valid JSON
(strict: no NaN). Files are written to a temporary file beside the target and renamed over it, so a reader never
sees half a file and a failed write leaves the old one. Refusals are 4xx in ComfyUI's error shape.

Three names answer even when absent, so that the front end's start asks for nothing that fails: `user.css` (empty
CSS), `comfy.templates.json` (no saved templates, `[]`) and `workflows/.index.json` (no bookmarked workflows). The
folders `workflows` and `subgraphs` are made on start.
Without a user folder (make_app's user_dir None) settings are `{}`, there are no files and every write is refused
405, naming the option that keeps them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from .bodies import BadRequest, json_error, parse_json

log = logging.getLogger("vramgraph.server")
USER = "default"  # ComfyUI's single user when it runs without --multi-user
SETTINGS_FILE = "comfy.settings.json"
MAX_FILE_BYTES = 32 * 2**20  # one user file or settings body (a large UI workflow with subgraphs is a few MiB)
MAX_PATH = 1024
DEFAULTS = {"user.css": ("text/css", b""), "comfy.templates.json": ("application/json", b"[]"),
            "workflows/.index.json": ("application/json", b'{"favorites": []}')}
FOLDERS = ("workflows", "subgraphs")
READ_ONLY = ("this server keeps no user data: start it with --user-dir DIR (or the config key user_dir) to keep "
             "settings and saved workflows under DIR")


class ReadOnly(BadRequest):
    """A write to a server started without a user folder (405, Allow: GET)."""

    def __init__(self) -> None:
        super().__init__(READ_ONLY, "settings and user files are read-only here: nothing is kept without a user "
                         "folder", "read_only", status=405)

    def response(self) -> web.Response:
        response = json_error(self.status, self.message, self.type, details=self.details)
        response.headers["Allow"] = "GET"
        return response


class UserPathError(BadRequest):
    """A user file path that leaves the user folder or is not a plain path there (403)."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message, details, "forbidden", status=403)


def clean_relative(raw: str) -> str:
    """`raw` (URL-decoded when it holds %) as a '/'-separated path inside the user folder; UserPathError else."""
    name = urllib.parse.unquote(raw) if "%" in raw else raw
    why = None
    if not name or len(name) > MAX_PATH:
        why = f"a path of 1 to {MAX_PATH} characters"
    elif not name.isprintable() or "\\" in name or ":" in name.split("/", 1)[0]:
        why = "no control characters, backslashes or drive letters"
    elif name.startswith("/"):
        why = "a relative path, not an absolute one"
    else:
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            why = "no '..', '.' or empty components"
        elif any(len(p) > 255 for p in parts):
            why = "components of at most 255 characters"
    if why:
        raise UserPathError("that path is not allowed in the user folder", f"{name[:200]!r}: give {why}, e.g. "
                            "workflows/my_workflow.json")
    return name


class UserData:
    """The routes of the module doc over `user_dir` (None: read-only, nothing kept)."""

    def __init__(self, user_dir: Path | None) -> None:
        self.root = None if user_dir is None else Path(user_dir) / USER

    def table(self) -> list[tuple[str, str, Callable]]:
        return [("GET", "/settings", self.settings), ("GET", "/settings/{id}", self.setting),
                ("POST", "/settings", self.post_settings), ("POST", "/settings/{id}", self.post_setting),
                ("GET", "/userdata", self.listing), ("GET", "/v2/userdata", self.listing_v2),
                ("GET", "/userdata/{file}", self.get_file), ("POST", "/userdata/{file}", self.post_file),
                ("DELETE", "/userdata/{file}", self.delete_file),
                ("POST", "/userdata/{file}/move/{dest}", self.move_file),
                ("GET", "/users", self.users), ("POST", "/users", self.post_users)]

    def prepare(self) -> None:
        """Make the user folder and the folders the front end lists at its start (with a user folder)."""
        if self.root is not None:
            for name in FOLDERS:
                (self.root / name).mkdir(parents=True, exist_ok=True)

    # -- paths
    def _root(self) -> Path:
        if self.root is None:
            raise ReadOnly()
        return self.root

    def _read_path(self, raw: str) -> Path:
        """The user file `raw` names for reading: inside the folder once links are followed."""
        root = self._root().resolve()
        path = (root / clean_relative(raw)).resolve()
        if not path.is_relative_to(root):
            raise UserPathError("that path leads out of the user folder", f"{raw[:200]!r} leads through a link "
                                "outside it")
        return path

    def _write_path(self, raw: str) -> Path:
        """The user file `raw` names for writing: no link on the way from the folder to it, nor the file itself."""
        root = self._root()
        rel = clean_relative(raw)
        path = root
        for part in rel.split("/"):
            path = path / part
            if path.is_symlink():
                raise UserPathError("that path goes through a symbolic link", f"{rel[:200]!r}: "
                                    f"{path.relative_to(root).as_posix()} is a link; files are written only to plain "
                                    "folders inside the user folder")
        return path

    # -- settings
    def _settings(self) -> dict:
        path = None if self.root is None else self.root / SETTINGS_FILE
        if path is None or not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("the user settings file %s is not JSON; answering none", path)
            return {}
        return data if isinstance(data, dict) else {}

    async def settings(self, request: web.Request) -> web.Response:
        return web.json_response(self._settings())

    async def setting(self, request: web.Request) -> web.Response:
        return web.json_response(self._settings().get(request.match_info["id"]))

    async def post_settings(self, request: web.Request) -> web.Response:
        self._root()
        body = parse_json(await read_capped(request))
        if not isinstance(body, dict):
            raise BadRequest("the settings must be a JSON object", 'send {"Setting.Id": value, ...}')
        self._save_settings({**self._settings(), **body})
        return web.Response(status=200)

    async def post_setting(self, request: web.Request) -> web.Response:
        self._root()
        sid = request.match_info["id"]
        if not sid.isprintable() or len(sid) > 256:
            raise BadRequest("bad setting id", "a setting id is 1 to 256 printable characters, e.g. Comfy.Locale")
        value = parse_json(await read_capped(request))
        self._save_settings({**self._settings(), sid: value})
        return web.Response(status=200)

    def _save_settings(self, settings: dict) -> None:
        data = json.dumps(settings, indent=4, allow_nan=False).encode()
        if len(data) > MAX_FILE_BYTES:  # read at call time: tests lower it
            raise BadRequest("the settings are too large", f"at most {MAX_FILE_BYTES // 2**20} MiB in all",
                             status=413)
        write_atomic(self._write_path(SETTINGS_FILE), data)

    # -- listings
    async def listing(self, request: web.Request) -> web.Response:
        """ComfyUI's GET /userdata?dir=...&recurse=&full_info=&split=."""
        q = request.rel_url.query
        if not q.get("dir"):
            return web.Response(status=400, text="Directory not provided")
        if self.root is None:
            return web.Response(status=404, text="Directory not found")
        try:
            path = self._read_path(q["dir"])
        except UserPathError:
            return web.Response(status=403, text="Invalid directory")
        if not path.is_dir():
            return web.Response(status=404, text="Directory not found")
        recurse, full, split = (q.get(k, "").lower() == "true" for k in ("recurse", "full_info", "split"))
        return web.json_response(await asyncio.get_running_loop().run_in_executor(
            None, _list, path, self.root.resolve(), recurse, full, split))

    async def listing_v2(self, request: web.Request) -> web.Response:
        """ComfyUI's GET /v2/userdata?path=: files and folders below a folder, folders first, by name."""
        raw = request.rel_url.query.get("path", "")
        if self.root is None:
            return web.json_response([])
        base = self.root.resolve()
        try:
            path = self._read_path(raw) if raw else base
        except UserPathError:
            return web.Response(status=400, text="Invalid path requested")
        if not path.exists():
            return web.json_response([]) if path == base else web.Response(status=404, text="Requested path not found")
        if not path.is_dir():
            return web.Response(status=400, text="Requested path is not a directory")
        out: list[dict] = []
        for p in sorted(path.rglob("*")):
            if p.is_symlink() or not p.resolve().is_relative_to(base):
                continue
            entry: dict[str, Any] = {"name": p.name, "path": p.relative_to(base).as_posix(),
                                     "type": "directory" if p.is_dir() else "file"}
            if p.is_file():
                st = p.stat()
                entry.update(size=st.st_size, modified=st.st_mtime)
            out.append(entry)
        out.sort(key=lambda e: (e["type"] != "directory", e["name"].lower()))
        return web.json_response(out)

    # -- files
    async def get_file(self, request: web.Request) -> web.StreamResponse:
        raw = request.match_info["file"]
        if self.root is None:
            return _default(clean_relative(raw)) or web.Response(status=404)
        path = self._read_path(raw)
        if not path.is_file():
            return _default(clean_relative(raw)) or web.Response(status=404)
        css = path == (self.root.resolve() / "user.css")
        return web.FileResponse(path, headers={
            "X-Content-Type-Options": "nosniff", "Content-Type": "text/css" if css else "application/octet-stream",
            "Content-Disposition": "inline" if css else f'attachment; filename="{_ascii(path.name)}"'})

    async def post_file(self, request: web.Request) -> web.Response:
        path = self._write_path(request.match_info["file"])
        q = request.rel_url.query
        if q.get("overwrite", "true") == "false" and (path.exists() or path.is_symlink()):
            return web.Response(status=409, text="File already exists")
        if path.is_dir():
            raise BadRequest("that path is a folder", f"{request.match_info['file'][:200]!r} is a folder of the "
                             "user folder; give a file name", status=409)
        data = await read_capped(request)
        if path.suffix.lower() == ".json":
            parse_json(data)  # a .json user file must be JSON: the front end parses what it reads back
        await asyncio.get_running_loop().run_in_executor(None, write_atomic, path, data)
        return web.json_response(self._info(path, q.get("full_info", "").lower() == "true"))

    async def delete_file(self, request: web.Request) -> web.Response:
        path = self._write_path(request.match_info["file"])
        if not path.is_file():
            return web.Response(status=404)
        path.unlink()
        return web.Response(status=204)

    async def move_file(self, request: web.Request) -> web.Response:
        source, dest = self._write_path(request.match_info["file"]), self._write_path(request.match_info["dest"])
        if not source.is_file():
            return web.Response(status=404)
        q = request.rel_url.query
        if q.get("overwrite", "true") == "false" and (dest.exists() or dest.is_symlink()):
            return web.Response(status=409, text="File already exists")
        if dest.is_dir():
            raise BadRequest("the destination is a folder", "give a file name as the destination", status=409)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, dest)
        return web.json_response(self._info(dest, q.get("full_info", "").lower() == "true"))

    def _info(self, path: Path, full: bool) -> Any:
        rel = path.relative_to(self._root()).as_posix()
        if not full:
            return rel
        st = path.stat()
        return {"path": rel, "size": st.st_size, "modified": int(st.st_mtime * 1000),
                "created": int(st.st_ctime * 1000)}

    # -- users
    async def users(self, request: web.Request) -> web.Response:
        return web.json_response({"storage": "server", "migrated": self.root is not None and self.root.is_dir()})

    async def post_users(self, request: web.Request) -> web.Response:
        self._root()
        return web.json_response({"error": "this server has one user, 'default' (ComfyUI's --multi-user is not "
                                           "supported)"}, status=400)


async def read_capped(request: web.Request, cap: int | None = None) -> bytes:
    """The request's body, refused 413 beyond `cap` bytes (default MAX_FILE_BYTES; before reading it when its length
    is announced)."""
    cap = MAX_FILE_BYTES if cap is None else cap
    too_big = BadRequest("the body is too large", f"user files and settings are at most {cap // 2**20} MiB",
                         "too_large", status=413)
    if request.content_length is not None and request.content_length > cap:
        raise too_big
    chunks, size = [], 0
    while True:
        chunk = await request.content.read(2**16)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > cap:
            raise too_big
        chunks.append(chunk)


def write_atomic(path: Path, data: bytes) -> None:
    """`data` to `path` through a temporary file beside it renamed over it: all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".vramgraph-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _list(path: Path, base: Path, recurse: bool, full: bool, split: bool) -> list[Any]:
    out: list[Any] = []
    for f in sorted(path.rglob("*") if recurse else path.glob("*")):
        if not f.is_file() or f.name.startswith(".vramgraph-") or not f.resolve().is_relative_to(base):
            continue  # links leading out are not listed, nor our temporary files
        rel = f.relative_to(path).as_posix()
        if full:
            st = f.stat()
            out.append({"path": rel, "size": st.st_size, "modified": int(st.st_mtime * 1000),
                        "created": int(st.st_ctime * 1000)})
        else:
            out.append([rel, *rel.split("/")] if split else rel)
    return out


def _default(name: str) -> web.Response | None:
    found = DEFAULTS.get(name)
    if found is None:
        return None
    kind, body = found
    return web.Response(body=body, content_type=kind, headers={"X-Content-Type-Options": "nosniff"})


def _ascii(name: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in name)


__all__ = ["MAX_FILE_BYTES", "UserData", "UserPathError", "clean_relative", "read_capped", "write_atomic"]
