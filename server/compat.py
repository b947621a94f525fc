"""The rest of ComfyUI's API that real clients and ComfyUI's front end call (registered by app.py beside routes.py):

    GET /features                 our feature flags (also the websocket's answer to the client's `feature_flags`)
    GET /models, /models/{folder} the model folders we read, and the files in one
    GET /jobs, /jobs/{job_id}     ComfyUI's unified job list (queue and history), under /api/jobs too
    POST /jobs/{job_id}/cancel, /jobs/cancel   cancel a pending job (it leaves the queue) or a running one
    POST /upload/mask             a mask's alpha applied to an image already in input/output/temp
    GET /view_metadata/{folder}   a model file's safetensors `__metadata__`

Settings and user files are in userdata.py, the front end's other routes in frontend.py and templates.py.
Nothing here writes outside the input, output and temp folders.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from ..nodes.images import ImageTooLarge, open_image
from . import formats
from .bodies import BadRequest, id_list, parse_json, read_object, sane_id
from .messages import QueueItem
from .routes import Routes, _inside, _json_error
from .security import save_upload

log = logging.getLogger("vramgraph.server")


class Compat:
    """ComfyUI's further routes (see the module doc) over the same engine, queue and worker as `routes`."""

    def __init__(self, routes: Routes) -> None:
        self.routes, self.engine, self.queue = routes, routes.engine, routes.queue

    def table(self) -> list[tuple[str, str, Callable]]:
        return [("GET", "/features", self.features), ("GET", "/models", self.models),
                ("GET", "/models/{folder}", self.models_in), ("GET", "/jobs", self.jobs),
                ("GET", "/jobs/{job_id}", self.job), ("POST", "/jobs/{job_id}/cancel", self.cancel_job),
                ("POST", "/jobs/cancel", self.cancel_jobs), ("POST", "/upload/mask", self.upload_mask),
                ("GET", "/view_metadata/{folder}", self.view_metadata)]

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
        """A model file's safetensors `__metadata__`: `{}` for a file without one (ComfyUI answers 404 there, which
        the Model Library of its front end asks for every model and shows as a failed request), 404 when the file is
        not there or not a safetensors file."""
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
        return web.json_response(meta) if meta is not None else web.Response(status=404)

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
        if (limit is not None and not (_digits(limit) and int(limit) > 0)) or not _digits(offset.removeprefix("-")):
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
            item = QueueItem.of(entry["prompt"])
            job = {**formats.finished_job(pid, entry), "outputs": entry["outputs"],
                   "execution_status": entry["status"], "workflow": {"prompt": item.prompt,
                                                                     "extra_data": item.extra_data}}
            return web.json_response(job, dumps=_dumps)
        running, pending = self.queue.current()
        for status, items in (("in_progress", running), ("pending", pending)):
            for item in items:
                if item.prompt_id == pid:
                    job = {**formats.queued_job(item, status), "workflow": {"prompt": item.prompt,
                                                                            "extra_data": item.extra_data}}
                    return web.json_response(job, dumps=_dumps)
        return web.json_response({"error": "Job not found"}, status=404)

    def _cancel(self, pid: str) -> str:
        """Cancel job `pid`: a pending one leaves the queue, a running one is interrupted (that prompt alone).
        "cancelled", "finished" (too late) or "not_found"."""
        if self.queue.delete(pid):
            self.routes.hub.send("status", {"status": self.routes.worker.status()})
            return "cancelled"
        if self.routes.worker.interrupt(pid):
            return "cancelled"
        return "finished" if pid in self.queue.get_history(pid) else "not_found"

    async def cancel_job(self, request: web.Request) -> web.Response:
        """The front end's POST /api/jobs/{id}/cancel (its queue panel's cancel)."""
        pid = sane_id(request.match_info["job_id"], "job_id")
        outcome = self._cancel(pid)
        if outcome == "not_found":
            return _json_error(404, "no such job", "not_found", details=f"{pid[:80]!r} is not queued, running or in "
                               "the history; GET /api/jobs lists them")
        if outcome == "finished":
            return _json_error(409, "the job has finished", "job_finished", details=f"{pid[:80]!r} ran to its end "
                               "before it could be cancelled")
        return web.json_response({"id": pid, "status": "cancelled"})

    async def cancel_jobs(self, request: web.Request) -> web.Response:
        """POST /api/jobs/cancel {"job_ids": [...]}: each cancelled as above; the answer says what became of each."""
        body = await read_object(request)
        ids = id_list(body.get("job_ids"), "job_ids")
        outcomes = {pid: self._cancel(pid) for pid in ids}
        return web.json_response({"cancelled": [p for p, o in outcomes.items() if o == "cancelled"],
                                  "finished": [p for p, o in outcomes.items() if o == "finished"],
                                  "not_found": [p for p, o in outcomes.items() if o == "not_found"]})

    # -- /upload/mask
    async def upload_mask(self, request: web.Request) -> web.Response:
        """ComfyUI's mask upload: the uploaded image's alpha becomes the alpha of the image `original_ref` names
        (a file in input, output or temp), saved as a new PNG where `type` and `subfolder` say (default input)."""
        try:
            post = await request.post()
        except web.HTTPException:
            raise
        except Exception as e:  # aiohttp's multipart parser on a malformed body: ValueError, AssertionError, ...
            return _json_error(400, "the body is not a readable form", details="send multipart/form-data with a PNG "
                               f"'image', and 'original_ref' ({type(e).__name__})")
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
        data = mask.file.read()
        overwrite = str(post.get("overwrite") or "") in ("true", "1") and kind != "output"  # outputs never replaced
        cap = self.engine.folders.max_image_pixels

        def save() -> Path:

            with open_image(original, cap, "the original image") as im, open_image(data, cap, "the mask") as m:
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
            buf = io.BytesIO()
            out.save(buf, format="PNG", compress_level=4, pnginfo=info)
            return save_upload(folder, name, buf.getvalue(), overwrite, reuse=False)

        try:
            path = await asyncio.get_running_loop().run_in_executor(None, save)
        except ImageTooLarge as e:
            return _json_error(400, "the image is too large", "image_too_large", details=str(e))
        except (OSError, ValueError, SyntaxError, EOFError, TypeError, KeyError, IndexError, ZeroDivisionError,
                MemoryError, struct.error) as e:  # not an image, or a hostile one (what PIL raises)
            return _json_error(400, f"cannot apply the mask: {type(e).__name__}: {e}"[:300])
        return web.json_response({"name": path.name, "subfolder": subfolder, "type": kind})


def _original(routes: Routes, raw: Any) -> Path | None:
    """The file a mask upload's `original_ref` names, or None when it is malformed or leaves its folder."""
    try:
        ref = parse_json(str(raw))
    except BadRequest:
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


def _digits(text: str) -> bool:
    """Whether `text` is a whole number written in ASCII digits (str.isdigit takes '²' too), of sane length."""
    return text.isascii() and text.isdigit() and len(text) < 16


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)


__all__ = ["Compat"]


def _served() -> dict[str, tuple[str, ...]]:
    """The model folders the server lists: the model components' and loras (nodes/lora.py)."""
    from ..nodes.files import MODEL_FOLDERS

    return {**MODEL_FOLDERS, "loras": ("loras",)}
