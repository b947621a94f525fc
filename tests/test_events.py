"""One translation of engine events into ComfyUI messages: a recorded event sequence replayed through the
single-prompt path, the batch path and the fleet worker gives one client the same messages (server/events.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vramgraph.server import messages as msg
from vramgraph.server.fleet_worker import Delivery, FleetWorker
from vramgraph.server.messages import QueueItem
from vramgraph.server.queue import PromptQueue, Worker
from vramgraph.server.signing import Signer

A = {"1": "q0:1", "2": "q0:2", "3": "q0:3"}  # prompt a's ids in the merged graph (the loader shared)
B = {"1": "q0:1", "2": "q1:2", "3": "q1:3"}
IMAGE_A = {"images": [{"filename": "a.png", "subfolder": "", "type": "output"}]}
IMAGE_B = {"images": [{"filename": "b.png", "subfolder": "", "type": "output"}]}
PLAN = {"steps": [{"kind": "run", "node": "q0:1"}]}

# the merged graph's run as the engine reports it: b's nodes first, then a's (so a ends last in the batch too)
RECORDED: list[tuple[str, dict]] = [
    ("execution_start", {}), ("plan", {"plan": PLAN}), ("execution_cached", {"nodes": []}),
    ("executing", {"node": "q0:1"}), ("vg_step", {"kind": "load", "model": "transformer"}),
    ("executed", {"node": "q0:1", "output": None, "seconds": 0.1}),
    ("executing", {"node": "q1:2"}), ("progress", {"node": "q1:2", "value": 1, "max": 2}),
    ("executed", {"node": "q1:2", "output": None}), ("executing", {"node": "q1:3"}),
    ("executed", {"node": "q1:3", "output": IMAGE_B}),
    ("executing", {"node": "q0:2"}), ("progress", {"node": "q0:2", "value": 1, "max": 1}),
    ("vg_estimate_exceeded", {"node": "q0:2", "measured": 5, "predicted": 4}),
    ("preview", {"node": "q0:2", "image": None}),
    ("executed", {"node": "q0:2", "output": None}), ("executing", {"node": "q0:3"}),
    ("executed", {"node": "q0:3", "output": IMAGE_A}),
    ("executing", {"node": None}), ("execution_success", {}),
]


def _prompt(tag: str) -> dict:
    return {"1": {"class_type": "Loader", "inputs": {}}, "2": {"class_type": "Sampler", "inputs": {"m": ["1", 0]}},
            "3": {"class_type": "Save", "inputs": {"images": ["2", 0], "filename_prefix": tag}}}


@dataclass
class FakePlan:
    order: list[str]

    def to_json(self) -> dict:
        return PLAN

    def variant_of(self, node: str) -> str:
        return "gpu"


@dataclass
class FakePrep:
    prompt: dict
    outputs: tuple[str, ...]
    plan: FakePlan
    signatures: dict[str, str]
    cached: list[str] = field(default_factory=list)
    costs: dict = field(default_factory=dict)


@dataclass
class FakeResult:
    def to_json(self) -> dict:
        return {"plan": PLAN}


@dataclass
class FakeMerged:
    members: list[dict]


class ReplayEngine:
    """An engine whose runs replay RECORDED (a lone prompt hears only its own nodes, by its own ids)."""

    def __init__(self, output: Path) -> None:
        self.folders = type("F", (), {"output": output, "temp": output, "input": output})()
        self.budget = type("B", (), {"card": None})()
        self.ledger = type("L", (), {"events": [], "on_gpu": []})()
        self.previews = False

    def _prep(self, renames: list[dict]) -> FakePrep:
        ids = list(dict.fromkeys(n for r in renames for n in r.values()))
        prompt = {n: {"class_type": {"1": "Loader", "2": "Sampler", "3": "Save"}[n[-1]], "inputs": {}} for n in ids}
        return FakePrep(prompt, tuple(r["3"] for r in renames), FakePlan(ids), {n: f"sig-{n}" for n in ids})

    def prepare(self, prompt: dict, outputs: Any = None) -> FakePrep:
        return self._prep([{n: n for n in prompt}])

    def prepare_queue(self, prompts: list[dict], pnginfos: list, outputs: list) -> tuple[FakePrep, FakeMerged]:
        renames = [A, B][:len(prompts)]
        prep = self._prep(renames)
        prep.costs = {n: type("C", (), {"variants": []})() for n in prep.prompt}
        return prep, FakeMerged(renames)

    def run(self, prep: FakePrep, extra_pnginfo: Any = None, prompt_id: str = "", events: Any = None,
            cancel: Any = None) -> FakeResult:
        alone = "q0:1" not in prep.prompt
        back = {v: k for k, v in A.items()}
        for kind, data in RECORDED:
            node = data.get("node")
            if alone and node is not None:
                if node not in back:
                    continue  # b's node: not in a prompt run alone
                data = {**data, "node": back[node]}
            if alone and kind == "execution_cached":
                data = {"nodes": [back[n] for n in data["nodes"]]}
            events(kind, {**data, "prompt_id": prompt_id})
        return FakeResult()

    def interrupt(self) -> None:
        pass


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, Any, str | None]] = []

    def send_threadsafe(self, kind: Any, data: Any, sid: str | None = None) -> None:
        self.sent.append((kind, data, sid))


def _items() -> list[QueueItem]:
    return [QueueItem(1, "pid-a", _prompt("a"), {"client_id": "client-a", "preview_method": "auto"}, ["3"]),
            QueueItem(2, "pid-b", _prompt("b"), {"client_id": "client-b"}, ["3"])]


def _normal(sent: list[tuple[Any, Any, str | None]], sid: str) -> list[tuple[str, Any]]:
    """What client `sid` was told, less timestamps and the fields only a batch has (its other prompts, ids)."""
    out = []
    for kind, data, to in sent:
        if to == sid:
            if isinstance(data, dict):
                data = {k: v for k, v in data.items() if k not in ("timestamp", "prompt_ids", "batch", "members")}
            out.append((str(kind), json.loads(json.dumps(data, default=str))))
    return out


@pytest.fixture
def timeline(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramgraph.graph.draw import timeline

    monkeypatch.setattr(timeline, "timeline_svg", lambda plan, name, card=None, prompt=None: "<svg/>")
    monkeypatch.setattr(timeline, "timeline_data", lambda plan: {"rows": []})
    monkeypatch.setattr("vramgraph.server.events.encode_preview", lambda image: b"frame")


def _single(tmp_path: Path) -> tuple[Recorder, PromptQueue]:
    hub, queue = Recorder(), PromptQueue()
    Worker(ReplayEngine(tmp_path), queue, hub).execute(_items()[0])  # type: ignore[arg-type]
    return hub, queue


def test_single_and_batch_paths_tell_a_client_the_same(tmp_path, timeline):
    alone, alone_queue = _single(tmp_path)
    hub, queue = Recorder(), PromptQueue()
    Worker(ReplayEngine(tmp_path), queue, hub).execute_batch(_items())  # type: ignore[arg-type]
    expected = _normal(alone.sent, "client-a")
    assert [k for k, _ in expected] == [
        "execution_start", "vramgraph.plan", "execution_cached", "executing", "progress_state", "vramgraph.step",
        "progress_state", "executing", "progress_state", "progress", "progress_state", "vramgraph.estimate",
        "1", "progress_state", "executing", "progress_state", "progress_state", "executed", "execution_success",
        "executing"]
    assert _normal(hub.sent, "client-a") == expected
    assert expected[-1][1] == {"node": None, "prompt_id": "pid-a"} and expected[-3][1]["output"] == IMAGE_A
    kept = [[k, {x: y for x, y in d.items() if x != "timestamp"}] for k, d in
            alone_queue.history["pid-a"]["status"]["messages"]]
    assert kept == [[k, {x: y for x, y in d.items() if x != "timestamp"}] for k, d in
                    queue.history["pid-a"]["status"]["messages"]]
    assert [k for k, _ in kept] == ["execution_start", "execution_cached", "execution_success"]
    b = _normal(hub.sent, "client-b")  # b hears of its own nodes only, with its own ids
    assert [d["node"] for k, d in b if k == "executing"] == ["1", "2", "3", None]
    assert {d["prompt_id"] for _, d in b if "prompt_id" in d} == {"pid-b"}


def test_fleet_worker_relays_the_same_messages(tmp_path, timeline):
    alone, _ = _single(tmp_path)
    fleet = FleetWorker(ReplayEngine(tmp_path), "amqp://vg:secret@127.0.0.1/", signer=Signer(b"k" * 24), ident="w1")
    sent: list[tuple] = []
    fleet.threadsafe = lambda fn, *args: fn(*args)  # type: ignore[method-assign]  # no event loop here
    fleet._outbox = type("Outbox", (), {"put_nowait": staticmethod(sent.append)})()  # type: ignore[assignment]
    item = _items()[0]
    fleet.routes[item.prompt_id] = ("vg.frontend.f1", "w1:1", fleet.generation)
    fleet.by_sid["client-a"] = {item.prompt_id}
    fleet.deliveries[item.prompt_id] = Delivery(None, "vg.frontend.f1", "w1:1", fleet.generation, "set", False)
    fleet.worker.execute(item)
    relayed = []
    for kind, reply_to, body, *_ in sent:
        assert reply_to == "vg.frontend.f1"
        if kind == "event":
            d = json.loads(body)
            relayed.append((d["kind"], d["data"], d["sid"]))
        elif kind == "preview":
            relayed.append((1, body, "client-a"))
    assert _normal(relayed, "client-a") == _normal(alone.sent, "client-a")
    assert [k for k, *_ in sent].count("result") == 1


def test_every_execution_error_body_has_comfyuis_fields():
    """The four places that end a prompt before any node runs (refused, dead-lettered, the worker failing, a
    plan that failed) build the one body; its fields are ComfyUI's."""
    body = msg.error("p", "why", "PromptRefused")
    assert set(body) == {"prompt_id", "node_id", "node_type", "executed", "exception_message", "exception_type",
                         "traceback", "current_inputs", "current_outputs", "timestamp"}
    entry = msg.failed_entry(QueueItem(3, "p", {}, {}), body, {"x": 1})
    assert entry["prompt"] == [3, "p", {}, {}, None] and entry["status"]["messages"] == [["execution_error", body]]
    assert QueueItem.of(entry["prompt"]).prompt_id == "p" and QueueItem.of(entry["prompt"]).targets is None

