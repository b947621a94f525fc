"""End to end on tiny random-weight models written in all three checkpoint layouts: recognition from
headers, loading, and whole generations (text-to-image, batch of two prompts, two-reference edit,
CFG for base models) compared with diffusers' Flux2KleinPipeline on the same weights; the command
line writes PNGs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import qwen_tokenizer_dir, rel_l2, save
from PIL import Image
from refmodels import diffusers_transformer, diffusers_vae, transformer_to_bfl, transformers_qwen3, vae_to_bfl
from vramgraph.cli import main as cli
from vramgraph.models import loading
from vramgraph.models.headers import CheckpointError
from vramgraph.models.pipeline import generate, load_models
from vramgraph.models.sampling import noise

TOK_DIR = qwen_tokenizer_dir()
W, H = 64, 48


@pytest.fixture(scope="module")
def refs():
    return {"transformer": diffusers_transformer(seed=5), "text_encoder": transformers_qwen3(seed=6),
            "vae": diffusers_vae(seed=7)}


@pytest.fixture(scope="module")
def ckpts(refs, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    tr_bfl = transformer_to_bfl(refs["transformer"].state_dict())
    vae_bfl = vae_to_bfl(refs["vae"].state_dict(), 4)
    te_sd = {k: v for k, v in refs["text_encoder"].state_dict().items() if k != "lm_head.weight"}
    comfy = root / "comfy" / "models"
    save(tr_bfl, comfy / "diffusion_models" / "flux-2-klein-4b.safetensors")
    save(te_sd, comfy / "text_encoders" / "qwen_3_4b.safetensors")
    save(vae_bfl, comfy / "vae" / "flux2-vae.safetensors")
    bfl = root / "bfl"
    save({"model.diffusion_model." + k: v for k, v in tr_bfl.items()}, bfl / "flux-2-klein-4b.safetensors")
    save(vae_bfl, bfl / "ae.safetensors")
    hf = root / "hf" / "FLUX.2-klein-4B"
    refs["transformer"].save_pretrained(hf / "transformer", max_shard_size="3MB")
    refs["text_encoder"].save_pretrained(hf / "text_encoder", max_shard_size="10MB")
    refs["vae"].save_pretrained(hf / "vae")
    shutil.copytree(TOK_DIR, hf / "tokenizer")
    (hf / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline", "is_distilled": True}))
    return {"comfy": comfy, "bfl": bfl, "hf": hf, "te_file": comfy / "text_encoders" / "qwen_3_4b.safetensors"}


def _pipe(refs, distilled=True):
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen2TokenizerFast

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096,
                                            time_shift_type="exponential")
    pipe = Flux2KleinPipeline(scheduler=sched, vae=refs["vae"], text_encoder=refs["text_encoder"],
                              tokenizer=Qwen2TokenizerFast.from_pretrained(str(TOK_DIR)),
                              transformer=refs["transformer"], is_distilled=distilled)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _unit(pixels):
    return ((pixels.float() + 1) / 2).clamp(0, 1)


def test_inspect_all_layouts(ckpts):
    comfy = loading.inspect(ckpts["comfy"])
    assert comfy.variant == "custom" and comfy.distilled and comfy.distilled_from == "default"
    assert comfy.transformer.layout == comfy.vae.layout == "comfyui" and comfy.tokenizer is None
    hf = loading.inspect(ckpts["hf"])
    assert hf.transformer.layout == "hf" and len(hf.transformer.files) > 1
    assert hf.distilled_from == "model_index.json" and hf.tokenizer.name == "tokenizer.json"
    files = loading.inspect([ckpts["bfl"] / "flux-2-klein-4b.safetensors", ckpts["te_file"],
                             ckpts["bfl"] / "ae.safetensors"])
    for spec in (comfy, hf, files):
        tr = spec.transformer
        assert tr.config == comfy.transformer.config
        assert [b for b, _ in tr.block_params].count("shared") == 1
        assert sum(1 for b, _ in tr.block_params if b.startswith("double_blocks.")) == 1
        assert sum(1 for b, _ in tr.block_params if b.startswith("single_blocks.")) == 2
        # the text encoder file has 28 layers; only 27 are built, planned and loaded
        te = spec.text_encoder
        assert sum(1 for b, _ in te.block_params if b.startswith("layers.")) == 27
        assert te.nbytes(torch.float32) < te.file_bytes
        assert {b for b, _ in spec.vae.block_params} >= {"encoder", "decoder"}
    model = loading.load(comfy.transformer, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == comfy.transformer.params
    assert comfy.transformer.nbytes(torch.bfloat16) == comfy.transformer.params * 2


def test_inspect_errors(ckpts, tmp_path):
    shutil.copy(ckpts["comfy"] / "diffusion_models" / "flux-2-klein-4b.safetensors", tmp_path / "a.safetensors")
    shutil.copy(ckpts["comfy"] / "diffusion_models" / "flux-2-klein-4b.safetensors", tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="several transformer checkpoints"):
        loading.inspect(tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        loading.inspect(tmp_path / "missing.safetensors")
    save({"x": torch.zeros(3)}, tmp_path / "other" / "x.safetensors")
    with pytest.raises(CheckpointError, match=r"not a FLUX\.2 \[klein\] transformer, Qwen3 text encoder or "
                                              r"FLUX\.2 VAE; .*look like none of them"):
        loading.inspect(tmp_path / "other" / "x.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        loading.inspect(tmp_path / "bad.safetensors")


def test_distilled_from_metadata_and_name(ckpts, tmp_path):
    src = ckpts["comfy"] / "diffusion_models" / "flux-2-klein-4b.safetensors"
    from vramgraph.models.headers import read_header

    infos, _ = read_header(src)
    from safetensors.torch import load_file

    sd = load_file(src)
    save(sd, tmp_path / "m" / "x.safetensors", metadata={"modelspec.title": "FLUX.2 [klein] Base 4B"})
    assert loading.inspect(tmp_path / "m" / "x.safetensors").distilled is False
    shutil.copy(src, tmp_path / "flux-2-klein-base-4b.safetensors")
    spec = loading.inspect(tmp_path / "flux-2-klein-base-4b.safetensors")
    assert (spec.distilled, spec.distilled_from) == (False, "file name")
    assert len(infos) == 29


@pytest.mark.parametrize("layout", ["comfy", "hf"])
def test_text_to_image_matches_diffusers(refs, ckpts, layout):
    models = load_models(ckpts[layout], dtype=torch.float32)
    prompts = ["a red bicycle leaning on a brick wall in the rain", "fox"]
    got = generate(models, prompts, width=W, height=H, seed=3)
    want = _pipe(refs)(prompt=prompts, height=H, width=W, num_inference_steps=4, output_type="pt",
                       latents=noise(3, 2, H // 16, W // 16)).images
    assert got.shape == want.shape == (2, 3, H, W)
    assert rel_l2(_unit(got), want) < 1e-4
    # a different seed is a different image
    other = generate(models, prompts[:1], width=W, height=H, seed=4)
    assert rel_l2(_unit(other), want[:1]) > 1e-2


def _ref_images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (64, 80, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 255, (96, 64, 3), dtype=np.uint8))]


def test_edit_with_two_references_matches_diffusers(refs, ckpts):
    models = load_models(ckpts["comfy"], dtype=torch.float32)
    images = _ref_images()
    got = generate(models, "make it blue", width=W, height=H, seed=9, references=images)
    want = _pipe(refs)(prompt="make it blue", image=images, height=H, width=W, num_inference_steps=4,
                       output_type="pt", latents=noise(9, 1, H // 16, W // 16)).images
    assert rel_l2(_unit(got), want) < 1e-4
    plain = generate(models, "make it blue", width=W, height=H, seed=9)
    assert rel_l2(_unit(plain), want) > 1e-3  # the references matter


def test_base_model_cfg_matches_diffusers(refs, ckpts):
    models = load_models(ckpts["comfy"], dtype=torch.float32)
    models.distilled = False
    got = generate(models, "a castle", width=W, height=H, seed=1, steps=3, guidance=4.0)
    want = _pipe(refs, distilled=False)(prompt="a castle", height=H, width=W, num_inference_steps=3,
                                        guidance_scale=4.0, output_type="pt",
                                        latents=noise(1, 1, H // 16, W // 16)).images
    assert rel_l2(_unit(got), want) < 1e-4


def test_cli_writes_pngs(refs, ckpts, tmp_path, capsys):
    """`vramgraph generate` runs the shipped workflows through the engine; the PNG is diffusers' picture."""
    out = tmp_path / "t2i.png"
    assert cli(["generate", "--models", str(ckpts["comfy"]), "-p", "a boat", "-W", str(W), "-H", str(H),
                "-S", "5", "--dtype", "fp32", "-o", str(out)]) == 0
    img = Image.open(out)
    assert img.size == (W, H) and img.mode == "RGB"
    assert json.loads(img.text["prompt"])["4"]["inputs"]["text"] == "a boat" and img.text["seed"] == "5"
    want = _pipe(refs)(prompt="a boat", height=H, width=W, num_inference_steps=4, output_type="pt",
                       latents=noise(5, 1, H // 16, W // 16)).images[0]
    want = np.floor(want.permute(1, 2, 0).clamp(0, 1).numpy() * 255)  # ComfyUI's SaveImage truncates
    assert np.abs(np.asarray(img).astype(np.float64) - want).max() <= 1
    ref_args = []
    for i, im in enumerate(_ref_images()):
        ref_args += ["-i", str(tmp_path / f"ref{i}.png")]
        im.save(tmp_path / f"ref{i}.png")
    edit = tmp_path / "edit.png"
    assert cli(["generate", "--checkpoint", str(ckpts["hf"]), "-p", "a boat", "-W", str(W), "-H", str(H),
                "-S", "5", "-o", str(edit), *ref_args]) == 0
    assert Image.open(edit).size == (W, H)
    assert not np.array_equal(np.asarray(Image.open(edit)), np.asarray(img))
    assert cli(["inspect", str(ckpts["comfy"])]) == 0
    assert '"variant": "custom"' in capsys.readouterr().out
    assert cli(["generate", "--models", str(tmp_path / "nowhere"), "-p", "x", "-o", str(tmp_path / "n.png")]) == 1
    err = capsys.readouterr().err  # one line: the first node error, how many more, and why the list is empty
    assert err.count("\n") == 1 and "node 1 (VGLoadTransformer)" in err and "[value_not_in_list]" in err
    assert "nowhere does not exist" in err


def test_demo_runs_the_whole_path_on_tiny_models(tmp_path, capsys):
    assert cli(["demo", "--out", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out.split()
    out = tmp_path / "demo" / "output" / "vramgraph"
    assert printed == [str(out / "text_to_image_00001_.png"), str(out / "edit_00001_.png")]
    a, b = (np.asarray(Image.open(p)) for p in printed)
    assert a.shape == b.shape == (256, 256, 3) and a.std() > 1 and not np.array_equal(a, b)
    spec = loading.inspect(tmp_path / "demo" / "models" / "diffusion_models" / "flux-2-klein-4b.safetensors")
    assert spec.transformer.layout == "file"


def test_cli_refuses_a_missing_or_broken_reference(ckpts, tmp_path, capsys):
    (tmp_path / "broken.png").write_bytes(b"no image here")
    for ref in (tmp_path / "absent.png", tmp_path / "broken.png"):
        assert cli(["generate", "--models", str(ckpts["comfy"]), "-p", "x", "-i", str(ref), "-W", "64", "-H", "64",
                    "-o", str(tmp_path / "o.png")]) in (1, 2)
        assert str(ref) in capsys.readouterr().err
    assert not (tmp_path / "o.png").exists()
