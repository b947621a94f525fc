"""Results as soon as they are free (issue 15, item 6): a queue of 8 at 1024² on an emulated 12 GiB card, the time to
its first image against one prompt's time alone, and its total against the old order (decode all after sampling all).

    python3 bench/first_image.py OUT.json [--n 8] [--side 1024] [--card 12]

Same random klein-4B checkpoints and Engine as bench/plan_matrix.py; every case starts with all weights in pinned
host RAM and nothing on the GPU. The first image is the first save node's "executed" event. The old order is the
planner's with graph/plan/early.py's pass left out (for this bench only). Targets: first image <= 1.3x one prompt alone,
total no worse than the old order, the same loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import GiB, env, write_report
from plan_matrix import ROOT, prompt_for, reset, write_models
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import planner
from vramgraph.nodes.files import Folders


def timed_run(engine: Engine, prompts: list[dict]) -> dict:
    reset(engine)
    saved: list[float] = []

    def events(kind: str, data: dict) -> None:
        if kind == "executed" and (data.get("output") or {}).get("images"):
            torch.cuda.synchronize()
            saved.append(time.perf_counter())

    n0 = engine.ledger.events.mark()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if len(prompts) == 1:
        result = engine.run(prompts[0], events=events)
    else:
        result, _ = engine.run_queue(prompts, events=events)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    loads: dict[str, int] = {}
    for e in engine.ledger.events.since(n0):
        if e.kind == "load":
            loads[e.model.split(":")[0]] = loads.get(e.model.split(":")[0], 0) + 1
    classes = result.plan.classes
    return {"total_s": round(total, 4), "first_image_s": round(saved[0] - t0, 4) if saved else None,
            "images_s": [round(t - t0, 3) for t in saved], "loads": loads,
            "order": [classes[n] for n in result.plan.order if classes[n] in ("VGTextEncode", "VGSampler",
                                                                                "VGVAEDecode")]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--card", type=int, default=12)
    a = ap.parse_args()
    write_models(ROOT)
    folders = Folders(models=(ROOT / "models",), input=ROOT / "input", output=ROOT / "output", temp=ROOT / "temp")
    engine = Engine(folders, device="cuda", dtype="bf16", budget=budget_for("cuda", f"{a.card}GiB"))
    engine.run(prompt_for(a.side, 99))  # warm-up: pins every model, runs every kernel once
    prompts = [prompt_for(a.side, i) for i in range(a.n)]
    cases = {"single": [timed_run(engine, [prompt_for(a.side, 50 + k)]) for k in range(2)],
             "queue_new": timed_run(engine, prompts)}
    early = planner.finish_early
    planner.finish_early = lambda order, *args, **kw: list(order)  # the order before graph/plan/early.py
    try:
        cases["queue_old"] = timed_run(engine, [prompt_for(a.side, 20 + i) for i in range(a.n)])
    finally:
        planner.finish_early = early
    cases["queue_new_again"] = timed_run(engine, [prompt_for(a.side, 30 + i) for i in range(a.n)])
    single = min(c["total_s"] for c in cases["single"])
    new = min(cases["queue_new"]["total_s"], cases["queue_new_again"]["total_s"])
    first = min(cases["queue_new"]["first_image_s"], cases["queue_new_again"]["first_image_s"])
    summary = {
        "single_s": single, "first_image_new_s": first, "first_image_old_s": cases["queue_old"]["first_image_s"],
        "first_image_over_single": round(first / single, 3), "target_first_over_single": 1.3,
        "total_new_s": new, "total_old_s": cases["queue_old"]["total_s"],
        "total_new_over_old": round(new / cases["queue_old"]["total_s"], 3),
        "loads_new": cases["queue_new"]["loads"], "loads_old": cases["queue_old"]["loads"],
    }
    write_report(a.out, {"env": env(), "n": a.n, "side": a.side, "card_gib": a.card, "summary": summary,
                         "cases": cases, "gib": GiB})


if __name__ == "__main__":
    main()
