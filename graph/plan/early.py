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
order grouped stage by stage (graph/plan/planner.py `plan`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...nodes.types import Variant

_NONE: frozenset[str] = frozenset()


class FinishEarly:
    """The pass for one graph, its nodes' variants and one budget; what does not depend on the order (which nodes
    finish, how many inputs each waits for, the activations left per set of models) is found once, since the planner
    runs the pass on more than one order of the same nodes. Nodes are numbers (graph/plan/order.py `Shape`) and sets of
    models are numbered by first appearance: the pass walks lists by those numbers."""

    def __init__(self, succs: Sequence[Sequence[int]], topo: Sequence[int], prov: Sequence[Variant],
                 weights: Mapping[str, int], gpu: int, resident: Sequence[str] = ()) -> None:
        """`succs`: the consumers of each node (by number); `topo`: the nodes in a topological order; `prov`: each
        node's variant."""
        self.weights, self.gpu, self.resident = weights, gpu, list(resident)
        self.succs = succs
        n = len(succs)
        number: dict[tuple[str, ...], tuple[int, tuple[str, ...]]] = {}  # a models tuple -> (its set's number, its
        #                                                                   models without repeats, in their order)
        self.sets: list[frozenset[str]] = []  # per set number: the models
        self.left: list[dict[int, int]] = []  # per set: activation -> nodes with it
        need = self.need = [0] * n  # per node: the number of its set of models
        uses: list[tuple[str, ...]] = [()] * n  # per node: its models without repeats
        self.acts = [v.activation for v in prov]  # per node: its activation
        self.models = [v.models for v in prov]  # per node: its models
        self.uses = uses
        for i in topo:
            v = prov[i]
            models, a = v.models, v.activation
            got = number.get(models)
            if got is None:
                key = frozenset(models)
                k = next((j for j, x in enumerate(self.sets) if x == key), None)
                if k is None:
                    k = len(self.sets)
                    self.sets.append(key)
                    self.left.append({})
                got = number[models] = k, tuple(dict.fromkeys(models))
            need[i], uses[i] = got
            c = self.left[got[0]]
            c[a] = c.get(a, 0) + 1
        reach: list[frozenset[str]] = [_NONE] * n  # the models each node and its descendants need
        finishing = [False] * n
        waiting = self.waiting = [0] * n  # inputs of each node (before any has run)
        sets = self.sets
        for i in reversed(topo):
            got = _NONE  # the models its descendants need
            for s in succs[i]:
                waiting[s] += 1
                r = reach[s]
                if not r <= got:
                    got = r if not got else got | r
            own = sets[need[i]]
            if got <= own:
                finishing[i] = True
                reach[i] = own
            else:
                reach[i] = got if own <= got else got | own
        self.finishing = finishing
        self.ends = [i for i, f in enumerate(finishing) if f]

    def __call__(self, order: Sequence[int]) -> list[int]:
        """`order` (the same nodes) with each finishing node moved up to the first point where it is ready and free
        (module docstring).

        Each step picks the first node of the order left that is finishing, ready and free, else the first one left.
        Whether a node is free depends only on its set of models, so nodes are kept by that set: for each set, the
        ready finishing nodes (earliest first) and the activations of the nodes left, whose largest is what has to
        fit."""
        ends = self.ends
        if not ends:
            return list(order)
        finishing, need, uses, succs, weights, gpu = (self.finishing, self.need, self.uses, self.succs, self.weights,
                                                      self.gpu)
        sets, acts, models = self.sets, self.acts, self.models
        at = order
        pos = [0] * len(at)  # per node: its position in the order
        for p, i in enumerate(at):
            pos[i] = p
        waiting = self.waiting[:]  # inputs not yet run
        left = [dict(c) for c in self.left]  # per set of models: activation -> nodes left with it
        top = {k: max(c) for k, c in enumerate(left) if c}  # the largest activation left per set (absent: none left)
        ready: dict[int, list[int]] = {need[i]: [] for i in ends}  # per set: positions of ready finishing nodes
        for i in ends:
            if not waiting[i]:
                heapq.heappush(ready[need[i]], pos[i])
        res: list[str] = list(self.resident)  # least recently used first
        held = sum(weights[m] for m in res)
        done = [False] * len(at)  # per position: run
        out: list[int] = []
        first = 0  # position of the first node left
        known: dict[int, bool] = {}  # free(set), while `res` and `top` stay as they are

        def free(key: int) -> bool:
            got = known.get(key)
            if got is None:
                joined = sets[key].union(res)
                held = sum(weights[m] for m in joined)
                got = known[key] = all(held + a <= gpu for k, a in top.items() if sets[k] <= joined)
            return got

        for _ in range(len(at)):
            p = -1  # the position picked
            for key, heap in ready.items():
                while heap and done[heap[0]]:
                    heapq.heappop(heap)
                if heap and (p < 0 or heap[0] < p) and free(key):
                    p = heap[0]
            if p < 0:
                while done[first]:
                    first += 1
                p = first
            done[p] = True
            pick = at[p]
            out.append(pick)
            key, a = need[pick], acts[pick]
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
                if not waiting[s] and finishing[s] and not done[pos[s]]:
                    heapq.heappush(ready[need[s]], pos[s])
            changed = False
            for m in uses[pick]:
                if m in res:
                    res.remove(m)
                else:
                    held += weights[m]
                    changed = True
                res.append(m)
            if held + a > gpu:
                held, dropped = evict_lru(res, models[pick], held, a, gpu, weights.__getitem__)
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
