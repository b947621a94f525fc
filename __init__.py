"""vramgraph: FLUX.2 [klein] image generation as a node graph whose GPU memory is planned ahead of time.

This file is also what ComfyUI imports when the pack sits in `custom_nodes/`: it exposes the node
mappings and the web directory, and imports nothing heavy beyond what the nodes need.
"""

from __future__ import annotations

__version__ = "0.1.0"

NODE_CLASS_MAPPINGS: dict[str, type] = {}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {}
WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
