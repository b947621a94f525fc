"""Images one by one against the exact bound: the planner's plans for N prompts sent one after another, on the CPU.

    python3 bench/session_bound.py OUT.json [--cards 8,10,12,16,24] [--sizes 512,1024,1536,2048]
                                            [--workflows text_to_image.json,text_to_image_base.json] [--images 8]
                                            [--step 1] [--profile h200]

Per cell (workflow x card x size, the budget of `vramgraph plan --vram CARD`): N prompts planned one after another,
each from the last one's end (`Plan.end`) with `repeat` (as the engine plans a session's next prompt), all the
models' pinned copies made and nothing on the GPU at the start (a warm engine). Their predicted seconds and bytes
copied host->GPU (loads and streaming) are compared with `bound`: an exact dynamic programme over the same N runs of
the same nodes, from the same start, with the same cost model (graph/plan/types.py `CostModel`, graph/plan/residency.py
`seconds`), that may hold any model whole, drop any model before any node (free: it is pinned), and keep after a
node that streams a model block by block any number of its blocks, a multiple of --step, spread evenly over the
model or its first ones, or the fastest set in any of 64 rooms evenly spread over its range or beside any set of
whole models (graph/plan/residency.py `choose`), each reused by the next node that streams the model and keeps the
same blocks. It knows the whole sequence of N runs at once. Its own code, written apart from graph/plan/session.py.

Reported: `over_bound` = plan seconds / the bound's least seconds (acceptance: <= 1.05 at 512²-2048² on 8-24 GiB),
`bytes_over_within` = plan bytes / the fewest bytes of a path within 1 % of the least seconds that a sweep of byte
prices finds (`within_gib`; `within_floor_gib` is the Lagrangian floor under any such path's bytes), and the plan of
the main branch (`--against DIR`: another checkout's planner, for the before/after numbers).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time
from pathlib import Path

import plan_cells

GiB = 2**30
ROOMS = 64  # the bound's rooms for residency.choose: steps of 1/64 of a streamed node's range
PRICES = (0.0, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)  # seconds per second of pinned copy, for the byte sweep


def spread_resident(n: int, count: int) -> tuple[int, ...]:
    """`count` of n blocks, evenly spread (the middle of count equal parts)."""
    return tuple(sorted({(2 * j + 1) * n // (2 * count) for j in range(count)})) if count else ()


class Bound:
    """The exact programme over `runs` runs of `nodes` (NodeCosts in their order)."""

    def __init__(self, nodes: list, models: dict, gpu: int, cm, step: int = 1) -> None:
        from vramgraph.graph.plan import residency

        self.res = residency
        self.nodes, self.gpu, self.cm, self.step = nodes, gpu, cm, step
        self.keys = list(dict.fromkeys(m for nc in nodes for v in nc.variants for m in (*v.models, *v.streams)))
        self.w = [models[k].nbytes for k in self.keys]
        self.spec = {}
        for nc in nodes:
            for v in nc.variants:
                if v.blocks is not None:
                    self.spec.setdefault(self.keys.index(v.blocks.model), v.blocks)
        self.cache: dict = {}
        self.plans: dict = {}

    # a level: ("0",) absent, ("W",) whole, ("P", resident blocks) a kept part
    def held(self, j: int, level: tuple) -> int:
        if level[0] == "0":
            return 0
        if level[0] == "W":
            return self.w[j]
        spec = self.spec[j]
        return spec.fixed + sum(spec.sizes[i] for i in level[1])

    def plan(self, spec, resident: tuple[int, ...], reused: bool):
        key = (id(spec), resident, reused)
        got = self.plans.get(key)
        if got is None:
            bp = self.res.with_resident(spec, resident, self.cm.h2d_pinned)
            got = self.plans[key] = self.res.reuse(bp, self.cm.h2d_pinned) if reused else bp
        return got

    def sets(self, j: int, spec) -> list[tuple[int, ...]]:
        """The resident sets a streamed node of model j may keep: every multiple of `step` blocks spread evenly or the
        first ones, and
        the fastest set (residency.choose) in every room from the least to all of it in steps of 1/ROOMS, and in the
        room beside each set of the other models held whole."""
        key = ("sets", j, id(spec))
        if key not in self.cache:
            n = len(spec.sizes)
            counts = sorted({*range(0, n + 1, self.step), n})
            got = {spread_resident(n, c) for c in counts} | {tuple(range(c)) for c in counts}
            low, high = spec.min_gpu(), spec.gpu_bytes(())
            rooms = {low + (high - low) * k // ROOMS for k in range(ROOMS + 1)}
            others = [w for i, w in enumerate(self.w) if i != j]
            for mask in itertools.product((0, 1), repeat=len(others)):
                rooms.add(self.gpu - sum(w for w, on in zip(others, mask, strict=True) if on))
            for room in rooms:
                bp = self.res.choose(spec, room, self.cm.h2d_pinned) if room >= low else None
                if bp is not None:
                    got.add(bp.resident)
            self.cache[key] = sorted(got)
        return self.cache[key]

    def moves(self, i: int, s: tuple) -> list[tuple[tuple, float, int]]:
        """(state after, seconds, bytes) of every way node i runs from state s."""
        key = (i, s)
        if key in self.cache:
            return self.cache[key]
        out = []
        load = [self.cm.load_seconds(w, True) for w in self.w]
        for v in self.nodes[i].variants:
            need = {self.keys.index(m) for m in v.models}
            blk = self.keys.index(v.blocks.model) if v.blocks is not None else -1
            whole_streams = {self.keys.index(m) for m in v.streams} - {blk}
            optional = [j for j in range(len(s)) if s[j][0] != "0" and j not in need and j != blk
                        and j not in whole_streams]
            loads = [j for j in need if s[j][0] != "W"]
            extra_s = sum(load[j] for j in loads) + sum(load[j] for j in whole_streams)
            extra_b = sum(self.w[j] for j in loads) + sum(self.w[j] for j in whole_streams)
            need_b = sum(self.w[j] for j in need)
            if blk >= 0:
                spec = v.blocks
                kept_now = s[blk][1] if s[blk][0] == "P" else None
                runs = [(("P", r),) for r in self.sets(blk, spec)]
                if kept_now is not None and ("P", kept_now) not in [r[0] for r in runs]:
                    runs.append((("P", kept_now),))
            subsets = [tuple(j for j, on in zip(optional, keep, strict=True) if on)
                       for keep in itertools.product((True, False), repeat=len(optional))]
            for level, bp in ([(None, None)] if blk < 0 else
                              [(lv, self.plan(spec, lv[1], lv[1] == kept_now)) for (lv,) in runs]):
                peak = v.activation if bp is None else bp.gpu_bytes
                fits = [k for k in subsets if need_b + peak + sum(self.held(j, s[j]) for j in k) <= self.gpu]
                for kept in fits:
                    # a set of models kept that fits inside a larger one that fits is no better: dropping is free
                    # at any later node
                    if any(set(kept) < set(other) for other in fits):
                        continue
                    after = [("0",)] * len(s)
                    for j in kept:
                        after[j] = s[j]
                    for j in need:
                        after[j] = ("W",)
                    if bp is None:
                        out.append((tuple(after), self.cm.run_seconds(v) + extra_s, extra_b))
                    else:
                        after[blk] = level if bp.resident_bytes else ("0",)
                        out.append((tuple(after), bp.seconds + extra_s, bp.uploaded + extra_b))
        self.cache[key] = out
        return out

    def best(self, runs: int, price: float) -> tuple[float, int]:
        """(seconds, bytes) of the path with the least seconds + price x bytes / pinned bandwidth."""
        per_byte = price / self.cm.h2d_pinned
        cur = {tuple(("0",) for _ in self.keys): (0.0, 0.0, 0)}
        for step in range(runs * len(self.nodes)):
            nxt: dict = {}
            for s, (c, secs, nbytes) in cur.items():
                for after, ds, db in self.moves(step % len(self.nodes), s):
                    total = c + ds + db * per_byte
                    got = nxt.get(after)
                    if got is None or total < got[0]:
                        nxt[after] = (total, secs + ds, nbytes + db)
            cur = nxt
        _, secs, nbytes = min(cur.values())
        return secs, nbytes

    def report(self, runs: int) -> dict:
        fastest, fastest_b = self.best(runs, 0.0)
        limit = fastest * 1.01
        within, floor = fastest_b, 0.0
        for price in PRICES[1:]:
            secs, nbytes = self.best(runs, price)
            if secs <= limit:
                within = min(within, nbytes)
            lam = price / self.cm.h2d_pinned  # bytes + secs / lam is least on this path: a floor under the bytes of
            floor = max(floor, nbytes + (secs - limit) / lam)  # any path within the limit (weak duality)
        return {"seconds": fastest, "gib": fastest_b / GiB, "within_gib": within / GiB,
                "within_floor_gib": max(0.0, floor) / GiB}


def one_by_one(planner, dag, costs: dict, models: dict, budget, cm, images: int) -> tuple[float, int, list]:
    """N prompts planned one after another, each from the last one's end, with one planning context."""
    start = planner.Residency(pinned=frozenset(models))
    # the session rule on (graph/plan/session.py; off by default): `--against` a checkout without it plans as it does
    context = None
    if hasattr(planner, "PlanContext"):
        fields = getattr(planner.PlanContext, "__dataclass_fields__", {})
        context = planner.PlanContext(session=True) if "session" in fields else planner.PlanContext()
    secs, nbytes, per = 0.0, 0, []
    for _ in range(images):
        p = planner.plan(dag, costs, models, budget, cm, start, **({"context": context} if context else {}))
        secs += p.seconds
        nbytes += p.bytes_moved + p.streamed_bytes
        per.append((round(p.seconds, 4), round((p.bytes_moved + p.streamed_bytes) / GiB, 3)))
        start = p.end
    return secs, nbytes, per


def cell(planner, other, planning, workflow: str, side: int, card: int, images: int, step: int) -> dict:
    from vramgraph.graph.workflow import estimate

    row = {"workflow": workflow, "card_gib": card, "side": side, "images": images,
           "budget_gib": round(planning.budget.gpu / GiB, 3)}
    try:
        prep = planning.prepare(plan_cells.prompts_for(workflow, side, 1)[0])
    except planner.PlanError as e:
        row["rejected"] = e.class_type
        return row
    costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
    secs, nbytes, per = one_by_one(planner, prep.dag, costs, models, planning.budget, planning.cost, images)
    order = prep.plan.order
    gpu_nodes = [costs[n] for n in order if any(v.models or v.streams or v.activation for v in costs[n].variants)]
    t0 = time.process_time()
    bound = Bound(gpu_nodes, models, planning.budget.gpu, planning.cost, step).report(images)
    row.update(seconds=round(secs, 4), gib=round(nbytes / GiB, 2), per_image=per,
               bound_seconds=round(bound["seconds"], 4), bound_gib=round(bound["gib"], 2),
               within_gib=round(bound["within_gib"], 2), within_floor_gib=round(bound["within_floor_gib"], 2),
               over_bound=round(secs / bound["seconds"], 4),
               bytes_over_within=round(nbytes / bound["within_gib"] / GiB, 3) if bound["within_gib"] else None,
               bound_s=round(time.process_time() - t0, 1))
    if other is not None:
        o_secs, o_bytes, _ = one_by_one(other, prep.dag, costs, models, _as(other.Budget, planning.budget),
                                        _as(other.CostModel, planning.cost), images)
        row.update(against_seconds=round(o_secs, 4), against_gib=round(o_bytes / GiB, 2),
                   against_over_bound=round(o_secs / bound["seconds"], 4))
    return row


def _as(cls, obj):
    import dataclasses

    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--cards", default="8,10,12,16,24")
    ap.add_argument("--sizes", default="512,1024,1536,2048")
    ap.add_argument("--workflows", default="text_to_image.json,text_to_image_base.json")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--step", type=int, default=1, help="the bound keeps multiples of this many blocks")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--against", default=None, help="another checkout whose planner plans the same prompts")
    a = ap.parse_args(argv)
    plan_cells._import()
    plan_cells.demo_inputs()
    from vramgraph.graph.plan import planner

    other = None
    if a.against:
        import plan_time

        other = plan_time.planner_of(plan_time._other(a.against))
    rows: list[dict] = []
    for card in [int(c) for c in a.cards.split(",")]:
        planning = plan_cells.planning_for(card, a.profile)
        for wf in a.workflows.split(","):
            for side in [int(s) for s in a.sizes.split(",")]:
                row = cell(planner, other, planning, wf, side, card, a.images, a.step)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "per_image"}), flush=True)
                write(a, rows, other is not None)
    print(json.dumps(write(a, rows, other is not None), indent=1))


def write(a: argparse.Namespace, rows: list[dict], against: bool) -> dict:
    """The report of the cells so far (written after every cell: a long run leaves what it has)."""
    done = [r for r in rows if "rejected" not in r]
    summary = {"cells": len(rows), "rejected": [(r["workflow"], r["card_gib"], r["side"]) for r in rows
                                                if "rejected" in r],
               "over_bound_max": max((r["over_bound"] for r in done), default=None),
               "cells_over_1.05": [(r["workflow"], r["card_gib"], r["side"], r["over_bound"]) for r in done
                                   if r["over_bound"] > 1.05],
               "bytes_over_within_max": max((r["bytes_over_within"] or 0) for r in done),
               "cells_bytes_over_1.2": [(r["workflow"], r["card_gib"], r["side"], r["bytes_over_within"]) for r in done
                                        if (r["bytes_over_within"] or 0) > 1.2]}
    if against:
        summary["against_over_bound_max"] = max((r["against_over_bound"] for r in done), default=None)
        summary["against_cells_over_1.05"] = [(r["workflow"], r["card_gib"], r["side"], r["against_over_bound"])
                                              for r in done if r["against_over_bound"] > 1.05]
    report = {"args": vars(a), "rows": rows, "summary": summary}
    Path(a.out).write_text(json.dumps(report, indent=1))
    return summary


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    importlib.invalidate_caches()
    main()
