"""GGML block quantisations dequantized by torch, on whatever device the bytes are (the GPU, just in time).

Each function takes the blocks as uint8, shape (n, bytes per block), and returns float32 (n, elements per block),
computing exactly what the `gguf` package's numpy dequantizers compute (the same fp32 products, in the same order:
tests/test_gguf.py checks them bit for bit on the same bytes). The block layouts are llama.cpp's (ggml-common.h):
a block starts or ends with its fp16 scale `d` (and `dmin`); K-quants pack 6-bit sub-block scales in 12 bytes.

`dequantize` applies them to a whole tensor's bytes and returns it in the compute dtype, a bounded number of
blocks at a time, so that the fp32 transient stays small beside the output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .dtypes import GGML_BLOCKS, GGML_CHUNK_ELEMENTS


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row read as a little-endian fp16, as fp32 (n, 1)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _shifts(step: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Bit shifts 0, step, 2 * step, ... below 8, shaped to broadcast; made on `device` (a tensor built from a list
    would be a host-to-device copy, which waits for the GPU's queue, in every layer's call)."""
    return torch.arange(0, 8, step, dtype=torch.uint8, device=device).reshape(shape)


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """(n, groups * width) bytes -> (n, groups, 2, width) 4-bit values: each group's low nibbles, then its high."""
    n = qs.shape[0]
    return (qs.reshape(n, groups, 1, width) >> _shifts(4, (1, 1, 2, 1), qs.device)) & 0x0F


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 8 * k) bits, bit i of byte j at 8 * j + i (a little-endian bit field)."""
    n = qh.shape[0]
    return ((qh.reshape(n, -1, 1) >> _shifts(1, (1, 1, 8), qh.device)) & 1).reshape(n, -1)


def q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(b[:, :2])


def q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1, 16).reshape(b.shape[0], 32).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.to(torch.float32)


def q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 1, 16).reshape(b.shape[0], 32).to(torch.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5(b: torch.Tensor, start: int) -> torch.Tensor:
    """The 5-bit values of a Q5_0/Q5_1 block: 32 high bits at start..start+4, then 16 bytes of low nibbles."""
    ql = _nibbles(b[:, start + 4:], 1, 16).reshape(b.shape[0], 32)
    return ql | (_bits(b[:, start:start + 4]) << 4)


def q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b, 2).to(torch.int8) - 16).to(torch.float32)


def q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _q5(b, 4).to(torch.float32) + _f16(b[:, 2:4])


def q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    dl = (_f16(b[:, 80:82]) * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (_f16(b[:, 82:84]) * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts(2, (1, 1, 4, 1), b.device)) & 3
    return (dl * q.reshape(n, 16, 16).to(torch.float32) - ml).reshape(n, 256)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = (scales[:, :8].reshape(n, 1, 8) >> _shifts(4, (1, 2, 1), b.device)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> _shifts(2, (1, 4, 1), b.device)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 3) << 4)).to(torch.int8) - 32
    dl = (_f16(b[:, 108:110]) * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> _shifts(2, (1, 1, 4, 1), b.device)) & 3).reshape(n, 16, 16)
    qh = ((hmask.reshape(n, 1, 1, 32) >> _shifts(1, (1, 1, 8, 1), b.device)) & 1).reshape(n, 16, 16)
    q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)  # a set high bit means no offset
    return (dl * q.to(torch.float32)).reshape(n, 256)


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 six-bit scales and 8 six-bit mins from their 12 packed bytes, each (n, 8)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d * scale * q - dmin * min, per 32-element sub-block, for Q4_K and Q5_K."""
    n = b.shape[0]
    sc, mn = _scale_min(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.to(torch.float32)).reshape(n, 8, 1)
    return (d * q.to(torch.float32) - dm).reshape(n, 256)


def q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 16:], 4, 32).reshape(b.shape[0], 8, 32))


def q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles(b[:, 48:], 4, 32).reshape(n, 8, 32)
    qh = ((b[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(1, (1, 1, 8, 1), b.device)) & 1)
    return _k_affine(b, ql | (qh.reshape(n, 8, 32) << 4))


def q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 2, 64).reshape(n, 8, 32)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(2, (1, 1, 4, 1), b.device)) & 3)
    q = ((ql | (qh.reshape(n, 8, 32) << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    return (d * q.to(torch.float32)).reshape(n, 256)


BLOCK_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1,
    "Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
}
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize(raw: torch.Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
               chunk_elements: int = GGML_CHUNK_ELEMENTS) -> torch.Tensor:
    """A tensor of `shape` in `dtype` from its stored bytes `raw` (uint8, any shape; `kind` a GGUF type name).

    Computed in fp32 (bit for bit the `gguf` package's values), then cast to `dtype`; for a `dtype` other than fp32
    at most `chunk_elements` elements (whole blocks) are in fp32 at once. Bytes on a CUDA device go to the Triton
    kernels instead (the same values, straight into `dtype`: models/gguf_triton.py), where Triton imports.
    """
    if kind in PLAIN:
        return raw.reshape(-1).view(PLAIN[kind]).reshape(shape).to(dtype)
    fn = BLOCK_DEQUANT.get(kind)
    if fn is None:
        raise ValueError(f"GGUF type {kind} is not one vramgraph dequantizes ({', '.join([*PLAIN, *BLOCK_DEQUANT])})")
    from .gguf_triton import DISPATCH  # imported here: Triton is imported on the first GGUF layer's call, not before

    fast = DISPATCH.run(raw, kind, shape, dtype)  # the Triton kernels where the bytes are on a CUDA device
    if fast is not None:
        return fast
    size, nbytes = GGML_BLOCKS[kind]
    blocks = raw.reshape(-1, nbytes)
    chunk_blocks = max(1, chunk_elements // size)
    if dtype == torch.float32 or blocks.shape[0] <= chunk_blocks:
        return fn(blocks).to(dtype).reshape(shape)
    out = torch.empty(blocks.shape[0], size, dtype=dtype, device=raw.device)
    for i in range(0, blocks.shape[0], chunk_blocks):
        out[i:i + chunk_blocks] = fn(blocks[i:i + chunk_blocks])
    return out.reshape(shape)
