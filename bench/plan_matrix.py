"""Planned residency on the H200 under emulated cards: budgets x sizes, two images each, vs diffusers offload.

    python3 bench/plan_matrix.py OUT.json [--calibrate] [--sizes 512,1024,1536,2048] [--cards 0,80,24,16,12,10,8]
    python3 bench/plan_matrix.py OUT.json --plan-only      (no GPU: the planner over workflows x cards x sizes x
                                                            queues, bench/plan_cells.py)

Random weights at klein-4B shapes are written once as ComfyUI-layout files in /dev/shm (host RAM) and
pinned by the engine; every cell starts with all weights in pinned host RAM and nothing on the GPU. A
cell runs the shipped text-to-image workflow twice (new prompt text, new seed) through the same Engine
the CLI uses, with `--vram CARD` semantics (torch allocator capped to the card minus this process's
CUDA context). Reported per cell: the plan, per-node predicted vs measured activation peak, loads and
unloads, the decode variant, times and their ratio to the uncapped cell of the same size, and planning
time. diffusers' Flux2KleinPipeline with enable_model_cpu_offload runs the same budgets at 1024² in the
same process. `--calibrate` instead measures the raw activation peaks the estimate constants are fitted on.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from _common import GiB, env, peak_bytes
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import planner
from vramgraph.models.flux2 import KLEIN_4B, Flux2Transformer
from vramgraph.models.qwen3 import Qwen3Config, Qwen3Encoder
from vramgraph.models.tiny import SHIPPED_NAMES
from vramgraph.models.vae import Flux2VAE
from vramgraph.nodes.files import Folders

ROOT = Path("/dev/shm/vg")
WORKFLOW = Path(__file__).parents[1] / "workflows" / "text_to_image.json"


def write_models(root: Path) -> None:
    """Real-shape random bf16 checkpoints in ComfyUI layout (built on the GPU, saved to host RAM); the base
    transformer's file name (text_to_image_base.json) is a hard link to the same weights."""
    parts = {
        f"diffusion_models/{SHIPPED_NAMES['transformer'][0]}": lambda: Flux2Transformer(KLEIN_4B),
        f"text_encoders/{SHIPPED_NAMES['text_encoder']}": lambda: Qwen3Encoder(Qwen3Config()),
        f"vae/{SHIPPED_NAMES['vae']}": lambda: Flux2VAE(),
    }
    for rel, build in parts.items():
        path = root / "models" / rel
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = build()
        sd = {k: v.to(torch.bfloat16).cpu().contiguous() for k, v in m.state_dict().items()}
        if "text_encoders" in rel:
            sd = {"model." + k: v for k, v in sd.items()}
        del m
        torch.cuda.empty_cache()
        save_file(sd, str(path))
    models = root / "models" / "diffusion_models"
    for name in SHIPPED_NAMES["transformer"][1:]:
        if not (models / name).exists():
            os.link(models / SHIPPED_NAMES["transformer"][0], models / name)


def pinned_h2d() -> float:
    x = torch.empty(2 * GiB, dtype=torch.uint8).pin_memory()
    y = torch.empty_like(x, device="cuda")
    y.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        y.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    bw = 3 * x.numel() / (time.perf_counter() - t0)
    del x, y
    torch.cuda.empty_cache()
    return bw


def reset(engine: Engine) -> None:
    """Start of a cell: all weights in pinned host RAM, nothing on the GPU, no cached outputs."""
    engine.cache.clear()
    for key in list(engine.ledger.entries):
        engine.ledger.ensure_pinned(key)  # a model the last plan never pinned would otherwise reload from the file
    for key in list(engine.ledger.on_gpu):
        engine.ledger.unload(key, "pinned")
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def prompt_for(side: int, i: int) -> dict:
    p = json.loads(WORKFLOW.read_text())
    p["4"]["inputs"]["text"] = f"A lighthouse on a cliff at dusk, photo number {i}"
    p["5"]["inputs"].update(width=side, height=side)
    p["6"]["inputs"]["seed"] = 100 + i
    return p


def run_cell(engine: Engine, card: int, side: int) -> dict:
    reset(engine)
    engine.budget = budget_for("cuda", f"{card}GiB" if card else None)
    # outside_allocator: the context, the BLAS workspace and the card margin, which the budget leaves out
    cell = {"card_gib": card or None, "side": side, "budget_gib": round(engine.budget.gpu / GiB, 3),
            "outside_allocator_gib": round(engine.budget.outside_allocator / GiB, 3), "images": []}
    for i in range(2):
        prompt = prompt_for(side, i)
        t0 = time.perf_counter()
        try:
            prep = engine.prepare(prompt)
        except planner.PlanError as e:
            cell["rejected"] = e.to_dict()
            return cell
        t_prepare = time.perf_counter() - t0
        t0 = time.perf_counter()
        node_costs, models = _planner_inputs(engine, prep)
        start = planner.Residency(engine.ledger.on_gpu, engine.ledger.pinned)
        todo = prep.dag.subgraph(n for n in prep.dag.nodes if n not in prep.cached).copy()
        planner.plan(todo, {n: node_costs[n] for n in todo.nodes}, models, engine.budget, engine.cost,
                     start)
        t_plan = time.perf_counter() - t0
        n_events = engine.ledger.events.mark()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            result = engine.run(prep)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        except Exception as e:  # reported, never hidden: the acceptance counts these
            cell["images"].append({"error": f"{type(e).__name__}: {e}"[:2000]})
            return cell
        events = engine.ledger.events.since(n_events)
        cell["images"].append({
            "seconds": round(seconds, 4), "prepare_ms": round(t_prepare * 1e3, 3), "plan_ms": round(t_plan * 1e3, 3),
            "loads": result.loads, "unloads": result.unloads,
            "decode": prep.plan.variant_of("7"), "encoder_on_gpu": prep.plan.variant_of("4") == "gpu",
            "nodes": [{"node": n.node, "class_type": n.class_type, "variant": n.variant,
                       "seconds": round(n.seconds, 4), "predicted_gib": round(n.predicted_bytes / GiB, 4),
                       "measured_gib": round(n.measured_bytes / GiB, 4),
                       "ratio": round(n.predicted_bytes / n.measured_bytes, 4) if n.measured_bytes else None}
                      for n in result.nodes if n.variant != "host"],
            "moves": [{"kind": e.kind, "model": e.model.split(":")[0], "source": e.source,
                       "seconds": round(e.seconds, 4), "gib": round(e.nbytes / GiB, 3)} for e in events],
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 3),
            "plan": prep.plan.table(),
        })
    return cell


def _planner_inputs(engine: Engine, prep):  # the planner alone, timed apart from validation and estimates
    from vramgraph.graph.workflow import estimate

    node_costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
    for key, e in engine.ledger.entries.items():
        models.setdefault(key, planner.ModelCost(key, e.info.nbytes, e.info.label))
    return node_costs, models


def diffusers_cells(cards: list[int], sides: list[int]) -> list[dict]:
    from _common import ref_qwen3, ref_transformer, ref_vae
    from speed import diffusers_pipeline

    dt = torch.bfloat16
    tr, ae, te = ref_transformer(dt), ref_vae(dt), ref_qwen3(dt)
    tr, ae, te = tr.cpu(), ae.cpu(), te.cpu()
    torch.cuda.empty_cache()
    pipe = diffusers_pipeline(tr, te, ae)
    pipe.enable_model_cpu_offload()
    out = []
    for card in cards:
        for side in sides:
            torch.cuda.empty_cache()
            b = budget_for("cuda", f"{card}GiB" if card else None)
            cell = {"card_gib": card or None, "side": side, "budget_gib": round(b.gpu / GiB, 3), "images": []}
            for i in range(2):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        pipe(prompt=f"A lighthouse on a cliff at dusk, photo number {i}", height=side, width=side,
                             num_inference_steps=4, generator=torch.Generator("cpu").manual_seed(100 + i),
                             output_type="pil")
                    torch.cuda.synchronize()
                    cell["images"].append({"seconds": round(time.perf_counter() - t0, 4),
                                           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 3)})
                except torch.OutOfMemoryError as e:
                    cell["images"].append({"error": f"OutOfMemoryError: {str(e)[:300]}"})
                    break
            out.append(cell)
            print(json.dumps(cell), flush=True)
    return out


def calibrate(engine: Engine) -> dict:
    """Raw activation peaks of the heavy operations at several shapes (what the estimates are fitted on)."""
    from vramgraph.nodes import ops
    from vramgraph.nodes.values import Noise

    prep = engine.prepare(prompt_for(1024, 0))
    engine.run(prep)
    led = engine.ledger
    for k in list(led.entries):
        led.load(k, "pinned")
    mods = {e.info.kind: led.module(k) for k, e in led.entries.items()}
    tok = engine.tokenizer(None)
    out = {"text_encode": [], "sampler": [], "decode": [], "tiled": [], "vae_encode": []}
    with torch.no_grad():
        out["text_encode"].append({"batch": 1, "bytes": peak_bytes(
            ops.encode_text, mods["text_encoder"], tok, ["a lighthouse"])})
        emb = ops.encode_text(mods["text_encoder"], tok, ["a lighthouse"])
        for side in (256, 512, 768, 1024, 1536, 2048):
            h = side // 16
            lat = torch.zeros(1, 128, h, h)
            nz = Noise(1).generate_noise({"samples": lat})
            for cfg, refs in ((1.0, 0), (4.0, 0), (1.0, 1), (1.0, 2)):
                if refs and side not in (512, 1024):
                    continue
                ref_lats = [torch.randn(1, 128, 64, 64) for _ in range(refs)]
                b = peak_bytes(ops.run_sampler, mods["transformer"], nz, lat, emb, emb if cfg != 1 else None,
                            cfg, [1.0, 0.5], ref_lats)
                out["sampler"].append({"side": side, "cfg": cfg, "refs": refs, "tokens": h * h + 512 + refs * 4096,
                                       "batch": 2 if cfg != 1 else 1, "bytes": b})
            lat = torch.randn(1, 128, h, h)
            out["decode"].append({"side": side, "bytes": peak_bytes(ops.vae_decode, mods["vae"], lat, "gpu")})
            if side >= 1536:
                out["tiled"].append({"side": side,
                                     "bytes": peak_bytes(ops.vae_decode, mods["vae"], lat, "tiled")})
            if side <= 1024:
                img = torch.rand(1, side, side, 3)
                out["vae_encode"].append({"side": side, "bytes": peak_bytes(ops.vae_encode, mods["vae"], img)})
            print(side, flush=True)
    return out


def summarize(report: dict) -> dict:
    """The acceptance numbers, as ratios measured in this run."""
    cells = [c for c in report["ours"] if "rejected" not in c]
    total = {(c["card_gib"], c["side"]): sum(i["seconds"] for i in c["images"]) for c in cells}
    unc = {side: t for (card, side), t in total.items() if card is None}
    bw = report["pinned_h2d_GBps"] * 1e9
    reloads = [m["seconds"] / (m["gib"] * GiB / bw) for c in cells for i in c["images"] for m in i["moves"]
               if m["kind"] == "load" and m["model"] == "transformer" and m["source"] == "pinned"]
    ratios = [n["ratio"] for c in cells for i in c["images"] for n in i["nodes"] if n["ratio"]]
    diff = {(c["card_gib"], c["side"]): sum(i["seconds"] for i in c["images"]) for c in report["diffusers_offload"]
            if all("seconds" in i for i in c["images"])}
    c12 = next(c for c in cells if c["card_gib"] == 12 and c["side"] == 1024)
    c80 = next(c for c in cells if c["card_gib"] == 80 and c["side"] == 1024)
    return {
        "time_vs_uncapped": {f"{card}GiB/{side}": round(t / unc[side], 3) for (card, side), t in total.items()
                             if card is not None},
        "cap12_1024": {"ratio_vs_uncapped": round(total[(12, 1024)] / unc[1024], 3),
                       "decoded_on_gpu": [i["decode"] for i in c12["images"]],
                       "encoder_on_gpu": [i["encoder_on_gpu"] for i in c12["images"]],
                       "diffusers_offload_over_ours": round(diff[(12, 1024)] / total[(12, 1024)], 2)
                       if (12, 1024) in diff else None},
        "diffusers_offload_over_ours_1024": {f"{card}GiB": round(diff[(card, 1024)] / total[(card, 1024)], 2)
                                             for (card, side) in diff if (card, side) in total and side == 1024},
        "cap80_second_image_loads": [i["loads"] for i in c80["images"]][1],
        "plan_ms_max": max(i["plan_ms"] for c in cells for i in c["images"]),
        "estimate_over_measured": {"min": min(ratios), "max": max(ratios), "nodes": len(ratios)},
        "transformer_reload_over_bytes_per_pinned_bw": {"min": round(min(reloads), 3),
                                                        "max": round(max(reloads), 3), "n": len(reloads)},
        "errors": [(c["card_gib"], c["side"], i["error"]) for c in report["ours"] for i in c["images"]
                   if "error" in i],
        "rejected_before_running": [(c["card_gib"], c["side"]) for c in report["ours"] if "rejected" in c],
    }


def main() -> None:
    if "--plan-only" in sys.argv:  # the planner alone, on the CPU: bench/plan_cells.py
        import plan_cells

        plan_cells.main(sys.argv[1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--sizes", default="512,1024,1536,2048")
    ap.add_argument("--cards", default="0,80,24,16,12,10,8")
    ap.add_argument("--diffusers-sizes", default="1024")
    ap.add_argument("--diffusers-cards", default=None, help="default: the same as --cards")
    ap.add_argument("--summarize", action="store_true", help="only (re)compute the summary of an existing OUT.json")
    a = ap.parse_args()
    if a.summarize:
        report = json.loads(Path(a.out).read_text())
        report["summary"] = summarize(report)
        Path(a.out).write_text(json.dumps(report, indent=1))
        return
    t0 = time.perf_counter()
    write_models(ROOT)
    folders = Folders(models=(ROOT / "models",), input=ROOT / "input", output=ROOT / "output", temp=ROOT / "temp")
    engine = Engine(folders, device="cuda", dtype="bf16", budget=budget_for("cuda"))
    report = {"env": env(), "setup_s": round(time.perf_counter() - t0, 1)}
    if a.calibrate:
        report["calibration"] = calibrate(engine)
        Path(a.out).write_text(json.dumps(report, indent=1))
        return
    report["pinned_h2d_GBps"] = round(pinned_h2d() / 1e9, 2)
    prompt = prompt_for(1024, 0)  # warm-up: pins every model and runs each kernel once
    engine.run(copy.deepcopy(prompt))
    cells = []
    for card in [int(c) for c in a.cards.split(",")]:
        for side in [int(s) for s in a.sizes.split(",")]:
            cell = run_cell(engine, card, side)
            cells.append(cell)
            print(json.dumps({k: v for k, v in cell.items() if k != "images"},), [
                {k: im.get(k) for k in ("seconds", "loads", "unloads", "decode", "error")} for im in cell["images"]],
                flush=True)
    report["ours"] = cells
    engine.free()
    torch.cuda.set_per_process_memory_fraction(1.0)
    report["diffusers_offload"] = diffusers_cells([int(c) for c in (a.diffusers_cards or a.cards).split(",")],
                                                  [int(s) for s in a.diffusers_sizes.split(",")])
    report["summary"] = summarize(report)
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
