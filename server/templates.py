"""The template browser's files: ComfyUI's workflow templates (installed packages) and our workflows.

    GET /templates/{path}                         a file of the installed template packages (index.json, a workflow,
                                                  a thumbnail), as ComfyUI serves them beside its front end
    GET /workflow_templates                       {"vramgraph": [our workflows' names]}, ComfyUI's list of the
                                                  templates custom node packs ship
    GET /workflow_templates/vramgraph/{name}.json one of our workflows (workflows/*.json) in UI format

ComfyUI's templates come from PyPI's `comfyui-workflow-templates` (and its `-core`, `-json` and `-media-*` parts):
each installed part's `templates/` folder is searched in turn. The JSON part holds every index and workflow; the
media parts hold the thumbnails. A thumbnail whose media part is not installed is answered with THUMBNAIL, a plain
placeholder image, so that the browser shows an empty card instead of a failed request (docs/frontend.md says how to
get the real ones). Without any template package, index.json is `[]` (an empty browser, our workflows aside).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import logging
import mimetypes
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from aiohttp import web

from .bodies import json_error
from .security import view_headers

log = logging.getLogger("vramgraph.server")
ROOT = Path(__file__).parent.parent
PACK = "vramgraph"  # our name in /workflow_templates, as a custom node pack's
DISTRIBUTION = "comfyui-workflow-templates"  # the meta package; its parts are named comfyui-workflow-templates-*
THUMBNAIL_TYPES = (".webp", ".png", ".jpg", ".jpeg", ".gif", ".mp4", ".webm", ".mp3", ".flac", ".glb")
# a 4x3 grey PNG: the card of a template whose thumbnail's media package is not installed
THUMBNAIL = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000040000000308020000003b963991000000144944415478da63b4b27260800126"
    "062480c201001a9a00ba1d83e8e60000000049454e44ae426082")


def template_roots() -> list[Path]:
    """The `templates/` folders of the installed template packages: the JSON part first, then the others."""
    names = sorted({(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()})
    modules = [n.replace("-", "_") for n in names if n == DISTRIBUTION or n.startswith(DISTRIBUTION + "-")]
    modules.sort(key=lambda m: (not m.endswith("_json"), m))
    roots = []
    for module in modules:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            if (Path(location) / "templates").is_dir():
                roots.append(Path(location) / "templates")
    return roots


def templates_version() -> str | None:
    """The installed templates' version (the meta package's, else the JSON part's), for /system_stats."""
    for name in (DISTRIBUTION, DISTRIBUTION + "-json"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class Templates:
    """The routes of the module doc; `nodes` converts our API-format workflows to UI format."""

    def __init__(self, nodes: Any) -> None:
        self.nodes = nodes

    @cached_property
    def roots(self) -> list[Path]:
        return template_roots()

    def table(self) -> list[tuple[str, str, Callable]]:
        return [("GET", "/workflow_templates", self.packs),
                ("GET", "/workflow_templates/{pack}/{name}", self.pack_template)]

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/templates/{path:.+}", self.template_file)

    def ours(self) -> list[str]:
        return sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))

    async def packs(self, request: web.Request) -> web.Response:
        return web.json_response({PACK: self.ours()})

    async def pack_template(self, request: web.Request) -> web.Response:
        pack, name = request.match_info["pack"], request.match_info["name"]
        stem = name.removesuffix(".json")
        if pack != PACK or stem not in self.ours() or not name.endswith(".json"):
            return json_error(404, f"no template {pack[:60]}/{name[:100]}", "not_found",
                              details=f"GET /workflow_templates lists them; this server ships {PACK}'s only")
        from ..graph.workflow.parse import load_workflow
        from .formats import api_to_ui

        def ui() -> dict:
            data = json.loads((ROOT / "workflows" / f"{stem}.json").read_text())
            wf = load_workflow(data, self.nodes)
            return wf.ui if isinstance(wf.ui, dict) and wf.ui.get("nodes") else api_to_ui(wf.prompt, self.nodes)

        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, ui))

    async def template_file(self, request: web.Request) -> web.StreamResponse:
        rel = request.match_info["path"]
        parts = rel.split("/")
        if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
            return json_error(400, "bad template path", details="a file name of the template packages, e.g. "
                              "index.json")
        for root in self.roots:
            path = root.joinpath(*parts)
            if path.is_file() and path.resolve().is_relative_to(root.resolve()):
                kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                headers = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
                if kind != "application/json":
                    kind, more = view_headers(path.name)
                    headers.update(more)
                return web.FileResponse(path, headers={**headers, "Content-Type": kind})
        if len(parts) == 1 and rel.startswith("index") and rel.endswith(".json"):  # no package: no templates
            return web.json_response([] if rel != "index_logo.json" else {})
        if rel.lower().endswith(THUMBNAIL_TYPES) and len(parts) == 1 and self._is_template(rel):
            return web.Response(body=THUMBNAIL, content_type="image/png", headers={"Cache-Control": "no-cache"})
        return json_error(404, f"no template file {rel[:200]!r}", "not_found",
                          details="the installed template packages do not have it (pip install "
                          "comfyui-workflow-templates for the media)")

    def _is_template(self, name: str) -> bool:
        """Whether `name` is a thumbnail of a template of the installed index (name-1.webp, name-2.webp...)."""
        stem = name.rsplit(".", 1)[0].rsplit("-", 1)[0]
        return any((root / f"{stem}.json").is_file() for root in self.roots)


__all__ = ["THUMBNAIL", "Templates", "template_roots", "templates_version"]
