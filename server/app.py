"""The local server: ComfyUI's HTTP and websocket API over our engine, and the page in web/ at `/` (or ComfyUI's
official front end there with `--front-end comfyui`, ours then at /vramgraph/: frontend.py, docs/frontend.md).

    vramgraph serve [--host 127.0.0.1] [--port 8188] [--models DIR] [--vram 12GiB]

Existing ComfyUI clients work unchanged: POST /prompt (validated when submitted, errors as ComfyUI
answers them), /queue, /history, /view, /object_info, /upload/image, /interrupt, /free,
/system_stats, and /ws with ComfyUI's events (status, execution_start, execution_cached, executing,
progress, executed, execution_success, execution_error, execution_interrupted, binary preview frames).
More of ComfyUI's routes, which its front end and newer clients call, are in compat.py: /features (and
the answer to the websocket's `feature_flags`), /models, /api/jobs (and their cancel), /upload/mask,
/view_metadata; settings and user files kept under --user-dir are in userdata.py, the template browser's files in
templates.py, the Model Library in modellib.py; the events include `progress_state`, and `execution_cached`
even when it lists no node. POST /prompt honours `partial_execution_targets`; /interrupt with a prompt id
stops that prompt alone (see queue.py). Every route also answers under /api, as ComfyUI's does.

Our additions: the `vramgraph.plan` event (the running prompt's plan and its timeline) and
`vramgraph.step` (each load and unload as it happens; to ComfyUI's front end only once our panel subscribes with
POST /vramgraph/events, and never with the server's paths: hub.py), and POST /vramgraph/plan, /vramgraph/convert,
/vramgraph/ui for the page.

One queue, one worker thread: the worker alone calls the engine, whose runs are blocking; its events
reach each websocket through that client's own outgoing queue on the event loop, so they keep their order.
Files are served and written only inside the input, output and temp folders. With `--broker amqp://...` the
app is a frontend of a fleet instead: no engine thread; prompts are planned here and published, workers on other
machines run them and their events and results come back through the broker (broker.py, fleet_worker.py).

Beside a browser (security.py): requests from pages of other sites, foreign Host headers (DNS rebinding) and
cross-site websockets are refused unless `cors` (`--enable-cors-header [ORIGIN]`) opts out as in ComfyUI;
/view serves only images inline; uploads must be images. Malformed requests are answered 4xx in ComfyUI's
error shape (bodies.py); each websocket client has its own bounded send queue (hub.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from .bodies import refusals
from .compat import Compat
from .formats import MAX_UPLOAD_SIZE
from .frontend import FrontEnd, front_end_root
from .hub import Hub
from .modellib import ModelLibrary
from .queue import PromptQueue, Worker
from .routes import Routes, plan_response
from .security import middlewares
from .templates import Templates
from .userdata import UserData

log = logging.getLogger("vramgraph.server")
ROOT = Path(__file__).parent.parent
WEB = ROOT / "web"


def add_comfy_routes(routes: web.RouteTableDef) -> None:
    """Inside ComfyUI (called by the pack's __init__): POST /vramgraph/plan for the front-end panel.

    The planning context (graph/engine/planning.py `Planning`, torch-free: no Engine) is made on first use from
    ComfyUI's folders and device; it plans with the files' real sizes, or the built-in klein sizes when a file is
    absent, and ComfyUI's node types we do not implement with stand-ins (nodes/foreign.py), within what ComfyUI
    has free at each request (`_comfy_budget`). It runs nothing, and touches neither ComfyUI's allocator nor the
    GPU: no cap set, no probe run (the H200's costs, named as assumed).
    """
    made: list[Any] = []
    lock = threading.Lock()

    def planner() -> Any:
        device = str(_comfy_device())
        if not made:  # on the first plan, when ComfyUI has loaded its nodes and every pack's
            from ..graph.engine.planning import Planning
            from ..graph.plan.planner import CostModel
            from ..nodes import ENGINE_NODES
            from ..nodes.catalog import ModelCatalog
            from ..nodes.comfy import comfy_folders
            from ..nodes.foreign import comfy_stand_ins

            # a graph there mixes our nodes with ComfyUI's: the core types we implement are planned as ours, the
            # others by stand-ins made from ComfyUI's own declarations (nodes/foreign.py), named in the answer
            nodes = {**comfy_stand_ins(ENGINE_NODES), **ENGINE_NODES}
            folders = comfy_folders()
            dtype = "bf16" if device.startswith("cuda") else "fp32"
            made.append(Planning(folders, ModelCatalog(folders, dtype, allow_builtin=True), _comfy_budget(device),
                                 nodes, CostModel(name="h200, assumed: the panel runs nothing on ComfyUI's GPU")))
        else:
            made[0].budget = _comfy_budget(device)  # (under the lock: plan_response holds it)
        return made[0]

    async def plan(request: web.Request) -> web.Response:
        return await plan_response(request, planner, lock)

    routes.post("/vramgraph/plan")(plan)


def _comfy_budget(device: str) -> Any:
    """What ComfyUI has free on its device now (comfy.model_management.get_free_memory, which counts torch's free
    cache too), less the card margin and the reserve: read, never set. Off CUDA, host memory (budget_for)."""
    from ..graph.engine.budget import CARD_MARGIN, HOST_MARGIN, budget_for, host_available
    from ..graph.plan.planner import DEFAULT_RESERVE, Budget, GiB

    if not device.startswith("cuda"):
        return budget_for(device)
    import comfy.model_management as mm  # type: ignore[import-not-found]

    free = int(mm.get_free_memory(mm.get_torch_device()))
    return Budget(max(0, free - CARD_MARGIN - DEFAULT_RESERVE), max(GiB, host_available() - HOST_MARGIN), None,
                  DEFAULT_RESERVE, CARD_MARGIN)


def _comfy_device() -> Any:
    import comfy.model_management as mm  # type: ignore[import-not-found]

    return mm.get_torch_device()



ROUTES = web.AppKey("vramgraph", Routes)  # app[ROUTES]: the queue, worker and hub behind an app


async def _module_type(request: web.Request, response: web.StreamResponse) -> None:
    """ES module files (.mjs: ours under /web/ and /extensions/, a front end's) as text/javascript, the type browsers
    require of a module script, whatever the platform's MIME tables say; set on the answer, not registered in the
    process-wide `mimetypes` tables."""
    if isinstance(response, web.FileResponse) and request.path.endswith(".mjs"):
        response.content_type = "text/javascript"


def make_app(engine: Any, *, planner: Any = None, start_worker: bool = True, previews: bool = False,
             batch: bool = True, plugins: tuple[str, ...] = (), user_dir: Path | None = None,
             cors: str | None = None, broker: str | None = None, frontend_id: str | None = None,
             front_end: Path | None = None, signer: Any = None) -> web.Application:
    """The aiohttp application over `engine` (a graph.engine.executor.Engine).

    `planner` is the engine that answers /vramgraph/plan without touching the running one (by default a
    second Engine on the same folders and budget that may plan with built-in model sizes when files are
    absent). Step previews go out as ComfyUI's binary frames for prompts whose extra_data has a
    `preview_method` other than "none", or for every prompt with `previews` (ComfyUI sends none by default,
    and some clients take any binary frame for a result). The worker thread starts and stops with the app.
    `plugins` are Python files or module names whose `setup(app, engine)` adds routes (bench/ has one).
    `user_dir` is where ComfyUI's front end keeps settings and user files (userdata.py; None: read-only, none).
    `cors` is ComfyUI's --enable-cors-header: an origin (or "*") every answer allows, in place of the default
    origin checks (security.py). `broker` (an AMQP URL) makes the app a frontend (broker.py): prompts are planned
    here for the engine's budget (the reference card) and published; workers run them. `front_end` is the folder of
    the front end served at `/` (frontend.front_end_root; None: our page, which is at /vramgraph/ either way).
    `signer` (signing.py) signs and checks its broker messages (default: from VRAMGRAPH_BROKER_SECRET).
    """
    from ..graph.engine.executor import Engine

    planner = planner or Engine(engine.folders, device=str(engine.device), dtype=engine.dtype, budget=engine.budget,
                                nodes=engine.nodes, cost=engine.cost, allow_builtin=True)
    queue, hub = PromptQueue(), Hub()
    if broker:
        from .fleet_frontend import Frontend, FrontendRoutes
        from .signing import signer as read_signer

        worker: Any = Frontend(broker, queue, hub, frontend_id, signer=signer or read_signer(), folders=engine.folders)
        routes: Routes = FrontendRoutes(engine, queue, hub, worker, planner)
    else:
        worker = Worker(engine, queue, hub, previews, batch=batch)
        routes = Routes(engine, queue, hub, worker, planner)
    app = web.Application(client_max_size=MAX_UPLOAD_SIZE, middlewares=[*middlewares(cors), refusals])
    app[ROUTES] = routes
    front, user, templates = FrontEnd(front_end, hub, engine.folders), UserData(user_dir), Templates(engine.nodes)
    user.prepare()
    for method, path, handler in [*routes.table(), *Compat(routes).table(), *user.table(), *front.table(),
                                  *templates.table(), *ModelLibrary(engine.folders).table()]:
        app.router.add_route(method, path, handler)
        app.router.add_route(method, "/api" + path, handler)
    for plugin in plugins:
        load_plugin(plugin)(app, engine)
    templates.add_to(app)
    front.add_to(app)  # last: the front end's static folder is served at `/`

    async def started(app: web.Application) -> None:
        hub.start()
        if broker:
            await worker.start()
        elif start_worker:
            worker.start()

    async def stopping(app: web.Application) -> None:
        if broker:
            await worker.stop()
        else:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)
        await hub.stop()

    app.on_startup.append(started)
    app.on_shutdown.append(stopping)
    app.on_response_prepare.append(_module_type)
    return app


def load_plugin(spec: str) -> Callable[[web.Application, Any], None]:
    """The `setup(app, engine)` of a plugin given as a .py file or an importable module name."""
    import importlib
    import importlib.util

    if spec.endswith(".py"):
        path = Path(spec)
        loader = importlib.util.spec_from_file_location(f"vramgraph_plugin_{path.stem}", path)
        if loader is None or not path.is_file():
            raise ValueError(f"--plugin {spec}: no such file")
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as e:
            raise ValueError(f"--plugin {spec}: cannot import it ({e})") from e
    setup = getattr(module, "setup", None)
    if not callable(setup):
        raise ValueError(f"--plugin {spec}: it has no setup(app, engine) function")
    return setup


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


def _front_end_and_user_dir(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """The front end's folder (frontend.front_end_root) and the user folder, from the options or the config's keys
    front_end and user_dir; with ComfyUI's front end and no user folder given, ./user (ComfyUI's layout)."""
    from ..graph.engine.runtime import read_config, settings_of

    config = read_config(settings_of(args))
    name = getattr(args, "front_end", None) or config.get("front_end")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"config front_end: give comfyui, vramgraph or a folder, not {name!r}")
    root = front_end_root(name)
    user = getattr(args, "user_dir", None) or config.get("user_dir") or ("user" if root is not None else None)
    return root, Path(user).expanduser() if user else None


def serve(args: argparse.Namespace) -> int:
    """`vramgraph serve`: the engine from the command line's options (--demo already applied to them), served
    until Ctrl-C. It says where it listens only once the socket is bound; a busy port is a ValueError."""
    from ..graph.engine.runtime import engine_from

    url = getattr(args, "broker", None)
    signer = None
    if url:  # a frontend: the AMQP client, a usable URL and the shared secret, checked before anything is loaded
        from .broker import amqp, check_url, frontend_id
        from .signing import signer as read_signer

        amqp()
        check_url(url)
        signer = read_signer(getattr(args, "broker_secret_file", None))
    elif getattr(args, "work", False):
        raise ValueError("--work runs a fleet worker beside the frontend: give --broker amqp://... too")
    front_end, user_dir = _front_end_and_user_dir(args)  # a missing front end is refused before models load
    engine = engine_from(args)
    from ..nodes.modelpaths import models_warning

    warning = models_warning(engine.folders)
    if warning:  # said at the start, not first at the first prompt
        log.warning("%s", warning)
    for folder in (engine.folders.input, engine.folders.output, engine.folders.temp):
        folder.mkdir(parents=True, exist_ok=True)
    engine.warm_up()  # before listening: the first prompt then finds the kernels and the tokenizer ready
    app = make_app(engine, previews=getattr(args, "previews", False), plugins=tuple(getattr(args, "plugin", ()) or ()),
                   cors=getattr(args, "enable_cors_header", None), user_dir=user_dir, front_end=front_end,
                   broker=url, signer=signer,
                   frontend_id=(getattr(args, "frontend_id", None) or frontend_id(args.port)) if url else None)
    if url and getattr(args, "work", False):  # one process, both: a fleet worker on the same engine
        from .fleet_worker import FleetWorker, run_in_thread

        run_in_thread(FleetWorker(engine, url, signer=signer, max_batch=getattr(args, "max_batch", 16),
                                  steal_after=getattr(args, "steal_after", 30.0), grace=getattr(args, "grace", 1.0)))

    async def main() -> None:
        runner = web.AppRunner(app, handle_signals=True)
        await runner.setup()
        if url:  # a frontend that cannot read what workers write refuses to start, before listening (fleet_files.py)
            try:
                await app[ROUTES].worker.handshake(getattr(args, "handshake_wait", 10.0))
            except ValueError:
                await runner.cleanup()
                raise
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise ValueError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); "
                             "is another server running there? Choose another --port") from None
        port = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else args.port
        log.info("vramgraph serve on http://%s:%d (device %s, budget %.2f GiB; Python %s, %s)", args.host, port,
                 engine.device, engine.budget.gpu / 2**30, platform.python_version(), sys.platform)
        if front_end is not None:
            log.info("front end: %s (our page: /vramgraph/; user folder %s)", front_end, user_dir)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except (web.GracefulExit, KeyboardInterrupt):
        log.info("stopped")
    return 0


__all__ = ["ROUTES", "ServerThread", "add_comfy_routes", "make_app", "serve"]
