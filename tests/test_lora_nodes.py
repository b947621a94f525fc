"""LoraLoader and LoraLoaderModelOnly run by the engine on tiny models (real files, real nodes), ComfyUI's core graph
with the LoRA nodes inserted:

    1 UNETLoader ─► 20 LoraLoader ─► (21 LoraLoaderModelOnly) ─► 6 CFGGuider ─► 11 SamplerCustomAdvanced ─► ...
    2 CLIPLoader ─►┘        └─ clip ─► 4 CLIPTextEncode ─────────►┘

The picture equals the one made from checkpoint files with the LoRA merged in beforehand by the reference formula;
a change of the model's LoRA keeps the text encoding; bad LoRA input fails validation, naming the node and the file,
and the next prompt runs.
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import core_text_to_image, folders_for, pixels
from test_lora import ref_merge
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import planner
from vramgraph.graph.workflow.errors import NodeExecutionError, ValidationFailed
from vramgraph.models import flux2_config, lora_format
from vramgraph.models.lora_make import text_encoder_modules, transformer_modules, write_lora
from vramgraph.models.tiny import TINY_QWEN3, TINY_TRANSFORMER

UNET, CLIP = "flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors"


def with_lora(g: dict, name: str = "style.safetensors", sm: float = 1.0, sc: float = 1.0) -> dict:
    g = copy.deepcopy(g)
    g["20"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["2", 0], "lora_name": name,
                                                      "strength_model": sm, "strength_clip": sc}}
    g["6"]["inputs"]["model"] = ["20", 0]
    g["4"]["inputs"]["clip"] = ["20", 1]
    return g


def chained(g: dict, name: str, strength: float) -> dict:
    g = copy.deepcopy(g)
    g["21"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": g["6"]["inputs"]["model"], "lora_name": name,
                                                               "strength_model": strength}}
    g["6"]["inputs"]["model"] = ["21", 0]
    return g


@pytest.fixture(scope="module")
def lora_models(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models plus loras/: a LoRA on both parts (BFL + kohya text encoder keys), a diffusers-style LoKr on
    the transformer, and a LoRA for klein-9B."""
    models = tmp_path_factory.mktemp("lora") / "models"
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (models / sub).mkdir(parents=True)
    shutil.copy(tiny_models / "diffusion_models" / UNET, models / "diffusion_models" / UNET)
    shutil.copy(tiny_models / "text_encoders" / CLIP, models / "text_encoders" / CLIP)
    shutil.copy(tiny_models / "vae" / "flux2-vae.safetensors", models / "vae" / "flux2-vae.safetensors")
    loras = models / "loras"
    write_lora(loras / "style.safetensors", transformer_modules(TINY_TRANSFORMER, "bfl") +
               text_encoder_modules(TINY_QWEN3, "kohya_te"), rank=4, alpha=2.0, dtype="float32", scale=0.3)
    write_lora(loras / "sub" / "detail.safetensors", transformer_modules(TINY_TRANSFORMER, "diffusers"), kind="lokr",
               rank=4, dtype="bfloat16", seed=3, scale=0.3)
    big = [m for m in transformer_modules(flux2_config.KLEIN_9B, "bfl") if "double_blocks.0.img_attn.proj" in m[0]]
    write_lora(loras / "klein9b.safetensors", big)
    return models


@pytest.fixture
def engine(lora_models: Path, input_dir: Path, tmp_path: Path) -> Engine:
    return Engine(folders_for(lora_models, input_dir, tmp_path), device="cpu")


def _merged_models(lora_models: Path, dest: Path, strength_model: float, strength_clip: float) -> Path:
    """A models folder whose checkpoints have style.safetensors merged in by the reference formula."""
    shutil.copytree(lora_models, dest, ignore=shutil.ignore_patterns("loras"))
    t = load_file(str(lora_models / "loras" / "style.safetensors"))
    unet = load_file(str(dest / "diffusion_models" / UNET))
    for k, w in unet.items():
        n = "diffusion_model." + k.removesuffix(".weight")
        if f"{n}.lora_A.weight" in t:
            unet[k] = ref_merge(w.float(), t, n, strength_model).to(w.dtype)
    save_file(unet, str(dest / "diffusion_models" / UNET))
    te = load_file(str(dest / "text_encoders" / CLIP))
    for k, w in te.items():
        n = "lora_te_" + k.removeprefix("model.").removesuffix(".weight").replace(".", "_")
        if f"{n}.lora_down.weight" in t:
            te[k] = ref_merge(w.float(), t, n, strength_clip).to(w.dtype)
    save_file(te, str(dest / "text_encoders" / CLIP))
    return dest


def test_lora_picture_equals_the_merged_checkpoint(engine, lora_models, input_dir, tmp_path):
    g = core_text_to_image("a fox", seed=3, steps=2, size=64)
    plain = engine.run(g)
    lora = engine.run(with_lora(g, sm=0.9, sc=1.3))
    assert not np.array_equal(pixels(plain.images[0]), pixels(lora.images[0]))
    notes = " ".join(s.note for s in lora.plan.steps if getattr(s, "note", ""))
    assert "LoRA" in notes
    merged = _merged_models(lora_models, tmp_path / "merged", 0.9, 1.3)
    ref = Engine(folders_for(merged, input_dir, tmp_path / "ref"), device="cpu").run(g)
    diff = np.abs(pixels(lora.images[0]).astype(int) - pixels(ref.images[0]).astype(int))
    assert diff.mean() <= 0.5 and diff.max() <= 3  # bf16 rounding of the merged weights vs the reference's


def test_only_the_model_lora_changed_keeps_the_text_encoding(engine):
    g = with_lora(core_text_to_image("a fox", seed=3, steps=1, size=64))
    engine.run(g)
    g2 = copy.deepcopy(g)
    g2["20"]["inputs"]["strength_model"] = 0.5
    second = engine.run(g2)
    assert "4" in second.cached and "11" not in second.cached  # the encode is reused, the sampler runs
    g3 = copy.deepcopy(g2)
    g3["20"]["inputs"]["strength_clip"] = 0.2
    third = engine.run(g3)
    assert "4" not in third.cached


def test_chained_loras_and_strength_zero(engine):
    g = core_text_to_image("a fox", seed=5, steps=1, size=64)
    base = engine.run(g)
    two = engine.run(chained(with_lora(g, sm=1.0, sc=0.0), "sub/detail.safetensors", -0.7))
    one = engine.run(with_lora(g, sm=1.0, sc=0.0))
    assert not np.array_equal(pixels(two.images[0]), pixels(one.images[0]))
    off = engine.run(chained(with_lora(g, sm=0.0, sc=0.0), "sub/detail.safetensors", 0.0))
    # 0 = off: the base weights again, though the run before merged a LoRA into them
    assert np.array_equal(pixels(off.images[0]), pixels(base.images[0]))


def _chosen(prep, node: str):
    """The variant the plan runs `node` with."""
    name = prep.plan.variant_of(node)
    return next(v for v in prep.costs[node].variants if v.name == name)


def _moves(engine: Engine, mark: int) -> list[tuple[str, str]]:
    """(kind, model label) of the ledger's events since `mark`: loads, pins (file reads), merges, restores."""
    return [(e.kind, engine.ledger.entries[e.model].info.label) for e in engine.ledger.events.since(mark)]


ON_EACH_DEVICE = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


@ON_EACH_DEVICE
def test_a_warm_merge_is_free_in_the_plan_and_not_done_again(device, lora_models, input_dir, tmp_path):
    """The next prompt with the same LoRAs (a new text: the encode and the sampler run again) finds them merged on the
    resident weights: the plan counts 0 s and 0 bytes for them and the run merges nothing. A new model strength merges
    the transformer again (its earlier merge restored from the host copy first), not the text encoder."""
    engine = Engine(folders_for(lora_models, input_dir, tmp_path), device=device)
    first = engine.prepare(with_lora(core_text_to_image("a fox", seed=3, steps=2, size=64), sm=0.9, sc=1.3))
    assert {_chosen(first, n).lora_mode for n in ("4", "11")} == {"merged"}  # (tiny layers: a merge is cheap)
    assert not any(_chosen(first, n).lora.warm for n in ("4", "11"))
    mark = engine.ledger.events.mark()
    engine.run(first)
    assert [m for m in _moves(engine, mark) if m[0] == "merge"] == [("merge", "text encoder"), ("merge", "transformer")]
    g = with_lora(core_text_to_image("a cat", seed=3, steps=2, size=64), sm=0.9, sc=1.3)
    prep = engine.prepare(g)
    for node in ("4", "11"):
        v = _chosen(prep, node)
        assert v.lora_mode == "merged" and v.lora.warm and "already" in v.note
        assert (v.seconds, v.activation) == (v.lora.base.seconds, v.lora.base.activation)  # nothing for the LoRA
        cold = v.lora.cost
        assert cold.merge_seconds > 0 and cold.merge_transient + cold.adapter_bytes > 0  # what a cold merge costs
    mark = engine.ledger.events.mark()
    warm = engine.run(prep)
    assert _moves(engine, mark) == []  # no file read, no load, no merge, no restore
    fresh = Engine(folders_for(lora_models, input_dir, tmp_path / "fresh"), device=device).run(g)
    diff = np.abs(pixels(warm.images[0]).astype(int) - pixels(fresh.images[0]).astype(int))
    assert diff.max() <= (0 if device == "cpu" else 1)  # the picture of a merge made from cold (GPU kernels may vary)

    g2 = copy.deepcopy(g)
    g2["20"]["inputs"]["strength_model"] = 0.5
    prep = engine.prepare(g2)
    assert "4" in prep.cached  # the text encoding does not depend on the model's strength
    v = _chosen(prep, "11")
    assert not v.lora.warm and v.seconds > v.lora.base.seconds
    mark = engine.ledger.events.mark()
    engine.run(prep)
    assert _moves(engine, mark) == [("restore", "transformer"), ("merge", "transformer")]


@ON_EACH_DEVICE
def test_switching_loras_reads_no_file_and_never_writes_the_host_copy(device, lora_models, input_dir, tmp_path):
    """LoRA sets one after another, merged into the weights, on a card that cannot hold the three models at once (so
    every model gets a host copy, pinned on a GPU): no switch reads a model file again, and the host copy keeps the
    checkpoint's weights throughout (a merge writes GPU weights, or new tensors on the CPU, and restores from it)."""
    folders = folders_for(lora_models, input_dir, tmp_path)
    g = core_text_to_image("a fox", seed=5, steps=1, size=64)
    weights = sum(m.nbytes for m in Engine(folders, device=device).prepare(with_lora(g)).plan.models.values())
    engine = Engine(folders, device=device, budget=planner.Budget(gpu=weights, host=8 * 2**30))
    engine.run(with_lora(g))
    mark = engine.ledger.events.mark()
    for prompt in (chained(with_lora(g, sm=0.7), "sub/detail.safetensors", 0.5), g, with_lora(g, sm=-1.0, sc=0.4)):
        engine.run(prompt)
    events = engine.ledger.events.since(mark)
    assert not [e for e in events if e.kind == "pin" or e.source == "file"]  # no model file read again
    assert sum(e.kind == "merge" for e in events) >= 2
    e = next(e for e in engine.ledger.entries.values() if e.info.kind == "transformer")
    on_file = load_file(str(lora_models / "diffusion_models" / UNET))
    assert e.copy is not None and e.copy.host.keys() >= on_file.keys()
    assert all(torch.equal(e.copy.host[k], on_file[k].to(e.copy.host[k].dtype)) for k in on_file)
    assert (e.copy.flat is not None) == (device == "cuda")  # one pinned buffer on a GPU
    style = lora_format.parse(lora_models / "loras" / "style.safetensors", TINY_TRANSFORMER, None)
    assert {t.param for t in style.component("transformer")} <= on_file.keys()  # the merged layers among them


@pytest.mark.parametrize(("bad", "said"), [({"strength_model": math.nan}, "finite"),
                                           ({"lora_name": "missing.safetensors"}, "not in list")])
def test_bad_inputs_fail_validation(engine, bad, said):
    g = with_lora(core_text_to_image("a fox", seed=1, steps=1, size=64))
    g["20"]["inputs"].update(bad)
    with pytest.raises(ValidationFailed) as e:
        engine.run(g)
    assert said in str(e.value.response)


def test_a_lora_for_another_model_names_node_and_file_and_the_next_prompt_runs(engine, lora_models):
    g = with_lora(core_text_to_image("a fox", seed=1, steps=1, size=64), name="klein9b.safetensors")
    with pytest.raises(NodeExecutionError) as e:
        engine.run(g)
    msg = str(e.value)
    assert "klein9b.safetensors" in msg and "9B" in msg and "20" in str(e.value.node_id)
    damaged = lora_models / "loras" / "damaged.safetensors"
    damaged.write_bytes((lora_models / "loras" / "style.safetensors").read_bytes()[:-64])
    try:
        with pytest.raises(ValidationFailed, match=r"ends before|damaged"):
            engine.run(with_lora(g, name="damaged.safetensors"))
    finally:
        damaged.unlink()
    ok = engine.run(with_lora(core_text_to_image("a fox", seed=1, steps=1, size=64)))
    assert ok.images and torch.isfinite(torch.from_numpy(pixels(ok.images[0]).astype(float))).all()


def test_cli_and_python_api_take_loras(lora_models, input_dir, tmp_path):
    from vramgraph.api.pipeline import Pipeline
    from vramgraph.cli.main import lora_arg
    from vramgraph.cli.session import Session

    assert lora_arg("a/b.safetensors:0.5") == ("a/b.safetensors", 0.5)
    assert lora_arg("C:/x/b.safetensors") == ("C:/x/b.safetensors", 1.0)
    outside = tmp_path / "mine" / "my lora.safetensors"  # a path outside the models folders
    shutil.copy(lora_models / "loras" / "style.safetensors", outside.parent.mkdir() or outside)
    pipe = Pipeline(lora_models, input=input_dir, output=tmp_path / "out", device="cpu")
    plain = pipe.generate("a fox", seed=2, width=64, height=64, steps=1)
    styled = pipe.generate("a fox", seed=2, width=64, height=64, steps=1,
                           loras=[(outside, 0.8), "sub/detail.safetensors"])
    assert not np.array_equal(np.asarray(plain.images[0]), np.asarray(styled.images[0]))
    kinds = [n["class_type"] for n in styled.prompt.values()]
    assert kinds.count("VGLoraLoader") == 2
    with pytest.raises(ValueError, match="finite"):
        pipe.generate("a fox", seed=2, width=64, height=64, steps=1, loras=[(outside, math.inf)])
    with pytest.raises(ValueError, match="no such file"):
        pipe.generate("a fox", seed=2, width=64, height=64, steps=1, loras=["./nowhere.safetensors"])
    said: list[str] = []
    session = Session(pipe, save_dir=tmp_path / "session")
    session.handle(f"!lora {outside}:0.5", said.append)
    assert session.loras == [(str(outside), 0.5)] and "1 LoRA(s)" in said[-1]
    with pytest.raises(ValueError, match="no such file"):
        session.handle("!lora /nowhere/x.safetensors", said.append)
