"""The server's request handlers: ComfyUI's routes and ours (see app.py for the list), over one engine."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from . import formats
from .hub import Hub
from .queue import PromptQueue, Worker

log = logging.getLogger("vramgraph.server")
ROOT = Path(__file__).parent.parent

# ------------------------------------------------------------------------------------------------ routes


def _json_error(status: int, message: str, type_: str = "invalid_request", **extra: Any) -> web.Response:
    error = {"type": type_, "message": message, "details": message, "extra_info": extra}
    return web.json_response({"error": error, "node_errors": {}}, status=status)


async def _body(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None


def _inside(root: Path, *parts: str) -> Path | None:
    """root/parts resolved, or None if that leaves root (.., absolute parts, links pointing out)."""
    base = root.resolve()
    path = base.joinpath(*parts).resolve()
    return path if path == base or path.is_relative_to(base) else None


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
                ("GET", "/embeddings", self.embeddings), ("GET", "/extensions", self.embeddings),
                ("POST", "/vramgraph/plan", self.plan), ("POST", "/vramgraph/convert", self.convert),
                ("POST", "/vramgraph/ui", self.to_ui), ("GET", "/vramgraph/workflows", self.workflows),
                ("GET", "/vramgraph/workflows/{name}", self.workflow)]

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        sid = request.rel_url.query.get("clientId") or uuid.uuid4().hex
        self.hub.sockets[sid] = ws
        try:
            self.hub.send("status", {"status": self.worker.status(), "sid": sid}, sid)
            if self.worker.plan_message is not None and self.worker.client_id in (sid, None):
                self.hub.send("vramgraph.plan", self.worker.plan_message, sid)
            if self.worker.client_id == sid and self.worker.last_node is not None:
                self.hub.send("executing", {"node": self.worker.last_node, "display_node": self.worker.last_node,
                                            "prompt_id": self.worker.plan_message and
                                            self.worker.plan_message["prompt_id"]}, sid)
            first = True
            async for msg in ws:
                if msg.type == WSMsgType.ERROR:
                    log.warning("websocket closed with %s", ws.exception())
                elif msg.type == WSMsgType.TEXT and first:  # ComfyUI's front end sends its feature flags first
                    first = False
                    if formats.is_feature_flags(msg.data):
                        self.hub.send(formats.FEATURE_FLAGS, formats.features(formats.MAX_UPLOAD_SIZE), sid)
        finally:
            if self.hub.sockets.get(sid) is ws:
                del self.hub.sockets[sid]
        return ws

    async def get_prompt(self, request: web.Request) -> web.Response:
        return web.json_response(self.worker.status())

    async def post_prompt(self, request: web.Request) -> web.Response:
        from ..graph.validate import validate

        body = await _body(request)
        if not isinstance(body, dict):
            return _json_error(400, "the body must be a JSON object", "invalid_prompt")
        if "number" in body:
            number = float(body["number"])
        else:
            number = -self.number if body.get("front") else self.number
            self.number += 1
        if "prompt" not in body:
            return _json_error(400, "No prompt provided", "no_prompt")
        prompt = body["prompt"]
        pid = str(body.get("prompt_id") or uuid.uuid4())
        outputs = body.get("partial_execution_targets")
        loop = asyncio.get_running_loop()
        check = await loop.run_in_executor(None, lambda: validate(prompt, self.engine.nodes, self.engine.folders,
                                                                  outputs))
        if not check.ok:
            log.warning("invalid prompt: %s", check.error.get("message") if check.error else "")
            return web.json_response(check.response(), status=400)
        extra = dict(body.get("extra_data") or {})
        if "client_id" in body:
            extra["client_id"] = body["client_id"]
        extra["create_time"] = int(time.time() * 1000)  # as ComfyUI: /api/jobs sorts by it
        self.queue.put((number, pid, prompt, extra, list(check.outputs)))
        self.hub.send("status", {"status": self.worker.status()})
        return web.json_response({"prompt_id": pid, "number": number, "node_errors": check.node_errors})

    async def get_queue(self, request: web.Request) -> web.Response:
        running, pending = self.queue.current()
        return web.json_response({"queue_running": running, "queue_pending": pending}, dumps=_dumps)

    async def post_queue(self, request: web.Request) -> web.Response:
        body = await _body(request) or {}
        if body.get("clear"):
            self.queue.wipe()
        for pid in body.get("delete", []) or []:
            self.queue.delete(str(pid))
        self.hub.send("status", {"status": self.worker.status()})
        return web.Response(status=200)

    async def get_history(self, request: web.Request) -> web.Response:
        raw = request.rel_url.query.get("max_items")
        max_items = int(raw) if raw and raw.isdigit() else None
        return web.json_response(self.queue.get_history(max_items=max_items), dumps=_dumps)

    async def get_history_item(self, request: web.Request) -> web.Response:
        return web.json_response(self.queue.get_history(request.match_info["prompt_id"]), dumps=_dumps)

    async def post_history(self, request: web.Request) -> web.Response:
        body = await _body(request) or {}
        if body.get("clear"):
            self.queue.delete_history()
        for pid in body.get("delete", []) or []:
            self.queue.delete_history(str(pid))
        return web.Response(status=200)

    async def view(self, request: web.Request) -> web.StreamResponse:
        q = request.rel_url.query
        name, root = q.get("filename", ""), self.folder(q.get("type"))
        if not name or root is None or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
            return web.Response(status=400)
        path = _inside(root, q.get("subfolder", ""), name)
        if path is None:
            return web.Response(status=403)
        if not path.is_file():
            return web.Response(status=404)
        headers = {"Content-Disposition": f'filename="{name}"'}
        preview = q.get("preview")
        if preview:
            from PIL import Image

            fmt, _, quality = preview.partition(";")
            fmt = fmt if fmt in ("webp", "jpeg") else "webp"
            buf = io.BytesIO()
            with Image.open(path) as im:
                (im.convert("RGB") if fmt == "jpeg" else im).save(buf, format=fmt,
                                                                  quality=int(quality) if quality.isdigit() else 90)
            return web.Response(body=buf.getvalue(), content_type=f"image/{fmt}", headers=headers)
        return web.FileResponse(path, headers=headers)

    async def object_info(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        info = await loop.run_in_executor(None, formats.object_info, self.engine.nodes, self.engine.folders)
        return web.json_response(info, dumps=_dumps)

    async def object_info_one(self, request: web.Request) -> web.Response:
        name = request.match_info["node_class"]
        nodes = {name: self.engine.nodes[name]} if name in self.engine.nodes else {}
        return web.json_response(formats.object_info(nodes, self.engine.folders), dumps=_dumps)

    async def upload_image(self, request: web.Request) -> web.Response:
        post = await request.post()
        image = post.get("image")
        kind = str(post.get("type") or "input")
        root = self.folder(kind)
        filename = getattr(image, "filename", None)
        if root is None or not filename or Path(filename).name != filename or filename in (".", ".."):
            return web.Response(status=400)
        subfolder = str(post.get("subfolder") or "")
        folder = _inside(root, subfolder)
        if folder is None:
            return web.Response(status=400)
        data = image.file.read()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / filename
        if str(post.get("overwrite") or "") not in ("true", "1"):
            stem, suffix = os.path.splitext(filename)
            for i in itertools.count(1):
                if not path.exists() or path.read_bytes() == data:  # the same image again: keep the file it is
                    break
                path = folder / f"{stem} ({i}){suffix}"
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
        return web.json_response({"name": path.name, "subfolder": subfolder, "type": kind})

    async def interrupt(self, request: web.Request) -> web.Response:
        body = await _body(request) if request.can_read_body else None
        wanted = body.get("prompt_id") if isinstance(body, dict) else None
        self.worker.interrupt(str(wanted) if wanted else None)  # with an id: that running prompt alone
        return web.Response(status=200)

    async def free(self, request: web.Request) -> web.Response:
        body = await _body(request) or {}
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
        from ..graph.errors import WorkflowError
        from ..graph.workflow import load_workflow

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
        except (KeyError, TypeError, ValueError) as e:
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
    """POST {"prompt": API format, "name"?: workflow name} -> {"plan", "timeline", "svg", "table"} (svg: the plan's
    picture, the same drawing as `vramgraph plan --svg`), or ComfyUI's error body (HTTP 400)."""
    from ..graph.errors import ValidationFailed
    from ..graph.planner import PlanError
    from ..graph.timeline import timeline_data, timeline_svg

    body = await _body(request)
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, dict):
        return _json_error(400, 'send {"prompt": <API-format workflow>}', "invalid_prompt")

    def run() -> Any:
        with lock:
            engine = planner()
            prep = engine.prepare(prompt)
            return prep.plan, timeline_svg(prep.plan, str(body.get("name") or ""), card=engine.budget.card,
                                           prompt=prep.prompt)

    try:
        plan, svg = await asyncio.get_running_loop().run_in_executor(None, run)
    except ValidationFailed as e:
        return web.json_response(e.response, status=400, dumps=_dumps)
    except PlanError as e:
        return web.json_response({"error": e.to_dict(), "node_errors": {}}, status=400)
    except (OSError, ValueError) as e:
        return _json_error(400, str(e), "plan_failed")
    return web.json_response({"plan": plan.to_json(), "timeline": timeline_data(plan), "svg": svg,
                              "table": plan.table()}, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)

