"""Model specs from headers alone, at the real sizes: files whose headers describe the real FLUX.2-klein
tensors but hold no data (they could not be loaded; inspect must not need to)."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
from vramgraph.models import dtypes, flux2, loading, qwen3, vae
from vramgraph.models.headers import CheckpointError

GiB = 2**30


def header_only(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> Path:
    """A safetensors file with a true header for `shapes` and no tensor bytes after it."""
    t = dtypes.stored_torch_dtype(dtype)
    return header_of(path, {k: torch.empty(shape, dtype=t, device="meta") for k, shape in shapes.items()})


def header_of(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file with a true header for `tensors` (meta tensors: their shape and dtype) and `metadata`,
    whose data holds the bytes of the tensors that are not meta only (small ones a reader of headers needs, such as
    `.comfy_quant` markers; they come first, the meta tensors' bytes would follow)."""
    table: dict = {"__metadata__": metadata} if metadata else {}
    data, off = bytearray(), 0
    for k in sorted(tensors, key=lambda k: tensors[k].is_meta):
        t = tensors[k]
        n = t.numel() * t.element_size()
        table[k] = {"dtype": dtypes.stored_name(t.dtype, ""), "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
        if not t.is_meta:
            data += t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw = json.dumps(table).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def shapes_of(module: torch.nn.Module, prefix: str = "") -> dict[str, tuple[int, ...]]:
    return {prefix + n: tuple(t.shape) for n, t in {**dict(module.named_parameters()),
                                                    **dict(module.named_buffers())}.items()}


def real_shapes(tr_cfg: flux2.Flux2Config, te_cfg: qwen3.Qwen3Config, te_layers: int = 36):
    with torch.device("meta"):
        tr = shapes_of(flux2.Flux2Transformer(tr_cfg))
        full = qwen3.Qwen3Encoder(dataclasses.replace(te_cfg, output_layers=(te_layers,)))
        te = shapes_of(full, "model.")
        te["model.norm.weight"] = (te_cfg.hidden_size,)
        ae = shapes_of(vae.Flux2VAE(vae.VAEConfig()))
    return tr, te, ae


@pytest.mark.parametrize(("name", "tr_cfg", "te_cfg"), [("klein-4b", flux2.KLEIN_4B, qwen3.Qwen3Config()),
                                                       ("klein-9b", flux2.KLEIN_9B, qwen3.QWEN3_8B)])
def test_real_size_spec_from_headers_alone(tmp_path, name, tr_cfg, te_cfg):
    tr, te, ae = real_shapes(tr_cfg, te_cfg)
    models = tmp_path / "models"
    header_only(models / "diffusion_models" / "a.safetensors", {"model.diffusion_model." + k: v for k, v in tr.items()})
    header_only(models / "text_encoders" / "b.safetensors", te)
    header_only(models / "vae" / "c.safetensors", ae, dtype="F32")
    spec = loading.inspect(models)
    assert spec.variant == name and spec.distilled
    assert spec.transformer.config == tr_cfg and spec.text_encoder.config.hidden_size == te_cfg.hidden_size
    assert spec.text_encoder.config.num_layers == 36 and spec.text_encoder.config.n_built == 27
    assert spec.vae.dtype == "fp32" and spec.transformer.dtype == "bf16"
    blocks = spec.transformer.block_bytes(torch.bfloat16)
    assert len(blocks) == tr_cfg.depth_double + tr_cfg.depth_single + 1
    assert sum(blocks.values()) == spec.transformer.nbytes(torch.bfloat16)
    te_layers = [b for b in spec.text_encoder.block_bytes(torch.bfloat16) if b.startswith("layers.")]
    assert te_layers == [f"layers.{i}" for i in range(27)]
    if name == "klein-4b":
        # the figures in shared/reference: 7.22 GiB transformer, 5.80 GiB encoder (layers 0..26), VAE 84.0 M params
        assert spec.transformer.params == 3_875_544_576
        assert spec.transformer.nbytes(torch.bfloat16) / GiB == pytest.approx(7.219, abs=1e-3)
        assert spec.text_encoder.nbytes(torch.bfloat16) / GiB == pytest.approx(5.80, abs=5e-3)
        assert spec.text_encoder.file_bytes / GiB == pytest.approx(7.49, abs=1e-2)
        assert spec.vae.params == 84_046_115 + 2 * 128  # + the BatchNorm statistics
        assert spec.vae.block_params[[b for b, _ in spec.vae.block_params].index("decoder")][1] == 49_620_259


def test_mismatched_encoder_and_transformer(tmp_path):
    tr, _, _ = real_shapes(flux2.KLEIN_4B, qwen3.Qwen3Config())
    _, te9, _ = real_shapes(flux2.KLEIN_9B, qwen3.QWEN3_8B)
    header_only(tmp_path / "t.safetensors", tr)
    header_only(tmp_path / "q.safetensors", te9)
    with pytest.raises(CheckpointError, match="klein-4B pairs with Qwen3-4B"):
        loading.inspect([tmp_path / "t.safetensors", tmp_path / "q.safetensors"])


def test_picks_ours_out_of_a_full_comfyui_folder(tmp_path):
    """A ComfyUI models/ folder also holds FLUX.1, SD VAEs and other text encoders: ours are found by their
    tensors, and of two Qwen3 sizes the one the transformer reads is taken."""
    tr, te4, ae = real_shapes(flux2.KLEIN_4B, qwen3.Qwen3Config())
    _, te8, _ = real_shapes(flux2.KLEIN_9B, qwen3.QWEN3_8B)
    m = tmp_path / "models"
    header_only(m / "diffusion_models" / "flux-2-klein-4b.safetensors", tr)
    flux1 = {"img_in.weight": (3072, 64), "txt_in.weight": (3072, 4096),
             "double_blocks.0.img_attn.qkv.weight": (9216, 3072)}
    header_only(m / "diffusion_models" / "flux1-dev.safetensors", flux1)
    header_only(m / "unet" / "flux-2-dev.safetensors", {**tr, "guidance_in.in_layer.weight": (3072, 256)})
    header_only(m / "text_encoders" / "qwen_3_4b.safetensors", te4)
    header_only(m / "text_encoders" / "qwen_3_8b.safetensors", te8)
    qwen25 = {k: v for k, v in te4.items() if "norm.weight" not in k or "layernorm" in k}
    header_only(m / "text_encoders" / "qwen_2.5_vl_7b.safetensors", qwen25)
    header_only(m / "vae" / "flux2" / "flux2-vae.safetensors", ae)  # users sort models into subfolders
    header_only(m / "vae" / "ae.safetensors", {k: v for k, v in ae.items() if not k.startswith("bn.")})
    header_only(m / "vae" / "sdxl_vae.safetensors", {"decoder.conv_in.weight": (512, 4, 3, 3)})
    spec = loading.inspect(m)
    assert spec.transformer.files[0].name == "flux-2-klein-4b.safetensors"
    assert spec.text_encoder.files[0].name == "qwen_3_4b.safetensors"
    assert spec.vae.files[0] == m / "vae" / "flux2" / "flux2-vae.safetensors"
    for name, what in (("diffusion_models/flux1-dev", "a FLUX.1-style transformer"),
                       ("unet/flux-2-dev", r"FLUX\.2 \[dev\]"), ("vae/ae", "a VAE without FLUX.2's latent statistics"),
                       ("text_encoders/qwen_2.5_vl_7b", "without q_norm")):
        with pytest.raises(CheckpointError, match=what):
            loading.inspect(m / f"{name}.safetensors")
    header_only(m / "diffusion_models" / "flux-2-klein-4b-copy.safetensors", tr)
    with pytest.raises(CheckpointError, match=r"several transformer checkpoints found .* pass the one you mean"):
        loading.inspect(m)


# ---------------------------------------------------------------------------------------------------------------
# Parameter shapes without torch: what sizes a plan and names a checkpoint's tensors must equal the built modules.

TINY_DIT = dataclasses.replace(flux2.KLEIN_4B, hidden=64, heads=2, head_dim=32, depth_double=1, depth_single=2,
                               context_dim=96, in_channels=16)
TINY_VAE = dataclasses.replace(vae.VAEConfig(), channels=(32, 64), layers_per_block=1, norm_groups=8)


def _built(make: object) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        module = make()  # type: ignore[operator]
    return [(n, tuple(t.shape)) for n, t in [*module.named_parameters(), *module.named_buffers()]]


@pytest.mark.parametrize("cfg", [flux2.KLEIN_4B, flux2.KLEIN_9B, TINY_DIT], ids=["4b", "9b", "tiny"])
def test_transformer_parameter_shapes_are_the_modules(cfg: flux2.Flux2Config) -> None:
    assert list(flux2.parameter_shapes(cfg).items()) == _built(lambda: flux2.Flux2Transformer(cfg))


@pytest.mark.parametrize("cfg", [qwen3.Qwen3Config(), qwen3.QWEN3_8B], ids=["4b", "8b"])
def test_text_encoder_parameter_shapes_are_the_modules(cfg: qwen3.Qwen3Config) -> None:
    assert list(qwen3.parameter_shapes(cfg).items()) == _built(lambda: qwen3.Qwen3Encoder(cfg))


@pytest.mark.parametrize("parts", [("encoder", "decoder"), ("decoder",), ("encoder",)])
@pytest.mark.parametrize("cfg", [vae.VAEConfig(), TINY_VAE], ids=["real", "tiny"])
def test_vae_parameter_shapes_are_the_modules(cfg: vae.VAEConfig, parts: tuple[str, ...]) -> None:
    assert list(vae.parameter_shapes(cfg, parts).items()) == _built(lambda: vae.Flux2VAE(cfg, parts))


def test_one_dtype_table() -> None:
    from vramgraph.models import dtypes

    assert [dtypes.itemsize(n) for n in ("bf16", "fp16", "fp32")] == [2, 2, 4]
    assert dtypes.itemsize(torch.bfloat16) == 2
    assert [dtypes.torch_dtype(n) for n in ("bf16", "fp16", "fp32")] == [torch.bfloat16, torch.float16, torch.float32]
    assert dtypes.compute_name("BF16") == "bf16" and dtypes.compute_name("F8_E4M3") == "f8_e4m3"
    assert dtypes.stored_name(torch.float16) == "F16" and dtypes.stored_torch_dtype("I64") == torch.int64
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dtypes.itemsize("fp8")
