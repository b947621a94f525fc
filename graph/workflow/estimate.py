"""Shapes ahead of time: every node's output infos and cost, before anything runs.

`propagate` walks the graph in topological order and calls each node's `vg_estimate` with its input
infos, asking the model catalogue (nodes/catalog.py) what the loaders would load; `planner_inputs`
turns the costs into the planner's terms. Nothing here imports torch.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

import networkx as nx

from ...nodes.types import UNKNOWN, Cost, ModelInfo, is_link
from ..plan import planner
from ..plan.order import heap_order
from .errors import NodeExecutionError, _type_name


def inputs_of(prompt: Mapping[str, dict], node: str, values: Mapping[str, tuple]) -> dict[str, Any]:
    """A node's inputs with links replaced by the producing node's output at that slot."""
    out = {}
    for name, v in prompt[node]["inputs"].items():
        if is_link(v):
            src = values.get(v[0])
            out[name] = src[v[1]] if src is not None and v[1] < len(src) else UNKNOWN
        else:
            out[name] = v
    return out


def propagate(prompt: Mapping[str, dict], dag: nx.DiGraph, nodes: Mapping[str, type], env: Any,
              with_defaults: Any = None) -> dict[str, Cost]:
    """Every node's Cost (output infos, variants) in topological order; `with_defaults(cls, inputs)` fills defaults."""
    costs: dict[str, Cost] = {}
    outputs: dict[str, tuple] = {}
    for node in _topological(dag):
        cls = nodes[prompt[node]["class_type"]]
        inputs = inputs_of(prompt, node, outputs)
        unknown = [k for k, v in inputs.items() if v is UNKNOWN]
        if unknown and not getattr(cls, "UNPLANNED", None):  # fed by a node we only stand in for (nodes/foreign.py)
            src = prompt[node]["inputs"][unknown[0]][0]
            raise NodeExecutionError(node, prompt[node]["class_type"], (
                f"its input '{unknown[0]}' comes from node {src} ({prompt[src]['class_type']}), ComfyUI's own node, "
                "whose output vramgraph cannot know ahead of time, so this node cannot be planned; plan the graph "
                "without that node in front of ours"), "UnknownInput")
        if with_defaults is not None:
            inputs = with_defaults(cls, inputs)
        try:
            cost = cls.vg_estimate(env, **inputs)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # a missing or unreadable file, or a value the node cannot use: the node fails, by name, before any run
            raise NodeExecutionError(node, prompt[node]["class_type"], str(e), _type_name(type(e)),
                                     traceback.format_exception(e)) from e
        costs[node] = cost
        outputs[node] = cost.outputs
    return costs


def _part_key(part: str) -> tuple:
    """The sort key of one ':'-separated part of a node id: numbers by value, before names."""
    return (0, int(part), "") if part.isdigit() else (1, 0, part)


def _topological(dag: nx.DiGraph) -> list[str]:
    """`nx.lexicographical_topological_sort(dag, key=...)`'s order, the key a node id's parts' `_part_key`s: a node is
    taken as soon as its producers are, the least key (then the first in `dag`) first. Each node is ranked once, and
    the heap holds (rank, node): networkx's heap compares the keys' nested tuples, and its views cost more than the
    rest."""
    parts: dict[str, tuple] = {}  # each part keyed once: a queue's ids repeat theirs ("q12:5", "q12:6", "q13:5")

    def key(node: str) -> tuple:
        return tuple([parts[p] if p in parts else parts.setdefault(p, _part_key(p)) for p in node.split(":")])

    ranked = sorted(dag, key=key)  # stable: equal keys keep their order in dag, networkx's tie break
    rank = {n: (i, n) for i, n in enumerate(ranked)}
    succ = {n: list(after) for n, after in dag.adjacency()}
    waits = dict.fromkeys(ranked, 0)  # producers not yet taken
    for after in succ.values():
        for v in after:
            waits[v] += 1
    order = heap_order([rank[n] for n in ranked if not waits[n]], waits, succ, rank)  # (ascending: already a heap)
    if len(order) < len(ranked):
        raise nx.NetworkXUnfeasible("Graph contains a cycle or graph changed during iteration")
    return order


def planner_inputs(prompt: Mapping[str, dict], costs: Mapping[str, Cost]
                   ) -> tuple[dict[str, planner.NodeCost], dict[str, planner.ModelCost]]:
    """The planner's view: per node its variants, and every model any variant needs."""
    models: dict[str, planner.ModelCost] = {}
    node_costs = {}
    for node, cost in costs.items():
        for out in cost.outputs:
            if isinstance(out, ModelInfo):
                models[out.key] = planner.ModelCost(out.key, out.nbytes, out.label)
        node_costs[node] = planner.NodeCost(node, prompt[node]["class_type"], cost.variants, cost.host_bytes)
    return node_costs, models
