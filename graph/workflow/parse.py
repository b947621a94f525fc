"""Saved ComfyUI workflows in either format, and the UI (litegraph) format converted to the API format.

The API format is what the engine runs: ``{"<id>": {"class_type", "inputs", "_meta"}}`` where a linked
input is ``[source_id, output_slot]`` and anything else is a literal widget value. The UI format is what
ComfyUI's front end saves (``{"nodes": [...], "links": [...], "definitions": {"subgraphs": [...]}}``);
`ui_to_api` does what the front end's graphToPrompt does:

- muted nodes (mode 2) are dropped and their consumers lose that input; bypassed nodes (mode 4) are
  dropped and each consumer is rewired to the bypassed node's input of the output's type;
- UI-only nodes (Note, MarkdownNote, Reroute, legacy PrimitiveNode) vanish: links are followed through
  reroutes and a primitive's value is written into every input it feeds;
- subgraph instances are flattened recursively, inner nodes taking the ids ``"<instance>:<inner>"``;
- widget values are matched to the class's widget inputs in declaration order, skipping the extra
  values the front end stores after a ``control_after_generate`` widget and an upload widget.

A PNG saved by ComfyUI or by us is a workflow too: its `prompt` text chunk (API format) runs, its
`workflow` chunk (UI format) is kept for the PNGs the run writes.

Legacy "group nodes" (``workflow>Name``, from ``extra.groupNodes``) are not expanded: they stay in the
output under their own class_type, so validation reports them as missing node types. A node of a type we do
not know keeps its raw widget values in ``_meta.widgets_values`` (it cannot run; validation reads them to say
which model the workflow is for).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...nodes.types import is_link
from .errors import WorkflowError

log = logging.getLogger(__name__)

MODE_NEVER = 2  # muted
MODE_BYPASS = 4
SUBGRAPH_INPUT_ID = "-10"  # the subgraph's input node, as link origin
SUBGRAPH_OUTPUT_ID = "-20"  # the subgraph's output node, as link target
NOTE_TYPES = frozenset({"Note", "MarkdownNote"})
UI_ONLY_TYPES = NOTE_TYPES | {"Reroute", "PrimitiveNode"}
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
SEED_NAMES = frozenset({"seed", "noise_seed"})  # the front end adds a control widget to these even unasked
CONTROL_VALUES = frozenset({"fixed", "increment", "decrement", "randomize"})
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class WorkflowFormatError(WorkflowError, ValueError):
    """A workflow that is neither ComfyUI's API nor UI format, or whose subgraphs cannot be expanded."""

    type = "invalid_prompt"


@dataclass(frozen=True)
class Workflow:
    prompt: dict  # API format, what the engine runs
    ui: dict | None  # the original UI workflow, kept for the PNG "workflow" chunk
    source: str  # the file it came from, or "<dict>"


@dataclass(frozen=True)
class WidgetSlot:
    """One widget input of a node class, as the front end lays out widgets_values."""

    name: str
    control: bool  # a control_after_generate value ("fixed", "randomize", ...) follows it
    upload: bool  # an upload button's value follows it


# ------------------------------------------------------------------------------------------------ format


def is_api_format(data: Any) -> bool:
    """``{"<id>": {"class_type": ..., "inputs": {...}}, ...}`` with at least one node."""
    return (isinstance(data, Mapping) and bool(data)
            and all(isinstance(v, Mapping) and isinstance(v.get("class_type"), str) for v in data.values()))


def is_ui_format(data: Any) -> bool:
    """A litegraph workflow: a list of nodes that each have an id and a type, and a list of links."""
    if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), list):
        return False
    return (isinstance(data.get("links", []), list)
            and all(isinstance(n, Mapping) and "id" in n and "type" in n for n in data["nodes"]))


EXPECTED = ('expected ComfyUI\'s API format {"<id>": {"class_type": ..., "inputs": {...}}}, its UI format '
            '{"nodes": [...], "links": [...]} (File > Save), or a /prompt body {"prompt": {...}}')


def load_workflow(source: str | Path | Mapping[str, Any], nodes: Mapping[str, type] | None = None) -> Workflow:
    """Read a workflow file (or an already-parsed dict) in API or UI format; UI format is converted.

    `nodes` maps class_type to node class and defaults to the engine's nodes; it is only consulted to lay out
    widget values when converting the UI format.
    """
    if isinstance(source, Mapping):
        data: Any = source
        name = "<dict>"
    else:
        name = str(source)
        if _is_png(Path(source)):
            return _from_png(Path(source), nodes)
        try:
            data = json.loads(Path(source).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise WorkflowFormatError(f"{name} is not valid JSON ({e})", EXPECTED, {"source": name}) from e
        except (OSError, UnicodeDecodeError) as e:
            raise WorkflowFormatError(f"cannot read workflow file {name} ({e})",
                                      "check the path; a workflow is a .json file saved from ComfyUI",
                                      {"source": name}) from e
    if nodes is None:
        from ...nodes import ENGINE_NODES
        nodes = ENGINE_NODES
    if is_api_format(data):
        return Workflow(_copy_api(data), None, name)
    if is_ui_format(data):
        return Workflow(ui_to_api(data, nodes), copy.deepcopy(dict(data)), name)
    if isinstance(data, Mapping) and "prompt" in data:
        return _from_wrapper(data, nodes, name)
    raise WorkflowFormatError(f"{name} is not a ComfyUI workflow", EXPECTED, {"source": name})


def _is_png(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == PNG_SIGNATURE
    except OSError:
        return False


def _from_png(path: Path, nodes: Mapping[str, type] | None) -> Workflow:
    """The workflow a PNG carries, as ComfyUI (and our SaveImage) writes it: text chunks `prompt` (API format, what
    ran) and `workflow` (UI format, what the front end showed). The prompt is run when there is one; the UI
    workflow is kept for the PNGs this run writes."""
    from PIL import Image

    name = str(path)
    try:
        with Image.open(path) as im:
            text = dict(getattr(im, "text", {}) or {})
    except (OSError, SyntaxError, ValueError) as e:
        raise WorkflowFormatError(f"cannot read the PNG {name} ({e})", "give a PNG saved by ComfyUI or vramgraph",
                                  {"source": name}) from e
    found = {}
    for key in ("prompt", "workflow"):
        if key in text:
            try:
                found[key] = json.loads(text[key])
            except json.JSONDecodeError as e:
                raise WorkflowFormatError(f"{name}: its '{key}' text chunk is not JSON ({e})",
                                          "the PNG's metadata is damaged; use the workflow it was made with",
                                          {"source": name}) from e
    if not found:
        raise WorkflowFormatError(f"{name} carries no workflow", "ComfyUI and vramgraph store the workflow in a "
                                  "PNG's 'prompt' and 'workflow' text chunks; this PNG has neither (saved by "
                                  "another program, or its metadata was stripped)", {"source": name})
    if nodes is None:
        from ...nodes import ENGINE_NODES
        nodes = ENGINE_NODES
    ui = found.get("workflow")
    ui = ui if is_ui_format(ui) else None
    if is_api_format(found.get("prompt")):
        return Workflow(_copy_api(found["prompt"]), ui, name)
    if ui is not None:
        return Workflow(ui_to_api(ui, nodes), ui, name)
    raise WorkflowFormatError(f"{name}: its text chunks hold no workflow", EXPECTED, {"source": name})


def _copy_api(data: Mapping[str, Any]) -> dict:
    return {str(k): copy.deepcopy(dict(v)) for k, v in data.items()}


def _from_wrapper(data: Mapping[str, Any], nodes: Mapping[str, type], name: str) -> Workflow:
    """``{"prompt": {...}, "extra_data": {"extra_pnginfo": {"workflow": {...}}}}`` (ComfyUI's /prompt body)."""
    prompt = data["prompt"]
    if isinstance(prompt, str):  # as stored in a PNG text chunk
        try:
            prompt = json.loads(prompt)
        except json.JSONDecodeError as e:
            raise WorkflowFormatError(f'{name}: "prompt" is a string that is not JSON ({e})', EXPECTED,
                                      {"source": name}) from e
    extra = data.get("extra_data")
    pnginfo = extra.get("extra_pnginfo") if isinstance(extra, Mapping) else None
    ui = pnginfo.get("workflow") if isinstance(pnginfo, Mapping) else None
    if ui is None:
        ui = data.get("workflow")
    ui = copy.deepcopy(dict(ui)) if is_ui_format(ui) else None
    if is_api_format(prompt):
        return Workflow(_copy_api(prompt), ui, name)
    if is_ui_format(prompt):
        return Workflow(ui_to_api(prompt, nodes), ui or copy.deepcopy(dict(prompt)), name)
    raise WorkflowFormatError(f'{name}: its "prompt" holds no workflow', EXPECTED, {"source": name})


# ------------------------------------------------------------------------------------------------ widgets


def widget_slots(cls: type) -> tuple[WidgetSlot, ...]:
    """The widget inputs of a node class in the order the front end stores their values."""
    try:
        spec = cls.INPUT_TYPES(folders=None)
    except TypeError:  # a plain ComfyUI node: INPUT_TYPES() takes no arguments
        spec = cls.INPUT_TYPES()
    slots = []
    for section in ("required", "optional"):
        for name, entry in (spec.get(section) or {}).items():
            kind = entry[0] if isinstance(entry, list | tuple) and entry else entry
            options = entry[1] if isinstance(entry, list | tuple) and len(entry) > 1 else {}
            options = options if isinstance(options, Mapping) else {}
            is_combo = isinstance(kind, list | tuple)
            if not (is_combo or (isinstance(kind, str) and kind in WIDGET_TYPES)) or options.get("forceInput"):
                continue
            control = bool(options.get("control_after_generate")) or (kind == "INT" and name in SEED_NAMES)
            upload = any(key.endswith("_upload") and value for key, value in options.items())
            slots.append(WidgetSlot(name, control, upload))
    return tuple(slots)


def widget_values(node: Mapping[str, Any], slots: tuple[WidgetSlot, ...]) -> dict[str, Any]:
    """The UI node's widgets_values by input name; inputs with no stored value are left out."""
    values = node.get("widgets_values")
    if isinstance(values, Mapping):
        return {s.name: values[s.name] for s in slots if s.name in values}
    if not isinstance(values, list):
        return {}
    return {slot.name: values[i] for slot, i in widget_positions(slots, values)}


def widget_positions(slots: tuple[WidgetSlot, ...], values: list) -> Iterator[tuple[WidgetSlot, int]]:
    """(slot, index in widgets_values) for each stored widget, skipping the extra control and upload values."""
    i = 0
    for slot in slots:
        if i >= len(values):
            return
        yield slot, i
        i += 1
        if slot.control and i < len(values) and (values[i] is None or (isinstance(values[i], str)
                                                                      and values[i] in CONTROL_VALUES)):
            i += 1
        if slot.upload and i < len(values):
            i += 1


# ------------------------------------------------------------------------------------------------ UI -> API


@dataclass(frozen=True)
class _Link:
    """A litegraph link, ids as strings."""

    origin_id: str
    origin_slot: int
    target_id: str
    target_slot: int


@dataclass(frozen=True)
class _Out:
    """Resolved source: output `slot` of the API node `node`."""

    node: str
    slot: int


@dataclass(frozen=True)
class _Value:
    """Resolved source: a literal (a legacy PrimitiveNode, or a subgraph instance's promoted widget)."""

    value: Any
    origin: tuple[Any, Any] | None = None  # (widgets_values list or dict, index or key) it is stored at


class _Unset:
    """Resolved source: an unconnected subgraph input; the inner node keeps its own widget value."""


UNSET = _Unset()
_Source = _Out | _Value | _Unset | None  # None: the input is dropped


@dataclass(frozen=True)
class _Scope:
    """One graph level: the top-level workflow, or one subgraph instance's inside."""

    prefix: str  # "" at top level, "75:" inside instance 75, "92:112:" inside 112 inside 92
    nodes: dict[str, Mapping[str, Any]]
    links: dict[str, _Link]
    definition: Mapping[str, Any] | None = None  # the subgraph definition, inside an instance
    instance: Mapping[str, Any] | None = None  # the instance node, in `parent`
    parent: _Scope | None = None
    promoted: Mapping[str, tuple[Any, Any, Any]] | None = None  # subgraph input name -> (value, container, key)


def _links(raw: Any) -> dict[str, _Link]:
    """Links by id (as a string), from litegraph's list form or the dict form subgraph definitions use."""
    out: dict[str, _Link] = {}
    for entry in raw or ():
        if isinstance(entry, Mapping):
            fields = [entry.get(k) for k in ("id", "origin_id", "origin_slot", "target_id", "target_slot")]
        elif isinstance(entry, list | tuple) and len(entry) >= 5:
            fields = list(entry[:5])
        else:
            continue
        if None in fields:
            continue
        link_id, origin, origin_slot, target, target_slot = fields
        try:
            out[str(link_id)] = _Link(str(origin), int(origin_slot), str(target), int(target_slot))
        except (TypeError, ValueError):
            log.warning("skipping malformed link %r", entry)
    return out


def _types_match(a: Any, b: Any) -> bool:
    """LiteGraph.isValidConnection: equal, a wildcard, or overlapping comma-separated type lists."""
    if a in ("*", "", None) or b in ("*", "", None):
        return True
    if a == b:
        return True
    return bool({t.strip().upper() for t in str(a).split(",")} & {t.strip().upper() for t in str(b).split(",")})


def _bypass_input(node: Mapping[str, Any], slot: int) -> int | None:
    """The input a bypassed node passes through to output `slot` (the front end's rule)."""
    inputs = node.get("inputs") or []
    outputs = node.get("outputs") or []
    if not inputs:
        return None
    out_type = outputs[slot].get("type") if slot < len(outputs) else None
    if out_type in (None, "", "*"):
        return slot if slot < len(inputs) else 0
    if slot < len(inputs) and _types_match(inputs[slot].get("type"), out_type):
        return slot
    for match in (lambda t: t == out_type, lambda t: _types_match(t, out_type)):
        for i, inp in enumerate(inputs):
            if match(inp.get("type")):
                return i
    return None


class _Converter:
    """One conversion: resolves every input to its real source across reroutes, bypasses and subgraph borders."""

    def __init__(self, ui: Mapping[str, Any], classes: Mapping[str, type]) -> None:
        self.ui, self.classes = ui, classes
        self.subgraphs: dict[str, Mapping[str, Any]] = {}
        self._collect(ui)
        self.out: dict[str, dict[str, Any]] = {}
        self.linked: list[tuple[str, str]] = []  # (API node id, input name) of every input set from a link
        self._slots: dict[str, tuple[WidgetSlot, ...]] = {}
        self._scopes: dict[str, _Scope] = {}
        # where each API input's value is stored in the UI workflow (graph/workflow/uiedit.py writes there):
        self.widget_at: dict[tuple[str, str], tuple[Any, Any]] = {}  # (id, input) -> (widgets_values, index/key)
        self.source_at: dict[tuple[str, str], tuple] = {}  # ("value", container, key) or ("link", scope, node, i)

    def _collect(self, graph: Mapping[str, Any]) -> None:
        definitions = graph.get("definitions")
        for sg in (definitions.get("subgraphs") if isinstance(definitions, Mapping) else None) or ():
            if isinstance(sg, Mapping) and "id" in sg and str(sg["id"]) not in self.subgraphs:
                self.subgraphs[str(sg["id"])] = sg
                self._collect(sg)

    # -- scopes

    def top(self, ui: Mapping[str, Any]) -> _Scope:
        return _Scope("", {str(n["id"]): n for n in ui["nodes"]}, _links(ui.get("links")))

    def enter(self, scope: _Scope, instance: Mapping[str, Any]) -> _Scope:
        path = f"{scope.prefix}{instance['id']}"
        if path not in self._scopes:
            self._scopes[path] = self._enter(scope, instance, path)
        return self._scopes[path]

    def _enter(self, scope: _Scope, instance: Mapping[str, Any], path: str) -> _Scope:
        sg = self.subgraphs[str(instance["type"])]
        outer: _Scope | None = scope
        while outer is not None:
            if outer.definition is sg:
                raise WorkflowFormatError(
                    f"Node {path}: subgraph {sg.get('name') or sg['id']!r} contains itself",
                    "remove the recursive subgraph instance in ComfyUI and save the workflow again",
                    {"node_id": path, "subgraph": str(sg["id"])})
            outer = outer.parent
        nodes = {str(n["id"]): n for n in sg.get("nodes") or () if isinstance(n, Mapping) and "id" in n}
        links = _links(sg.get("links"))
        promoted = self._promoted(sg, instance, nodes, links, path)
        return _Scope(f"{path}:", nodes, links, sg, instance, scope, promoted)

    @staticmethod
    def _promoted(sg: Mapping[str, Any], instance: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]],
                  links: Mapping[str, _Link], where: str) -> dict[str, Any]:
        """The instance's widgets_values by subgraph input name.

        The front end gives an instance one widget per subgraph input that feeds an inner widget, in the
        subgraph's input order, and stores no control_after_generate values for them. Newer front ends
        ("proxyWidgets") store nothing on the instance: the values stay in the inner nodes.
        """
        names = []
        for sg_input in sg.get("inputs") or ():
            for link_id in sg_input.get("linkIds") or ():
                link = links.get(str(link_id))
                target = nodes.get(link.target_id) if link else None
                if target is None:
                    continue
                fed = [inp for inp in target.get("inputs") or () if str(inp.get("link")) == str(link_id)]
                if any(inp.get("widget") for inp in fed):
                    names.append(sg_input.get("name"))
                    break
        values = instance.get("widgets_values")
        if isinstance(values, Mapping):
            return {n: (values[n], values, n) for n in names if n in values}
        if not isinstance(values, list) or not values:
            return {}
        if len(values) != len(names):
            log.warning("subgraph instance %s stores %d widget values for %d promoted widgets (%s); using the "
                        "inner nodes' own values", where, len(values), len(names), ", ".join(map(str, names)))
            return {}
        return {n: (values[i], values, i) for i, n in enumerate(names)}

    # -- resolution

    def resolve_input(self, scope: _Scope, node: Mapping[str, Any], index: int, seen: set) -> _Source:
        inputs = node.get("inputs") or []
        if index >= len(inputs) or inputs[index].get("link") is None:
            return None
        link = scope.links.get(str(inputs[index]["link"]))
        if link is None:
            return None
        if link.origin_id == SUBGRAPH_INPUT_ID and scope.definition is not None:
            return self.resolve_subgraph_input(scope, link.origin_slot, seen)
        return self.resolve_output(scope, link.origin_id, link.origin_slot, seen)

    def resolve_subgraph_input(self, inner: _Scope, index: int, seen: set) -> _Source:
        sg_inputs = inner.definition.get("inputs") or []
        if index >= len(sg_inputs) or inner.instance is None or inner.parent is None:
            return None
        name = sg_inputs[index].get("name")
        for j, inp in enumerate(inner.instance.get("inputs") or ()):
            if inp.get("name") == name and inp.get("link") is not None:
                return self.resolve_input(inner.parent, inner.instance, j, seen)
        if inner.promoted and name in inner.promoted:
            value, container, key = inner.promoted[name]
            return _Value(value, (container, key))
        return UNSET

    def resolve_output(self, scope: _Scope, node_id: str, slot: int, seen: set) -> _Source:
        key = (scope.prefix, node_id, slot)
        node = scope.nodes.get(node_id)
        if node is None or key in seen:  # a dangling link, or a cycle through reroutes or bypasses
            return None
        seen.add(key)
        kind = str(node.get("type"))
        if kind == "Reroute":
            return self.resolve_input(scope, node, 0, seen)
        if kind == "PrimitiveNode":
            values = node.get("widgets_values")
            if isinstance(values, list) and values:
                return _Value(values[0], (values, 0))
            return _Value(values["value"], (values, "value")) if isinstance(values, Mapping) and "value" in values \
                else None
        if kind in NOTE_TYPES or node.get("mode") == MODE_NEVER:
            return None
        if node.get("mode") == MODE_BYPASS:
            index = _bypass_input(node, slot)
            return None if index is None else self.resolve_input(scope, node, index, seen)
        if kind in self.subgraphs:
            inner = self.enter(scope, node)
            for link in inner.links.values():
                if link.target_id == SUBGRAPH_OUTPUT_ID and link.target_slot == slot:
                    if link.origin_id == SUBGRAPH_INPUT_ID:
                        found = self.resolve_subgraph_input(inner, link.origin_slot, seen)
                        return None if found is UNSET else found
                    return self.resolve_output(inner, link.origin_id, link.origin_slot, seen)
            return None
        return _Out(scope.prefix + node_id, slot)

    # -- emission

    def emit_scope(self, scope: _Scope) -> None:
        for node_id, node in scope.nodes.items():
            kind = str(node.get("type"))
            if node.get("mode") in (MODE_NEVER, MODE_BYPASS) or kind in UI_ONLY_TYPES:
                continue
            if kind in self.subgraphs:
                self.emit_scope(self.enter(scope, node))
            else:
                self.emit_node(scope, node_id, node, kind)

    def emit_node(self, scope: _Scope, node_id: str, node: Mapping[str, Any], kind: str) -> None:
        inputs: dict[str, Any] = {}
        meta: dict[str, Any] = {"title": node.get("title") or kind}
        cls = self.classes.get(kind)
        if cls is None and isinstance(node.get("widgets_values"), list | Mapping):
            # a type we do not know: its widgets cannot be named, but what they hold (a model file, a loader's type)
            # tells validation which model the workflow is for (graph/workflow/families.py)
            meta["widgets_values"] = copy.deepcopy(node["widgets_values"])
        if cls is not None:
            if kind not in self._slots:
                self._slots[kind] = widget_slots(cls)
            inputs.update(copy.deepcopy(widget_values(node, self._slots[kind])))
            stored = node.get("widgets_values")
            if isinstance(stored, Mapping):
                self.widget_at.update({(scope.prefix + node_id, name): (stored, name) for name in inputs})
            elif isinstance(stored, list):
                self.widget_at.update({(scope.prefix + node_id, slot.name): (stored, i)
                                       for slot, i in widget_positions(self._slots[kind], stored)})
        for index, inp in enumerate(node.get("inputs") or ()):
            name = inp.get("name")
            if name is None or inp.get("link") is None:
                continue
            source = self.resolve_input(scope, node, index, set())
            if source is UNSET:
                continue  # an unconnected subgraph input: the widget keeps its own value
            if source is None:
                inputs.pop(name, None)
            elif isinstance(source, _Out):
                inputs[name] = [source.node, source.slot]
                self.linked.append((scope.prefix + node_id, name))
                self.source_at[(scope.prefix + node_id, name)] = ("link", scope, node, index)
            else:
                inputs[name] = copy.deepcopy(source.value)
                if source.origin is not None:
                    self.source_at[(scope.prefix + node_id, name)] = ("value", *source.origin)
        self.out[scope.prefix + node_id] = {"inputs": inputs, "class_type": kind, "_meta": meta}


def ui_to_api(ui: Mapping[str, Any], nodes: Mapping[str, type]) -> dict:
    """Convert a UI-format workflow to the API format, as ComfyUI's front end does when queueing it."""
    return convert(ui, nodes).out


def convert(ui: Mapping[str, Any], nodes: Mapping[str, type]) -> _Converter:
    """`ui_to_api`'s converter after the conversion: `.out` is the API prompt, `.widget_at` and `.source_at` say
    where in `ui` each input's value came from."""
    if not is_ui_format(ui):
        raise WorkflowFormatError("not a UI-format workflow", EXPECTED)
    conv = _Converter(ui, nodes)
    conv.emit_scope(conv.top(ui))
    for node_id, name in conv.linked:  # like the front end: drop links to nodes that were not emitted
        value = conv.out[node_id]["inputs"].get(name)
        if is_link(value) and value[0] not in conv.out:
            del conv.out[node_id]["inputs"][name]
    return conv


__all__ = ["Workflow", "WorkflowFormatError", "is_api_format", "is_ui_format", "load_workflow", "ui_to_api",
           "widget_slots", "widget_values"]
