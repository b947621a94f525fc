"""Where a cold load's time goes, on full-size random klein-4B checkpoints in ComfyUI's layout.

    python3 bench/load_probe.py MODELS_DIR OUT.json [--card 12]

MODELS_DIR is a ComfyUI `models/` folder (shared/tools/make_checkpoints.py --comfy-only writes one).
Part 1 times the pieces of reading the text encoder's file: page-locked allocation, parallel reads into
pinned and pageable memory, one pinned->GPU copy, and the loader's own paths (to the GPU, to pinned).
Part 2 runs ComfyUI's core text-to-image graph in a fresh Engine on the card: cold, warm, then a queue
of 7, and reports every plan step and ledger event with its seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import GiB, env
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.models import loading
from vramgraph.nodes.files import Folders

WORKFLOW = Path(__file__).resolve().parents[1] / "workflows" / "core_text_to_image.json"
CHUNK = 64 * 2**20


def timed(fn, *args):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, round(time.perf_counter() - t0, 3)


def pread_into(path: Path, buf: np.ndarray, threads: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        spans = [(o, min(CHUNK, buf.nbytes - o)) for o in range(0, buf.nbytes, CHUNK)]

        def one(span):
            o, n = span
            got = os.preadv(fd, [memoryview(buf[o:o + n])], o)
            assert got == n

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, spans))
    finally:
        os.close(fd)


def part0() -> dict:
    """First-use costs in a fresh process: CUDA context, cuBLAS, attention, convolution, the tokenizer."""
    import torch.nn.functional as F
    from vramgraph.models.qwen3 import PromptTokenizer

    r = {}
    _, r["cuda_init_s"] = timed(lambda: torch.zeros(1, device="cuda"))
    a = torch.randn(4096, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, 2560, device="cuda", dtype=torch.bfloat16)
    for i in (1, 2):
        _, r[f"matmul_{i}_s"] = timed(lambda: F.linear(a, w))
    q = torch.randn(1, 24, 4608, 128, device="cuda", dtype=torch.bfloat16)
    for i in (1, 2):
        _, r[f"sdpa_{i}_s"] = timed(lambda: F.scaled_dot_product_attention(q, q, q))
    x = torch.randn(1, 128, 512, 512, device="cuda", dtype=torch.bfloat16)
    cw = torch.randn(128, 128, 3, 3, device="cuda", dtype=torch.bfloat16)
    for i in (1, 2):
        _, r[f"conv_{i}_s"] = timed(lambda: F.conv2d(x, cw, padding=1))
    _, r["tokenizer_s"] = timed(lambda: PromptTokenizer.find(None))
    return r


def part1(models: Path) -> dict:
    te = models / "text_encoders" / "qwen_3_4b.safetensors"
    size = te.stat().st_size
    r: dict = {"file_gib": round(size / GiB, 3)}
    pinned, r["pin_alloc_s"] = timed(lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True))
    for threads in (1, 4, 8, 16):
        _, s = timed(pread_into, te, pinned.numpy(), threads)
        r[f"pread_pinned_{threads}t_gbps"] = round(size / s / 1e9, 2)
    gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
    _, s = timed(lambda: gpu.copy_(pinned, non_blocking=True))
    r["h2d_pinned_gbps"] = round(size / s / 1e9, 2)
    gpu = None
    pageable, r["pageable_alloc_s"] = timed(lambda: np.empty(size, dtype=np.uint8))
    _, s = timed(pread_into, te, pageable, 8)
    r["pread_pageable_8t_first_gbps"] = round(size / s / 1e9, 2)
    _, s = timed(pread_into, te, pageable, 8)
    r["pread_pageable_8t_again_gbps"] = round(size / s / 1e9, 2)
    t = torch.from_numpy(pageable)
    _, r["register_s"] = timed(lambda: torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 0))
    _, s = timed(pread_into, te, pageable, 8)
    r["pread_registered_8t_gbps"] = round(size / s / 1e9, 2)
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    pinned = pageable = t = None
    spec = loading.inspect(te).component("text_encoder")
    m, r["loader_to_gpu_s"] = timed(lambda: loading.load(spec, device="cuda"))
    r["loaded_gib"] = round(sum(p.numel() * p.element_size() for p in m.parameters()) / GiB, 3)
    m = None
    torch.cuda.empty_cache()
    m, r["loader_to_pinned_s"] = timed(lambda: loading.load(spec, device="pinned"))
    return r


def prompt(side: int, i: int) -> dict:
    p = json.loads(WORKFLOW.read_text())
    p["4"]["inputs"]["text"] = f"A lighthouse on a cliff at dusk, photo number {i}"
    p["8"]["inputs"].update(width=side, height=side)
    p["10"]["inputs"].update(width=side, height=side)
    p["9"]["inputs"]["noise_seed"] = 100 + i
    return p


def report(engine: Engine, result, n0: int, seconds: float) -> dict:
    return {"seconds": round(seconds, 3),
            "steps": [f"{type(ps.step).__name__} {vars(ps.step)}" for ps in result.plan.steps],
            "nodes": {f"{n.node}:{n.class_type}": round(n.seconds, 3) for n in result.nodes},
            "ledger": [{"kind": e.kind, "model": e.model.split(":")[0], "source": e.source,
                        "s": round(e.seconds, 3)} for e in engine.ledger.events.since(n0)]}


def part2(models: Path, card: int | None, out: Path) -> dict:
    folders = Folders(models=(models,), input=out / "in", output=out / "out", temp=out / "tmp")
    engine = Engine(folders, budget=budget_for("cuda", f"{card}GiB" if card else None))
    r = {}
    for name, p in (("cold", prompt(1024, 0)), ("warm", prompt(1024, 1))):
        n0 = engine.ledger.events.mark()
        res, s = timed(engine.run, p)
        r[name] = report(engine, res, n0, s)
    n0 = engine.ledger.events.mark()
    (res, _), s = timed(lambda: engine.run_queue([prompt(1024, i) for i in range(2, 9)]))
    r["queue7"] = report(engine, res, n0, s)
    engine.free()
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--card", type=int, default=12)
    ap.add_argument("--parts", default="0,1,2")
    a = ap.parse_args()
    rep = {"env": env()}
    if "0" in a.parts:
        rep["first_use"] = part0()
        print(json.dumps(rep["first_use"], indent=1), flush=True)
    if "1" in a.parts:
        rep["read"] = part1(a.models)
        print(json.dumps(rep["read"], indent=1), flush=True)
    if "2" in a.parts:
        rep["engine"] = part2(a.models, a.card, a.out.parent / "probe_files")
        print(json.dumps(rep["engine"], indent=1), flush=True)
    a.out.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
