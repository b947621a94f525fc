"""Several prompts planned as one graph, so N images share one load of each model.

`merge` renames every prompt's nodes to `q<i>:<id>` and keeps one copy of any node whose inputs are
identical in several prompts (the loaders, usually; an identical text encode too), except output
nodes. The planner then sees the whole queue at once and orders it by model (encode every prompt,
sample every latent, decode every latent) within the GPU and host RAM budgets. Each image is computed
by the same nodes with the same inputs as when its prompt runs alone, so it is the same image.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from ..nodes.types import is_link


@dataclass(frozen=True)
class Merged:
    prompt: dict  # API format, all prompts
    members: tuple[dict[str, str], ...]  # per queued prompt: its node id -> id in the merged prompt


def _order(prompt: Mapping[str, dict]) -> list[str]:
    g = nx.DiGraph()
    g.add_nodes_from(prompt)
    for node, spec in prompt.items():
        for v in spec.get("inputs", {}).values():
            if is_link(v) and v[0] in prompt:
                g.add_edge(v[0], node)
    return list(nx.topological_sort(g))


def needed(prompt: Mapping[str, dict], outputs: Sequence[str]) -> dict:
    """The part of `prompt` that `outputs` need: those nodes and every node they link to, transitively."""
    keep: set[str] = set()
    stack = [str(o) for o in outputs if str(o) in prompt]
    while stack:
        node = stack.pop()
        if node in keep:
            continue
        keep.add(node)
        inputs = prompt[node].get("inputs", {})
        stack.extend(v[0] for v in (inputs.values() if isinstance(inputs, Mapping) else ()) if is_link(v)
                     and v[0] in prompt)
    return {n: spec for n, spec in prompt.items() if n in keep}


def merge(prompts: Sequence[Mapping[str, dict]], output_types: frozenset[str] = frozenset()) -> Merged:
    """One API prompt for a queue of prompts; nodes with identical inputs are shared, outputs never."""
    merged: dict[str, dict] = {}
    by_signature: dict[str, str] = {}
    members = []
    for i, prompt in enumerate(prompts):
        rename: dict[str, str] = {}
        for node in _order(prompt):
            spec = copy.deepcopy(dict(prompt[node]))
            spec["inputs"] = {k: [rename[v[0]], v[1]] if is_link(v) and v[0] in rename else v
                              for k, v in spec.get("inputs", {}).items()}
            key = hashlib.sha256(json.dumps([spec["class_type"], spec["inputs"]], sort_keys=True,
                                            default=str).encode()).hexdigest()
            if spec["class_type"] not in output_types and key in by_signature:
                rename[node] = by_signature[key]
                continue
            new = f"q{i}:{node}"
            merged[new] = spec
            rename[node] = new
            if spec["class_type"] not in output_types:
                by_signature[key] = new
        members.append(rename)
    return Merged(merged, tuple(members))
