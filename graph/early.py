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
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..nodes.types import Variant

_NONE: frozenset[str] = frozenset()


class FinishEarly:
    """The pass for one graph, its nodes' variants and one budget; what does not depend on the order (which nodes
    finish, how many inputs each waits for, the activations left per set of models) is found once, since the planner
    runs the pass on more than one order of the same nodes."""

    def __init__(self, topo: Sequence[str], succs: Mapping[str, Sequence[str]], prov: Mapping[str, Variant],
                 weights: Mapping[str, int], gpu: int, resident: Sequence[str] = ()) -> None:
        """`topo`: the graph's nodes in a topological order; `succs`: the consumers of each node."""
        self.succs, self.prov, self.weights, self.gpu, self.resident = succs, prov, weights, gpu, list(resident)
        sets: dict[tuple[str, ...], tuple[frozenset[str], tuple[str, ...]]] = {}  # one set per models tuple
        need: dict[str, frozenset[str]] = {}
        uses: dict[str, tuple[str, ...]] = {}  # each node's models without repeats, in their order
        self.left: dict[frozenset[str], dict[int, int]] = {}  # per set of models: activation -> nodes with it
        for n in topo:
            v = prov[n]
            got = sets.get(v.models)
            if got is None:
                got = sets[v.models] = (frozenset(v.models), tuple(dict.fromkeys(v.models)))
            need[n], uses[n] = got
            c = self.left.get(got[0])
            if c is None:
                c = self.left[got[0]] = {}
            c[v.activation] = c.get(v.activation, 0) + 1
        self.need, self.uses = need, uses
        reach: dict[str, frozenset[str]] = {}  # the models each node and its descendants need
        finishing = set()
        waiting = self.waiting = dict.fromkeys(topo, 0)  # inputs of each node (before any has run)
        for n in reversed(topo):
            got = _NONE  # the models its descendants need
            for s in succs[n]:
                waiting[s] += 1
                r = reach[s]
                if not r <= got:
                    got = r if not got else got | r
            own = need[n]
            if got <= own:
                finishing.add(n)
                reach[n] = own
            else:
                reach[n] = got if own <= got else got | own
        self.finishing = finishing

    def __call__(self, order: Sequence[str]) -> list[str]:
        """`order` (the same nodes) with each finishing node moved up to the first point where it is ready and free
        (module docstring).

        Each step picks the first node of the order left that is finishing, ready and free, else the first one left.
        Whether a node is free depends only on its set of models, so nodes are kept by that set: for each set, the
        ready finishing nodes (earliest first) and the activations of the nodes left, whose largest is what has to
        fit."""
        finishing, need, uses, succs, prov, weights, gpu = (self.finishing, self.need, self.uses, self.succs, self.prov,
                                                            self.weights, self.gpu)
        if not finishing:
            return list(order)
        pos = {n: i for i, n in enumerate(order)}
        waiting = dict(self.waiting)  # inputs not yet run
        left = {k: dict(c) for k, c in self.left.items()}  # per set of models: activation -> nodes left with it
        top = {k: max(c) for k, c in left.items()}  # the largest activation left per set (absent: none left)
        ready: dict[frozenset[str], list[int]] = {need[n]: [] for n in finishing}  # per set: positions of ready
        #                                                                          finishing nodes
        for n in finishing:
            if not waiting[n]:
                heapq.heappush(ready[need[n]], pos[n])
        res: list[str] = list(self.resident)  # least recently used first
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
            for s in succs[pick]:
                waiting[s] -= 1
                if not waiting[s] and s in finishing and s not in done:
                    heapq.heappush(ready[need[s]], pos[s])
            changed = False
            for m in uses[pick]:
                if m in res:
                    res.remove(m)
                else:
                    held += weights[m]
                    changed = True
                res.append(m)
            if held + v.activation > gpu:
                held, dropped = evict_lru(res, v.models, held, v.activation, gpu, weights.__getitem__)
                changed = changed or bool(dropped)
            if changed:
                known.clear()
        return out


def evict_lru(resident: list[str], keep: Collection[str], held: int, need: int, budget: int,
              weight: Callable[[str], int]) -> tuple[int, list[str]]:
    """The least-recently-used sketch of the GPU that the planner's orderings keep: drop the models of `resident`
    (oldest first) that are not in `keep` until `held` + `need` fits `budget` or none is left. Returns the bytes still
    held and the models dropped."""
    dropped = []
    while held + need > budget:
        victim = next((m for m in resident if m not in keep), None)
        if victim is None:
            break
        resident.remove(victim)
        held -= weight(victim)
        dropped.append(victim)
    return held, dropped
