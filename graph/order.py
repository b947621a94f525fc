"""The planner's orders of the nodes (graph/planner.py passes 1 and its grouped candidate), the host RAM that node
outputs hold along an order, and the graph's shape as the passes read it.

Pure: it sees the DAG, each node's provisional variant and sizes, never tensors.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

import networkx as nx

from .early import evict_lru
from .plantypes import NodeCost, Residency, gib

if TYPE_CHECKING:
    from ..nodes.types import Variant
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


def needs_nothing(nc: NodeCost) -> bool:
    """A node with one variant that uses no model, streams none and needs no GPU bytes, and whose outputs hold no host
    RAM (a loader, a save, ComfyUI's guider and noise nodes): where it runs changes nothing the planner counts."""
    return not nc.host_bytes and len(nc.variants) == 1 and not uses_gpu(nc.variants[0])


class Shape:
    """The graph as the passes read it. A node that needs nothing (`needs_nothing`) runs as soon as its inputs are
    ready: the passes order only the others (`nodes`), with an edge u -> v wherever v reads u's output directly or
    through nodes that need nothing, and `expand` puts the rest of an order's nodes back in. In a queue of ComfyUI's
    own nodes that is more than half the nodes (noise, guider, zeroed conditioning, save), and all of the planner's
    passes cost per node.

    An output's host RAM (`NodeCost.host_bytes`) lives until every node that reads it has run, directly or through
    nodes that need nothing (which hold no RAM of their own: they pass their inputs on, as a guider holds the
    conditioning until the sampler runs); `holders`/`releases` say which runs those are, once for all the orders the
    passes try."""

    def __init__(self, dag: nx.DiGraph, nodes: list[str], free: set[str], costs: Mapping[str, NodeCost]) -> None:
        """`nodes`: the DAG's nodes in its order; `free`: those that need nothing."""
        preds = {n: list(before) for n, before in nx.reverse_view(dag).adjacency()}  # (networkx's per-node views
        #                                                                              cost more than a pass)
        self.pos = {n: i for i, n in enumerate(nodes)}
        self.nodes = [n for n in nodes if n not in free] if free else nodes
        frees = [n for n in nodes if n in free] if free else []  # (in the graph's order: the same plan every time)
        self.free_succs: dict[str, list[str]] = {f: [] for f in frees}  # per free node: its free consumers
        self.waits = dict.fromkeys(frees, 0)  # per free node: its inputs from free nodes
        for f in frees:
            for p in preds[f]:
                if p in free:
                    self.free_succs[p].append(f)
                    self.waits[f] += 1
        self.gate = gate = self._gates(dag, frees, preds, free, self.free_succs, self.waits)

        gating = {f for f in frees if gate[f]}  # (the others, a loader say, wait for no node)

        if free:  # each node's inputs, those that need nothing replaced by the nodes they wait for, without repeats
            self.preds = {}
            for n in self.nodes:
                xs = preds[n]
                if not free.isdisjoint(xs):
                    if gating.isdisjoint(xs):
                        xs = [x for x in xs if x not in free]
                    else:
                        xs = list(dict.fromkeys([y for x in xs for y in (gate[x] if x in free else (x,))]))
                self.preds[n] = xs
        else:
            self.preds = preds
        self.succs: dict[str, list[str]] = {n: [] for n in self.nodes} if free else \
            {n: list(after) for n, after in dag.adjacency()}
        if free:
            for n in self.nodes:
                for p in self.preds[n]:
                    self.succs[p].append(n)
        self.holders: dict[str, int] = {}  # per node whose output holds host RAM: the runs that free it
        self.releases: dict[str, list[str]] = {}  # per node: the outputs its run may free
        for n in self.nodes:
            if costs[n].host_bytes:
                readers = self.succs[n]
                self.holders[n] = len(readers)
                for r in readers:
                    got = self.releases.get(r)
                    if got is None:
                        self.releases[r] = [n]
                    else:
                        got.append(n)
        self.gated: dict[str, list[str]] = {}  # per node: the free nodes that wait for it
        for f in frees:
            for n in gate[f]:
                got = self.gated.get(n)
                if got is None:
                    self.gated[n] = [f]
                else:
                    got.append(f)

    @staticmethod
    def _gates(dag: nx.DiGraph, frees: list[str], preds: Mapping[str, list[str]], free: set[str],
               free_succs: Mapping[str, list[str]], waits: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
        """Per node that needs nothing, the other nodes whose runs it waits for, directly or through nodes that need
        nothing (in an order where its free inputs come first)."""
        waiting = dict(waits)
        ready = [f for f in frees if not waiting[f]]
        gate: dict[str, tuple[str, ...]] = {}
        while ready:
            f = ready.pop()
            ps = preds[f]
            if len(ps) < 2:  # (most: a loader waits for nothing, a save for its decode)
                g = (gate[ps[0]] if ps[0] in free else (ps[0],)) if ps else ()
            else:
                got: list[str] = []
                for p in ps:
                    if p in free:
                        got += gate[p]
                    else:
                        got.append(p)
                g = tuple(dict.fromkeys(got)) if len(got) > 1 else tuple(got)
            gate[f] = g
            for c in free_succs[f]:
                waiting[c] -= 1
                if not waiting[c]:
                    ready.append(c)
        if len(gate) < len(frees):  # nodes that need nothing on a cycle of their own
            raise cycle_error(dag) or RuntimeError(f"nodes on a cycle: {sorted(set(frees) - set(gate))}")
        return gate

    def expand(self, order: list[str]) -> tuple[list[str], dict[str, list[str]]]:
        """The nodes that need nothing placed along `order` (of `nodes`): those that run before it, and per node of
        `order` those that run right after it; each as soon as it is ready, the earliest in the graph first."""
        if not self.gate:
            return [], {}
        gate, pos, free_succs = self.gate, self.pos, self.free_succs
        key = {f: (pos[f], f) for f in gate}
        waiting = {f: len(g) + self.waits[f] for f, g in gate.items()}  # runs and free inputs it still waits for
        ready = [key[f] for f, n in waiting.items() if not n]
        heapq.heapify(ready)
        first = heap_order(ready, waiting, free_succs, key)
        after: dict[str, list[str]] = {}
        gated = self.gated
        for n in order:
            fs = gated.get(n)
            if fs is None:
                continue
            for f in fs:
                waiting[f] -= 1
                if not waiting[f]:
                    heapq.heappush(ready, key[f])
            if len(ready) == 1 and not free_succs[ready[0][-1]]:  # (most: a save after its decode)
                after[n] = [ready.pop()[-1]]
            elif ready:
                after[n] = heap_order(ready, waiting, free_succs, key)
        return first, after


def heap_order(ready: list[tuple], waiting: dict[str, int], succs: Mapping[str, list[str]],
               key: Mapping[str, tuple]) -> list[str]:
    """Kahn's algorithm, the least key first: `ready` a heap of the keys of the nodes that wait for nothing (each key
    ends with its node), `waiting` what each other node still waits for (counted down as they run)."""
    out = []
    while ready:
        n = heapq.heappop(ready)[-1]
        out.append(n)
        for s in succs[n]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(ready, key[s])
    return out


def run_order(shape: Shape, costs: Mapping[str, NodeCost], sizes: Sizes, gpu: int, prov: Mapping[str, Variant],
              start: Residency, host_limit: int) -> tuple[list[str], int]:
    """Pass 1: the run order of `shape.nodes` (graph/planner.py) and the peak of host bytes held by live outputs."""
    nodes, preds, succs, pos, releases = shape.nodes, shape.preds, shape.succs, shape.pos, shape.releases
    indeg = {n: len(preds[n]) for n in nodes}
    left = dict(shape.holders)  # per output that holds host RAM: the runs left that free it
    hb = {n: costs[n].host_bytes for n in nodes}
    resident: list[str] = sorted(start.gpu)  # least recently used first
    live = peak = 0
    order: list[str] = []

    # ready nodes in groups of equal (models, activation, host bytes): they rank alike, earliest first in each; a
    # group by its number (`keys`: its fields, `need`: its models without repeats)
    group: dict[str, int] = {}
    number: dict[tuple, int] = {}
    keys: list[tuple[tuple[str, ...], int, int]] = []
    for n in nodes:
        v = prov[n]
        k = (v.models, v.activation, hb[n])
        g = number.get(k)
        if g is None:
            g = number[k] = len(keys)
            keys.append(k)
        group[n] = g
    need = [sizes.unique(k[0]) for k in keys]
    uses = Counter()  # runs left that need each model
    for n in nodes:
        for m in need[group[n]]:
            uses[m] += 1

    def freed(n: str) -> int:
        return sum(hb[p] for p in releases.get(n, ()) if left[p] == 1) + (hb[n] if left.get(n) == 0 else 0)

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

    groups: dict[int, list[tuple[int, str]]] = {}
    for n in nodes:
        if indeg[n] == 0:
            groups.setdefault(group[n], []).append((pos[n], n))  # (in order: a heap)
    res = set(resident)
    held = sum(sizes.w(m) for m in resident)
    ranks: dict[int, tuple[bool, bool]] = {}  # rank(g), while the set of resident models and that of the models
    #                                           no run left needs stay as they are
    while groups:
        key, best, first = -1, (True, True), 0  # the group of the least (rank, earliest position) among those
        #                                         that fit in host RAM
        for g, h in groups.items():
            if live + keys[g][2] <= host_limit:
                r = ranks.get(g)
                if r is None:
                    r = ranks[g] = rank(g, res, held)
                if key < 0 or r < best or (r == best and h[0][0] < first):
                    key, best, first = g, r, h[0][0]
        if key >= 0:
            h = groups[key]
            pick = heapq.heappop(h)[1]
        else:  # nothing fits in host RAM: the node that leaves the least held, earliest first
            pick = min((n for h in groups.values() for _, n in h), key=lambda n: (live + hb[n] - freed(n), pos[n]))
            key = group[pick]
            h = groups[key]
            h.remove((pos[pick], pick))
            heapq.heapify(h)
            log.warning("node outputs need %s GiB of host RAM at %r, above the %s GiB available",
                        gib(live + hb[pick]), pick, gib(host_limit))
        if not h:
            del groups[key]
        b = hb[pick]
        if b:
            if live + b > peak:
                peak = live + b
            live += b
            if not left[pick]:  # read by no one: gone at once
                live -= b
        got = releases.get(pick)
        if got is not None:
            for p in got:
                left[p] -= 1
                if not left[p]:
                    live -= hb[p]
        order.append(pick)
        for n in succs[pick]:
            indeg[n] -= 1
            if not indeg[n]:
                h = groups.get(group[n])
                if h is None:
                    groups[group[n]] = [(pos[n], n)]
                else:
                    heapq.heappush(h, (pos[n], n))
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


def grouped_order(order: list[str], shape: Shape, costs: Mapping[str, NodeCost], prov: Mapping[str, Variant]
                  ) -> list[str]:
    """`order` regrouped stage by stage: a topological order that runs next, among the ready nodes, one that needs no
    GPU (a save), else one of the class that came first in `order`, the earliest first: a queue's encodes, then its
    references, samples and decodes, each for every prompt."""
    rank: dict[str, int] = {}
    for n in order:
        rank.setdefault(costs[n].class_type, len(rank))
    key = {}  # each node's heap key: (-1 for a node that needs no GPU, else its class's rank; position; node)
    for i, n in enumerate(order):
        v = prov[n]
        key[n] = -1 if not (v.models or v.streams or v.activation) else rank[costs[n].class_type], i, n
    preds, succs = shape.preds, shape.succs
    # the heap below picks the least key among the ready nodes: where all nodes sorted by key are in a topological
    # order (a queue's stages: encodes, then samples...), that order is what it makes, at a fraction of the time
    ranked = [k[2] for k in sorted(key.values())]
    at = {n: i for i, n in enumerate(ranked)}
    if all(at[p] < i for i, n in enumerate(ranked) for p in preds[n]):
        return ranked
    indeg = {n: len(preds[n]) for n in order}
    ready = [key[n] for n in order if not indeg[n]]
    heapq.heapify(ready)
    return heap_order(ready, indeg, succs, key)


def host_peak(order: list[str], shape: Shape, costs: Mapping[str, NodeCost]) -> int:
    """The most host RAM that live node outputs hold along `order` (an output lives until its last reader ran)."""
    left = dict(shape.holders)
    releases = shape.releases
    live = peak = 0
    for n in order:
        hb = costs[n].host_bytes
        live += hb
        peak = max(peak, live)
        if hb and not left[n]:  # read by no one: gone at once
            live -= hb
        for p in releases.get(n, ()):
            left[p] -= 1
            if left[p] == 0:
                live -= costs[p].host_bytes
    return peak
