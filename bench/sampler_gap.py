"""What the resident sampler holds at its peak, in the engine's run and in bench/calibrate.py's direct call.

    python3 bench/sampler_gap.py OUT.json [--sides 1024,2048] [--steps 2]
    bash bench/run_device.sh sampler_gap                      (on the device machine: $OUT/sampler_gap.json)

Why: bench/results/oom_matrix.json measured the resident VGSampler 3.0-3.8 % over its estimate at 1536² and 2048²
(7-8 % over the unmargined formula, a slope of 23.4 bytes per token and hidden unit against the fitted 21.17), while
the calibration points (bench/results/calibrate.json, ops.run_sampler on a freshly built model) fit within 1 %. This
runs, at each side, on one H200 and uncapped:

- "engine": the shipped text-to-image workflow through the Engine (the CLI's), the executor's own measure of the
  sampler node;
- "loaded": ops.run_sampler directly on the transformer the engine loaded (the same module), calibrate.py's inputs;
- "built": the same call on a freshly built random model, as calibrate.py measures.

For each, torch's allocator history (torch.cuda.memory._record_memory_history) is replayed to the node's peak, and the
blocks alive there are grouped by the innermost frame of this repository that allocated them: the report names where
the difference is, so the estimate is fixed at its cause rather than refitted around it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch

sys.path.insert(0, str(Path(__file__).parent))
import oom_matrix
from _common import GiB, env, write_report
from plan_matrix import ROOT, reset, write_models
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import planner
from vramgraph.models.flux2 import KLEIN_4B, Flux2Transformer
from vramgraph.nodes import ops
from vramgraph.nodes.files import Folders
from vramgraph.nodes.values import Noise

REPO = str(Path(__file__).resolve().parents[1])


def _where(frames: list[dict]) -> str:
    """The innermost frame of this repository (else the innermost frame)."""
    for f in frames:
        if f.get("filename", "").startswith(REPO) or "/vramgraph/" in f.get("filename", ""):
            return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    return f"{Path(frames[0]['filename']).name}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def live_at_peak(snapshot: dict, base: int) -> dict:
    """Replay the allocator's trace: the peak of live bytes above `base`, and what was alive there by frame."""
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in snapshot["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _where(ev.get("frames", [])))
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        groups[where][0] += size
        groups[where][1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "peak_gib": round(peak / GiB, 4),
        "base_gib": round(base / GiB, 4),
        "live_at_peak": [{"where": w, "gib": round(s / GiB, 4), "blocks": n} for w, (s, n) in top],
    }


def recorded(fn, *args) -> tuple[int, dict, object]:
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    out = fn(*args)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return measured, live_at_peak(snap, base), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--sides", default="1024,2048")
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    write_models(ROOT)
    (ROOT / "input").mkdir(parents=True, exist_ok=True)
    folders = Folders(models=(ROOT / "models",), input=ROOT / "input", output=ROOT / "output", temp=ROOT / "temp")
    engine = Engine(folders, device="cuda", dtype="bf16", budget=budget_for("cuda"))
    engine.run(oom_matrix.prompt("text_to_image", 512, 1))  # warm-up: pins the models, runs each kernel once
    built = Flux2Transformer(KLEIN_4B).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    report: dict = {"env": env(), "steps": a.steps, "sides": {}}
    for side in (int(s) for s in a.sides.split(",")):
        reset(engine)
        prep = engine.prepare(oom_matrix.prompt("text_to_image", side, a.steps))
        sampler = next(
            s.step.node
            for s in prep.plan.steps
            if isinstance(s.step, planner.Run) and prep.prompt[s.step.node]["class_type"] == "VGSampler"
        )
        whole, whole_live, result = recorded(engine.run, prep)
        node = next(n for n in result.nodes if n.node == sampler)
        key = next(k for k in engine.ledger.on_gpu if "transformer" in k)
        loaded = engine.ledger.module(key)
        row = {
            "tokens": (side // 16) ** 2 + 512,
            "engine_node_measured_gib": round(node.measured_bytes / GiB, 4),
            "engine_node_predicted_gib": round(node.predicted_bytes / GiB, 4),
            "engine_whole_run": {"measured_gib": round(whole / GiB, 4), **whole_live},
        }
        h = side // 16
        lat = torch.zeros(1, 128, h, h)
        noise = Noise(1).generate_noise({"samples": lat})
        emb = torch.randn(1, 512, KLEIN_4B.context_dim).to(torch.bfloat16)  # calibrate.py's conditioning shape
        sigmas = [1.0 - i / a.steps * 0.5 for i in range(a.steps + 1)]
        for name, model in (("loaded", loaded), ("built", built)):
            m, live, _ = recorded(ops.run_sampler, model, noise, lat, emb, None, 1.0, sigmas, [])
            row[name] = {"measured_gib": round(m / GiB, 4), **live}
        row["module_check"] = {
            "loaded_dtypes": sorted({str(p.dtype) for p in loaded.parameters()}),
            "loaded_noncontiguous": sum(not p.is_contiguous() for p in loaded.parameters()),
            "loaded_buffers": sorted({f"{n}:{b.dtype}" for n, b in loaded.named_buffers()})[:20],
            "built_buffers": sorted({f"{n}:{b.dtype}" for n, b in built.named_buffers()})[:20],
            "loaded_type": type(loaded).__name__,
        }
        report["sides"][side] = row
        print(side, {k: (v if not isinstance(v, dict) else v.get("measured_gib")) for k, v in row.items()}, flush=True)
    write_report(a.out, report)


if __name__ == "__main__":
    main()
