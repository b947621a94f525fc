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

import heapq
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import networkx as nx

if TYPE_CHECKING:
    from ..nodes.types import Variant

_NONE: frozenset[str] = frozenset()


def finish_early(order: Sequence[str], dag: nx.DiGraph, prov: Mapping[str, Variant], weights: Mapping[str, int],
                 gpu: int, resident: Sequence[str] = ()) -> list[str]:
    """`order` with each finishing node moved up to the first point where it is ready and free (module docstring).

    Each step picks the first node of the order left that is finishing, ready and free, else the first one left.
    Whether a node is free depends only on its set of models, so nodes are kept by that set: for each set, the ready
    finishing nodes (earliest first) and the activations of the nodes left, whose largest is what has to fit."""
    need = {n: frozenset(prov[n].models) for n in order}
    pos = {n: i for i, n in enumerate(order)}
    succ: dict[str, list[str]] = {n: [] for n in dag}
    waiting = dict.fromkeys(order, 0)  # predecessors not yet run
    topo = len(pos) == len(dag) and all(n in pos for n in dag)  # is `order` a topological order of the graph?
    for u, v in dag.edges:
        succ[u].append(v)
        if v in waiting:
            waiting[v] += 1
        topo = topo and pos[u] < pos[v]
    below: dict[str, frozenset[str]] = {}  # the models the descendants of each node need
    for n in reversed(order if topo else list(nx.topological_sort(dag))):
        got: frozenset[str] = frozenset()
        for s in succ[n]:
            got = got | need.get(s, _NONE) | below[s]
        below[n] = got
    finishing = {n for n in order if below[n] <= need[n]}
    if not finishing:
        return list(order)
    left: dict[frozenset[str], dict[int, int]] = {}  # per set of models: activation -> nodes left with it
    for n in order:
        c = left.setdefault(need[n], {})
        c[prov[n].activation] = c.get(prov[n].activation, 0) + 1
    top = {k: max(c) for k, c in left.items()}  # the largest activation left per set (absent: none left)
    ready: dict[frozenset[str], list[int]] = {need[n]: [] for n in finishing}  # per set: positions of ready
    #                                                                          finishing nodes
    for n in order:
        if n in finishing and not waiting[n]:
            heapq.heappush(ready[need[n]], pos[n])
    res: list[str] = list(resident)  # least recently used first
    held = sum(weights[m] for m in res)
    done: set[str] = set()
    out: list[str] = []
    first = 0  # position of the first node left
    known: dict[frozenset[str], bool] = {}  # free(set), while `res` and `top` stay as they are

    def free(key: frozenset[str]) -> bool:
        got = known.get(key)
        if got is None:
            joined = key.union(res)
            held = sum(weights[m] for m in joined)
            got = known[key] = all(held + a <= gpu for k, a in top.items() if k <= joined)
        return got

    while len(out) < len(order):
        pick = None
        for key, heap in ready.items():
            while heap and order[heap[0]] in done:
                heapq.heappop(heap)
            if heap and (pick is None or heap[0] < pos[pick]) and free(key):
                pick = order[heap[0]]
        if pick is None:
            while order[first] in done:
                first += 1
            pick = order[first]
        done.add(pick)
        out.append(pick)
        v = prov[pick]
        key, a = need[pick], v.activation
        c = left[key]
        c[a] -= 1
        if not c[a]:
            del c[a]
            if top[key] == a:
                if c:
                    top[key] = max(c)
                else:
                    del top[key]
                known.clear()
        for s in succ[pick]:
            if s in waiting:
                waiting[s] -= 1
                if not waiting[s] and s in finishing and s not in done:
                    heapq.heappush(ready[need[s]], pos[s])
        changed = False
        for m in dict.fromkeys(v.models):
            if m in res:
                res.remove(m)
            else:
                held += weights[m]
                changed = True
            res.append(m)
        while held + v.activation > gpu:
            victim = next((m for m in res if m not in v.models), None)
            if victim is None:
                break
            res.remove(victim)
            held -= weights[victim]
            changed = True
        if changed:
            known.clear()
    return out
