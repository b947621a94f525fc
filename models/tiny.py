"""Tiny random-weight models for the demo and the tests.

Writes tiny random-weight models shaped like FLUX.2 [klein] (transformer, Qwen3 encoder, VAE) as a
ComfyUI `models/` folder with the real key names, so that the loaders recognise and run them exactly as
they do real checkpoints.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

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


def write_tiny_models(models: Path, seed: int = 0, names: dict[str, str | list[str]] | None = None) -> Path:
    """A ComfyUI-style models/ folder holding tiny random-weight checkpoints; returns it.

    `names` gives the file name(s) per component ("transformer", "text_encoder", "vae", and "small_decoder": VAEs
    with a narrower decoder, written into vae/ like the others; none unless named), so that a
    workflow's file names can be served by tiny models. Torch is imported here, not with the module: the names and
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
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return models


SHIPPED_NAMES = {"transformer": ["flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"],
                 "text_encoder": "qwen_3_4b.safetensors", "vae": "flux2-vae.safetensors"}
