"""Several devices in one process: one Engine per device, a prompt (or a queue merged into one) placed on them by
graph/plan/placement.py and run with every device working at once.

Each engine runs its lane of the placement as an ordinary run of the prompt with the lane's plan; an input made
in another lane is taken from the `Exchange` (waiting until that lane has made it; outputs are host tensors,
so nothing else is copied), and every node's outputs and ui are put there, as output cache entries
(graph/engine/cache.py). The first engine validates and estimates the prompt, and its output cache is the one
the next prompt's cached nodes come from; all engines share the folders, the dtype and the cost model.

One device, or a device that cannot be used (gone, out of memory before anything runs), falls back to the
one-device run with a warning: never a crash for want of the second card.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ...nodes.types import ModelInfo
from ..plan import placement, planner
from ..workflow import estimate
from .cache import CacheEntry, OutputCache
from .executor import Engine
from .planning import Prepared
from .run import Events, RunResult, _quiet

log = logging.getLogger(__name__)
_LANE_EVENTS = {"execution_start", "execution_success", "execution_cached", "plan"}  # said once, for all lanes


class LaneFailed(RuntimeError):
    """Another device's lane failed, so this one cannot have its input."""


class Exchange:
    """Node outputs (with their ui) passed between the lanes of one run."""

    def __init__(self, values: Mapping[str, CacheEntry] | None = None) -> None:
        self._values: dict[str, CacheEntry] = dict(values or {})
        self._cond = threading.Condition()
        self._failed: BaseException | None = None

    def put(self, node: str, entry: CacheEntry) -> None:
        with self._cond:
            self._values[node] = entry
            self._cond.notify_all()

    def get(self, node: str) -> CacheEntry:
        with self._cond:
            while node not in self._values:
                if self._failed is not None:
                    raise LaneFailed(f"node {node} was to come from another device, whose lane failed: "
                                     f"{self._failed}")
                self._cond.wait(0.5)
            return self._values[node]

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = error
            self._cond.notify_all()


@dataclasses.dataclass
class PlacedRun:
    prompt_id: str
    placement: placement.Placement
    lanes: dict[str, RunResult]
    seconds: float = 0.0

    @property
    def images(self) -> list:
        return [p for r in self.lanes.values() for p in r.images]

    @property
    def ui(self) -> dict:
        return {k: v for r in self.lanes.values() for k, v in r.ui.items()}

    @property
    def loads(self) -> int:
        return sum(r.loads for r in self.lanes.values())

    @property
    def unloads(self) -> int:
        return sum(r.unloads for r in self.lanes.values())

    @property
    def nodes(self) -> list:
        return [n for r in self.lanes.values() for n in r.nodes]

    @property
    def cached(self) -> tuple[str, ...]:
        return self._cached

    _cached: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"prompt_id": self.prompt_id, "seconds": round(self.seconds, 4), "loads": self.loads,
                "unloads": self.unloads, "images": [str(p) for p in self.images],
                "placement": self.placement.to_json(),
                "lanes": {d: {"seconds": round(r.seconds, 4), "loads": r.loads, "unloads": r.unloads,
                              "nodes": [vars(n) for n in r.nodes]} for d, r in self.lanes.items()}}


class Devices:
    """Engines by device name, in the order given (the first validates and estimates). Offers what the Python
    API and the command line use of an Engine: prepare, prepare_queue, run, free, interrupt, warm_up."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        if not engines:
            raise ValueError("no engine to run on")
        self.engines = dict(engines)

    @property
    def first(self) -> Engine:
        return next(iter(self.engines.values()))

    @property
    def nodes(self) -> Mapping[str, type]:
        return self.first.nodes

    @property
    def folders(self) -> Any:
        return self.first.folders

    @property
    def cache(self) -> OutputCache:  # the first engine's, which the next prompt's cached nodes come from
        return self.first.cache

    @property
    def device(self) -> Any:  # the first device's (what a one-device caller shows)
        return self.first.device

    @property
    def budget(self) -> planner.Budget:
        return self.first.budget

    @property
    def dtype(self) -> str:
        return self.first.dtype

    @property
    def cost(self) -> planner.CostModel:
        return self.first.cost

    @property
    def previews(self) -> bool:
        return self.first.previews

    @previews.setter
    def previews(self, on: bool) -> None:
        for e in self.engines.values():
            e.previews = on

    def prepare(self, prompt: dict, *, repeat: bool = True) -> Prepared:
        return self.first.prepare(prompt, repeat=repeat)

    def prepare_queue(self, prompts: list[dict], extra_pnginfo: list[dict | None] | None = None) -> tuple:
        return self.first.prepare_queue(prompts, extra_pnginfo)

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        for e in self.engines.values():
            e.free(unload_models, free_memory)

    def warm_up(self) -> None:
        for e in self.engines.values():
            e.warm_up()

    def interrupt(self) -> None:
        for e in self.engines.values():
            e.interrupt()

    def place(self, prompt: dict | Prepared, *, repeat: bool = True) -> tuple[Prepared, placement.Placement]:
        """Validate and estimate `prompt` once, then place what is not cached on the devices."""
        prep = prompt if isinstance(prompt, Prepared) else self.first.prepare(prompt, repeat=repeat)
        node_costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
        for e in self.engines.values():
            for key, m in e.ledger.model_costs().items():
                models.setdefault(key, m)
        todo = prep.dag.subgraph(n for n in prep.dag.nodes if n not in prep.cached).copy()
        devices = [placement.Device(name, e.budget) for name, e in self.engines.items()]
        starts = {name: e.ledger.residency() for name, e in self.engines.items()}
        placed = placement.place(todo, {n: node_costs[n] for n in todo.nodes}, models, devices, self.first.cost,
                                 starts, repeat=repeat, outputs=prep.outputs, context=self.first.planning)
        return prep, placed

    def run(self, prompt: dict | Prepared, *, extra_pnginfo: dict | None = None, prompt_id: str | None = None,
            events: Events = _quiet, repeat: bool = True, cancel: Any = None) -> PlacedRun:
        import uuid

        prep, placed = self.place(prompt, repeat=repeat)
        pid = prompt_id or uuid.uuid4().hex
        exchange = Exchange({n: self.first.cache[prep.signatures[n]] for n in prep.cached})  # the first's cache
        infos = [o for c in prep.costs.values() for o in c.outputs if isinstance(o, ModelInfo)]
        lanes: dict[str, RunResult] = {}
        errors: dict[str, BaseException] = {}
        lock = threading.Lock()

        def lane_events(name: str, data: dict) -> None:
            if name in _LANE_EVENTS or (name == "executing" and data.get("node") is None):
                return
            with lock:
                events(name, data)

        def work(lane: placement.Lane) -> None:
            engine = self.engines[lane.device]
            try:
                for info in infos:
                    engine.ledger.register(info)
                mine = dataclasses.replace(prep, cached=(), plan=lane.plan)
                lanes[lane.device] = engine.run(mine, extra_pnginfo=extra_pnginfo, prompt_id=pid,
                                                events=lane_events, cancel=cancel, exchange=exchange)
            except BaseException as e:  # the others must not wait for what this lane will never make
                errors[lane.device] = e
                exchange.fail(e)
                for other in self.engines.values():
                    if other is not engine:
                        other.interrupt()

        events("execution_start", {"prompt_id": pid})
        events("plan", {"prompt_id": pid, "plan": placed.lanes[0].plan.to_json() if len(placed.lanes) == 1 else
                        {**placed.lanes[0].plan.to_json(), "placement": placed.to_json()}})
        events("execution_cached", {"prompt_id": pid, "nodes": list(prep.cached)})
        t0 = time.perf_counter()
        threads = [threading.Thread(target=work, args=(lane,), name=f"vramgraph-{lane.device}", daemon=True)
                   for lane in placed.lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:  # the first lane to fail says why; the others only stopped because of it
            first = next((e for e in errors.values() if not isinstance(e, LaneFailed)), next(iter(errors.values())))
            raise first
        events("executing", {"node": None, "prompt_id": pid})
        events("execution_success", {"prompt_id": pid})
        done = PlacedRun(pid, placed, lanes, time.perf_counter() - t0)
        done._cached = tuple(prep.cached)
        return done


def devices_from(names: list[str], make: Callable[[str, str | None], Engine], sizes: list[str | None],
                 warn: Callable[[str], Any] = log.warning) -> Devices | Engine:
    """Engines for `names` (made by `make(name, vram)`); a device that cannot be opened is left out with a
    warning, and with one device left this is that device's plain Engine."""
    engines: dict[str, Engine] = {}
    why: list[str] = []
    for name, vram in zip(names, sizes, strict=True):
        try:
            engines[name] = make(name, vram)
        except Exception as e:  # gone, or out of memory before anything runs: carry on without it
            why.append(f"{name}: {e}")
            if len(names) > 1:
                warn(f"device {name} cannot be used ({e}); running without it")
    if not engines:
        raise ValueError(f"none of the devices {', '.join(names)} can be used ({'; '.join(why)})")
    if len(engines) == 1:
        if len(names) > 1:
            warn(f"only {next(iter(engines))} is usable: running the one-device plan")
        return next(iter(engines.values()))
    return Devices(engines)


__all__ = ["Devices", "Exchange", "LaneFailed", "PlacedRun", "devices_from"]
