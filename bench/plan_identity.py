"""Whether this checkout's planner makes the same plans as another checkout's, step and note, over a matrix of cells.

    python3 bench/plan_identity.py --against OLD_CHECKOUT [--cards 6,8,10,12,16,24] [--sizes 512,1024,1536,2048]
                                   [--queues 1,2,8,64] [--hosts 64GiB,19GB,6GB] [--profiles h200,rtx3060]
                                   [--workflows all]

A change to the planner that is meant to make it faster, not different, is checked with this: every cell (workflow x
card x image side x queue length x host RAM x cost profile) is estimated once by this checkout, and both planners
plan the same inputs three ways: cold (nothing resident), warm (from the cold plan's end, as the next run starts) and
without repeat. Two plans are the same when every step (its kind and fields, GPU bytes, resident models, seconds,
note, streams and block plan, by their reprs), the end residency and the budget are. A rejected cell must be rejected
by both with the same message. Prints each cell that differs and a summary; exits 1 if any does.
(`git worktree add /tmp/old/vramgraph <commit>` makes the other checkout.)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import plan_cells
from plan_time import _other, planner_of


def _text(p) -> tuple:
    """Everything a user or the executor reads of a plan, as plain text."""
    end = p.end
    return (tuple(repr(s) for s in p.steps), sorted(end.gpu), sorted(end.pinned), repr(end.kept),
            p.budget.gpu, p.budget.host)


def _convert(obj, mod):
    """A frozen dataclass of this checkout's (Budget, CostModel, Residency with its ModelCosts) as the other
    checkout's class of the same name."""
    if isinstance(obj, tuple):
        return tuple(_convert(x, mod) for x in obj)
    if not dataclasses.is_dataclass(obj):
        return obj
    cls = getattr(mod, type(obj).__name__)
    return cls(**{f.name: _convert(getattr(obj, f.name), mod) for f in dataclasses.fields(obj)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="another checkout of this repository")
    ap.add_argument("--cards", default="6,8,10,12,16,24")
    ap.add_argument("--sizes", default="512,1024,1536,2048")
    ap.add_argument("--queues", default="1,2,8,64")
    ap.add_argument("--hosts", default="64GiB,19GB,6GB")
    ap.add_argument("--profiles", default="h200,rtx3060")
    ap.add_argument("--workflows", default="all")
    ap.add_argument("--random", type=int, default=0, help="also this many random DAGs of the workflows' nodes")
    a = ap.parse_args()
    logging.disable(logging.WARNING)  # (pass 1's host RAM warnings, the same from both)
    plan_cells._import()
    from vramgraph.graph.plan import planner
    from vramgraph.graph.workflow import estimate, queue

    other = planner_of(_other(a.against))
    plan_cells.demo_inputs()
    workflows = plan_cells.WORKFLOWS if a.workflows == "all" else tuple(a.workflows.split(","))
    cells = differ = rejected = 0
    prompts: dict[tuple, dict] = {}
    for profile in a.profiles.split(","):
        for host in a.hosts.split(","):
            for card in [int(c) for c in a.cards.split(",")]:
                planning = plan_cells.planning_for(card, None if profile == "h200" else profile, host)
                for wf in workflows:
                    for side in [int(s) for s in a.sizes.split(",")]:
                        for n in [int(q) for q in a.queues.split(",")]:
                            key = (wf, side, n)
                            if key not in prompts:
                                ps = plan_cells.prompts_for(wf, side, n)
                                prompts[key] = queue.merge(ps, frozenset({"VGSaveImage", "SaveImage"})).prompt \
                                    if n > 1 else ps[0]
                            cells += 1
                            try:
                                prep = planning.prepare(prompts[key])
                            except planner.PlanError:  # (rejected by the estimates, before either planner)
                                rejected += 1
                                continue
                            node_costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
                            dag = prep.dag.subgraph(x for x in prep.dag.nodes if x not in prep.cached).copy()
                            costs = {k: node_costs[k] for k in dag.nodes}
                            mine = _plans(planner, dag, costs, models, planning.budget, planning.cost)
                            theirs = _plans(other, dag, costs, models, _convert(planning.budget, other),
                                            _convert(planning.cost, other))
                            if mine != theirs:
                                differ += 1
                                ways = [w for w, x, y in zip(("cold", "warm", "no repeat"), mine, theirs, strict=False)
                                        if x != y]
                                print(f"DIFFERS: {wf} {card} GiB {side}² x{n} host {host} {profile}: "
                                      f"{', '.join(ways) or 'raised'}", flush=True)
    print(f"{cells} cells, {rejected} rejected by the estimates, {differ} with different plans")
    if a.random:
        bad = _random_graphs(a.random, planner, other, estimate, queue, workflows, prompts)
        print(f"{a.random} random graphs, {bad} with different plans")
        differ += bad
    sys.exit(1 if differ else 0)


def _random_graphs(count: int, planner, other, estimate, queue, workflows, prompts) -> int:
    """Random DAGs whose nodes take the estimates of the shipped workflows' nodes (streamed, tiled and CPU variants,
    loaders, saves, host RAM held), with pass-through nodes that need nothing and random host RAM, planned by both
    planners at random cards, host RAM and profiles."""
    import random

    import networkx as nx

    pool, models = [], {}
    for wf in workflows:
        planning = plan_cells.planning_for(80, None)
        prep = planning.prepare(prompts.get((wf, 1024, 1)) or plan_cells.prompts_for(wf, 1024, 1)[0])
        node_costs, ms = estimate.planner_inputs(prep.prompt, prep.costs)
        pool += node_costs.values()
        models.update(ms)
    free = [nc for nc in pool if not nc.host_bytes and len(nc.variants) == 1 and not nc.variants[0].models]
    bad = raised = 0
    for seed in range(count):
        rng = random.Random(seed)
        n = rng.randint(2, 120)
        names = [f"q{rng.randrange(9)}:{k}" for k in range(n)]
        dag = nx.DiGraph()
        dag.add_nodes_from(names)
        costs = {}
        for k, name in enumerate(names):
            nc = rng.choice(free if rng.random() < 0.3 else pool)
            hb = rng.choice((0, 0, nc.host_bytes, 2**20 * rng.randint(1, 4096)))
            costs[name] = planner.NodeCost(name, nc.class_type, nc.variants, hb)
            for j in rng.sample(range(k), min(k, rng.choice((0, 1, 1, 2, 3)))):
                dag.add_edge(names[j], name)
        card = rng.choice((6, 8, 10, 12, 16, 24))
        planning = plan_cells.planning_for(card, rng.choice((None, "rtx3060")), rng.choice(("64GiB", "19GB", "6GB")))
        mine = _plans(planner, dag, costs, models, planning.budget, planning.cost)
        theirs = _plans(other, dag, costs, models, _convert(planning.budget, other), _convert(planning.cost, other))
        raised += len(mine) == 1
        if mine != theirs:
            bad += 1
            print(f"DIFFERS: random graph {seed} ({n} nodes, {card} GiB)", flush=True)
    print(f"(of the random graphs, {raised} were rejected by both planners alike)")
    return bad


def _plans(planner, dag, costs, models, budget, cost) -> list:
    """One planner's plans of a cell as text: cold, warm from the cold plan's end, and without repeat; or the error
    it raised."""
    try:
        cold = planner.plan(dag, costs, models, budget, cost)
        warm = planner.plan(dag, costs, models, budget, cost, cold.end)
        once = planner.plan(dag, costs, models, budget, cost, repeat=False)
    except ValueError as e:  # (PlanError is one)
        return [f"{type(e).__name__}: {e}"]
    return [_text(cold), _text(warm), _text(once)]


if __name__ == "__main__":
    main()
