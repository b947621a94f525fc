"""Ahead-of-time GPU memory planner: (graph, costs, budget, cost model) -> Plan of Load/Unload/Run steps.

A pure function: it imports neither torch nor any node (only `nodes.types.Variant`, the plain dataclass in which
node estimates state their variants); it sees sizes and predicted seconds, never tensors.
The plan is made in three passes, each a simple greedy rule that a user can follow by hand:

1. **Order** (`_order`). A topological order built one node at a time. Among the ready nodes, prefer one
   whose preferred variant's models are already resident (this groups work by model: a queue of N prompts
   becomes encode all, sample all, decode all), then one that would not push out a resident model that a
   later node still needs (a queued edit's decode that cannot sit beside the transformer waits until every
   prompt has sampled), then the lowest original position (insertion order of `dag.nodes`). Host RAM held
   by node outputs (`NodeCost.host_bytes`, alive from the producer's run until
   its last consumer has run) must stay within `budget.host` minus the pinned copies that already exist;
   a ready node that would exceed it is passed over, which falls back to finishing the earlier chains
   first. Residency in this pass is a rough sketch (least recently used models leave when the budget is
   exceeded); the real residency is decided in pass 3. Then graph/early.py moves each node that finishes an
   output (a decode, its save) up to where its models join the resident ones for free, by the same sketch. The
   sketch counts a streamed node at its least need, while pass 3 gives it all the room there is, so where pass 3
   on that order loads a model twice or streams, it also runs on the order grouped stage by stage (`_grouped`:
   every prompt's encode, then every reference, sample, decode), with results early and without, and the order
   whose residency moves the fewest bytes, loads and streaming together, is kept (results early on a tie).
2. **Pinned copies** (`_choose_pins`). Only a model that gets unloaded is ever reloaded, so only such models get
   a pinned host copy: those unloaded in this run or, with `repeat`, in the next one, and every model of the
   run when they cannot all stay on the GPU together (another prompt may push any of them out), while host RAM
   allows
   (`budget.host` minus the peak of live outputs), models loaded most often first, then the largest. The copy
   is read from the file in the background when the model is first loaded (`Load(pin=True)`) and kept: later
   unloads free the GPU copy only (`Unload(to="pinned")`) and reloads run at pinned PCIe speed. Without a
   pinned copy an unload drops the weights (`Unload(to="drop")`) and the reload reads the file again.
3. **Residency and variants** (`_assign`). Weights are like registers. Before each Run the chosen variant's
   models must be resident; unloads happen only when resident weights + missing weights + the variant's
   activation exceed `budget.gpu`. Models the node does not need are evicted in order of their eviction
   cost: free first (never used again, or forced out anyway before their next use because that node and
   the model cannot fit together), then the cheapest reload (bytes / bandwidth of its source), ties broken
   by the farthest next use (Belady). Afterwards any evicted model that still fits is kept. With
   `repeat=True`, "next use" looks past the end of the run into the same sequence run again (the next
   image), so the end state is what the next run wants. Each node gets the variant with the least predicted
   time = variant seconds + loads of its missing models + reloads its evictions cause; variants within `TIE`
   (0.1 %) of the least count as equally fast, and of those the one that copies the fewest bytes host->GPU wins
   (its note says so).
   A node that streams a model block by block leaves its resident part (the weights outside the blocks and its
   resident blocks) on the GPU as a *kept part* (graph/residency.py `part_key`), a model of its own in the
   residency: evicted like any other (its reload is its upload by the next node that streams the model), taken
   over by that node, which then uploads nothing before its first pass when it keeps the same blocks, and
   unloaded before its model loads whole.

Nothing is ever unloaded unless a node forces it out, and nothing is loaded before the node that needs it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
import operator
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import networkx as nx

from . import residency
from .early import FinishEarly, evict_lru
from .residency import BlockPlan

if TYPE_CHECKING:  # only a name in annotations: the planner runs on costs, never imports a node module
    from ..nodes.types import Variant

GiB = 2**30
DEFAULT_RESERVE = 128 * 2**20  # what torch's allocator holds above the live tensors (graph/budget.py: measured)
_INF = math.inf
_PINNING = ", pinned while loading"  # a Load's note, after the node it is for, where it makes a pinned copy
TIE = 0.001  # variants whose predicted seconds are this close (relative) count as equally fast: the one that copies
#              fewer bytes host->GPU wins (a stream that copies 1.5x the bytes for 0.01 % less predicted time is
#              within the prediction's error, and its bytes are real: the link's power and other processes' copies)
_SHORTCUTS = True  # pass 3's remembered choices and the passes plan() leaves out where they would change nothing;
#                    False: every node weighed, every pass run (tests/test_fast_paths.py compares the plans)
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ModelCost:
    """One model's weights as the planner sees them."""

    key: str  # e.g. "transformer:/path/flux-2-klein-4b.safetensors:bf16"
    nbytes: int  # bytes its weights take on the GPU
    label: str = ""  # short display name, e.g. "transformer"

    @property
    def name(self) -> str:
        return self.label or self.key


@dataclass(frozen=True)
class NodeCost:
    node: str  # node id in the workflow
    class_type: str  # e.g. "VAEDecode"
    variants: tuple[Variant, ...]  # at least one; the first is preferred when all else is equal
    host_bytes: int = 0  # host RAM its outputs hold until their last consumer has run


@dataclass(frozen=True)
class CostModel:
    """What moving and computing cost on one machine (graph/costs.py: named profiles and the start-up probe).
    The defaults are the H200's measured constants; node estimates state their seconds on the H200 too."""

    h2d_pinned: float = 55.3e9  # bytes/s, host->GPU from pinned host memory (H200 measured)
    h2d_pageable: float = 8.06e9  # bytes/s from pageable memory
    disk: float = 2.0e9  # bytes/s reading a memory-mapped checkpoint from disk
    compute: float = 1.0  # GPU seconds here per H200 second (8.0: a GPU with 1/8 of the H200's bf16 rate)
    name: str = "h200"  # shown with the plan's totals, so a plan says whose seconds it predicts

    def load_seconds(self, nbytes: int, pinned: bool) -> float:
        """Pinned: one PCIe copy. From the file: the slower of the disk read and the pageable copy."""
        return nbytes / (self.h2d_pinned if pinned else min(self.disk, self.h2d_pageable))

    def run_seconds(self, v: Variant) -> float:
        """A variant's compute time here: GPU work (it uses a model on the GPU, resident or streamed) scales with
        `compute`; CPU and host work is taken as estimated."""
        return v.seconds * self.compute if v.models or v.streams else v.seconds


@dataclass(frozen=True)
class Budget:
    """The GPU and host memory a plan must stay within (graph/budget.py measures it or parses --vram)."""

    gpu: int  # bytes the plan may use on the GPU (weights + activations), reserve already subtracted
    host: int  # bytes of host RAM for pinned copies of weights and node outputs (host_bytes)
    card: int | None = None  # the emulated card size (--vram), if any
    reserve: int = DEFAULT_RESERVE  # kept back from the device (already out of `gpu`)
    outside_allocator: int = 0  # CUDA context etc., measured when the budget was made

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items()}


@dataclass(frozen=True)
class Residency:
    """Where weights are at the start of a run (carried over from the previous run) or at its end."""

    gpu: frozenset[str] = frozenset()
    pinned: frozenset[str] = frozenset()  # models with a pinned host copy
    kept: tuple[ModelCost, ...] = ()  # the kept parts in `gpu` (graph/residency.py), so that a plan starting from
    #                                   this residency knows their bytes


# ----------------------------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class Load:
    """Copy a model's weights to the GPU from its pinned copy or from the file.

    `pin=True` (only with source "file"): make a pinned host copy while loading and keep it.
    """

    model: str
    source: str  # "pinned" | "file"
    pin: bool = False
    kind: ClassVar[str] = "load"


@dataclass(frozen=True)
class Unload:
    """Free a model's GPU copy; "pinned": its pinned host copy remains, "drop": a reload reads the file."""

    model: str
    to: str  # "pinned" | "drop"
    kind: ClassVar[str] = "unload"


@dataclass(frozen=True)
class Run:
    node: str
    variant: str
    kind: ClassVar[str] = "run"


Step = Load | Unload | Run


@dataclass(frozen=True)
class PlannedStep:
    step: Step
    gpu_bytes: int  # predicted GPU bytes in use during/after the step (resident weights + Run activation)
    resident: tuple[str, ...]  # GPU-resident model keys after the step
    seconds: float  # predicted
    note: str = ""  # why this step is here (shown to users)
    streams: tuple[str, ...] = ()  # Run: models its variant reads from host memory while it runs (never resident)
    blocks: BlockPlan | None = None  # Run that streams a model block by block: which blocks stay (graph/residency.py)


class PlanError(ValueError):
    """A node fits on the GPU with none of its variants, even with every other model evicted."""

    def __init__(self, node: str, class_type: str, needed: int, budget: int, message: str, details: str,
                 extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.class_type = class_type
        self.needed = needed
        self.budget = budget
        self.message = message
        self.details = details
        self.extra = dict(extra or {})

    def to_dict(self) -> dict[str, Any]:
        """ComfyUI's error shape."""
        extra = {"node_id": self.node, "class_type": self.class_type, "needed_bytes": self.needed,
                 "budget_bytes": self.budget, **self.extra}
        return {"type": "vram_plan_infeasible", "message": self.message, "details": self.details,
                "extra_info": extra}


# ------------------------------------------------------------------------------------------------ plan


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


@dataclass(frozen=True)
class Plan:
    steps: tuple[PlannedStep, ...]
    budget: Budget
    models: Mapping[str, ModelCost]
    end: Residency
    start: Residency = Residency()
    classes: Mapping[str, str] = field(default_factory=dict)  # node id -> class_type, for display
    cost: CostModel = CostModel()  # the cost profile the seconds are predicted with

    @property
    def loads(self) -> int:
        return sum(1 for s in self.steps if isinstance(s.step, Load))

    @property
    def bytes_moved(self) -> int:
        """Bytes copied host->GPU by the Load steps."""
        return sum(self.models[s.step.model].nbytes for s in self.steps if isinstance(s.step, Load))

    @property
    def streamed_bytes(self) -> int:
        """Bytes copied host->GPU by the Runs that stream a model (every pass, and their resident blocks' upload)."""
        return sum(s.blocks.uploaded for s in self.steps if s.blocks is not None)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def peak(self) -> int:
        return max((s.gpu_bytes for s in self.steps), default=0)

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(s.step.node for s in self.steps if isinstance(s.step, Run))

    def variant_of(self, node: str) -> str:
        for s in self.steps:
            if isinstance(s.step, Run) and s.step.node == node:
                return s.step.variant
        raise KeyError(f"node {node!r} is not in the plan")

    def label(self, model: str) -> str:
        m = self.models.get(model)
        return m.name if m else model

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: steps with their predictions, budget, models, end residency and totals."""
        steps = []
        for s in self.steps:
            d: dict[str, Any] = {"kind": s.step.kind, **{k: v for k, v in vars(s.step).items()}}
            d.update(gpu_bytes=s.gpu_bytes, resident=list(s.resident), seconds=s.seconds, note=s.note)
            if s.blocks is not None:
                d["blocks"] = s.blocks.to_json()
            steps.append(d)
        return {
            "steps": steps,
            "budget": {"gpu": self.budget.gpu, "host": self.budget.host},
            "models": {k: {"nbytes": m.nbytes, "label": m.label} for k, m in self.models.items()},
            "start": {"gpu": sorted(self.start.gpu), "pinned": sorted(self.start.pinned)},
            "end": {"gpu": sorted(self.end.gpu), "pinned": sorted(self.end.pinned)},
            "order": list(self.order),
            "loads": self.loads,
            "bytes_moved": self.bytes_moved,
            "streamed_bytes": self.streamed_bytes,
            "seconds": self.seconds,
            "peak": self.peak,
            "cost_profile": self.cost.name,
        }

    def describe(self, s: PlannedStep) -> tuple[str, str, str]:
        """(step name, model or node, variant/source) of one step, for tables and labels."""
        st = s.step
        if isinstance(st, Run):
            cls = self.classes.get(st.node)
            return "Run", f"{st.node} ({cls})" if cls else st.node, st.variant
        if isinstance(st, Load):
            return "Load", self.label(st.model), f"from {st.source}" + (" +pin" if st.pin else "")
        return "Unload", self.label(st.model), "to pinned" if st.to == "pinned" else "drop"

    def table(self) -> str:
        """Aligned text table, one row per step, and a totals line."""
        rows = [("#", "step", "model/node", "variant", "GPU GiB", "seconds", "note")]
        for i, s in enumerate(self.steps, 1):
            rows.append((str(i), *self.describe(s), _gib(s.gpu_bytes), f"{s.seconds:.3f}", s.note))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        right = {0, 4, 5}
        lines = ["  ".join(v.rjust(widths[c]) if c in right else v.ljust(widths[c]) for c, v in enumerate(r)).rstrip()
                 for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        streamed = f" + {_gib(self.streamed_bytes)} GiB streamed" if self.streamed_bytes else ""
        lines.append(f"{self.loads} loads, {_gib(self.bytes_moved)} GiB moved{streamed}, peak {_gib(self.peak)} of "
                     f"{_gib(self.budget.gpu)} GiB, {self.seconds:.3f} s predicted (costs: {self.cost.name})")
        lines += self.streaming_lines()
        return "\n".join(lines)

    def streaming_lines(self) -> list[str]:
        """One line per Run that streams a model, e.g.
        'Run 6 (VGSampler) stream · transformer 14/25 blocks resident, 3.10 GiB streamed per step'."""
        out = []
        for s in self.steps:
            if s.blocks is not None and isinstance(s.step, Run):
                _, what, how = self.describe(s)
                out.append(f"Run {what} {how} · {s.blocks.describe(self.label(s.blocks.model))}")
        return out

    def graph(self) -> nx.DiGraph:
        """Runs and memory steps as a chain a UI can draw.

        Run nodes are keyed by node id; Load/Unload nodes by "load:<model>@<step>" / "unload:<model>@<step>".
        Memory steps between two runs form a chain prev Run -> Unload -> Load -> next Run (edges kind
        "memory"); consecutive runs with nothing between are joined by an edge of kind "order".
        """
        g = nx.DiGraph()
        prev: str | None = None
        pending: list[str] = []
        for i, s in enumerate(self.steps):
            st = s.step
            name, what, how = self.describe(s)
            if isinstance(st, Run):
                nid = st.node
                g.add_node(nid, kind="run", step=i, variant=st.variant, class_type=self.classes.get(nid, ""),
                           label=f"{what} [{how}]", gpu_bytes=s.gpu_bytes, seconds=s.seconds, note=s.note)
                chain = [p for p in (prev, *pending, nid) if p is not None]
                for a, b in itertools.pairwise(chain):
                    g.add_edge(a, b, kind="memory" if pending else "order")
                prev, pending = nid, []
            else:
                nid = f"{st.kind}:{st.model}@{i}"
                g.add_node(nid, kind=st.kind, step=i, model=st.model, label=f"{name} {what} ({how})",
                           gpu_bytes=s.gpu_bytes, seconds=s.seconds, note=s.note)
                pending.append(nid)
        return g


# ------------------------------------------------------------------------------------------- planning


class _Sizes:
    """Byte sums of model sets and variants, and the block choices of streamed variants, memoised for one plan (the
    planner's inner loops ask often; variants and specs by identity: they live as long as the plan's costs)."""

    def __init__(self, models: Mapping[str, ModelCost]) -> None:
        self.models = models
        self._cache: dict[tuple[str, ...], int] = {}
        self._unique: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._blocks: dict[tuple[int, int, float], BlockPlan | None] = {}
        self._specs: dict[tuple, Any] = {}  # a Blocks' fields -> the first Blocks seen with them
        self._of_blocks: Any = None
        self._spec: dict[int, Any] = {}  # id of a Blocks -> the first equal one seen
        self._alone: dict[int, int] = {}
        self.parts: dict[str, ModelCost] = {}  # kept parts (graph/residency.py) made by pass 3, by key
        self._base: dict[str, str | None] = {}
        self._keeping: dict[tuple[int, str, int, float], BlockPlan | None] = {}
        self._part: dict[tuple[str, tuple[int, ...]], str] = {}

    def w(self, key: str) -> int:
        m = self.models.get(key)
        return (m if m is not None else self.parts[key]).nbytes

    def base(self, key: str) -> str | None:
        """The model whose kept part `key` is; None for a whole model."""
        got = self._base.get(key, ...)
        if got is ...:
            got = self._base[key] = residency.part_of(key)
        return got

    def part(self, bp: BlockPlan) -> str | None:
        """The key of the part a streamed node leaves on the GPU (its fixed weights and resident blocks), made
        known to the plan; None when it leaves nothing."""
        if not bp.resident_bytes:
            return None
        key = self._part.get((bp.model, bp.resident))
        if key is None:
            key = self._part[(bp.model, bp.resident)] = residency.part_key(bp.model, bp.resident)
        if key not in self.models and key not in self.parts:
            label = residency.part_label(self.models[bp.model].name, bp.resident)
            self.parts[key] = ModelCost(key, bp.resident_bytes, label)
            self._base[key] = bp.model
        return key

    def uses(self, m: str, v: Variant) -> bool:
        """Whether v needs m on the GPU: a model it names, or a kept part of the model it streams by blocks."""
        base = self.base(m)
        if base is None:
            return m in v.models
        return v.blocks is not None and v.blocks.model == base

    def excludes(self, m: str, v: Variant) -> bool:
        """Whether m must leave before v runs: a kept part of a model v loads whole."""
        base = self.base(m)
        return base is not None and base in v.models

    def keeping(self, v: Variant, part: str, room: int, bandwidth: float) -> BlockPlan | None:
        """residency.keeping for v with the blocks of the kept part `part`, once per spec, part and room."""
        spec = self._canonical(v)
        key = (id(spec), part, room, bandwidth)
        if key not in self._keeping:
            self._keeping[key] = residency.keeping(spec, residency.part_blocks(part), room, bandwidth)
        return self._keeping[key]

    @property
    def nbytes(self) -> dict[str, int]:
        return {k: m.nbytes for k, m in self.models.items()}

    def weights(self, keys: tuple[str, ...]) -> int:
        got = self._cache.get(keys)
        if got is None:
            got = self._cache[keys] = sum(self.w(k) for k in dict.fromkeys(keys))
        return got

    def unique(self, keys: tuple[str, ...]) -> tuple[str, ...]:
        """`keys` without repeats, in their order."""
        got = self._unique.get(keys)
        if got is None:
            got = self._unique[keys] = tuple(dict.fromkeys(keys))
        return got

    def choose(self, v: Variant, room: int, bandwidth: float) -> BlockPlan | None:
        """residency.choose for the blocks of v, once per distinct spec and room: the nodes of a queue have equal
        specs in distinct objects, and the cache behind residency.choose hashes and compares a whole spec per call."""
        spec = self._canonical(v)
        key = (id(spec), room, bandwidth)
        if key not in self._blocks:
            self._blocks[key] = residency.choose(spec, room, bandwidth)
        return self._blocks[key]

    def _canonical(self, v: Variant) -> Any:
        """The first spec seen equal to v's blocks (the caches above key specs by its identity)."""
        b = v.blocks
        assert b is not None
        spec = self._spec.get(id(b))
        if spec is None:
            spec = self._spec[id(b)] = self._specs.setdefault(self.of_blocks(b), b)
        return spec

    def of_blocks(self, b: Any) -> tuple:
        """A Blocks' fields as a plain tuple (hashed and compared in C, where a dataclass's own methods build the same
        tuple in Python)."""
        if self._of_blocks is None:
            self._of_blocks = operator.attrgetter(*(f.name for f in dataclasses.fields(b)))
        return self._of_blocks(b)

    def holds(self, u: Variant, v: Variant, gpu: int) -> bool:
        """Whether u, a variant that fits alone, holds whole the models v streams (pass 3 streams only a model that
        cannot stay)."""
        return u.blocks is None and self.alone(u) <= gpu and set(v.streams) <= set(u.models)

    def alone(self, v: Variant) -> int:
        """GPU bytes a variant needs with nothing else resident."""
        got = self._alone.get(id(v))
        if got is None:
            got = self._alone[id(v)] = self.weights(v.models) + v.activation
        return got


def _kinds(dag: nx.DiGraph, nodes: list[str], costs: Mapping[str, NodeCost], sizes: _Sizes, gpu: int
           ) -> tuple[dict[str, int], dict[str, Variant]]:
    """Each node's kind for pass 3's remembered choices, and its provisional variant (the first that fits alone).

    Two nodes are of a kind exactly when their variants are equal, field by field: the key is made of plain tuples of
    every field, which hash and compare in C (a variant's blocks by theirs, `_Sizes.of_blocks`), and nodes that list
    the same variant objects are of a kind without that key (a queue's nodes do: nodes/estimates.py). A node that
    lists one variant object twice is of a kind of its own (a choice names its variant by its index, and so do the
    look ahead's questions), and so is one with one variant without weights, where a key would cost more than it
    saves.
    Raises PlanError at the first node that fits with no variant."""
    of_variant = of_blocks = None
    by_key: dict[tuple, int] = {}
    by_ids: dict[tuple[int, ...], int] = {}  # the same variant objects: the same kind, without a look at their fields
    #                                          (the estimates of a queue's nodes share them, nodes/estimates.py)
    fit: list[int] = []  # per kind: the index of its first variant that fits alone
    kinds: dict[str, int] = {}
    prov: dict[str, Variant] = {}
    for n in nodes:
        vs = costs[n].variants
        v = vs[0]
        if len(vs) == 1 and not v.models and not v.streams:
            k = len(fit)  # (one without weights: pass 3 runs it as it is unless it does not fit beside the resident
            #               models, which is rare enough to weigh it every time)
        else:
            ids = tuple(map(id, vs))
            k = by_ids.get(ids) if _SHORTCUTS else None
            if k is None:
                if len(set(ids)) < len(ids):
                    k = len(fit)
                else:
                    if of_variant is None:
                        of_variant = operator.attrgetter(*(f.name for f in dataclasses.fields(v)
                                                           if f.name != "blocks"))
                        of_blocks = sizes.of_blocks
                    key = tuple([(of_variant(u), u.blocks and of_blocks(u.blocks)) for u in vs])
                    k = by_ids[ids] = by_key.setdefault(key, len(fit))
        if k == len(fit):
            j = next((j for j, u in enumerate(vs) if sizes.alone(u) <= gpu), None)
            if j is None:
                raise _cycle(dag) or _infeasible(costs[n], sizes, gpu)
            fit.append(j)
        kinds[n] = k
        prov[n] = vs[fit[k]]
    return kinds, prov


def _infeasible(nc: NodeCost, sizes: _Sizes, budget: int) -> PlanError:
    v = min(nc.variants, key=sizes.alone)
    needed, w = sizes.alone(v), sizes.weights(v.models)
    at_least = -(-needed * 100 // GiB) / 100  # rounded up to the hundredth: a budget that surely fits
    if v.blocks is not None:
        fit = (f"{residency.floor_text(v.blocks)}; it needs a budget of at least {at_least:.2f} GiB "
               "(or a smaller image or batch)")
    elif w < budget:
        fit = (f"it would fit with a budget of at least {at_least:.2f} GiB, or with {v.name!r} at an activation "
               f"of at most {(budget - w) * 100 // GiB / 100:.2f} GiB (a smaller image or batch)")
    else:
        fit = (f"its weights alone ({_gib(w)} GiB) exceed the budget; it needs a budget of at least "
               f"{at_least:.2f} GiB")
    what = "streamed" if v.blocks is not None else f"(weights {_gib(w)} GiB + activation {_gib(v.activation)} GiB)"
    msg = (f"node {nc.node!r} ({nc.class_type}) needs {_gib(needed)} GiB of GPU memory with its smallest variant "
           f"{v.name!r} {what} but the budget is {_gib(budget)} GiB; {fit}")
    details = "; ".join(f"{x.name}: {_gib(sizes.alone(x))} GiB (weights {_gib(sizes.weights(x.models))} + "
                        f"activation {_gib(x.activation)})" for x in nc.variants)
    extra = {"variants": [{"name": x.name, "needed_bytes": sizes.alone(x)} for x in nc.variants],
             "min_budget_gib": at_least}
    return PlanError(nc.node, nc.class_type, needed, budget, msg, details, extra)


def _cycle(dag: nx.DiGraph) -> ValueError | None:
    """The error for a graph with a cycle, None for one without. Asked only where planning stops, so that a cycle is
    named before any other fault; a graph that passes the checks is found cyclic by pass 1, which cannot order the
    nodes of a cycle (a check of its own up front took a twentieth of a 64-prompt plan)."""
    if nx.is_directed_acyclic_graph(dag):
        return None
    cycle = nx.find_cycle(dag)
    return ValueError(f"the graph has a cycle through {[u for u, _ in cycle]}; break it to plan")


def _validate(dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost],
              start: Residency) -> list[str]:
    def fault(message: str) -> ValueError:
        return _cycle(dag) or ValueError(message)

    nodes = list(dag.nodes)
    seen: set[int] = set()  # variants checked (a queue's nodes share theirs)
    for n in nodes:
        nc = costs.get(n)
        if nc is None:
            raise fault(f"node {n!r} has no NodeCost: estimate every node before planning")
        if not nc.variants:
            raise fault(f"node {n!r} ({nc.class_type}) has no variants: give it at least one")
        for v in nc.variants:
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
    return nodes


def _edges(dag: nx.DiGraph, nodes: list[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Each node's producers and consumers, read once for all the passes (networkx's per-node views cost more than
    the rest of a pass)."""
    succs = {n: list(after) for n, after in dag.adjacency()}
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    for u in nodes:
        for v in succs[u]:
            preds[v].append(u)
    return preds, succs


def _order(nodes: list[str], preds: Mapping[str, list[str]], succs: Mapping[str, list[str]],
           costs: Mapping[str, NodeCost], sizes: _Sizes, gpu: int, prov: Mapping[str, Variant], start: Residency,
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
                        _gib(live + hb[pick]), pick, _gib(host_limit))
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


def _made(cls: type, fields: dict[str, Any]) -> Any:
    """`cls(**fields)` for a frozen dataclass without __post_init__ whose `fields` are all of its fields: half the
    time of its __init__, which sets each field through object.__setattr__ (a 64-prompt plan makes a thousand)."""
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made


_FIELDS = {kind: tuple(f.name for f in dataclasses.fields(kind)) for kind in (Load, Unload, Run)}


@dataclass
class _Assigned:
    rows: list[tuple]  # each step as (Run/Load/Unload, its fields, then PlannedStep's other fields, the note perhaps
    #                    as _run_note's arguments): plan() makes steps only of the pass it returns
    chosen: dict[str, Variant]
    end: Residency
    loads: Counter[str]
    unloaded: set[str]  # models an Unload step frees
    moved: int  # bytes copied host->GPU, as Plan.bytes_moved + Plan.streamed_bytes count them
    weighed: set[str]  # models whose eviction was priced (evict_cost asked)

    def steps(self) -> tuple[PlannedStep, ...]:
        notes: dict[int, str] = {}  # _run_note of each arguments tuple (the nodes of a remembered choice share one)

        def text(note: str | tuple) -> str:
            if isinstance(note, str):
                return note
            got = notes.get(id(note))
            if got is None:
                got = notes[id(note)] = _run_note(*note)
            return got

        return tuple(_made(PlannedStep, {"step": _made(kind, dict(zip(_FIELDS[kind], args, strict=True))),
                                         "gpu_bytes": gpu, "resident": res, "seconds": secs, "note": text(note),
                                         "streams": streams, "blocks": bp})
                     for kind, args, gpu, res, secs, note, streams, bp in self.rows)

    def repinned(self, pins: frozenset[str]) -> _Assigned:
        """This pass, made with every model pinned once loaded, as the same order gets it with only `pins` (which hold
        the start's pinned copies): its Loads of the other models make no copy, and the end keeps only those of `pins`.

        Valid where no model outside `pins` is unloaded, streamed or weighed for eviction in this pass (plan() checks):
        pass 3 asks whether a model has a pinned copy only to price its reload, its stream or its eviction, and a model
        outside `pins` has a copy here only once loaded; loaded, it stays, so nothing asks, and every choice is the
        same."""
        rows = [(Load, (r[1][0], "file", False), r[2], r[3], r[4], r[5].removesuffix(_PINNING), r[6], r[7])
                if r[0] is Load and r[1][2] and r[1][0] not in pins else r for r in self.rows]
        end = Residency(self.end.gpu, self.end.pinned & pins, self.end.kept)
        return _Assigned(rows, self.chosen, end, self.loads, self.unloaded, self.moved, self.weighed)


def _run_note(v: Variant, first: Variant, bp: BlockPlan | None, label: str, t: float,
              options: list[tuple[Variant, float | None]], tie: tuple[str, float, int] | None) -> str:
    """A Run's note: the variant's own, what it streams, what it was chosen over when it is not the first, and, where
    it is not the fastest, the near tie that it won by copying fewer bytes (`tie`: the fastest's name, seconds, and
    the bytes more it copies)."""
    parts = [v.note] if v.note else []
    if bp is not None:
        parts.append(bp.describe(label))
    if v is not first or tie:
        alts = ", ".join([f"{a.name}: does not fit" if ta is None else f"{a.name}: {ta:.3f} s"
                          for a, ta in options if a is not v])
        parts.append(f"chosen at {t:.3f} s over {alts}")
    if tie:
        parts.append(f"{tie[0]} is within {TIE:.1%} of it and would copy {_gib(tie[2])} GiB more")
    return "; ".join(parts)


@dataclass
class _Memo:
    """What the passes 3 of one plan share: each node's kind (`_kinds`), the choices remembered by kind and state
    (`known`; None: weigh every node) and the look ahead's tables ((id(order), model) -> (order, table))."""

    kinds: dict[str, int]
    known: dict[tuple, tuple] | None = field(default_factory=dict)
    tables: dict[tuple[int, str], tuple[list[str], list[int]]] = field(default_factory=dict)


class _NextUse:
    """Pass 3's look ahead for evicting model m at position i: the first node after i, in this run and then (with
    `repeat`) in the next, whose variant uses m or cannot fit beside it, and its distance. The nodes after i have
    their provisional variant (none is chosen yet), the ones before i their chosen one, which stays as it is; so a
    table per model answers the first part and a mark per model the second, where a walk along the order would do it
    for every eviction. Ask with positions that never go down, as pass 3 does."""

    def __init__(self, order: list[str], prov: Mapping[str, Variant], sizes: _Sizes, gpu: int, repeat: bool,
                 memo: _Memo) -> None:
        self.order, self.prov, self.sizes, self.gpu, self.repeat, self.memo = order, prov, sizes, gpu, repeat, memo
        self.ahead: dict[str, list[int]] = {}  # m -> per position, the first at or after it whose provisional variant
        #                                        meets m (len(order): none)
        self.behind: dict[str, list[Any]] = {}  # m -> [the first position whose chosen variant meets m, or None;
        #                                          the positions looked at]

    def meets(self, m: str, v: Variant) -> bool | None:
        """True: v uses m; False: v and m cannot fit together (or m is a kept part of a model v loads whole);
        None: neither."""
        sizes = self.sizes
        if sizes.uses(m, v):
            return True
        return False if sizes.excludes(m, v) or sizes.weights(v.models) + sizes.w(m) + v.activation > self.gpu \
            else None

    def _table(self, m: str) -> list[int]:
        """Per position, the first at or after it whose provisional variant meets m (meets, spelled out: a kept part
        meets the nodes that stream its model and those that load it whole); len(order) for none."""
        order, n = self.order, len(self.order)
        ahead = [n] * (n + 1)
        prov, alone, room, nxt = self.prov, self.sizes.alone, self.gpu - self.sizes.w(m), n
        base = self.sizes.base(m)
        hit: dict[int, bool] = {}  # by kind: the nodes of a kind share their provisional variant
        kinds = self.memo.kinds
        for j in range(n - 1, -1, -1):
            node = order[j]
            h = hit.get(kinds[node])
            if h is None:
                v = prov[node]
                if base is None:
                    h = m in v.models or alone(v) > room
                else:
                    h = base in v.models or (v.blocks is not None and v.blocks.model == base) or alone(v) > room
                hit[kinds[node]] = h
            if h:
                nxt = j
            ahead[j] = nxt
        return ahead

    def first(self, m: str, i: int, chosen: Mapping[str, Variant], cur: Variant) -> tuple[Variant, int] | None:
        """(variant, distance) of the first node after position i that meets m, `cur` (position i in the next run)
        last; None when none does."""
        order, n = self.order, len(self.order)
        ahead = self.ahead.get(m)
        if ahead is None:
            tables = self.memo.tables
            got = tables.get((id(order), m))
            if got is None or got[0] is not order:
                got = tables[(id(order), m)] = order, self._table(m)
            ahead = self.ahead[m] = got[1]
        j = ahead[i + 1]
        if j < n:
            return self.prov[order[j]], j - i
        if not self.repeat:
            return None
        seen = self.behind.setdefault(m, [None, 0])
        if seen[0] is None:
            seen[0] = next((k for k in range(seen[1], i) if self.meets(m, chosen[order[k]]) is not None), None)
            seen[1] = i
        if seen[0] is not None:
            return chosen[order[seen[0]]], n - i + seen[0]
        return (cur, n) if self.meets(m, cur) is not None else None


def _alike(known: tuple[tuple[str, int, tuple[float, float]], ...],
           asked: list[tuple[str, Variant, tuple[float, float]]]) -> bool:
    """Whether the look ahead's answers `asked` (reload seconds, distance to the next use), whose seconds equal those
    of the remembered answers `known` one by one, order every pair of equal seconds by distance as `known` does. Pass
    3 uses a distance only for that, to rank evictions of equal cost (the farthest next use first), so a node of a
    queue whose next use is one node nearer than the last one's takes the same choice."""
    for x in range(len(asked)):
        for y in range(x + 1, len(asked)):
            (c, d), (_, e) = known[x][2], known[y][2]
            if c == known[y][2][0]:
                f, g = asked[x][2][1], asked[y][2][1]
                if (d > e) != (f > g) or (d < e) != (f < g):
                    return False
    return True


def _assign(order: list[str], costs: Mapping[str, NodeCost], sizes: _Sizes, budget: Budget, cm: CostModel,
            start: Residency, prov: Mapping[str, Variant], pins: frozenset[str], repeat: bool, memo: _Memo
            ) -> _Assigned:
    """Pass 3: residency and variants along a fixed order (see the module docstring).

    The nodes of a queue repeat, and so do their choices: a choice depends only on the node's variants, the resident
    models in their order (kept parts included), the pinned copies, and the look ahead's answers to the evictions it
    priced. So they are remembered in `memo.known` (for all the passes of one plan; None: weigh every node): a node of
    the same kind (`memo.kinds`: equal variants) in the same state takes the remembered choice once the look ahead
    gives answers alike to the same questions (asked in the same order, so that weighing it would follow the same
    path): the same reload seconds, and distances that rank alike (`_alike`)."""
    gpu = budget.gpu
    w = {k: m.nbytes for k, m in sizes.models.items()}
    w.update((k, m.nbytes) for k, m in sizes.parts.items())
    resident: list[str] = sorted(start.gpu)
    kept: dict[str, str] = {}  # model -> the key of its kept part on the GPU (graph/residency.py)
    for m in resident:
        if sizes.base(m) is not None:
            kept[sizes.base(m)] = m
    pinned: set[str] = set(start.pinned)
    chosen: dict[str, Variant] = {}
    rows: list[tuple] = []
    loads: Counter[str] = Counter()
    unloaded: set[str] = set()
    weighed: set[str] = set()
    moved = 0
    part_bw = cm.h2d_pinned * residency.STREAM_COPY_EFFICIENCY  # a kept part comes back with its node's upload

    after = _NextUse(order, prov, sizes, gpu, repeat, memo)
    kinds, known = memo.kinds, memo.known

    asked: list[tuple[str, Variant, tuple[float, float]]] = []  # evict_cost's questions and answers for one node

    def evict_cost(m: str, i: int, cur: Variant) -> tuple[float, float]:
        """(reload seconds this eviction causes, distance to the next use); 0 s when m must leave anyway."""
        weighed.add(m)
        got = after.first(m, i, chosen, cur)
        if got is not None and sizes.uses(m, got[0]):  # (it meets m: uses it, or cannot fit beside it)
            if sizes.base(m) is not None:  # a kept part: uploaded again by the next node that streams its model
                answer = w[m] / part_bw, got[1]
            else:
                answer = cm.load_seconds(w[m], m in pinned), got[1]  # m is resident: pinned by now if ever
        else:
            answer = 0.0, _INF  # never used again, or forced out anyway: that node and m cannot fit together
        asked.append((m, cur, answer))
        return answer

    def gone(v: Variant) -> tuple[list[str], str | None]:
        """The kept parts v frees without an eviction: those of the models it loads whole (which must leave
        first), and the part of the model it streams by blocks (None if none), which it takes over."""
        drop = [kept[m] for m in sizes.unique(v.models) if m in kept]
        own = kept.get(v.blocks.model) if v.blocks is not None else None
        return drop, own

    def evictions(i: int, v: Variant, total: int, skip: list[str]) -> tuple[list[str], float]:
        """The models to unload before v runs at position i (`total`: the GPU bytes it needs with all resident
        but `skip`), and the reload seconds that costs."""
        keyed = sorted(((*evict_cost(m, i, v), m) for m in resident if m not in v.models and m not in skip),
                       key=lambda t: (t[0], -t[1], -w[t[2]]))
        out: list[tuple[float, float, str]] = []
        for t in keyed:
            if total <= gpu:
                break
            out.append(t)
            total -= w[t[2]]
        for t in reversed(out[:]):  # keep back any evicted model that still fits, most costly first
            if total + w[t[2]] <= gpu:
                out.remove(t)
                total += w[t[2]]
        return [m for _, _, m in out], sum(c for c, _, _ in out)

    def free(i: int, u: Variant) -> bool:
        """Whether u can run at position i without pushing out a model that would have to come back."""
        drop, _ = gone(u)
        total = held - sum(w[m] for m in drop) + sum(w[m] for m in sizes.unique(u.models) if m not in resident) \
            + u.activation
        return total <= gpu or evictions(i, u, total, drop)[1] == 0

    def read_first(v: Variant) -> float:
        """Reading a streamed model's file into its pinned host copy, the first time."""
        secs = 0.0  # (loops rather than generators in this pass: it runs them for every streamed node of a queue)
        for m in v.streams:
            if m not in pinned:
                secs += cm.load_seconds(w[m], False)
        return secs

    def streamed(i: int, v: Variant, missing: int, out: list[str], reload_s: float, own: str | None
                 ) -> tuple[float, list[str], BlockPlan]:
        """A block-streaming variant: the resident blocks that fit beside the models that stay (the kept part
        `own` reused where keeping its blocks is faster), and whether evicting more models (cheapest first) buys a
        faster node than their reloads cost."""
        assert v.blocks is not None
        bw = cm.h2d_pinned
        room = gpu - held - missing  # for the node's own bytes, beside the models that stay
        for m in out:
            room += w[m]
        if own is not None:
            room += w[own]

        def best_at(room: int) -> BlockPlan | None:
            bp = sizes.choose(v, room, bw)
            if own is not None:
                kb = sizes.keeping(v, own, room, bw)
                if kb is not None and (bp is None or kb.seconds < bp.seconds):
                    bp = kb
            return bp

        best_bp = best_at(room)
        best_t, best_out = (_INF if best_bp is None else best_bp.seconds + reload_s), out
        more = []
        for m in resident:
            if m not in out and m not in v.models and m != own:
                more.append((*evict_cost(m, i, v), m))
        if len(more) > 1:
            more.sort(key=lambda t: (t[0], -t[1], -w[t[2]]))
        extra_s = 0.0
        for k, (c, _, m) in enumerate(more, 1):
            extra_s += c
            room += w[m]
            bp = best_at(room)
            if bp is not None and bp.seconds + reload_s + extra_s < best_t:
                best_t, best_out, best_bp = bp.seconds + reload_s + extra_s, out + [m for _, _, m in more[:k]], bp
        assert best_bp is not None  # the variant's activation is its least need, which evictions made room for
        return best_t, best_out, best_bp

    def weigh(i: int, nc: NodeCost) -> tuple[int, list[str], BlockPlan | None, str | None, float, str | tuple]:
        """The variant of node `nc` at position i and what running it takes: (its index in nc.variants, the models to
        unload first, its block plan if it streams, the kept part it takes over, its Run's seconds, its note or
        _run_note's arguments)."""
        cands: list[tuple[float, int, int, list[str], BlockPlan | None, float, str | None]] = []  # (seconds, bytes
        #                                            copied, index, evictions, block plan, first read, kept part taken)
        options: list[tuple[Variant, float | None]] = []
        for k, v in enumerate(nc.variants):
            if sizes.alone(v) > gpu:
                options.append((v, None))
                continue
            if v.streams:
                for m in v.streams:  # streaming a resident model would hold it twice
                    if m in resident:
                        break
                else:
                    m = None
                if m is not None:
                    options.append((v, None))
                    continue
            if v.blocks is not None:  # streaming is for a model that cannot stay: not when it can
                for u in nc.variants:
                    if sizes.holds(u, v, gpu) and free(i, u):
                        break
                else:
                    u = None
                if u is not None:
                    options.append((v, None))
                    continue
            drop, own = gone(v) if kept else ([], None)
            missing, need = [], 0
            for m in sizes.unique(v.models):
                if m not in resident:
                    missing.append(m)
                    need += w[m]
            total = held + need + v.activation
            for m in drop:
                total -= w[m]
            if own is not None:
                total -= w[own]
            out, reload_s = ([], 0.0) if total <= gpu else evictions(i, v, total, [*drop, own] if own else drop)
            out = drop + out
            bp, read = None, 0.0
            if v.blocks is not None:
                t, out, bp = streamed(i, v, need, out, reload_s, own)
                read = read_first(v)
                t += read
            else:
                t = cm.run_seconds(v) + reload_s
                if v.streams:  # (an empty sum adds 0: skipping it leaves t as it is)
                    t += sum(cm.load_seconds(w[m], m in pinned) for m in v.streams)
            if missing:
                t += sum(cm.load_seconds(w[m], m in pinned) for m in missing)
            options.append((v, t))
            copied = need + (bp.uploaded if bp is not None else sum(w[m] for m in v.streams))
            cands.append((t, copied, k, out, bp, read, own))
        assert cands  # feasibility was checked up front
        best = fastest = min(cands, key=lambda c: c[0])  # (the first of equals)
        if len(cands) > 1:  # a near tie in predicted time goes to the option that copies fewer bytes
            best = min((c for c in cands if c[0] <= fastest[0] * (1 + TIE) and c[1] < fastest[1]),
                       key=lambda c: (c[1], c[0], c[2]), default=fastest)
        tie = None if best is fastest else (nc.variants[fastest[2]].name, fastest[0], fastest[1] - best[1])
        t, _, k, out, bp, read, own = best
        v = nc.variants[k]
        note: str | tuple = v.note
        if bp is not None or v is not nc.variants[0] or tie:  # written out only for the steps of the plan returned
            note = (v, nc.variants[0], bp, sizes.models[bp.model].name if bp is not None else "", t, options, tie)
        return k, out, bp, own, bp.seconds + read if bp is not None else cm.run_seconds(v), note

    held = sum(w[m] for m in resident)  # bytes of the resident weights
    now = tuple(resident)
    copies = frozenset(pinned)  # `known` is by the node's kind, the resident models (in their order) and these
    for i, node in enumerate(order):
        nc = costs[node]
        vs = nc.variants
        if len(vs) == 1 and not vs[0].models and not vs[0].streams \
                and held + vs[0].activation <= gpu:  # a host node, or one without weights: nothing moves
            v = chosen[node] = vs[0]
            rows.append((Run, (node, v.name), held + v.activation, now, cm.run_seconds(v), v.note, (), None))
            continue
        key = (kinds[node], now, copies) if known is not None else None
        got = known.get(key) if key is not None else None
        asked.clear()
        if got is not None and got[1]:  # the same questions to the look ahead must get answers alike (_alike)
            for m, j, answer in got[1]:
                if evict_cost(m, i, vs[j])[0] != answer[0]:
                    got = None
                    break
            else:
                if len(asked) > 1 and not _alike(got[1], asked):
                    got = None
        if got is None:
            asked.clear()
            choice = weigh(i, nc)
            if key is not None:
                index = {id(x): j for j, x in enumerate(vs)}
                known[key] = choice, tuple((m, index[id(cur)], answer) for m, cur, answer in asked)
        else:
            choice = got[0]
        k, out, bp, own, secs, note = choice
        v = chosen[node] = vs[k]
        for m in out:
            resident.remove(m)
            held -= w[m]
            now = tuple(resident)
            unloaded.add(m)
            base = sizes.base(m)
            if base is not None:
                del kept[base]
            rows.append((Unload, (m, "pinned" if m in pinned or base is not None else "drop"), held, now, 0.0,
                         f"makes room for {node} ({nc.class_type})", (), None))
        for m in sizes.unique(v.models):
            if m in resident:
                continue
            src = "pinned" if m in pinned else "file"
            pin = src == "file" and m in pins
            if pin:
                pinned.add(m)
                copies = frozenset(pinned)
            resident.append(m)
            held += w[m]
            now = tuple(resident)
            loads[m] += 1
            moved += w[m]
            why = f"for {node}" + (_PINNING if pin else "")
            rows.append((Load, (m, src, pin), held, now, cm.load_seconds(w[m], src == "pinned"), why, (), None))
        for m in v.streams:  # the executor reads (and keeps) its pinned copy for the stream
            if m in pins and m not in pinned:
                pinned.add(m)
                copies = frozenset(pinned)
        gpu_bytes = held + v.activation
        if bp is not None:
            if own is not None:  # taken over by this node: reused, or freed as it starts when its blocks differ
                resident.remove(own)
                held -= w[own]
                del kept[bp.model]
            gpu_bytes = held + bp.gpu_bytes
            moved += bp.uploaded
            part = sizes.part(bp)
            if part is not None:  # its resident part stays on the GPU after it, until a node needs the room
                w[part] = sizes.w(part)
                kept[bp.model] = part
                resident.append(part)
                held += w[part]
            now = tuple(resident)
        rows.append((Run, (node, v.name), gpu_bytes, now, secs, note, tuple(v.streams), bp))
    kept_parts = tuple(sizes.parts.get(m) or sizes.models[m] for m in kept.values())
    end = Residency(frozenset(resident), frozenset(pinned), kept_parts)
    return _Assigned(rows, chosen, end, loads, unloaded, moved, weighed)


def _grouped(order: list[str], preds: Mapping[str, list[str]], succs: Mapping[str, list[str]],
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


def _all_fit(kinds: Iterable[tuple[Variant, ...]], sizes: _Sizes, gpu: int, resident: Residency) -> bool:
    """Whether pass 3 from `resident` surely unloads no model and streams none (`kinds`: the variants of each kind of
    node): the variants it weighs need models that fit on the GPU together, beside what is resident (kept parts too)
    and the largest of their activations (it evicts only for a variant that does not fit), and none of them streams.
    It never weighs a variant that streams a model another variant of its node holds whole: that one fits and is
    free."""
    weighed = []
    for vs in kinds:
        for v in vs:
            if sizes.alone(v) > gpu:
                continue
            if v.streams or v.blocks is not None:
                if v.blocks is None or not any(sizes.holds(u, v, gpu) for u in vs):
                    return False
                continue
            weighed.append(v)
    held = {m for v in weighed for m in v.models} | resident.gpu
    return sum(sizes.w(m) for m in held) + max((v.activation for v in weighed), default=0) <= gpu


def _host_peak(order: list[str], preds: Mapping[str, list[str]], succs: Mapping[str, list[str]],
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


def _choose_pins(first: _Assigned, sizes: _Sizes, costs: Mapping[str, NodeCost], order: list[str],
                 start: Residency, room: int, evicted: set[str]) -> frozenset[str]:
    """Pass 2: the models that get a pinned copy: start's, then among the candidates (`evicted`: models that get
    unloaded, or all used models when they cannot stay together), while host RAM allows, the most loaded ones,
    the largest first among equals (a pinned reload saves time in proportion to bytes)."""
    used = dict.fromkeys(m for n in order for v in costs[n].variants for m in v.models if m in evicted)
    rank = {m: (-first.loads[m], -sizes.w(m), k) for k, m in enumerate(used)}
    pins = set(start.pinned)
    for m in sorted((m for m in used if m not in pins), key=rank.__getitem__):
        if sizes.w(m) <= room:
            pins.add(m)
            room -= sizes.w(m)
    return frozenset(pins)


def plan(dag: nx.DiGraph, costs: Mapping[str, NodeCost], models: Mapping[str, ModelCost], budget: Budget,
         cost: CostModel = CostModel(), start: Residency = Residency(), *, repeat: bool = True) -> Plan:
    """Plan one run of `dag`: the order, every node's variant and the Load/Unload steps between runs.

    `dag` edges u->v mean v consumes an output of u; every node needs a NodeCost in `costs`. `start` is the
    residency left by the previous run. With `repeat`, the plan expects the same graph to run again next
    and keeps what that run will want. Raises PlanError when a node fits with no variant.
    """
    if start.kept:
        models = {**models, **{m.key: m for m in start.kept if m.key in start.gpu}}
    nodes = _validate(dag, costs, models, start)
    sizes = _Sizes(models)
    kinds, prov = _kinds(dag, nodes, costs, sizes, budget.gpu)
    memo = _Memo(kinds, {} if _SHORTCUTS else None)  # what its passes 3 share
    pinned_bytes = sum(sizes.w(m) for m in start.pinned if m in models)
    preds, succs = _edges(dag, nodes)
    order, peak_out = _order(nodes, preds, succs, costs, sizes, budget.gpu, prov, start, budget.host - pinned_bytes)
    if len(order) < len(nodes):  # the nodes of a cycle never get ready
        raise _cycle(dag) or RuntimeError(f"pass 1 left out {sorted(set(nodes) - set(order))}")
    everything = frozenset(models)
    # results early where that moves no byte more than the grouped order, with or without them (module docstring,
    # pass 1); pass 1's order stands in for the grouped one where grouping would hold more host RAM than there is
    early = FinishEarly(order, succs, prov, sizes.nbytes, budget.gpu, sorted(start.gpu))
    chosen = early(order)
    first = _assign(chosen, costs, sizes, budget, cost, start, prov, everything, repeat, memo)
    streams = any(r[-1] is not None for r in first.rows)  # a row's last field: its block plan
    if max(first.loads.values(), default=0) > 1 or streams:  # else no order moves less
        host_room = max(budget.host - pinned_bytes, peak_out)  # (pass 1 may have had to go over it)
        tight = sum(costs[n].host_bytes for n in nodes) > host_room  # else no order holds more than there is
        grouped = _grouped(order, preds, succs, costs, prov)
        if tight and _host_peak(grouped, preds, succs, costs) > host_room:
            grouped = order
        tried = [chosen]
        for cand in (early(grouped) if grouped != order else chosen, grouped):
            if cand in tried or (tight and _host_peak(cand, preds, succs, costs) > host_room):
                continue
            tried.append(cand)
            other = _assign(cand, costs, sizes, budget, cost, start, prov, everything, repeat, memo)
            if other.moved < first.moved:
                first, chosen, peak_out = other, cand, _host_peak(cand, preds, succs, costs)
    order = chosen
    # a pinned copy pays only for a model that gets unloaded: in this run, in the next one if it repeats, or by
    # some other prompt when the used models cannot all stay on the GPU together
    evicted = set(first.unloaded)
    evicted |= {m for v in first.chosen.values() for m in v.streams}
    used_models = {m for v in first.chosen.values() for m in v.models + v.streams}
    if sum(sizes.w(m) for m in used_models) + max((v.activation for v in first.chosen.values()), default=0) \
            > budget.gpu:
        evicted |= used_models  # the models cannot all stay: any of them may have to leave for a later prompt
    variants = {}  # the variants of a node of each kind: all the variants of the plan
    for n, k in kinds.items():
        variants.setdefault(k, costs[n].variants)
    used = {m for vs in variants.values() for v in vs for m in v.models}
    # (the next run can only add candidates that are not in yet, and none where it surely moves nothing)
    if repeat and not used <= evicted and not (_SHORTCUTS and _all_fit(variants.values(), sizes, budget.gpu,
                                                                       first.end)):
        nxt = _assign(order, costs, sizes, budget, cost, first.end, prov, everything, repeat, memo)
        evicted |= nxt.unloaded
        evicted |= {m for v in nxt.chosen.values() for m in v.streams}
    pins = _choose_pins(first, sizes, costs, order, start, budget.host - peak_out - pinned_bytes, evicted)
    if used <= pins:
        done = first
    elif _SHORTCUTS and evicted <= pins and first.weighed <= pins:  # the copies left out change no choice
        #                                                                  (_Assigned.repinned)
        done = first.repinned(pins)
    else:
        done = _assign(order, costs, sizes, budget, cost, start, prov, pins, repeat, memo)
    parts = {k: sizes.parts[k] for s in done.rows for k in s[3] if k in sizes.parts} if sizes.parts else {}
    #         (a row's resident keys)
    return Plan(done.steps(), budget, {**models, **parts}, done.end, start,
                {n: costs[n].class_type for n in nodes}, cost)
