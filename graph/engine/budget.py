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
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..plan.planner import DEFAULT_RESERVE, Budget, PlanError

log = logging.getLogger("vramgraph.budget")
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


@dataclass(frozen=True)
class ContextGrowth:
    """One measurement of what CARD_MARGIN must hold: the device memory a process came to use outside torch's
    allocator after its budget measured the context (kernel images loaded on first use), on one device and kernel
    path, with the results file (and the code's commit) it comes from."""

    device: str
    path: str  # the kernels that ran: compute dtype, attention, weights' format
    growth: int  # bytes: the largest context after a cell less the context at the start
    data: str


# Every measurement of the context's growth; CARD_MARGIN must hold the largest (tests/test_cards.py checks it and each
# figure against its file). A new one (a consumer card, another kernel path: bench/oom_matrix.py reports
# start_context_gib and each cell's context_after_gib) drops in here.
CONTEXT_GROWTH = (
    ContextGrowth("NVIDIA H200", "bf16, SDPA, bf16 weights: 60 cells, 512²-2048², 3 workflows", 112 * 2**20,
                  "bench/results/oom_matrix.json (code of 917421e, committed in 3c76c11): 0.7781 - 0.6688 GiB"),
)
# Paths whose growth nobody has measured: CARD_MARGIN's 48 MiB above the largest growth measured stand in for them, a
# guess until they are measured on the GPU (docs/cards.md).
UNMEASURED_GROWTH = ("fp8 weights (torch._scaled_mm kernels)", "fp32 compute", "any consumer card (RTX 30/40/50)")
# The CUDA context and cuBLAS workspace a plan off the GPU assumes (`vramgraph plan` on a laptop, `--device cpu` with
# --vram): the H200's, measured as the GPU run measures them (0.669 + 0.031 GiB, above), rounded up. Consumer cards
# are expected to measure less (smaller page tables; not measured here), but their CUDA total on Linux is 0.2-0.4 GiB
# under the size they are sold as (WHOLE_CARD, below): a plan made here is a prediction, and the run on the card
# measures both and plans within them.
CONTEXT_ESTIMATE = 720 * 2**20
MiB = 2**20
# Sizes are binary, as cards and memory are sold: a card sold as "8 GB" has 8 GiB of memory (8192 MiB), so 8GiB, 8GB
# and 8G all name it (docs/cards.md); likewise K/KB/KiB, M/MB/MiB and T/TB/TiB.
UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": MiB, "mb": MiB, "mib": MiB,
         "g": GiB, "gb": GiB, "gib": GiB, "t": 2**40, "tb": 2**40, "tib": 2**40}
# A card's driver reports a little less than the memory it is sold with: real 8 GB cards report 8188-8192 MiB through
# nvidia-smi and on Windows, but CUDA on Linux counts 7.75-7.80 GiB of them (RTX 3070, 4060), a 12 GB RTX 3060 11.75
# GiB, a 24 GB RTX 4090 23.61-23.68 GiB (the driver's own reservation; docs/cards.md lists the sources). A --vram
# request above the device's total by at most this share of it therefore names the card itself: the whole device.
WHOLE_CARD = 0.04


def parse_size(text: str | int | float) -> int:
    """'12GiB', '12G', '12GB', '11.5 GB', '800MiB', '4096B', or a number of bytes as an int -> bytes. Every unit is
    binary (G, GB and GiB are all 2**30: module comment). A string without a unit is refused: '12' is too easily meant
    as 12 GiB."""
    if isinstance(text, int | float):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m and not m.group(2):
        raise ValueError(f"'{text}' has no unit; write {m.group(1)}GiB (or {m.group(1)}GB, {m.group(1)}MiB)")
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"'{text}' is not a size; write e.g. 12GB (a card sold as 12 GB), 11.5GiB or 800MiB")
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


def whole_card(total: int) -> str:
    """The shortest --vram that names a device of `total` bytes as a whole: the size it is sold as (7.78 GiB: '8GB'),
    or its exact total in MiB where no whole GiB is within WHOLE_CARD of it (an ECC card)."""
    sold = -(-total // GiB)
    return f"{sold}GB" if sold * GiB <= total * (1 + WHOLE_CARD) else f"{total // MiB}MiB"


def card_on_device(card: int, total: int, vram: str | int | float | None = None) -> int:
    """The card a --vram of `card` bytes means on a device of `total` bytes: that card where it fits; the whole device
    where it asks for at most WHOLE_CARD more than the device reports (the card it is sold as: '8GB' on a card whose
    CUDA total is 7.78 GiB); else a ValueError that says what to write."""
    if card <= total:
        return card
    if card <= total * (1 + WHOLE_CARD):
        return total
    shown = vram if vram is not None else f"{card / GiB:.2f}GiB"
    raise ValueError(f"--vram {shown} is more than this device has: it reports {total / GiB:.2f} GiB ({total // MiB} "
                     f"MiB); leave --vram out or write --vram {whole_card(total)} for the whole card, or a smaller "
                     "size to plan as that card")


def budget_text(budget: Budget) -> str:
    """How `budget` was made from its card, each part named as what it is (docs/cards.md): printed under a plan."""
    context = budget.outside_allocator - CARD_MARGIN
    if budget.card is None or budget.outside_allocator <= 0:
        return f"budget {budget.gpu / GiB:.2f} GiB (reserve {budget.reserve / GiB:.2f} GiB kept free)"
    where = ("the H200's, estimated: planned off the GPU" if context == CONTEXT_ESTIMATE else "measured at start")
    worst = max(CONTEXT_GROWTH, key=lambda g: g.growth)
    return (f"card {budget.card / GiB:.2f} GiB = budget {budget.gpu / GiB:.2f} + CUDA context and cuBLAS workspace "
            f"{context / GiB:.2f} ({where}) + card margin {CARD_MARGIN / GiB:.2f} (the context's growth measured on "
            f"the {worst.device} only: {worst.growth / GiB:.2f}; not measured: {', '.join(UNMEASURED_GROWTH)}) + "
            f"reserve {budget.reserve / GiB:.2f}")


def card_needed(gpu: int, budget: Budget) -> int:
    """The card size (what --vram takes) whose budget is `gpu` bytes, made the way `budget` was made: the plan's bytes +
    the reserve + what the process holds outside the allocator (CUDA context, cuBLAS workspace, CARD_MARGIN)."""
    return gpu + budget.reserve + budget.outside_allocator


def vram_text(nbytes: int) -> str:
    """`nbytes` as a --vram value that is at least that much: GiB rounded up to the hundredth ('2.87GiB')."""
    return f"{-(-nbytes * 100 // GiB) / 100:.2f}GiB"


def with_card(e: PlanError, budget: Budget) -> PlanError:
    """The planner's rejection (it names the budget a node needs) with the card that budget takes: the --vram to type
    (the budget is what is left of a card after the context, the margin and the reserve)."""
    if e.needed <= e.budget or "min_vram" in e.extra:  # not a node too large for the budget, or said already
        return e
    need = card_needed(e.needed, budget)
    text = vram_text(need)
    msg = f"{e.message}; that is a card of at least {text[:-3]} GiB: plan with --vram {text} or larger"
    details = (f"{e.details}; a card of C GiB leaves a budget of C - {(card_needed(0, budget)) / GiB:.2f} GiB (CUDA "
               "context, card margin and reserve: docs/cards.md)")
    out = PlanError(e.node, e.class_type, e.needed, e.budget, msg, details,
                    {**e.extra, "min_card_bytes": need, "min_vram": text})
    out.__cause__ = e.__cause__
    return out


# (device index, thread) -> bytes: a record of torch's own process state, not a cache (tests/test_no_globals.py
# ALLOWED): torch keeps each thread's cuBLAS workspace until the process ends, and a second measurement would see 0
_WORKSPACE: dict[tuple[int, int], int] = {}


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
    asked, card = card, card_on_device(card, total, vram)
    if card < asked:
        log.info("--vram %s: the whole device (%.2f GiB; a card reports a little less than it is sold as)", vram,
                 total / GiB)
    gpu = card_budget(card, outside, res)
    if gpu <= 0:
        raise ValueError(f"--vram {vram} leaves nothing: the CUDA context alone takes {outside / GiB:.2f} GiB, and "
                         f"{(CARD_MARGIN + res) / GiB:.2f} GiB are kept free; give a card larger than "
                         f"{vram_text(outside + CARD_MARGIN + res)}")
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


def assumed(budget: Budget, cost_name: str, device: Any) -> str:
    """What a plan assumed, in one line: the card (or host RAM, on a machine without a GPU), the bytes left for
    weights and activations, the reserve, the host RAM, and the cost profile its seconds come from."""
    gib = GiB
    tail = (f"; {budget.reserve / gib:.2f} GiB reserve, host RAM {budget.host / gib:.1f} GiB; "
            f"seconds from the cost profile {cost_name}")
    if budget.card is not None:
        return (f"planned for a {budget.card / gib:.2f} GiB card (--vram): {budget.gpu / gib:.2f} GiB for weights "
                f"and activations after its CUDA context{tail}")
    if str(device).split(":")[0] != "cuda":
        return (f"no GPU here and no --vram: planned against host RAM ({budget.gpu / gib:.2f} GiB); give --vram "
                f"12GiB to plan for a card of that size{tail}")
    return f"planned for {device}'s free memory: {budget.gpu / gib:.2f} GiB{tail}"
