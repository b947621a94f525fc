"""The graph engine end to end on the CPU with tiny random-weight models (the real files, loaders and nodes).

The shipped text-to-image workflow (workflows/text_to_image.json), at 64x64:

    1 VGLoadTransformer ───────────────────────► 6 VGSampler ─► 7 VGVAEDecode ─► 8 VGSaveImage
    2 VGLoadTextEncoder ─► 4 VGTextEncode ─────►┘                ▲
    5 VGEmptyLatent ───────────────────────────►┘                │
    3 VGLoadVAE ─────────────────────────────────────────────────┘

Covered: the output cache across runs (what re-runs, what loads), progress events and interrupting, a failing
node (an injected out-of-memory error), plans under a small budget (unloads, infeasible budgets), and that
equivalent graphs give equal images: UI vs API format, ComfyUI's core nodes vs ours, the engine vs the
whole-model pipeline.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from vramgraph.graph.engine.budget import Budget
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import planner
from vramgraph.graph.workflow.errors import InterruptedRun, NodeExecutionError
from vramgraph.graph.workflow.parse import load_workflow
from vramgraph.models import loading
from vramgraph.models.pipeline import generate as pipeline_generate
from vramgraph.models.pipeline import load_models
from vramgraph.models.sampling import images_from_pixels
from vramgraph.nodes import ops
from vramgraph.nodes.files import Folders

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
ALT_TRANSFORMER = "flux-2-klein-4b-alt.safetensors"  # a second transformer file in tiny_models (see conftest)
SIZE = 64
GiB = 2**30


def shipped(name: str, size: int = SIZE) -> dict:
    """A shipped API workflow at size x size."""
    prompt = json.loads((WORKFLOWS / f"{name}.json").read_text())
    prompt["5"]["inputs"].update(width=size, height=size)
    return prompt


def core_text_to_image(text: str | None, seed: int, steps: int, size: int = SIZE) -> dict:
    """The shipped ComfyUI core-node FLUX.2 [klein] distilled text-to-image graph (as in its template, flattened);
    `text` None keeps the file's prompt."""
    g = json.loads((WORKFLOWS / "core_text_to_image.json").read_text())
    if text is not None:
        g["4"]["inputs"]["text"] = text
    g["9"]["inputs"]["noise_seed"] = seed
    g["8"]["inputs"].update(steps=steps, width=size, height=size)
    g["10"]["inputs"].update(width=size, height=size)
    g["13"]["inputs"]["filename_prefix"] = "core"
    return g


def folders_for(models: Path, input_dir: Path, out: Path) -> Folders:
    return Folders(models=(models,), input=input_dir, output=out / "output", temp=out / "temp")


@pytest.fixture
def folders(tiny_models: Path, input_dir: Path, tmp_path: Path) -> Folders:
    return folders_for(tiny_models, input_dir, tmp_path)


@pytest.fixture
def engine(folders: Folders) -> Engine:
    return Engine(folders, device="cpu")


@pytest.fixture
def weight_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The file name of every checkpoint the engine reads (through loading.load, which the ledger calls)."""
    calls: list[str] = []
    real = loading.load

    def counting(spec: loading.ComponentSpec, **kw: object) -> torch.nn.Module:
        calls.append(Path(spec.files[0]).name)
        return real(spec, **kw)

    monkeypatch.setattr(loading, "load", counting)
    return calls


def pngs(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.png")) if folder.exists() else []


def leftovers(folder: Path) -> list[Path]:
    """Anything a failed save could leave: PNGs and half-written `.part` files."""
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).copy()


# ------------------------------------------------------------------------------------------ the output cache


def test_cache_reruns_only_what_changed_and_loads_only_new_models(engine: Engine, folders: Folders,
                                                                   weight_loads: list[str]) -> None:
    first = engine.run(shipped("text_to_image"))
    assert first.loads == 3 and len(weight_loads) == 3  # transformer, text encoder, VAE read once each
    assert first.cached == ()
    assert [n.class_type for n in first.nodes] == [  # the plan's order: loaders (no weights) first
        "VGLoadVAE", "VGLoadTransformer", "VGEmptyLatent", "VGLoadTextEncoder", "VGTextEncode", "VGSampler",
        "VGVAEDecode", "VGSaveImage"]
    assert len(first.images) == 1 and first.images[0].is_file()

    # Only the prompt text differs: the loaders' outputs are cached, so the models stay where they are.
    p2 = shipped("text_to_image")
    p2["4"]["inputs"]["text"] = "a lighthouse at dusk"
    second = engine.run(p2)
    assert second.loads == 0 and second.unloads == 0 and len(weight_loads) == 3
    assert [n.class_type for n in second.nodes] == ["VGTextEncode", "VGSampler", "VGVAEDecode", "VGSaveImage"]
    assert set(second.cached) == {"1", "2", "3", "5"}
    assert len(second.images) == 1 and second.images[0] != first.images[0]
    assert not np.array_equal(pixels(first.images[0]), pixels(second.images[0]))  # the text matters

    # Another transformer file: that model, and only that one, is loaded; encode is cached now.
    p3 = copy.deepcopy(p2)
    p3["1"]["inputs"]["file"] = ALT_TRANSFORMER
    third = engine.run(p3)
    assert third.loads == 1 and weight_loads[3:] == [ALT_TRANSFORMER]
    assert [n.class_type for n in third.nodes] == ["VGLoadTransformer", "VGSampler", "VGVAEDecode", "VGSaveImage"]
    assert len(pngs(folders.output)) == 3

    # The same prompt again: every node's inputs are unchanged, so nothing runs, nothing is loaded and no new
    # PNG is written. This is ComfyUI's behaviour too (it does not re-execute an output node whose inputs did not
    # change; the picture from the earlier run is the result). Here the RunResult lists every node as cached and
    # reports no images, because none were written by this run.
    events: list[tuple[str, dict]] = []
    fourth = engine.run(p3, events=lambda kind, data: events.append((kind, data)))
    assert fourth.nodes == [] and fourth.loads == 0 and fourth.unloads == 0
    assert set(fourth.cached) == set(p3) and fourth.plan.steps == ()
    assert fourth.images == [] and fourth.ui == {}
    assert len(pngs(folders.output)) == 3 and len(weight_loads) == 4
    kinds = [k for k, _ in events]
    assert "execution_cached" in kinds and kinds[-1] == "execution_success"
    assert dict(events)["execution_cached"]["nodes"] and "progress" not in kinds


# ------------------------------------------------------------------------------------------ events, interrupt


def test_progress_events_and_interrupt_from_the_callback(engine: Engine, folders: Folders) -> None:
    events: list[tuple[str, dict]] = []
    result = engine.run(shipped("text_to_image"), prompt_id="p1", events=lambda k, d: events.append((k, d)))
    ran = [n.node for n in result.nodes]
    executing = [d["node"] for k, d in events if k == "executing"]
    assert executing == [*ran, None]  # one per node in plan order, then None: the prompt is done
    assert [(d["node"], d["value"], d["max"]) for k, d in events if k == "progress"] == [("6", i, 4)
                                                                                      for i in range(1, 5)]
    assert events[0] == ("execution_start", {"prompt_id": "p1"}) and events[-1][0] == "execution_success"
    assert [d["node"] for k, d in events if k == "executed"] == ran
    assert len(pngs(folders.output)) == 1

    # interrupt from the first progress event: the sampler stops at its next step
    fresh = Engine(folders_for(folders.models[0], folders.input, folders.output.parent / "second"), device="cpu")
    seen: list[tuple[str, dict]] = []

    def stop(kind: str, data: dict) -> None:
        seen.append((kind, data))
        if kind == "progress":
            fresh.interrupt()

    with pytest.raises(InterruptedRun) as info:
        fresh.run(shipped("text_to_image"), events=stop)
    assert info.value.node_id == "6" and info.value.class_type == "VGSampler"
    assert info.value.to_dict()["type"] == "execution_interrupted"
    assert [d["value"] for k, d in seen if k == "progress"] == [1]
    assert "execution_success" not in [k for k, _ in seen]
    assert leftovers(fresh.folders.output) == []

    after = fresh.run(shipped("text_to_image"))  # runs to the end: the interrupt was consumed
    assert len(after.images) == 1 and pngs(fresh.folders.output) == after.images
    assert np.array_equal(pixels(after.images[0]), pixels(result.images[0]))


# ------------------------------------------------------------------------------------------ a failing node


def test_out_of_memory_in_decode_names_the_node_and_leaves_no_png(engine: Engine, folders: Folders,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(*args: object, **kw: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(ops, "vae_decode", oom)
    with pytest.raises(NodeExecutionError) as info:
        engine.run(shipped("text_to_image"), prompt_id="oom-1")
    err = info.value
    assert (err.node_id, err.class_type) == ("7", "VGVAEDecode")
    assert "Node 7 (VGVAEDecode)" in str(err) and "CUDA out of memory" in str(err)
    d = err.to_dict()  # ComfyUI's execution_error message
    assert list(d) == ["prompt_id", "node_id", "node_type", "executed", "exception_message", "exception_type",
                       "traceback", "current_inputs", "current_outputs"]
    assert d["prompt_id"] == "oom-1" and d["node_id"] == "7" and d["node_type"] == "VGVAEDecode"
    assert d["exception_type"] == "torch.OutOfMemoryError"
    assert d["exception_message"].startswith("CUDA out of memory")
    assert "the plan predicted" in d["exception_message"]  # an OOM inside the plan means a wrong estimate
    assert {"6", "1", "4"} <= set(d["executed"]) and "7" not in d["executed"] and "8" not in d["executed"]
    assert all(isinstance(v, list) for v in d["current_inputs"].values())
    assert d["traceback"] and json.loads(json.dumps(d)) == d
    assert leftovers(folders.output) == []  # no PNG, no half-written .part

    monkeypatch.undo()
    result = engine.run(shipped("text_to_image"))
    assert "7" in [n.node for n in result.nodes] and len(result.images) == 1
    assert pngs(folders.output) == result.images


def test_damaged_weights_file_names_its_loader_node_and_a_fixed_file_runs(tiny_models: Path, input_dir: Path,
                                                                          tmp_path: Path) -> None:
    """A checkpoint whose header is whole but whose data is cut short fails at its Load step, reported as the
    loader node's error; once the file is whole again the same engine runs the prompt."""
    import shutil

    models = tmp_path / "models"
    shutil.copytree(tiny_models, models)
    prompt = shipped("text_to_image")
    path = next(models.rglob(prompt["1"]["inputs"]["file"]))
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 4096])
    folders = folders_for(models, input_dir, tmp_path)
    engine = Engine(folders, device="cpu")
    with pytest.raises(NodeExecutionError) as info:
        engine.run(prompt)
    err = info.value
    assert (err.node_id, err.class_type) == ("1", "VGLoadTransformer")
    assert "loading its model failed" in err.exception_message
    assert f"{path}: the file ends before its tensors do" in err.exception_message
    assert err.current_inputs and "6" not in err.executed
    assert leftovers(folders.output) == []
    path.write_bytes(whole)
    assert len(engine.run(prompt).images) == 1


# ------------------------------------------------------------------------------------------ small budgets


def _needs(engine: Engine, prompt: dict) -> tuple[int, dict[str, int]]:
    """(the largest GPU need of one node with nothing else resident, in its first (all-resident) variant; model
    bytes by label)."""
    prep = engine.prepare(prompt)
    sizes = {k: m.nbytes for k, m in prep.plan.models.items()}
    alone = max(sum(sizes[m] for m in c.variants[0].models) + c.variants[0].activation for c in prep.costs.values())
    return alone, {m.label: m.nbytes for m in prep.plan.models.values()}


@pytest.mark.parametrize("name", ["text_to_image", "edit"])
def test_tight_budget_unloads_between_nodes_and_gives_the_same_image(name: str, tiny_models: Path,
                                                                     input_dir: Path, tmp_path: Path) -> None:
    """With a budget that holds the largest node alone, the text encoder and the transformer never share the
    GPU: the plan unloads one for the other, and the picture is bit-for-bit the unlimited one."""
    roomy = Engine(folders_for(tiny_models, input_dir, tmp_path / "roomy"), device="cpu",
                   budget=Budget(gpu=64 * GiB, host=64 * GiB))
    reference = roomy.run(shipped(name))
    assert reference.unloads == 0

    alone, sizes = _needs(roomy, shipped(name))
    assert alone < sizes["text encoder"] + sizes["transformer"]  # so the two cannot be resident together
    tight = Engine(folders_for(tiny_models, input_dir, tmp_path / "tight"), device="cpu",
                   budget=Budget(gpu=alone, host=64 * GiB))
    prep = tight.prepare(shipped(name))
    unloads = [s.step for s in prep.plan.steps if isinstance(s.step, planner.Unload)]
    assert unloads and prep.plan.peak <= alone
    te = next(k for k, m in prep.plan.models.items() if m.label == "text encoder")
    tr = next(k for k, m in prep.plan.models.items() if m.label == "transformer")
    assert all(not {te, tr} <= set(s.resident) for s in prep.plan.steps)
    order = [type(s.step).__name__ + ":" + getattr(s.step, "model", getattr(s.step, "node", "")) for s in
             prep.plan.steps]
    assert order.index(f"Unload:{te}") < order.index(f"Load:{tr}")  # the encoder leaves before the transformer

    result = tight.run(prep)
    assert result.unloads == len(unloads) >= 1
    assert np.array_equal(pixels(result.images[0]), pixels(reference.images[0]))


def test_budget_too_small_for_any_node_fails_before_running(tiny_models: Path, input_dir: Path, tmp_path: Path,
                                                            weight_loads: list[str]) -> None:
    folders = folders_for(tiny_models, input_dir, tmp_path)
    engine = Engine(folders, device="cpu", budget=Budget(gpu=1 << 20, host=64 * GiB))  # 1 MiB
    events: list[str] = []
    with pytest.raises(planner.PlanError) as info:
        engine.run(shipped("text_to_image"), events=lambda k, d: events.append(k))
    d = info.value.to_dict()
    assert d["type"] == "vram_plan_infeasible" and set(d) == {"type", "message", "details", "extra_info"}
    assert d["extra_info"]["node_id"] in {"4", "6", "7"} and d["extra_info"]["budget_bytes"] == 1 << 20
    assert events == [] and weight_loads == [] and leftovers(folders.output) == []


# ------------------------------------------------------------------------------------------ equal graphs, equal images



def _template(name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    assert spec is not None and spec.submodule_search_locations, "pip install comfyui-workflow-templates-json"
    return Path(next(iter(spec.submodule_search_locations))) / "templates" / name


def test_ui_format_and_api_format_give_the_same_image(tiny_models: Path, input_dir: Path, tmp_path: Path) -> None:
    """ComfyUI's text-to-image template (UI format, a subgraph) against the same graph written by hand in the
    API format: same image, bit for bit."""
    ui = json.loads(_template("image_flux2_klein_text_to_image.json").read_text())
    sub = next(s for s in ui["definitions"]["subgraphs"] if s["id"] == "7b34ab90-36f9-45ba-a665-71d418f0df18")
    inner = {n["id"]: n for n in sub["nodes"]}
    inner[68]["widgets_values"][0] = inner[69]["widgets_values"][0] = SIZE  # Width, Height
    inner[62]["widgets_values"][0] = 2  # Flux2Scheduler steps
    text = next(n for n in ui["nodes"] if n["id"] == 76)["widgets_values"][0]
    from_ui = load_workflow(ui).prompt

    api = core_text_to_image(text, seed=0, steps=2)  # the template's base-model subgraph: cfg 5 with a negative
    api["1"]["inputs"]["unet_name"] = "flux-2-klein-base-4b.safetensors"
    api["5"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["2", 0]}}
    api["6"]["inputs"]["cfg"] = 5
    api["13"]["inputs"]["filename_prefix"] = "Flux2-Klein"
    assert sorted(n["class_type"] for n in from_ui.values()) == sorted(
        [n["class_type"] for n in api.values()] + ["PrimitiveInt", "PrimitiveInt", "PrimitiveStringMultiline"])

    a = Engine(folders_for(tiny_models, input_dir, tmp_path / "ui"), device="cpu").run(from_ui)
    b = Engine(folders_for(tiny_models, input_dir, tmp_path / "api"), device="cpu").run(api)
    assert np.array_equal(pixels(a.images[0]), pixels(b.images[0]))


def test_core_nodes_and_vg_nodes_give_the_same_image(tiny_models: Path, input_dir: Path, tmp_path: Path) -> None:
    vg = shipped("text_to_image")
    text, seed, steps = vg["4"]["inputs"]["text"], vg["6"]["inputs"]["seed"], vg["6"]["inputs"]["steps"]
    core = core_text_to_image(text, seed, steps)
    a = Engine(folders_for(tiny_models, input_dir, tmp_path / "vg"), device="cpu").run(vg)
    b = Engine(folders_for(tiny_models, input_dir, tmp_path / "core"), device="cpu").run(core)
    assert [n.class_type for n in b.nodes if n.class_type.startswith("VG")] == []
    im = pixels(a.images[0])
    assert im.shape == (SIZE, SIZE, 3) and im.std() > 1  # a picture, not a flat colour
    assert np.array_equal(im, pixels(b.images[0]))


def test_engine_matches_the_whole_model_pipeline(engine: Engine, tiny_models: Path) -> None:
    prompt = shipped("text_to_image")
    result = engine.run(prompt)
    files = [tiny_models / "diffusion_models" / "flux-2-klein-4b.safetensors",
             tiny_models / "text_encoders" / "qwen_3_4b.safetensors", tiny_models / "vae" / "flux2-vae.safetensors"]
    models = load_models(files, dtype=torch.float32, device="cpu")
    p = prompt["6"]["inputs"]
    out = pipeline_generate(models, prompt["4"]["inputs"]["text"], width=SIZE, height=SIZE, seed=p["seed"],
                            steps=p["steps"], guidance=p["guidance"])
    want = np.asarray(images_from_pixels(out, rounding="floor")[0].convert("RGB")).astype(int)
    got = pixels(result.images[0]).astype(int)
    assert got.shape == want.shape == (SIZE, SIZE, 3)
    assert np.abs(got - want).max() <= 1, np.abs(got - want).max()


def test_the_png_seed_comes_from_the_nearest_seeded_node_above() -> None:
    """An image-to-image chain with two seeded samplers above one save, and a save with two samplers as near:

        11 (seed 1) ──► 12 ──► 13 (seed 2) ──► 14 ──► 15 save          the nearer sampler: 13
        21 (seed 3) ──┐
        30 (seed 4) ──┴──► 31 save                                     as near: the lower id, 21
        40 ──► 41 save                                                 no seed above: None

    The answer must not depend on the order a set of ancestors happens to iterate in, so every graph is tried with
    its nodes and edges added in many orders."""
    import random

    import networkx as nx
    from vramgraph.graph.engine.executor import seed_source

    seeded = {"11": ("noise_seed", 1), "13": ("seed", 2), "21": ("seed", 3), "30": ("noise_seed", 4)}
    prompt = {n: {"inputs": {seeded[n][0]: seeded[n][1]} if n in seeded else {}}
              for n in ("11", "12", "13", "14", "15", "21", "30", "31", "40", "41")}
    edges = [("11", "12"), ("12", "13"), ("13", "14"), ("14", "15"), ("21", "31"), ("30", "31"), ("40", "41")]
    rng = random.Random(0)
    for _ in range(20):
        dag = nx.DiGraph()
        dag.add_nodes_from(rng.sample(sorted(prompt), len(prompt)))
        dag.add_edges_from(rng.sample(edges, len(edges)))
        assert seed_source(dag, prompt, "15") == ("13", "seed")
        assert seed_source(dag, prompt, "31") == ("21", "seed")
        assert seed_source(dag, prompt, "13") == ("13", "seed")  # a node's own seed input first
        assert seed_source(dag, prompt, "41") is None
