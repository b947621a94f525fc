"""Results as soon as they are free: a pass over the planner's run order that moves each node finishing an output
(a decode and its save, in a merged queue) to the earliest point where it costs no extra model move.

Pure (no torch): it sees the order, the DAG, each node's preferred variant and the models' sizes. A node *finishes*
when every node after it (its descendants) needs no model it does not need itself: the decode (its descendants, the
saves, need none) and the save (none after it). Such a node, once its inputs are ready, runs at once when its models
are resident or can join the resident ones without pushing any out, now or later: the resident weights with its models
added, plus the activation of every node left that uses only those models (the samplers that follow, the other
decodes), stay within the GPU budget. Its models are loaded once either way, so no byte moves that the grouped order
(encode all, sample all, decode all) would not move, and the first image is written after the first sample instead of
after the last. Residency along the order is sketched as in the order pass: models stay until the budget forces the
least recently used out.

The sketch counts a streamed node at its least need (its variant's `activation`), but the planner gives it whatever
room there is: a streamed sampler may push out the VAE that a decode here let in beside it, and the next decode loads
it again. So the planner keeps this order only where its residency moves no more bytes than pass 1's order or the
order grouped stage by stage (graph/planner.py `plan`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import networkx as nx

if TYPE_CHECKING:
    from ..nodes.types import Variant


def finish_early(order: Sequence[str], dag: nx.DiGraph, prov: Mapping[str, Variant], weights: Mapping[str, int],
                 gpu: int, resident: Sequence[str] = ()) -> list[str]:
    """`order` with each finishing node moved up to the first point where it is ready and free (module docstring)."""
    need = {n: set(prov[n].models) for n in order}
    after: dict[str, set[str]] = {}  # the models the node's descendants need
    for n in reversed(list(nx.topological_sort(dag))):
        after[n] = set().union(*(need.get(c, set()) | after[c] for c in dag.succ[n]))
    pending = [n for n in order if after[n] <= need[n]]  # the finishing nodes not yet placed, in order
    if not pending:
        return list(order)
    res: list[str] = list(resident)  # least recently used first
    left = list(order)
    waits = {n: dag.in_degree(n) for n in pending}  # inputs not yet computed
    out: list[str] = []

    def free(n: str) -> bool:
        joined = set(res) | need[n]
        held = sum(weights[m] for m in joined)
        return all(held + prov[m].activation <= gpu for m in left if need[m] <= joined)

    while left:
        pick = next((n for n in pending if not waits[n] and free(n)), left[0])
        left.remove(pick)
        if pick in waits:
            pending.remove(pick)
        for c in dag.succ[pick]:
            if c in waits:
                waits[c] -= 1
        out.append(pick)
        v = prov[pick]
        for m in dict.fromkeys(v.models):
            if m in res:
                res.remove(m)
            res.append(m)
        while sum(weights[m] for m in res) + v.activation > gpu:
            victim = next((m for m in res if m not in v.models), None)
            if victim is None:
                break
            res.remove(victim)
    return out
