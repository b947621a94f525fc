"""Placement on several devices: which device runs each node, and so holds which models. Pure, like the planner.

Every device is a lane with its own `Budget`. A placement gives each node that uses a model (its variants name
models to load or stream) one lane; an output node goes to the lane of the nearest such node above it; any other
node (loaders, empty latents, noise, image loads: nothing on the GPU, deterministic) runs in every lane that
needs its outputs, so a model handle or a seed never has to cross. Where a node's input was made in another lane,
the value crosses: node outputs live in host memory (nodes/ops.py), so the copy is the consumer's usual host to
device copy, counted here as a `Transfer` before the consumer may start.

Each lane is then planned by the one-device planner (graph/plan/planner.py) over its own nodes, in the order of one
global run order (the one-device plan's order of the whole graph: work grouped by model), so no two lanes can
wait on each other in a circle. The predicted finish time lets the lanes run at the same time, each waiting for
the inputs it imports; a single lane is exactly today's plan.

The candidates searched:
- **one device**: everything in one lane, for each device;
- **split models**: every assignment of the graph's models to devices in which each node's models share a
  device (e.g. the text encoder on one card, the transformer and the VAE on the other): no model ever moves;
- **split queue**: the output nodes dealt to the devices in turn, each lane holding every model its prompts
  need (two workers sharing a queue; each image is computed exactly as it would be alone).
tests/test_placement.py checks these against every assignment of the model-using nodes to devices on small
cases: the same model moves, a finish within 2 %.

The best (`Placement.score`) moves the fewest model bytes in the next run of the same graph (with `repeat`:
models stay where a placement puts them, so the steady state decides, and a model move is what this project
exists to avoid), then has the least predicted finish of that run, then of this one; ties go to fewer bytes
loaded, fewer lanes, fewer bytes copied between devices, the earlier devices first. The lanes share the host's
RAM for pinned copies and outputs: each gets an equal part. Concurrent file reads are predicted as if each had
the disk to itself. Raises the one-device `PlanError` of the device that comes closest when nothing fits.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from . import planner
from .planner import Budget, CostModel, ModelCost, NodeCost, Plan, PlanError, Residency, Run

_EPS = 1e-9


@dataclass(frozen=True)
class Device:
    """One device the plan may use: its name as torch writes it and its budget."""

    name: str  # "cuda:0"
    budget: Budget


@dataclass(frozen=True)
class Transfer:
    """An output made in one lane and used in another: its bytes are copied to the consumer's device."""

    node: str  # the producer
    source: str  # device it ran on
    target: str  # device of the consumer
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Lane:
    device: str
    plan: Plan
    imports: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # node -> producers in other lanes


@dataclass(frozen=True)
class Placement:
    kind: str  # "one device" | "split models" | "split queue"
    lanes: tuple[Lane, ...]
    transfers: tuple[Transfer, ...]
    finish: float  # predicted seconds with the lanes running at the same time
    sequential: float  # predicted seconds with one lane after the other
    warm: float = 0.0  # predicted finish of the next run of the same graph, from where this one leaves the models
    warm_bytes: int = 0  # bytes that next run copies to the GPU (loads and streams)

    @property
    def score(self) -> tuple:
        """What `place` minimises: the next run's model moves and finish, then this run's, then the fewest lanes
        and the fewest bytes copied between devices."""
        return (self.warm_bytes, round(self.warm, 6), round(self.finish, 6), self.bytes_moved, len(self.lanes),
                sum(t.nbytes for t in self.transfers))

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(lane.device for lane in self.lanes)

    @property
    def loads(self) -> int:
        return sum(lane.plan.loads for lane in self.lanes)

    @property
    def bytes_moved(self) -> int:
        return sum(lane.plan.bytes_moved for lane in self.lanes)

    def lane(self, device: str) -> Lane:
        return next(lane for lane in self.lanes if lane.device == device)

    def device_of(self, node: str) -> tuple[str, ...]:
        """The devices that run `node` (several for a node every lane computes for itself)."""
        return tuple(lane.device for lane in self.lanes if node in lane.plan.order)

    def model_devices(self) -> dict[str, tuple[str, ...]]:
        """Model key -> the devices that load it."""
        out: dict[str, list[str]] = {}
        for lane in self.lanes:
            for s in lane.plan.steps:
                if isinstance(s.step, planner.Load) and lane.device not in out.setdefault(s.step.model, []):
                    out[s.step.model].append(lane.device)
        return {k: tuple(v) for k, v in out.items()}

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "finish_seconds": self.finish, "sequential_seconds": self.sequential,
                "next_run_seconds": self.warm,
                "loads": self.loads, "bytes_moved": self.bytes_moved,
                "lanes": [{"device": lane.device, "imports": {k: list(v) for k, v in lane.imports.items()},
                           "plan": lane.plan.to_json()} for lane in self.lanes],
                "transfers": [vars(t) for t in self.transfers]}

    def table(self) -> str:
        """One plan table per device, then the transfers and the totals."""
        parts = []
        for lane in self.lanes:
            parts.append(f"== {lane.device} (budget {lane.plan.budget.gpu / 2**30:.2f} GiB)")
            parts.append(lane.plan.table())
        for t in self.transfers:
            parts.append(f"copy: output of {t.node} from {t.source} to {t.target}, {t.nbytes / 2**20:.1f} MiB, "
                         f"{t.seconds * 1000:.1f} ms")
        parts.append(f"placement: {self.kind} on {', '.join(self.devices)}: {self.loads} loads, "
                     f"{self.bytes_moved / 2**30:.2f} GiB moved, {self.finish:.3f} s predicted with the devices "
                     f"working at the same time ({self.sequential:.3f} s one after the other; the next run "
                     f"{self.warm:.3f} s)")
        return "\n".join(parts)


def _uses(nc: NodeCost) -> frozenset[str]:
    return frozenset(m for v in nc.variants for m in (*v.models, *v.streams))


def place(dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost], devices: Sequence[Device],
          cost: CostModel | None = None, starts: Mapping[str, Residency] | None = None, *, repeat: bool = True,
          outputs: Iterable[str] = ()) -> Placement:
    """The best placement of `dag` on `devices` (see the module docstring). `outputs`: the output nodes (dealt
    to the devices by the queue split; by default the nodes without consumers)."""
    if not devices:
        raise ValueError("no device to place the graph on")
    cost = cost or CostModel()
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"devices {names}: each device may be named once")
    starts = dict(starts or {})
    order = _global_order(dag, costs, models, devices, cost)
    outs = [n for n in order if n in set(outputs)] or [n for n in order if dag.out_degree(n) == 0]
    users = [n for n in order if _uses(costs[n])]
    errors: list[PlanError] = []

    index = {name: i for i, name in enumerate(names)}
    found: list[tuple[tuple, Placement]] = []

    def attempt(kind: str, assign: Mapping[str, str]) -> None:
        try:
            p = _build(kind, dag, costs, models, devices, cost, starts, repeat, order, assign)
        except PlanError as e:
            errors.append(e)
            return  # ties (see `score`), then the earlier devices first in the work's order
        found.append(((*p.score, tuple(index[assign[n]] for n in users)), p))

    for d in devices:  # one device: exactly the one-device plan
        try:
            p = planner.plan(dag, costs, models, d.budget, cost, starts.get(d.name, Residency()), repeat=repeat)
        except PlanError as e:
            errors.append(e)
            continue
        nxt = planner.plan(dag, costs, models, d.budget, cost, p.end, repeat=True) if repeat else p
        one = _single(d.name, p, nxt)
        found.append(((*one.score, (index[d.name],) * len(users)), one))
    if len(devices) > 1:
        keys = sorted({m for n in users for m in _uses(costs[n])})
        for combo in itertools.product(names, repeat=len(keys)):
            if len(set(combo)) < 2:
                continue
            where = dict(zip(keys, combo, strict=True))
            assign = {}
            for n in users:
                placed = {where[m] for m in _uses(costs[n])}
                if len(placed) > 1:
                    break
                assign[n] = placed.pop()
            else:
                attempt("split models", assign)
        if len(outs) > 1:
            group = {o: names[i % len(names)] for i, o in enumerate(outs)}
            assign = {}
            for n in users:
                first = next((o for o in outs if o == n or nx.has_path(dag, n, o)), None)
                assign[n] = group[first] if first is not None else names[0]
            attempt("split queue", assign)
    if not found:
        raise min(errors, key=lambda e: e.needed - e.budget)
    return min(found, key=lambda kp: kp[0])[1]


def _moved(p: Plan) -> int:
    """Bytes a plan copies to the GPU: its loads and what its runs stream from host memory."""
    return p.bytes_moved + sum(p.models[m].nbytes for s in p.steps for m in s.streams)


def _single(device: str, p: Plan, nxt: Plan) -> Placement:
    return Placement("one device", (Lane(device, p),), (), p.seconds, p.seconds, nxt.seconds, _moved(nxt))


def _global_order(dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost],
                  devices: Sequence[Device], cost: CostModel) -> list[str]:
    """The one-device planner's order of the whole graph with room for everything (work grouped by model)."""
    room = sum(m.nbytes for m in models.values()) + max(
        (min(v.activation for v in c.variants) for c in costs.values()), default=0)
    big = Budget(max(room, max(d.budget.gpu for d in devices)), max(d.budget.host for d in devices))
    return list(planner.plan(dag, costs, models, big, cost, repeat=False).order)


def _build(kind: str, dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost],
           devices: Sequence[Device], cost: CostModel, starts: Mapping[str, Residency], repeat: bool,
           order: list[str], assign: Mapping[str, str]) -> Placement:
    """The lanes for `assign` (model-using node -> device): output nodes and free nodes follow (module docstring)."""
    pos = {n: i for i, n in enumerate(order)}
    home = dict(assign)
    for n in order:  # an output or any other node with consumers nowhere: the lane of its nearest user above
        if n in home or _uses(costs[n]) or dag.out_degree(n) > 0:
            continue
        above = [a for a in nx.ancestors(dag, n) if a in assign]
        home[n] = assign[max(above, key=pos.__getitem__)] if above else devices[0].name
    lanes_nodes: dict[str, set[str]] = {d.name: set() for d in devices}
    imports: dict[str, dict[str, list[str]]] = {d.name: {} for d in devices}
    for n, d in home.items():
        stack = [n]
        while stack:  # the node and the free nodes above it, up to the outputs of other lanes' users
            x = stack.pop()
            if x in lanes_nodes[d]:
                continue
            lanes_nodes[d].add(x)
            for p in dag.predecessors(x):
                if p in assign and assign[p] != d:  # made by another lane's model: it crosses
                    imports[d].setdefault(x, []).append(p)
                else:  # this lane's own, or a free node: computed here (again, if another lane needs it too)
                    stack.append(p)
    used_lanes = sum(1 for d in devices if lanes_nodes[d.name])

    def lanes_from(starts: Mapping[str, Residency]) -> tuple[list[Lane], list[Transfer]]:
        lanes: list[Lane] = []
        transfers: list[Transfer] = []
        for dev in devices:
            mine = sorted(lanes_nodes[dev.name], key=pos.__getitem__)
            if not mine:
                continue
            sub = nx.DiGraph()
            sub.add_nodes_from(mine)
            sub.add_edges_from(dag.subgraph(mine).edges)  # its own consumers free its outputs' host memory
            sub.add_edges_from(itertools.pairwise(mine))  # the global order: no two lanes wait on each other
            used = {m for n in mine for m in _uses(costs[n])}
            start = starts.get(dev.name, Residency())
            sub_models = {k: m for k, m in models.items() if k in used or k in start.gpu or k in start.pinned}
            budget = dataclasses.replace(dev.budget, host=min(d.budget.host for d in devices) // used_lanes)
            p = planner.plan(sub, {n: costs[n] for n in mine}, sub_models, budget, cost, start, repeat=repeat)
            imp = {n: tuple(dict.fromkeys(ps)) for n, ps in imports[dev.name].items()}
            lanes.append(Lane(dev.name, p, imp))
            for ps in imp.values():
                for src in ps:
                    nbytes = costs[src].host_bytes
                    transfers.append(Transfer(src, home[src], dev.name, nbytes, nbytes / cost.h2d_pageable))
        return lanes, transfers

    lanes, transfers = lanes_from(starts)
    finish, sequential = _simulate(lanes, transfers, home)
    warm, warm_bytes = finish, sum(_moved(lane.plan) for lane in lanes)
    if repeat:
        again, moved = lanes_from({lane.device: lane.plan.end for lane in lanes})
        warm, warm_bytes = _simulate(again, moved, home)[0], sum(_moved(lane.plan) for lane in again)
    return Placement(kind, tuple(lanes), tuple(transfers), finish, sequential, warm, warm_bytes)


def _simulate(lanes: Sequence[Lane], transfers: Sequence[Transfer], home: Mapping[str, str]) -> tuple[float, float]:
    """Predicted finish with every lane working through its steps at once, a Run waiting for what it imports."""
    wait = {(t.node, t.target): t.seconds for t in transfers}
    done: dict[tuple[str, str], float] = {}  # (node, device) -> when its Run ends
    clock = {lane.device: 0.0 for lane in lanes}
    at = {lane.device: 0 for lane in lanes}
    total = sum(s.seconds for lane in lanes for s in lane.plan.steps) + sum(t.seconds for t in transfers)
    while any(at[lane.device] < len(lane.plan.steps) for lane in lanes):
        moved = False
        for lane in lanes:
            d, steps = lane.device, lane.plan.steps
            while at[d] < len(steps):
                s = steps[at[d]]
                if isinstance(s.step, Run):
                    need = lane.imports.get(s.step.node, ())
                    if any((p, home[p]) not in done for p in need):
                        break
                    start = max([clock[d], *(done[(p, home[p])] + wait[(p, d)] for p in need)])
                    clock[d] = start + s.seconds
                    done[(s.step.node, d)] = clock[d]
                else:
                    clock[d] += s.seconds
                at[d] += 1
                moved = True
        if not moved:  # cannot happen with lanes in one global order; say so rather than loop
            raise AssertionError("lanes wait on each other: the placement's lanes are not in one global order")
    return max(clock.values(), default=0.0), total


def parse_devices(text: str | Sequence[str] | None, visible: int | None) -> list[str]:
    """'cuda:0,cuda:1', 'all' (every visible GPU) or a list of names -> device names; a ValueError in one line.
    `visible`: how many CUDA devices there are (None: do not check, e.g. to plan for cards not in this machine,
    or to leave a missing device to the caller's fallback)."""
    if text is None:
        return []
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if items == ["all"]:
        if not visible:
            raise ValueError("--devices all: no CUDA device here; leave --devices out to run on the CPU")
        return [f"cuda:{i}" for i in range(visible)]
    out = []
    for t in items:
        name = "cuda:0" if t == "cuda" else t
        if not name.startswith("cuda:") or not name[5:].isdigit():
            raise ValueError(f"--devices {text}: {t!r} is not a CUDA device; write cuda:0,cuda:1 or all")
        if visible is not None and int(name[5:]) >= visible:
            raise ValueError(f"--devices {text}: there {'is' if visible == 1 else 'are'} {visible} CUDA device(s)"
                             + (f", cuda:0..cuda:{visible - 1}" if visible else ""))
        if name in out:
            raise ValueError(f"--devices {text}: {name} is named twice")
        out.append(name)
    if not out:
        raise ValueError(f"--devices {text!r}: name at least one device, e.g. cuda:0,cuda:1")
    return out


def split_sizes(text: str | None, count: int) -> list[str | None]:
    """`--vram 12GiB,8GiB` -> one size per device; one size applies to every device; None: each device's own."""
    if text is None:
        return [None] * count
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) == 1:
        return parts * count
    if len(parts) != count:
        raise ValueError(f"--vram {text}: {len(parts)} sizes for {count} devices; give one size, or one per device")
    return parts


__all__ = ["Device", "Lane", "Placement", "Transfer", "parse_devices", "place", "split_sizes"]
