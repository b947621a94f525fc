"""The planner's time for a queue of prompts, on the CPU: `planner.plan` alone (validation and estimates apart).

    python3 bench/plan_time.py [--prompts 64] [--cards 12] [--sizes 1024] [--repeat 60] [--out OUT.json]
                               [--against OLD_CHECKOUT] [--prepare N] [workflow.json ...]

CPU time (time.process_time) of each call, after a garbage collection, min and median over --repeat calls, so that
other jobs on a shared machine inflate it less than wall time would. Issue 13's bar: <= 5 ms for 64 queued prompts.
`--cards 6,8,10` and `--sizes 1024,2048` plan every combination; `all` as the only workflow: every shipped one.

`--against DIR`: the planner of another checkout of this repository (e.g. `git worktree add /tmp/old <commit>`) plans
the same inputs in the same process, call for call alternately with this one, and each cell reports the ratio of the
two minimums: on a machine whose speed drifts (the 2-core CI machine) the ratio is steadier than either time. With
`--prepare N` too, the other checkout's whole of planning (its validation, estimates and planner, from the same prompt)
is timed alternately with this one's as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import plan_cells


def _other(checkout: str):
    """`checkout` imported as the package `vg_against` (its modules import each other relatively, as inside ComfyUI):
    its planner takes this checkout's inputs (it imports only its own pure modules and plain dataclasses)."""
    link = Path(tempfile.mkdtemp()) / "vg_against"
    link.symlink_to(Path(checkout).resolve(), target_is_directory=True)
    sys.path.insert(0, str(link.parent))
    return sys.modules[importlib.import_module("vg_against").__name__]


def planner_of(pkg):
    """The planner module of another checkout: graph/plan/planner.py, or graph/planner.py before the rooms."""
    try:
        return importlib.import_module(f"{pkg.__name__}.graph.plan.planner")
    except ImportError:
        return importlib.import_module(f"{pkg.__name__}.graph.planner")


def pipeline_of(pkg):
    """The Pipeline class of another checkout: api/pipeline.py, or graph/api.py before the rooms."""
    try:
        return importlib.import_module(f"{pkg.__name__}.api.pipeline").Pipeline
    except ImportError:
        return importlib.import_module(f"{pkg.__name__}.graph.api").Pipeline


def _timed(call, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.process_time()
        call()
        times.append(time.process_time() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workflows", nargs="*", default=["text_to_image.json", "edit.json"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--cards", "--card", default="12")
    ap.add_argument("--sizes", "--side", default="1024")
    ap.add_argument("--repeat", type=int, default=60)
    ap.add_argument("--against", default=None, help="another checkout whose planner is timed alongside")
    ap.add_argument("--out", default=None, help="also write the rows and a summary as JSON")
    ap.add_argument("--prepare", type=int, default=0, help="calls of the whole of planning to time (0: none)")
    a = ap.parse_args()
    plan_cells._import()
    from vramgraph.graph.plan import planner
    from vramgraph.graph.workflow import estimate, queue

    other_pkg = _other(a.against) if a.against else None
    other = planner_of(other_pkg) if other_pkg else None
    plan_cells.demo_inputs()
    workflows = list(plan_cells.WORKFLOWS) if a.workflows == ["all"] else a.workflows
    rows = []
    for card in [int(c) for c in a.cards.split(",")]:
        planning = plan_cells.planning_for(card, None)
        for wf in workflows:
            for side in [int(s) for s in a.sizes.split(",")]:
                merged = queue.merge(plan_cells.prompts_for(wf, side, a.prompts),
                                     frozenset({"VGSaveImage", "SaveImage"}))
                prep = planning.prepare(merged.prompt)
                node_costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
                costs = {k: node_costs[k] for k in prep.dag.nodes}
                ours = functools.partial(planner.plan, prep.dag, costs, models, planning.budget, planning.cost)
                p = ours()
                row = {"workflow": wf, "prompts": a.prompts, "card_gib": card, "side": side, "nodes": len(prep.dag),
                       "loads": p.loads}
                if other is None:
                    times = _timed(ours, a.repeat)
                else:
                    budget = other.Budget(**{f.name: getattr(planning.budget, f.name)
                                             for f in dataclasses.fields(planning.budget)})
                    cost = other.CostModel(**{f.name: getattr(planning.cost, f.name)
                                              for f in dataclasses.fields(planning.cost)})
                    theirs = functools.partial(other.plan, prep.dag, costs, models, budget, cost)
                    times, against = [], []
                    for _ in range(a.repeat):  # alternately, so that both see the same drift
                        times += _timed(ours, 1)
                        against += _timed(theirs, 1)
                    row.update(against_min_ms=round(min(against) * 1e3, 2),
                               against_median_ms=round(statistics.median(against) * 1e3, 2),
                               over_against=round(min(times) / min(against), 3))
                row.update(min_ms=round(min(times) * 1e3, 2), median_ms=round(statistics.median(times) * 1e3, 2))
                if a.prepare and other_pkg is None:
                    whole = _timed(functools.partial(planning.prepare, merged.prompt), a.prepare)
                    row.update(prepare_min_ms=round(min(whole) * 1e3, 2))
                elif a.prepare:
                    theirs_all = functools.partial(pipeline_of(other_pkg)(
                        input=str(plan_cells.INPUT), host=plan_cells.HOST)._planner(f"{card}GiB").prepare,
                        merged.prompt)
                    whole, whole_against = [], []
                    for _ in range(a.prepare):
                        whole += _timed(functools.partial(planning.prepare, merged.prompt), 1)
                        whole_against += _timed(theirs_all, 1)
                    row.update(prepare_min_ms=round(min(whole) * 1e3, 2),
                               against_prepare_min_ms=round(min(whole_against) * 1e3, 2),
                               prepare_over_against=round(min(whole) / min(whole_against), 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {"cells": len(rows), "min_ms_max": max(r["min_ms"] for r in rows),
               "min_ms_median": statistics.median(r["min_ms"] for r in rows),
               "cells_min_over_5ms": sum(r["min_ms"] > 5 for r in rows),
               "cells_median_over_5ms": sum(r["median_ms"] > 5 for r in rows)}
    if other is not None and a.prepare:
        summary.update(prepare_over_against_median=statistics.median(r["prepare_over_against"] for r in rows),
                       prepare_over_against_max=max(r["prepare_over_against"] for r in rows))
    if other is not None:
        summary.update(over_against_median=statistics.median(r["over_against"] for r in rows),
                       over_against_max=max(r["over_against"] for r in rows),
                       against_cells_min_over_5ms=sum(r["against_min_ms"] > 5 for r in rows))
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
