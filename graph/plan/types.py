"""The planner's inputs (the sizes and costs it sees) and its output: a Plan of Load, Unload and Run steps.

Plain frozen dataclasses, no torch and no node module: graph/workflow/estimate.py turns node estimates into NodeCost and
ModelCost, engine/budget.py makes the Budget, engine/costs.py the CostModel; plan/planner.py plans; the executor, the
timeline and the server read the Plan. graph/plan/planner.py re-exports every name here.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import networkx as nx

from .residency import BlockPlan

if TYPE_CHECKING:  # only a name in annotations: the planner runs on costs, never imports a node module
    from ...nodes.types import Variant

GiB = 2**30
DEFAULT_RESERVE = 128 * 2**20  # what torch's allocator holds above the live tensors (graph/engine/budget.py: measured)


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
    """What moving and computing cost on one machine (graph/engine/costs.py: named profiles and the start-up probe).
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
    """The GPU and host memory a plan must stay within (graph/engine/budget.py measures it or parses --vram)."""

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
    kept: tuple[ModelCost, ...] = ()  # the kept parts in `gpu` (graph/plan/residency.py), so that a plan starting from
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
    blocks: BlockPlan | None = None  # Run that streams a model block by block: which blocks stay (plan/residency.py)


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


def gib(n: float) -> str:
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
            rows.append((str(i), *self.describe(s), gib(s.gpu_bytes), f"{s.seconds:.3f}", s.note))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        right = {0, 4, 5}
        lines = ["  ".join(v.rjust(widths[c]) if c in right else v.ljust(widths[c]) for c, v in enumerate(r)).rstrip()
                 for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        streamed = f" + {gib(self.streamed_bytes)} GiB streamed" if self.streamed_bytes else ""
        lines.append(f"{self.loads} loads, {gib(self.bytes_moved)} GiB moved{streamed}, peak {gib(self.peak)} of "
                     f"{gib(self.budget.gpu)} GiB, {self.seconds:.3f} s predicted (costs: {self.cost.name})")
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
