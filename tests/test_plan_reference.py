"""The planner's package as a pure function with a reference (graph/plan/): the fast path makes the reference's plans,
step for step and note for note, on a sample of the matrix (bench/plan_identity.py runs all of it) and on random
graphs; plain dependencies plan as the DiGraph does; planning leaves the process as it found it (no garbage collector
switched, no cache outside the caller's PlanContext); no function of the package is long.

Pure (no torch); no timing here.
"""

from __future__ import annotations

import ast
import gc
import random
from pathlib import Path

import networkx as nx
import pytest
from vramgraph.graph.plan import planner, residency
from vramgraph.graph.plan.planner import Budget, ModelCost, NodeCost, PlanContext, Residency
from vramgraph.nodes.types import Blocks, Variant

PLAN = Path(__file__).resolve().parents[1] / "graph" / "plan"
MB = 10**6


def _text(p: planner.Plan) -> tuple:
    """Everything a user or the executor reads of a plan (bench/plan_identity.py compares the same)."""
    return tuple(repr(s) for s in p.steps), repr(p.end), p.budget


def _three(dag, costs, models, budget, cost, context_of) -> list:
    """Cold, warm (from the cold plan's end) and without repeat; or the error raised."""
    try:
        cold = planner.plan(dag, costs, models, budget, cost, context=context_of())
        warm = planner.plan(dag, costs, models, budget, cost, cold.end, context=context_of())
        once = planner.plan(dag, costs, models, budget, cost, repeat=False, context=context_of())
    except ValueError as e:  # (PlanError is one)
        return [f"{type(e).__name__}: {e}"]
    return [_text(cold), _text(warm), _text(once)]


def _reference() -> PlanContext:
    return PlanContext(reference=True)


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> object:
    """bench/plan_cells.py, with its input images in a temporary folder."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import plan_cells

    plan_cells.INPUT = tmp_path_factory.mktemp("input")
    plan_cells.demo_inputs()
    return plan_cells


def _queued(cells, workflow: str, card: int, side: int, prompts: int, host: str, profile: str | None) -> tuple:
    from vramgraph.graph.workflow import estimate, queue

    planning = cells.planning_for(card, profile, host)
    ps = cells.prompts_for(workflow, side, prompts)
    prompt = queue.merge(ps, frozenset({"VGSaveImage", "SaveImage"})).prompt if prompts > 1 else ps[0]
    prep = planning.prepare(prompt)
    node_costs, models = estimate.planner_inputs(prep.prompt, prep.costs)
    return prep.dag, {k: node_costs[k] for k in prep.dag.nodes}, models, planning.budget, planning.cost


@pytest.mark.parametrize(("workflow", "card", "side", "prompts", "host", "profile"), [
    ("text_to_image.json", 6, 512, 8, "64GiB", None), ("edit.json", 8, 1024, 4, "6GB", "rtx3060"),
    ("text_to_image_base.json", 12, 2048, 2, "64GiB", None), ("multi_reference.json", 10, 1536, 3, "19GB", None),
    ("core_text_to_image.json", 24, 512, 8, "64GiB", "rtx3060"), ("edit.json", 12, 1024, 1, "64GiB", None)])
def test_the_fast_path_makes_the_reference_plans(cells, workflow: str, card: int, side: int, prompts: int, host: str,
                                                 profile: str | None) -> None:
    """A sample of bench/plan_identity.py's matrix (workflow x card x side x queue x host RAM x cost profile): the fast
    path (remembered choices, the look ahead's tables, the passes left out) and the reference (every node weighed by
    graph/plan/gpu.py's rules, the look ahead walked, every pass run) make the same plans, cold, warm and once."""
    dag, costs, models, budget, cost = _queued(cells, workflow, card, side, prompts, host, profile)
    fast = _three(dag, costs, models, budget, cost, PlanContext)
    assert len(fast) == 3  # (planned, not rejected)
    assert fast == _three(dag, costs, models, budget, cost, _reference)


def test_the_fast_path_makes_the_reference_plans_of_random_graphs(cells) -> None:
    """Random DAGs of the shipped workflows' nodes (streamed, tiled and CPU variants, loaders, saves), with nodes
    that need nothing and random host RAM, on random cards, host RAM and cost profiles."""
    pool, models = [], {}
    for wf in ("text_to_image.json", "edit.json", "multi_reference.json"):
        _, costs, ms, _, _ = _queued(cells, wf, 80, 1024, 1, "64GiB", None)
        pool += costs.values()
        models.update(ms)
    free = [nc for nc in pool if not nc.host_bytes and len(nc.variants) == 1 and not nc.variants[0].models]
    planned = 0
    for seed in range(12):
        rng = random.Random(seed)
        names = [f"q{rng.randrange(4)}:{k}" for k in range(rng.randint(2, 40))]
        dag = nx.DiGraph()
        dag.add_nodes_from(names)
        costs = {}
        for k, name in enumerate(names):
            nc = rng.choice(free if rng.random() < 0.3 else pool)
            hb = rng.choice((0, 0, nc.host_bytes, 2**20 * rng.randint(1, 4096)))
            costs[name] = NodeCost(name, nc.class_type, nc.variants, hb)
            for j in rng.sample(range(k), min(k, rng.choice((0, 1, 1, 2, 3)))):
                dag.add_edge(names[j], name)
        planning = cells.planning_for(rng.choice((6, 8, 12, 24)), rng.choice((None, "rtx3060")),
                                      rng.choice(("64GiB", "19GB", "6GB")))
        fast = _three(dag, costs, models, planning.budget, planning.cost, PlanContext)
        assert fast == _three(dag, costs, models, planning.budget, planning.cost, _reference), seed
        planned += len(fast) == 3
    assert planned >= 8  # (most are planned, not rejected alike)


# --------------------------------------------------------------------------------------- plain data in and out


def _small() -> tuple[dict, dict, dict]:
    """load -> encode -> sample -> decode -> save; encode and sample cannot sit together on a 10 GB budget."""
    models = {"te": ModelCost("te", 6000 * MB, "te"), "dit": ModelCost("dit", 7000 * MB, "dit"),
              "vae": ModelCost("vae", 100 * MB, "vae")}
    uses = {"load": Variant("cpu", (), 0, 0.0), "encode": Variant("gpu", ("te",), 100 * MB, 0.5),
            "sample": Variant("gpu", ("dit",), 500 * MB, 3.0), "decode": Variant("gpu", ("vae",), 900 * MB, 0.2),
            "save": Variant("cpu", (), 0, 0.1)}
    costs = {n: NodeCost(n, n.title(), (v,), 10 * MB if n == "decode" else 0) for n, v in uses.items()}
    deps = {"load": [], "encode": ["load"], "sample": ["encode", "load"], "decode": ["sample", "load"],
            "save": ["decode"]}
    return deps, costs, models


def test_plain_dependencies_plan_as_the_digraph_does() -> None:
    """plan() takes per node the nodes whose outputs it reads, in place of a networkx graph: the same plan."""
    deps, costs, models = _small()
    dag = nx.DiGraph()
    dag.add_nodes_from(deps)
    dag.add_edges_from((src, n) for n, srcs in deps.items() for src in srcs)
    budget = Budget(10_000 * MB, 64 * 2**30)
    p = planner.plan(deps, costs, models, budget)
    assert _text(p) == _text(planner.plan(dag, costs, models, budget))
    assert p.order == ("load", "encode", "sample", "decode", "save")
    assert [s.step.model for s in p.steps if s.step.kind == "unload"] == ["te"]  # the sampler needs its room


def test_a_dependency_outside_the_graph_is_named() -> None:
    deps, costs, models = _small()
    deps["decode"] = ["sample", "vae_loader"]
    with pytest.raises(ValueError, match=r"node 'decode' reads the output of 'vae_loader', which is not a node"):
        planner.plan(deps, costs, models, Budget(10_000 * MB, 64 * 2**30))


def test_planning_leaves_the_garbage_collector_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server plans on threads while another thread runs: planning never switches the collector."""
    deps, costs, models = _small()

    def refused() -> None:
        raise AssertionError("the planner switched the garbage collector")

    monkeypatch.setattr(gc, "disable", refused)
    monkeypatch.setattr(gc, "enable", refused)
    planner.plan(deps, costs, models, Budget(10_000 * MB, 64 * 2**30))
    assert gc.isenabled()


def test_block_choices_are_cached_in_the_callers_context_only() -> None:
    """A streamed node's block choice is remembered by the PlanContext passed in (an engine keeps one for its
    plans), by nothing of the modules: a plan without one leaves nothing behind."""
    blocks = Blocks("dit", (300 * MB,) * 6, (0.004,) * 6, fixed=200 * MB, activation=300 * MB, passes=4)
    models = {"dit": ModelCost("dit", 200 * MB + sum(blocks.sizes), "dit")}
    stream = Variant("stream", (), blocks.min_gpu(), 0.1, streams=("dit",), blocks=blocks)
    costs = {"s": NodeCost("s", "Sampler", (stream,))}
    budget = Budget(1500 * MB, 64 * 2**30)
    context = PlanContext()
    p = planner.plan({"s": []}, costs, models, budget, context=context)
    assert p.steps[-1].blocks is not None and context.blocks.chosen  # streamed, its choice kept by the context
    assert _text(planner.plan({"s": []}, costs, models, budget)) == _text(p)
    for module in (planner, residency):
        cached = [k for k, v in vars(module).items() if hasattr(v, "cache_info")]
        assert not cached, f"{module.__name__} caches for the process: {cached}"


def test_the_plan_package_has_no_long_function_and_no_process_effect() -> None:
    """Each pass a small function or a small class (DESIGN.md): no function over 120 lines, no `gc` and no
    `object.__new__` in graph/plan/."""
    for path in sorted(PLAN.glob("*.py")):
        text = path.read_text()
        assert "import gc" not in text and "object.__new__" not in text, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                assert node.end_lineno - node.lineno < 120, f"{path.name}: {node.name}"


def test_a_start_with_a_kept_part_plans_alike_on_both_paths() -> None:
    """A queue's second run starts with the transformer's kept part on the GPU (its resident blocks): the reference
    and the fast path take it over alike."""
    blocks = Blocks("dit", (300 * MB,) * 6, (0.004,) * 6, fixed=200 * MB, activation=300 * MB, passes=4)
    models = {"dit": ModelCost("dit", 200 * MB + sum(blocks.sizes), "dit"), "vae": ModelCost("vae", 300 * MB, "vae")}
    stream = Variant("stream", (), blocks.min_gpu(), 0.1, streams=("dit",), blocks=blocks)
    decode = Variant("gpu", ("vae",), 200 * MB, 0.05)
    deps = {f"s{k}": [] for k in range(3)} | {f"d{k}": [f"s{k}"] for k in range(3)}
    costs = {n: NodeCost(n, "Sampler" if n[0] == "s" else "Decode", (stream if n[0] == "s" else decode,))
             for n in deps}
    budget = Budget(1800 * MB, 64 * 2**30)
    first = planner.plan(deps, costs, models, budget)
    assert any(m.key != "dit" for m in first.end.kept)  # a kept part at the end
    again = [_text(planner.plan(deps, costs, models, budget, None, first.end, context=c()))
             for c in (PlanContext, _reference)]
    assert again[0] == again[1]
    assert Residency() == planner.plan(deps, costs, models, budget, repeat=False).start
