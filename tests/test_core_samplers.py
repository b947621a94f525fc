"""The core nodes' sampler, scheduler, weight_dtype and device choices, validated, planned and run end to end on
tiny random-weight models (CPU), through ComfyUI's core workflow and KSampler."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_engine import core_text_to_image
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.workflow.errors import NodeExecutionError, ValidationFailed
from vramgraph.models import samplers, schedules
from vramgraph.nodes import ENGINE_NODES
from vramgraph.nodes.core import SAMPLERS, SCHEDULERS, WEIGHT_DTYPES, scheduled_sigmas
from vramgraph.nodes.declared import COMFY_SAMPLERS
from vramgraph.nodes.files import Folders

SIZE = 32


def core(sampler: str = "euler", seed: int = 7, steps: int = 2) -> dict:
    """The shipped core-node text-to-image graph (KSamplerSelect -> SamplerCustomAdvanced), small."""
    g = core_text_to_image(None, seed, steps, SIZE)
    g["7"]["inputs"]["sampler_name"] = sampler
    return g


def ksampler(sampler: str, scheduler: str, seed: int = 7, steps: int = 2, denoise: float = 1.0) -> dict:
    """The same graph with ComfyUI's KSampler in place of the custom-sampling nodes."""
    g = core(steps=steps)
    for n in ("6", "7", "8", "9", "11"):
        del g[n]
    g["20"] = {"class_type": "KSampler", "inputs": {
        "model": ["1", 0], "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": sampler, "scheduler": scheduler,
        "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["10", 0], "denoise": denoise}}
    g["12"]["inputs"]["samples"] = ["20", 0]
    return g


def basic_scheduler(g: dict, scheduler: str, steps: int, denoise: float = 1.0) -> dict:
    """`core` with BasicScheduler in place of Flux2Scheduler."""
    g = copy.deepcopy(g)
    g["8"] = {"class_type": "BasicScheduler", "inputs": {"model": ["1", 0], "scheduler": scheduler, "steps": steps,
                                                         "denoise": denoise}}
    return g


@pytest.fixture
def folders(tiny_models: Path, input_dir: Path, tmp_path: Path) -> Folders:
    return Folders(models=(tiny_models,), input=input_dir, output=tmp_path / "output", temp=tmp_path / "temp")


def run(folders: Folders | Engine, g: dict) -> np.ndarray:
    """`g` on an engine (or a fresh one); its one image as uint8 pixels."""
    engine = folders if isinstance(folders, Engine) else Engine(folders, device="cpu")
    result = engine.run(g)
    return np.asarray(Image.open(result.images[0]).convert("RGB"))


def test_choices_are_comfyuis():
    types = {name: ENGINE_NODES[name].INPUT_TYPES() for name in ("KSamplerSelect", "KSampler", "BasicScheduler")}
    assert types["KSamplerSelect"]["required"]["sampler_name"][0] == list(COMFY_SAMPLERS)  # all of ComfyUI's
    assert types["KSampler"]["required"]["sampler_name"][0] == list(COMFY_SAMPLERS)
    assert [s for s in COMFY_SAMPLERS if s in SAMPLERS] == list(SAMPLERS)  # ours, in ComfyUI's order
    assert types["KSampler"]["required"]["scheduler"][0] == SCHEDULERS
    assert types["BasicScheduler"]["required"]["scheduler"][0] == SCHEDULERS
    for name in ("euler", "euler_ancestral", "heun", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_sde", "lcm"):
        assert name in SAMPLERS
    for name in ("simple", "normal", "karras", "exponential", "sgm_uniform", "beta"):
        assert name in SCHEDULERS
    unet = ENGINE_NODES["UNETLoader"].INPUT_TYPES()["required"]["weight_dtype"]
    assert unet == (["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"], {"advanced": True}) == (WEIGHT_DTYPES,
                                                                                                      unet[1])
    assert ENGINE_NODES["CLIPLoader"].INPUT_TYPES()["optional"]["device"][0] == ["default", "cpu"]


def test_every_pair_validates_and_plans(folders: Folders):
    engine = Engine(folders, device="cpu")
    for sampler in SAMPLERS:
        engine.prepare(core(sampler))
        for scheduler in SCHEDULERS:
            prep = engine.prepare(ksampler(sampler, scheduler))
            assert any(s.step.kind == "run" and s.step.node == "20" for s in prep.plan.steps)
    for scheduler in SCHEDULERS:
        engine.prepare(basic_scheduler(core(), scheduler, 3))


def test_unknown_choices_are_refused_before_running(folders: Folders):
    engine = Engine(folders, device="cpu")
    with pytest.raises(ValidationFailed) as e:
        engine.prepare(core("no_such_sampler"))
    assert e.value.response["node_errors"]["7"]["errors"][0]["type"] == "value_not_in_list"
    with pytest.raises(ValidationFailed) as e:  # one ComfyUI lists and we do not run: refused, with what we run
        engine.prepare(core("dpm_fast"))
    (err,) = e.value.response["node_errors"]["7"]["errors"]
    assert err["type"] == "custom_validation_failed" and err["extra_info"]["input_name"] == "sampler_name"
    assert "sampler_name 'dpm_fast' is not run by vramgraph" in err["details"] and "euler, " in err["details"]
    with pytest.raises(NodeExecutionError, match=r"kl_optimal.*at least 2 steps"):
        engine.prepare(ksampler("euler", "kl_optimal", steps=1))


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"])
def test_fp8_casts_are_refused_with_a_clear_error(folders: Folders, weight_dtype: str):
    g = core()
    g["1"]["inputs"]["weight_dtype"] = weight_dtype
    with pytest.raises(ValidationFailed) as e:
        Engine(folders, device="cpu").prepare(g)
    (err,) = e.value.response["node_errors"]["1"]["errors"]
    assert err["type"] == "custom_validation_failed" and err["extra_info"]["input_name"] == "weight_dtype"
    assert err["details"].startswith(f"weight_dtype - weight_dtype '{weight_dtype}': casting") and "'default'" in \
        err["details"]
    from vramgraph.nodes.core import UNETLoader

    with pytest.raises(ValueError, match="not supported"):  # the estimate refuses it too, should anything skip
        UNETLoader.vg_estimate(None, "flux-2-klein-4b.safetensors", weight_dtype)


def test_each_sampler_end_to_end(folders: Folders):
    """Every sampler runs the core graph; each gives its own picture; the stochastic ones change with the seed
    (their fresh noise is the noise seed's, tests/test_samplers.py checks it is the same for the same seed)."""
    images, engine = {}, Engine(folders, device="cpu")  # one engine: the loads and the text encode are cached
    for sampler in SAMPLERS:
        im = images[sampler] = run(engine, core(sampler, steps=3))
        assert im.shape == (SIZE, SIZE, 3) and im.std() > 1
    names = list(images)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not np.array_equal(images[a], images[b]), (a, b)
    for sampler in ("euler_ancestral", "dpmpp_2m_sde"):
        assert not np.array_equal(images[sampler], run(engine, core(sampler, seed=8, steps=3)))


def test_ksampler_is_basic_scheduler_and_custom_sampling(folders: Folders):
    """KSampler = BasicScheduler + KSamplerSelect + SamplerCustomAdvanced with the same seed (as in ComfyUI)."""
    engine = Engine(folders, device="cpu")
    a = run(engine, ksampler("dpmpp_2m_sde", "beta", seed=3, steps=3, denoise=0.5))
    b = run(engine, basic_scheduler(core("dpmpp_2m_sde", seed=3), "beta", 3, denoise=0.5))
    assert np.array_equal(a, b)
    sig = scheduled_sigmas("beta", 3, 0.5)  # denoise < 1: the tail of the schedule for int(steps / denoise) steps
    assert torch.equal(sig, schedules.schedule("beta", 6)[-4:]) and float(sig[0]) < 1


def test_euler_core_graph_is_unchanged(folders: Folders):
    """KSamplerSelect 'euler' + Flux2Scheduler still step x += (sigma_next - sigma) v on Flux2Scheduler's sigmas."""
    from vramgraph.models.sampling import sigmas as flux2_sigmas

    g = core(steps=2)
    assert run(folders, g).std() > 1
    assert flux2_sigmas(2, (SIZE // 16) ** 2) == pytest.approx(
        ENGINE_NODES["Flux2Scheduler"]().get_sigmas(2, SIZE, SIZE)[0].tolist())


def test_cliploader_device_cpu_plans_no_gpu_memory_for_the_text_encoder(folders: Folders):
    g = core()
    g["2"]["inputs"]["device"] = "cpu"
    engine = Engine(folders, device="cpu")
    prep = engine.prepare(g)
    encode = next(s for s in prep.plan.steps if s.step.kind == "run" and s.step.node == "4")
    assert encode.step.variant == "cpu"
    te = prep.costs["2"].outputs[0]
    assert te.placement == "cpu"
    assert not any(s.step.kind == "load" and s.step.model == te.key for s in prep.plan.steps)
    assert all(te.key not in s.resident for s in prep.plan.steps)
    assert np.array_equal(run(engine, g), run(engine, core()))  # the same conditioning, reaching the sampler


def test_brownian_noise_has_comfyuis_latent_layout():
    """The SDE noise is drawn in the latent's (B, 128, h, w) shape, as ComfyUI draws it, not in token order."""
    x = torch.zeros(1, 128, 2, 3)
    sig = schedules.schedule("simple", 2)
    got = samplers.BrownianNoise(x, sig[sig > 0].min(), sig.max(), 5)(sig[0], sig[1])
    assert got.shape == (1, 128, 2, 3)


def test_two_call_samplers_are_priced_per_model_call(folders: Folders):
    engine = Engine(folders, device="cpu")
    seconds = {s: engine.prepare(core(s, steps=4)).costs["11"].variants[0].seconds for s in ("euler", "heun")}
    assert seconds["heun"] == pytest.approx(seconds["euler"] * 7 / 4)  # 2 calls a step, 1 on the step to 0
