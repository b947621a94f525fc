"""Two devices in one process (graph/engine/devices.py), on the CPU: two engines with their own budgets stand for two
cards. The placement splits the models when a card cannot hold the text encoder beside the transformer, or the
queue when each card holds a full set; the pictures are bit for bit the one-engine ones, the lanes run at once,
and a failing lane stops the other with the failing node's error.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from test_engine import _needs, folders_for, pixels, shipped
from vramgraph.graph.engine.budget import Budget
from vramgraph.graph.engine.devices import Devices, devices_from
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import placement, planner
from vramgraph.graph.workflow.errors import NodeExecutionError
from vramgraph.nodes import ops

GiB = 2**30


def prompts(n: int, subject: str = "a lighthouse") -> list[dict]:
    out = []
    for i in range(n):
        p = shipped("text_to_image")
        p["4"]["inputs"]["text"] = f"{subject}, picture {i}"
        p["6"]["inputs"]["seed"] = 100 + i
        p["8"]["inputs"]["filename_prefix"] = f"img{i}"
        out.append(p)
    return out


def sizes(engine: Engine, prompt: dict) -> dict[str, int]:
    prep = engine.prepare(prompt)
    return {m.label: m.nbytes for m in prep.plan.models.values()}


@pytest.fixture
def reference(tiny_models: Path, input_dir: Path, tmp_path: Path) -> tuple[Engine, list[np.ndarray]]:
    one = Engine(folders_for(tiny_models, input_dir, tmp_path / "one"), device="cpu",
                 budget=Budget(gpu=64 * GiB, host=64 * GiB))
    _result, images = one.run_queue(prompts(2))
    return one, [pixels(paths[0]) for paths in images]


def two(tiny_models: Path, input_dir: Path, out: Path, gpu: int) -> Devices:
    return Devices({f"cpu#{i}": Engine(folders_for(tiny_models, input_dir, out), device="cpu",
                                       budget=Budget(gpu=gpu, host=64 * GiB)) for i in range(2)})


def test_split_models_same_pictures_no_model_moves(reference, tiny_models: Path, input_dir: Path,
                                                    tmp_path: Path) -> None:
    one, want = reference
    s = sizes(one, prompts(1)[0])
    # each "card" holds the largest node alone (the text encoder's), never the text encoder beside the transformer
    gpu = _needs(one, prompts(1)[0])[0]
    assert gpu < s["transformer"] + s["text encoder"]
    devs = two(tiny_models, input_dir, tmp_path / "two", gpu)
    prep, _merged = devs.first.prepare_queue(prompts(2))
    _, placed = devs.place(prep)
    assert placed.kind == "split models" and len(placed.lanes) == 2
    labels = {k: m.label for lane in placed.lanes for k, m in lane.plan.models.items()}
    where = {labels[k]: v for k, v in placed.model_devices().items()}
    assert where["text encoder"] != where["transformer"]
    events: list[tuple[str, dict]] = []
    got = devs.run(prep, events=lambda name, data: events.append((name, data)))
    assert got.loads == 3 and got.unloads == 0
    by_prefix = {p.name.split("_")[0]: pixels(p) for p in got.images}
    assert np.array_equal(by_prefix["img0"], want[0]) and np.array_equal(by_prefix["img1"], want[1])
    names = [n for n, _ in events]
    assert names.count("execution_start") == 1 and names.count("execution_success") == 1
    assert names[-1] == "execution_success" and names.count("plan") == 1
    plan_event = next(d for n, d in events if n == "plan")
    assert [lane["device"] for lane in plan_event["plan"]["placement"]["lanes"]] == ["cpu#0", "cpu#1"]
    # the next queue (new prompts: nothing cached) finds every model where it was: no model move after the first load
    prep2, _ = devs.first.prepare_queue(prompts(2, "a harbour"))
    again = devs.run(prep2)
    assert again.loads == 0 and again.unloads == 0


def test_split_queue_when_each_card_holds_everything(reference, tiny_models: Path, input_dir: Path,
                                                     tmp_path: Path) -> None:
    """Roomy cards: the queue is dealt out, each lane runs whole prompts, and both lanes work at once."""
    _one, want = reference
    devs = two(tiny_models, input_dir, tmp_path / "two", 64 * GiB)
    prep, _ = devs.first.prepare_queue(prompts(2))
    _, placed = devs.place(prep)
    busy = threading.Barrier(2, timeout=30)
    real = ops.run_sampler

    def sampler(*a, **kw):  # both samplings must be under way at the same time to pass the barrier
        busy.wait()
        return real(*a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(ops, "run_sampler", sampler)
    try:
        if placed.kind != "split queue":
            pytest.fail(f"expected the queue to be split, got {placed.kind}:\n{placed.table()}")
        got = devs.run(prep)
    finally:
        mp.undo()
    by_prefix = {p.name.split("_")[0]: pixels(p) for p in got.images}
    assert np.array_equal(by_prefix["img0"], want[0]) and np.array_equal(by_prefix["img1"], want[1])
    assert got.loads == 6  # each lane loads its own set


def test_a_failing_lane_stops_the_other_with_its_error(tiny_models: Path, input_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    probe = Engine(folders_for(tiny_models, input_dir, tmp_path / "p"), device="cpu")
    devs = two(tiny_models, input_dir, tmp_path / "two", _needs(probe, prompts(1)[0])[0])

    def broken(*a, **kw):
        raise RuntimeError("the sampler broke")

    monkeypatch.setattr(ops, "run_sampler", broken)
    prep, _ = devs.first.prepare_queue(prompts(2))
    with pytest.raises(NodeExecutionError) as e:
        devs.run(prep)
    assert "the sampler broke" in str(e.value)
    assert not list((tmp_path / "two" / "output").glob("*.png"))


def test_one_usable_device_falls_back_with_a_message(tiny_models: Path, input_dir: Path, tmp_path: Path) -> None:
    said: list[str] = []

    def make(name: str, vram: str | None) -> Engine:
        if name == "cuda:1":
            raise RuntimeError("CUDA error: no CUDA-capable device is detected")
        return Engine(folders_for(tiny_models, input_dir, tmp_path), device="cpu")

    got = devices_from(["cuda:0", "cuda:1"], make, [None, None], said.append)
    assert isinstance(got, Engine)
    assert said == ["device cuda:1 cannot be used (CUDA error: no CUDA-capable device is detected); running "
                    "without it", "only cuda:0 is usable: running the one-device plan"]
    with pytest.raises(ValueError, match=r"none of the devices cuda:1 can be used \(cuda:1: CUDA error"):
        devices_from(["cuda:1"], make, [None], said.append)


def test_plan_devices_on_a_laptop_has_one_lane_per_device(tmp_path: Path) -> None:
    """`vramgraph plan --devices` with a size per card needs no GPU: the placement, a table per device, the JSON
    with one lane per device and a timeline with one picture per device."""
    import json
    import subprocess
    import sys

    svg = tmp_path / "two.svg"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "vramgraph", "plan", str(root / "workflows" / "text_to_image.json"),
                          "--devices", "cuda:0,cuda:1", "--vram", "12GiB,12GiB", "--json", "--svg", str(svg)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    js = json.loads(out.stdout)
    assert js["kind"] == "split models" and [lane["device"] for lane in js["lanes"]] == ["cuda:0", "cuda:1"]
    labels = {lane["device"]: {m["label"] for m in lane["plan"]["models"].values()} for lane in js["lanes"]}
    assert labels == {"cuda:0": {"text encoder"}, "cuda:1": {"transformer", "vae"}}
    assert js["loads"] == 3 and all(s["kind"] != "unload" for lane in js["lanes"] for s in lane["plan"]["steps"])
    text = svg.read_text()
    assert text.count("on cuda:0") == 1 and text.count("on cuda:1") == 1
    bad = subprocess.run([sys.executable, "-m", "vramgraph", "plan", str(root / "workflows" / "text_to_image.json"),
                          "--devices", "cuda:0,cuda:1", "--vram", "12GiB,8GiB,4GiB"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert bad.returncode != 0 and "3 sizes for 2 devices" in bad.stderr


def test_the_planner_budget_of_each_lane_is_its_own(tiny_models: Path, input_dir: Path, tmp_path: Path) -> None:
    probe = Engine(folders_for(tiny_models, input_dir, tmp_path / "p"), device="cpu")
    s = sizes(probe, prompts(1)[0])
    small = Budget(gpu=s["text encoder"] + 8 * 2**20, host=64 * GiB)
    devs = Devices({"cpu#0": Engine(folders_for(tiny_models, input_dir, tmp_path), device="cpu", budget=small),
                    "cpu#1": Engine(folders_for(tiny_models, input_dir, tmp_path), device="cpu",
                                    budget=Budget(gpu=64 * GiB, host=64 * GiB))})
    _prep, placed = devs.place(prompts(1)[0])
    for lane in placed.lanes:
        assert lane.plan.peak <= devs.engines[lane.device].budget.gpu
    assert isinstance(placed, placement.Placement) and all(
        isinstance(st.step, planner.Load | planner.Unload | planner.Run) for lane in placed.lanes
        for st in lane.plan.steps)
