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
from typing import Any

import networkx as nx

from ...nodes.types import is_link


@dataclass(frozen=True)
class Merged:
    prompt: dict  # API format, all prompts
    members: tuple[dict[str, str], ...]  # per queued prompt: its node id -> id in the merged prompt


_PLAIN = (str, int, float, bool, type(None))
_KEY_TEXT = json.JSONEncoder(sort_keys=True, default=str)  # json.dumps(key, sort_keys=True, default=str), made once


def digest(key: Any) -> str:
    """The sha256 hex digest of `key` as JSON with sorted keys (other values by their str): what two nodes of a queue
    are merged by, and what a node's signature is made of (graph/engine/planning.py)."""
    return hashlib.sha256(_KEY_TEXT.encode(key).encode()).hexdigest()


class _NotPlain(Exception):
    pass


def _order(prompt: Mapping[str, dict]) -> list[str]:
    """`nx.topological_sort`'s order of the prompt's nodes (links to nodes not in it left out), on plain dicts: as
    networkx takes them, by generations, each in the order its nodes became ready (a graph per prompt cost a fifth of
    merging 64 prompts)."""
    consumers: dict[str, dict[str, None]] = {n: {} for n in prompt}  # a second link between two nodes is one edge
    for node, spec in prompt.items():
        for v in spec.get("inputs", {}).values():
            if is_link(v) and v[0] in prompt:
                consumers[v[0]][node] = None
    waits = dict.fromkeys(prompt, 0)
    for after in consumers.values():
        for n in after:
            waits[n] += 1
    order = [n for n in prompt if not waits[n]]
    for node in order:  # appended to while read: each generation after the one before
        for n in consumers[node]:
            waits[n] -= 1
            if not waits[n]:
                order.append(n)
    if len(order) < len(waits):
        raise nx.NetworkXUnfeasible("Graph contains a cycle or graph changed during iteration")
    return order


def _copied(spec: dict) -> dict:
    """`copy.deepcopy(spec)`, rebuilt directly when it is a shallow tree of dicts and lists of plain values, each met
    once (what JSON gives: deepcopy's bookkeeping took half of merging 64 prompts); anything else by deepcopy."""
    seen: set[int] = set()

    def rebuild(x: Any, depth: int) -> Any:  # x: not a plain value
        if type(x) not in (dict, list) or id(x) in seen or depth > 16:
            raise _NotPlain
        seen.add(id(x))
        if type(x) is list:
            return [v if type(v) in _PLAIN else rebuild(v, depth + 1) for v in x]
        return {k if type(k) in _PLAIN else rebuild(k, depth + 1): v if type(v) in _PLAIN else rebuild(v, depth + 1)
                for k, v in x.items()}

    try:
        return rebuild(spec, 0)
    except _NotPlain:
        return copy.deepcopy(spec)


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
            spec = _copied(dict(prompt[node]))
            spec["inputs"] = {k: [rename[v[0]], v[1]] if is_link(v) and v[0] in rename else v
                              for k, v in spec.get("inputs", {}).items()}
            key = digest([spec["class_type"], spec["inputs"]])
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
