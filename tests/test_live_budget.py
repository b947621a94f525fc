"""A live budget: the engine plans within what the device has free now, and recovers when another process takes
memory in the middle of a run. On the CPU with tiny models and a fake device (an injected probe) whose free memory
the test changes between prompts and inside nodes, and fake out-of-memory errors raised inside nodes.

The shipped text-to-image workflow at 1536x64 (two decode tiles), as in tests/test_variants.py; the given budget is
1 GiB with a 16 MiB reserve on a 2 GiB fake device, so "free - 16 MiB" is what the engine may plan with:

    free        live budget   decode
    2 GiB       1 GiB         gpu    (capped at the budget given: never above it)
    126 MiB     110 MiB       tiled
    76 MiB      60 MiB        cpu
    46 MiB      30 MiB        -      (the sampler, 39 MiB, fits nowhere: the error says what other processes hold)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from vramgraph.graph.engine.budget import Budget, DeviceMemory, live
from vramgraph.graph.engine.executor import Engine, _tried
from vramgraph.graph.plan import planner
from vramgraph.graph.workflow.errors import NodeExecutionError
from vramgraph.nodes import ENGINE_NODES
from vramgraph.nodes.files import Folders
from vramgraph.nodes.vg import VGSampler, VGTextEncode, VGVAEDecode

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
MiB, GiB = 2**20, 2**30
BUDGET = Budget(gpu=GiB, host=64 * GiB, reserve=16 * MiB)


class Device:
    """A fake device: `free` bytes free of 2 GiB; the probe's reading of it, counted."""

    def __init__(self, free: int = 2 * GiB) -> None:
        self.free, self.reads = free, 0

    def __call__(self) -> DeviceMemory:
        self.reads += 1
        return DeviceMemory(self.free, 2 * GiB, 0)


def prompt(seed: int = 42) -> dict:
    p = json.loads((WORKFLOWS / "text_to_image.json").read_text())
    p["5"]["inputs"].update(width=1536, height=64)
    p["6"]["inputs"].update(steps=2, seed=seed)
    return p


def engine(tiny_models: Path, input_dir: Path, out: Path, device: Device, nodes: dict | None = None) -> Engine:
    folders = Folders(models=(tiny_models,), input=input_dir, output=out / "output", temp=out / "temp")
    return Engine(folders, device="cpu", budget=BUDGET, probe=device, nodes={**ENGINE_NODES, **(nodes or {})})


def steps(plan: planner.Plan) -> list[tuple[str, str, str]]:
    return [plan.describe(s) for s in plan.steps]


def pngs(out: Path) -> list[Path]:
    return sorted((out / "output").rglob("*.png"))


def test_the_live_budget_is_what_is_free_minus_the_reserve_never_above_the_budget_given() -> None:
    assert live(BUDGET, DeviceMemory(2 * GiB, 4 * GiB, 0)) == BUDGET
    assert live(BUDGET, DeviceMemory(126 * MiB, GiB, 0)).gpu == 110 * MiB
    # what this process's allocator holds (weights, cached blocks) is its own to plan with
    assert live(BUDGET, DeviceMemory(100 * MiB, GiB, 26 * MiB)).gpu == 110 * MiB
    assert DeviceMemory(100 * MiB, GiB, 26 * MiB, 300 * MiB).others == GiB - 426 * MiB
    assert _tried("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has") == int(2.5 * GiB)
    assert _tried("CUDA out of memory. Tried to allocate 20.00 MiB.") == 20 * MiB and _tried("no size") == 0


def test_each_prompt_is_planned_within_what_the_device_has_free_then(tiny_models: Path, input_dir: Path,
                                                                     tmp_path: Path) -> None:
    device = Device()
    e = engine(tiny_models, input_dir, tmp_path, device)
    first = e.run(prompt(1))
    assert first.plan.budget.gpu == GiB and first.plan.variant_of("7") == "gpu"
    for free, decode, seed in ((126 * MiB, "tiled", 2), (76 * MiB, "cpu", 3)):
        device.free = free
        result = e.run(prompt(seed))
        assert result.plan.budget.gpu == free - 16 * MiB and result.plan.variant_of("7") == decode
        assert result.plan.peak <= free - 16 * MiB and not result.replans and len(result.images) == 1
    device.free = 46 * MiB
    with pytest.raises(planner.PlanError) as err:
        e.prepare(prompt(4))
    msg = err.value.message
    assert msg.startswith("other processes hold 1.96 GiB of the device's 2.00 GiB, which leaves this engine 0.03 GiB "
                          "of its 1.00 GiB budget; node '6' (VGSampler) needs "), msg
    assert "it would fit with a budget of at least" in msg  # what would fit, from the planner
    assert err.value.to_dict()["extra_info"]["others_bytes"] == 2 * GiB - 46 * MiB
    device.free = 2 * GiB  # memory returned: the next prompt plans with the whole budget again
    assert e.run(prompt(4)).plan.variant_of("7") == "gpu"
    assert len(pngs(tmp_path)) == 4


def test_a_prompt_too_big_for_the_budget_given_is_not_blamed_on_other_processes(tiny_models: Path, input_dir: Path,
                                                                                 tmp_path: Path) -> None:
    folders = Folders(models=(tiny_models,), input=input_dir, output=tmp_path / "output", temp=tmp_path / "temp")
    e = Engine(folders, device="cpu", budget=Budget(gpu=30 * MiB, host=64 * GiB, reserve=16 * MiB),
               probe=Device(40 * MiB))
    with pytest.raises(planner.PlanError) as err:
        e.prepare(prompt())
    assert err.value.message.startswith("node '6' (VGSampler) needs ") and "other processes" not in err.value.message


def _oom_in(cls: type, device: Device, free: int | None, when: str = "gpu", times: int = 1,
            message: str = "CUDA out of memory. Tried to allocate 2.00 MiB.") -> tuple[type, list[str]]:
    """`cls` whose run, in variant `when`, sets the device's free memory to `free` and raises an out-of-memory error
    (the first `times` calls); the variants it was called with are listed."""
    calls: list[str] = []

    def run(self: object, *args: object, **kw: object) -> object:
        variant = kw["vg"].variant  # type: ignore[attr-defined]
        calls.append(variant)
        if variant == when and len(calls) <= times:
            if free is not None:
                device.free = free
            raise torch.OutOfMemoryError(message)
        return getattr(super(sub, self), cls.FUNCTION)(*args, **kw)

    sub = type(cls.__name__, (cls,), {cls.FUNCTION: run})
    return sub, calls


def test_memory_taken_during_a_decode_replans_the_rest_and_retries_it_tiled(tiny_models: Path, input_dir: Path,
                                                                            tmp_path: Path) -> None:
    device = Device()
    decode, calls = _oom_in(VGVAEDecode, device, 126 * MiB)
    e = engine(tiny_models, input_dir, tmp_path, device, {"VGVAEDecode": decode})
    events: list[tuple[str, dict]] = []
    result = e.run(prompt(), events=lambda k, d: events.append((k, d)))
    assert result.plan.variant_of("7") == "gpu" and calls == ["gpu", "tiled"]
    assert len(result.replans) == 1
    replan = result.replans[0]
    assert replan.budget.gpu == 110 * MiB and replan.peak <= 110 * MiB
    assert steps(replan) == [("Unload", "text encoder", "to pinned"), ("Unload", "transformer", "to pinned"),
                             ("Run", "7 (VGVAEDecode)", "tiled"), ("Run", "8 (VGSaveImage)", "host")]
    told = [d for k, d in events if k == "vg_replan"]
    assert [(d["node"], d["reason"], d["budget_bytes"], d["others_bytes"]) for d in told] == [
        ("7", "out_of_memory", 110 * MiB, 2 * GiB - 126 * MiB)]
    assert [(n.node, n.variant) for n in result.nodes if n.node in ("6", "7")] == [("6", "gpu"), ("7", "tiled")]
    assert len(result.images) == 1 and pngs(tmp_path) == result.images
    assert not [k for k, _ in events if k == "execution_error"]


def test_memory_taken_before_a_load_replans_before_loading(tiny_models: Path, input_dir: Path, tmp_path: Path) -> None:
    """The text encode ends with less free than the plan needs: the transformer's load finds it out and the rest of
    the run is planned again from where the weights are, before anything fails."""
    device = Device()

    class Encode(VGTextEncode):
        def encode(self, *args: object, **kw: object) -> object:
            out = super().encode(*args, **kw)
            device.free = 126 * MiB
            return out

    e = engine(tiny_models, input_dir, tmp_path, device, {"VGTextEncode": Encode})
    events: list[tuple[str, dict]] = []
    result = e.run(prompt(), events=lambda k, d: events.append((k, d)))
    assert [(d["node"], d["reason"], d["budget_bytes"]) for k, d in events if k == "vg_replan"] == [
        ("6", "load", 110 * MiB)]
    assert steps(result.replans[0]) == [
        ("Load", "transformer", "from file +pin"), ("Run", "6 (VGSampler)", "gpu"),
        ("Unload", "text encoder", "to pinned"), ("Unload", "transformer", "to pinned"),
        ("Load", "vae", "from file +pin"), ("Run", "7 (VGVAEDecode)", "tiled"), ("Run", "8 (VGSaveImage)", "host")]
    assert [n.variant for n in result.nodes if n.node == "7"] == ["tiled"] and len(result.images) == 1


def test_when_no_plan_fits_the_error_says_what_other_processes_hold_and_nothing_is_written(
        tiny_models: Path, input_dir: Path, tmp_path: Path) -> None:
    device = Device()
    sampler, calls = _oom_in(VGSampler, device, 46 * MiB)
    e = engine(tiny_models, input_dir, tmp_path, device, {"VGSampler": sampler})
    predicted = e.prepare(prompt()).plan.steps
    planned = next(s.gpu_bytes - sum(e.prepare(prompt()).plan.models[m].nbytes for m in s.resident)
                   for s in predicted if isinstance(s.step, planner.Run) and s.step.node == "6")
    with pytest.raises(NodeExecutionError) as err:
        e.run(prompt())
    assert calls == ["gpu"]  # not retried: nothing fits
    msg = err.value.exception_message
    head = ("CUDA out of memory. Tried to allocate 2.00 MiB.; other processes took GPU memory while it ran (it used "
            f"0.00 GiB of the {planned / GiB:.2f} GiB planned for it): other processes hold 1.96 GiB of the device's "
            "2.00 GiB, which leaves this engine 0.03 GiB of its 1.00 GiB budget, and no plan of the rest of the prompt "
            "fits: node '6' (VGSampler) needs ")
    assert msg.startswith(head), msg
    assert re.search(r"it would fit with a budget of at least [0-9.]+ GiB", msg), msg
    assert (err.value.node_id, err.value.exception_type) == ("6", "torch.OutOfMemoryError")
    assert "estimate is wrong" not in msg and pngs(tmp_path) == []
    device.free = 2 * GiB  # memory returned: the rerun starts at the sampler (what finished stayed cached)
    again = e.run(prompt())
    assert {"4", "5"} <= set(again.cached) and calls == ["gpu", "gpu"] and len(pngs(tmp_path)) == 1


def test_a_node_that_fails_again_after_the_replan_fails_once_with_the_numbers(tiny_models: Path, input_dir: Path,
                                                                             tmp_path: Path) -> None:
    device = Device()
    sampler, calls = _oom_in(VGSampler, device, None, times=2)
    e = engine(tiny_models, input_dir, tmp_path, device, {"VGSampler": sampler})
    events: list[tuple[str, dict]] = []
    with pytest.raises(NodeExecutionError) as err:
        e.run(prompt(), events=lambda k, d: events.append((k, d)))
    assert calls == ["gpu", "gpu"] and len([k for k, _ in events if k == "vg_replan"]) == 1
    assert err.value.exception_message.startswith(
        "CUDA out of memory. Tried to allocate 2.00 MiB.; it ran out of GPU memory again after the rest of the prompt "
        "was planned again (it used 0.00 GiB of the "), err.value.exception_message
    assert err.value.exception_message.endswith(
        "planned for it): other processes hold 0.00 GiB of the device's 2.00 GiB, which leaves this engine 1.00 GiB "
        "of its 1.00 GiB budget; free GPU memory in the other processes, then queue again")
    assert pngs(tmp_path) == []


def test_the_estimate_is_called_wrong_only_when_the_node_itself_asked_for_more(tiny_models: Path, input_dir: Path,
                                                                               tmp_path: Path) -> None:
    device = Device()
    decode, calls = _oom_in(VGVAEDecode, device, None, message="CUDA out of memory. Tried to allocate 5.00 GiB.")
    e = engine(tiny_models, input_dir, tmp_path, device, {"VGVAEDecode": decode})
    events: list[tuple[str, dict]] = []
    with pytest.raises(NodeExecutionError) as err:
        e.run(prompt(), events=lambda k, d: events.append((k, d)))
    assert calls == ["gpu"] and not [k for k, _ in events if k == "vg_replan"]
    assert "so its estimate is wrong: please report it" in err.value.exception_message
    assert "other processes" not in err.value.exception_message and pngs(tmp_path) == []
