"""Ahead-of-time GPU memory planner: (graph, costs, budget, cost model) -> Plan of Load/Unload/Run steps.

A pure function: it imports neither torch nor any node (only `nodes.types.Variant`, the plain dataclass in which
node estimates state their variants); it sees sizes and predicted seconds, never tensors.
The plan is made in three passes, each a simple greedy rule that a user can follow by hand:

0. A node that needs nothing (one variant without models, streams or GPU bytes, whose outputs hold no host RAM: a
   loader, a save, ComfyUI's noise and guider nodes) runs as soon as its inputs are ready; the passes order and weigh
   only the others, with an edge wherever one reads another's output directly or through such nodes (graph/plan/order.py
   `Shape`).
1. **Order** (graph/plan/order.py `run_order`). A topological order built one node at a time. Among the ready nodes,
   prefer one whose preferred variant's models are already resident (this groups work by model: a queue of N prompts
   becomes encode all, sample all, decode all), then one that would not push out a resident model that a later node
   still needs (a queued edit's decode that cannot sit beside the transformer waits until every prompt has sampled),
   then the lowest original position (insertion order of `dag.nodes`). Host RAM held by node outputs
   (`NodeCost.host_bytes`, alive from the producer's run until every node that reads it, directly or through nodes
   that need nothing, has run) must stay within `budget.host` minus the pinned copies that already exist; a ready
   node that would exceed it is passed over, which falls back to finishing the earlier chains first. Residency in
   this pass is a rough sketch (least recently used models leave when the budget is exceeded); the real residency is
   decided in pass 3. Then graph/plan/early.py moves each node that finishes an output (a decode, its save) up to where
   its models join the resident ones for free, by the same sketch. The sketch counts a streamed node at its least
   need, while pass 3 gives it all the room there is, so where pass 3 on that order loads a model twice or streams,
   it also runs on the order grouped stage by stage (graph/plan/order.py `grouped_order`: every prompt's encode, then
   every reference, sample, decode), with results early and without, and the order whose residency moves the fewest
   bytes, loads and streaming together, is kept (results early on a tie; orders that differ only where nodes without
   GPU use run are one order to pass 3).
2. **Pinned copies** (plan/assign.py `choose_pins`). Only a model that gets unloaded is ever reloaded, so only such
   models get a pinned host copy: those unloaded in this run or, with `repeat`, in the next one, and every model of
   the run when they cannot all stay on the GPU together (another prompt may push any of them out), while host RAM
   allows (`budget.host` minus the peak of live outputs), models loaded most often first, then the largest. The copy
   is read from the file in the background when the model is first loaded (`Load(pin=True)`) and kept: later unloads
   free the GPU copy only (`Unload(to="pinned")`) and reloads run at pinned PCIe speed. Without a pinned copy an
   unload drops the weights (`Unload(to="drop")`) and the reload reads the file again.
3. **Residency and variants** (graph/plan/assign.py `assign`). Weights are like registers. Before each Run the chosen
   variant's models must be resident; unloads happen only when resident weights + missing weights + the variant's
   activation exceed `budget.gpu`. Models the node does not need are evicted in order of their eviction cost: free
   first (never used again, or forced out anyway before their next use because that node and the model cannot fit
   together), then the cheapest reload (bytes / bandwidth of its source), ties broken by the farthest next use
   (Belady). Afterwards any evicted model that still fits is kept. With `repeat=True`, "next use" looks past the end
   of the run into the same sequence run again (the next image), so the end state is what the next run wants. Each
   node gets the variant with the least predicted time = variant seconds + loads of its missing models + reloads its
   evictions cause; variants within `TIE` (0.1 %) of the least count as equally fast, and of those the one that
   copies the fewest bytes host->GPU wins (its note says so).
   A node that streams a model block by block leaves its resident part (the weights outside the blocks and its
   resident blocks) on the GPU as a *kept part* (graph/plan/residency.py `part_key`), a model of its own in the
   residency: evicted like any other (its reload is its upload by the next node that streams the model), taken over
   by that node, which then uploads nothing before its first pass when it keeps the same blocks, and unloaded before
   its model loads whole.

Nothing is ever unloaded unless a node forces it out, and nothing is loaded before the node that needs it.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping

import networkx as nx

from . import assign as pass3
from .early import FinishEarly
from .order import Shape, cycle_error, grouped_order, host_peak, run_order, uses_gpu
from .sizes import Sizes, all_fit, node_kinds
from .types import (
    DEFAULT_RESERVE,
    Budget,
    CostModel,
    GiB,
    Load,
    ModelCost,
    NodeCost,
    Plan,
    PlanError,
    PlannedStep,
    Residency,
    Run,
    Step,
    Unload,
)

TIE = pass3.TIE
_SHORTCUTS = True  # pass 3's remembered choices and the passes plan() leaves out where they would change nothing;
#                    False: every node weighed, every pass run (tests/test_fast_paths.py compares the plans)

_H200 = CostModel()  # the default cost profile (graph/engine/costs.py)
_NOTHING = Residency()  # the default start: no weights anywhere

__all__ = ["DEFAULT_RESERVE", "TIE", "Budget", "CostModel", "GiB", "Load", "ModelCost", "NodeCost", "Plan", "PlanError",
           "PlannedStep", "Residency", "Run", "Step", "Unload", "plan"]


def _validate(dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost],
              start: Residency, gpu: int) -> tuple[list[str], set[str]]:
    """The DAG's nodes and those of them that need nothing (graph/plan/order.py `Shape`: the passes leave them
    out), after checking that every node has a cost and every model a size."""
    def fault(message: str) -> ValueError:
        return cycle_error(dag) or ValueError(message)

    nodes = list(dag.nodes)
    free: set[str] = set()
    quiet: dict[int, bool] = {}  # per variants tuple checked (a queue's nodes share theirs): whether it is one variant
    #                              that uses no GPU
    seen: set[int] = set()  # variants checked
    for n in nodes:
        nc = costs.get(n)
        if nc is None:
            raise fault(f"node {n!r} has no NodeCost: estimate every node before planning")
        vs = nc.variants
        got = quiet.get(id(vs))
        if got is not None:
            if got and not nc.host_bytes:
                free.add(n)
            continue
        if not vs:
            raise fault(f"node {n!r} ({nc.class_type}) has no variants: give it at least one")
        got = quiet[id(vs)] = len(vs) == 1 and not uses_gpu(vs[0]) and gpu >= 0  # (with no room at all, every node
        #                                                                          fails as itself)
        if got and not nc.host_bytes:
            free.add(n)
        for v in vs:
            if id(v) in seen:
                continue
            seen.add(id(v))
            for m in v.models:
                if m not in models:
                    raise fault(f"node {n!r} ({nc.class_type}) variant {v.name!r} needs model {m!r}, "
                                "which is missing from `models`")
    for m in start.gpu:
        if m not in models:
            raise fault(f"model {m!r} is resident at the start but missing from `models`: describe every "
                        "resident model so that its bytes are counted")
    return nodes, free


def plan(dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost], budget: Budget,
         cost: CostModel = _H200, start: Residency = _NOTHING, *, repeat: bool = True) -> Plan:
    """Plan one run of `dag`: the order, every node's variant and the Load/Unload steps between runs.

    `dag` edges u->v mean v consumes an output of u; every node needs a NodeCost in `costs`. `start` is the
    residency left by the previous run. With `repeat`, the plan expects the same graph to run again next
    and keeps what that run will want. Raises PlanError when a node fits with no variant.
    """
    # A queue's plan makes tens of thousands of short-lived tuples and lists, and no reference cycle: the cyclic
    # collector's passes over them cost 5-10% of planning 64 prompts, for nothing to collect. Paused while it plans
    # (left as it is where something else turned it off).
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _plan(dag, costs, models, budget, cost, start, repeat)
    finally:
        if paused:
            gc.enable()


def _plan(dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost], budget: Budget,
          cost: CostModel, start: Residency, repeat: bool) -> Plan:
    if start.kept:
        models = {**models, **{m.key: m for m in start.kept if m.key in start.gpu}}
    nodes, free = _validate(dag, costs, models, start, budget.gpu)
    shape = Shape(dag, nodes, free, costs)  # the passes order the nodes that need something, by number
    #                                         (graph/plan/order.py)
    ncs = shape.costs
    sizes = Sizes(models)
    kinds, prov = node_kinds(dag, ncs, sizes, budget.gpu, _SHORTCUTS)
    memo = pass3.Memo(kinds, {} if _SHORTCUTS else None)  # what its passes 3 share
    pinned_bytes = sum(sizes.w(m) for m in start.pinned if m in models)
    order, peak_out = run_order(shape, sizes, budget.gpu, prov, start, budget.host - pinned_bytes)
    if len(order) < len(ncs):  # the nodes of a cycle never get ready
        left_out = set(shape.names) - {shape.names[n] for n in order}
        raise cycle_error(dag) or RuntimeError(f"pass 1 left out {sorted(left_out)}")
    everything = frozenset(models)
    # results early where that moves no byte more than the grouped order, with or without them (module docstring,
    # pass 1); pass 1's order stands in for the grouped one where grouping would hold more host RAM than there is
    early = FinishEarly(shape.succs, order, prov, sizes.nbytes, budget.gpu, sorted(start.gpu))
    chosen = early(order)
    first = pass3.assign(chosen, shape, sizes, budget, cost, start, prov, everything, repeat, memo)
    streams = any(r[-1] is not None for r in first.rows)  # a row's last field: its block plan
    if max(first.loads.values(), default=0) > 1 or streams:  # else no order moves less
        host_room = max(budget.host - pinned_bytes, peak_out)  # (pass 1 may have had to go over it)
        tight = sum(shape.hb) > host_room  # else no order holds more than there is
        grouped = grouped_order(order, shape, prov)
        if tight and host_peak(grouped, shape) > host_room:
            grouped = order
        # pass 3 runs a node that has one variant without models, streams or GPU bytes (an image loaded) where it is,
        # moving nothing, and no such node meets a model in its look ahead: orders that differ only in where those
        # nodes run get the same choices for the others
        neutral = [len(nc.variants) == 1 and not uses_gpu(nc.variants[0]) for nc in ncs]

        def on_gpu(o: list[int]) -> list[int]:
            return [n for n in o if not neutral[n]] if _SHORTCUTS and any(neutral) else o

        tried, tried_first = [on_gpu(chosen)], chosen
        for cand in (early(grouped) if grouped != order else chosen, grouped):
            if on_gpu(cand) in tried or (tight and host_peak(cand, shape) > host_room):
                continue
            tried.append(on_gpu(cand))
            other = pass3.assign(cand, shape, sizes, budget, cost, start, prov, everything, repeat, memo)
            if other.moved < first.moved:
                first, chosen = other, cand
        if chosen is not tried_first:
            peak_out = host_peak(chosen, shape)
    order = chosen
    # a pinned copy pays only for a model that gets unloaded: in this run, in the next one if it repeats, or by
    # some other prompt when the used models cannot all stay on the GPU together
    evicted = set(first.unloaded)
    evicted |= {m for v in first.chosen for m in v.streams}
    used_models = {m for v in first.chosen for m in v.models + v.streams}
    if sum(sizes.w(m) for m in used_models) + max((v.activation for v in first.chosen), default=0) \
            > budget.gpu:
        evicted |= used_models  # the models cannot all stay: any of them may have to leave for a later prompt
    variants = {}  # the variants of a node of each kind: all the variants of the plan
    for n, k in enumerate(kinds):
        variants.setdefault(k, ncs[n].variants)
    used = {m for vs in variants.values() for v in vs for m in v.models}
    # (the next run can only add candidates that are not in yet, and none where it surely moves nothing)
    if repeat and not used <= evicted and not (_SHORTCUTS and all_fit(variants.values(), sizes, budget.gpu,
                                                                       first.end)):
        nxt = pass3.assign(order, shape, sizes, budget, cost, first.end, prov, everything, repeat, memo)
        evicted |= nxt.unloaded
        evicted |= {m for v in nxt.chosen for m in v.streams}
    pins = pass3.choose_pins(first, sizes, ncs, order, start, budget.host - peak_out - pinned_bytes, evicted)
    if used <= pins:
        done = first
    elif _SHORTCUTS and evicted <= pins and first.weighed <= pins:  # the copies left out change no choice
        #                                                                  (Assigned.repinned)
        done = first.repinned(pins)
    else:
        done = pass3.assign(order, shape, sizes, budget, cost, start, prov, pins, repeat, memo)
    parts = {k: sizes.parts[k] for s in done.rows for k in s[3] if k in sizes.parts} if sizes.parts else {}
    #         (a row's resident keys)
    return Plan(done.steps(shape, cost, tuple(sorted(start.gpu))), budget, {**models, **parts}, done.end, start,
                {n: costs[n].class_type for n in nodes}, cost)
