"""Values set on the API prompt (`--set NODE.INPUT=VALUE`) written back into the UI workflow it came from.

The PNGs a run writes carry the UI workflow in their `workflow` chunk; ComfyUI opens that chunk, so it must
hold the values that ran, or opening the PNG in ComfyUI would not make the same picture. Each set input is
written where the UI stores it, as `graph.workflow.parse`'s conversion found it: the node's own widget, the legacy
PrimitiveNode that feeds it, or the subgraph instance's promoted widget; an input that was linked and is set
to a literal is unlinked first (as a widget converted back from an input). The edited workflow is then
converted again and must give exactly the API prompt that runs; when it does not (a value the UI cannot hold,
such as one node inside a subgraph that several instances share), there is no faithful UI workflow to write
and `ui_with_sets` says why instead.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from .parse import SUBGRAPH_INPUT_ID, WorkflowFormatError, convert, ui_to_api


def ui_with_sets(ui: Mapping[str, Any], targets: Iterable[tuple[str, str, Any]], nodes: Mapping[str, type]
                 ) -> tuple[dict | None, str]:
    """A copy of `ui` with each (API node id, input name, value) of `targets` written in, and "" — or None and the
    reason when the UI workflow cannot hold those values."""
    edited = copy.deepcopy(dict(ui))
    try:
        conv = convert(edited, nodes)
    except WorkflowFormatError as e:
        return None, str(e)
    expected = copy.deepcopy(conv.out)
    for node_id, name, value in targets:
        where = f"{node_id}.{name}"
        if node_id not in expected:
            return None, f"node {node_id} is not in the UI workflow"
        expected[node_id]["inputs"][name] = copy.deepcopy(value)
        source = conv.source_at.get((node_id, name))
        if source is not None and source[0] == "value":  # a PrimitiveNode's value, or a promoted subgraph widget
            _, container, key = source
            container[key] = copy.deepcopy(value)
            continue
        if source is not None and source[0] == "link":
            _unlink(edited, *source[1:])
        widget = conv.widget_at.get((node_id, name))
        if widget is None:
            return None, f"the UI workflow stores no widget value for {where}"
        container, key = widget
        container[key] = copy.deepcopy(value)
    got = ui_to_api(edited, nodes)
    changed = sorted(f"{i}.{n}" for i in set(got) | set(expected)
                     for n in set(got.get(i, {}).get("inputs", {})) | set(expected.get(i, {}).get("inputs", {}))
                     if got.get(i, {}).get("inputs", {}).get(n) != expected.get(i, {}).get("inputs", {}).get(n))
    if changed:
        return None, (f"the UI workflow cannot hold these values: writing them changes {', '.join(changed[:5])} "
                      "(a node inside a subgraph that several instances share holds one value for all of them)")
    return edited, ""


def _unlink(ui: dict, scope: Any, node: dict, index: int) -> None:
    """Remove the link into input `index` of `node` (in `scope`: the top level, or a subgraph definition)."""
    inp = node["inputs"][index]
    link_id = inp.get("link")
    inp["link"] = None
    holder = ui if scope.definition is None else scope.definition
    raw = holder.get("links") or []
    origin = None
    for i, entry in enumerate(raw):
        lid = entry.get("id") if isinstance(entry, Mapping) else entry[0] if isinstance(entry, list) else None
        if str(lid) == str(link_id):
            origin = entry.get("origin_id") if isinstance(entry, Mapping) else entry[1]
            del raw[i]
            break
    if origin is None or str(origin) == SUBGRAPH_INPUT_ID:
        if scope.definition is not None:  # the subgraph input's own list of the links it feeds
            for sg_input in scope.definition.get("inputs") or ():
                ids = sg_input.get("linkIds")
                if isinstance(ids, list):
                    sg_input["linkIds"] = [x for x in ids if str(x) != str(link_id)]
        return
    for n in holder.get("nodes") or ():
        if str(n.get("id")) == str(origin):
            for out in n.get("outputs") or ():
                if isinstance(out.get("links"), list):
                    out["links"] = [x for x in out["links"] if str(x) != str(link_id)]


__all__ = ["ui_with_sets"]
