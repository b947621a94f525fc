"""For the type checker: both runners of our nodes implement nodes/context.py `Context` (`.ci/run` runs mypy over
this module; nothing imports it at run time). A member added to the protocol and missing, or typed otherwise, in the
engine's `NodeContext` or in ComfyUI's `ComfyContext` fails that check."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...nodes.comfy import ComfyContext
    from ...nodes.context import Context
    from .executor import NodeContext


def engine_context(ctx: NodeContext) -> Context:
    """The engine's context is a `Context`."""
    return ctx


def comfy_context(ctx: ComfyContext) -> Context:
    """ComfyUI's context is a `Context`."""
    return ctx
