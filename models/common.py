"""Pieces shared by the model families: safetensors headers, key remapping, small layers.

A checkpoint is read in two steps. First its header (a JSON table at the start of every safetensors
file) gives every tensor's name, dtype and shape without reading any data: enough to detect the
layout and variant and to size every component for the planner. Then the weights are read one tensor
at a time from memory-mapped files straight into a module built on the meta device, so no random
weights are ever materialised and no second host copy is made.

Each family states how its own parameter names are made from a checkpoint's names as a table of
`Source` entries; the loader (loading.py) carries the table out.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# safetensors dtype names -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, unreadable, or not the model it was taken for."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file's header describes it."""

    file: Path | None
    dtype: str
    shape: tuple[int, ...]
    name: str  # the key inside the file (callers may index infos by a prefix-stripped name)
    tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)  # in-memory state dicts

    @property
    def nbytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 2) * math.prod(self.shape)


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor table and `__metadata__` of one safetensors file, reading only its header."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
            table = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON)") from e
    meta = table.pop("__metadata__", None) or {}
    infos = {k: TensorInfo(path, v["dtype"], tuple(v["shape"]), k) for k, v in table.items()}
    return infos, meta


def infos_from_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """A tensor table over an in-memory state dict (e.g. one ComfyUI or a reference model holds)."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
    return {k: TensorInfo(None, names.get(v.dtype, "F32"), tuple(v.shape), k, v) for k, v in state.items()}


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
    "conv1x1" (a Linear weight (o, i) stored as a 1x1 conv (o, i, 1, 1) or back: reshape to `shape`).
    """

    keys: tuple[str, ...]
    op: str = "copy"

    def make(self, get: Callable[[str], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        if self.op == "copy":
            t = get(self.keys[0])
        elif self.op == "cat0":
            t = torch.cat([get(k) for k in self.keys], 0)
        elif self.op == "swap_halves":
            a, b = get(self.keys[0]).chunk(2, 0)
            t = torch.cat([b, a], 0)
        elif self.op == "conv1x1":
            t = get(self.keys[0]).reshape(shape)
        else:
            raise ValueError(f"unknown op {self.op!r}")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{'+'.join(self.keys)}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t

    def nbytes(self, infos: Mapping[str, TensorInfo]) -> int:
        return sum(infos[k].nbytes for k in self.keys)


def strip_prefix(infos: Mapping[str, TensorInfo], prefixes: tuple[str, ...]) -> dict[str, TensorInfo]:
    """The same table indexed by bare names, if every key starts with one of `prefixes`."""
    for p in prefixes:
        if infos and all(k.startswith(p) for k in infos):
            return {k[len(p):]: v for k, v in infos.items()}
    return dict(infos)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale: normalised in fp32, cast back, then scaled (as both references do)."""

    def __init__(self, dim: int, eps: float = 1e-6, weight_name: str = "weight") -> None:
        super().__init__()
        self.eps = eps
        self.weight_name = weight_name
        self.register_parameter(weight_name, nn.Parameter(torch.ones(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = getattr(self, self.weight_name)
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * w


class _Files:
    """Open safetensors files on demand (memory-mapped by safetensors) and hand out tensors."""

    def __init__(self, infos: Mapping[str, TensorInfo]) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self._infos = infos
        self._handles: dict[Path, object] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> torch.Tensor:
        info = self._infos.get(key)
        if info is None:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint")
        if info.tensor is not None:
            return info.tensor
        with self._lock:
            h = self._handles.get(info.file)
            if h is None:
                h = self._handles[info.file] = self._open(str(info.file), framework="pt", device="cpu")
        return h.get_tensor(info.name)

    def close(self) -> None:
        self._handles.clear()


PLAIN_DTYPES = ("F32", "BF16", "F16")


def check_plain(sources: Mapping[str, Source], infos: Mapping[str, TensorInfo]) -> None:
    """Refuse quantised weights (fp8 and the like): cast without their scales they would give a wrong image."""
    for s in sources.values():
        for k in s.keys:
            info = infos.get(k)
            if info is not None and info.dtype not in PLAIN_DTYPES:
                where = f" in {info.file.name}" if info.file is not None else ""
                raise CheckpointError(f"{k}{where} is stored as {info.dtype}: quantised checkpoints are not "
                                      "supported; use the bf16 or fp32 file of this model")


ALIGN = 256
READ_AHEAD = 8


def pinned_arena(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Views into ONE page-locked host buffer, one per named (shape, dtype), each 256-byte aligned.

    A model whose weights live in one pinned buffer moves to the GPU as a single copy at the host
    link's full speed, and back by dropping the GPU copy.
    """
    offsets, total = {}, 0
    for name, (shape, dt) in shapes.items():
        offsets[name] = total
        nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        total += -(-nbytes // ALIGN) * ALIGN
    flat = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    views = {}
    for name, (shape, dt) in shapes.items():
        nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        views[name] = flat[offsets[name]:offsets[name] + nbytes].view(dt).view(shape)
    return views


def load_weights(build: Callable[[], nn.Module], sources: Mapping[str, Source], infos: Mapping[str, TensorInfo], *,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> nn.Module:
    """Build a module on the meta device and fill it from checkpoint tensors, one tensor at a time.

    `sources` names, for every parameter and buffer of the module, where it comes from. Floating
    tensors are cast to `dtype`; each is moved to `device` as soon as it is read, so host memory
    holds at most the memory-mapped file plus one converted tensor. `device="pinned"` puts every
    tensor into one page-locked host buffer (see `pinned_arena`), read straight from the file.
    """
    with torch.device("meta"):
        module = build()
    wanted = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    missing = sorted(set(wanted) - set(sources))
    if missing:
        raise CheckpointError(f"no source for {len(missing)} weights, e.g. {missing[:3]}")
    check_plain(sources, infos)
    arena = None
    if str(device) == "pinned":
        arena = pinned_arena({n: (tuple(w.shape), dtype if w.is_floating_point() else w.dtype)
                              for n, w in wanted.items()})
    files = _Files(infos)
    state = {}
    try:
        # Reads run a few tensors ahead in threads: page faults on a memory-mapped file are served one page at a
        # time per thread, so parallel reads multiply the throughput; at most READ_AHEAD tensors are in flight.
        with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="vramgraph-read") as pool:
            items = list(wanted.items())
            pending = deque(pool.submit(sources[n].make, files.get, tuple(t.shape)) for n, t in items[:READ_AHEAD])
            for i, (name, _) in enumerate(items):
                t = pending.popleft().result()
                if i + READ_AHEAD < len(items):
                    n2, t2 = items[i + READ_AHEAD]
                    pending.append(pool.submit(sources[n2].make, files.get, tuple(t2.shape)))
                if arena is not None:
                    state[name] = arena[name].copy_(t)
                    continue
                t = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, non_blocking=False)
                state[name] = t
    finally:
        files.close()
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval().requires_grad_(False)
