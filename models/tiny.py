"""Tiny random-weight models for the demo and the tests.

Writes tiny random-weight models shaped like FLUX.2 [klein] (transformer, Qwen3 encoder, VAE) as a
ComfyUI `models/` folder with the real key names, so that the loaders recognise and run them exactly as
they do real checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .flux2_config import KLEIN_4B
from .qwen3_config import Qwen3Config
from .vae_config import VAEConfig

TINY_QWEN3 = dataclasses.replace(Qwen3Config(), hidden_size=64, intermediate_size=128, num_layers=27, num_heads=4,
                                 num_kv_heads=2, head_dim=16)
TINY_TRANSFORMER = dataclasses.replace(KLEIN_4B, hidden=256, heads=2, depth_double=1, depth_single=2,
                                       context_dim=TINY_QWEN3.out_dim)
TINY_VAE = dataclasses.replace(VAEConfig(), channels=(32, 32, 64, 64), layers_per_block=1)
# A tiny FLUX.2 small decoder (full_encoder_small_decoder.safetensors): a decoder narrower than its encoder by one
# factor per level, as ComfyUI derives it from the header. The GroupNorm's 32 groups need widths in multiples of 32,
# so the tiny encoder is twice TINY_VAE's and the decoder half of it (the real one: 0.75, 96 against 128).
TINY_SMALL_DECODER_VAE = dataclasses.replace(TINY_VAE, channels=(64, 64, 128, 128), decoder_channels=(32, 32, 64, 64))


TINY_NAMES = {"transformer": "flux-2-klein-tiny.safetensors", "text_encoder": "qwen3-tiny.safetensors",
              "vae": "flux2-vae-tiny.safetensors", "small_decoder": []}


def write_tiny_models(models: Path, seed: int = 0, names: dict[str, str | list[str]] | None = None,
                      quantize: dict[str, dict[str, Any]] | None = None) -> Path:
    """A ComfyUI-style models/ folder holding tiny random-weight checkpoints; returns it.

    `names` gives the file name(s) per component ("transformer", "text_encoder", "vae", and "small_decoder": VAEs
    with a narrower decoder, written into vae/ like the others; none unless named), so that a
    workflow's file names can be served by tiny models. `quantize` maps a file name to `quantize_fp8`'s
    keyword arguments: that file is written in fp8 the way ComfyUI stores it (e.g.
    `{"flux-2-klein-4b-fp8.safetensors": {}, "qwen_3_8b_fp8mixed.safetensors": {"marking": "comfy_quant",
    "layers": lambda k: ".mlp." in k}}`). Torch is imported here, not with the module: the names and
    configs above are plain data (a demo whose files exist already plans and validates without torch).
    """
    import torch
    from safetensors.torch import save_file

    from .flux2 import Flux2Transformer
    from .qwen3 import Qwen3Encoder
    from .vae import Flux2VAE

    torch.manual_seed(seed)
    names = {**TINY_NAMES, **(names or {})}
    weights = {
        "transformer": ("diffusion_models", Flux2Transformer(TINY_TRANSFORMER).state_dict()),
        "text_encoder": ("text_encoders", {"model." + k: v for k, v in Qwen3Encoder(TINY_QWEN3).state_dict().items()}),
        "vae": ("vae", Flux2VAE(TINY_VAE).state_dict()),
        "small_decoder": ("vae", Flux2VAE(TINY_SMALL_DECODER_VAE).state_dict()),
    }
    parts = {}
    for kind, (folder, sd) in weights.items():
        for name in [names[kind]] if isinstance(names[kind], str) else names[kind]:
            parts[f"{folder}/{name}"] = sd
    for rel, sd in parts.items():
        path = models / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = None
        if quantize and path.name in quantize:
            sd, meta = quantize_fp8(sd, **quantize[path.name])
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=meta or None)
    return models


SHIPPED_NAMES = {"transformer": ["flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"],
                 "text_encoder": "qwen_3_4b.safetensors", "vae": "flux2-vae.safetensors"}


MARKINGS = ("metadata", "comfy_quant", "scaled_fp8")  # the three ways ComfyUI marks a quantised layer
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantize_fp8(sd: dict, *, fmt: str = "float8_e4m3fn", marking: str = "metadata", layers: Any = None,
                 input_scale: Any = None, uint8: bool = False, prefix: str = "", rest: Any = None
                 ) -> tuple[dict, dict[str, str]]:
    """A state dict's Linear weights quantised per tensor the way ComfyUI stores fp8 checkpoints; (tensors, metadata).

    Each chosen 2-d `<layer>.weight` becomes `fmt` (float8_e4m3fn or float8_e5m2; raw bytes as uint8 with
    `uint8`) with `scale = amax / fmt's max` and `q = clamp(w / scale)`, stored with a 0-dim fp32 weight scale
    and, when `input_scale` is given, a 0-dim fp32 static input scale of that value (a number, or a mapping from
    weight key to number: calibrated scales, amax of the layer's input / 448; keys it lacks get none).
    `layers(name) -> bool` picks the weights (default: every 2-d `.weight`; mixed files quantise some).
    `marking` is one of MARKINGS:
    `_quantization_metadata` in the header (returned as metadata), per-layer `<layer>.comfy_quant` uint8 JSON
    tensors, or legacy `scaled_fp8` with `scale_weight` / `scale_input`. `prefix` ("model.diffusion_model.") is
    put before every key and metadata layer name, as in a ComfyUI checkpoint. `rest` (a torch dtype or its name,
    "bfloat16") casts the floating-point tensors left unquantised, as a real fp8 file keeps them in bf16 (None: as
    they are). Meta tensors give meta results (shapes and dtypes only: a header of the real sizes), the small
    marker and input-scale tensors excepted. Pass the result to safetensors'
    `save_file(tensors, path, metadata=metadata)`.
    """
    import torch

    if fmt not in FP8_MAX or marking not in MARKINGS:
        raise ValueError(f"fmt is one of {list(FP8_MAX)}, marking one of {list(MARKINGS)}")
    fp8 = getattr(torch, fmt)
    pick = layers or (lambda name: True)
    plain = getattr(torch, rest) if isinstance(rest, str) else rest
    out: dict = {}
    marked: dict[str, dict[str, str]] = {}
    for key, w in sd.items():
        if not (key.endswith(".weight") and w.ndim == 2 and w.is_floating_point() and pick(key)):
            out[prefix + key] = w.to(plain) if plain is not None and w.is_floating_point() else w
            continue
        layer = prefix + key.removesuffix(".weight")
        wf = w.detach().float()
        scale = (wf.abs().amax() / FP8_MAX[fmt]).clamp_min(1e-12)
        q = (wf / scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fp8)
        out[layer + ".weight"] = q.view(torch.uint8) if uint8 else q
        names = ("scale_weight", "scale_input") if marking == "scaled_fp8" else ("weight_scale", "input_scale")
        out[f"{layer}.{names[0]}"] = scale.reshape(())
        s_in = input_scale.get(key) if isinstance(input_scale, dict) else input_scale
        if s_in is not None:
            out[f"{layer}.{names[1]}"] = torch.tensor(float(s_in))
        marked[layer] = {"format": fmt}
    meta: dict[str, str] = {}
    if marking == "metadata":
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": marked})
    elif marking == "comfy_quant":
        for layer, conf in marked.items():
            out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    else:
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=fp8)
    return out, meta
