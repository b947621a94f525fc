"""One run of the engine: what it reports (`NodeReport`, `RunResult`), how outputs are taken out of it while it
runs (`Cancel`), and `RunState`, everything a run changes as it goes.

`Engine.run` makes a `RunState` for each run and drops it when the run returns; the engine itself keeps only
what outlives a run (the ledger, the output cache, the budget, the planner's caches). So two runs, one after the
other or on two engines of one process (graph/engine/devices.py), never see each other's prompt id,
cancellations, retries or exchange, and a node's context (`NodeContext.run`) is its own run's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import networkx as nx

from ..plan import planner
from ..workflow.errors import InterruptedRun
from .planning import Prepared

if TYPE_CHECKING:
    from .devices import Exchange

Events = Callable[[str, dict], None]


def _quiet(kind: str, data: dict) -> None:
    pass


@dataclass
class NodeReport:
    node: str
    class_type: str
    variant: str
    seconds: float
    predicted_bytes: int = 0
    measured_bytes: int = 0


@dataclass
class RunResult:
    prompt_id: str
    plan: planner.Plan
    ui: dict[str, dict] = field(default_factory=dict)  # output node id -> ComfyUI "ui" dict
    images: list[Path] = field(default_factory=list)
    nodes: list[NodeReport] = field(default_factory=list)
    cached: tuple[str, ...] = ()
    loads: int = 0
    unloads: int = 0
    seconds: float = 0.0
    replans: list[planner.Plan] = field(default_factory=list)  # the rest of the run planned again (live budget)

    def to_json(self) -> dict:
        return {"prompt_id": self.prompt_id, "seconds": round(self.seconds, 4), "loads": self.loads,
                "unloads": self.unloads, "cached": list(self.cached), "images": [str(p) for p in self.images],
                "nodes": [vars(n) for n in self.nodes], "plan": self.plan.to_json(), "replans": len(self.replans)}


class Cancel:
    """Output nodes to leave out of a run, asked from any thread before or while it runs (see executor.py's doc).

    `Engine.run(..., cancel=c)` polls it before every step and at every progress report of a node; each time new
    outputs are asked for, the run reports a "cancelled" event: {"outputs": those outputs, "node": the running
    node stopped for them or None, "dropped": the nodes left out for them, in plan order}.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outputs: set[str] = set()

    def outputs(self, ids: Iterable[str]) -> None:
        with self._lock:
            self._outputs.update(ids)

    def wanted(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._outputs)


class _Dropped(InterruptedRun):
    """The running node was left out of its run by a `Cancel` (caught by the run, never raised out of it)."""


@dataclass
class Cuts:
    """A run's cancellations so far: the outputs given up and the plan's nodes no longer to run."""

    cancel: Cancel
    step: int = 0  # the plan step the run is at (0 again when the rest is planned again)
    outputs: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)

    def apply(self, run: RunState, running: str | None) -> bool:
        """Take in newly cancelled outputs of `run`; True when `running` is no longer needed."""
        prep = run.prep
        new = (self.cancel.wanted() & set(prep.outputs)) - self.outputs
        if new:
            self.outputs |= new
            keep: set[str] = set()
            for o in prep.outputs:
                if o not in self.outputs:
                    keep |= nx.ancestors(prep.dag, o) | {o}
            later = [s.step.node for s in prep.plan.steps[self.step:] if isinstance(s.step, planner.Run)]
            cut = [n for n in later if n not in keep and n not in self.dropped and n not in run.values]
            self.dropped.update(cut)
            run.events("cancelled", {"outputs": sorted(new), "node": running if running in cut else None,
                                     "dropped": cut})
        return running is not None and running in self.dropped


@dataclass(eq=False)
class RunState:
    """What one run changes as it goes (see the module doc); the output cache takes `values` and `ui` at its end."""

    prompt_id: str
    prep: Prepared  # the prompt as planned; its plan is replaced when the rest of the run is planned again
    result: RunResult
    events: Events = _quiet
    extra_pnginfo: dict | None = None
    values: dict[str, tuple] = field(default_factory=dict)  # node -> its outputs: cached, run, or another lane's
    ui: dict[str, dict] = field(default_factory=dict)  # node -> the ComfyUI ui it returned (those that returned one)
    cuts: Cuts | None = None  # its cancellations, when it was given a Cancel
    retried: set[str] = field(default_factory=set)  # nodes and loads the rest was planned again for (each once)
    exchange: Exchange | None = None  # a lane of a prompt placed on several devices: the lanes' outputs

    def done(self) -> list[str]:
        """The nodes done (cached or run), in the order they were, as ComfyUI lists them in errors."""
        return list(self.values)

    def dropped(self) -> set[str]:
        """The nodes a Cancel left out of the run."""
        return self.cuts.dropped if self.cuts is not None else set()


__all__ = ["Cancel", "Cuts", "Events", "NodeReport", "RunResult", "RunState"]
