"""What the server answers in ComfyUI's shapes: /object_info, /system_stats, /features, /api/jobs, the
`progress_state` event, and API -> UI format.

`api_to_ui` lets the page save a workflow in the UI format ComfyUI's front end opens: when the prompt
came from a UI file, that file with its widget values updated; otherwise a new UI graph laid out in
columns by depth, whose conversion back (`graph.workflow.parse.ui_to_api`) gives the prompt again.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

import networkx as nx

from ..graph.workflow.parse import WidgetSlot, widget_positions, widget_slots
from ..graph.workflow.validate import input_types
from ..nodes.types import is_link
from .messages import QueueItem

GiB = 2**30


def node_info(name: str, cls: type, folders: Any = None, display_names: Mapping[str, str] | None = None,
              module: str = "nodes") -> dict:
    """ComfyUI's /object_info entry for one node class."""
    types = input_types(cls, folders)
    out = list(cls.RETURN_TYPES)
    info = {"input": types, "input_order": {k: list(v) for k, v in types.items()}, "output": out,
            "output_is_list": list(getattr(cls, "OUTPUT_IS_LIST", [False] * len(out))),
            "output_name": list(getattr(cls, "RETURN_NAMES", out)), "name": name,
            "display_name": (display_names or {}).get(name, name),
            "description": (getattr(cls, "DESCRIPTION", "") or "").strip(), "python_module": module,
            "category": getattr(cls, "CATEGORY", "sd"), "output_node": getattr(cls, "OUTPUT_NODE", False) is True}
    if hasattr(cls, "OUTPUT_TOOLTIPS"):
        info["output_tooltips"] = list(cls.OUTPUT_TOOLTIPS)
    if getattr(cls, "EXPERIMENTAL", False):
        info["experimental"] = True
    return info


def object_info(nodes: Mapping[str, type], folders: Any = None) -> dict:
    from ..nodes import VG_DISPLAY_NAMES, VG_NODES
    from ..nodes.declared import DISPLAY_NAMES

    return {name: node_info(name, cls, folders, DISPLAY_NAMES | VG_DISPLAY_NAMES,
                            "custom_nodes.vramgraph" if name in VG_NODES else "nodes")
            for name, cls in nodes.items()}


def _ram() -> tuple[int, int]:
    from ..graph.engine.budget import host_available

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    return total, host_available()


def system_stats(engine: Any) -> dict:
    """ComfyUI's /system_stats, plus our budget under "vramgraph"."""
    import torch

    from .. import __version__
    from .signing import redact_argv

    ram_total, ram_free = _ram()
    dev = engine.device
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        reserved, allocated = torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index)
        device = {"name": f"cuda:{index} {torch.cuda.get_device_name(index)}", "type": "cuda", "index": index,
                  "vram_total": total, "vram_free": free + reserved - allocated, "torch_vram_total": reserved,
                  "torch_vram_free": reserved - allocated}
    else:
        device = {"name": str(dev), "type": dev.type, "index": dev.index, "vram_total": ram_total,
                  "vram_free": ram_free, "torch_vram_total": ram_total, "torch_vram_free": ram_free}
    from .frontend import TESTED_FRONTEND
    from .templates import templates_version

    templates = templates_version()
    return {"system": {"os": os.name, "ram_total": ram_total, "ram_free": ram_free,
                       "comfyui_version": f"vramgraph {__version__}", "required_frontend_version": TESTED_FRONTEND,
                       # whatever templates are installed are the ones we serve: nothing newer is required
                       "installed_templates_version": templates, "required_templates_version": templates,
                       "python_version": sys.version,
                       "pytorch_version": torch.__version__, "embedded_python": False, "argv": redact_argv(sys.argv),
                       "platform": platform.platform()},
            "devices": [device],
            "vramgraph": {"budget": engine.budget.to_json(), "dtype": engine.dtype}}


# ------------------------------------------------------------------------------------------ /features, jobs

JOB_STATUSES = ("pending", "in_progress", "completed", "failed", "cancelled")
MAX_UPLOAD_SIZE = 256 * 2**20  # the largest request body the server reads (aiohttp's client_max_size)
FEATURE_FLAGS = "feature_flags"  # the websocket message a ComfyUI front end sends first, and our answer's type


def is_feature_flags(text: str) -> bool:
    """Whether a websocket text message is ComfyUI's `{"type": "feature_flags", "data": {...}}`."""
    try:
        message = json.loads(text)
    except ValueError:
        return False
    return isinstance(message, dict) and message.get("type") == FEATURE_FLAGS


def features(max_upload_size: int) -> dict:
    """Our /features and websocket `feature_flags` answer: ComfyUI's keys, with what this server does."""
    return {"supports_preview_metadata": False, "max_upload_size": max_upload_size,
            "extension": {"manager": {"supports_v4": False}}, "node_replacements": False, "assets": False,
            "vramgraph": {"batches": True, "targeted_interrupt": True, "plan": True}}


def _pruned(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def queued_job(item: QueueItem, status: str) -> dict:
    """A pending or running queue item as one of ComfyUI's /api/jobs entries."""
    number, pid, extra = item.number, item.prompt_id, item.extra_data
    workflow = ((extra.get("extra_pnginfo") or {}).get("workflow") or {}) if isinstance(extra, dict) else {}
    return _pruned({"id": pid, "status": status, "priority": number, "create_time": extra.get("create_time"),
                    "outputs_count": 0, "previewable_outputs_count": 0,
                    "workflow_id": workflow.get("id") if isinstance(workflow, dict) else None})


def finished_job(pid: str, entry: dict) -> dict:
    """A history entry as one of ComfyUI's /api/jobs entries (interrupted: "cancelled", other errors: "failed")."""
    job = queued_job(QueueItem.of(entry["prompt"]), "completed")
    status = entry.get("status") or {}
    start = end = error = None
    interrupted = False
    for kind, data in status.get("messages", []):
        if kind == "execution_start":
            start = data.get("timestamp")
        elif kind in ("execution_success", "execution_error", "execution_interrupted"):
            end = data.get("timestamp")
            error = data if kind == "execution_error" else error
            interrupted = interrupted or kind == "execution_interrupted"
    if status.get("status_str") == "error":
        job["status"] = "cancelled" if interrupted else "failed"
    items = [{**im, "nodeId": node, "mediaType": kind} for node, out in entry.get("outputs", {}).items()
             for kind, ims in out.items() if isinstance(ims, list) for im in ims if isinstance(im, dict)]
    preview = next((i for i in items if i.get("type") == "output"), items[0] if items else None)
    job.update(_pruned({"execution_start_time": start, "execution_end_time": end, "execution_error": error,
                        "outputs_count": len(items), "previewable_outputs_count": sum(
                            1 for i in items if i["mediaType"] == "images"), "preview_output": preview}))
    return job


class ProgressState:
    """ComfyUI's `progress_state` event for one prompt: every node started so far, with its state and progress."""

    def __init__(self, prompt_id: str) -> None:
        self.prompt_id = prompt_id
        self.nodes: dict[str, dict] = {}

    def _set(self, node: str, state: str, value: float | None = None, max_: float | None = None) -> dict:
        entry = self.nodes.setdefault(node, {"value": 0.0, "max": 1.0, "state": state, "node_id": node,
                                             "prompt_id": self.prompt_id, "display_node_id": node,
                                             "parent_node_id": None, "real_node_id": node})
        entry["state"] = state
        if value is not None:
            entry["value"], entry["max"] = value, max_ if max_ is not None else entry["max"]
        if state == "finished":
            entry["value"] = entry["max"]
        return {"prompt_id": self.prompt_id, "nodes": {n: dict(e) for n, e in self.nodes.items()}}

    def start(self, node: str) -> dict:
        return self._set(node, "running", 0.0, 1.0)

    def update(self, node: str, value: float, max_: float) -> dict:
        return self._set(node, "running", value, max_)

    def finish(self, node: str) -> dict:
        return self._set(node, "finished")


# ------------------------------------------------------------------------------------------ API -> UI


def _widget_list(slots: tuple[WidgetSlot, ...], values: Mapping[str, Any]) -> list:
    """widgets_values as the front end stores them: a control value after seeds, the upload button's value."""
    out: list = []
    for s in slots:
        out.append(values.get(s.name))
        if s.control:
            out.append("fixed")
        if s.upload:
            out.append("image")
    return out


def _update_widgets(node: dict, slots: tuple[WidgetSlot, ...], values: Mapping[str, Any]) -> None:
    """Write `values` into a UI node's widgets_values in place (the inverse of workflow.widget_values)."""
    stored = node.get("widgets_values")
    if isinstance(stored, dict):
        stored.update({s.name: values[s.name] for s in slots if s.name in values})
        return
    if not isinstance(stored, list):
        node["widgets_values"] = _widget_list(slots, values)
        return
    for s, i in widget_positions(slots, stored):
        if s.name in values:
            stored[i] = values[s.name]


def api_to_ui(prompt: Mapping[str, dict], nodes: Mapping[str, type], original: Mapping[str, Any] | None = None
              ) -> dict:
    """A UI-format workflow for `prompt` (see the module docstring)."""
    if isinstance(original, Mapping) and isinstance(original.get("nodes"), list):
        ui = copy.deepcopy(dict(original))
        for node in ui["nodes"]:
            spec = prompt.get(str(node.get("id")))
            cls = nodes.get(str(node.get("type")))
            if spec is None or cls is None or spec.get("class_type") != node.get("type"):
                continue
            literal = {k: v for k, v in spec.get("inputs", {}).items() if not is_link(v)}
            _update_widgets(node, widget_slots(cls), literal)
        return ui
    return _build_ui(prompt, nodes)


def _build_ui(prompt: Mapping[str, dict], nodes: Mapping[str, type]) -> dict:
    numeric = all(str(k).isdigit() for k in prompt)
    ids = {str(k): int(k) if numeric else i + 1 for i, k in enumerate(prompt)}
    g = nx.DiGraph()
    g.add_nodes_from(ids)
    for nid, spec in prompt.items():
        for v in spec.get("inputs", {}).values():
            if is_link(v) and str(v[0]) in ids:
                g.add_edge(str(v[0]), str(nid))
    depth = {n: 0 for n in g}
    for n in nx.topological_sort(g) if nx.is_directed_acyclic_graph(g) else g:
        for s in g.successors(n):
            depth[s] = max(depth[s], depth[n] + 1)
    rows: dict[int, float] = {}
    ui_nodes, links, outputs = [], [], {}
    link_id = 0
    for nid, spec in prompt.items():
        kind = spec["class_type"]
        cls = nodes.get(kind)
        if cls is None:
            raise KeyError(f"node {nid}: unknown class_type {kind!r}")
        types = input_types(cls)
        slots = widget_slots(cls)
        widget_names = {s.name for s in slots}
        inputs = []
        for section in ("required", "optional"):
            for name, entry in (types.get(section) or {}).items():
                value = spec.get("inputs", {}).get(name)
                kind_of = entry[0] if isinstance(entry, list | tuple) and entry else entry
                type_name = "COMBO" if isinstance(kind_of, list | tuple) else str(kind_of)
                if name in widget_names and not is_link(value):
                    continue
                inp: dict[str, Any] = {"name": name, "type": type_name, "link": None}
                if name in widget_names:
                    inp["widget"] = {"name": name}
                if is_link(value) and str(value[0]) in ids:
                    link_id += 1
                    src, slot = str(value[0]), int(value[1])
                    src_type = list(nodes[prompt[src]["class_type"]].RETURN_TYPES)[slot]
                    links.append([link_id, ids[src], slot, ids[str(nid)], len(inputs), src_type])
                    outputs.setdefault((src, slot), []).append(link_id)
                    inp["link"] = link_id
                inputs.append(inp)
        literal = {k: v for k, v in spec.get("inputs", {}).items() if not is_link(v)}
        column = depth[str(nid)]
        height = 46 + 22 * (len(inputs) + len(slots) + len(cls.RETURN_TYPES))
        y = rows.get(column, 40.0)
        rows[column] = y + height + 40
        ui_nodes.append({"id": ids[str(nid)], "type": kind, "pos": [40 + 320 * column, y], "size": [280, height],
                         "flags": {}, "order": 0, "mode": 0, "inputs": inputs, "outputs": [],
                         "properties": {"Node name for S&R": kind},
                         "widgets_values": _widget_list(slots, literal),
                         "title": spec.get("_meta", {}).get("title") or kind})
    for node, (nid, spec) in zip(ui_nodes, prompt.items(), strict=True):
        cls = nodes[spec["class_type"]]
        names = list(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES))
        node["outputs"] = [{"name": names[i], "type": t, "links": outputs.get((str(nid), i), []), "slot_index": i}
                           for i, t in enumerate(cls.RETURN_TYPES)]
    order = {n: i for i, n in enumerate(nx.topological_sort(g))} if nx.is_directed_acyclic_graph(g) else {}
    for node, nid in zip(ui_nodes, prompt, strict=True):
        node["order"] = order.get(str(nid), 0)
    return {"last_node_id": max(ids.values(), default=0), "last_link_id": link_id, "nodes": ui_nodes,
            "links": links, "groups": [], "config": {}, "extra": {}, "version": 0.4}


__all__ = ["FEATURE_FLAGS", "JOB_STATUSES", "MAX_UPLOAD_SIZE", "ProgressState", "api_to_ui", "features",
           "finished_job", "is_feature_flags", "node_info", "object_info", "queued_job", "system_stats"]
