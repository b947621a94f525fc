"""Ahead-of-time GPU memory planner: (graph, costs, budget, cost model) -> Plan of Load/Unload/Run steps.

A pure function: it imports neither torch nor any node (only `nodes.types.Variant`, the plain dataclass in which
node estimates state their variants); it sees sizes and predicted seconds, never tensors.
The plan is made in three passes, each a simple greedy rule that a user can follow by hand, and, for a run that will
run again, a fourth that plans it for the runs to come:

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
3. **Residency and variants** (graph/plan/assign.py `assign`, by the rules of graph/plan/gpu.py `GpuState`). Weights
   are like registers. Before each Run the chosen
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

4. **For the runs to come** (graph/plan/session.py; only with `PlanContext(session=True)`, off by default until
   measured on the GPU). With `repeat`, a small run (one image: at most 5 nodes that use the GPU and 4 models) is
   planned for the runs after it too: an exact dynamic programme over the next 8 runs
   (per model absent, whole, or a part of its blocks kept; cost: seconds plus a price per byte, several prices) and
   pass 3's own plan, each carried out by `GpuState.apply`; among those within 1 % of the fastest, the fewest bytes
   win.

The passes above are the reference. The fast paths (pass 3's remembered choices and tables, `node_kinds`' shared
kinds, and the passes left out where they would change nothing) change no plan; `PlanContext(reference=True)` plans
without them, and tests/test_plan_reference.py compares the two plan for plan. docs/planner.md says it in words.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

import networkx as nx

from . import assign as pass3
from . import session
from .early import FinishEarly
from .order import Shape, cycle_error, grouped_order, host_peak, run_order, uses_gpu
from .residency import BlockCache
from .session import Session
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

__all__ = ["DEFAULT_RESERVE", "TIE", "Budget", "CostModel", "GiB", "Load", "ModelCost", "NodeCost", "Plan",
           "PlanContext", "PlanError", "PlannedStep", "Residency", "Run", "Step", "Unload", "plan"]


@dataclass
class PlanContext:
    """What the plans of one caller (an engine, a server's planner, a panel) share, and how they are made.

    `reference`: plan by the reference rules alone (every node weighed, the look ahead walked, every pass run), not
    with the fast paths that change no plan. `blocks`: the block choices of streamed nodes, by spec and room
    (graph/plan/residency.py `BlockCache`), which a queue asks once per prompt and the next queue again. `sessions`:
    the choices of graph/plan/session.py for the runs to come, by the run's variants and start (a session's runs
    come back to the same start). `session` True: plan a run that will run again for the runs to come (False, the
    default: pass 3's own plan).
    A caller that passes none gets a fresh context per plan: nothing outlives the call."""

    reference: bool = False
    blocks: BlockCache = field(default_factory=BlockCache)
    sessions: session.Memory = field(default_factory=session.Memory)
    # plan a run that will run again for the runs to come (graph/plan/session.py); off by default until its plans are
    # measured on the GPU (the engine turns it on with VRAMGRAPH_PLAN_AHEAD=on)
    session: bool = False


# A DAG with edges u->v where v reads u's output, or per node the nodes whose outputs it reads (its inputs' sources)
Dependencies: TypeAlias = nx.DiGraph | Mapping[str, Iterable[str]]


def as_dag(dependencies: Dependencies) -> nx.DiGraph:
    """The planner's graph of `dependencies`: node order is the mapping's (pass 1 breaks ties by it).

    >>> list(as_dag({"load": [], "encode": ["load"], "decode": ["encode", "load"]}).edges)
    [('load', 'encode'), ('load', 'decode'), ('encode', 'decode')]
    """
    if isinstance(dependencies, nx.DiGraph):
        return dependencies
    dag = nx.DiGraph()
    dag.add_nodes_from(dependencies)
    for node, inputs in dependencies.items():
        for src in inputs:
            if src not in dependencies:
                raise ValueError(f"node {node!r} reads the output of {src!r}, which is not a node of the graph: list "
                                 "every node, with its own inputs (or none)")
            dag.add_edge(src, node)
    return dag


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
        if got is None:
            if not vs:
                raise fault(f"node {n!r} ({nc.class_type}) has no variants: give it at least one")
            got = quiet[id(vs)] = len(vs) == 1 and not uses_gpu(vs[0]) and gpu >= 0  # (with no room at all, every
            #                                                                          node fails as itself)
            for v in vs:
                if id(v) in seen:
                    continue
                seen.add(id(v))
                for m in v.models:
                    if m not in models:
                        raise fault(f"node {n!r} ({nc.class_type}) variant {v.name!r} needs model {m!r}, "
                                    "which is missing from `models`")
        if got and not nc.host_bytes:
            free.add(n)
    for m in start.gpu:
        if m not in models:
            raise fault(f"model {m!r} is resident at the start but missing from `models`: describe every "
                        "resident model so that its bytes are counted")
    return nodes, free


def plan(dependencies: Dependencies, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost], budget: Budget,
         cost: CostModel | None = None, start: Residency | None = None, *, repeat: bool = True,
         context: PlanContext | None = None) -> Plan:
    """Plan one run of a graph: the order, every node's variant and the Load/Unload steps between runs.

    `dependencies`: per node the nodes whose outputs it reads (or a networkx DiGraph, edges u->v where v reads u);
    every node needs a NodeCost in `costs`, every model its variants name a ModelCost in `models`. `cost`: the
    machine's cost model (default: the H200's). `start`: the residency left by the previous run (default: nothing
    anywhere). With `repeat`, the plan expects the same graph to run again next and keeps what that run will want.
    `context`: the caller's caches and the reference switch (`PlanContext`). Raises PlanError when a node fits with
    no variant, ValueError when the inputs do not describe every node and model."""
    return _Planner(as_dag(dependencies), costs, models, budget, cost or CostModel(), start or Residency(), repeat,
                    context or PlanContext()).plan()


class _Planner:
    """One call of `plan`: its inputs, prepared once for the passes."""

    def __init__(self, dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost],
                 budget: Budget, cost: CostModel, start: Residency, repeat: bool, context: PlanContext) -> None:
        if start.kept:
            models = {**models, **{m.key: m for m in start.kept if m.key in start.gpu}}
        self.nodes, free = _validate(dag, costs, models, start, budget.gpu)
        self.dag, self.costs, self.models, self.budget, self.cost, self.start = dag, costs, models, budget, cost, start
        self.repeat, self.fast, self.sessions = repeat, not context.reference, context.sessions
        self.session = repeat and context.session
        self.shape = Shape(dag, self.nodes, free, costs)  # the passes order the nodes that need something, by number
        self.sizes = Sizes(models, context.blocks)
        self.kinds, self.prov = node_kinds(dag, self.shape.costs, self.sizes, budget.gpu, self.fast)
        self.memo = pass3.Memo(self.kinds, {} if self.fast else None)  # what its passes 3 share
        self.pinned_bytes = sum(self.sizes.w(m) for m in start.pinned if m in models)

    def assign(self, order: list[int], start: Residency, pins: frozenset[str]) -> pass3.Assigned:
        return pass3.assign(order, self.shape, self.sizes, self.budget, self.cost, start, self.prov, pins,
                            self.repeat, self.memo)

    def plan(self) -> Plan:
        shape, budget = self.shape, self.budget
        order, peak_out = run_order(shape, self.sizes, budget.gpu, self.prov, self.start,
                                    budget.host - self.pinned_bytes)
        if len(order) < len(shape.costs):  # the nodes of a cycle never get ready
            left_out = set(shape.names) - {shape.names[n] for n in order}
            raise cycle_error(self.dag) or RuntimeError(f"pass 1 left out {sorted(left_out)}")
        order, first, peak_out = self.best_order(order, peak_out)
        evicted = self.evicted(order, first)
        pins = pass3.choose_pins(first, self.sizes, shape.costs, order, self.start,
                                 budget.host - peak_out - self.pinned_bytes, evicted)  # pass 2
        if self.used() <= pins:
            done = first
        elif self.fast and evicted <= pins and first.weighed <= pins:  # the copies left out change
            #                                                                        no choice (Assigned.repinned)
            done = first.repinned(pins)
        else:
            done = self.assign(order, self.start, pins)
        nodes = [shape.costs[n] for n in order] if self.session else []
        if nodes and Session.small(nodes, self.start):  # residency for the runs to come (graph/plan/session.py)
            host_room = budget.host - peak_out - self.pinned_bytes

            def pins_for(extra: set[str]) -> frozenset[str]:
                return pass3.choose_pins(first, self.sizes, shape.costs, order, self.start, host_room, evicted | extra)

            done = session.best(lambda end: self.assign(order, end, pins), done, order, shape.names, nodes,
                                self.sizes, budget, self.cost, self.start, pins_for, self.prov, self.sessions)
        parts = {k: self.sizes.parts[k] for r in done.rows for k in r.resident if k in self.sizes.parts}
        return Plan(done.steps(shape, self.cost, tuple(sorted(self.start.gpu))), budget, {**self.models, **parts},
                    done.end, self.start, {n: self.costs[n].class_type for n in self.nodes}, self.cost)

    def best_order(self, order: list[int], peak_out: int) -> tuple[list[int], pass3.Assigned, int]:
        """Results early where that moves no byte more than the grouped order, with or without them (module
        docstring, pass 1); pass 1's order stands in for the grouped one where grouping would hold more host RAM
        than there is. Returns the order, its pass 3 with every model pinned, and its peak of host RAM in outputs."""
        shape, everything = self.shape, frozenset(self.models)
        early = FinishEarly(shape.succs, order, self.prov, self.sizes.nbytes, self.budget.gpu, sorted(self.start.gpu))
        chosen = early(order)
        first = self.assign(chosen, self.start, everything)
        if max(first.loads.values(), default=0) <= 1 and not first.streams:  # no order moves less
            return chosen, first, peak_out
        host_room = max(self.budget.host - self.pinned_bytes, peak_out)  # (pass 1 may have had to go over it)
        tight = sum(shape.hb) > host_room  # else no order holds more than there is
        grouped = grouped_order(order, shape, self.prov)
        if tight and host_peak(grouped, shape) > host_room:
            grouped = order
        # pass 3 runs a node that has one variant without models, streams or GPU bytes (an image loaded) where it is,
        # moving nothing, and no such node meets a model in its look ahead: orders that differ only in where those
        # nodes run get the same choices for the others
        neutral = [len(nc.variants) == 1 and not uses_gpu(nc.variants[0]) for nc in shape.costs]

        def on_gpu(o: list[int]) -> list[int]:
            return [n for n in o if not neutral[n]] if self.fast and any(neutral) else o

        tried, tried_first = [on_gpu(chosen)], chosen
        for cand in (early(grouped) if grouped != order else chosen, grouped):
            if on_gpu(cand) in tried or (tight and host_peak(cand, shape) > host_room):
                continue
            tried.append(on_gpu(cand))
            other = self.assign(cand, self.start, everything)
            if other.moved < first.moved:
                first, chosen = other, cand
        if chosen is not tried_first:
            peak_out = host_peak(chosen, shape)
        return chosen, first, peak_out

    def used(self) -> set[str]:
        """The models the variants of the plan's nodes name."""
        return {m for nc in self.shape.costs for v in nc.variants for m in v.models}

    def evicted(self, order: list[int], first: pass3.Assigned) -> set[str]:
        """The models a pinned copy pays for: those unloaded or streamed in this run, all the used ones when they
        cannot all stay on the GPU together (another prompt may push any of them out), and, with `repeat`, those
        unloaded or streamed in the next run (left out where it surely moves nothing)."""
        sizes, gpu = self.sizes, self.budget.gpu
        evicted = set(first.unloaded) | {m for v in first.chosen for m in v.streams}
        used_models = {m for v in first.chosen for m in v.models + v.streams}
        if sum(sizes.w(m) for m in used_models) + max((v.activation for v in first.chosen), default=0) > gpu:
            evicted |= used_models
        kinds: dict[int, tuple] = {}  # the variants of a node of each kind: all the variants of the plan
        for n, k in enumerate(self.kinds):
            kinds.setdefault(k, self.shape.costs[n].variants)
        if self.repeat and not self.used() <= evicted and not (self.fast and all_fit(kinds.values(), sizes, gpu,
                                                                                      first.end)):
            nxt = self.assign(order, first.end, frozenset(self.models))
            evicted |= nxt.unloaded
            evicted |= {m for v in nxt.chosen for m in v.streams}
        return evicted
