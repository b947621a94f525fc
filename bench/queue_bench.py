"""A queue of 8 prompts at 1024² on the H200: planned as one graph under a 12 GiB card vs uncapped, and
the cost of step previews.

    python3 bench/queue_bench.py OUT.json [--n 8] [--side 1024] [--card 12]

Same random klein-4B checkpoints and Engine as bench/plan_matrix.py; every case starts with all weights
in pinned host RAM and nothing on the GPU. Cases: the queue uncapped, the queue on the card, the queue
on the card with a preview every step, and (for scale) the same prompts one by one on the card.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import GiB, env
from plan_matrix import ROOT, prompt_for, reset, write_models
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import planner
from vramgraph.nodes.files import Folders


def case(engine: Engine, card: int | None, prompts: list[dict], queued: bool, previews: bool) -> dict:
    reset(engine)
    engine.budget = budget_for("cuda", f"{card}GiB" if card else None)
    engine.previews = previews
    frames = []

    def events(kind: str, data: dict) -> None:
        if kind == "preview":
            frames.append(data["step"])

    n0 = engine.ledger.events.mark()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if queued:
        result, images = engine.run_queue(prompts, events=events)
        plans = [result.plan]
    else:
        plans, images = [], []
        for p in prompts:
            r = engine.run(p, events=events)
            plans.append(r.plan)
            images.append(r.images)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    moves = engine.ledger.events.since(n0)
    loads = {}
    for e in moves:
        if e.kind == "load":
            label = e.model.split(":")[0]
            loads[label] = loads.get(label, 0) + 1
    return {"card_gib": card, "queued": queued, "previews": previews, "seconds": round(seconds, 4),
            "images": sum(len(g) for g in images), "loads": loads,
            "unloads": sum(1 for e in moves if e.kind == "unload"), "preview_frames": len(frames),
            "decodes": sorted({p.variant_of(n) for p in plans for n in p.order if p.classes[n] == "VGVAEDecode"}),
            "plan": plans[0].table() if queued else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--card", type=int, default=12)
    a = ap.parse_args()
    write_models(ROOT)
    folders = Folders(models=(ROOT / "models",), input=ROOT / "input", output=ROOT / "output", temp=ROOT / "temp")
    engine = Engine(folders, device="cuda", dtype="bf16", budget=budget_for("cuda"))
    engine.run(prompt_for(a.side, 99))  # warm-up: pins every model, runs every kernel once
    prompts = [prompt_for(a.side, i) for i in range(a.n)]
    cases = {}
    for name, card, queued, previews in (("uncapped_queue", None, True, False), ("card_queue", a.card, True, False),
                                         ("card_queue_previews", a.card, True, True),
                                         ("uncapped_queue_previews", None, True, True),
                                         ("card_one_by_one", a.card, False, False),
                                         ("uncapped_queue_again", None, True, False)):
        try:
            cases[name] = case(engine, card, prompts, queued, previews)
        except planner.PlanError as e:
            cases[name] = {"rejected": e.to_dict()}
        print(name, json.dumps({k: v for k, v in cases[name].items() if k != "plan"}), flush=True)
    unc = min(cases["uncapped_queue"]["seconds"], cases["uncapped_queue_again"]["seconds"])
    summary = {
        "card_queue_over_uncapped_queue": round(cases["card_queue"]["seconds"] / unc, 3),
        "card_queue_loads": cases["card_queue"]["loads"],
        "previews_over_no_previews_card": round(cases["card_queue_previews"]["seconds"]
                                                / cases["card_queue"]["seconds"], 3),
        "previews_over_no_previews_uncapped": round(cases["uncapped_queue_previews"]["seconds"] / unc, 3),
        "one_by_one_over_queue_card": round(cases["card_one_by_one"]["seconds"] / cases["card_queue"]["seconds"], 3),
        "uncapped_runs_s": [cases["uncapped_queue"]["seconds"], cases["uncapped_queue_again"]["seconds"]],
    }
    report = {"env": env(), "n": a.n, "side": a.side, "card_gib": a.card, "cases": cases, "summary": summary,
              "gib": GiB}
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
