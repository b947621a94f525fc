"""One output cache and a RunState per run (issue 36, item 2; graph/engine/cache.py, graph/engine/run.py).

The cache's bound as its module doc states it; the ui a client is told again for a cached output node read from
the engine's one cache by the single-prompt path, the batch path and the fleet worker; two runs, each with its own
RunState, the engine keeping only what outlives a run. On the CPU, with test nodes that load no model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vramgraph.graph.engine.cache import CacheEntry, OutputCache, array_bytes
from vramgraph.graph.engine.executor import Cancel, Engine
from vramgraph.graph.engine.run import RunState
from vramgraph.nodes.files import Folders
from vramgraph.nodes.types import INT, STRING, Cost, ModelInfo
from vramgraph.nodes.values import ModelHandle
from vramgraph.server.messages import QueueItem
from vramgraph.server.queue import PromptQueue, Worker


def entry(nbytes: int = 0, ui: dict | None = None) -> CacheEntry:
    return CacheEntry((np.zeros(nbytes, np.uint8),) if nbytes else ("handle",), ui)


# ------------------------------------------------------------------------------------------ the bound


def test_keep_holds_the_last_runs_entries_only() -> None:
    cache = OutputCache()
    cache.keep({"a": entry(), "b": entry(ui={"text": ["b"]})})
    assert cache.keep({"b": cache["b"], "c": entry()}) == []
    assert list(cache) == ["b", "c"] and cache["b"].ui == {"text": ["b"]} and cache.get("a") is None


def test_over_the_count_the_biggest_go_first_then_the_last_given() -> None:
    cache = OutputCache(max_entries=3)
    dropped = cache.keep({"loader": entry(), "encode": entry(100), "latent": entry(10), "image": entry(100),
                          "save": entry(ui={"images": []})})
    assert dropped == ["image", "encode"]  # most bytes first; between equals, the one given last
    assert list(cache) == ["loader", "latent", "save"] and len(cache) == 3 and cache.nbytes == 10


def test_over_the_bytes_the_biggest_go_first_and_handles_stay() -> None:
    cache = OutputCache(max_bytes=150)
    assert cache.keep({"loader": entry(), "encode": entry(100), "latent": entry(10), "image": entry(120)}) \
        == ["image"]
    assert cache.nbytes == 110
    cache = OutputCache(max_bytes=0)
    assert cache.keep({"loader": entry(), "encode": entry(100), "latent": entry(10)}) == ["encode", "latent"]
    assert list(cache) == ["loader"]


def test_an_array_shared_by_entries_counts_once_and_a_model_handle_none() -> None:
    shared = np.zeros(64, np.uint8)
    assert array_bytes([shared, {"x": shared}, (shared,)]) == 64
    assert array_bytes((torch.zeros(2, 3), ModelHandle(ModelInfo("t", "transformer", "transformer", 2**30)))) == 24
    cache = OutputCache(max_bytes=64)
    assert cache.keep({"a": CacheEntry((shared,)), "b": CacheEntry(([shared, {"again": shared}],))}) == []
    assert cache.nbytes == 64


def test_clear_empties_and_close_keeps_nothing_more() -> None:
    cache = OutputCache()
    cache.keep({"a": entry()})
    cache.clear()
    assert len(cache) == 0
    cache.keep({"a": entry()})
    cache.close()
    assert cache.keep({"b": entry()}) == ["b"] and len(cache) == 0


# ------------------------------------------------------------------------------------------ test nodes


class Text:
    """An output node that shows its text (its ui) and passes nothing on (test only)."""

    CATEGORY = "test"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"text": (STRING, {"default": ""})}}

    @classmethod
    def vg_estimate(cls, env: Any, text: str) -> Cost:
        return Cost(())

    def run(self, text: str) -> dict:
        return {"ui": {"text": [text]}}


def spying(runs: list[RunState]) -> tuple[type, type]:
    """A number node and an output node that record the run their context belongs to in `runs`."""

    class Number:
        CATEGORY = "test"
        RETURN_TYPES = (INT,)
        FUNCTION = "run"

        @classmethod
        def INPUT_TYPES(cls, folders: Any = None) -> dict:
            return {"required": {"n": (INT, {"default": 1})}, "hidden": {"vg": "VG_CONTEXT"}}

        @classmethod
        def vg_estimate(cls, env: Any, n: int) -> Cost:
            return Cost((n,))

        def run(self, n: int, vg: Any = None) -> tuple:
            runs.append(vg.run)
            return (n,)

    class Show(Number):
        RETURN_TYPES = ()
        OUTPUT_NODE = True

        @classmethod
        def INPUT_TYPES(cls, folders: Any = None) -> dict:
            return {"required": {"n": (INT, {"default": 1})}, "hidden": {"vg": "VG_CONTEXT"}}

        def run(self, n: int, vg: Any = None) -> dict:  # type: ignore[override]
            runs.append(vg.run)
            vg.check_interrupted()
            return {"ui": {"text": [str(n)]}}

    return Number, Show


@pytest.fixture
def folders(tmp_path: Path) -> Folders:
    f = Folders(models=(tmp_path / "models",), input=tmp_path / "input", output=tmp_path / "output",
                temp=tmp_path / "temp")
    for d in (*f.models, f.input, f.output, f.temp):
        d.mkdir(parents=True)
    return f


# ------------------------------------------------------------------------------------------ the ui re-sent


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, Any, str | None]] = []

    def send_threadsafe(self, kind: Any, data: Any, sid: str | None = None) -> None:
        self.sent.append((kind, data, sid))

    def executed(self, sid: str) -> list[tuple[str, dict]]:
        return [(d["node"], d["output"]) for k, d, to in self.sent if k == "executed" and to == sid]


def _item(pid: str, text: str) -> QueueItem:
    return QueueItem(1, pid, {"1": {"class_type": "Text", "inputs": {"text": text}}}, {"client_id": f"c-{pid}"})


def _marked(engine: Engine) -> None:
    """Every entry's ui replaced by one that only the cache holds."""
    engine.cache.keep({s: CacheEntry(e.outputs, {"text": [f"{e.ui['text'][0]}, from the cache"]})  # type: ignore
                       for s in list(engine.cache) if (e := engine.cache[s]).ui is not None})


def test_a_cached_nodes_ui_comes_from_the_one_cache(folders: Folders) -> None:
    """The single-prompt and the batch path tell a cached output node's ui from its entry in engine.cache."""
    engine = Engine(folders, device="cpu", nodes={"Text": Text})
    hub = Recorder()
    worker = Worker(engine, PromptQueue(), hub)
    worker.execute_batch([_item("a1", "a"), _item("b1", "b")])
    assert hub.executed("c-a1") == [("1", {"text": ["a"]})] and hub.executed("c-b1") == [("1", {"text": ["b"]})]
    assert sorted(e.ui["text"][0] for e in engine.cache.entries() if e.ui) == ["a", "b"]  # type: ignore[index]
    _marked(engine)
    worker.execute_batch([_item("a2", "a"), _item("b2", "b")])  # both cached: told the entries' ui
    assert hub.executed("c-a2") == [("1", {"text": ["a, from the cache"]})]
    assert hub.executed("c-b2") == [("1", {"text": ["b, from the cache"]})]
    worker.execute(_item("a3", "a"))  # alone
    assert hub.executed("c-a3") == [("1", {"text": ["a, from the cache"]})]
    assert [e.ui for e in engine.cache.entries()] == [{"text": ["a, from the cache"]}]  # kept as it was
    assert not hasattr(worker, "ui_cache")
    engine.free()
    worker.execute(_item("a4", "a"))  # nothing cached: run again
    assert hub.executed("c-a4") == [("1", {"text": ["a"]})]


def test_the_fleet_worker_tells_the_ui_of_the_one_cache(folders: Folders) -> None:
    from vramgraph.server.fleet_worker import Delivery, FleetWorker
    from vramgraph.server.signing import Signer

    engine = Engine(folders, device="cpu", nodes={"Text": Text})
    fleet = FleetWorker(engine, "amqp://vg:secret@127.0.0.1/", signer=Signer(b"k" * 24), ident="w1")
    sent: list[tuple] = []
    fleet.threadsafe = lambda fn, *args: fn(*args)  # type: ignore[method-assign]  # no event loop here
    fleet._outbox = type("Outbox", (), {"put_nowait": staticmethod(sent.append)})()  # type: ignore[assignment]
    told = []
    for pid in ("f1", "f2"):
        item = _item(pid, "f")
        fleet.routes[pid] = ("vg.frontend.f1", f"w1:{pid}", fleet.generation)
        fleet.by_sid[f"c-{pid}"] = {pid}
        fleet.deliveries[pid] = Delivery(None, "vg.frontend.f1", f"w1:{pid}", fleet.generation, "set", False)
        fleet.worker.execute(item)
        events = [json.loads(body) for kind, _, body, *_ in sent if kind == "event"]
        told.append([e["data"]["output"] for e in events if e["kind"] == "executed" and e["sid"] == f"c-{pid}"])
        if pid == "f1":
            _marked(engine)
    assert told == [[{"text": ["f"]}], [{"text": ["f, from the cache"]}]]


# ------------------------------------------------------------------------------------------ RunState


def test_two_runs_have_each_their_own_run_state(folders: Folders) -> None:
    runs: list[RunState] = []
    number, show = spying(runs)
    engine = Engine(folders, device="cpu", nodes={"Number": number, "Show": show})
    prompt = {"1": {"class_type": "Number", "inputs": {"n": 3}}, "2": {"class_type": "Show", "inputs": {"n": ["1", 0]}}}
    engine.run(prompt, prompt_id="first", cancel=Cancel())
    first = runs[0]
    assert runs == [first, first] and first.prompt_id == "first" and first.cuts is not None
    assert first.values == {"1": (3,), "2": ()} and first.ui == {"2": {"text": ["3"]}}
    prompt["1"]["inputs"]["n"] = 4
    engine.run(prompt, prompt_id="second")
    second = runs[2]
    assert runs[2:] == [second, second] and second is not first
    assert second.prompt_id == "second" and second.cuts is None and second.values == {"1": (4,), "2": ()}
    assert first.prompt_id == "first" and first.values == {"1": (3,), "2": ()}  # the first run's, untouched
    # the engine keeps only what outlives a run
    assert sorted(vars(engine)) == ["_interrupt", "_lock", "_peaks", "budget", "cache", "catalog", "cost", "device",
                                    "dtype", "folders", "ledger", "nodes", "planning", "previews", "probe"]


def test_the_engine_cache_keeps_within_its_bound(folders: Folders) -> None:
    """A run's entries past the cache's count: the last in the prompt's order go (none holds an array), and only
    that node runs again."""
    runs: list[RunState] = []
    number, show = spying(runs)
    engine = Engine(folders, device="cpu", nodes={"Number": number, "Show": show})
    engine.cache = OutputCache(max_entries=1)
    prompt = {"1": {"class_type": "Number", "inputs": {"n": 3}}, "2": {"class_type": "Show", "inputs": {"n": ["1", 0]}}}
    assert engine.run(prompt).cached == ()
    assert len(engine.cache) == 1 and engine.cache.entries() == [CacheEntry((3,))]
    again = engine.run(prompt)
    assert again.cached == ("1",) and [n.node for n in again.nodes] == ["2"] and again.ui == {"2": {"text": ["3"]}}
