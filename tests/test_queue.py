"""Many images: queue-aware planning, the interactive session, step previews (CPU, tiny models)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from vramgraph.api.pipeline import Pipeline
from vramgraph.cli import main as cli
from vramgraph.cli.session import Session
from vramgraph.graph.engine.budget import Budget
from vramgraph.graph.engine.executor import Cancel, Engine
from vramgraph.graph.plan import planner
from vramgraph.graph.workflow.queue import merge
from vramgraph.graph.workflow.roles import build_prompt
from vramgraph.models.preview import preview_rgb, unpatchify
from vramgraph.models.vae import patchify
from vramgraph.nodes.files import Folders

SIDE = 64


def _folders(tiny_models: Path, input_dir: Path, tmp_path: Path) -> Folders:
    return Folders(models=(tiny_models,), input=input_dir, output=tmp_path / "out", temp=tmp_path / "temp")


def _prompts(n: int) -> list[dict]:
    return [build_prompt(f"prompt number {i}", width=SIDE, height=SIDE, seed=10 + i) for i in range(n)]


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path))


def test_merge_shares_identical_nodes_but_never_outputs():
    """
    q0: 1,2,3 loaders -> 4 encode -> 6 sample -> 7 decode -> 8 save
    q1: same loaders (shared), its own 4, 5 (same size: shared), 6, 7, 8
    """
    m = merge(_prompts(2), frozenset({"VGSaveImage"}))
    ids = sorted(m.prompt)
    assert [i for i in ids if i.startswith("q1:")] == ["q1:4", "q1:6", "q1:7", "q1:8"]
    assert m.members[1]["1"] == "q0:1" and m.members[1]["5"] == "q0:5" and m.members[1]["8"] == "q1:8"
    assert m.prompt["q1:6"]["inputs"]["model"] == ["q0:1", 0] and m.prompt["q1:6"]["inputs"]["positive"] == ["q1:4", 0]


def test_queue_loads_each_model_once_and_gives_the_same_images(tiny_models, input_dir, tmp_path):
    """A budget that holds one model at a time: queued, each model loads once; alone, each image swaps."""
    folders = _folders(tiny_models, input_dir, tmp_path)
    probe = Engine(folders)
    prep = probe.prepare(_prompts(1)[0])
    sizes = {e.info.label: e.info.nbytes for e in probe.ledger.entries.values()}
    need = max(sizes["text encoder"], sizes["transformer"])
    act = max(o.activation for c in prep.costs.values() for o in c.variants if o.blocks is None)  # (a streamed
    #                                                  variant's `activation` holds its staging and fixed weights too)
    budget = Budget(gpu=need + sizes["vae"] + act + 2**20, host=8 * 2**30)
    assert sizes["text encoder"] + sizes["transformer"] > budget.gpu - act  # they cannot be resident together

    queued = Engine(folders, budget=budget)
    prompts = _prompts(4)
    result, images = queued.run_queue(prompts)
    loads = [s.step for s in result.plan.steps if isinstance(s.step, planner.Load)]
    labels = sorted(result.plan.label(s.model) for s in loads)
    assert labels == ["text encoder", "transformer", "vae"]  # one load of each model for 4 images
    order = [result.plan.classes[n] for n in result.plan.order
             if not result.plan.classes[n].startswith("VGLoad") and result.plan.classes[n] != "VGEmptyLatent"]
    # each image is decoded and saved once sampled: the decode fits beside the transformer (graph/plan/early.py)
    assert order == ["VGTextEncode"] * 4 + ["VGSampler", "VGVAEDecode", "VGSaveImage"] * 4

    alone = Engine(folders, budget=budget)
    moves, streamed = 0, []
    for prompt, mine in zip(prompts, images, strict=True):
        r = alone.run(prompt)
        moves += r.loads
        streamed += [(n.class_type, n.variant) for n in r.nodes if n.variant.startswith("stream")]
        assert np.array_equal(_pixels(r.images[0]), _pixels(mine[0]))  # bit for bit
        saved = Image.open(mine[0])
        assert json.loads(saved.text["prompt"]) == prompt  # each PNG carries its own prompt
    # image by image the encoder and the transformer cannot both stay: after the first image (a load of each model)
    # every text encode streams the encoder beside the resident transformer rather than swapping them
    assert moves == 3 and streamed == [("VGTextEncode", "stream")] * 3


def test_cancelling_one_prompt_of_a_queue(tiny_models, input_dir, tmp_path):
    """The middle prompt of three loses its output while its sampler runs (timed by the sampler's own progress
    report): the sampler stops at its next step, that prompt's decode and save never run, the shared loaders and
    the other prompts' nodes run as planned, and the other images equal those of their prompts run alone."""
    folders = _folders(tiny_models, input_dir, tmp_path)
    engine = Engine(folders)
    prompts = _prompts(3)
    prep, merged = engine.prepare_queue(prompts)
    mine = merged.members[1]
    assert mine["1"] == "q0:1" and mine["8"] == "q1:8", "loaders shared, outputs not"
    cancel = Cancel()
    seen: list[tuple[str, dict]] = []

    def events(kind: str, data: dict) -> None:
        seen.append((kind, data))
        if kind == "progress" and data["node"] == mine["6"] and data["value"] == 1:
            cancel.outputs([mine["8"]])

    result = engine.run(prep, events=events, cancel=cancel)
    (cut,) = [d for k, d in seen if k == "cancelled"]
    assert cut["outputs"] == [mine["8"]] and cut["node"] == mine["6"]
    assert sorted(cut["dropped"]) == sorted(mine[n] for n in ("6", "7", "8"))
    steps = [d["value"] for k, d in seen if k == "progress" and d["node"] == mine["6"]]
    assert steps == [1], "stopped at its next step"
    executed = [d["node"] for k, d in seen if k == "executed"]
    assert mine["4"] in executed and not {mine["7"], mine["8"]} & set(executed)
    assert {merged.members[i][n] for i in (0, 2) for n in ("4", "6", "7", "8")} <= set(executed)
    assert set(result.ui) == {"q0:8", "q2:8"}
    alone = Engine(folders)
    for i in (0, 2):
        (ours,) = engine._image_paths(result.ui[merged.members[i]["8"]])
        assert np.array_equal(_pixels(alone.run(prompts[i]).images[0]), _pixels(ours))  # bit for bit
    # the cut is per run: the same queue again runs the middle prompt's rest, the others come from the cache
    again = engine.run(engine.prepare_queue(prompts)[0])
    assert set(again.ui) == {"q1:8"} and {"q0:8", "q1:4", "q2:8"} <= set(again.cached)


def test_queue_respects_host_ram(tiny_models, input_dir, tmp_path):
    """With host RAM for only one held output at a time the queue finishes chains one by one."""
    folders = _folders(tiny_models, input_dir, tmp_path)
    engine = Engine(folders, budget=Budget(gpu=2**34, host=1))
    result, images = engine.run_queue(_prompts(2))
    assert all(len(g) == 1 for g in images)
    classes = [result.plan.classes[n] for n in result.plan.order]
    first_save = classes.index("VGSaveImage")
    assert classes[first_save + 1:].count("VGTextEncode") == 1  # the second prompt started after the first saved


def test_session_keeps_models_and_reports_moves(tiny_models, input_dir, tmp_path):
    pipe = Pipeline(tiny_models, input=tmp_path / "in", output=tmp_path / "out")
    said: list[str] = []
    s = Session(pipe, width=SIDE, height=SIDE, save_dir=tmp_path / "saved")
    s.handle("a red fox", said.append)
    assert "loaded text encoder, transformer, vae" in said[-1] and "seed 0" in said[-1]
    s.handle("!seed 7", said.append)
    s.handle("128x64 a cat", said.append)
    assert "seed 7" in said[-1] and "no model moved" in said[-1]
    saved = sorted((tmp_path / "saved").glob("*.png"))
    assert len(saved) == 2 and Image.open(saved[1]).size == (128, 64)
    s.handle(f"!ref {input_dir / 'reference.png'}", said.append)
    assert "1 reference(s)" in said[-1]
    s.handle("make it winter", said.append)
    assert len(list((tmp_path / "saved").glob("edit_*.png"))) == 1
    with pytest.raises(ValueError, match="!help"):
        s.handle("!bogus", said.append)
    with pytest.raises(ValueError, match="WxH"):
        s.handle("!size big", said.append)
    with pytest.raises(ValueError, match=r"!steps 0: must be a whole number from 1 to 1000"):
        s.handle("!steps 0", said.append)
    with pytest.raises(ValueError, match=r"size width 100: must be a multiple of 16"):
        s.handle("100x64 a dog", said.append)
    s.handle("!quit", said.append)
    assert s.done


def test_previews_every_step_and_map_shape(tiny_models, input_dir, tmp_path):
    engine = Engine(_folders(tiny_models, input_dir, tmp_path), previews=True)
    frames = []
    engine.run(_prompts(1)[0], events=lambda k, d: frames.append(d) if k == "preview" else None)
    assert [f["step"] for f in frames] == [1, 2, 3, 4] and all(f["image"].size[0] >= 8 for f in frames)
    lat = torch.randn(2, 128, 5, 7)
    assert torch.equal(unpatchify(lat), _unpatchify_ref(lat))
    rgb = preview_rgb(lat)
    assert rgb.shape == (2, 10, 14, 3) and rgb.min() >= 0 and rgb.max() <= 1


def _unpatchify_ref(lat: torch.Tensor) -> torch.Tensor:
    """Inverse of the VAE's own patchify, as an independent check of the preview's channel order."""
    out = torch.zeros(lat.shape[0], 32, lat.shape[2] * 2, lat.shape[3] * 2)
    for c in range(32):
        for dy in range(2):
            for dx in range(2):
                out[:, c, dy::2, dx::2] = lat[:, c * 4 + dy * 2 + dx]
    assert torch.equal(patchify(out), lat)
    return out


def test_cli_generate_queue_and_previews(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a boat\n\na lighthouse\n")
    out = tmp_path / "img.png"
    assert cli(["generate", "--models", str(tiny_models), "-p", "a fox", "--prompts", str(prompts),
                "-W", str(SIDE), "-H", str(SIDE), "-o", str(out), "--preview", str(tmp_path / "prev")]) == 0
    made = sorted(tmp_path.glob("img-*.png"))
    assert [p.name for p in made] == ["img-1.png", "img-2.png", "img-3.png"]
    assert [json.loads(Image.open(p).text["prompt"])["4"]["inputs"]["text"] for p in made] == \
        ["a fox", "a boat", "a lighthouse"]
    assert len(list((tmp_path / "prev").glob("*.png"))) == 12  # 3 images x 4 steps


def test_preview_map_fit_recovers_a_linear_map():
    """bench/fit_preview.py's least squares recovers a known 32x3 map and bias."""
    from vramgraph.models.preview import fit_map

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(32, 3, generator=g), torch.randn(3, generator=g)
    raw = torch.randn(2, 32, 6, 5, generator=g)
    rgb = torch.einsum("bchw,cr->bhwr", raw, weight) + bias
    w, b = fit_map(raw, rgb)
    assert torch.allclose(w, weight, atol=1e-4) and torch.allclose(b, bias, atol=1e-4)
