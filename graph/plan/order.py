"""The planner's orders of the nodes (graph/plan/planner.py passes 1 and its grouped candidate), the host RAM that node
outputs hold along an order, and the graph's shape as the passes read it.

Pure: it sees the DAG, each node's provisional variant and sizes, never tensors.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import networkx as nx

from .early import evict_lru
from .types import NodeCost, Residency, gib

if TYPE_CHECKING:
    from ...nodes.types import Variant
    from .sizes import Sizes

log = logging.getLogger(__name__)


def cycle_error(dag: nx.DiGraph) -> ValueError | None:
    """The error for a graph with a cycle, None for one without. Asked only where planning stops, so that a cycle is
    named before any other fault; a graph that passes the checks is found cyclic by pass 1, which cannot order the
    nodes of a cycle (a check of its own up front took a twentieth of a 64-prompt plan)."""
    if nx.is_directed_acyclic_graph(dag):
        return None
    cycle = nx.find_cycle(dag)
    return ValueError(f"the graph has a cycle through {[u for u, _ in cycle]}; break it to plan")


def uses_gpu(v: Variant) -> bool:
    """Whether a variant uses the GPU: a model resident or streamed, or GPU bytes of its own."""
    return bool(v.models or v.streams or v.activation or v.blocks is not None)


class Shape:
    """The graph as the passes read it, its nodes numbered. A node that needs nothing (one variant that uses no GPU,
    `uses_gpu`, and outputs that hold no host RAM: a loader, a save, ComfyUI's guider and noise nodes) runs as soon as
    its inputs are ready: the passes order only the others (`names`, numbered 0.. in the DAG's order, so that the
    lowest number is the earliest in the graph), with an edge u -> v wherever v reads u's output directly or through
    nodes that need nothing, and `expand` puts the rest of an order's nodes back in (numbered apart, in the DAG's
    order too). In a queue of ComfyUI's own nodes that is more than half the nodes (noise, guider, zeroed
    conditioning, save), and all of the planner's passes cost per node. The passes keep their per-node facts in
    lists by these numbers, and their orders are lists of numbers: a list index costs less than a dict's lookup by
    name, and nothing is looked up by name twice.

    An output's host RAM (`NodeCost.host_bytes`, `hb`) lives until every node that reads it has run, directly or
    through nodes that need nothing (which hold no RAM of their own: they pass their inputs on, as a guider holds the
    conditioning until the sampler runs); `holders`/`releases` say which runs those are, once for all the orders the
    passes try."""

    def __init__(self, dag: nx.DiGraph, nodes: list[str], free: set[str], costs: Mapping[str, NodeCost]) -> None:
        """`nodes`: the DAG's nodes in its order; `free`: those that need nothing."""
        self.names = names = [n for n in nodes if n not in free] if free else list(nodes)
        self.costs = [costs[n] for n in names]  # per number: its NodeCost
        number = {n: i for i, n in enumerate(names)}
        self.free_names = frees = [n for n in nodes if n in free] if free else []
        self.free_costs = [costs[f] for f in frees]
        fnum = {f: j for j, f in enumerate(frees)}
        raw: list[Any] = [None] * len(names)  # per number: its inputs in the DAG (a dict of them)
        fraw: list[Any] = [None] * len(frees)
        for n, before in nx.reverse_view(dag).adjacency():  # (networkx's per-node views cost more than a pass)
            i = number.get(n)
            if i is not None:
                raw[i] = before
            else:
                fraw[fnum[n]] = before
        self.free_succs: list[list[int]] = [[] for _ in frees]  # per free node: its free consumers
        self.waits = [0] * len(frees)  # per free node: its inputs from free nodes
        for j, before in enumerate(fraw):
            for x in before:
                k = fnum.get(x)
                if k is not None:
                    self.free_succs[k].append(j)
                    self.waits[j] += 1
        self.gate = gate = self._gates(dag, fraw, number, fnum, self.free_succs, self.waits)

        self.preds: list[list[int]] = []  # per number: its inputs, those that need nothing replaced by the nodes
        #                                   they wait for, without repeats
        for before in raw:
            xs: list[int] = []
            through = False  # an input that needs nothing and waits for a node
            for x in before:
                j = number.get(x)
                if j is not None:
                    xs.append(j)
                else:
                    g = gate[fnum[x]]
                    if g:
                        xs += g
                        through = True
            self.preds.append(list(dict.fromkeys(xs)) if through else xs)
        self.succs: list[list[int]] = [[] for _ in names]
        for i, xs in enumerate(self.preds):
            for p in xs:
                self.succs[p].append(i)
        self.hb = [nc.host_bytes for nc in self.costs]
        self.holders = [-1] * len(names)  # per node whose output holds host RAM: the runs that free it (-1: none held)
        self.releases: list[Any] = [()] * len(names)  # per node: the outputs its run may free
        for i, b in enumerate(self.hb):
            if b:
                readers = self.succs[i]
                self.holders[i] = len(readers)
                for r in readers:
                    got = self.releases[r]
                    if got:
                        got.append(i)
                    else:
                        self.releases[r] = [i]
        self.gated: list[Any] = [()] * len(names)  # per node: the free nodes that wait for it
        for j, g in enumerate(gate):
            for i in g:
                got = self.gated[i]
                if got:
                    got.append(j)
                else:
                    self.gated[i] = [j]

    @staticmethod
    def _gates(dag: nx.DiGraph, fraw: list[Any], number: Mapping[str, int], fnum: Mapping[str, int],
               free_succs: list[list[int]], waits: list[int]) -> list[tuple[int, ...]]:
        """Per node that needs nothing, the other nodes whose runs it waits for, directly or through nodes that need
        nothing (in an order where its free inputs come first)."""
        waiting = waits[:]
        ready = [j for j, w in enumerate(waiting) if not w]
        gate: list[Any] = [None] * len(fraw)
        done = 0
        while ready:
            j = ready.pop()
            done += 1
            got: list[int] = []
            for x in fraw[j]:
                k = number.get(x)
                if k is not None:
                    got.append(k)
                else:
                    got += gate[fnum[x]]
            gate[j] = tuple(dict.fromkeys(got)) if len(got) > 1 else tuple(got)
            for c in free_succs[j]:
                waiting[c] -= 1
                if not waiting[c]:
                    ready.append(c)
        if done < len(fraw):  # nodes that need nothing on a cycle of their own
            raise cycle_error(dag) or RuntimeError("nodes that need nothing on a cycle of their own")
        return gate

    def expand(self, order: list[int]) -> tuple[list[int], dict[int, list[int]]]:
        """The nodes that need nothing placed along `order` (of numbers): those that run before it, and per node of
        `order` those that run right after it; each as soon as it is ready, the earliest in the graph first."""
        gate, free_succs, waits = self.gate, self.free_succs, self.waits
        if not gate:
            return [], {}
        waiting = [len(g) + w for g, w in zip(gate, waits, strict=True)]  # runs and free inputs it still waits for
        ready = [j for j, w in enumerate(waiting) if not w]  # (ascending: a heap)
        first = heap_order(ready, waiting, free_succs)
        after: dict[int, list[int]] = {}
        gated = self.gated
        for n in order:
            fs = gated[n]
            if not fs:
                continue
            for f in fs:
                waiting[f] -= 1
                if not waiting[f]:
                    heapq.heappush(ready, f)
            if len(ready) == 1 and not free_succs[ready[0]]:  # (most: a save after its decode)
                after[n] = [ready.pop()]
            elif ready:
                after[n] = heap_order(ready, waiting, free_succs)
        return first, after


def heap_order(ready: list[Any], waiting: Any, succs: Any, key: Any = None) -> list[Any]:
    """Kahn's algorithm, the least key first: `ready` a heap of the keys of the nodes that wait for nothing (each key
    ends with its node; without `key`, the nodes themselves), `waiting` what each other node still waits for (counted
    down as they run)."""
    out = []
    pop, push = heapq.heappop, heapq.heappush
    while ready:
        n = pop(ready) if key is None else pop(ready)[-1]
        out.append(n)
        for s in succs[n]:
            waiting[s] -= 1
            if not waiting[s]:
                push(ready, s if key is None else key[s])
    return out


def run_order(shape: Shape, sizes: Sizes, gpu: int, prov: list[Variant], start: Residency, host_limit: int
              ) -> tuple[list[int], int]:
    """Pass 1: the run order of the shape's nodes (numbers; plan/planner.py) and the peak of host bytes held by live
    outputs."""
    preds, succs, releases, hb = shape.preds, shape.succs, shape.releases, shape.hb
    indeg = [len(p) for p in preds]
    left = shape.holders[:]  # per output that holds host RAM: the runs left that free it
    resident: list[str] = sorted(start.gpu)  # least recently used first
    live = peak = 0
    order: list[int] = []

    # ready nodes in groups of equal (models, activation, host bytes): they rank alike, earliest first in each (a
    # heap of numbers); a group by its number (`keys`: its fields, `need`: its models without repeats)
    group: list[int] = []
    number: dict[tuple, int] = {}
    keys: list[tuple[tuple[str, ...], int, int]] = []
    for v, b in zip(prov, hb, strict=True):
        k = (v.models, v.activation, b)
        g = number.get(k)
        if g is None:
            g = number[k] = len(keys)
            keys.append(k)
        group.append(g)
    need = [sizes.unique(k[0]) for k in keys]
    held_out = [k[2] for k in keys]
    uses = Counter()  # runs left that need each model
    for g, c in Counter(group).items():
        for m in need[g]:
            uses[m] += c

    def freed(n: int) -> int:
        return sum(hb[p] for p in releases[n] if left[p] == 1) + (hb[n] if left[n] == 0 else 0)

    def rank(g: int, res: set[str], held: int) -> tuple[bool, bool]:
        """(its models are not all resident, running it now would push out a resident model that a later run
        still needs: e.g. a decode that does not fit beside the transformer while other prompts still sample)."""
        models, act = keys[g][0], keys[g][1]
        missing = [m for m in need[g] if m not in res]
        over = held + sum(sizes.w(m) for m in missing) + act - gpu
        if over <= 0:
            return bool(missing), False
        dead = sum(sizes.w(m) for m in res if m not in models and uses[m] == 0)
        return bool(missing), over > dead

    groups: dict[int, list[int]] = {}
    for n, d in enumerate(indeg):
        if not d:
            groups.setdefault(group[n], []).append(n)  # (ascending: a heap)
    res = set(resident)
    held = sum(sizes.w(m) for m in resident)
    ranks: dict[int, tuple[bool, bool]] = {}  # rank(g), while the set of resident models and that of the models
    #                                           no run left needs stay as they are
    while groups:
        key, best, first = -1, (True, True), 0  # the group of the least (rank, earliest node) among those that fit
        #                                         in host RAM
        for g, h in groups.items():
            if live + held_out[g] <= host_limit:
                r = ranks.get(g)
                if r is None:
                    r = ranks[g] = rank(g, res, held)
                if key < 0 or r < best or (r == best and h[0] < first):
                    key, best, first = g, r, h[0]
        if key >= 0:
            h = groups[key]
            pick = heapq.heappop(h)
        else:  # nothing fits in host RAM: the node that leaves the least held, earliest first
            pick = min((n for h in groups.values() for n in h), key=lambda n: (live + hb[n] - freed(n), n))
            key = group[pick]
            h = groups[key]
            h.remove(pick)
            heapq.heapify(h)
            log.warning("node outputs need %s GiB of host RAM at %r, above the %s GiB available",
                        gib(live + hb[pick]), shape.names[pick], gib(host_limit))
        if not h:
            del groups[key]
        b = hb[pick]
        if b:
            if live + b > peak:
                peak = live + b
            live += b
            if not left[pick]:  # read by no one: gone at once
                live -= b
        for p in releases[pick]:
            left[p] -= 1
            if not left[p]:
                live -= hb[p]
        order.append(pick)
        for n in succs[pick]:
            indeg[n] -= 1
            if not indeg[n]:
                h = groups.get(group[n])
                if h is None:
                    groups[group[n]] = [n]
                else:
                    heapq.heappush(h, n)
        v = prov[pick]
        if not v.models and not v.activation:
            continue
        for m in need[key]:
            uses[m] -= 1
            if not uses[m]:
                ranks.clear()
            if m in res:
                resident.remove(m)
            else:
                res.add(m)
                held += sizes.w(m)
                ranks.clear()
            resident.append(m)
        if held + v.activation > gpu:
            held, dropped = evict_lru(resident, v.models, held, v.activation, gpu, sizes.w)
            if dropped:
                res.difference_update(dropped)
                ranks.clear()
    return order, peak


def grouped_order(order: list[int], shape: Shape, prov: list[Variant]) -> list[int]:
    """`order` regrouped stage by stage: a topological order that runs next, among the ready nodes, one that needs no
    GPU (a save), else one of the class that came first in `order`, the earliest first: a queue's encodes, then its
    references, samples and decodes, each for every prompt."""
    rank: dict[str, int] = {}
    costs = shape.costs
    for n in order:
        rank.setdefault(costs[n].class_type, len(rank))
    key: list[Any] = [None] * len(order)  # each node's heap key: (-1 for a node that needs no GPU, else its class's
    #                                       rank; position; node)
    for i, n in enumerate(order):
        v = prov[n]
        key[n] = -1 if not (v.models or v.streams or v.activation) else rank[costs[n].class_type], i, n
    preds, succs = shape.preds, shape.succs
    # the heap below picks the least key among the ready nodes: where all nodes sorted by key are in a topological
    # order (a queue's stages: encodes, then samples...), that order is what it makes, at a fraction of the time
    ranked = [k[2] for k in sorted(key)]
    at = [0] * len(ranked)
    for i, n in enumerate(ranked):
        at[n] = i
    if all(at[p] < i for i, n in enumerate(ranked) for p in preds[n]):
        return ranked
    indeg = [len(p) for p in preds]
    ready = [key[n] for n in order if not indeg[n]]
    heapq.heapify(ready)
    return heap_order(ready, indeg, succs, key)


def host_peak(order: list[int], shape: Shape) -> int:
    """The most host RAM that live node outputs hold along `order` (an output lives until its last reader ran)."""
    left = shape.holders[:]
    releases, hb = shape.releases, shape.hb
    live = peak = 0
    for n in order:
        b = hb[n]
        if b:
            live += b
            if live > peak:
                peak = live
            if not left[n]:  # read by no one: gone at once
                live -= b
        for p in releases[n]:
            left[p] -= 1
            if left[p] == 0:
                live -= hb[p]
    return peak
