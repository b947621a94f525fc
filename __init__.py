"""vramgraph: FLUX.2 [klein] image generation as a node graph whose GPU memory is planned ahead of time.

This file is also what ComfyUI imports when the repository folder sits in `ComfyUI/custom_nodes/`
(as a package named after its path, so everything below uses relative imports only):

- `NODE_CLASS_MAPPINGS` / `NODE_DISPLAY_NAME_MAPPINGS`: our `VG` nodes only, one category
  ("vramgraph"), display names ending in "(vramgraph)". They are built on first access (PEP 562), so
  `import vramgraph` stays light: no torch until a node class is asked for.
- `Pipeline`: the Python API (api/pipeline.py), also built on first access: `from vramgraph import Pipeline`.
- `WEB_DIRECTORY`: ComfyUI loads every `.js` file under it as a front-end extension; the only one is
  `vramgraph_panel.js` (the plan of the queued prompt). The standalone page's scripts are `.mjs`.
- Inside ComfyUI (its `server` and `comfy.model_management` modules are loaded), the route
  POST /vramgraph/plan is added to ComfyUI's server for that panel. Nothing is imported to find out:
  outside ComfyUI, or without aiohttp, importing this package does nothing more.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__version__ = "0.1.0"
WEB_DIRECTORY = "./web"
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", "Pipeline"]


def __getattr__(name: str) -> Any:
    if name == "Pipeline":  # the Python API (api/pipeline.py); torch is imported when a pipeline first runs
        from .api.pipeline import Pipeline

        globals()["Pipeline"] = Pipeline
        return Pipeline
    if name in ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"):
        from .nodes import VG_DISPLAY_NAMES, VG_NODES
        from .nodes.comfy import comfy_nodes, runtime

        globals().update(NODE_CLASS_MAPPINGS=comfy_nodes(VG_NODES, runtime()),
                         NODE_DISPLAY_NAME_MAPPINGS=dict(VG_DISPLAY_NAMES))
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_in_comfyui() -> None:
    comfy_server = sys.modules.get("server")
    instance = getattr(getattr(comfy_server, "PromptServer", None), "instance", None)
    if instance is None or "comfy.model_management" not in sys.modules:
        return
    try:
        from .server.app import add_comfy_routes

        add_comfy_routes(instance.routes)
    except Exception:  # never break ComfyUI's start-up over the panel's route
        logging.getLogger("vramgraph").exception("vramgraph: could not add /vramgraph/plan to ComfyUI's server")


_register_in_comfyui()
