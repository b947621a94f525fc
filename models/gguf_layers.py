"""Layers whose weights stay GGML blocks (GGUF files) wherever the model lives, dequantized just in time.

A GGUF layer's weight is a uint8 parameter holding the file's bytes, shape (rows, bytes per row): it moves to the
GPU, streams block by block and is counted by the planner at its stored size (a Q4_K row of 4096 weights is 2304
bytes, against 8192 in bf16). Each call dequantizes it on its device by torch code (models/gguf_dequant.py) into a
transient weight of the compute dtype and runs a plain matmul, as ComfyUI-GGUF does; the embedding table
dequantizes only the rows it looks up.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .dtypes import GGML_BLOCKS, stored_shape
from .gguf_dequant import PLAIN, dequantize
from .headers import CheckpointError, TensorInfo
from .quant import QuantLayer


def _row_bytes(kind: str, n: int) -> int:
    size, nbytes = GGML_BLOCKS[kind]
    return n // size * nbytes


class GGUFLinear(nn.Module):
    """A bias-free Linear whose weight is GGML blocks (`kind`, e.g. "Q4_K"): `weight` is uint8 (out, row bytes)."""

    def __init__(self, in_features: int, out_features: int, kind: str, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.empty(out_features, _row_bytes(kind, in_features), dtype=torch.uint8),
                                   requires_grad=False)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind}"

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight (out, in) in `dtype` (default: the compute dtype)."""
        return dequantize(self.weight, self.kind, (self.out_features, self.in_features), dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype))


class GGUFEmbedding(nn.Module):
    """An embedding table of GGML blocks: the looked-up rows' bytes are gathered, then dequantized."""

    def __init__(self, num: int, dim: int, kind: str, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.num, self.dim, self.kind = num, dim, kind
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.empty(num, _row_bytes(kind, dim), dtype=torch.uint8), requires_grad=False)

    def extra_repr(self) -> str:
        return f"{self.num}, {self.dim}, {self.kind}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight[ids], self.kind, (*ids.shape, self.dim), self.compute_dtype)


def gguf_twin(old: nn.Module, q: QuantLayer, compute_dtype: torch.dtype) -> nn.Module:
    """The GGUF layer that replaces `old` (a bias-free Linear or an Embedding, on the meta device)."""
    if q.format not in GGML_BLOCKS:
        raise CheckpointError(f"{q.file}: layer {q.layer} is stored as {q.format}, which is not a GGML block type")
    if isinstance(old, nn.Linear) and old.bias is None:
        return GGUFLinear(old.in_features, old.out_features, q.format, compute_dtype)
    if isinstance(old, nn.Embedding):
        return GGUFEmbedding(old.num_embeddings, old.embedding_dim, q.format, compute_dtype)
    raise CheckpointError(f"{q.file}: layer {q.layer} is quantised ({q.format}) but is not a linear or embedding "
                          "layer; use a file that keeps it in F16/F32")


def read_stored(info: TensorInfo) -> torch.Tensor:
    """A GGUF tensor's stored bytes through a read-only memory map: plain types (F32, F16, BF16) as that dtype in
    their shape, GGML blocks as uint8 (rows, bytes per row). Callers copy out of it (a cast, a move to the GPU)."""
    if info.file is None or info.offset < 0:
        raise CheckpointError(f"tensor {info.name} has no file to read")
    try:
        data = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{info.file}: cannot read tensor {info.name} ({e}); the file is damaged or was "
                             "changed after it was inspected") from e
    with warnings.catch_warnings():  # read-only on purpose: the map is only copied from
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(data)
    if info.dtype in PLAIN:
        return raw.view(PLAIN[info.dtype]).reshape(info.shape)
    return raw.reshape(stored_shape(info.dtype, info.shape))
