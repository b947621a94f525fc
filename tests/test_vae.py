"""FLUX.2 VAE: loading both checkpoint layouts and matching diffusers' AutoencoderKLFlux2 and pipeline math.

A tiny random diffusers VAE is written to disk twice, as a diffusers `vae/` folder and as a BFL single
file (converted here by a key map of this file's own, independent of the package's), and each is loaded
through the real header-reading and loading path.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKLFlux2
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from helpers import perturb_, rel_l2, save
from refmodels import vae_to_bfl as bfl_from_diffusers
from vramgraph.models.headers import CheckpointError, read_headers
from vramgraph.models.vae import Flux2VAE, VAEConfig, config_from_checkpoint, group_norm, load_vae, sources

TINY = dataclasses.replace(VAEConfig(), channels=(32, 32, 64, 64), layers_per_block=1)
TOL = 1e-4
@pytest.fixture(scope="module")
def ref() -> AutoencoderKLFlux2:
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(block_out_channels=TINY.channels, layers_per_block=TINY.layers_per_block).eval()
    perturb_(vae, seed=1)
    g = torch.Generator().manual_seed(2)
    vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape, generator=g))
    vae.bn.running_var.copy_(0.3 + 2 * torch.rand(vae.bn.running_var.shape, generator=g))
    return vae.requires_grad_(False)


@pytest.fixture(scope="module")
def files(ref: AutoencoderKLFlux2, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vae")
    ref.save_pretrained(root / "vae")
    sd = ref.state_dict()
    n = len(TINY.channels)
    return {
        "diffusers": root / "vae" / "diffusion_pytorch_model.safetensors",
        "bfl": save(bfl_from_diffusers(sd, n), root / "flux2-vae.safetensors"),
        "bfl_unreversed": save(bfl_from_diffusers(sd, n, reverse_up=False), root / "unreversed.safetensors"),
        "bfl_swapped": save(bfl_from_diffusers(sd, n, swap_up=(2, 3)), root / "swapped.safetensors"),
    }


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"z": torch.randn(1, TINY.latent_channels, 8, 8, generator=g),
            "image": torch.rand(2, 3, 64, 64, generator=g) * 2 - 1,
            "packed": torch.randn(2, TINY.packed_channels, 4, 4, generator=g)}


def _load(path: Path, **kw: object) -> Flux2VAE:
    infos = read_headers([path])
    return load_vae(infos, config_from_checkpoint(infos), dtype=torch.float32, **kw)  # type: ignore[arg-type]


def test_default_config_is_the_released_vae() -> None:
    with torch.device("meta"):
        ours, dec = Flux2VAE(VAEConfig()), Flux2VAE(VAEConfig(), parts=("decoder",))
        theirs = AutoencoderKLFlux2()
    assert sum(p.numel() for p in ours.parameters()) == 84_046_115
    assert sum(p.numel() for p in dec.parameters()) == 49_620_259
    want = bfl_from_diffusers(theirs.state_dict(), 4)
    want.pop("bn.num_batches_tracked")
    got = ours.state_dict()
    assert sorted(got) == sorted(want)
    assert all(got[k].shape == want[k].shape for k in got)


@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
def test_config_from_checkpoint(files: dict[str, Path], layout: str) -> None:
    infos = read_headers([files[layout]])
    assert config_from_checkpoint(infos) == TINY
    for side in ("encoder.", "decoder."):  # one half alone (plus the latent statistics) is enough
        half = {k: v for k, v in infos.items() if k.startswith((side, "bn."))}
        assert config_from_checkpoint(half) == TINY


@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
@torch.no_grad()
def test_raw_encode_decode_match_diffusers(ref: AutoencoderKLFlux2, files: dict[str, Path],
                                           inputs: dict[str, torch.Tensor], layout: str) -> None:
    vae = _load(files[layout])
    z, image = inputs["z"], inputs["image"]
    want = ref.decode(z).sample
    got = vae.decode_unpacked(z)
    assert got.shape == (1, 3, 64, 64)
    assert rel_l2(got, want) < TOL
    want = ref.encode(image).latent_dist.mode()
    got = vae.encode_moments_mean(image)
    assert got.shape == (2, TINY.latent_channels, 8, 8)
    assert rel_l2(got, want) < TOL


@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
@torch.no_grad()
def test_packed_path_matches_pipeline(ref: AutoencoderKLFlux2, files: dict[str, Path],
                                      inputs: dict[str, torch.Tensor], layout: str) -> None:
    vae = _load(files[layout])
    image, packed = inputs["image"], inputs["packed"]
    # the pipeline's own reference-image encode, run on the reference VAE
    pipe = SimpleNamespace(vae=ref, _patchify_latents=Flux2KleinPipeline._patchify_latents)
    want = Flux2KleinPipeline._encode_vae_image(pipe, image, None)
    got = vae.encode(image)
    assert got.shape == (2, TINY.packed_channels, 4, 4)
    assert rel_l2(got, want) < TOL
    # the decode tail of Flux2KleinPipeline.__call__
    mean = ref.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps)
    want = ref.decode(Flux2KleinPipeline._unpatchify_latents(packed * std + mean), return_dict=False)[0]
    got = vae.decode(packed)
    assert got.shape == (2, 3, 64, 64)
    assert rel_l2(got, want) < TOL
    assert rel_l2(vae.pack(vae.unpack(packed)), packed) < 1e-6


@torch.no_grad()
def test_decoder_only(files: dict[str, Path], inputs: dict[str, torch.Tensor], tmp_path: Path) -> None:
    full = _load(files["bfl"])
    infos = read_headers([files["bfl"]])
    dec = load_vae(infos, parts=("decoder",), dtype=torch.float32)
    names = [n for n, _ in dec.named_parameters()]
    assert names and not any(n.startswith("encoder.") for n in names)
    assert dec.encoder is None
    assert rel_l2(dec.decode(inputs["packed"]), full.decode(inputs["packed"])) < 1e-6
    with pytest.raises(RuntimeError, match="without its encoder"):
        dec.encode(inputs["image"])
    # a file holding only the decoder half (diffusers naming) loads too
    from safetensors.torch import load_file

    sd = load_file(str(files["diffusers"]))
    half = save({k: v for k, v in sd.items() if not k.startswith(("encoder.", "quant_conv."))}, tmp_path / "d.st")
    dec2 = _load(half, parts=("decoder",))
    assert rel_l2(dec2.decode(inputs["packed"]), full.decode(inputs["packed"])) < 1e-6
    with pytest.raises(CheckpointError, match="lacks"):
        _load(half)  # the encoder is asked for but absent


def test_not_a_vae_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    other = save({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2),
                  "img_in.weight": torch.zeros(2, 4)}, tmp_path / "transformer.safetensors")
    with pytest.raises(CheckpointError, match=r"not a FLUX\.2 VAE"):
        config_from_checkpoint(read_headers([other]))
    with pytest.raises(CheckpointError, match=r"not a FLUX\.2 VAE"):
        sources(TINY, read_headers([other]).keys())
    infos = read_headers([files["bfl"]])
    flux1 = {k: v for k, v in infos.items() if not k.startswith("bn.")}  # an older VAE has no latent stats
    with pytest.raises(CheckpointError, match=r"bn\.running_mean"):
        config_from_checkpoint(flux1)
    holed = {k: v for k, v in infos.items() if k != "decoder.up.1.block.0.conv2.weight"}
    with pytest.raises(CheckpointError, match=r"decoder\.up\.1\.block\.0\.conv2\.weight"):
        load_vae(holed, TINY, dtype=torch.float32)


@torch.no_grad()
def test_up_block_order_matters(ref: AutoencoderKLFlux2, files: dict[str, Path],
                                inputs: dict[str, torch.Tensor]) -> None:
    """The reversal of up blocks between layouts is load-bearing: getting it wrong is caught."""
    with pytest.raises(CheckpointError):  # diffusers' indices taken as BFL ones: shapes do not fit
        _load(files["bfl_unreversed"])
    vae = _load(files["bfl_swapped"])  # two equal-width up levels exchanged: loads, but decodes wrongly
    z = inputs["z"]
    assert rel_l2(vae.decode_unpacked(z), ref.decode(z).sample) > 0.05


@torch.no_grad()
def test_fast_group_norm_matches_torch() -> None:
    """The large-group path (used on big images) computes GroupNorm: fp32 and bf16, batch of 2."""
    norm = torch.nn.GroupNorm(8, 32, 1e-6).requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    norm.weight.copy_(torch.randn(32, generator=g))
    norm.bias.copy_(torch.randn(32, generator=g))
    x = torch.randn(2, 32, 16, 16, generator=g) * 3 + 2
    assert rel_l2(group_norm(x, norm, min_group=1), norm(x)) < 1e-6
    xb, nb = x.bfloat16(), torch.nn.GroupNorm(8, 32, 1e-6).bfloat16().requires_grad_(False)
    nb.load_state_dict(norm.state_dict())
    got = group_norm(xb, nb, min_group=1)
    assert got.dtype == torch.bfloat16
    assert rel_l2(got, norm(x)) < 1e-2
