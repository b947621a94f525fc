"""The rest of ComfyUI's API that real clients and ComfyUI's front end call (registered by app.py beside routes.py):

    GET /features                 our feature flags (also the websocket's answer to the client's `feature_flags`)
    GET /models, /models/{folder} the model folders we read, and the files in one
    GET /jobs, /jobs/{job_id}     ComfyUI's unified job list (queue and history), under /api/jobs too
    POST /upload/mask             a mask's alpha applied to an image already in input/output/temp
    GET /view_metadata/{folder}   a model file's safetensors `__metadata__`
    GET /settings, /settings/{id}, /userdata, /userdata/{file}, /users   read-only, see below

User data is read-only: with `user_dir` (make_app's argument) the settings and files come from ComfyUI's layout
under it (`<user_dir>/default/comfy.settings.json`, `<user_dir>/default/workflows/...`); without one there are
no settings (`{}`) and no files (404). Every write (POST /settings, POST/DELETE /userdata/..., POST /users) is
refused with 405 and ComfyUI's error shape, naming what to do instead. Nothing here writes outside the
input, output and temp folders.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from . import formats
from .routes import Routes, _inside, _json_error

log = logging.getLogger("vramgraph.server")
USER = "default"  # ComfyUI's single user when it runs without --multi-user
SETTINGS_FILE = "comfy.settings.json"
READ_ONLY = ("this server keeps no user data: settings and user files are read-only here; keep them in the "
             "browser, or run ComfyUI itself to store them")


class Compat:
    """ComfyUI's further routes (see the module doc) over the same engine, queue and worker as `routes`."""

    def __init__(self, routes: Routes, user_dir: Path | None = None) -> None:
        self.routes, self.engine, self.queue = routes, routes.engine, routes.queue
        self.user = None if user_dir is None else Path(user_dir) / USER

    def table(self) -> list[tuple[str, str, Callable]]:
        return [("GET", "/features", self.features), ("GET", "/models", self.models),
                ("GET", "/models/{folder}", self.models_in), ("GET", "/jobs", self.jobs),
                ("GET", "/jobs/{job_id}", self.job), ("POST", "/upload/mask", self.upload_mask),
                ("GET", "/view_metadata/{folder}", self.view_metadata),
                ("GET", "/settings", self.settings), ("GET", "/settings/{id}", self.setting),
                ("POST", "/settings", self.read_only), ("POST", "/settings/{id}", self.read_only),
                ("GET", "/userdata", self.userdata), ("GET", "/userdata/{file}", self.userdata_file),
                ("POST", "/userdata/{file}", self.read_only), ("DELETE", "/userdata/{file}", self.read_only),
                ("POST", "/userdata/{file}/move/{dest}", self.read_only),
                ("GET", "/users", self.users), ("POST", "/users", self.read_only)]

    # -- /features, /models, /view_metadata
    async def features(self, request: web.Request) -> web.Response:
        return web.json_response(formats.features(formats.MAX_UPLOAD_SIZE))

    def _model_folders(self) -> dict[str, str]:
        """Every model folder name we answer to (ComfyUI's and its old names) -> ComfyUI's name."""
        return {alias: name for name, aliases in _served().items() for alias in (name, *aliases)}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(list(_served()))

    async def models_in(self, request: web.Request) -> web.Response:
        folder = self._model_folders().get(request.match_info["folder"])
        if folder is None:
            return web.Response(status=404)
        files = await asyncio.get_running_loop().run_in_executor(None, self.engine.folders.list, folder)
        return web.json_response(files)

    async def view_metadata(self, request: web.Request) -> web.Response:
        """A model file's safetensors `__metadata__` (404 when the file, or its metadata, is not there)."""
        from ..models.headers import CheckpointError, read_header

        folder = self._model_folders().get(request.match_info["folder"])
        name = request.rel_url.query.get("filename", "")
        if folder is None or not name.endswith(".safetensors") or "\0" in name:
            return web.Response(status=404)

        def metadata() -> dict | None:
            try:
                return read_header(self.engine.folders.resolve(folder, name))[1]
            except (FileNotFoundError, CheckpointError, OSError, ValueError):
                return None

        meta = await asyncio.get_running_loop().run_in_executor(None, metadata)
        return web.json_response(meta) if meta else web.Response(status=404)

    # -- /jobs
    async def jobs(self, request: web.Request) -> web.Response:
        """ComfyUI's GET /api/jobs: status filter, workflow_id, sort_by, sort_order, limit, offset."""
        q = request.rel_url.query
        wanted = [s.strip().lower() for s in q.get("status", "").split(",") if s.strip()] or list(formats.JOB_STATUSES)
        bad = [s for s in wanted if s not in formats.JOB_STATUSES]
        if bad:
            return web.json_response({"error": f"Invalid status value(s): {', '.join(bad)}. Valid values: "
                                               f"{', '.join(formats.JOB_STATUSES)}"}, status=400)
        sort_by, order = q.get("sort_by", "created_at").lower(), q.get("sort_order", "desc").lower()
        if sort_by not in ("created_at", "execution_duration"):
            return web.json_response({"error": "sort_by must be 'created_at' or 'execution_duration'"}, status=400)
        if order not in ("asc", "desc"):
            return web.json_response({"error": "sort_order must be 'asc' or 'desc'"}, status=400)
        limit, offset = q.get("limit"), q.get("offset", "0")
        if (limit is not None and not (limit.isdigit() and int(limit) > 0)) or not offset.lstrip("-").isdigit():
            return web.json_response({"error": "limit must be a positive integer and offset an integer"}, status=400)
        running, pending = self.queue.current()
        jobs = [*(formats.queued_job(i, "in_progress") for i in running if "in_progress" in wanted),
                *(formats.queued_job(i, "pending") for i in pending if "pending" in wanted)]
        jobs += [j for j in (formats.finished_job(pid, e) for pid, e in self.queue.get_history().items())
                 if j["status"] in wanted]
        if q.get("workflow_id"):
            jobs = [j for j in jobs if j.get("workflow_id") == q["workflow_id"]]

        def key(j: dict) -> float:
            if sort_by == "execution_duration":
                return (j.get("execution_end_time") or 0) - (j.get("execution_start_time") or 0)
            return j.get("create_time") or 0

        jobs.sort(key=key, reverse=order == "desc")
        start = max(int(offset), 0)
        page = jobs[start:start + int(limit)] if limit is not None else jobs[start:]
        return web.json_response({"jobs": page, "pagination": {
            "offset": start, "limit": int(limit) if limit is not None else None, "total": len(jobs),
            "has_more": start + len(page) < len(jobs)}}, dumps=_dumps)

    async def job(self, request: web.Request) -> web.Response:
        pid = request.match_info["job_id"]
        entry = self.queue.get_history(pid).get(pid)
        if entry is not None:
            job = {**formats.finished_job(pid, entry), "outputs": entry["outputs"],
                   "execution_status": entry["status"], "workflow": {"prompt": entry["prompt"][2],
                                                                     "extra_data": entry["prompt"][3]}}
            return web.json_response(job, dumps=_dumps)
        running, pending = self.queue.current()
        for status, items in (("in_progress", running), ("pending", pending)):
            for item in items:
                if item[1] == pid:
                    job = {**formats.queued_job(item, status), "workflow": {"prompt": item[2], "extra_data": item[3]}}
                    return web.json_response(job, dumps=_dumps)
        return web.json_response({"error": "Job not found"}, status=404)

    # -- /upload/mask
    async def upload_mask(self, request: web.Request) -> web.Response:
        """ComfyUI's mask upload: the uploaded image's alpha becomes the alpha of the image `original_ref` names
        (a file in input, output or temp), saved as a new PNG where `type` and `subfolder` say (default input)."""
        post = await request.post()
        mask, kind = post.get("image"), str(post.get("type") or "input")
        name = getattr(mask, "filename", None)
        root = self.routes.folder(kind)
        if root is None or not name or Path(name).name != name or name in (".", "..") or "\0" in name \
                or not name.lower().endswith(".png"):
            return _json_error(400, "send a PNG file named <name>.png as `image`, with type input, output or temp")
        subfolder = str(post.get("subfolder") or "")
        folder = _inside(root, subfolder)
        original = _original(self.routes, post.get("original_ref"))
        if folder is None or original is None:
            return _json_error(400, "original_ref must be JSON naming an image in input, output or temp: "
                                    '{"filename", "subfolder", "type"}; subfolder and type must stay inside them')
        if not original.is_file():
            return _json_error(404, f"original_ref names no file: {original.name}")
        data, overwrite = mask.file.read(), str(post.get("overwrite") or "") in ("true", "1")

        def save() -> Path:
            from PIL import Image

            with Image.open(original) as im, Image.open(io.BytesIO(data)) as m:
                if im.size != m.size:
                    raise ValueError(f"the mask is {m.size[0]}x{m.size[1]}, the image {im.size[0]}x{im.size[1]}")
                text = dict(getattr(im, "text", {}) or {})
                out = im.convert("RGBA")
                out.putalpha(m.convert("RGBA").getchannel("A"))
            from PIL.PngImagePlugin import PngInfo

            info = PngInfo()
            for k, v in text.items():
                info.add_text(k, v)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            stem, suffix = os.path.splitext(name)
            for i in itertools.count(1):
                if overwrite or not path.exists():
                    break
                path = folder / f"{stem} ({i}){suffix}"
            buf = io.BytesIO()
            out.save(buf, format="PNG", compress_level=4, pnginfo=info)
            part = path.with_name(path.name + ".part")
            part.write_bytes(buf.getvalue())
            part.replace(path)
            return path

        try:
            path = await asyncio.get_running_loop().run_in_executor(None, save)
        except (OSError, ValueError, SyntaxError) as e:  # not an image (PIL's UnidentifiedImageError is an OSError)
            return _json_error(400, f"cannot apply the mask: {e}")
        return web.json_response({"name": path.name, "subfolder": subfolder, "type": kind})

    # -- settings, user data (read-only)
    def _settings(self) -> dict:
        path = None if self.user is None else self.user / SETTINGS_FILE
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

    async def read_only(self, request: web.Request) -> web.Response:
        response = _json_error(405, READ_ONLY, "read_only", route=request.path)
        response.headers["Allow"] = "GET"
        return response

    async def users(self, request: web.Request) -> web.Response:
        return web.json_response({"storage": "server", "migrated": True})

    async def userdata(self, request: web.Request) -> web.Response:
        """ComfyUI's GET /userdata?dir=...&recurse=&full_info=&split=: the files of a user folder."""
        q = request.rel_url.query
        directory = q.get("dir", "")
        if not directory:
            return web.Response(status=400, text="Directory not provided")
        path = None if self.user is None else _inside(self.user, directory)
        if self.user is not None and path is None:
            return web.Response(status=403, text="Invalid directory")
        if path is None or not path.is_dir():
            return web.Response(status=404, text="Directory not found")
        recurse, full, split = (q.get(k, "").lower() == "true" for k in ("recurse", "full_info", "split"))
        base = self.user.resolve()
        out: list[Any] = []
        for f in sorted(path.rglob("*") if recurse else path.glob("*")):
            real = f.resolve()
            if not f.is_file() or not real.is_relative_to(base):  # links leading out are not listed
                continue
            rel = f.relative_to(path).as_posix()
            if full:
                st = f.stat()
                out.append({"path": rel, "size": st.st_size, "modified": st.st_mtime, "created": st.st_ctime})
            else:
                out.append([rel, *rel.split("/")] if split else rel)
        return web.json_response(out)

    async def userdata_file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["file"]
        path = None if self.user is None or "\0" in name else _inside(self.user, name)
        if self.user is not None and path is None:
            return web.Response(status=403)
        if path is None or not path.is_file():
            return web.Response(status=404)
        return web.FileResponse(path, headers={"X-Content-Type-Options": "nosniff",
                                               "Content-Disposition": f'attachment; filename="{path.name}"'})


def _original(routes: Routes, raw: Any) -> Path | None:
    """The file a mask upload's `original_ref` names, or None when it is malformed or leaves its folder."""
    try:
        ref = json.loads(str(raw))
    except ValueError:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("filename"), str):
        return None
    name, sub, kind = ref["filename"], ref.get("subfolder") or "", ref.get("type") or "output"
    for folder in ("input", "output", "temp"):  # ComfyUI's annotated names: "x.png [input]"
        if name.endswith(f" [{folder}]"):
            name, kind = name[:-len(folder) - 3], folder
    if not isinstance(sub, str) or not isinstance(kind, str) or not name or Path(name).name != name \
            or name in (".", "..") or "\0" in name + sub:
        return None
    root = routes.folder(kind)
    return None if root is None else _inside(root, sub, name)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)


__all__ = ["Compat"]


def _served() -> dict[str, tuple[str, ...]]:
    """The model folders the server lists: the model components' and loras (nodes/lora.py)."""
    from ..nodes.files import MODEL_FOLDERS

    return {**MODEL_FOLDERS, "loras": ("loras",)}
