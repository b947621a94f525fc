"""The FLUX.2 small decoder (BFL's FLUX.2-small-decoder, `full_encoder_small_decoder.safetensors`): the FLUX.2 VAE's
encoder with a distilled decoder 0.75x as wide at every level, fp32 weights.

Its decoder widths come from the header (ComfyUI's rule: `decoder.conv_in.weight.shape[0] // ch_mult[-1]` times the
encoder's level multipliers). The reference is diffusers' AutoencoderKLFlux2 built with `decoder_block_out_channels`;
a tiny one is written in each layout we load (the BFL/ComfyUI single file, converted by tests/refmodels.py's own key
map, and diffusers' `vae/` folder) and loaded through the real header-reading path. Its memory estimate follows its
own widths: the decode activation scales with the decoder's full-resolution width (96 against 128: 0.75x).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLFlux2
from helpers import perturb_, rel_l2, save
from refmodels import vae_to_bfl
from test_loading import header_only
from vramgraph.models import loading
from vramgraph.models.headers import CheckpointError, read_headers
from vramgraph.models.tiny import TINY_SMALL_DECODER_VAE as TINY
from vramgraph.models.vae import Flux2VAE, config_from_checkpoint, load_vae
from vramgraph.models.vae_config import SMALL_DECODER, VAEConfig
from vramgraph.nodes import estimates
from vramgraph.nodes.types import LatentInfo, ModelInfo

TOL = 1e-4
WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"


def diffusers_small(seed: int = 0, **kw: object) -> AutoencoderKLFlux2:
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=TINY.channels, decoder_block_out_channels=TINY.decoder_channels,
                             layers_per_block=TINY.layers_per_block, **kw).eval()
    perturb_(vae, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape, generator=g))
    vae.bn.running_var.copy_(0.3 + 2 * torch.rand(vae.bn.running_var.shape, generator=g))
    return vae.requires_grad_(False)


@pytest.fixture(scope="module")
def ref() -> AutoencoderKLFlux2:
    return diffusers_small()


@pytest.fixture(scope="module")
def files(ref: AutoencoderKLFlux2, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("small")
    ref.save_pretrained(root / "hf" / "vae")
    sd = {k: v for k, v in ref.state_dict().items() if k != "bn.num_batches_tracked"}
    return {"diffusers": root / "hf" / "vae" / "diffusion_pytorch_model.safetensors",
            "bfl": save(vae_to_bfl(sd, len(TINY.channels)), root / "vae" / "full_encoder_small_decoder.safetensors")}


def _load(path: Path, **kw: object) -> Flux2VAE:
    infos = read_headers([path])
    return load_vae(infos, config_from_checkpoint(infos), dtype=torch.float32, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_widths_from_the_header(files: dict[str, Path], layout: str) -> None:
    infos = read_headers([files[layout]])
    cfg = config_from_checkpoint(infos)
    assert cfg == TINY and cfg.decoder_widths == (32, 32, 64, 64) and cfg.channels == (64, 64, 128, 128)
    spec = loading.inspect([files[layout]])
    assert spec.vae is not None and spec.vae.config == TINY and spec.vae.dtype == "fp32"
    # the decoder half alone (the planner may load only it) is the narrow one
    half = {k: v for k, v in infos.items() if not k.startswith(("encoder.", "quant_conv."))}
    assert config_from_checkpoint(half).channels == (32, 32, 64, 64)


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
@torch.no_grad()
def test_decodes_and_encodes_as_diffusers(ref: AutoencoderKLFlux2, files: dict[str, Path], layout: str) -> None:
    vae = _load(files[layout])
    g = torch.Generator().manual_seed(5)
    z = torch.randn(1, TINY.latent_channels, 8, 8, generator=g)
    want = ref.decode(z).sample
    got = vae.decode_unpacked(z)
    assert got.shape == want.shape == (1, 3, 64, 64)
    assert rel_l2(got, want) < TOL
    image = torch.rand(1, 3, 64, 64, generator=g) * 2 - 1
    assert rel_l2(vae.encode_moments_mean(image), ref.encode(image).latent_dist.mode()) < TOL
    # the decoder alone (what the planner loads for a decode) gives the same pixels
    dec = _load(files[layout], parts=("decoder",))
    packed = torch.randn(1, TINY.packed_channels, 4, 4, generator=g)
    assert rel_l2(dec.decode(packed), vae.decode(packed)) < 1e-6


def test_full_size_file_from_the_header_alone(tmp_path: Path) -> None:
    """BFL's file at its real shapes (no data): 62.4 M fp32 parameters, a 27.9 M decoder (BFL's card: ~28 M against
    ~50 M)."""
    with torch.device("meta"):
        theirs = AutoencoderKLFlux2(decoder_block_out_channels=(96, 192, 384, 384))
    shapes = {k: tuple(v.shape) for k, v in vae_to_bfl(theirs.state_dict(), 4).items() if k != "bn.num_batches_tracked"}
    path = header_only(tmp_path / "vae" / "full_encoder_small_decoder.safetensors", shapes, "F32")
    spec = loading.inspect([path]).vae
    assert spec is not None and spec.config == SMALL_DECODER and spec.dtype == "fp32"
    assert spec.config.decoder_widths == (96, 192, 384, 384) and spec.config.channels == (128, 256, 512, 512)
    blocks = dict(spec.block_params)
    assert spec.params == 62_373_091 + 2 * 128 and blocks["decoder"] == 27_947_235
    assert spec.file_bytes == 4 * spec.params  # fp32
    with torch.device("meta"):
        assert sum(p.numel() for p in Flux2VAE(SMALL_DECODER).parameters()) == 62_373_091


def test_a_decoder_off_the_rule_is_refused(tmp_path: Path) -> None:
    """ComfyUI builds a narrower decoder from one base width times the encoder's multipliers; anything else is not a
    FLUX.2 VAE it (or we) would load."""
    with torch.device("meta"):
        odd = AutoencoderKLFlux2(block_out_channels=(64, 64, 128, 128), decoder_block_out_channels=(32, 64, 64, 64),
                                 layers_per_block=1)
    shapes = {k: tuple(v.shape) for k, v in vae_to_bfl(odd.state_dict(), 4).items() if k != "bn.num_batches_tracked"}
    infos = read_headers([header_only(tmp_path / "odd.safetensors", shapes, "F32")])
    with pytest.raises(CheckpointError, match=r"decoder levels \(32, 64, 64, 64\) are not the encoder's"):
        config_from_checkpoint(infos)


def _vae_info(cfg: VAEConfig, name: str) -> ModelInfo:
    return ModelInfo(f"vae:{name}:bf16", "vae", "vae", 0, cfg)


def test_decode_estimate_follows_the_decoder_width() -> None:
    """Decode activation = VAE_DECODE_PER_PIXEL * pixels * width * item + fixed, width the decoder's full-resolution
    level: the small decoder's 96 gives 0.75x the full decoder's (1.33x less); encode (the same encoder) is
    unchanged."""
    full, small = _vae_info(VAEConfig(), "flux2-vae"), _vae_info(SMALL_DECODER, "full_encoder_small_decoder")
    for side in (1024, 2048):
        lat = LatentInfo(1, side // 16, side // 16)
        f, s = ({v.name: v.activation for v in estimates.vae_decode(m, lat)} for m in (full, small))
        pixels = side * side
        fixed = estimates.MARGIN * estimates.VAE_DECODE_FIXED
        assert (s["gpu"] - fixed) / (f["gpu"] - fixed) == pytest.approx(0.75, rel=1e-5)
        assert f["gpu"] / s["gpu"] == pytest.approx(1 / 0.75, rel=1e-3)
        assert s["gpu"] == pytest.approx(estimates.MARGIN * (estimates.VAE_DECODE_PER_PIXEL * pixels * 96 * 2
                                                             + estimates.VAE_DECODE_FIXED), rel=1e-6)
        if side > 1024:
            assert s["tiled"] < f["tiled"]
    assert estimates.vae_encode(small, 1, 1024, 1024).activation == estimates.vae_encode(full, 1, 1024, 1024).activation


def _header_models(root: Path) -> Path:
    """A ComfyUI models/ folder of header-only full-size files: klein-4B, Qwen3-4B, both VAEs."""
    from test_loading import real_shapes
    from vramgraph.models import flux2, qwen3

    tr, te, ae = real_shapes(flux2.KLEIN_4B, qwen3.Qwen3Config())
    header_only(root / "diffusion_models" / "flux-2-klein-4b.safetensors", tr)
    header_only(root / "text_encoders" / "qwen_3_4b.safetensors", te)
    header_only(root / "vae" / "flux2-vae.safetensors", ae, "F32")
    with torch.device("meta"):
        small = Flux2VAE(SMALL_DECODER)
    header_only(root / "vae" / "full_encoder_small_decoder.safetensors",
                {k: tuple(v.shape) for k, v in small.state_dict().items()}, "F32")
    return root


def test_the_planner_sees_the_smaller_decode(tmp_path: Path) -> None:
    """Planned from header-only full-size files at 2048²: with the small decoder the decode fits beside the resident
    transformer on a card where the full decoder's does not (the full one is tiled or evicts the transformer)."""
    from vramgraph.api.pipeline import Pipeline

    models = _header_models(tmp_path / "models")
    wf = json.loads((WORKFLOWS / "text_to_image.json").read_text())
    vae_node = next(k for k, n in wf.items() if n["class_type"] in ("VAELoader", "VGLoadVAE")
                    and any(str(v).endswith("flux2-vae.safetensors") for v in n["inputs"].values()))
    vae_input = next(k for k, v in wf[vae_node]["inputs"].items() if str(v).endswith(".safetensors"))
    pipe = Pipeline(models=models, vram="80GiB", host="64GiB")  # (not this machine's free RAM: see test_cli)
    plans = {}
    for name in ("flux2-vae.safetensors", "full_encoder_small_decoder.safetensors"):
        plans[name] = pipe.plan(wf, vram="80GiB", size="2048x2048", set={f"{vae_node}.{vae_input}": name})
    full, small = plans["flux2-vae.safetensors"], plans["full_encoder_small_decoder.safetensors"]
    decode = next(n for n, c in full.classes.items() if c in ("VAEDecode", "VGVAEDecode"))

    def run_step(plan):
        return next(s for s in plan.steps if s.step.kind == "run" and s.step.node == decode)

    f, s = run_step(full), run_step(small)
    assert f.step.variant == s.step.variant == "gpu"  # 80 GiB: everything fits
    act_full = f.gpu_bytes - sum(full.models[m].nbytes for m in f.resident)
    act_small = s.gpu_bytes - sum(small.models[m].nbytes for m in s.resident)
    assert act_small / act_full == pytest.approx(0.75, rel=1e-3)
    # a card with room for the transformer, the VAE and the small decode, not the full decode
    tr = next(m for m in full.models if m.startswith("transformer:"))
    card = full.models[tr].nbytes + max(full.models[m].nbytes for m in full.models if m.startswith("vae:"))
    card += (act_small + act_full) // 2 + (80 * 2**30 - full.budget.gpu)  # what the 80 GiB budget kept back
    full_c = pipe.plan(wf, vram=card, size="2048x2048", set={f"{vae_node}.{vae_input}": "flux2-vae.safetensors"})
    small_c = pipe.plan(wf, vram=card, size="2048x2048",
                        set={f"{vae_node}.{vae_input}": "full_encoder_small_decoder.safetensors"})
    fs, ss = run_step(full_c), run_step(small_c)
    assert ss.step.variant == "gpu" and any(m.startswith("transformer:") for m in ss.resident)
    # the full decode does not fit beside the transformer: it runs on the GPU once the transformer has left
    assert fs.step.variant == "gpu" and sorted(m.split(":")[0] for m in fs.resident) == ["text_encoder", "vae"]


def test_tiny_writer_small_decoder(tmp_path: Path) -> None:
    """models/tiny.py writes a small-decoder VAE when asked, under the template's name, recognised from its header."""
    from vramgraph.models.tiny import write_tiny_models

    models = write_tiny_models(tmp_path / "models", names={"small_decoder": ["full_encoder_small_decoder.safetensors"]})
    infos = read_headers([models / "vae" / "full_encoder_small_decoder.safetensors"])
    assert config_from_checkpoint(infos) == TINY
    assert dataclasses.replace(TINY, decoder_channels=()) != TINY
