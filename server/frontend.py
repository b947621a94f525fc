"""ComfyUI's official front end served by `vramgraph serve --front-end comfyui` (docs/frontend.md).

The front end is the PyPI package `comfyui-frontend-package` (the extra `vramgraph[frontend]`), served from its
`static/` folder at `/` on the same origin and behind the same middlewares as the API; our own page then moves to
`/vramgraph/` (it is always there too). Beside the static files this module answers what the front end asks of a
ComfyUI server and that is not about prompts, as ComfyUI's `server.py` and `api_server/` answer it:

    GET /extensions                     the front end's own extensions and our plan panel (web/vramgraph_panel.js)
    GET /extensions/vramgraph/...       our web/ folder (the panel and the modules it imports)
    GET /i18n                           translations of custom nodes: none
    GET /global_subgraphs[/{id}]        subgraph blueprints: none (ComfyUI finds them in custom node packs)
    GET /node_replacements              node replacements: none
    GET /internal/logs, /internal/logs/raw, PATCH /internal/logs/subscribe   this server's log (vramgraph logger)
    GET /internal/files/{input|output}  the names of the files in the input or output folder
    GET /internal/folder_paths          refused 403: it would send the server's folder paths to the browser

The log buffer keeps the last LOG_LINES records of the `vramgraph` logger while the app runs; clients that
subscribe get each new record as ComfyUI's `logs` event.
"""

from __future__ import annotations

import collections
import datetime
import importlib.util
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from .bodies import json_error, read_object, sane_id
from .hub import Hub

log = logging.getLogger("vramgraph.server")
ROOT = Path(__file__).parent.parent
WEB = ROOT / "web"
FRONT_ENDS = ("vramgraph", "comfyui")
PACKAGE = "comfyui_frontend_package"
EXTENSION = "vramgraph"  # our folder under /extensions/, as ComfyUI names a custom node pack's web directory
TESTED_FRONTEND = "1.58.1"  # the comfyui-frontend-package version tests/test_browser.py runs (/system_stats'
#                             required_frontend_version: an older front end warns that it is outdated)
LOG_LINES = 1000
NO_CACHE = {"Cache-Control": "no-cache", "Pragma": "no-cache", "Expires": "0"}


class FrontEndMissing(ValueError):
    """`--front-end comfyui` without the package installed."""


def front_end_root(name: str | None) -> Path | None:
    """The folder of the front end `name` serves at `/`: None for ours ("vramgraph" or None), the installed
    comfyui-frontend-package's static folder for "comfyui", or a folder holding an index.html (ComfyUI's
    --front-end-root). FrontEndMissing (a ValueError) says how to get what is missing."""
    if name in (None, "", "vramgraph"):
        return None
    if name == "comfyui":
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FrontEndMissing("--front-end comfyui: the ComfyUI front end is not installed; install it with "
                                  "pip install 'vramgraph[frontend]' (or pip install comfyui-frontend-package)")
        root = Path(next(iter(spec.submodule_search_locations))) / "static"
    else:
        root = Path(name).expanduser()
    if not (root / "index.html").is_file():
        raise FrontEndMissing(f"--front-end {name}: {root} has no index.html; give 'comfyui' (the installed "
                              f"comfyui-frontend-package), 'vramgraph' (our page) or a folder with a built front end")
    return root.resolve()


class LogBuffer(logging.Handler):
    """The last LOG_LINES records of the `vramgraph` logger, as ComfyUI's /internal/logs entries {t, m}."""

    def __init__(self, hub: Hub) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.entries: collections.deque[dict[str, str]] = collections.deque(maxlen=LOG_LINES)
        self.subscribers: set[str] = set()
        self.hub = hub
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            entry = {"t": datetime.datetime.fromtimestamp(record.created).isoformat(), "m": self.format(record) + "\n"}
        except Exception:  # a record whose message cannot be formatted: logging's own rule is to not raise
            return
        with self._lock:
            self.entries.append(entry)
            subscribers = list(self.subscribers)
        for sid in subscribers:
            self.hub.send_threadsafe("logs", {"entries": [entry], "size": {"cols": 120, "rows": 30}}, sid)

    def raw(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": list(self.entries), "size": {"cols": 120, "rows": 30}}


class FrontEnd:
    """The routes of the module doc for the front end served from `root` (None: our page at `/`)."""

    def __init__(self, root: Path | None, hub: Hub, folders: Any) -> None:
        self.root, self.folders = root, folders
        self.logs = LogBuffer(hub)

    def table(self) -> list[tuple[str, str, Callable]]:
        """The API routes (registered with and without /api, as every other)."""
        return [("GET", "/extensions", self.extensions), ("GET", "/i18n", self.i18n),
                ("GET", "/global_subgraphs", self.nothing), ("GET", "/global_subgraphs/{id}", self.no_subgraph),
                ("GET", "/node_replacements", self.nothing)]

    def add_to(self, app: web.Application) -> None:
        """/internal routes, our page and the static files (after every API route: the front end's static
        folder is served at `/`, so it must be the last resource that matches)."""
        for method, path, handler in [("GET", "/internal/logs", self.log_text), ("GET", "/internal/logs/raw",
                                                                                 self.log_raw),
                                      ("PATCH", "/internal/logs/subscribe", self.subscribe),
                                      ("GET", "/internal/files/{directory}", self.files),
                                      ("GET", "/internal/folder_paths", self.folder_paths)]:
            app.router.add_route(method, path, handler)
        app.router.add_get("/vramgraph/", self.our_page)
        app.router.add_get("/user.css", self.user_css)
        app.router.add_static(f"/extensions/{EXTENSION}/", WEB, show_index=False, follow_symlinks=False)
        app.router.add_get("/", self.index if self.root is not None else self.our_page)
        app.router.add_static("/web/", WEB, show_index=False, follow_symlinks=False)
        if self.root is not None:
            app.router.add_static("/", self.root, show_index=False, follow_symlinks=False)
        app.on_startup.append(self._start_log)
        app.on_cleanup.append(self._stop_log)

    async def _start_log(self, app: web.Application) -> None:
        logging.getLogger("vramgraph").addHandler(self.logs)

    async def _stop_log(self, app: web.Application) -> None:
        logging.getLogger("vramgraph").removeHandler(self.logs)

    async def index(self, request: web.Request) -> web.StreamResponse:
        assert self.root is not None
        return web.FileResponse(self.root / "index.html", headers=NO_CACHE)

    async def user_css(self, request: web.Request) -> web.StreamResponse:
        """The front end's index links `user.css` beside it; ComfyUI's has none (404): ours answers it empty (the
        user's own CSS is /api/userdata/user.css)."""
        return web.Response(text="", content_type="text/css", headers={"Cache-Control": "no-cache"})

    async def our_page(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(WEB / "index.html", headers={"Cache-Control": "no-cache"})

    async def extensions(self, request: web.Request) -> web.Response:
        """ComfyUI's list: the front end's own extensions/**/*.js, then each pack's web files (ours: the panel)."""
        own = [] if self.root is None else sorted(
            "/" + p.relative_to(self.root).as_posix() for p in (self.root / "extensions").rglob("*.js"))
        ours = [f"/extensions/{EXTENSION}/{p.name}" for p in sorted(WEB.glob("*.js"))]
        return web.json_response([*own, *ours])

    async def i18n(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def nothing(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def no_subgraph(self, request: web.Request) -> web.Response:
        return json_error(404, f"no subgraph blueprint {request.match_info['id'][:100]!r}: this server ships none",
                          "not_found")

    async def log_text(self, request: web.Request) -> web.Response:
        return web.json_response("".join(e["m"] for e in self.logs.raw()["entries"]))

    async def log_raw(self, request: web.Request) -> web.Response:
        return web.json_response(self.logs.raw())

    async def subscribe(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        sid = sane_id(body.get("clientId"), "clientId")
        with self.logs._lock:
            if body.get("enabled"):
                if len(self.logs.subscribers) < 1000:
                    self.logs.subscribers.add(sid)
            else:
                self.logs.subscribers.discard(sid)
        return web.Response(status=200)

    async def files(self, request: web.Request) -> web.Response:
        kind = request.match_info["directory"]
        root = {"input": self.folders.input, "output": self.folders.output}.get(kind)
        if root is None:
            return json_error(400, f"unknown directory {kind[:40]!r}", details="ask for input or output")
        names = sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith(".")) \
            if root.is_dir() else []
        return web.json_response(names)

    async def folder_paths(self, request: web.Request) -> web.Response:
        return json_error(403, "this server does not send its folder paths to browsers", "forbidden",
                          details="the model folders are listed by name at /api/experiment/models; their paths are "
                          "in the server's configuration (vramgraph serve --models)")


__all__ = ["FRONT_ENDS", "TESTED_FRONTEND", "FrontEnd", "FrontEndMissing", "front_end_root"]
