"""A card of N GiB on a bigger GPU, as a user has it: another process holds the device's memory so that exactly
N GiB - 0.25 GiB stays free (what a card without a display shows at start), until it is killed.

    python3 bench/hold_memory.py --card-gib 12 --out hold.json &     # bench/peer_compare.sh's cardN settings
    python3 bench/hold_memory.py --card-gib 12 --out hold.json --fake-device-gib 80   # no GPU: a simulated device

Rules: the holder is a separate process with its own CUDA context (counted in what it holds, as the other
processes on a user's machine are); it allocates with torch in chunks of at most 4 GiB until cudaMemGetInfo's free
memory is within SLACK above the target, then writes `--out` (JSON: card, target, free, total, held, NVML's used)
at once (written to a temporary name, then renamed: a reader never sees half of it) and sleeps until SIGTERM.
It exits non-zero, with the reason on stderr and no `--out`, where the device has less free than the target or
the target cannot be reached (another process freeing or taking memory meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

GiB = 2**30
MiB = 2**20
LEFT_BY_DISPLAYLESS_CARD = GiB // 4  # free on a card without a display at start: its size less ~0.25 GiB
CHUNK = 4 * GiB  # the largest single allocation
SLACK = 4 * MiB  # free may stay this far above the target (allocations round up to 2 MiB pages)
GRAIN = 2 * MiB


class HoldError(RuntimeError):
    """The target cannot be held (says why)."""


def target_free(card_gib: float) -> int:
    """Bytes that stay free for a card of `card_gib` GiB."""
    return int(card_gib * GiB) - LEFT_BY_DISPLAYLESS_CARD


def fill(target: int, free: Callable[[], int], take: Callable[[int], object], tries: int = 200) -> list:
    """Take memory with `take(nbytes)` until `free()` is within SLACK above `target`; the taken objects (hold
    them to keep the memory). Chunks are at most CHUNK and whole GRAINs; the last one stops SLACK / 2 short."""
    held: list = []
    have = free()
    if have < target:
        raise HoldError(f"the device has {have / GiB:.2f} GiB free, less than the {target / GiB:.2f} GiB to leave")
    for _ in range(tries):
        extra = have - target
        if extra <= SLACK:
            return held
        want = min(CHUNK, extra - SLACK // 2)  # the last chunk stops short: a driver rounding up stays above
        held.append(take(want - want % GRAIN))
        now = free()
        if now >= have:
            raise HoldError(f"free memory did not fall after taking memory ({have} -> {now} bytes)")
        if now < target:
            raise HoldError(f"free memory fell to {now / GiB:.3f} GiB, under the {target / GiB:.3f} GiB target "
                            "(another process took memory meanwhile?)")
        have = now
    raise HoldError(f"free memory still {have / GiB:.3f} GiB after {tries} allocations")


def nvml_used() -> int | None:
    """Device 0's used memory as NVML reports it (None without pynvml)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # NVML absent or failing: the report says None
        return None


def write_atomic(path: Path, report: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


class FakeDevice:
    """A device of `total` bytes with nothing on it, for running this script without a GPU."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used, self.total

    def take(self, n: int) -> int:
        self.used += n
        return n


def hold(card_gib: float, fake_gib: float | None) -> tuple[dict, list]:
    """Take the memory: (the report, what holds it: keep it referenced)."""
    target = target_free(card_gib)
    if fake_gib is not None:
        dev = FakeDevice(int(fake_gib * GiB))
        info, take, sizes = dev.mem_get_info, dev.take, lambda held: sum(held)
        errors: tuple[type[BaseException], ...] = (HoldError,)
    else:
        import torch

        torch.empty(1, device="cuda")  # this process's context first: it is part of what is held
        info, sizes = torch.cuda.mem_get_info, lambda held: sum(t.numel() for t in held)
        take = lambda n: torch.empty(n, dtype=torch.uint8, device="cuda")  # noqa: E731
        errors = (HoldError, torch.OutOfMemoryError)
    try:
        held = fill(target, lambda: info()[0], take)
    except errors as e:
        sys.exit(f"hold_memory: cannot leave {card_gib} GiB - 0.25 GiB free: {e}")
    have, total = info()
    return {"card_gib": card_gib, "target_free_bytes": target, "free_bytes": have, "total_bytes": total,
            "held_bytes": total - have, "allocated": sizes(held), "fake_device": fake_gib is not None,
            "nvml_used_bytes": None if fake_gib is not None else nvml_used(), "pid": os.getpid()}, held


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--card-gib", type=float, required=True, help="the card to emulate, GiB")
    ap.add_argument("--out", type=Path, required=True, help="JSON written once the memory is held")
    ap.add_argument("--fake-device-gib", type=float, help="no GPU: simulate an empty device of this size")
    a = ap.parse_args()
    report, held = hold(a.card_gib, a.fake_device_gib)
    have, total, target = report["free_bytes"], report["total_bytes"], report["target_free_bytes"]
    write_atomic(a.out, report)
    print(f"hold_memory: card {a.card_gib} GiB: {have / GiB:.3f} GiB free of {total / GiB:.2f} (target "
          f"{target / GiB:.3f}), holding {(total - have) / GiB:.3f} GiB", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while held:  # until killed
        signal.pause()


if __name__ == "__main__":
    main()
