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
import mmap
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
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
    offset: int = -1  # where its bytes start in the file (-1: not from a file)

    @property
    def nbytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 2) * math.prod(self.shape)


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor table and `__metadata__` of one safetensors file, reading only its header."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            raw = f.read(n) if 2 <= n <= 100 * 2**20 else b""
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
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
            wrong = info.dtype in DTYPE_BYTES and stored != info.nbytes
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file (a tensor in its header is described wrongly)") \
                from e
        if wrong:
            raise CheckpointError(f"{path}: a tensor's stored size does not match its dtype and shape: the file is "
                                  "damaged (an incomplete download?)")
        infos[k] = info
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
READ_THREADS = 16  # parallel reads of one file: page-cache copies scale with threads (5.8 GB/s alone, 45 at 16)
READ_CHUNK = 64 * 2**20
STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


class _Pages(mmap.mmap):
    """Anonymous host pages that unregister themselves from CUDA (see `pin_pages`) when the last view dies."""

    registered = 0  # the address registered with CUDA, if any

    def __del__(self) -> None:
        if self.registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.registered)
            except Exception:  # interpreter shutdown: the driver is going away with the process
                pass
            self.registered = 0


def host_pages(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor over fresh anonymous pages (page-aligned, not yet touched, not yet pinned)."""
    # Plain pages, faulted in by the parallel readers.
    pages = _Pages(-1, max(nbytes, 1))
    flat = torch.from_numpy(np.frombuffer(pages, dtype=np.uint8, count=nbytes))
    flat._vg_pages = pages  # for pin_pages; the array keeps the pages alive as long as any view of it lives
    return flat


def pin_pages(flat: torch.Tensor) -> None:
    """Page-lock a tensor made by `host_pages`, in place, so that it moves to the GPU by DMA at full speed.

    Registering pages that are already filled cost 0.04 s per GiB on the H200 host, where allocating
    page-locked memory up front (`pin_memory=True`) cost 0.45 s per GiB (bench/results/load_probe.json).
    """
    pages = getattr(flat, "_vg_pages", None)
    if pages is None or pages.registered or not torch.cuda.is_available() or flat.numel() == 0:
        return
    err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cannot page-lock {flat.numel() / 2**30:.2f} GiB of host memory (CUDA error {int(err)})")
    pages.registered = flat.data_ptr()


def _arena(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ONE host buffer (see `host_pages`) and a view into it per named (shape, dtype), each 256-byte aligned.

    A model whose weights live in one buffer moves to the GPU as a single copy, and back by dropping
    the GPU copy.
    """
    spans, total = {}, 0
    for name, (shape, dt) in shapes.items():
        nbytes = math.prod(shape) * dt.itemsize
        spans[name] = (total, nbytes)
        total += -(-nbytes // ALIGN) * ALIGN
    flat = host_pages(total)
    return flat, {name: flat[o:o + n].view(shapes[name][1]).view(shapes[name][0]) for name, (o, n) in spans.items()}


def _byte_spans(source: Source, shape: tuple[int, ...], infos: Mapping[str, TensorInfo], dtype: torch.dtype
                ) -> list[tuple[Path, int, int]] | None:
    """The file byte ranges that, laid end to end, are this tensor in `dtype`; None if it must be converted.

    Every op is a byte-level rearrangement of row-major tensors stored in `dtype`: concatenating along
    dim 0 lays the parts end to end, swapping the halves of dim 0 reads the second half first.
    """
    parts = [infos.get(k) for k in source.keys]
    if any(i is None or i.file is None or i.offset < 0 or STORED_DTYPES.get(i.dtype) != dtype for i in parts):
        return None
    source.make(lambda k: torch.empty(infos[k].shape, dtype=dtype, device="meta"), shape)  # checks the shape
    if source.op == "swap_halves":
        (i,) = parts
        if not i.shape or i.shape[0] % 2:
            return None
        half = i.nbytes // 2
        return [(i.file, i.offset + half, half), (i.file, i.offset, half)]
    return [(i.file, i.offset, i.nbytes) for i in parts]


def _read_spans(flat: torch.Tensor, jobs: list[tuple[int, Path, int, int]], pool: ThreadPoolExecutor) -> None:
    """Read every (dest offset, file, file offset, n) range into `flat`, in parallel chunks."""
    buf = flat.numpy()
    fds: dict[Path, int] = {}

    def read(dest: int, path: Path, off: int, n: int) -> None:
        view = memoryview(buf[dest:dest + n])
        done = 0
        while done < n:
            got = os.preadv(fds[path], [view[done:]], off + done)
            if got <= 0:
                raise CheckpointError(f"{path}: the file ends before its tensors do (an incomplete download? "
                                      "fetch the file again)")
            done += got

    try:
        for _, path, _, _ in jobs:
            if path not in fds:
                try:
                    fds[path] = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
        futures = [pool.submit(read, dest + o, path, off + o, min(READ_CHUNK, n - o))
                   for dest, path, off, n in jobs for o in range(0, n, READ_CHUNK)]
        for f in futures:
            f.result()
    finally:
        for fd in fds.values():
            os.close(fd)


def load_weights(build: Callable[[], nn.Module], sources: Mapping[str, Source], infos: Mapping[str, TensorInfo], *,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> nn.Module:
    """Build a module on the meta device and fill it from checkpoint tensors.

    `sources` names, for every parameter and buffer of the module, where it comes from; floating
    tensors are cast to `dtype`. On the host (`device` "cpu", or "pinned" for page-locked memory) all
    weights go into ONE buffer, read from the files by parallel positional reads straight into place
    (see `_host_weights`). On a GPU each tensor is read from the memory-mapped file and moved as soon
    as it is read, so host memory holds at most the mapped file plus a few tensors.
    """
    with torch.device("meta"):
        module = build()
    wanted = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    missing = sorted(set(wanted) - set(sources))
    if missing:
        raise CheckpointError(f"no source for {len(missing)} weights, e.g. {missing[:3]}")
    check_plain(sources, infos)
    shapes = {n: (tuple(w.shape), dtype if w.is_floating_point() else w.dtype) for n, w in wanted.items()}
    if str(device) in ("cpu", "pinned"):
        flat, state = _host_weights(sources, infos, shapes)
        if str(device) == "pinned":
            pin_pages(flat)
    else:
        state = _device_weights(sources, infos, shapes, device)
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval().requires_grad_(False)


def _host_weights(sources: Mapping[str, Source], infos: Mapping[str, TensorInfo],
                  shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[torch.Tensor, dict]:
    """All weights in one host buffer. Tensors stored in the wanted dtype are read byte for byte into
    place by READ_THREADS threads (no memory map, no intermediate copy); the rest are converted."""
    flat, views = _arena(shapes)
    jobs, convert = [], []
    base = flat.data_ptr()
    for name, (shape, dt) in shapes.items():
        spans = _byte_spans(sources[name], shape, infos, dt)
        if spans is None:
            convert.append(name)
            continue
        dest = views[name].data_ptr() - base
        for path, off, n in spans:
            jobs.append((dest, path, off, n))
            dest += n
    files = _Files(infos)
    try:
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="vramgraph-read") as pool:
            _read_spans(flat, jobs, pool)
            futures = [pool.submit(lambda n: views[n].copy_(sources[n].make(files.get, shapes[n][0])), n)
                       for n in convert]
            for f in futures:
                f.result()
    finally:
        files.close()
    return flat, views


def _device_weights(sources: Mapping[str, Source], infos: Mapping[str, TensorInfo],
                    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: str | torch.device) -> dict:
    files = _Files(infos)
    state = {}
    try:
        # Reads run a few tensors ahead in threads: page faults on a memory-mapped file are served one page at a
        # time per thread, so parallel reads multiply the throughput; at most READ_AHEAD tensors are in flight.
        with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="vramgraph-read") as pool:
            items = list(shapes.items())
            pending = deque(pool.submit(sources[n].make, files.get, shape) for n, (shape, _) in items[:READ_AHEAD])
            for i, (name, (_, dt)) in enumerate(items):
                t = pending.popleft().result()
                if i + READ_AHEAD < len(items):
                    n2, (shape2, _) = items[i + READ_AHEAD]
                    pending.append(pool.submit(sources[n2].make, files.get, shape2))
                state[name] = t.to(device=device, dtype=dt, non_blocking=False)
    finally:
        files.close()
    return state


@torch.inference_mode()
def warm_up_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """Run each kind of GPU kernel the models use once, on tiny inputs, so that the process's first image
    does not pay for loading their code (attention alone took 0.76 s the first time on the H200)."""
    x = torch.randn(1, 4, 256, 128, device=device, dtype=dtype)
    F.scaled_dot_product_attention(x, x, x)
    F.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(1, 1, 256, 256, device=device, dtype=torch.bool))
    h = F.silu(F.linear(x, torch.randn(256, 128, device=device, dtype=dtype)))
    F.gelu(F.rms_norm(h.float(), (256,)).to(dtype), approximate="tanh")
    img = torch.randn(1, 128, 32, 32, device=device, dtype=dtype)
    img = F.conv2d(F.group_norm(img, 32), torch.randn(128, 128, 3, 3, device=device, dtype=dtype), padding=1)
    F.interpolate(img, scale_factor=2.0, mode="nearest")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
