"""For the type checker: both runners of our nodes implement nodes/context.py `Context`, and both file views
nodes/files.py `Files` (`.ci/run` runs mypy over this module; nothing imports it at run time). A member added to a
protocol and missing, or typed otherwise, in the engine's or ComfyUI's implementation fails that check."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...nodes.comfy import ComfyContext, ComfyFiles
    from ...nodes.context import Context
    from ...nodes.files import Files, Folders
    from .executor import NodeContext


def engine_context(ctx: NodeContext) -> Context:
    """The engine's context is a `Context`."""
    return ctx


def comfy_context(ctx: ComfyContext) -> Context:
    """ComfyUI's context is a `Context`."""
    return ctx


def engine_files(folders: Folders) -> Files:
    """Our folders are `Files`."""
    return folders


def comfy_files(files: ComfyFiles) -> Files:
    """ComfyUI's files are `Files`."""
    return files
