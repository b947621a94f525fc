"""VRAM and time estimates for the heavy nodes: pure functions of shapes and model configs.

Activation peaks are what a node allocates on the GPU above its resident weights, as
`torch.cuda.max_memory_allocated` sees it. They are linear in the data (tokens or pixels) because
attention runs through SDPA's memory-efficient kernels; each constant says what it was fitted on.
The `MARGIN` keeps estimates a little above measurement so that a plan is never optimistic.
Times are only used to choose between variants (GPU, tiled, CPU decode), never asserted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

from ..models import flux2_config, qwen3_config
from ..models.dtypes import COMPUTE, GGML_BLOCKS, GGML_CHUNK_ELEMENTS, GGML_WORK_BYTES, itemsize
from .types import Blocks, CondInfo, LatentInfo, ModelInfo, Variant

GiB = 2**30
T = TypeVar("T")
MARGIN = 1.04

# Fitted by `nodes.calibration.fit` on the H200 measurements in bench/results/calibrate.json (bf16 and fp32, SDPA,
# klein-4B shapes, 256² to 2048²; measured by bench/calibrate.py after a first, unmeasured encode) and rounded to 4
# significant digits; each point is predicted within 2 % (the sampler) and 1.5 % (the rest); tests/test_calibration.py
# refits them from that file and checks both. The formulas (`*_bytes` below) take shapes, the compute dtype's item
# size and the widths as parameters: fp32, fp8-stored weights (computed in bf16: item size 2) and a narrower decoder
# are sized by them, but only bf16 and fp32 at klein-4B widths are calibrated so far.
# Transformer, one sampling step, per image in the batch: the larger of two lines in the tokens, times hidden *
# itemsize: DIT_PER_TOKEN * tokens + DIT_FIXED and DIT_PER_TOKEN_LARGE * tokens + DIT_FIXED_LARGE, which cross at
# about 2,200 tokens. The peak moves: from 1024² on, torch's allocator history puts it in a double block's image-stream
# MLP (bench/results/sampler_gap.json), which grows with the image tokens alone. One line fitted over all sizes (the
# fit in use before 2026-12-02, on points measured before later changes to models/flux2.py) was 7-8 % under the
# sampler's measured peak at 1536² and 2048² (bench/results/oom_matrix.json of commit 6175349).
DIT_PER_TOKEN, DIT_FIXED = 20.13, 1471.0
DIT_PER_TOKEN_LARGE, DIT_FIXED_LARGE = 23.14, -5174.0
# Qwen3 encoder, per compute dtype: a fixed part plus bytes per (batch * token * hidden * itemsize), 512 tokens; bf16's
# constants serve every 2-byte compute (fp16, fp8-stored weights). The fixed part is small once torch's cuBLAS
# workspace is counted outside the nodes (graph/budget.blas_workspace): measured inside the first encode, it had made a
# fixed 66 MiB of bf16's fit (bench/results/calibrate-rerun.json) and the estimate twice the encode's later peaks.
TE_FIXED_BF16, TE_PER_TOKEN_BF16 = 1.573e6, 16.9
TE_FIXED_FP32, TE_PER_TOKEN_FP32 = 7.078e6, 15.85
# VAE: bytes per (pixel * width * itemsize) plus a fixed part, width the full-resolution level's channels (decoder's
# for decode, encoder's for encode); decode per output pixel, encode per input pixel
VAE_DECODE_PER_PIXEL, VAE_DECODE_FIXED = 9.514, 3.394e6
VAE_ENCODE_PER_PIXEL, VAE_ENCODE_FIXED = 7.038, 2.5e6
# Tiled decode: tiles of TILE latent cells with TILE_OVERLAP cells on each side; the fp32 canvas and its
# blend weights cost TILED_CANVAS bytes per output pixel
TILE, TILE_OVERLAP, TILED_CANVAS = 64, 8, 16.15

# Compute times on the H200 at klein-4B size, scaled by parameter counts for other sizes.
DIT_SECONDS_PER_TOKEN_STEP = 0.083 / 4608  # one step at 1024² (4096 image + 512 text tokens)
TE_SECONDS_PER_PROMPT = 0.033
# One transformer block's compute in one sampling step of one image of n tokens: PER_TOKEN * n + PER_TOKEN2 * n²
# (attention), at klein-4B width (other widths scale by hidden²). A double block runs each token through one
# stream's weights, a single block through its own: the same 13·hidden² weights per token, so both kinds take
# about the same time at twice the bytes for a double. Measured on the H200 (bf16, SDPA) by bench/streaming.py
# ("constants": one block at 1024² and 2048², bench/results/streaming.json), the two points fitted exactly.
DIT_DOUBLE_SECONDS_PER_TOKEN, DIT_DOUBLE_SECONDS_PER_TOKEN2 = 6.931e-7, 1.569e-11
DIT_SINGLE_SECONDS_PER_TOKEN, DIT_SINGLE_SECONDS_PER_TOKEN2 = 6.290e-7, 1.651e-11
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


def sampling_bytes(batch: int, tokens: int, hidden: int, item: int,
                   lines: tuple[float, float, float, float] | None = None) -> float:
    """One sampling step of `batch` images (cond and uncond count twice) over `tokens` tokens each; `lines`: (per
    token, fixed, per token large, fixed large), default the constants above."""
    a, b, c, d = lines or (DIT_PER_TOKEN, DIT_FIXED, DIT_PER_TOKEN_LARGE, DIT_FIXED_LARGE)
    return batch * max(a * tokens + b, c * tokens + d) * hidden * item


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
    activations is smaller); a GGUF model's also the fp32 working set of one chunk of its blocks
    (models/gguf_dequant.py). 0 for a model without quantised layers."""
    spec = model.spec
    largest = getattr(spec, "quant_largest", 0) if spec is not None else 0
    if any(stored in GGML_BLOCKS for stored, _ in getattr(spec, "dtype_mix", ())):  # GGUF: plus one fp32 chunk
        return largest * item + min(largest, GGML_CHUNK_ELEMENTS) * GGML_WORK_BYTES
    return largest * item


def _per_model(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn(model, *args)` once per model info (by identity: infos are frozen, and the one a loader gives is the one its
    consumers get) and args: the nodes of a queue of prompts share their estimates, one object per kind of node,
    where 64 prompts would otherwise compute and hold 64 equal ones (and the planner compare them field by field)."""
    done: dict[tuple, tuple[ModelInfo, T]] = {}

    @functools.wraps(fn)
    def once(model: ModelInfo, *args: Any) -> T:
        key = (id(model), *args)
        got = done.get(key)
        if got is None or got[0] is not model:
            if len(done) >= 256:  # infos of models no longer loaded
                done.clear()
            got = done[key] = model, fn(model, *args)
        return got[1]

    return once


def _grouped(shapes: dict[str, tuple[int, ...]], prefixes: tuple[str, ...], nbytes: int) -> tuple[list[int], int]:
    """Bytes of each block (parameters named `prefix<i>.`, in the order of `prefixes` then i) and of the rest,
    scaled so that all of them add up to the model's `nbytes` (its stored item size)."""
    numel = {k: math.prod(v) for k, v in shapes.items()}
    per = nbytes / max(1, sum(numel.values()))
    sizes: dict[str, int] = {}
    rest = 0
    for k, n in numel.items():
        head = next((p for p in prefixes if k.startswith(p)), None)
        if head is None:
            rest += n
            continue
        block = head + k[len(head):].split(".", 1)[0]
        sizes[block] = sizes.get(block, 0) + n
    return [math.ceil(n * per) for n in sizes.values()], math.ceil(rest * per)


@_per_model
def _block_sizes(model: ModelInfo, shapes_of: Callable[[Any], dict[str, tuple[int, ...]]], prefixes: tuple[str, ...]
                 ) -> tuple[tuple[int, ...], int]:
    """Each block's bytes as stored (fp8 layers at 1 byte, models/loading.py's block_bytes) and the rest's, in the
    order of `prefixes` then index; without a file's spec, the parameter shapes (`shapes_of(model.config)`) scaled to
    the model's bytes. Once per model info (`_per_model`): the nodes of a 64-prompt queue would otherwise spend most of
    their estimate here."""
    have = model.spec.block_bytes(model.dtype) if hasattr(model.spec, "block_bytes") else {}
    if not have:
        sizes, rest = _grouped(shapes_of(model.config), prefixes, model.nbytes)
    else:
        order = {p: i for i, p in enumerate(prefixes)}

        def key_of(name: str) -> tuple[int, int]:
            head, _, index = name.rpartition(".")
            return order[head + "."], int(index)

        names = sorted((n for n in have if any(n.startswith(p) for p in prefixes)), key=key_of)
        sizes, rest = [have[n] for n in names], sum(b for n, b in have.items() if n not in names)
    return tuple(sizes), rest


@_per_model
def text_encode(model: ModelInfo, batch: int, tokens: int) -> tuple[Variant, ...]:
    """Resident on the GPU, or streamed layer by layer from pinned host memory (the plan keeps some layers on the
    GPU for the node when there is room; the embedding stays in host memory)."""
    cfg = model.config
    hidden = cfg.hidden_size if cfg is not None else 2560
    item = _itemsize(model.dtype)
    act = text_encode_bytes(batch, tokens, hidden, item) + fp8_transient(model, item)
    gpu = Variant("gpu", (model.key,), _margin(act), TE_SECONDS_PER_PROMPT * batch)
    if cfg is None or not model.nbytes:
        return (gpu,)
    sizes, _ = _block_sizes(model, qwen3_config.parameter_shapes, ("layers.",))
    per_layer = TE_SECONDS_PER_PROMPT * batch / len(sizes)
    blocks = Blocks(model.key, tuple(sizes), (per_layer,) * len(sizes), 0,
                    _margin(act + batch * tokens * hidden * item * 4), 1, "encode")
    stream = Variant("stream", (), blocks.min_gpu(), TE_SECONDS_PER_PROMPT * batch, streams=(model.key,),
                     note="streams the text encoder from pinned host memory, layer by layer", blocks=blocks)
    return (gpu, stream)


@_per_model
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
    """All steps of the sampler: the peak of one step (steps run one after another)."""
    return sampling_variants(model, latent, positive, cfg_batch, steps)[0]


@_per_model
def sampling_variants(model: ModelInfo, latent: LatentInfo, positive: CondInfo, cfg_batch: int,
                      steps: int) -> tuple[Variant, ...]:
    """The transformer resident ("gpu"), or streamed block by block from its pinned host copy with the blocks
    that fit kept on the GPU for the node ("stream"). A model patched by FluxKVCache with references: the larger
    of its first and later steps (kv_sampling_bytes), and later steps are faster."""
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
    gpu = Variant("gpu", (model.key,), _margin(act), seconds)
    if cfg is None or not model.nbytes:
        return (gpu,)
    sizes, fixed = _block_sizes(model, flux2_config.parameter_shapes, ("double_blocks.", "single_blocks."))
    scale = batch * (hidden / 3072) ** 2
    double = (DIT_DOUBLE_SECONDS_PER_TOKEN * tokens + DIT_DOUBLE_SECONDS_PER_TOKEN2 * tokens**2) * scale
    single = (DIT_SINGLE_SECONDS_PER_TOKEN * tokens + DIT_SINGLE_SECONDS_PER_TOKEN2 * tokens**2) * scale
    secs = (double,) * cfg.depth_double + (single,) * cfg.depth_single
    blocks = Blocks(model.key, tuple(sizes), secs, fixed, _margin(act), steps, "step")
    stream = Variant("stream", (), blocks.min_gpu(), seconds, streams=(model.key,), blocks=blocks,
                     note="streams the transformer blocks that do not fit from pinned host memory")
    if cfg_batch == 1 or model.kv_cache:  # the K/V cache holds both CFG halves at once
        return (gpu, stream)
    # CFG's two passes one after the other: the activation of one image, every block streamed twice per step
    one = sampling_bytes(latent.batch, tokens, hidden, item) + 2 * latent.batch * latent.height * latent.width * \
        latent.channels * 4
    half = tuple(t / cfg_batch for t in secs)
    seq = Blocks(model.key, tuple(sizes), half, fixed, _margin(one), steps * cfg_batch, "step", cfg_batch)
    stream_cfg = Variant("stream-cfg", (), seq.min_gpu(), seconds, streams=(model.key,), blocks=seq,
                         note="streams the transformer; CFG's conditional and unconditional passes one after the other")
    return (gpu, stream, stream_cfg)


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


@_per_model
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


@_per_model
def vae_encode(model: ModelInfo, batch: int, height: int, width: int) -> Variant:
    item = _itemsize(model.dtype)
    pixels = batch * height * width
    act = vae_bytes(pixels, _encoder_width(model), item, VAE_ENCODE_PER_PIXEL, VAE_ENCODE_FIXED)
    return Variant("gpu", (model.key,), _margin(act), VAE_ENCODE_SECONDS_PER_MPIXEL * pixels / 1e6)
