"""The cost profile a plan predicts its seconds with: a named profile (`--profile NAME`) or a quick probe.

The planner weighs reloads (bytes / host-link bandwidth) against compute (the estimates' seconds, stated on
the H200), so both must be this machine's. `cost_for(device, name)`:
- a name picks a profile from PROFILES;
- without one, a CUDA device is probed at start (about 0.1 s): a pinned host-to-device copy of 256 MiB and a
  bf16 matmul, whose rate against the H200's gives `compute` (GPU seconds here per H200 second);
- without one and without a GPU (a plan made on a laptop) the H200 profile is used and named as assumed,
  so the plan says so in its totals line and JSON: the H200 constants are never taken silently.
"""

from __future__ import annotations

import time
from typing import Any

from ..plan.planner import CostModel

# The H200's measured constants (shared/reference/anchors-h200.json: pinned 55.33 GB/s, pageable 8.06 GB/s).
H200 = CostModel()
# The probe's bf16 matmul (PROBE_N x PROBE_N x PROBE_N) on the H200, FLOP/s. Not measured yet: estimated from the
# transformer step the estimates are fitted on (klein-4B at 1024², 4608 tokens: about 4.2e13 FLOP in 0.083 s, so
# 5.0e14 FLOP/s over the whole step, whose large matmuls run faster); `python3 bench/cost_probe.py` prints the
# probe on a GPU, and this constant should be set to its H200 result.
H200_MATMUL_FLOPS = 6.0e14
PROBE_N = 4096
PROBE_BYTES = 256 * 2**20

PROFILES = {
    "h200": H200,
    # an RTX 3060-like card, as issue 13 describes it: pinned copies over PCIe 4 at ~25 GB/s and 1/8 of the H200's
    # bf16 rate; reading files and pageable copies are the host's, taken as the H200 host's
    "rtx3060": CostModel(h2d_pinned=25e9, h2d_pageable=H200.h2d_pageable, disk=H200.disk, compute=8.0,
                         name="rtx3060"),
}


def profile(name: str) -> CostModel:
    """The profile called `name`; a ValueError that lists the known ones otherwise."""
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ValueError(f"--profile {name}: no such cost profile; choose one of {', '.join(PROFILES)}") from None


def probe(device: Any) -> CostModel:
    """Measure this GPU: pinned host-to-device bandwidth and a bf16 matmul's rate (against the H200's)."""
    import torch

    device = torch.device(device)
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8).pin_memory()
    dev = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
    a = torch.randn(PROBE_N, PROBE_N, device=device, dtype=torch.bfloat16)
    try:
        dev.copy_(host, non_blocking=True)  # first use: the copy engine and the matmul's kernel load
        a @ a
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        bw = 3 * PROBE_BYTES / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(5):
            a @ a
        torch.cuda.synchronize(device)
        flops = 5 * 2 * PROBE_N**3 / (time.perf_counter() - t0)
    finally:
        del host, dev, a
        torch.cuda.empty_cache()
    return CostModel(h2d_pinned=bw, h2d_pageable=min(bw, H200.h2d_pageable), disk=H200.disk,
                     compute=H200_MATMUL_FLOPS / flops,
                     name=f"probed: {bw / 1e9:.1f} GB/s pinned, {flops / 1e12:.0f} TFLOPS bf16")


def cost_for(device: Any, name: str | None = None) -> CostModel:
    """The cost model for `device` (a torch.device or its name; None: no GPU): `name`'s profile, else a probe of a
    CUDA device, else the H200's constants, named as assumed."""
    if name:
        return profile(name)
    if str(device).split(":")[0] == "cuda":
        return probe(device)
    return CostModel(name="h200, assumed: no GPU to probe (--profile NAME)")
