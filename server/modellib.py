"""The front end's Model Library, as ComfyUI's `app/model_manager.py` answers it.

    GET /experiment/models                          [{"name": folder, "folders": [...]}] for each model folder
    GET /experiment/models/{folder}                 [{"name", "pathIndex", "modified", "size"}] its model files
    GET /experiment/models/preview/{folder}/{pathIndex}/{filename}   the image beside a model file (name.png, ...)

A model without an image beside it gets a plain grey tile (ComfyUI answers 404, which the front end's Model Library
asks for every model it shows and the browser reports as a failed request); a name that is no model file is 404.

`folders` names each place a folder is read from by its name under a models root (`diffusion_models`, `unet`),
not by its path on the server as ComfyUI does: a browser has no use for the server's paths. `pathIndex` is the
index in that list. Checkpoints (whole-model folders, `checkpoints`) are listed by folder name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from .templates import THUMBNAIL

PREVIEW_EXTENSIONS = (".webp", ".png", ".jpg", ".jpeg", ".gif")
MODEL_EXTENSIONS = (".safetensors", ".sft")


class ModelLibrary:
    """The routes of the module doc over `folders` (nodes.files.Folders)."""

    def __init__(self, folders: Any) -> None:
        self.folders = folders

    def table(self) -> list[tuple[str, str, Callable]]:
        return [("GET", "/experiment/models", self.model_folders),
                ("GET", "/experiment/models/{folder}", self.models),
                ("GET", "/experiment/models/preview/{folder}/{index}/{filename:.+}", self.preview)]

    def _names(self) -> list[str]:
        from ..nodes.files import MODEL_FOLDERS

        return [*MODEL_FOLDERS, "checkpoints"]

    def _dirs(self, folder: str) -> list[Path]:
        return self.folders.model_dirs(folder)

    async def model_folders(self, request: web.Request) -> web.Response:
        return web.json_response([{"name": name, "folders": [d.name for d in self._dirs(name)]}
                                  for name in self._names()])

    async def models(self, request: web.Request) -> web.Response:
        folder = request.match_info["folder"]
        if folder not in self._names():
            return web.Response(status=404)
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, self._files, folder))

    def _files(self, folder: str) -> list[dict]:
        from ..models.paths import walk_files
        from ..nodes.files import MODEL_EXTENSIONS, checkpoint_names

        out = []
        for index, root in enumerate(self._dirs(folder)):
            names = checkpoint_names([root]) if folder == "checkpoints" else walk_files(root, MODEL_EXTENSIONS)
            for name in names:
                try:
                    st = (root / name).stat()
                except OSError:
                    continue
                out.append({"name": name, "pathIndex": index, "modified": st.st_mtime, "size": st.st_size})
        return out

    async def preview(self, request: web.Request) -> web.StreamResponse:
        folder, index, name = (request.match_info[k] for k in ("folder", "index", "filename"))
        dirs = self._dirs(folder) if folder in self._names() else []
        if not index.isdigit() or int(index) >= len(dirs) or "\0" in name or "\\" in name:
            return web.Response(status=404)
        root = dirs[int(index)].resolve()
        stem = (root / name).with_suffix("")
        for ext in PREVIEW_EXTENSIONS:
            for candidate in (stem.with_name(stem.name + ext), stem.with_name(stem.name + ".preview" + ext)):
                path = candidate.resolve()
                if path.is_relative_to(root) and path.is_file():
                    return web.FileResponse(path, headers={"X-Content-Type-Options": "nosniff"})
        model = (root / name).resolve()
        if model.is_relative_to(root) and any((model.parent / (model.stem + e)).exists() for e in MODEL_EXTENSIONS):
            return web.Response(body=THUMBNAIL, content_type="image/png")  # a model without a picture: a grey tile
        return web.Response(status=404)


__all__ = ["ModelLibrary"]
