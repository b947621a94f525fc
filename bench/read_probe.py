"""How fast a file in the OS page cache reads into fresh host pages, by kind of mapping (GPU host).

    python3 bench/read_probe.py OUT.json [--gib 6]

A cold load on a small card reads each checkpoint into host pages and page-locks them (models/common.py
`host_pages`, `pin_pages`). This probe writes a file of --gib GiB to /dev/shm (page-cache speed) and times,
per mapping kind (shared or private anonymous, with or without transparent huge pages) and thread count:
the parallel reads into fresh pages, the page-locking, and one copy of the whole buffer to the GPU.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import GiB, env
from vramgraph.models.common import READ_CHUNK as CHUNK
from vramgraph.models.common import _read_spans

KINDS = {"shared": (mmap.MAP_SHARED, False), "private": (mmap.MAP_PRIVATE, False),
         "private_hugepage": (mmap.MAP_PRIVATE, True)}


def one_kind(path: Path, size: int, kind: str, threads: int) -> dict:
    flags, huge = KINDS[kind]
    pages = mmap.mmap(-1, size, flags=flags | mmap.MAP_ANONYMOUS)
    if huge:
        pages.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.from_numpy(np.frombuffer(pages, dtype=np.uint8))
    with ThreadPoolExecutor(threads) as pool:  # the whole file, read as the loader reads: 64 MiB chunks in parallel
        t0 = time.perf_counter()
        _read_spans(flat, [(0, path, 0, size)], pool)
        read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    err = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 0))
    reg_s = time.perf_counter() - t0
    gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gpu.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()
    h2d_s = time.perf_counter() - t0
    ok = bool(torch.equal(gpu[-4096:].cpu(), flat[-4096:]))
    del gpu
    if err == 0:
        torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
    del flat
    pages.close()
    return {"kind": kind, "threads": threads, "read_gbps": round(size / read_s / 1e9, 2),
            "register_s": round(reg_s, 3), "register_error": err, "h2d_gbps": round(size / h2d_s / 1e9, 2),
            "bytes_ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gib", type=float, default=6.0)
    a = ap.parse_args()
    size = int(a.gib * GiB) // CHUNK * CHUNK
    path = Path("/dev/shm/vg_read_probe.bin")
    block = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(size // CHUNK):
            f.write(block)
    torch.zeros(1, device="cuda")
    runs = []
    for threads in (16, 8):
        for kind in KINDS:
            runs.append(one_kind(path, size, kind, threads))
            print(runs[-1], flush=True)
    runs.append(one_kind(path, size, "shared", 16))  # the first kind again: order effects
    print(runs[-1], flush=True)
    path.unlink()
    Path(a.out).write_text(json.dumps({"env": env(), "file_gib": round(size / GiB, 3), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
