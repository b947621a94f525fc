"""The planner's time for a queue of prompts, on the CPU: `planner.plan` alone (validation and estimates apart).

    python3 bench/plan_time.py [--prompts 64] [--card 12] [--side 1024] [--repeat 60] [workflow.json ...]

CPU time (time.process_time) of each call, min and median over --repeat calls, so that other jobs on a shared
machine inflate it less than wall time would. Issue 13's bar: <= 5 ms for 64 queued prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import plan_cells


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workflows", nargs="*", default=["text_to_image.json", "edit.json"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--card", type=int, default=12)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=60)
    a = ap.parse_args()
    plan_cells._import()
    from vramgraph.graph import estimate, planner, queue

    plan_cells.demo_inputs()
    planning = plan_cells.planning_for(a.card, None)
    for wf in a.workflows:
        merged = queue.merge(plan_cells.prompts_for(wf, a.side, a.prompts), frozenset({"VGSaveImage", "SaveImage"}))
        prep = planning.prepare(merged.prompt)
        node_costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
        costs = {k: node_costs[k] for k in prep.dag.nodes}
        times = []
        for _ in range(a.repeat):
            t0 = time.process_time()
            p = planner.plan(prep.dag, costs, models, planning.budget, planning.cost)
            times.append(time.process_time() - t0)
        print(json.dumps({"workflow": wf, "prompts": a.prompts, "card_gib": a.card, "side": a.side,
                          "nodes": len(prep.dag), "loads": p.loads, "min_ms": round(min(times) * 1e3, 2),
                          "median_ms": round(statistics.median(times) * 1e3, 2)}))


if __name__ == "__main__":
    main()
