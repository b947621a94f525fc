"""No OOM, and every node's GPU peak near its estimate, over cards x sizes x workflows (issue 13 item 3).

    python3 bench/oom_matrix.py OUT.json [--cards 6,8,10,12,16] [--sizes 512,1024,1536,2048]
            [--workflows text_to_image,edit,text_to_image_base] [--steps N] [--margin-gib X] [--reserve-gib X]
            [--context start|now] [--poll-ms 20] [--deadline-s 540]
    bash bench/run_device.sh oom_matrix --cards 6,8              (on the device machine: $OUT/oom_matrix.json)
    python3 bench/oom_matrix.py OUT.json --merge A.json B.json   (chunks into one report, the summary recomputed)
    python3 bench/oom_matrix.py OUT.json --cpu                   (tiny models on the CPU, cards in MiB)

One process, one Engine (the one the CLI uses), random bf16 weights at klein-4B shapes written once to /dev/shm
(bench/plan_matrix.py; the base workflow's transformer file is a hard link to them) and pinned by the engine. Each
cell is one image of one shipped workflow (text to image, the edit with a reference image of the cell's size, the base
model with CFG) at one size on one emulated card, and starts with every weight of its workflow in pinned host RAM and
nothing on the GPU. The report is written again after every cell, so a run stopped at its time limit keeps what it did.

The card, as `--vram CARD` emulates it: `budget_for` caps torch's allocator to the plan's budget + the reserve, the
budget being the card minus the CUDA context, `CARD_MARGIN` (`--margin-gib` overrides it) and the reserve. The context
counted is, with `--context start` (the default), the one this process measured when it started, before any kernel ran:
what `vramgraph run --vram CARD` measures in a fresh process, so the memory that kernels, library workspaces and the
second CUDA stream take later comes on top of the plan, as in the CLI, and the margin must hold it. `--context now`
measures it again before each cell, as bench/plan_matrix.py does (the margin then only holds what the cell adds).

Steps: the workflows' own step counts (4; the base model's 50) would spend most of the device time on the sampler, but
the plan can depend on the step count (at 12 GiB 1024² the 2-step text to image keeps 7 of the transformer's 25 blocks
on the GPU, the 4-step one 8: 22 of the 60 cells plan differently with 2 steps than with their own, planned on the CPU
with the h200 costs and the context estimate, every weight pinned as the cells start; the fewest steps that plan the
same were 1 to 4, 7 for the base model at 16 GiB 1536²). So each cell runs the fewest steps, from 2 on (so that a step
after the first is measured too), whose plan is the plan of the workflow's own step count, step for step (the same
loads, unloads, variants, resident blocks and predicted bytes; the predicted seconds aside), planned in the cell with
the engine's own cost probe. With the same plan the peaks do not depend on the step count: every step allocates and
frees the same activations, and a streamed model reuses the same staging buffers in every pass. `--steps N` runs N steps
instead (each cell says whether its plan is still the plan of its own steps).

Per cell: ok, rejected before running (`streaming_floor`: the budget is below what streaming can serve; `does_not_fit`:
any other planned rejection; both with the planner's message), oom (an allocation failed: the error, or a run that had
to plan its rest again after one, `recovered`) or error; the plan (loads, unloads, bytes moved and streamed, resident
blocks, variants, its table); per node the estimate (the activation, and for a streamed node also the weights it keeps
and its staging buffers) against torch's measured peak above the weights resident when the node started (the
executor's own measurement, engine/executor.py), and their ratio; torch's peak allocated and reserved; the device's
memory in use at its peak (cudaMemGetInfo polled every `--poll-ms`, and NVML's where nvidia-ml-py answers) minus the
card; the CUDA context (total - free - torch's reserved) before and after; the run's wall time (`seconds`) and the
cell's reset, pinning and planning before it (`prepare_s`).

`--cpu` runs the same cells on the CPU with tiny random-weight models (written once to /tmp/vramgraph-oom-matrix-cpu),
cards in MiB and no reserve (the CLI's 256 MiB would leave the tiny cards nothing): planning, the step search, the
rejections, the runs and the report, but no measurement (torch measures no peaks on the CPU; there is no context or
card margin there, so `--margin-gib` and `--context` change nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch

sys.path.insert(0, str(Path(__file__).parent))
import plan_cells
from _common import DevicePoll, GiB, env
from plan_matrix import ROOT, reset, write_models
from vramgraph.graph.engine import budget as budget_mod
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.engine.runtime import demo_image
from vramgraph.graph.plan import planner
from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
from vramgraph.nodes.files import Folders

MiB = 2**20
WORKFLOWS = "text_to_image,edit,text_to_image_base"
STREAMING_FLOOR = "streaming needs at least"  # graph/residency.floor_text: a budget below what streaming can serve
MIN_STEPS = 2  # a step after the first is measured too (a streamed model's blocks reused from the last pass)
CPU_ROOT = Path("/tmp/vramgraph-oom-matrix-cpu")
DEFAULTS = {False: ("6,8,10,12,16", "512,1024,1536,2048"), True: ("30,40,60,200", "128,256")}  # GPU, --cpu


def reference_name(side: int) -> str:
    return f"oom-reference-{side}.png"


def prompt(workflow: str, side: int, steps: int | None) -> dict:
    """The shipped workflow at side² with plan_cells' text and seed; `steps` on every node that has steps (None: the
    workflow's own); its image loaders read the reference picture of the same size."""
    p = plan_cells.prompts_for(f"{workflow}.json", side, 1)[0]
    for node in p.values():
        inputs = node.get("inputs", {})
        if steps is not None and isinstance(inputs.get("steps"), int):
            inputs["steps"] = steps
        if node.get("class_type") in ("VGLoadImage", "LoadImage"):
            inputs["image"] = reference_name(side)
    return p


def own_steps(p: dict) -> int:
    return max(n["inputs"]["steps"] for n in p.values() if isinstance(n.get("inputs", {}).get("steps"), int))


def plan_shape(plan: planner.Plan) -> list[tuple]:
    """What a plan does with GPU memory, step by step: its steps, variants, predicted bytes, resident models and
    blocks (the predicted seconds aside)."""
    return [(s.step.kind, sorted(vars(s.step).items()), s.gpu_bytes, s.resident, s.streams,
             None if s.blocks is None else (s.blocks.resident, s.blocks.staging)) for s in plan.steps]


def plan_steps(engine: Engine, workflow: str, side: int, steps: int | None, least: int = MIN_STEPS):
    """(steps to run, the workflow's own steps, the prepared prompt, whether its plan is the own steps' plan): the
    fewest steps from `least` on that plan as the workflow's own do, or `steps` when given. Raises planner.PlanError."""
    own_prompt = prompt(workflow, side, None)
    target = engine.prepare(own_prompt)
    own, shape = own_steps(own_prompt), plan_shape(target.plan)
    for k in [steps] if steps else range(least, own):
        prep = engine.prepare(prompt(workflow, side, k))
        same = plan_shape(prep.plan) == shape
        if same or steps:
            return k, own, prep, same
    return own, own, target, True


def context_now() -> int:
    """This process's device memory outside torch's allocator: total - free - reserved."""
    return budget_mod.cuda_context(torch.cuda.current_device())


def failure(e: BaseException) -> tuple[str, str]:
    """("oom" | "error", the error's text). A PlanError raised by a run (not by its preparation) comes from planning
    the rest again after an allocation failed: an OOM too."""
    text = f"{type(e).__name__}: {e}"
    kind = getattr(e, "exception_type", "")
    oom = (isinstance(e, torch.OutOfMemoryError | planner.PlanError) or "OutOfMemoryError" in kind
           or any(s in text.lower() for s in ("out of memory", "alloc_failed")))
    return ("oom" if oom else "error"), text[:3000]


def _gib(n: int | None, unit: int = GiB) -> float | None:
    return None if n is None else round(n / unit, 4)


def run_cell(engine: Engine, a: argparse.Namespace, workflow: str, card: int, side: int,
             start_context: int | None) -> dict:
    cuda = engine.device.type == "cuda"
    unit = GiB if cuda else MiB
    cell: dict = {"workflow": workflow, "card": card, "unit": "GiB" if cuda else "MiB", "side": side}
    # the CPU's cards are a few MiB (tiny models): no 256 MiB reserve there
    reserve = ("0B" if not cuda else None if a.reserve_gib is None else f"{int(a.reserve_gib * GiB)}B")

    def budget() -> planner.Budget:
        return budget_for(engine.device, f"{card}{cell['unit']}", reserve,
                          context=start_context if a.context == "start" else None)

    t0 = time.perf_counter()
    try:
        reset(engine)
        engine.budget = budget()
        engine.prepare(prompt(workflow, side, None))  # registers its models (another workflow's run dropped them)
        reset(engine)  # every weight of this workflow in pinned host RAM, nothing on the GPU
        context_before = context_now() if cuda else None
        engine.budget = budget()
        steps, own, prep, same = plan_steps(engine, workflow, side, a.steps)
    except planner.PlanError as e:
        cell.update(status="rejected", budget=_gib(engine.budget.gpu, unit), rejected={
            "kind": "streaming_floor" if STREAMING_FLOOR in e.message else "does_not_fit", "node": e.node,
            "class_type": e.class_type, "min_budget_gib": e.extra.get("min_budget_gib"), "message": e.message})
        return cell
    except ValueError as e:  # budget_for: the card leaves nothing after the context and the margin
        cell.update(status="error", error=f"{type(e).__name__}: {e}")
        return cell
    b, p = engine.budget, prep.plan
    runs = {s.step.node: s for s in p.steps if isinstance(s.step, planner.Run)}
    cell.update(
        steps=steps, own_steps=own, plan_is_own_steps_plan=same, prepare_s=round(time.perf_counter() - t0, 3),
        budget=_gib(b.gpu, unit), reserve=_gib(b.reserve, unit), outside_allocator=_gib(b.outside_allocator, unit),
        plan={"loads": p.loads, "unloads": sum(isinstance(s.step, planner.Unload) for s in p.steps),
              "moved_gib": _gib(p.bytes_moved), "streamed_gib": _gib(p.streamed_bytes), "peak": _gib(p.peak, unit),
              "variants": {n: s.step.variant for n, s in runs.items()},
              "resident_blocks": {n: f"{len(s.blocks.resident)}/{s.blocks.n}" for n, s in runs.items() if s.blocks},
              "streaming": p.streaming_lines(), "table": p.table()},
        context_before_gib=_gib(context_before))
    events: list[dict] = []

    def listen(kind: str, data: dict) -> None:
        if kind in ("vg_replan", "vg_estimate_exceeded"):
            events.append({"event": kind, **{k: v for k, v in data.items() if k != "plan"}})

    n_moves = engine.ledger.events.mark()
    engine.peaks(reset=True)
    result, error = None, None
    t0 = time.perf_counter()
    with DevicePoll(a.poll_ms / 1000) if cuda else contextlib.nullcontext() as poll:
        try:
            result = engine.run(prep, events=listen)
        except Exception as e:  # reported, never hidden: the acceptance counts these
            error = failure(e)
    cell["seconds"] = round(time.perf_counter() - t0, 3)
    if error is not None:
        cell.update(status=error[0], error=error[1])
    elif result.replans or any(e["event"] == "vg_replan" for e in events):
        cell.update(status="oom", recovered=True, error="an allocation failed and the rest of the run was planned "
                    "again (no other process holds memory here)")
    else:
        cell["status"] = "ok"
    cell["events"] = events
    cell["moves"] = [{"kind": e.kind, "model": e.model.split(":")[0], "source": e.source,
                      "seconds": round(e.seconds, 4), "gib": _gib(e.nbytes)}
                     for e in engine.ledger.events.since(n_moves)]
    if result is not None:
        cell["ran"] = {"loads": result.loads, "unloads": result.unloads, "replans": len(result.replans)}
        cell["nodes"] = [node_row(n, prep, runs, cuda) for n in result.nodes
                         if n.variant != "host" and (n.predicted_bytes or n.measured_bytes)]
    if cuda:
        alloc, reserved = engine.peaks()
        after = context_now()
        cell.update(context_after_gib=_gib(after), torch_peak_allocated_gib=_gib(alloc),
                    torch_peak_reserved_gib=_gib(reserved), device_used_peak_gib=_gib(poll.peak),
                    device_samples=poll.samples, device_peak_minus_card_gib=_gib(poll.peak - card * GiB),
                    reserved_plus_context_minus_card_gib=_gib(reserved + after - card * GiB),
                    nvml_used_peak_gib=_gib(poll.nvml_peak), nvml_process_peak_gib=_gib(poll.nvml_process_peak))
    return cell


def node_row(n, prep, runs: dict, cuda: bool) -> dict:
    """One node's estimate against its measured peak (both above the weights resident when it started)."""
    chosen = next(v for v in prep.costs[n.node].variants if v.name == n.variant)
    row = {"node": n.node, "class_type": n.class_type, "variant": n.variant, "seconds": round(n.seconds, 4),
           "estimate_gib": _gib(n.predicted_bytes), "measured_gib": _gib(n.measured_bytes) if cuda else None,
           "measured_over_estimate": round(n.measured_bytes / n.predicted_bytes, 4)
           if cuda and n.predicted_bytes else None}  # the CPU measures nothing
    s = runs.get(n.node)
    if s is not None and s.blocks is not None and chosen.blocks is not None:
        # a streamed node's estimate also holds the weights it keeps on the GPU and its staging buffers; its
        # activation alone is the measured peak minus those bytes (derived: the weights' bytes are exact)
        act, weights = chosen.blocks.activation, n.predicted_bytes - chosen.blocks.activation
        row.update(blocks_resident=f"{len(s.blocks.resident)}/{s.blocks.n}", staging_gib=_gib(s.blocks.staging),
                   weights_in_estimate_gib=_gib(weights), activation_estimate_gib=_gib(act),
                   activation_measured_over_estimate=round((n.measured_bytes - weights) / act, 4)
                   if cuda and act else None)
    return row


def summarize(cells: list[dict]) -> dict:
    """The acceptance numbers: cells ok / rejected / OOM, measured/estimate per node kind, the nodes over +3 % and
    outside ±10 %, and per card the most the device's memory in use passed the card."""
    def where(c: dict) -> str:
        return f"{c['workflow']} {c['card']} {c['unit']} {c['side']}²"

    nodes = [(c, n) for c in cells for n in c.get("nodes", []) if n["measured_over_estimate"] is not None]
    kinds: dict[str, list[float]] = {}
    for _, n in nodes:
        kinds.setdefault(f"{n['class_type']}/{n['variant']}", []).append(n["measured_over_estimate"])
    streamed = [n["activation_measured_over_estimate"] for _, n in nodes
                if n.get("activation_measured_over_estimate") is not None]
    unmeasured = [(c, n) for c in cells for n in c.get("nodes", []) if n["measured_over_estimate"] is None
                  and n["measured_gib"]]  # measured with no estimate (CPU rows have no measurement at all)

    def listed(rows: list) -> list[str]:
        return [f"{where(c)} node {n['node']} {n['class_type']}/{n['variant']}: {n['measured_gib']} GiB measured, "
                f"{n['estimate_gib']} estimated ({n['measured_over_estimate']})" for c, n in rows]

    over = [(c, n) for c, n in nodes if n["measured_over_estimate"] > 1.03] + unmeasured
    outside = [(c, n) for c, n in nodes if not 0.9 <= n["measured_over_estimate"] <= 1.1] + unmeasured
    by_card: dict[str, dict] = {}
    for c in cells:
        if c.get("device_peak_minus_card_gib") is None:
            continue
        d = by_card.setdefault(f"{c['card']} {c['unit']}", {"device": None, "nvml": None, "at": None})
        if d["device"] is None or c["device_peak_minus_card_gib"] > d["device"]:
            d.update(device=c["device_peak_minus_card_gib"], at=where(c))
        if c.get("nvml_used_peak_gib") is not None:
            d["nvml"] = max(d["nvml"] or -1e9, round(c["nvml_used_peak_gib"] - c["card"], 4))
    steps: dict[str, int] = {}
    for c in cells:
        if "steps" in c:
            steps[f"{c['steps']} of {c['own_steps']}"] = steps.get(f"{c['steps']} of {c['own_steps']}", 0) + 1
    status = [c.get("status") for c in cells]
    return {
        "cells": len(cells), "ok": status.count("ok"), "rejected": status.count("rejected"),
        "oom": status.count("oom"), "error": status.count("error"),
        "rejected_cells": [f"{where(c)}: {c['rejected']['kind']}: {c['rejected']['message']}" for c in cells
                           if c.get("status") == "rejected"],
        "oom_cells": [f"{where(c)}: {c['error']}" for c in cells if c.get("status") == "oom"],
        "error_cells": [f"{where(c)}: {c['error']}" for c in cells if c.get("status") == "error"],
        "nodes_measured": len(nodes),
        "measured_over_estimate": {"min": min((n["measured_over_estimate"] for _, n in nodes), default=None),
                                   "max": max((n["measured_over_estimate"] for _, n in nodes), default=None)},
        "measured_over_estimate_by_kind": {k: {"n": len(v), "min": min(v), "max": max(v)}
                                           for k, v in sorted(kinds.items())},
        "streamed_activation_measured_over_estimate": {"min": min(streamed, default=None),
                                                       "max": max(streamed, default=None), "n": len(streamed)},
        "nodes_over_3pct": len(over), "nodes_outside_10pct": len(outside),
        "over_3pct": listed(over), "outside_10pct": listed(outside),
        "device_peak_minus_card_gib_max": by_card,  # > 0: a real card of that size would have run out
        "over_card_cells": [where(c) for c in cells if (c.get("device_peak_minus_card_gib") or 0) > 0],
        "plans_not_the_own_steps_plan": [where(c) for c in cells if c.get("plan_is_own_steps_plan") is False],
        "steps_run": steps,
        "seconds": round(sum(c.get("seconds", 0) + c.get("prepare_s", 0) for c in cells), 1),
    }


def write(path: Path, report: dict) -> None:
    report["summary"] = summarize(report["cells"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)  # a run killed at its limit leaves the last whole report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--cards", default=None, help="card sizes in GiB (--cpu: MiB); default 6,8,10,12,16")
    ap.add_argument("--sizes", default=None, help="image sides; default 512,1024,1536,2048")
    ap.add_argument("--workflows", default=WORKFLOWS, help="shipped workflows (names in workflows/, without .json)")
    ap.add_argument("--steps", type=int, default=None, help="steps per image (default: the fewest that plan as the "
                    "workflow's own steps do)")
    ap.add_argument("--margin-gib", type=float, default=None, help="CARD_MARGIN for this run (graph/engine/budget.py)")
    ap.add_argument("--reserve-gib", type=float, default=None, help="--reserve for this run (graph/plan/planner.py "
                    "DEFAULT_RESERVE by default)")
    ap.add_argument("--context", choices=("start", "now"), default="start", help="the CUDA context the budget counts: "
                    "measured at this process's start (a fresh CLI process), or before each cell")
    ap.add_argument("--poll-ms", type=float, default=20.0, help="device memory sampling period")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no cell after this many seconds")
    ap.add_argument("--cpu", action="store_true", help="tiny random-weight models on the CPU (the same code path; "
                    "nothing is measured there), cards in MiB, models in " + str(CPU_ROOT))
    ap.add_argument("--merge", nargs="+", default=None, metavar="REPORT", help="merge chunk reports into OUT")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.merge:
        parts = [json.loads(Path(m).read_text()) for m in a.merge]
        write(out, {"merged_from": [str(m) for m in a.merge], "env": parts[0].get("env"),
                    "runs": [{k: v for k, v in r.items() if k not in ("cells", "summary")} for r in parts],
                    "cells": [c for r in parts for c in r["cells"]]})
        print(json.dumps(json.loads(out.read_text())["summary"], indent=1))
        return
    t_start = time.perf_counter()
    cuda = not a.cpu
    # the context a fresh process measures (graph/engine/budget.py: after cuBLAS is initialised), before this one has
    # run any other kernel; without the BLAS workspace and the card margin, which budget_for adds to the context it is
    # given (Budget.outside_allocator holds all three: the bench counted the margin twice up to 03574f7)
    if cuda:
        budget_mod.blas_workspace(0)
    start_context = budget_mod.cuda_context(0) if cuda else None
    if a.margin_gib is not None:
        budget_mod.CARD_MARGIN = int(a.margin_gib * GiB)  # read by card_budget at every budget_for
    cards = [int(c) for c in (a.cards or DEFAULTS[a.cpu][0]).split(",")]
    sides = [int(s) for s in (a.sizes or DEFAULTS[a.cpu][1]).split(",")]
    workflows = a.workflows.split(",")
    root = ROOT if cuda else CPU_ROOT
    if cuda:
        write_models(root)
    elif not (root / "models").is_dir():
        write_tiny_models(root / "models", names=SHIPPED_NAMES)
    (root / "input").mkdir(parents=True, exist_ok=True)
    for side in sides:
        demo_image((side, side)).save(root / "input" / reference_name(side))
    folders = Folders(models=(root / "models",), input=root / "input", output=root / "output", temp=root / "temp")
    device = "cuda" if cuda else "cpu"
    engine = Engine(folders, device=device, dtype="bf16" if cuda else "fp32", budget=budget_for(device))
    for wf in workflows:  # warm-up, uncapped: pins every model and runs each kind of kernel once
        engine.run(prompt(wf, min(sides), 1))
    report = {"env": env(), "args": vars(a), "card_margin_gib": budget_mod.CARD_MARGIN / GiB,
              "start_context_gib": _gib(start_context),
              "blas_workspace_gib": _gib(budget_mod.blas_workspace(0)) if cuda else None,
              "setup_s": round(time.perf_counter() - t_start, 1), "cells": [], "not_run": []}
    for wf in workflows:  # the text to image and the edit share their models: few re-reads of pinned copies
        for card in cards:
            for side in sides:
                if time.perf_counter() - t_start > a.deadline_s:
                    report["not_run"].append([wf, card, side])
                    continue
                cell = run_cell(engine, a, wf, card, side, start_context)
                report["cells"].append(cell)
                write(out, report)
                print(json.dumps({k: cell.get(k) for k in (
                    "workflow", "card", "side", "status", "steps", "own_steps", "seconds", "device_peak_minus_card_gib",
                    "context_before_gib", "context_after_gib")}), "max measured/estimate:", max(
                    (n["measured_over_estimate"] for n in cell.get("nodes", [])
                     if n["measured_over_estimate"] is not None), default=None), flush=True)
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0)
    write(out, report)
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
