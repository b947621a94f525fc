"""Block-granular residency (graph/plan/residency.py), its planner hook, the rejection below the streaming floor, and
the plan-only matrix of cards x sizes x workflows. Pure: no torch (the streamed forward is tests/test_streaming.py).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import networkx as nx
import pytest
from vramgraph.graph.engine.budget import CONTEXT_ESTIMATE
from vramgraph.graph.plan import planner, residency
from vramgraph.graph.plan.planner import Budget, ModelCost, NodeCost, PlanError
from vramgraph.nodes.types import Blocks, Variant

GiB = 2**30
EFF = residency.STREAM_COPY_EFFICIENCY
ROOT = Path(__file__).parents[1]


def brute(spec: Blocks, room: int, bw: float) -> float | None:
    """The least predicted time over every subset of streamed blocks that fits."""
    best = None
    n = len(spec.sizes)
    for k in range(n + 1):
        for streamed in itertools.combinations(range(n), k):
            if spec.gpu_bytes(streamed) <= room:
                t = residency.seconds(spec, streamed, bw * EFF)
                best = t if best is None else min(best, t)
    return best


def test_gpu_bytes_and_floor() -> None:
    spec = Blocks("m", (200, 100, 100), (1.0,) * 3, fixed=10, activation=5, passes=1)
    assert spec.gpu_bytes(()) == 10 + 400 + 5
    assert spec.gpu_bytes((1,)) == 10 + 300 + 100 + 5  # one streamed block: one staging buffer
    assert spec.gpu_bytes((0, 2)) == 10 + 100 + 2 * 200 + 5
    # streaming the two small blocks and keeping the big one (200 + 2 x 100) beats streaming all three (2 x 200)
    assert spec.min_gpu() == 10 + 200 + 200 + 5


def test_all_resident_when_copies_cost_more_than_they_save() -> None:
    """Four blocks of 100 B, 10 ms each, 10 passes, copies of 1 s: everything fits, so everything stays."""
    spec = Blocks("m", (100,) * 4, (0.01,) * 4, fixed=0, activation=0, passes=10)
    bp = residency.choose(spec, 400, 100 / EFF)
    assert bp is not None
    assert bp.resident == (0, 1, 2, 3) and bp.streamed == ()
    assert bp.seconds == pytest.approx(4.0 + 10 * 0.04)  # upload once, then compute


def test_streams_what_hides_behind_compute() -> None:
    """Two blocks of 200 B then four of 100 B, 1 s each, 1 pass, 100 B/s, 700 B of room.

    Keep both big blocks, stream the small ones (400 + staging 200): upload 4 s, the big ones compute 4..6, the
    copies land at 5, 6, 8, 9, the small ones end at 7, 8, 9, 10: 10 s. Keep only block 0 (200 + staging 2 x 200):
    upload 2 s, block 0 computes 2..3, the copies land at 4, 5, 6, 7, 8 and the blocks end at 5, 6, 7, 8, 9: 9 s.
    Streaming all six also takes 9 s but copies 200 B more, so block 0 stays."""
    spec = Blocks("m", (200, 200, 100, 100, 100, 100), (1.0,) * 6, fixed=0, activation=0, passes=1)
    bp = residency.choose(spec, 700, 100 / EFF)
    assert bp is not None
    assert bp.resident == (0,) and bp.streamed == (1, 2, 3, 4, 5)
    assert bp.seconds == pytest.approx(9.0)
    assert residency.seconds(spec, (2, 3, 4, 5), 100) == pytest.approx(10.0)
    assert residency.seconds(spec, tuple(range(6)), 100) == pytest.approx(9.0)
    assert bp.staging == 400 and bp.gpu_bytes == 600 and bp.streamed_bytes == 600
    assert bp.describe("transformer") == "transformer 1/6 blocks resident, 0.00 GiB streamed per step"


def test_nothing_fits_below_the_floor() -> None:
    spec = Blocks("m", (100,) * 4, (1.0,) * 4, fixed=50, activation=25, passes=2)
    assert residency.choose(spec, spec.min_gpu() - 1, 100.0) is None
    assert residency.choose(spec, spec.min_gpu(), 100.0) is not None


@pytest.mark.parametrize("seed", range(40))
def test_choice_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n_big, n_small = rng.randint(0, 3), rng.randint(1, 5)
    big, small = rng.choice((150, 200, 300)), 100
    t_big, t_small = rng.choice((0.5, 1.0, 2.0)), rng.choice((0.25, 1.0, 1.5))
    sizes = (big,) * n_big + (small,) * n_small
    secs = (t_big,) * n_big + (t_small,) * n_small
    if rng.random() < 0.5:  # shuffle the kinds: the search must not rely on the big blocks coming first
        pairs = list(zip(sizes, secs, strict=True))
        rng.shuffle(pairs)
        sizes, secs = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    spec = Blocks("m", sizes, secs, fixed=rng.choice((0, 30)), activation=rng.choice((0, 40)),
                  passes=rng.choice((1, 2, 4, 10)))
    bw = rng.choice((50.0, 100.0, 400.0))
    for room in sorted({spec.min_gpu(), spec.gpu_bytes(()), (spec.min_gpu() + spec.gpu_bytes(())) // 2,
                        spec.min_gpu() + 100}):
        want = brute(spec, room, bw)
        got = residency.choose(spec, room, bw)
        assert (got is None) == (want is None)
        if got is not None:
            assert spec.gpu_bytes(got.streamed) <= room
            assert got.seconds == pytest.approx(residency.seconds(spec, got.streamed, bw * EFF))
            assert got.seconds <= want + 1e-9, (sizes, secs, room, got.streamed)


# --------------------------------------------------------------------------------------------- the planner


def _sampler_graph(budget_gpu: int) -> tuple[nx.DiGraph, dict, dict, Budget]:
    """One node, `s` (a sampler): resident ("gpu", 800 B of weights + 100 B) or streamed (6 blocks + 20 B fixed).

        s
    """
    blocks = Blocks("dit", (200, 200, 100, 100, 100, 80), (1.0,) * 6, fixed=20, activation=100, passes=4)
    gpu = Variant("gpu", ("dit",), 100, 24.0)
    stream = Variant("stream", (), blocks.min_gpu(), 24.0, streams=("dit",), blocks=blocks)
    dag = nx.DiGraph()
    dag.add_node("s")
    costs = {"s": NodeCost("s", "VGSampler", (gpu, stream))}
    models = {"dit": ModelCost("dit", 800, "transformer")}
    return dag, costs, models, Budget(budget_gpu, 10**6)


def test_planner_streams_when_the_model_cannot_fit() -> None:
    dag, costs, models, budget = _sampler_graph(700)
    p = planner.plan(dag, costs, models, budget, planner.CostModel(h2d_pinned=100.0 / EFF), repeat=False)
    (run,) = [s for s in p.steps if isinstance(s.step, planner.Run)]
    assert run.step.variant == "stream" and run.blocks is not None
    assert run.gpu_bytes == run.blocks.gpu_bytes <= 700
    assert p.loads == 0  # nothing is loaded whole: the node uploads its resident blocks itself
    assert p.streamed_bytes == run.blocks.resident_bytes + 4 * run.blocks.streamed_bytes
    assert run.seconds == pytest.approx(run.blocks.seconds + 800 / planner.CostModel().disk)  # + the first read
    assert p.to_json()["streamed_bytes"] == p.streamed_bytes
    assert p.to_json()["steps"][0]["blocks"]["resident"] == list(run.blocks.resident)
    line = f"Run s (VGSampler) stream · transformer {len(run.blocks.resident)}/6 blocks resident"
    assert p.streaming_lines()[0].startswith(line)
    assert "GiB streamed" in p.table().splitlines()[-2]


def _sample_then_decode(fits_beside: bool, budget: int = 710) -> tuple[nx.DiGraph, dict, dict, Budget, int]:
    """`s` streams the transformer in 700 B beside a 10 B VAE; `d` then decodes with that VAE and an activation that
    fits beside the part `s` leaves on the GPU (its fixed weights and resident blocks, R bytes), or needs all the
    room. Returns R too.

        s ──► d
    """
    dag, costs, models, _ = _sampler_graph(700)
    first = planner.plan(dag, costs, models, Budget(700, 10**6), planner.CostModel(h2d_pinned=100.0 / EFF))
    kept = next(st.blocks for st in first.steps if st.blocks is not None).resident_bytes
    dag.add_edge("s", "d")
    act = 710 - kept - 10 if fits_beside else 700
    costs["d"] = NodeCost("d", "VAEDecode", (Variant("gpu", ("vae",), act, 1.0),))
    models["vae"] = ModelCost("vae", 10, "vae")
    return dag, costs, models, Budget(budget, 10**6), kept


def test_a_streamed_models_resident_part_stays_for_the_next_node_that_streams_it() -> None:
    """After `s` its resident part stays on the GPU (the decode fits beside it), so the next run's `s` uploads
    nothing before its first pass: its bytes and its time drop by the part (R bytes at 100 B/s)."""
    dag, costs, models, budget, kept = _sample_then_decode(fits_beside=True)
    cm = planner.CostModel(h2d_pinned=100.0 / EFF)
    p1 = planner.plan(dag, costs, models, budget, cm)
    run1 = next(st for st in p1.steps if st.blocks is not None)
    part = residency.part_key("dit", run1.blocks.resident)
    assert run1.blocks.reused == 0 and run1.blocks.resident_bytes == kept
    assert part in run1.resident and part in p1.end.gpu  # on the GPU from the node on, and at the end
    assert not [st for st in p1.steps if isinstance(st.step, planner.Unload)]
    assert p1.models[part].nbytes == kept and p1.label(part) == f"transformer ({len(run1.blocks.resident)} blocks kept)"
    assert max(st.gpu_bytes for st in p1.steps) <= budget.gpu

    p2 = planner.plan(dag, costs, models, budget, cm, p1.end)  # the next run starts where this one ended
    run2 = next(st for st in p2.steps if st.blocks is not None)
    assert run2.blocks.resident == run1.blocks.resident and run2.blocks.reused == kept
    assert p2.streamed_bytes == 4 * run1.blocks.streamed_bytes  # the passes only
    assert run2.blocks.seconds == pytest.approx(run1.blocks.seconds - kept / 100)
    assert run2.gpu_bytes == run1.gpu_bytes + 10 and p2.loads == 0  # (the VAE stays beside it now)
    assert "kept from before" in p2.streaming_lines()[0]
    assert p2.end.gpu == p1.end.gpu


def test_a_kept_part_leaves_when_a_node_needs_its_room_or_its_model_loads_whole() -> None:
    """A decode that needs all the room pushes the part out (an Unload of the part; the next `s` uploads it again).
    With room for the whole transformer, the part goes before the model loads whole: never both on the GPU."""
    dag, costs, models, budget, kept = _sample_then_decode(fits_beside=False)
    cm = planner.CostModel(h2d_pinned=100.0 / EFF)
    p1 = planner.plan(dag, costs, models, budget, cm)
    run1 = next(st for st in p1.steps if st.blocks is not None)
    part = residency.part_key("dit", run1.blocks.resident)
    unloads = [st for st in p1.steps if isinstance(st.step, planner.Unload)]
    assert [(u.step.model, u.step.to) for u in unloads] == [(part, "pinned")] and "makes room for d" in unloads[0].note
    assert max(st.gpu_bytes for st in p1.steps) <= budget.gpu
    p2 = planner.plan(dag, costs, models, budget, cm, p1.end)
    run2 = next(st for st in p2.steps if st.blocks is not None)
    assert run2.blocks.reused == 0 and p2.streamed_bytes == kept + 4 * run2.blocks.streamed_bytes

    dag, costs, models, budget, _ = _sample_then_decode(fits_beside=True)
    p1 = planner.plan(dag, costs, models, budget, cm)
    part = next(m for m in p1.end.gpu if residency.part_of(m) == "dit")
    whole = planner.plan(dag, costs, models, Budget(1000, 10**6), cm, p1.end)
    assert whole.variant_of("s") == "gpu"
    kinds = [(st.step.kind, getattr(st.step, "model", "")) for st in whole.steps]
    assert kinds.index(("unload", part)) < kinds.index(("load", "dit"))
    assert not [st for st in whole.steps if part in st.resident and "dit" in st.resident]
    assert max(st.gpu_bytes for st in whole.steps) <= 1000


def test_planner_keeps_the_model_resident_when_it_fits() -> None:
    dag, costs, models, budget = _sampler_graph(900)
    p = planner.plan(dag, costs, models, budget, repeat=False)
    assert p.variant_of("s") == "gpu" and p.streamed_bytes == 0 and p.loads == 1


def test_budget_below_the_streaming_floor_is_rejected_with_the_minimum() -> None:
    dag, costs, models, _ = _sampler_graph(0)
    floor = costs["s"].variants[1].blocks.min_gpu()
    with pytest.raises(PlanError) as err:
        planner.plan(dag, costs, models, Budget(floor - 1, 10**6))
    e = err.value.to_dict()
    assert e["type"] == "vram_plan_infeasible" and set(e) == {"type", "message", "details", "extra_info"}
    assert e["extra_info"]["node_id"] == "s" and e["extra_info"]["needed_bytes"] == floor
    assert "streaming needs at least" in e["message"] and "largest block" in e["message"]
    planner.plan(dag, costs, models, Budget(floor, 10**6))  # exactly the floor plans


def test_rejection_of_a_real_workflow_names_the_minimum_budget(tmp_path: Path) -> None:
    """A 2 GiB card cannot stream the 1024² sampler; the error says which budget would, before anything loads."""
    planning = _planning(tmp_path, 2 * GiB)
    with pytest.raises(PlanError) as err:
        planning.prepare(_prompt("text_to_image.json", 1024))
    e = err.value
    assert e.class_type == "VGSampler"
    assert "streaming needs at least" in e.message
    at_least = e.extra["min_budget_gib"]
    ok = _planning(tmp_path, 0, gpu=int(at_least * GiB))
    assert ok.prepare(_prompt("text_to_image.json", 1024)).plan.variant_of(e.node) == "stream"


# ------------------------------------------------------------------------------------------- the matrix

CONTEXT = CONTEXT_ESTIMATE  # the H200's CUDA context and cuBLAS workspace at the start (graph/engine/budget.py)


def _planning(tmp: Path, card: int, gpu: int | None = None):
    from vramgraph.graph.engine.budget import CARD_MARGIN
    from vramgraph.graph.engine.planning import Planning
    from vramgraph.nodes.catalog import ModelCatalog
    from vramgraph.nodes.files import Folders

    (tmp / "input").mkdir(exist_ok=True)
    ref = tmp / "input" / "reference.png"
    if not ref.exists():
        from PIL import Image

        Image.new("RGB", (1024, 1024), (90, 120, 200)).save(ref)
    folders = Folders(models=(tmp / "models",), input=tmp / "input", output=tmp / "output", temp=tmp / "temp")
    if gpu is None:  # what the GPU run gives a card of this size (graph/engine/budget.py): context and margin out
        gpu = card - CONTEXT - CARD_MARGIN - planner.DEFAULT_RESERVE
    return Planning(folders, ModelCatalog(folders, "bf16", allow_builtin=True), Budget(gpu, 64 * GiB, card or None))


def _prompt(workflow: str, side: int) -> dict:
    from vramgraph.api.pipeline import load, resize

    wf = load(ROOT / "workflows" / workflow)
    resize(wf.prompt, side, side)
    return wf.prompt


@pytest.mark.parametrize("workflow", ["text_to_image.json", "edit.json", "text_to_image_base.json"])
def test_matrix_plans_every_cell(tmp_path: Path, workflow: str) -> None:
    """Every {6, 8, 10, 12, 16} GiB card x {512, 1024, 1536, 2048}² cell plans, within its budget."""
    for card in (6, 8, 10, 12, 16):
        planning = _planning(tmp_path, card * GiB)
        for side in (512, 1024, 1536, 2048):
            p = planning.prepare(_prompt(workflow, side)).plan
            assert p.peak <= planning.budget.gpu, (card, side)
            if card <= 6:  # the transformer cannot stay: streamed (with CFG's passes one by one where needed)
                assert p.variant_of(next(n for n, c in p.classes.items() if c == "VGSampler")).startswith("stream")
