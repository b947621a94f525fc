"""Planning time of prompts sent one by one, with the session rule on (graph/plan/session.py), on the CPU.

    python3 bench/session_plan_time.py [--prompts 12]

Per cell (workflow, side, card): N prompts planned one after another from the last one's end, one planning context
(as an engine with VRAMGRAPH_PLAN_AHEAD=on plans them); printed: the CPU milliseconds of each prompt's plan and the
predicted seconds of all N. The first prompt runs the programme; the next ones follow its path (about 1 ms each).
"""

from __future__ import annotations

import argparse
import time

import plan_cells

CELLS = [("text_to_image_base.json", 1024, 12), ("text_to_image_base.json", 512, 8),
         ("text_to_image_base.json", 512, 12), ("text_to_image.json", 1024, 12), ("text_to_image.json", 1024, 8),
         ("text_to_image_base.json", 2048, 16)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12)
    a = ap.parse_args()
    plan_cells._import()
    plan_cells.demo_inputs()
    from vramgraph.graph.plan import planner
    from vramgraph.graph.workflow import estimate

    for workflow, side, card in CELLS:
        planning = plan_cells.planning_for(card, None)
        prep = planning.prepare(plan_cells.prompts_for(workflow, side, 1)[0])
        costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
        start = planner.Residency(pinned=frozenset(models))
        context = planner.PlanContext(session=True)
        ms, seconds = [], 0.0
        for _ in range(a.prompts):
            t0 = time.process_time()
            p = planner.plan(prep.dag, costs, models, planning.budget, planning.cost, start, context=context)
            ms.append(round((time.process_time() - t0) * 1000))
            seconds += p.seconds
            start = p.end
        print(f"{workflow} {side}² {card} GiB: ms per prompt {ms}, predicted {seconds:.3f} s", flush=True)


if __name__ == "__main__":
    main()
