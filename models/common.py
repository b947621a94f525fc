"""Pieces shared by the model families that need torch: weight loading, host pages, small layers.

A checkpoint is read in two steps. First its header gives every tensor's name, dtype and shape
(headers.py, torch-free). Then the weights are read one tensor
at a time from memory-mapped files straight into a module built on the meta device, so no random
weights are ever materialised and no second host copy is made.

Each family states how its own parameter names are made from a checkpoint's names as a table of
`Source` entries; the loader (loading.py) carries the table out.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .dtypes import GGML_BLOCKS, stored_name, stored_shape, stored_torch_dtype
from .gguf import is_gguf
from .headers import CheckpointError, Source, TensorInfo
from .quant import check_weights, quant_layers, scale_sources


def infos_from_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """A tensor table over an in-memory state dict (e.g. one ComfyUI or a reference model holds)."""
    return {k: TensorInfo(None, stored_name(v.dtype), tuple(v.shape), k, v) for k, v in state.items()}


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
                h = self._handles[info.file] = "gguf" if is_gguf(info.file) else \
                    self._open(str(info.file), framework="pt", device="cpu")
        if h == "gguf":  # a GGUF file: its bytes through a memory map (models/gguf_layers.py)
            from .gguf_layers import read_stored

            return read_stored(info)
        return h.get_tensor(info.name)

    def close(self) -> None:
        self._handles.clear()


ALIGN = 256
READ_AHEAD = 8
READ_THREADS = 16  # parallel reads of one file: page-cache copies scale with threads (5.8 GB/s alone, 45 at 16)
READ_CHUNK = 64 * 2**20


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
    # Private pages, faulted in by the parallel readers, in transparent huge pages where the kernel allows.
    # Python's default anonymous map is shared (shmem-backed): its page faults serialise, and 16 parallel reads into
    # it ran at 3.9-4.3 GB/s on the H200 host against 20.8 private with huge pages (bench/results/read_probe.json).
    pages = _Pages(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
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


def _same_bytes(stored: str, dtype: torch.dtype) -> bool:
    """Whether a tensor stored as `stored` is, byte for byte, that tensor in `dtype` (fp8 may be stored as uint8)."""
    if stored in GGML_BLOCKS:  # GGUF blocks: their bytes, as uint8
        return dtype == torch.uint8
    have = stored_torch_dtype(stored)
    return have == dtype or (have == torch.uint8 and dtype in (torch.float8_e4m3fn, torch.float8_e5m2))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`: a cast, except fp8 bytes stored as uint8, which are reinterpreted."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return t.view(dtype) if t.dtype == torch.uint8 and dtype in fp8 else t.to(dtype)


def _byte_spans(source: Source, shape: tuple[int, ...], infos: Mapping[str, TensorInfo], dtype: torch.dtype
                ) -> list[tuple[Path, int, int]] | None:
    """The file byte ranges that, laid end to end, are this tensor in `dtype`; None if it must be converted.

    Every op is a byte-level rearrangement of row-major tensors stored in `dtype`: concatenating along
    dim 0 lays the parts end to end, swapping the halves of dim 0 reads the second half first.
    """
    parts = [infos.get(k) for k in source.keys]
    if any(i is None or i.file is None or i.offset < 0 or not _same_bytes(i.dtype, dtype) for i in parts):
        return None
    source.make(lambda k: torch.empty(stored_shape(infos[k].dtype, infos[k].shape), dtype=dtype, device="meta"),
                shape)  # checks the shape
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
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 fp8_compute: str | None = None) -> nn.Module:
    """Build a module on the meta device and fill it from checkpoint tensors.

    `sources` names, for every parameter and buffer of the module, where it comes from; floating
    tensors are cast to `dtype`, except the layers the checkpoint stores in fp8 (models/quant.py): those
    become fp8 layers (models/fp8.py) whose weights stay fp8 and whose scales are fp32, computing by
    `fp8_compute` ("dequant" or "scaled_mm"; None: fp8.DEFAULT_COMPUTE). On the host (`device` "cpu", or
    "pinned" for page-locked memory) all
    weights go into ONE buffer, read from the files by parallel positional reads straight into place
    (see `_host_weights`). On a GPU the same reads go through two small page-locked buffers that are
    copied to the GPU while the next is read (`_staged`), so host memory holds two buffers, not the model.
    """
    from . import fp8

    with torch.device("meta"):
        module = build()
        quantized = check_weights(sources, infos, quant_layers(infos), fp8.quantizable(module))
        keep = fp8.swap_in(module, quantized, dtype, fp8_compute or fp8.DEFAULT_COMPUTE) if quantized else {}
    sources = {**sources, **scale_sources(quantized)}
    wanted = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    missing = sorted(set(wanted) - set(sources))
    if missing:
        raise CheckpointError(f"no source for {len(missing)} weights, e.g. {missing[:3]}")
    shapes = {n: (tuple(w.shape), keep.get(n) or (dtype if w.is_floating_point() else w.dtype))
              for n, w in wanted.items()}
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
            futures = [pool.submit(lambda n: views[n].copy_(_as(sources[n].make(files.get, shapes[n][0]),
                                                               shapes[n][1])), n) for n in convert]
            for f in futures:
                f.result()
    finally:
        files.close()
    return flat, views


def _device_weights(sources: Mapping[str, Source], infos: Mapping[str, TensorInfo],
                    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: str | torch.device) -> dict:
    """Weights straight onto `device`: tensors stored in the wanted dtype through two small page-locked staging
    buffers (`_staged`), the rest converted tensor by tensor."""
    spans = {n: _byte_spans(sources[n], shape, infos, dt) for n, (shape, dt) in shapes.items()}
    state = _staged({n: sp for n, sp in spans.items() if sp is not None}, shapes, torch.device(device))
    rest = {n: shapes[n] for n, sp in spans.items() if sp is None}
    if rest:
        state.update(_tensor_by_tensor(sources, infos, rest, device))
    return {n: state[n] for n in shapes}


STAGE_BYTES = 256 * 2**20


def _staged(spans: Mapping[str, list[tuple[Path, int, int]]], shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
            device: torch.device, stage: int = STAGE_BYTES) -> dict:
    """Read byte ranges into one of two page-locked host buffers of `stage` bytes by READ_THREADS parallel reads,
    and copy each filled buffer to its tensors on `device` while the next one is read. Host memory stays at two
    buffers whatever the model's size; reads run at page-cache speed (20.8 GB/s on the H200 host,
    bench/results/read_probe.json; tensor by tensor through the memory map, loads ran at 5.6-6.9 GB/s in the server's
    log of the uncapped run behind peer_small_cards-shmem.json) and the copies hide behind them."""
    out = {n: torch.empty(shapes[n][0], dtype=shapes[n][1], device=device) for n in spans}
    pieces = []  # (tensor, byte offset in it, file, file offset, bytes), none larger than a stage
    for n, parts in spans.items():
        at = 0
        for path, off, nbytes in parts:
            for o in range(0, nbytes, stage):
                pieces.append((n, at + o, path, off + o, min(stage, nbytes - o)))
            at += nbytes
    if not pieces:
        return out
    cuda = device.type == "cuda"
    bufs = [host_pages(min(stage, sum(p[4] for p in pieces))) for _ in range(2)]
    for b in bufs:
        pin_pages(b)
    done: list = [None, None]
    flat = {n: t.reshape(-1).view(torch.uint8) for n, t in out.items()}
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="vramgraph-read") as pool:
        i = k = 0
        while i < len(pieces):
            batch, used = [], 0
            while i < len(pieces) and used + pieces[i][4] <= len(bufs[k]):
                batch.append((used, *pieces[i]))
                used += -(-pieces[i][4] // ALIGN) * ALIGN
                i += 1
            if done[k] is not None:
                done[k].synchronize()  # the copies out of this buffer have finished
            _read_spans(bufs[k], [(at, path, off, n) for at, _, _, path, off, n in batch], pool)
            for at, name, dest, _, _, n in batch:
                flat[name][dest:dest + n].copy_(bufs[k][at:at + n], non_blocking=cuda)
            if cuda:
                done[k] = torch.cuda.Event()
                done[k].record(torch.cuda.current_stream(device))
            k = 1 - k
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    return out


def _tensor_by_tensor(sources: Mapping[str, Source], infos: Mapping[str, TensorInfo],
                      shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: str | torch.device) -> dict:
    """Each tensor read through safetensors' memory map, rearranged, cast and moved on its own."""
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
                state[name] = _as(t, dt).to(device=device, non_blocking=False)
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
