"""The planner alone over workflows x cards x sizes x queue lengths, on the CPU (no GPU, no weights).

    python3 bench/plan_cells.py OUT.json [--cards 6,8,10,12,16,24,80] [--sizes 512,1024,1536,2048]
                                         [--queues 1,2,8] [--profile h200] [--host 64GiB]
    python3 bench/plan_matrix.py OUT.json --plan-only ...      (the same)

Every shipped workflow is planned with the built-in klein-4B sizes, for each card with the budget the GPU run
computes for that card (engine/budget.py `card_budget`, with the CUDA context estimate) and --host of host RAM (64 GiB
unless told: pinned copies of every model fit, as on the GPU host, whatever this machine has free), as one queue of N
prompts (new text and seed each, as `vramgraph run a.json b.json` or `generate -p .. -p ..` plans them).
Reported per cell: rejected (which node, the budget it would need), loads, bytes moved by Load steps
(`gib_moved`) and by streaming (`gib_streamed`: each streamed node's resident blocks uploaded once and its streamed
blocks in every pass, Plan.streamed_bytes), the predicted seconds, the planner's own time (`planner.plan` on the
estimated queue, validation and estimates apart), and `grouped_gib`: the fewest bytes, loads and streaming
together, that any whole-model residency moves when the same runs (the same variants) go in the grouped order
(encode every prompt, then each later stage for every prompt), by an exact dynamic programme over the resident sets
(as ../shared/tools/plan_bound.py, with this cell's sizes); a streamed run there costs the bytes of the blocks the
planner would keep and stream in the room that resident set leaves (graph/plan/residency.py `choose`), so a VAE kept
beside a streamed sampler is paid for in streamed blocks, as in the plan. The acceptance is gib_moved + gib_streamed
<= 1.05 x grouped_gib in every cell, and planning time for 64 queued prompts.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ("text_to_image.json", "text_to_image_base.json", "edit.json", "multi_reference.json",
             "core_text_to_image.json")
GiB = 2**30
INPUT = Path(tempfile.gettempdir()) / "vramgraph-plan-cells-input"
HOST = "64GiB"  # host RAM for pinned copies and outputs: all fit, as on the GPU host, whatever this machine has free


def _import():
    sys.path.insert(0, str(ROOT.parent))  # the checkout is importable as `vramgraph` from its parent
    try:
        import vramgraph  # noqa: F401
    except ImportError:
        pass


def prompts_for(workflow: str, side: int, n: int) -> list[dict]:
    from vramgraph.api.pipeline import load, resize

    out = []
    for i in range(n):
        wf = load(ROOT / "workflows" / workflow)
        resize(wf.prompt, side, side)
        for node in wf.prompt.values():
            inputs = node.get("inputs", {})
            if isinstance(inputs.get("text"), str) and inputs["text"]:
                inputs["text"] = f"{inputs['text']} (prompt {i})"
            for k in ("seed", "noise_seed"):
                if isinstance(inputs.get(k), int):
                    inputs[k] = 1000 + i
        out.append(wf.prompt)
    return out


def grouped_optimum(plan, node_costs: dict, models: dict) -> tuple[int, int] | None:
    """(fewest bytes moved, loads and streaming, and the loads among them) from an empty GPU by the plan's own runs in
    the grouped order, over all whole-model residencies: a dynamic programme over the subsets of the models (integer
    bytes). A streamed run costs its block plan's bytes in the room the resident set leaves, chosen as the planner
    chooses it."""
    from vramgraph.graph.plan import residency

    runs = []
    for s in plan.steps:
        st = s.step
        if st.kind != "run":
            continue
        v = next(v for v in node_costs[st.node].variants if v.name == st.variant)
        runs.append((st.node, v))
    # grouped: by the node's id inside its own prompt (q<i>:<id> -> <id>) in the order of its first occurrence
    first: dict[str, int] = {}
    for k, (node, _) in enumerate(runs):
        first.setdefault(node.split(":", 1)[-1], k)
    runs.sort(key=lambda r: (first[r[0].split(":", 1)[-1]], int(r[0][1:].split(":")[0]) if ":" in r[0] else 0))
    keys = sorted({m for _, v in runs for m in v.models})
    size = {k: models[k].nbytes for k in keys}
    budget = plan.budget.gpu
    cost: dict[frozenset, tuple[int, int]] = {frozenset(): (0, 0)}  # resident set -> (bytes moved, bytes loaded)
    states = [frozenset(k for i, k in enumerate(keys) if mask >> i & 1) for mask in range(1 << len(keys))]
    for _, v in runs:
        need = set(v.models)
        nxt = {}
        for st in states:
            held = sum(size[k] for k in st)
            if not need <= st or held + v.activation > budget or st & set(v.streams):
                continue
            streamed = 0
            if v.blocks is not None:
                bp = residency.choose(v.blocks, budget - held, plan.cost.h2d_pinned)
                if bp is None:
                    continue
                streamed = bp.resident_bytes + bp.total_streamed
            moved, loaded = min((c[0] + sum(size[k] for k in st - p), c[1] + sum(size[k] for k in st - p))
                                for p, c in cost.items())
            nxt[st] = (moved + streamed, loaded)
        if not nxt:
            return None
        cost = nxt
    return min(cost.values())


def cell(planning, workflow: str, side: int, n: int, card: int, context=None) -> dict:
    """One cell; `context`: the planner's PlanContext for the timed plans (default: a fresh one per plan)."""
    from vramgraph.graph.plan import planner
    from vramgraph.graph.workflow import estimate, queue

    prompts = prompts_for(workflow, side, n)
    merged = queue.merge(prompts, frozenset({"VGSaveImage", "SaveImage", "PreviewImage"})) if n > 1 else None
    prompt = merged.prompt if merged else prompts[0]
    row = {"workflow": workflow, "card_gib": card, "side": side, "queue": n,
           "budget_gib": round(planning.budget.gpu / GiB, 3)}
    t0 = time.perf_counter()
    try:
        prep = planning.prepare(prompt)
    except planner.PlanError as e:
        row["rejected"] = {"node": e.class_type, "min_budget_gib": e.extra.get("min_budget_gib")}
        return row
    row["prepare_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    node_costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
    todo = prep.dag.subgraph(n for n in prep.dag.nodes if n not in prep.cached).copy()
    times = []
    for _ in range(3 if n >= 8 else 1):
        t0 = time.perf_counter()
        p = planner.plan(todo, {k: node_costs[k] for k in todo.nodes}, models, planning.budget, planning.cost,
                         context=context)
        times.append(time.perf_counter() - t0)
    best = grouped_optimum(p, node_costs, models)
    moved = p.bytes_moved + p.streamed_bytes
    row.update(plan_ms=round(min(times) * 1e3, 3), loads=p.loads, gib_moved=round(p.bytes_moved / GiB, 3),
               gib_streamed=round(p.streamed_bytes / GiB, 3),
               grouped_gib=None if best is None else round(best[0] / GiB, 3),
               grouped_loads_gib=None if best is None else round(best[1] / GiB, 3),
               over_grouped=None if not best or not best[0] else round(moved / best[0], 4),
               seconds=round(p.seconds, 3), peak_gib=round(p.peak / GiB, 3),
               variants={c: sorted({s.step.variant for s in p.steps if s.step.kind == "run"
                                    and prep.prompt[s.step.node]["class_type"] == c})
                         for c in ("VGTextEncode", "CLIPTextEncode", "VGSampler", "SamplerCustomAdvanced",
                                   "VGVAEDecode", "VAEDecode")
                         if any(v["class_type"] == c for v in prep.prompt.values())})
    return row


def planning_for(card: int, profile: str | None, host: str = HOST):
    """The torch-free planning context `vramgraph plan --vram CARD --host HOST` uses (klein sizes, no weights)."""
    from vramgraph.api.pipeline import Pipeline

    return Pipeline(input=str(INPUT), host=host, profile=profile)._planner(f"{card}GiB")


def demo_inputs() -> None:
    from vramgraph.graph.engine.runtime import DEMO_IMAGES, demo_image

    INPUT.mkdir(parents=True, exist_ok=True)
    for i, (name, size) in enumerate(DEMO_IMAGES.items()):  # the images the edit workflows load
        if not (INPUT / name).is_file():
            demo_image(size, i).save(INPUT / name)


def summarize(cells: list[dict]) -> dict:
    done = [c for c in cells if "rejected" not in c]
    over = [c for c in done if c.get("over_grouped") and c["over_grouped"] > 1.05]
    single = [c for c in cells if c["queue"] == 1]
    q64 = [c["plan_ms"] for c in done if c["queue"] == 64]
    return {
        "cells": len(cells),
        "single_image_cells": len(single),
        "rejected_single_image": sum(1 for c in single if "rejected" in c),
        "rejected_single_image_cells": sorted({(c["card_gib"], c["side"]) for c in single if "rejected" in c}),
        "rejected_by_node": {k: sum(1 for c in single if c.get("rejected", {}).get("node") == k)
                             for k in sorted({c["rejected"]["node"] for c in single if "rejected" in c})},
        "queue_cells_over_1.05x_grouped": [(c["workflow"], c["card_gib"], c["side"], c["queue"], c["gib_moved"],
                                            c["gib_streamed"], c["grouped_gib"]) for c in over],
        "max_over_grouped": max((c["over_grouped"] for c in done if c.get("over_grouped")), default=None),
        "gib_moved_total": round(sum(c["gib_moved"] for c in done), 2),
        "gib_streamed_total": round(sum(c["gib_streamed"] for c in done), 2),
        "grouped_gib_total": round(sum(c["grouped_gib"] or 0 for c in done), 2),
        "plan_ms_max": max((c["plan_ms"] for c in done), default=None),
        "plan_ms_64_prompts": {"median": statistics.median(q64), "max": max(q64)} if q64 else None,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--plan-only", action="store_true", help="accepted for bench/plan_matrix.py's spelling")
    ap.add_argument("--cards", default="6,8,10,12,16,24,80")
    ap.add_argument("--sizes", default="512,1024,1536,2048")
    ap.add_argument("--queues", default="1,2,8")
    ap.add_argument("--workflows", default=",".join(WORKFLOWS))
    ap.add_argument("--q64", default="text_to_image.json,edit.json", help="workflows also planned as 64 prompts "
                    "(at every card, 1024²) for the planning time")
    ap.add_argument("--profile", default=None, help="a cost profile name (engine/costs.py), default the planner's")
    ap.add_argument("--host", default=HOST, help="host RAM the plans may use (default %(default)s: not what this "
                    "machine has free, so that the cells do not change with it)")
    a = ap.parse_args(argv)
    _import()
    demo_inputs()
    cells = []
    for card in [int(c) for c in a.cards.split(",")]:
        planning = planning_for(card, a.profile, a.host)
        for wf in a.workflows.split(","):
            for side in [int(s) for s in a.sizes.split(",")]:
                queues = [int(q) for q in a.queues.split(",")]
                if wf in a.q64.split(",") and side == 1024:
                    queues.append(64)
                for n in queues:
                    row = cell(planning, wf, side, n, card)
                    cells.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "variants"}), flush=True)
    report = {"env": {"python": platform.python_version(), "machine": platform.machine(),
                      "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "profile": a.profile, "host": a.host, "cells": cells, "summary": summarize(cells)}
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
