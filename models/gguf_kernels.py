"""Triton kernels that dequantize GGML blocks straight into the compute dtype: one read of the blocks, one write of
the weight, no fp32 tensor in between (models/gguf_dequant.py's torch code makes several per chunk).

Imported only where Triton imports (models/gguf_triton.py decides which calls run here). Each kernel is the torch
reference of the same type written element by element: every output element gathers the bytes it needs, unpacks
its quant and its (sub-)block scales as integers, and computes the same fp32 products, associated as the reference
does (`(d * sc) * q - dmin * m` for Q4_K, `d * q + m` for Q4_1, ...), then rounds once to the output dtype
(round to nearest even, as torch's `.to`). So the fp32 output equals the reference bit for bit and a bf16/fp16
output equals the reference cast, with one condition: the compiler must not contract a product and a sum into one
fused multiply-add (FMA rounds once where the reference rounds twice). Triton contracts by default; `dequantize`
launches every kernel with `enable_fp_fusion=False` (no contraction in LLVM, `--fmad=false` for ptxas); the tests
compile every kernel so and find no FFMA in its machine code, and on the GPU check equality. Types without a sum
(Q8_0, Q4_0, Q5_0, Q3_K, Q6_K) have nothing to contract.

Layout: a program handles `BB` whole blocks as a tile (BB, S, L): S sub-blocks of L elements (one sub-block per
block for the 32-element types), so per-block and per-sub-block scales are loaded once per row of the tile, not
per element. Block offsets are int64 (an embedding table's bytes pass 2**31). The block's fp16 scales are read
through an fp16 view of the same bytes (every type's scales sit at even offsets of an even-sized block); int8
values are uint8 loads sign-extended by arithmetic. Only constructs that compile for the GPU: power-of-2 tiles,
explicit masks, integer arithmetic on int32.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .dtypes import GGML_BLOCKS

# Blocks per program: 2048 elements either way (an untuned first choice: the lead's GPU runs may change it).
SMALL_BLOCKS = 64
K_BLOCKS = 8


@triton.jit
def _row(BB: tl.constexpr, n):
    """The program's blocks of a 32-element type: block indices (BB, 1) as int64, element indices (1, 32), the mask
    of blocks that exist (BB, 1) and that of elements (BB, 32)."""
    blk = (tl.program_id(0) * BB + tl.arange(0, BB)).to(tl.int64)[:, None]
    j = tl.arange(0, 32)[None, :]
    ok = blk < n
    return blk, j, ok, ok & (j < 32)


@triton.jit
def _tile(BB: tl.constexpr, S: tl.constexpr, L: tl.constexpr, n):
    """The program's blocks of a K-quant: block indices (BB, 1, 1) as int64, sub-block indices (1, S, 1), indices
    within the sub-block (1, 1, L) and within the block (1, S, L), the mask of blocks that exist (BB, 1, 1), of
    sub-blocks (BB, S, 1) and of elements (BB, S, L)."""
    blk = (tl.program_id(0) * BB + tl.arange(0, BB)).to(tl.int64)[:, None, None]
    s = tl.arange(0, S)[None, :, None]
    lane = tl.arange(0, L)[None, None, :]
    j = s * L + lane
    ok = blk < n
    return blk, s, lane, j, ok, ok & (s < S), ok & (j < S * L)


@triton.jit
def _u8(ptr, mask):
    """Bytes as int32 0..255."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(x):
    """int32 0..255 read as a signed byte, -128..127."""
    return x - ((x >> 7) << 8)


@triton.jit
def _f16(ptr, mask):
    """An fp16 scale as fp32 (exact)."""
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(out, offsets, value, mask):
    """One rounding of the fp32 values into the output's dtype."""
    tl.store(out + offsets, value.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _q8_0(src, half, out, n, BB: tl.constexpr):
    blk, j, ok, el = _row(BB, n)
    q = _i8(_u8(src + blk * 34 + 2 + j, el))
    d = _f16(half + blk * 17, ok)
    _store(out, blk * 32 + j, q.to(tl.float32) * d, el)


@triton.jit
def _nibble(src, base, j, mask):
    """Element j (0..31) of a 32-element block's 16 bytes of nibbles at `base`: low nibbles first, then high."""
    return (_u8(src + base + (j % 16), mask) >> ((j // 16) * 4)) & 0x0F


@triton.jit
def _q4_0(src, half, out, n, BB: tl.constexpr):
    blk, j, ok, el = _row(BB, n)
    q = _nibble(src, blk * 18 + 2, j, el) - 8
    d = _f16(half + blk * 9, ok)
    _store(out, blk * 32 + j, d * q.to(tl.float32), el)


@triton.jit
def _q4_1(src, half, out, n, BB: tl.constexpr):
    blk, j, ok, el = _row(BB, n)
    q = _nibble(src, blk * 20 + 4, j, el)
    d = _f16(half + blk * 10, ok)
    m = _f16(half + blk * 10 + 1, ok)
    _store(out, blk * 32 + j, d * q.to(tl.float32) + m, el)


@triton.jit
def _q5(src, base, j, mask):
    """The 5-bit value j of a Q5_0/Q5_1 block whose 4 bytes of high bits start at `base` (then 16 of nibbles)."""
    high = (_u8(src + base + j // 8, mask) >> (j % 8)) & 1
    return _nibble(src, base + 4, j, mask) | (high << 4)


@triton.jit
def _q5_0(src, half, out, n, BB: tl.constexpr):
    blk, j, ok, el = _row(BB, n)
    q = _q5(src, blk * 22 + 2, j, el) - 16
    d = _f16(half + blk * 11, ok)
    _store(out, blk * 32 + j, d * q.to(tl.float32), el)


@triton.jit
def _q5_1(src, half, out, n, BB: tl.constexpr):
    blk, j, ok, el = _row(BB, n)
    q = _q5(src, blk * 24 + 4, j, el)
    d = _f16(half + blk * 12, ok)
    m = _f16(half + blk * 12 + 1, ok)
    _store(out, blk * 32 + j, d * q.to(tl.float32) + m, el)


@triton.jit
def _crumb(src, base, j, mask):
    """The 2-bit value j (0..255) of 64 bytes at `base` as Q2_K/Q3_K/Q6_K pack them: two halves of 128 values, each
    32 bytes read four times (shifts 0, 2, 4, 6)."""
    return (_u8(src + base + (j // 128) * 32 + j % 32, mask) >> (2 * ((j // 32) % 4))) & 3


@triton.jit
def _q2_k(src, half, out, n, BB: tl.constexpr):
    blk, s, _lane, j, ok, sub, el = _tile(BB, 16, 16, n)
    b = blk * 84
    sc = _u8(src + b + s, sub)
    dl = _f16(half + blk * 42 + 40, ok) * (sc & 0x0F).to(tl.float32)
    ml = _f16(half + blk * 42 + 41, ok) * (sc >> 4).to(tl.float32)
    q = _crumb(src, b + 16, j, el)
    _store(out, blk * 256 + j, dl * q.to(tl.float32) - ml, el)


@triton.jit
def _q3_k(src, half, out, n, BB: tl.constexpr):
    blk, s, _lane, j, ok, sub, el = _tile(BB, 16, 16, n)
    b = blk * 110
    low = _u8(src + b + 96 + s % 8, sub) >> (4 * (s // 8))
    high = _u8(src + b + 104 + s % 4, sub) >> (2 * (s // 4))
    sc = ((low & 0x0F) | ((high & 3) << 4)) - 32
    dl = _f16(half + blk * 55 + 54, ok) * sc.to(tl.float32)
    qh = (_u8(src + b + j % 32, el) >> (j // 32)) & 1
    q = _crumb(src, b + 32, j, el) - ((qh ^ 1) << 2)  # a set high bit means no offset
    _store(out, blk * 256 + j, dl * q.to(tl.float32), el)


@triton.jit
def _k_scales(src, b, s, mask):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block s (0..7) from the 12 bytes at b + 4, as int32."""
    s4 = s % 4
    a = _u8(src + b + 4 + s4, mask)
    m = _u8(src + b + 8 + s4, mask)
    md = _u8(src + b + 12 + s4, mask)
    sc = tl.where(s < 4, a & 0x3F, (md & 0x0F) | ((a >> 2) & 0x30))
    mn = tl.where(s < 4, m & 0x3F, (md >> 4) | ((m >> 2) & 0x30))
    return sc, mn


@triton.jit
def _q4_k(src, half, out, n, BB: tl.constexpr):
    blk, s, lane, j, ok, sub, el = _tile(BB, 8, 32, n)
    b = blk * 144
    sc, mn = _k_scales(src, b, s, sub)
    d = _f16(half + blk * 72, ok) * sc.to(tl.float32)
    dm = _f16(half + blk * 72 + 1, ok) * mn.to(tl.float32)
    q = (_u8(src + b + 16 + (s // 2) * 32 + lane, el) >> (4 * (s % 2))) & 0x0F
    _store(out, blk * 256 + j, d * q.to(tl.float32) - dm, el)


@triton.jit
def _q5_k(src, half, out, n, BB: tl.constexpr):
    blk, s, lane, j, ok, sub, el = _tile(BB, 8, 32, n)
    b = blk * 176
    sc, mn = _k_scales(src, b, s, sub)
    d = _f16(half + blk * 88, ok) * sc.to(tl.float32)
    dm = _f16(half + blk * 88 + 1, ok) * mn.to(tl.float32)
    low = (_u8(src + b + 48 + (s // 2) * 32 + lane, el) >> (4 * (s % 2))) & 0x0F
    high = (_u8(src + b + 16 + lane, el) >> s) & 1
    q = low | (high << 4)
    _store(out, blk * 256 + j, d * q.to(tl.float32) - dm, el)


@triton.jit
def _q6_k(src, half, out, n, BB: tl.constexpr):
    blk, s, _lane, j, ok, sub, el = _tile(BB, 16, 16, n)
    b = blk * 210
    sc = _i8(_u8(src + b + 192 + s, sub))
    d = _f16(half + blk * 105 + 104, ok) * sc.to(tl.float32)
    low = (_u8(src + b + (j // 128) * 64 + j % 64, el) >> (4 * ((j // 64) % 2))) & 0x0F
    q = (low | (_crumb(src, b + 128, j, el) << 4)) - 32
    _store(out, blk * 256 + j, d * q.to(tl.float32), el)


# GGML type -> (kernel, blocks per program)
KERNELS = {
    "Q8_0": (_q8_0, SMALL_BLOCKS), "Q4_0": (_q4_0, SMALL_BLOCKS), "Q4_1": (_q4_1, SMALL_BLOCKS),
    "Q5_0": (_q5_0, SMALL_BLOCKS), "Q5_1": (_q5_1, SMALL_BLOCKS), "Q2_K": (_q2_k, K_BLOCKS),
    "Q3_K": (_q3_k, K_BLOCKS), "Q4_K": (_q4_k, K_BLOCKS), "Q5_K": (_q5_k, K_BLOCKS), "Q6_K": (_q6_k, K_BLOCKS),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dequantize(raw: torch.Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` in `dtype` (one of DTYPES) from the GGML blocks `raw` (uint8, any shape, on the device
    the kernel runs on: a CUDA device, or the CPU under TRITON_INTERPRET=1). Equal to models/gguf_dequant.py's
    `dequantize` of the same bytes (see the module's docstring for the one condition)."""
    kernel, per_program = KERNELS[kind]
    size, nbytes = GGML_BLOCKS[kind]
    blocks = raw.reshape(-1, nbytes)
    if not blocks.is_contiguous() or blocks.storage_offset() % 2:  # the fp16 view needs even, contiguous bytes
        blocks = blocks.clone(memory_format=torch.contiguous_format)
    n = blocks.shape[0]
    out = torch.empty(n * size, dtype=dtype, device=raw.device)
    if n:  # Triton launches on the current device, torch ops on their tensors': make the blocks' device current
        with torch.cuda.device(raw.device) if raw.is_cuda else contextlib.nullcontext():
            kernel[(triton.cdiv(n, per_program),)](blocks, blocks.view(torch.float16), out, n, BB=per_program,
                                                   enable_fp_fusion=False)
    return out.reshape(shape)
