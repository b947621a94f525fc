"""Inside ComfyUI, the node types of ComfyUI (and of other packs) that we do not implement, for planning only.

The pack's plan panel sends the whole graph, and a graph there mixes our VG nodes with ComfyUI's core nodes.
Core node types we implement (nodes/core.py, nodes/output.py) are planned with our classes, as our engine
runs them. Every other type ComfyUI knows (its `nodes.NODE_CLASS_MAPPINGS`, which by then holds its core
nodes and every loaded pack's) is planned as a stand-in made from ComfyUI's own declaration, so validation
checks its inputs and links as ComfyUI would: it needs no model of ours and no GPU in the plan, and each of its
IMAGE, LATENT or MASK outputs is taken to have the size of its first input of that type (unknown when it has
none). The plan cannot know what such a node does on the GPU; the plan route lists these nodes
(`UNPLANNED`), so the panel says so. A stand-in never runs: ComfyUI runs its own node.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .types import IMAGE, LATENT, MASK, UNKNOWN, Cost, ImageInfo, LatentInfo

SIZED = {IMAGE: ImageInfo, LATENT: LatentInfo, MASK: ImageInfo}  # output types whose size is passed through
NOTE = "ComfyUI's own node: its GPU memory is not in this plan; its outputs are taken to be the size of its inputs"


def _declared(real: type) -> dict[str, Any]:
    spec = real.INPUT_TYPES()
    return {**(spec.get("required") or {}), **(spec.get("optional") or {})}


def stand_in(name: str, real: type) -> type | None:
    """A planning stand-in for ComfyUI's node class `real`, or None when its declaration cannot be read."""
    try:
        spec = real.INPUT_TYPES()
        returns = tuple(getattr(real, "RETURN_TYPES", ()) or ())
    except Exception:  # a node whose declaration needs more of ComfyUI than it has now: not planned at all
        return None
    if not isinstance(spec, Mapping):
        return None

    def input_types(cls: type) -> dict:
        return real.INPUT_TYPES()

    def vg_estimate(cls: type, env: Any, **inputs: Any) -> Cost:
        types = {k: (v[0] if isinstance(v, list | tuple) and v else v) for k, v in _declared(real).items()}
        outs = []
        for kind in returns:
            info = SIZED.get(kind) if isinstance(kind, str) else None
            found = next((inputs[k] for k, t in types.items() if t == kind and isinstance(inputs.get(k), info)),
                         UNKNOWN) if info is not None else UNKNOWN
            outs.append(found)
        return Cost(tuple(outs))

    def run(self: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{name} is ComfyUI's node; vramgraph only plans it, ComfyUI runs it")

    return type(name, (), {
        "__doc__": f"Planning stand-in for ComfyUI's {name}.", "__module__": __name__,
        "INPUT_TYPES": classmethod(input_types), "RETURN_TYPES": returns,
        "OUTPUT_NODE": bool(getattr(real, "OUTPUT_NODE", False)), "CATEGORY": str(getattr(real, "CATEGORY", "")),
        "FUNCTION": "run", "run": run, "vg_estimate": classmethod(vg_estimate), "UNPLANNED": NOTE})


def comfy_stand_ins(ours: Mapping[str, type]) -> dict[str, type]:
    """Stand-ins for every node type the running ComfyUI knows and `ours` does not (empty outside ComfyUI)."""
    comfy_nodes = sys.modules.get("nodes")  # ComfyUI's nodes.py, loaded before any custom node
    mapping = getattr(comfy_nodes, "NODE_CLASS_MAPPINGS", None)
    if not isinstance(mapping, Mapping):
        return {}
    out = {}
    for name, real in list(mapping.items()):
        if isinstance(name, str) and name not in ours and isinstance(real, type):
            made = stand_in(name, real)
            if made is not None:
                out[name] = made
    return out


def unplanned(prompt: Mapping[str, dict], nodes: Mapping[str, type]) -> list[dict]:
    """The nodes of `prompt` planned by stand-ins: [{"node", "class_type", "note"}]."""
    return [{"node": n, "class_type": spec["class_type"], "note": nodes[spec["class_type"]].UNPLANNED}
            for n, spec in prompt.items() if getattr(nodes.get(spec.get("class_type")), "UNPLANNED", None)]


__all__ = ["comfy_stand_ins", "stand_in", "unplanned"]
