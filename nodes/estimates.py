"""VRAM and time estimates for the heavy nodes: pure functions of shapes and model configs.

Activation peaks are what a node allocates on the GPU above its resident weights, as
`torch.cuda.max_memory_allocated` sees it. They are linear in the data (tokens or pixels) because
attention runs through SDPA's memory-efficient kernels; each constant says what it was fitted on.
The `MARGIN` keeps estimates a little above measurement so that a plan is never optimistic.
Times are only used to choose between variants (GPU, tiled, CPU decode), never asserted.
"""

from __future__ import annotations

import math

from .types import CondInfo, LatentInfo, ModelInfo, Option

GiB = 2**30
MARGIN = 1.03
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}

# Fitted on the H200 (bench/calibrate.py, bf16, SDPA, klein-4B shapes); the JSON is bench/results/calibrate.json.
# Transformer, one sampling step: bytes per (batch * token * hidden * itemsize), plus a fixed part per
# (hidden * itemsize) for the time embedding and the modulation vectors.
DIT_PER_TOKEN = 20.0
DIT_FIXED = 12_000.0
# Qwen3 encoder, 512 tokens: bytes per (batch * token * hidden * itemsize)
TE_PER_TOKEN = 24.0
# VAE decoder: bytes per (batch * output pixel * channels[0] * itemsize); encoder per input pixel
VAE_DECODE_PER_PIXEL = 9.6
VAE_ENCODE_PER_PIXEL = 7.0
# Tiled decode: tiles of TILE latent cells with OVERLAP cells on each side
TILE, TILE_OVERLAP = 64, 8

# Compute times on the H200 at klein-4B size, scaled by parameter counts for other sizes.
DIT_SECONDS_PER_TOKEN_STEP = 0.083 / 4608  # one step at 1024² (4096 image + 512 text tokens)
TE_SECONDS_PER_PROMPT = 0.033
VAE_DECODE_SECONDS_PER_MPIXEL = 0.086
VAE_ENCODE_SECONDS_PER_MPIXEL = 0.05
CPU_DECODE_SECONDS_PER_MPIXEL = 134.0  # the C engine's CPU fallback at 1024² that started this project
TILED_SLOWDOWN = 1.6


def _margin(n: float) -> int:
    return math.ceil(n * MARGIN)


def _itemsize(dtype: str) -> int:
    return ITEMSIZE.get(dtype, 2)


def text_encode(model: ModelInfo, batch: int, tokens: int) -> Option:
    hidden = model.config.hidden_size if model.config is not None else 2560
    act = batch * tokens * hidden * _itemsize(model.dtype) * TE_PER_TOKEN
    return Option("gpu", (model.key,), _margin(act), TE_SECONDS_PER_PROMPT * batch)


def sampler_tokens(latent: LatentInfo, positive: CondInfo) -> int:
    return latent.height * latent.width + positive.tokens + sum(h * w for h, w in positive.refs)


def sampling(model: ModelInfo, latent: LatentInfo, positive: CondInfo, cfg_batch: int, steps: int) -> Option:
    """All steps of the sampler: the peak of one step (steps run one after another)."""
    hidden = model.config.hidden if model.config is not None else 3072
    item = _itemsize(model.dtype)
    tokens = sampler_tokens(latent, positive)
    batch = latent.batch * cfg_batch
    act = batch * tokens * hidden * item * DIT_PER_TOKEN + DIT_FIXED * hidden * item
    seconds = DIT_SECONDS_PER_TOKEN_STEP * tokens * batch * steps * _param_scale(model)
    return Option("gpu", (model.key,), _margin(act), seconds)


def _param_scale(model: ModelInfo) -> float:
    return model.nbytes / (7.219 * GiB) if model.nbytes else 1.0


def _decoder_width(model: ModelInfo) -> int:
    return model.config.channels[0] if model.config is not None else 128


def vae_decode(model: ModelInfo, latent: LatentInfo) -> tuple[Option, ...]:
    """Full GPU decode, tiled GPU decode, and CPU decode (the last resort, priced honestly)."""
    item = _itemsize(model.dtype)
    pixels = latent.batch * latent.height * latent.width * 256
    per_pixel = _decoder_width(model) * item * VAE_DECODE_PER_PIXEL
    mpix = pixels / 1e6
    options = [Option("gpu", (model.key,), _margin(pixels * per_pixel), VAE_DECODE_SECONDS_PER_MPIXEL * mpix)]
    if latent.height > TILE or latent.width > TILE:
        side = (TILE + 2 * TILE_OVERLAP) * 16
        tile_act = side * side * per_pixel + pixels * 3 * 4  # one tile's peak + the fp32 output canvas
        options.append(Option("tiled", (model.key,), _margin(tile_act),
                              VAE_DECODE_SECONDS_PER_MPIXEL * mpix * TILED_SLOWDOWN,
                              note=f"tiled decode ({TILE * 16}px tiles)"))
    options.append(Option("cpu", (), 0, CPU_DECODE_SECONDS_PER_MPIXEL * mpix,
                          note=f"decodes on the CPU: about {CPU_DECODE_SECONDS_PER_MPIXEL * mpix:.0f} s"))
    return tuple(options)


def vae_encode(model: ModelInfo, batch: int, height: int, width: int) -> Option:
    item = _itemsize(model.dtype)
    pixels = batch * height * width
    act = pixels * _decoder_width(model) * item * VAE_ENCODE_PER_PIXEL
    return Option("gpu", (model.key,), _margin(act), VAE_ENCODE_SECONDS_PER_MPIXEL * pixels / 1e6)
