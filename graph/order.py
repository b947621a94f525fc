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


def edges(dag: nx.DiGraph, nodes: list[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Each node's producers and consumers, read once for all the passes (networkx's per-node views cost more than
    the rest of a pass)."""
    succs = {n: list(after) for n, after in dag.adjacency()}
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    for u in nodes:
        for v in succs[u]:
            preds[v].append(u)
    return preds, succs


def run_order(nodes: list[str], preds: Mapping[str, list[str]], succs: Mapping[str, list[str]],
              costs: Mapping[str, NodeCost], sizes: Sizes, gpu: int, prov: Mapping[str, Variant], start: Residency,
              host_limit: int) -> tuple[list[str], int]:
    """Pass 1: the run order (see the module docstring) and the peak of host bytes held by live outputs."""
    pos = {n: i for i, n in enumerate(nodes)}
    indeg = {n: len(preds[n]) for n in nodes}
    left = {n: len(succs[n]) for n in nodes}  # consumers not yet run
    hb = {n: costs[n].host_bytes for n in nodes}
    resident: list[str] = sorted(start.gpu)  # least recently used first
    uses = Counter(m for n in nodes for m in dict.fromkeys(prov[n].models))  # runs left that need each model
    live = peak = 0
    order: list[str] = []

    def freed(n: str) -> int:
        return sum(hb[p] for p in preds[n] if left[p] == 1) + (hb[n] if left[n] == 0 else 0)

    def rank(k: tuple, res: set[str], held: int) -> tuple[bool, bool]:
        """(its models are not all resident, running it now would push out a resident model that a later run
        still needs: e.g. a decode that does not fit beside the transformer while other prompts still sample)."""
        need, act = k[0], k[1]
        missing = [m for m in dict.fromkeys(need) if m not in res]
        over = held + sum(sizes.w(m) for m in missing) + act - gpu
        if over <= 0:
            return bool(missing), False
        dead = sum(sizes.w(m) for m in res if m not in need and uses[m] == 0)
        return bool(missing), over > dead

    # ready nodes in groups of equal (models, activation, host bytes): they rank alike, earliest first in each
    group = {n: (prov[n].models, prov[n].activation, hb[n]) for n in nodes}
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for n in nodes:
        if indeg[n] == 0:
            groups.setdefault(group[n], []).append((pos[n], n))  # (in order: a heap)
    res = set(resident)
    held = sum(sizes.w(m) for m in resident)
    ranks: dict[tuple, tuple[bool, bool]] = {}  # rank(k), while the set of resident models and that of the models
    #                                             no run left needs stay as they are
    while groups:
        key, best, first = None, (True, True), 0  # the group of the least (rank, earliest position) among those
        #                                           that fit in host RAM
        for k, h in groups.items():
            if live + k[2] <= host_limit:
                r = ranks.get(k)
                if r is None:
                    r = ranks[k] = rank(k, res, held)
                if key is None or r < best or (r == best and h[0][0] < first):
                    key, best, first = k, r, h[0][0]
        if key is not None:
            pick = heapq.heappop(groups[key])[1]
        else:  # nothing fits in host RAM: the node that leaves the least held, earliest first
            pick = min((n for h in groups.values() for _, n in h), key=lambda n: (live + hb[n] - freed(n), pos[n]))
            key = group[pick]
            groups[key].remove((pos[pick], pick))
            heapq.heapify(groups[key])
            log.warning("node outputs need %s GiB of host RAM at %r, above the %s GiB available",
                        gib(live + hb[pick]), pick, gib(host_limit))
        if not groups[key]:
            del groups[key]
        peak = max(peak, live + hb[pick])
        gone = 0 if left[pick] else hb[pick]  # freed(pick), as the consumers are counted down
        for p in preds[pick]:
            if left[p] == 1:
                gone += hb[p]
            left[p] -= 1
        live = live + hb[pick] - gone
        order.append(pick)
        for n in succs[pick]:
            indeg[n] -= 1
            if indeg[n] == 0:
                h = groups.get(group[n])
                if h is None:
                    groups[group[n]] = [(pos[n], n)]
                else:
                    heapq.heappush(h, (pos[n], n))
        v = prov[pick]
        if not v.models and not v.activation:
            continue
        for m in dict.fromkeys(v.models):
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


def grouped_order(order: list[str], preds: Mapping[str, list[str]], succs: Mapping[str, list[str]],
                  costs: Mapping[str, NodeCost], prov: Mapping[str, Variant]) -> list[str]:
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
    indeg = {n: len(preds[n]) for n in order}
    ready = [key[n] for n in order if not indeg[n]]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
        n = heapq.heappop(ready)[2]
        out.append(n)
        for s in succs[n]:
            indeg[s] -= 1
            if not indeg[s]:
                heapq.heappush(ready, key[s])
    return out


def host_peak(order: list[str], preds: Mapping[str, list[str]], succs: Mapping[str, list[str]],
              costs: Mapping[str, NodeCost]) -> int:
    """The most host RAM that live node outputs hold along `order` (an output lives until its last consumer ran)."""
    left = {n: len(succs[n]) for n in order}
    live = peak = 0
    for n in order:
        live += costs[n].host_bytes
        peak = max(peak, live)
        for p in preds[n]:
            left[p] -= 1
            if left[p] == 0:
                live -= costs[p].host_bytes
        if left[n] == 0:
            live -= costs[n].host_bytes
    return peak
