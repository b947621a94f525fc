"""VRAM and time estimates for the heavy nodes: pure functions of shapes and model configs.

Activation peaks are what a node allocates on the GPU above its resident weights, as
`torch.cuda.max_memory_allocated` sees it. They are linear in the data (tokens or pixels) because
attention runs through SDPA's memory-efficient kernels; each constant says what it was fitted on.
The `MARGIN` keeps estimates a little above measurement so that a plan is never optimistic.
Times are only used to choose between variants (GPU, tiled, CPU decode), never asserted.
"""

from __future__ import annotations

import math

from ..models.dtypes import COMPUTE, itemsize
from .types import CondInfo, LatentInfo, ModelInfo, Variant

GiB = 2**30
MARGIN = 1.04

# Fitted by `nodes.calibration.fit` on the H200 measurements in bench/results/calibrate.json (bf16, SDPA,
# klein-4B shapes, 256² to 2048²; measured by bench/calibrate.py, first by bench/plan_matrix.py --calibrate) and
# rounded to 4 significant digits; each point is predicted within 1 %. tests/test_calibration.py refits them from
# that file and checks both. The formulas (`*_bytes` below) take shapes, the compute dtype's item size and the
# widths as parameters: fp32, fp8-stored weights (computed in bf16: item size 2) and a narrower decoder are sized
# by them, but only bf16 at klein-4B widths is calibrated so far.
# Transformer, one sampling step, per image in the batch: (DIT_PER_TOKEN * tokens + DIT_FIXED) * hidden * itemsize
DIT_PER_TOKEN = 21.17
DIT_FIXED = 1431.0
# Qwen3 encoder, per compute dtype: a fixed part plus bytes per (batch * token * hidden * itemsize), 512 tokens.
# Fitted on bench/results/calibrate-rerun.json (bf16 and fp32, batch 1 and 2): the per-token form alone was up to 43 %
# off there (a fixed ~66 MiB in bf16 that the first run's single point could not show). bf16's constants serve every
# 2-byte compute (fp16, fp8-stored weights).
TE_FIXED_BF16, TE_PER_TOKEN_BF16 = 6.868e7, 4.103
TE_FIXED_FP32, TE_PER_TOKEN_FP32 = 7.078e6, 15.85
# VAE: bytes per (pixel * width * itemsize) plus a fixed part, width the full-resolution level's channels (decoder's
# for decode, encoder's for encode); decode per output pixel, encode per input pixel
VAE_DECODE_PER_PIXEL, VAE_DECODE_FIXED = 9.512, 1.531e6
VAE_ENCODE_PER_PIXEL, VAE_ENCODE_FIXED = 7.069, 7.161e5
# Tiled decode: tiles of TILE latent cells with TILE_OVERLAP cells on each side; the fp32 canvas and its
# blend weights cost TILED_CANVAS bytes per output pixel
TILE, TILE_OVERLAP, TILED_CANVAS = 64, 8, 17.08

# Compute times on the H200 at klein-4B size, scaled by parameter counts for other sizes.
DIT_SECONDS_PER_TOKEN_STEP = 0.083 / 4608  # one step at 1024² (4096 image + 512 text tokens)
TE_SECONDS_PER_PROMPT = 0.033
VAE_DECODE_SECONDS_PER_MPIXEL = 0.086
VAE_ENCODE_SECONDS_PER_MPIXEL = 0.05
CPU_DECODE_SECONDS_PER_MPIXEL = 134.0  # the C engine's CPU fallback at 1024² that started this project
CPU_TEXT_ENCODE_SECONDS_PER_PROMPT = 10.0  # not measured: Qwen3-4B's ~4 TFLOP for 512 tokens at ~0.4 TFLOP/s
TILED_SLOWDOWN = 1.6


def scaled_size(width: int, height: int, megapixels: float, steps: int = 1) -> tuple[int, int]:
    """ImageScaleToTotalPixels' target size: the same aspect at `megapixels` * 1024², sides rounded to `steps`."""
    scale = math.sqrt(megapixels * 1024 * 1024 / (width * height))
    steps = max(1, steps)
    return (max(steps, round(width * scale / steps) * steps), max(steps, round(height * scale / steps) * steps))


def tile_spans(n: int) -> list[tuple[int, int, int]]:
    """(core start, span start, span end) of the tiles along one latent side of n cells."""
    return [(a, max(0, a - TILE_OVERLAP), min(n, a + TILE + TILE_OVERLAP)) for a in range(0, n, TILE)]


def largest_tile(n: int) -> int:
    return max(b - a for _, a, b in tile_spans(n))


def _margin(n: float) -> int:
    return math.ceil(n * MARGIN)


def _itemsize(dtype: str) -> int:
    """Bytes per element the activations take: the compute dtype's; weights stored otherwise (fp8) compute in bf16."""
    return itemsize(dtype) if dtype in COMPUTE else 2


# The activation peaks as functions of shapes, item size and widths (bytes, before MARGIN); the constants are
# parameters so that nodes.calibration can fit them and check each point with the same formula.
def text_encode_bytes(batch: int, tokens: int, hidden: int, item: int, per_token: float | None = None,
                      fixed: float | None = None) -> float:
    """The Qwen3 encode of `batch` prompts of `tokens` tokens; the constants default to the item size's fit."""
    if per_token is None or fixed is None:
        f, k = (TE_FIXED_FP32, TE_PER_TOKEN_FP32) if item >= 4 else (TE_FIXED_BF16, TE_PER_TOKEN_BF16)
        per_token, fixed = (k if per_token is None else per_token), (f if fixed is None else fixed)
    return fixed + batch * tokens * hidden * item * per_token


def sampling_bytes(batch: int, tokens: int, hidden: int, item: int, per_token: float = DIT_PER_TOKEN,
                   fixed: float = DIT_FIXED) -> float:
    """One sampling step of `batch` images (cond and uncond count twice) over `tokens` tokens each."""
    return batch * (per_token * tokens + fixed) * hidden * item


def vae_bytes(pixels: int, width: int, item: int, per_pixel: float, fixed: float) -> float:
    """A whole VAE decode or encode: `pixels` output (decode) or input (encode) pixels, decoder width `width`."""
    return pixels * width * item * per_pixel + fixed


def tiled_decode_bytes(tile_pixels: int, pixels: int, width: int, item: int,
                       per_pixel: float = VAE_DECODE_PER_PIXEL, fixed: float = VAE_DECODE_FIXED,
                       canvas: float = TILED_CANVAS) -> float:
    """The largest tile's decode plus the fp32 canvas and blend weights of the whole image."""
    return vae_bytes(tile_pixels, width, item, per_pixel, fixed) + pixels * canvas


def tile_pixels(batch: int, height: int, width: int) -> int:
    """Output pixels of the largest tile of a batch x height x width (latent cells) tiled decode."""
    return batch * largest_tile(height) * largest_tile(width) * 256


def fp8_transient(model: ModelInfo, item: int) -> int:
    """What an fp8 model allocates above its calibrated bf16 activations: its largest fp8 layer dequantized to the
    compute dtype (models/fp8.py dequantizes one layer at a time; the scaled-matmul path's fp8 copy of the
    activations is smaller). 0 for a model without fp8 layers."""
    spec = model.spec
    return getattr(spec, "quant_largest", 0) * item if spec is not None else 0


def text_encode(model: ModelInfo, batch: int, tokens: int) -> tuple[Variant, ...]:
    """Resident on the GPU, or streamed layer by layer from pinned host memory (two layers on the GPU at once)."""
    cfg = model.config
    hidden = cfg.hidden_size if cfg is not None else 2560
    item = _itemsize(model.dtype)
    act = text_encode_bytes(batch, tokens, hidden, item) + fp8_transient(model, item)
    gpu = Variant("gpu", (model.key,), _margin(act), TE_SECONDS_PER_PROMPT * batch)
    if cfg is None or not model.nbytes:
        return (gpu,)
    blocks = model.spec.block_bytes(model.dtype) if hasattr(model.spec, "block_bytes") else {}
    layers = [b for name, b in blocks.items() if name.startswith("layers.")]
    # the largest layer as loaded (fp8 layers of fp8mixed files count as stored); without a spec, an even split
    layer = max(layers) if layers else (model.nbytes - cfg.vocab_size * hidden * item) / max(1, cfg.n_built)
    stream = Variant("stream", (), _margin(act + 2 * layer + batch * tokens * hidden * item * 4),
                    TE_SECONDS_PER_PROMPT * batch, streams=(model.key,),
                    note="streams the text encoder from pinned host memory, layer by layer")
    return (gpu, stream)


def text_encode_cpu(model: ModelInfo, batch: int) -> Variant:
    """The text encode on the CPU (CLIPLoader device "cpu"): no GPU memory, the weights in host memory."""
    seconds = CPU_TEXT_ENCODE_SECONDS_PER_PROMPT * batch * _param_scale_te(model)
    return Variant("cpu", (), 0, seconds, note="text encoder on the CPU (CLIPLoader device: cpu)")


def _param_scale_te(model: ModelInfo) -> float:
    return model.nbytes / (5.8 * GiB) if model.nbytes else 1.0


def sampler_tokens(latent: LatentInfo, positive: CondInfo) -> int:
    return latent.height * latent.width + positive.tokens + sum(h * w for h, w in positive.refs)


def kv_cache_bytes(batch: int, ref_tokens: int, hidden: int, blocks: int, item: int) -> int:
    """FluxKVCache's cache: a key and a value row (hidden wide) per reference token, image in the batch and block."""
    return 2 * blocks * batch * ref_tokens * hidden * item


def kv_sampling_bytes(batch: int, tokens: int, ref_tokens: int, hidden: int, blocks: int, item: int
                      ) -> tuple[float, float]:
    """(first step, every later step) of a FluxKVCache sampler: the first runs over every token and fills the cache
    (whole by its last block); the later ones run without the reference tokens (a smaller activation, their keys and
    values joined to each block's as 2 rows per reference token) but hold the cache throughout."""
    cache = kv_cache_bytes(batch, ref_tokens, hidden, blocks, item)
    first = sampling_bytes(batch, tokens, hidden, item) + cache
    later = sampling_bytes(batch, tokens - ref_tokens, hidden, item) + 2 * batch * ref_tokens * hidden * item + cache
    return first, later


def sampling(model: ModelInfo, latent: LatentInfo, positive: CondInfo, cfg_batch: int, steps: int) -> Variant:
    """All steps of the sampler: the peak of one step (steps run one after another). A model patched by FluxKVCache
    with references: the larger of its first and later steps (kv_sampling_bytes), and later steps are faster."""
    cfg = model.config
    hidden = cfg.hidden if cfg is not None else 3072
    item = _itemsize(model.dtype)
    tokens = sampler_tokens(latent, positive)
    batch = latent.batch * cfg_batch
    ref = sum(h * w for h, w in positive.refs)
    if model.kv_cache and ref:
        blocks = cfg.depth_double + cfg.depth_single if cfg is not None else 25
        act = max(kv_sampling_bytes(batch, tokens, ref, hidden, blocks, item)) + fp8_transient(model, item)
        step_tokens = tokens + (steps - 1) * (tokens - ref)
    else:
        act = sampling_bytes(batch, tokens, hidden, item) + fp8_transient(model, item)
        step_tokens = tokens * steps
    act += 2 * latent.batch * latent.height * latent.width * latent.channels * 4  # step preview: x0 and its RGB
    seconds = DIT_SECONDS_PER_TOKEN_STEP * step_tokens * batch * _param_scale(model)
    return Variant("gpu", (model.key,), _margin(act), seconds)


def _param_scale(model: ModelInfo) -> float:
    """Compute grows with parameters, not bytes (an fp8 model does the same matmuls in half the bytes)."""
    params = getattr(model.spec, "params", 0) if model.spec is not None else 0
    if params:  # the same as nbytes for plain weights; fp8 layers count as the compute dtype
        return params * _itemsize(model.dtype) / (7.219 * GiB)
    return model.nbytes / (7.219 * GiB) if model.nbytes else 1.0


# The VAE's activation scales with the width of its full-resolution level: the decode's peak is at the last up
# levels, where every tensor is (pixels x width), and the small decoder narrows every level by the same factor
# (96/128 = 192/256 = 384/512 = 0.75), so its decode needs 0.75x the activation (1.33x less; BFL's card: ~1.4x less
# VRAM at decode). Decode takes the decoder's width, encode the encoder's (the small decoder's encoder is unchanged).
def _decoder_width(model: ModelInfo) -> int:
    return model.config.decoder_widths[0] if model.config is not None else 128


def _encoder_width(model: ModelInfo) -> int:
    return model.config.channels[0] if model.config is not None else 128


def vae_decode(model: ModelInfo, latent: LatentInfo) -> tuple[Variant, ...]:
    """Full GPU decode, tiled GPU decode, and CPU decode (the last resort, priced honestly)."""
    item = _itemsize(model.dtype)
    pixels = latent.batch * latent.height * latent.width * 256
    width = _decoder_width(model)
    mpix = pixels / 1e6
    options = [Variant("gpu", (model.key,),
                       _margin(vae_bytes(pixels, width, item, VAE_DECODE_PER_PIXEL, VAE_DECODE_FIXED)),
                       VAE_DECODE_SECONDS_PER_MPIXEL * mpix)]
    if latent.height > TILE or latent.width > TILE:
        tile_act = tiled_decode_bytes(tile_pixels(latent.batch, latent.height, latent.width), pixels, width, item)
        options.append(Variant("tiled", (model.key,), _margin(tile_act),
                              VAE_DECODE_SECONDS_PER_MPIXEL * mpix * TILED_SLOWDOWN,
                              note=f"tiled decode ({TILE * 16}px tiles)"))
    options.append(Variant("cpu", (), 0, CPU_DECODE_SECONDS_PER_MPIXEL * mpix,
                          note=f"decodes on the CPU: about {CPU_DECODE_SECONDS_PER_MPIXEL * mpix:.0f} s"))
    return tuple(options)


def vae_encode(model: ModelInfo, batch: int, height: int, width: int) -> Variant:
    item = _itemsize(model.dtype)
    pixels = batch * height * width
    act = vae_bytes(pixels, _encoder_width(model), item, VAE_ENCODE_PER_PIXEL, VAE_ENCODE_FIXED)
    return Variant("gpu", (model.key,), _margin(act), VAE_ENCODE_SECONDS_PER_MPIXEL * pixels / 1e6)
