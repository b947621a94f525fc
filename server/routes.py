"""The server's request handlers: ComfyUI's routes and ours (see app.py for the list), over one engine."""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from ..nodes.images import ImageTooLarge, open_image
from . import formats
from .bodies import BadRequest, id_list, json_error, prompt_request, read_json, read_object, sane_id
from .hub import MAX_INCOMING, Hub, dumps, without_paths
from .messages import QueueItem, executing
from .queue import PromptQueue, Worker
from .security import save_upload, uploaded_image_format, view_headers

log = logging.getLogger("vramgraph.server")
ROOT = Path(__file__).parent.parent

# ------------------------------------------------------------------------------------------------ routes


_json_error = json_error
_body = read_json  # the JSON body, parsed strictly (bodies.py): a body that is not JSON is refused 400
PREVIEW_QUALITY = range(1, 101)


def _inside(root: Path, *parts: str) -> Path | None:
    """root/parts resolved, or None if that leaves root (.., absolute parts, links pointing out, NUL bytes)."""
    if any("\0" in p for p in parts):
        return None
    base = root.resolve()
    try:
        path = base.joinpath(*parts).resolve()
    except (OSError, ValueError):  # a name too long, a loop of links
        return None
    return path if path == base or path.is_relative_to(base) else None


def _preview(path: Path, fmt: str, quality: int, max_pixels: int) -> bytes | None:
    """The image at `path` re-encoded as webp or jpeg (in a worker thread), or None when it is not an image (or one
    of more than `max_pixels` pixels, refused before decoding)."""
    from PIL import Image

    buf = io.BytesIO()
    try:
        with open_image(path, max_pixels) as im:
            (im.convert("RGB") if fmt == "jpeg" or im.mode not in ("RGB", "RGBA", "L") else im).save(
                buf, format=fmt, quality=quality)
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError, TypeError, KeyError,
            IndexError, ZeroDivisionError):  # what PIL raises on files that are not images it can write
        return None
    return buf.getvalue()


class Routes:
    def __init__(self, engine: Any, queue: PromptQueue, hub: Hub, worker: Worker, planner: Any) -> None:
        self.engine, self.queue, self.hub, self.worker, self.planner = engine, queue, hub, worker, planner
        self.number = 0
        self._plan_lock = threading.Lock()

    def folder(self, kind: str | None) -> Path | None:
        f = self.engine.folders
        return {"input": f.input, "output": f.output, "temp": f.temp}.get(kind or "output")

    def table(self) -> list[tuple[str, str, Callable]]:
        return [("GET", "/ws", self.websocket), ("GET", "/prompt", self.get_prompt),
                ("POST", "/prompt", self.post_prompt),
                ("GET", "/queue", self.get_queue), ("POST", "/queue", self.post_queue),
                ("GET", "/history", self.get_history), ("GET", "/history/{prompt_id}", self.get_history_item),
                ("POST", "/history", self.post_history), ("GET", "/view", self.view),
                ("GET", "/object_info", self.object_info), ("GET", "/object_info/{node_class}", self.object_info_one),
                ("POST", "/upload/image", self.upload_image), ("POST", "/interrupt", self.interrupt),
                ("POST", "/free", self.free), ("GET", "/system_stats", self.system_stats),
                ("GET", "/embeddings", self.embeddings),
                ("POST", "/vramgraph/plan", self.plan), ("POST", "/vramgraph/convert", self.convert),
                ("POST", "/vramgraph/ui", self.to_ui), ("GET", "/vramgraph/workflows", self.workflows),
                ("GET", "/vramgraph/workflows/{name}", self.workflow), ("POST", "/vramgraph/events", self.events)]

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        sid = request.rel_url.query.get("clientId") or ""
        sid = sane_id(sid, "clientId") if sid else uuid.uuid4().hex
        ws = web.WebSocketResponse(max_msg_size=MAX_INCOMING)
        await ws.prepare(request)
        self.hub.attach(sid, ws, request.transport)
        try:
            self.hub.send("status", {"status": self.worker.status(), "sid": sid}, sid)
            if self.worker.plan_message is not None and self.worker.client_id in (sid, None):
                self.hub.send("vramgraph.plan", self.worker.plan_message, sid)
            if self.worker.client_id == sid and self.worker.last_node is not None:
                self.hub.send("executing", executing(self.worker.plan_message and self.worker.plan_message["prompt_id"],
                                                     self.worker.last_node), sid)
            first = True
            async for msg in ws:
                if msg.type == WSMsgType.ERROR:
                    log.warning("websocket closed with %s", ws.exception())
                elif msg.type == WSMsgType.TEXT and first:  # ComfyUI's front end sends its feature flags first
                    first = False
                    if formats.is_feature_flags(msg.data):
                        self.hub.announce(sid)  # ComfyUI's front end: our events once its page subscribes
                        self.hub.send(formats.FEATURE_FLAGS, formats.features(formats.MAX_UPLOAD_SIZE), sid)
        finally:
            self.hub.detach(sid, ws)
        return ws

    async def events(self, request: web.Request) -> web.Response:
        """POST {"clientId"}: that client (ComfyUI's front end with our panel) wants our websocket events."""
        body = await read_object(request)
        self.hub.subscribe(sane_id(body.get("clientId"), "clientId"))
        return web.Response(status=200)

    async def get_prompt(self, request: web.Request) -> web.Response:
        return web.json_response(self.worker.status())

    async def admit(self, request: web.Request) -> tuple[Any, int, str, Any] | web.Response:
        """POST /prompt's first half, the same with or without a broker: the body read, the prompt numbered, a known
        prompt id refused, the prompt validated. (request, number, prompt id, validation), or the answer to give."""
        from ..graph.workflow.validate import validate

        req = prompt_request(await _body(request))
        if req.number is not None:
            number = req.number
        else:
            number = -self.number if req.front else self.number
            self.number += 1
        prompt, outputs, pid = req.prompt, req.targets, req.prompt_id or str(uuid.uuid4())
        if self.queue.known(pid):
            return _duplicate(pid)
        loop = asyncio.get_running_loop()
        check = await loop.run_in_executor(None, lambda: validate(prompt, self.engine.nodes, self.engine.folders,
                                                                  outputs))
        if not check.ok:
            from ..graph.workflow.errors import summary

            log.warning("prompt %s refused: %s", pid, summary(check.response()))
            return web.json_response(check.response(), status=400)
        return req, number, pid, check

    async def post_prompt(self, request: web.Request) -> web.Response:
        admitted = await self.admit(request)
        if isinstance(admitted, web.Response):
            return admitted
        req, number, pid, check = admitted
        req.extra["create_time"] = int(time.time() * 1000)  # as ComfyUI: /api/jobs sorts by it
        if not self.queue.put_new(QueueItem(number, pid, req.prompt, req.extra, list(check.outputs))):
            return _duplicate(pid)
        self.hub.send("status", {"status": self.worker.status()})
        return web.json_response({"prompt_id": pid, "number": number, "node_errors": check.node_errors})

    async def get_queue(self, request: web.Request) -> web.Response:
        running, pending = self.queue.current()
        return web.json_response({"queue_running": running, "queue_pending": pending}, dumps=_dumps)

    async def post_queue(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        delete = id_list(body["delete"], "delete") if body.get("delete") is not None else []
        if body.get("clear"):
            self.queue.wipe()
        for pid in delete:
            self.queue.delete(pid)
        self.hub.send("status", {"status": self.worker.status()})
        return web.Response(status=200)

    async def get_history(self, request: web.Request) -> web.Response:
        raw = request.rel_url.query.get("max_items", "")
        max_items = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 10 else None
        return web.json_response(self.queue.get_history(max_items=max_items), dumps=_dumps)

    async def get_history_item(self, request: web.Request) -> web.Response:
        return web.json_response(self.queue.get_history(request.match_info["prompt_id"]), dumps=_dumps)

    async def post_history(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        delete = id_list(body["delete"], "delete") if body.get("delete") is not None else []
        if body.get("clear"):
            self.queue.delete_history()
        for pid in delete:
            self.queue.delete_history(pid)
        return web.Response(status=200)

    async def view(self, request: web.Request) -> web.StreamResponse:
        q = request.rel_url.query
        name, root = q.get("filename", ""), self.folder(q.get("type"))
        if not name or root is None or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
            return _json_error(400, "bad file name or type", details="give filename (a name, no folders), "
                               "subfolder and type (input, output or temp)")
        path = _inside(root, q.get("subfolder", ""), name)
        if path is None:
            return _json_error(403, "that file is outside the input, output and temp folders", "forbidden")
        try:
            if not path.is_file():
                return _json_error(404, "no such file", "not_found")
        except OSError:
            return _json_error(404, "no such file", "not_found")
        content_type, headers = view_headers(name)
        preview = q.get("preview")
        if preview:
            fmt, _, quality = preview.partition(";")
            fmt = fmt if fmt in ("webp", "jpeg") else "webp"
            level = int(quality) if quality.isascii() and quality.isdigit() and len(quality) < 6 else 90
            if quality.isascii() and quality.isdigit() and level not in PREVIEW_QUALITY:
                return _json_error(400, "preview quality must be 1 to 100", details=f"preview={fmt};<1..100>")
            data = await asyncio.get_running_loop().run_in_executor(None, _preview, path, fmt, level,
                                                                    self.engine.folders.max_image_pixels)
            if data is None:
                return _json_error(400, "this file is not an image that can be previewed", "not_an_image")
            return web.Response(body=data, content_type=f"image/{fmt}", headers={
                **headers, "Content-Disposition": headers["Content-Disposition"].replace("attachment", "inline")})
        return web.FileResponse(path, headers={**headers, "Content-Type": content_type})

    async def object_info(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        info = await loop.run_in_executor(None, formats.object_info, self.engine.nodes, self.engine.folders)
        return web.json_response(info, dumps=_dumps)

    async def object_info_one(self, request: web.Request) -> web.Response:
        name = request.match_info["node_class"]
        nodes = {name: self.engine.nodes[name]} if name in self.engine.nodes else {}
        return web.json_response(formats.object_info(nodes, self.engine.folders), dumps=_dumps)

    async def upload_image(self, request: web.Request) -> web.Response:
        from ..nodes.files import IMAGE_EXTENSIONS

        try:
            post = await request.post()
        except web.HTTPException:
            raise
        except Exception as e:  # aiohttp's multipart parser on a malformed body: ValueError, AssertionError, ...
            raise BadRequest("the body is not a readable form", f"send multipart/form-data with an 'image' file "
                             f"({type(e).__name__})") from None
        image = post.get("image")
        kind = str(post.get("type") or "input")
        root = self.folder(kind)
        filename = getattr(image, "filename", None)
        if root is None or not filename or Path(filename).name != filename or filename in (".", "..") \
                or not filename.isprintable() or len(filename) > 255:
            return _json_error(400, "bad image name or type", details="send an 'image' file whose name has no "
                               "folders, and type input, output or temp")
        if not filename.lower().endswith(IMAGE_EXTENSIONS):
            return _json_error(400, "only images can be uploaded", "invalid_image",
                               details=f"{filename[:100]!r}: the name must end in one of {', '.join(IMAGE_EXTENSIONS)}")
        subfolder = str(post.get("subfolder") or "")
        folder = _inside(root, subfolder)
        if folder is None or not subfolder.isprintable():
            return _json_error(400, "bad subfolder", details="a subfolder inside the input, output or temp folder")
        data = image.file.read()
        loop = asyncio.get_running_loop()
        try:
            fmt = await loop.run_in_executor(None, uploaded_image_format, data, self.engine.folders.max_image_pixels)
        except ImageTooLarge as e:
            return _json_error(400, "the image is too large", "image_too_large", details=str(e))
        if fmt is None:
            return _json_error(400, "only images can be uploaded", "invalid_image",
                               details=f"{filename[:100]!r} is not a PNG, JPEG, WebP, GIF, BMP or TIFF image")
        overwrite = str(post.get("overwrite") or "") in ("true", "1") and kind != "output"  # outputs are never replaced

        def save() -> Path:
            folder.mkdir(parents=True, exist_ok=True)
            return save_upload(folder, filename, data, overwrite)

        try:
            path = await loop.run_in_executor(None, save)
        except OSError as e:
            return _json_error(400, "the image could not be saved there", "upload_failed",
                               details=f"{type(e).__name__}: {e.strerror or e}; choose another name or subfolder")
        return web.json_response({"name": path.name, "subfolder": subfolder, "type": kind})

    async def interrupt(self, request: web.Request) -> web.Response:
        body = await _body(request) if request.can_read_body else None
        wanted = body.get("prompt_id") if isinstance(body, dict) else None
        if wanted is not None:
            wanted = sane_id(wanted, "prompt_id")
        self.worker.interrupt(wanted)  # with an id: that running prompt alone; without: what is running
        return web.Response(status=200)

    async def free(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        for flag in ("unload_models", "free_memory"):
            if body.get(flag):
                self.queue.set_flag(flag, True)
        return web.Response(status=200)

    async def system_stats(self, request: web.Request) -> web.Response:
        return web.json_response(formats.system_stats(self.engine))

    async def embeddings(self, request: web.Request) -> web.Response:
        return web.json_response([])

    async def plan(self, request: web.Request) -> web.Response:
        return await plan_response(request, lambda: self.planner, self._plan_lock)

    async def convert(self, request: web.Request) -> web.Response:
        from ..graph.workflow.errors import WorkflowError
        from ..graph.workflow.parse import load_workflow

        body = await _body(request)
        data = body.get("workflow") if isinstance(body, dict) and "workflow" in body else body
        if not isinstance(data, dict):
            return _json_error(400, 'send {"workflow": <API or UI format workflow>}', "invalid_prompt")
        try:
            wf = load_workflow(data, self.engine.nodes)
        except WorkflowError as e:
            return web.json_response({"error": e.to_dict(), "node_errors": {}}, status=400)
        return web.json_response({"prompt": wf.prompt, "workflow": wf.ui}, dumps=_dumps)

    async def to_ui(self, request: web.Request) -> web.Response:
        body = await _body(request)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, dict):
            return _json_error(400, 'send {"prompt": <API format>, "workflow": <UI format it came from, optional>}')
        try:
            ui = formats.api_to_ui(prompt, self.engine.nodes, body.get("workflow"))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            return _json_error(400, f"cannot write this prompt in UI format: {e}")
        return web.json_response(ui, dumps=_dumps)

    async def workflows(self, request: web.Request) -> web.Response:
        return web.json_response(sorted(p.stem for p in (ROOT / "workflows").glob("*.json")))

    async def workflow(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"].removesuffix(".json")
        path = _inside(ROOT / "workflows", f"{name}.json")
        if path is None or not path.is_file():
            return web.Response(status=404)
        return web.FileResponse(path)


async def plan_response(request: web.Request, planner: Callable[[], Any], lock: threading.Lock) -> web.Response:
    """POST {"prompt": API format, "name"?: workflow name} -> {"plan", "timeline", "svg", "table", "unplanned"} (svg:
    the plan's picture, the same drawing as `vramgraph plan --svg`; unplanned: the nodes planned by stand-ins,
    nodes/foreign.py), or ComfyUI's error body (HTTP 400)."""
    from ..graph.draw.timeline import timeline_data, timeline_svg
    from ..graph.plan.planner import PlanError
    from ..graph.workflow.errors import NodeExecutionError, ValidationFailed, VramgraphError
    from ..nodes.foreign import unplanned

    try:  # inside ComfyUI (add_comfy_routes) no middleware of ours answers a BadRequest
        body = await _body(request)
    except BadRequest as e:
        return e.response()
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, dict):
        return _json_error(400, 'send {"prompt": <API-format workflow>}', "invalid_prompt")

    def run() -> Any:
        with lock:
            engine = planner()
            prep = engine.prepare(prompt)
            return prep.plan, timeline_svg(prep.plan, str(body.get("name") or ""), card=engine.budget.card,
                                           prompt=prep.prompt), unplanned(prep.prompt, engine.nodes)

    try:
        plan, svg, stand_ins = await asyncio.get_running_loop().run_in_executor(None, run)
    except ValidationFailed as e:
        return web.json_response(e.response, status=400, dumps=_dumps)
    except PlanError as e:
        return web.json_response({"error": e.to_dict(), "node_errors": {}}, status=400)
    except NodeExecutionError as e:  # a node that cannot be estimated ahead of time: the error names it
        return web.json_response({"error": VramgraphError.to_dict(e), "node_errors": {}}, status=400, dumps=_dumps)
    except (OSError, ValueError) as e:
        return _json_error(400, str(e), "plan_failed")
    return web.json_response(without_paths({"plan": plan.to_json(), "timeline": timeline_data(plan), "svg": svg,
                                            "table": plan.table(), "unplanned": stand_ins}), dumps=_dumps)


_dumps = dumps  # JSON a browser can parse (no NaN)


def _duplicate(pid: str) -> web.Response:
    return _json_error(400, "prompt_id is already in use", "duplicate_prompt_id",
                       details=f"prompt {pid[:80]!r} is queued, running or in the history; send a new prompt_id "
                       "or none (the server then makes one)")

