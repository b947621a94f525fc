"""The local server: ComfyUI's HTTP and websocket API over our engine, and the page in web/ at `/`.

    vramgraph serve [--host 127.0.0.1] [--port 8188] [--models DIR] [--vram 12GiB]

Existing ComfyUI clients work unchanged: POST /prompt (validated when submitted, errors as ComfyUI
answers them), /queue, /history, /view, /object_info, /upload/image, /interrupt, /free,
/system_stats, and /ws with ComfyUI's events (status, execution_start, execution_cached, executing,
progress, executed, execution_success, execution_error, execution_interrupted, binary preview frames).
Every route also answers under /api, as ComfyUI's does. Our additions: the `vramgraph.plan` event
(the running prompt's plan and its timeline) and `vramgraph.step` (each load and unload as it
happens), and POST /vramgraph/plan, /vramgraph/convert, /vramgraph/ui for the page.

One queue, one worker thread: the worker alone calls the engine, whose runs are blocking; its events
reach the websockets through one outgoing message queue on the event loop, so they keep their order.
Files are served and written only inside the input, output and temp folders.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import logging
import mimetypes
import os
import platform
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from . import server_formats as formats
from .server_queue import Hub, PromptQueue, Worker, encode_preview

log = logging.getLogger("vramgraph.server")
WEB = Path(__file__).parent / "web"


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
            async for msg in ws:
                if msg.type == WSMsgType.ERROR:
                    log.warning("websocket closed with %s", ws.exception())
        finally:
            if self.hub.sockets.get(sid) is ws:
                del self.hub.sockets[sid]
        return ws

    async def get_prompt(self, request: web.Request) -> web.Response:
        return web.json_response(self.worker.status())

    async def post_prompt(self, request: web.Request) -> web.Response:
        from .graph.validate import validate

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
        if wanted is None or wanted in self.queue.running:
            self.engine.interrupt()
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
        from .graph.errors import WorkflowError
        from .graph.workflow import load_workflow

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
        return web.json_response(sorted(p.stem for p in (Path(__file__).parent / "workflows").glob("*.json")))

    async def workflow(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"].removesuffix(".json")
        path = _inside(Path(__file__).parent / "workflows", f"{name}.json")
        if path is None or not path.is_file():
            return web.Response(status=404)
        return web.FileResponse(path)


async def plan_response(request: web.Request, planner: Callable[[], Any], lock: threading.Lock) -> web.Response:
    """POST {"prompt": API format} -> {"plan", "timeline", "table"}, or ComfyUI's error body (HTTP 400)."""
    from .graph.errors import ValidationFailed
    from .graph.planner import PlanError
    from .graph.timeline import timeline_data

    body = await _body(request)
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, dict):
        return _json_error(400, 'send {"prompt": <API-format workflow>}', "invalid_prompt")

    def run() -> Any:
        with lock:
            return planner().prepare(prompt).plan

    try:
        plan = await asyncio.get_running_loop().run_in_executor(None, run)
    except ValidationFailed as e:
        return web.json_response(e.response, status=400, dumps=_dumps)
    except PlanError as e:
        return web.json_response({"error": e.to_dict(), "node_errors": {}}, status=400)
    except (OSError, ValueError) as e:
        return _json_error(400, str(e), "plan_failed")
    return web.json_response({"plan": plan.to_json(), "timeline": timeline_data(plan), "table": plan.table()},
                             dumps=_dumps)


def add_comfy_routes(routes: web.RouteTableDef) -> None:
    """Inside ComfyUI (called by the pack's __init__): POST /vramgraph/plan for the front-end panel.

    The planning engine is made on first use from ComfyUI's folders and device; it plans with the files'
    real sizes, or the built-in klein sizes when a file is absent. It runs nothing.
    """
    made: list[Any] = []
    lock = threading.Lock()

    def planner() -> Any:
        if not made:
            from .graph.executor import Engine
            from .nodes.comfy import comfy_folders

            made.append(Engine(comfy_folders(), device=str(_comfy_device()), allow_builtin=True))
        return made[0]

    async def plan(request: web.Request) -> web.Response:
        return await plan_response(request, planner, lock)

    routes.post("/vramgraph/plan")(plan)


def _comfy_device() -> Any:
    import comfy.model_management as mm  # type: ignore[import-not-found]

    return mm.get_torch_device()


ROUTES = web.AppKey("vramgraph", Routes)  # app[ROUTES]: the queue, worker and hub behind an app


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(WEB / "index.html", headers={"Cache-Control": "no-cache"})


def memory_stats(engine: Any, reset: bool = False) -> dict:
    """Torch allocator figures (peaks since the last reset, across nodes) and the models on the GPU; `reset`
    restarts the peak counters first."""
    import torch

    out: dict[str, Any] = {"loaded_models": sorted(engine.ledger.on_gpu)}
    if engine.device.type == "cuda":
        max_allocated, max_reserved = engine.peaks(reset)
        free, total = torch.cuda.mem_get_info(engine.device)
        out.update(max_allocated=max_allocated, max_reserved=max_reserved,
                   allocated=torch.cuda.memory_allocated(engine.device),
                   reserved=torch.cuda.memory_reserved(engine.device), dev_free=free, dev_total=total)
    return out


def make_app(engine: Any, *, planner: Any = None, start_worker: bool = True, previews: bool = False,
             batch: bool = True) -> web.Application:
    """The aiohttp application over `engine` (a graph.executor.Engine).

    `planner` is the engine that answers /vramgraph/plan without touching the running one (by default a
    second Engine on the same folders and budget that may plan with built-in model sizes when files are
    absent). Step previews go out as ComfyUI's binary frames for prompts whose extra_data has a
    `preview_method` other than "none", or for every prompt with `previews` (ComfyUI sends none by default,
    and some clients take any binary frame for a result). The worker thread starts and stops with the app.
    """
    from .graph.executor import Engine

    mimetypes.add_type("text/javascript", ".mjs")
    planner = planner or Engine(engine.folders, device=str(engine.device), dtype=engine.dtype, budget=engine.budget,
                                nodes=engine.nodes, cost=engine.cost, allow_builtin=True)
    queue, hub = PromptQueue(), Hub()
    worker = Worker(engine, queue, hub, previews, batch=batch)
    routes = Routes(engine, queue, hub, worker, planner)
    app = web.Application(client_max_size=256 * 2**20)
    app[ROUTES] = routes
    for method, path, handler in routes.table():
        app.router.add_route(method, path, handler)
        app.router.add_route(method, "/api" + path, handler)
    app.router.add_get("/", _index)
    app.router.add_static("/web/", WEB, show_index=False, follow_symlinks=False)
    # the benchmark client's memory probe (shared/tools/comfyui-peer reads it from ComfyUI the same way)
    app.router.add_get("/peer/mem", lambda request: web.json_response(memory_stats(engine)))
    app.router.add_post("/peer/reset_peak", lambda request: web.json_response(memory_stats(engine, reset=True)))

    async def started(app: web.Application) -> None:
        hub.start()
        if start_worker:
            worker.start()

    async def stopping(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)
        await hub.stop()

    app.on_startup.append(started)
    app.on_shutdown.append(stopping)
    return app


class ServerThread:
    """The app served on host:port from a thread of its own (tests, notebooks); `with` starts and stops it."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="vramgraph-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port chosen when 0 was asked

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(args: argparse.Namespace) -> int:
    """`vramgraph serve`: the engine from the command line's options, served until Ctrl-C."""
    from .cli import engine_from

    if getattr(args, "demo", False):
        from .demo import SHIPPED_NAMES, write_tiny_models

        models = Path("vramgraph-demo") / "models"
        if not (models / "vae" / SHIPPED_NAMES["vae"]).exists():
            write_tiny_models(models, names=SHIPPED_NAMES)
        args.models = [str(models)]
    engine = engine_from(args)
    for folder in (engine.folders.input, engine.folders.output, engine.folders.temp):
        folder.mkdir(parents=True, exist_ok=True)
    engine.warm_up()  # before listening: the first prompt then finds the kernels and the tokenizer ready
    log.info("vramgraph %s on http://%s:%d (device %s, budget %.2f GiB; Python %s, %s)", "serve", args.host,
             args.port, engine.device, engine.budget.gpu / 2**30, platform.python_version(), sys.platform)
    web.run_app(make_app(engine, previews=getattr(args, "previews", False)), host=args.host, port=args.port,
                print=None)
    return 0


__all__ = ["ROUTES", "Hub", "PromptQueue", "ServerThread", "Worker", "add_comfy_routes", "encode_preview", "make_app",
           "plan_response", "serve"]
