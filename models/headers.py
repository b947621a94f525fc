"""Safetensors headers read with plain Python (json + struct), and the tables families map them with.

A checkpoint's header (a JSON table at the start of every safetensors file) gives every tensor's name,
dtype and shape without reading any data: enough to detect the layout and variant and to size every
component for the planner. Nothing here imports torch at import time, so planning and validation
never pay for it; `Source.make`, which builds tensors, imports torch when called.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .dtypes import STORED, tensor_bytes


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, unreadable, or not the model it was taken for."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file's header describes it."""

    file: Path | None
    dtype: str
    shape: tuple[int, ...]
    name: str  # the key inside the file (callers may index infos by a prefix-stripped name)
    tensor: Any = field(default=None, repr=False, compare=False)  # in-memory state dicts
    offset: int = -1  # where its bytes start in the file (-1: not from a file)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.dtype, self.shape)


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor table and `__metadata__` of one safetensors file, reading only its header (GGUF: models/gguf.py)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            raw = f.read(n) if 2 <= n <= 100 * 2**20 else b""
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    if head[:4] == b"GGUF":  # a GGUF file (ComfyUI-GGUF's, llama.cpp's), whatever its name
        from .gguf import read_gguf

        return read_gguf(path)
    if len(head) != 8:
        raise CheckpointError(f"{path}: not a safetensors file (too short to be one)")
    if not raw:
        raise CheckpointError(f"{path}: not a safetensors file (its header length is not plausible)")
    try:
        table = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON)") from e
    if not isinstance(table, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a table of tensors)")
    meta = table.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its metadata is not a table)")
    infos = {}
    for k, v in table.items():  # messages never quote the header: its bytes may come from any file
        try:
            info = TensorInfo(path, v["dtype"], tuple(v["shape"]), k, offset=8 + n + v["data_offsets"][0])
            stored = v["data_offsets"][1] - v["data_offsets"][0]
            wrong = info.dtype in STORED and stored != info.nbytes
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file (a tensor in its header is described wrongly)") \
                from e
        if wrong:
            raise CheckpointError(f"{path}: a tensor's stored size does not match its dtype and shape: the file is "
                                  "damaged (an incomplete download?)")
        infos[k] = info
    return infos, meta


def read_headers(paths: list[Path]) -> dict[str, TensorInfo]:
    """Merged tensor table of several files (the shards of one component)."""
    out: dict[str, TensorInfo] = {}
    for p in paths:
        out.update(read_header(p)[0])
    return out


@dataclass(frozen=True)
class Source:
    """How one of our parameters is made from checkpoint tensors.

    op: "copy"; "cat0" (concatenate the keys along dim 0: fused q|k|v); "swap_halves" (exchange the
    two halves along dim 0: diffusers' final-layer (scale, shift) vs BFL's (shift, scale));
    "conv1x1" (a Linear weight (o, i) stored as a 1x1 conv (o, i, 1, 1) or back: reshape to `shape`);
    "reshape" (the same elements in our shape: a per-tensor scale stored as [1] for our 0-dim buffer).
    """

    keys: tuple[str, ...]
    op: str = "copy"

    def make(self, get: Callable[[str], Any], shape: tuple[int, ...]) -> Any:
        import torch

        if self.op == "copy":
            t = get(self.keys[0])
        elif self.op == "cat0":
            t = torch.cat([get(k) for k in self.keys], 0)
        elif self.op == "swap_halves":
            a, b = get(self.keys[0]).chunk(2, 0)
            t = torch.cat([b, a], 0)
        elif self.op in ("conv1x1", "reshape"):
            t = get(self.keys[0]).reshape(shape)
        else:
            raise ValueError(f"unknown op {self.op!r}")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{'+'.join(self.keys)}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t

    def nbytes(self, infos: Mapping[str, TensorInfo]) -> int:
        return sum(infos[k].nbytes for k in self.keys)


UNPREFIXED = ("scaled_fp8",)  # keys a file may hold outside its prefix: ComfyUI's legacy fp8 marker


def strip_prefix(infos: Mapping[str, TensorInfo], prefixes: tuple[str, ...]) -> dict[str, TensorInfo]:
    """The same table indexed by bare names, if every key (but the markers in UNPREFIXED) starts with one of
    `prefixes`."""
    for p in prefixes:
        if infos and all(k.startswith(p) for k in infos if k not in UNPREFIXED) and any(k.startswith(p) for k in infos):
            return {k.removeprefix(p): v for k, v in infos.items()}
    return dict(infos)
