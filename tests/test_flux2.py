"""FLUX.2 transformer: numerical equivalence with diffusers' Flux2Transformer2DModel on identical random
weights, loaded from real safetensors files in BFL (with and without prefix) and diffusers layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import rel_l2, save
from refmodels import diffusers_transformer, transformer_to_bfl
from vramgraph.models import flux2
from vramgraph.models.headers import CheckpointError, read_header, read_headers, strip_prefix


@pytest.fixture(scope="module")
def reference():
    return diffusers_transformer(seed=3)


@pytest.fixture(scope="module")
def files(reference, tmp_path_factory):
    d = tmp_path_factory.mktemp("flux2")
    bfl = transformer_to_bfl(reference.state_dict())
    save(bfl, d / "bfl.safetensors")
    save({"model.diffusion_model." + k: v for k, v in bfl.items()}, d / "bfl_prefixed.safetensors")
    reference.save_pretrained(d / "hf", max_shard_size="3MB")
    return d


def _load(files, layout, dtype=torch.float32):
    if layout == "hf":
        infos = read_headers(sorted((files / "hf").glob("*.safetensors")))
    else:
        infos = strip_prefix(read_header(files / f"{layout}.safetensors")[0], flux2.BFL_PREFIXES)
    return flux2.load_transformer(infos, dtype=dtype)


def _inputs(batch=2, h=4, w=6, txt=24, refs=((3, 3), (2, 5)), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, h * w, 128, generator=g)
    ref_tokens = [torch.randn(batch, rh * rw, 128, generator=g) for rh, rw in refs]
    # two prompts of different lengths: the second one's tail is padding-like (zeros), as a batch would be
    ctx = torch.randn(batch, txt, 192, generator=g)
    ctx[1, txt // 2:] = 0.05
    ids = torch.cat([flux2.image_ids(h, w)] +
                    [flux2.image_ids(rh, rw, 10 * (i + 1)) for i, (rh, rw) in enumerate(refs)])
    return torch.cat([x, *ref_tokens], 1), ctx, ids, h * w


def _reference_out(ref, img, ctx, ids, n, sigma):
    b = img.shape[0]
    with torch.no_grad():
        return ref(hidden_states=img, encoder_hidden_states=ctx, timestep=sigma, guidance=None, return_dict=False,
                   img_ids=ids[None].expand(b, -1, -1), txt_ids=flux2.text_ids(ctx.shape[1])[None].expand(b, -1, -1),
                   )[0][:, :n]


def ours_and_reference(model, reference, sigma, refs=None):
    """Our model's and the diffusers reference's outputs on the same random inputs (`refs`: _inputs' references)."""
    img, ctx, ids, n = _inputs() if refs is None else _inputs(refs=refs)
    want = _reference_out(reference, img, ctx, ids, n, sigma)
    rope = flux2.rope_table(model.cfg, torch.cat([flux2.text_ids(ctx.shape[1]), ids]))
    with torch.no_grad():
        got = model(img, ctx, sigma, rope, n)
    return got, want, n


@pytest.mark.parametrize("layout", ["bfl", "bfl_prefixed", "hf"])
def test_matches_diffusers_with_two_references(reference, files, layout):
    model = _load(files, layout)
    got, want, n = ours_and_reference(model, reference, torch.tensor([0.9, 0.35]))
    assert got.shape == want.shape == (2, n, 128)
    assert rel_l2(got, want) < 1e-4


def test_config_inferred_from_headers(files):
    infos = read_headers(sorted((files / "hf").glob("*.safetensors")))
    cfg = flux2.config_from_checkpoint(infos)
    assert cfg == dataclasses.replace(flux2.KLEIN_4B, hidden=256, heads=2, depth_double=1, depth_single=2,
                                      context_dim=192)
    assert flux2.variant_name(cfg) == "custom"
    assert flux2.variant_name(flux2.KLEIN_9B) == "klein-9b"


def test_param_count_of_real_klein_4b():
    with torch.device("meta"):
        model = flux2.Flux2Transformer(flux2.KLEIN_4B)
    assert sum(p.numel() for p in model.parameters()) == 3_875_544_576


def test_swapped_final_halves_would_be_caught(reference, files):
    """Loading the diffusers final layer without swapping its halves must give a different result."""
    model = _load(files, "bfl")
    img, ctx, ids, n = _inputs()
    sigma = torch.tensor([0.5, 0.5])
    rope = flux2.rope_table(model.cfg, torch.cat([flux2.text_ids(ctx.shape[1]), ids]))
    w = model.final_layer.adaLN_modulation[1].weight
    with torch.no_grad():
        good = model(img, ctx, sigma, rope, n)
        w.copy_(torch.cat(w.chunk(2)[::-1]))
        bad = model(img, ctx, sigma, rope, n)
    assert rel_l2(bad, good) > 1e-2


def test_bf16_load_and_forward(reference, files):
    model = _load(files, "hf", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    got, want, _ = ours_and_reference(model, reference, torch.tensor([0.7, 0.2]), refs=())
    assert rel_l2(got.float(), want) < 3e-2


def test_missing_tensor_is_a_clear_error(files):
    infos = strip_prefix(read_header(files / "bfl.safetensors")[0], flux2.BFL_PREFIXES)
    infos.pop("single_blocks.1.linear2.weight")
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors.*single_blocks\.1\.linear2\.weight"):
        flux2.load_transformer(infos)


def test_not_a_transformer(tmp_path):
    save({"foo.weight": torch.zeros(2, 2)}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match=r"not a FLUX\.2 transformer"):
        flux2.config_from_checkpoint(read_header(tmp_path / "x.safetensors")[0])


def test_rope_rotates_adjacent_pairs():
    """Position (0, 0, 0, 1) rotates dims (96, 97) by angle 1 (first pair of the 4th axis) and leaves axis 0."""
    table = flux2.rope_table(flux2.KLEIN_4B, torch.tensor([[0, 0, 0, 1]]))
    x = torch.zeros(1, 1, 1, 128)
    x[..., 96] = 1.0
    x[..., 0] = 1.0
    y = flux2.apply_rope(x, table)
    assert torch.allclose(y[0, 0, 0, 96:98], torch.tensor([torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))]))
    assert y[0, 0, 0, 0] == 1.0 and y[0, 0, 0, 1] == 0.0


def test_quantised_checkpoint_is_refused(files, tmp_path):
    """An int8 weight no marking explains, cast without its scales, would give a wrong image: it must be refused,
    by name (fp8 checkpoints are tested in tests/test_fp8.py)."""
    from safetensors.torch import load_file
    from vramgraph.models import loading

    sd = load_file(files / "bfl.safetensors")
    sd["double_blocks.0.img_attn.qkv.weight"] = sd["double_blocks.0.img_attn.qkv.weight"].to(torch.int8)
    save(sd, tmp_path / "int8.safetensors")
    with pytest.raises(CheckpointError, match=r"img_attn\.qkv\.weight in int8\.safetensors is stored as I8 and is "
                                              "not marked"):
        loading.inspect(tmp_path / "int8.safetensors")
    with pytest.raises(CheckpointError, match="is not marked as a quantised layer vramgraph runs"):
        flux2.load_transformer(read_header(tmp_path / "int8.safetensors")[0])
