"""The GPU and host memory budget a plan must stay within.

By default: what the device has free (plus what this process already holds) minus a reserve. With
`vram`, the budget emulates a card of that size: the CUDA context and anything else this process
holds outside torch's allocator come out of it, and the allocator is capped with
`torch.cuda.set_per_process_memory_fraction` so that nothing can exceed it unnoticed.

The budget type is the planner's own `Budget` (graph/plan/planner.py); this module measures and parses it, and keeps it
live: `live` narrows it to what a `Probe` reads the device has free now (other processes may take memory at any
time), and `shortage` / `short_plan_error` say so when that leaves too little.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..plan.planner import DEFAULT_RESERVE, Budget, PlanError

GiB = 2**30
HOST_MARGIN = 4 * GiB  # host RAM left to the OS and the rest of the process
# A card of `--vram` bytes is split as: CUDA context and cuBLAS workspace (measured when the budget is made, after
# `blas_workspace` has initialised cuBLAS: `torch.cuda.mem_get_info` minus what torch's allocator holds, plus the
# workspace) + CARD_MARGIN + the reserve (DEFAULT_RESERVE unless --reserve) + the plan's budget (weights and
# activations). Without --vram the budget is the device's free memory less CARD_MARGIN and the reserve.
#
# CARD_MARGIN is device memory this process comes to use outside torch's allocator after the context was measured:
# kernel images loaded on first use. The reserve is what torch's allocator holds above the live tensors (rounding, its
# small-block pool) when the cap presses it; the rest of its cache it releases before an allocation fails. Measured on
# the H200 (bench/results/oom_matrix.json, all 60 cells {6, 8, 10, 12, 16} GiB x 512²-2048² x text to image, edit, base
# with CFG, code of 2026-12-02 with these margins, streamed models keeping their resident parts between nodes):
# - the context measured at the start, after cuBLAS is initialised, is 0.669 GiB and the workspace 0.031; once kernels
#   have run the context is 0.776-0.778: it grows by 0.11 (before the cuBLAS initialisation moved into the budget it
#   measured 0.51 at the start and grew by 0.26, which the margin of 1 GiB of earlier code had to hold);
# - torch's reserved peak stays within the budget + 0.165 GiB (the reserve and the workspace: 0.156);
# - NVML's count of this process's memory (context and allocator together) stays 0.074-0.47 GiB under the card in
#   every cell, cudaMemGetInfo's 0.038 under at least, 0 OOM (NVML's whole-device `used` also counts 0.60 GiB the
#   H200's driver keeps for itself, which a real card's CUDA total already leaves out). So a 12 GiB card plans with
#   11.02 GiB. The earlier matrix with the reserve at 0.25 GiB: 0.197 GiB under at least.
# A margin of 0.30 GiB without the cuBLAS initialisation in the budget had let the process pass an 8 GiB card by 0.02
# GiB (bench/results/peer_compare_fp8.json): the context then grew by 0.26-0.30 GiB after it was measured.
CARD_MARGIN = 160 * 2**20
# The CUDA context and cuBLAS workspace a plan off the GPU assumes (`vramgraph plan` on a laptop, `--device cpu` with
# --vram): the H200's, measured as the GPU run measures them (0.669 + 0.031 GiB, above), rounded up. Consumer cards
# measure less (their page tables are smaller), so a plan made here is never larger than the card can hold; on the GPU
# the measured context is used instead.
CONTEXT_ESTIMATE = 720 * 2**20
UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
         "g": GiB, "gb": 10**9, "gib": GiB, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str | int | float) -> int:
    """'12GiB', '12G', '11.5 GB', '800MiB', '4096B', or a number of bytes as an int -> bytes (G and GiB are both
    2**30). A string without a unit is refused: '12' is too easily meant as 12 GiB."""
    if isinstance(text, int | float):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m and not m.group(2):
        raise ValueError(f"'{text}' has no unit; write {m.group(1)}GiB (or {m.group(1)}GB, {m.group(1)}MiB)")
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"'{text}' is not a size; write e.g. 12GiB, 11.5GB or 800MiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def _size(option: str, value: str | int | float) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{option} {value}: {e}") from None


def host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB


def card_budget(card: int, context: int, reserve: int = DEFAULT_RESERVE) -> int:
    """The bytes a plan may use on a card of `card` bytes whose CUDA context (and anything else outside torch's
    allocator) takes `context`: the one formula of the GPU run (measured context) and of a plan made off the GPU
    (CONTEXT_ESTIMATE)."""
    return card - context - CARD_MARGIN - reserve


_WORKSPACE: dict[tuple[int, int], int] = {}  # (device index, thread) -> bytes


def blas_workspace(index: int) -> int:
    """The bytes of the cuBLAS workspace torch allocates on a thread's first matrix product on a device and keeps for
    the rest of the process (through its caching allocator, so the node that made that first product would measure it
    in its peak: bench/results/calibrate.json's first text encode peaked 34 MiB above the same encode later in
    oom_matrix.json). Torch keeps one cuBLAS handle, and so one workspace, per thread. Made here, once per device and
    thread, so that a budget counts it outside the plan rather than in a node (`Engine.run` counts a prompt thread's
    own: graph/engine/executor.py)."""
    key = (index, threading.get_ident())
    if key not in _WORKSPACE:
        import torch

        with torch.cuda.device(index):
            before = torch.cuda.memory_allocated(index)
            a = torch.ones(64, 64, device=f"cuda:{index}", dtype=torch.bfloat16)
            (a @ a).float().sum().item()  # a bf16 and an fp32 product: cuBLAS and cuBLASLt
            (a.float() @ a.float()).sum().item()
            del a
            _WORKSPACE[key] = max(0, torch.cuda.memory_allocated(index) - before)
    return _WORKSPACE[key]


def cuda_context(index: int) -> int:
    """The bytes this process holds on device `index` outside torch's allocator: the CUDA context, and whatever else
    the driver took for it (total - free - torch's reserved; assumes no other process uses the device)."""
    import torch

    free, total = torch.cuda.mem_get_info(index)
    return max(0, total - free - torch.cuda.memory_reserved(index))


def has_blas_workspace(index: int) -> bool:
    return (index, threading.get_ident()) in _WORKSPACE


def budget_for(device: Any, vram: str | int | None = None, reserve: str | int | None = None,
               host: str | int | None = None, *, cap: bool = True, context: int | None = None) -> Budget:
    """The budget on `device` (a torch.device or its name; None: no device, a plan for the card `vram` describes,
    with CONTEXT_ESTIMATE for its CUDA context: the budget the GPU run computes for that card). Only a CUDA device is
    measured, and only then is torch imported; on the CPU "the GPU" is host memory, capped to `vram` if given.
    With `vram` (and `cap`) torch's allocator is capped to that card's size; `cap=False`
    computes the same budget without touching the allocator (a plan for another card than the one running).
    `context`: the bytes this process holds outside torch's allocator, instead of measuring them now
    (bench/oom_matrix.py gives every cell of a long-running process the context it measured at its start, as a fresh
    CLI process measures it)."""
    res = DEFAULT_RESERVE if reserve is None else _size("--reserve", reserve)
    host_bytes = _size("--host", host) if host is not None else max(GiB, host_available() - HOST_MARGIN)
    card = _size("--vram", vram) if vram is not None else None
    if device is None and card is not None:
        # a plan for a card, made off the GPU: the budget the GPU run computes, with the context estimated (a card
        # too small for even that gets a budget of 0, so the plan names the first node that does not fit)
        return Budget(max(0, card_budget(card, CONTEXT_ESTIMATE, res)), host_bytes, card, res,
                      CONTEXT_ESTIMATE + CARD_MARGIN)
    if str(device).split(":")[0] != "cuda":
        # on the CPU "the GPU" is host memory: weights and activations share it (`vram` caps it)
        return Budget((card if card is not None else host_bytes) - res, host_bytes, card, res)
    import torch

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()
    workspace = blas_workspace(index)
    free, total = torch.cuda.mem_get_info(index)
    ours = torch.cuda.memory_reserved(index)
    # this process's context (cuda_context), unless the caller gives it, and the BLAS workspace torch holds for the
    # rest of the process
    outside = (cuda_context(index) if context is None else context) + workspace
    if card is None:
        if cap:
            torch.cuda.set_per_process_memory_fraction(1.0, index)  # undo an earlier cap in this process
        return Budget(free + ours - workspace - CARD_MARGIN - res, host_bytes, None, res, outside + CARD_MARGIN)
    if card > total:
        raise ValueError(f"--vram {vram} is more than the device has ({total / GiB:.1f} GiB)")
    gpu = card_budget(card, outside, res)
    if gpu <= 0:
        raise ValueError(f"--vram {vram} leaves nothing: the CUDA context alone takes {outside / GiB:.2f} GiB, and "
                         f"{(CARD_MARGIN + res) / GiB:.2f} GiB are kept free")
    if cap:  # torch may hold the plan's bytes, the reserve (allocator rounding) and the BLAS workspace, no more
        torch.cuda.set_per_process_memory_fraction((gpu + res + workspace) / total, index)
    return Budget(gpu, host_bytes, card, res, outside + CARD_MARGIN)


# ---------------------------------------------------------------------------------------------- the live budget
# Other processes may take GPU memory at any time. Before each prompt and each planned load the engine asks a probe
# what the device has free and plans within its own holdings + that - the reserve, never above the budget it was given.


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of the device: bytes free, its size, what this process's allocator holds (in use or cached) and
    what this process holds outside the allocator (the CUDA context, measured when the probe was made)."""

    free: int
    total: int
    allocator: int = 0
    context: int = 0

    @property
    def others(self) -> int:
        """Bytes held by other processes."""
        return max(0, self.total - self.free - self.allocator - self.context)


Probe = Callable[[], DeviceMemory]


def cuda_probe(device: Any) -> Probe:
    """The probe of a CUDA device: `torch.cuda.mem_get_info` and the allocator's reserved bytes (one driver call)."""
    import torch

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    context = cuda_context(index)  # assumes the device is not shared yet

    def probe() -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(index)
        return DeviceMemory(free, total, torch.cuda.memory_reserved(index), context)

    return probe


def live(budget: Budget, mem: DeviceMemory) -> Budget:
    """`budget` within what is really there: this process's allocator holdings + what is free - the reserve."""
    gpu = min(budget.gpu, mem.allocator + mem.free - budget.reserve)
    return budget if gpu >= budget.gpu else dataclasses.replace(budget, gpu=max(0, gpu))


def shortage(budget: Budget, mem: DeviceMemory) -> str:
    """What other processes hold and what that leaves, for the errors of a budget shrunk by them."""
    return (f"other processes hold {mem.others / GiB:.2f} GiB of the device's {mem.total / GiB:.2f} GiB, which "
            f"leaves this engine {live(budget, mem).gpu / GiB:.2f} GiB of its {budget.gpu / GiB:.2f} GiB budget")


def short_plan_error(e: PlanError, budget: Budget, mem: DeviceMemory) -> PlanError:
    """The planner's error for a prompt that does not fit the live budget, saying that other processes took it."""
    msg = f"{shortage(budget, mem)}; {e.message}"
    details = f"{e.details}; free GPU memory in the other processes (or wait for them), then queue again"
    return PlanError(e.node, e.class_type, e.needed, e.budget, msg, details,
                     {**e.extra, "others_bytes": mem.others, "free_bytes": mem.free, "budget_given_bytes": budget.gpu})
