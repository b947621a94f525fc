"""The planner gaps found in the plan matrix (issue 13, item 4): queued edits, the budget off the GPU, queues in
`vramgraph plan`, cost profiles.

Oracle: an exact dynamic programme over whole-model residencies (`fewest_bytes`), the same as
../shared/tools/plan_bound.py, with which it is checked where that tool is present. Sizes and activations are
the tool's own (klein-4B on the H200: text encoder "te" 5.80 GiB, transformer "dit" 7.22 GiB, VAE "vae" 0.09 GiB).
"""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import pytest
from vramgraph.api.pipeline import Pipeline
from vramgraph.cli.main import main
from vramgraph.graph.engine import budget as budget_mod
from vramgraph.graph.engine.costs import PROFILES, cost_for, profile
from vramgraph.graph.plan.planner import DEFAULT_RESERVE, Budget, GiB, Load, ModelCost, NodeCost, Run, Unload, plan
from vramgraph.nodes.types import Variant

ROOT = Path(__file__).resolve().parents[1]
W = {"te": 5.80, "dit": 7.22, "vae": 0.09}  # as plan_bound.W
ACT = {512: {"te": 0.2, "dit": 0.22, "vae": 0.60}, 1024: {"te": 0.2, "dit": 0.57, "vae": 2.38},
       1536: {"te": 0.2, "dit": 1.2, "vae": 5.35}, 2048: {"te": 0.2, "dit": 2.3, "vae": 9.5}}  # as plan_bound.ACT
SEC = {512: {"te": 0.033, "dit": 4 * 0.039, "vae": 0.022}, 1024: {"te": 0.033, "dit": 4 * 0.083, "vae": 0.086},
       1536: {"te": 0.033, "dit": 4 * 0.17, "vae": 0.205}, 2048: {"te": 0.033, "dit": 4 * 0.33, "vae": 0.40}}
CONTEXT = 0.6  # GiB of a card that plan_bound gives the CUDA context
MODELS = {k: ModelCost(k, round(w * GiB), k) for k, w in W.items()}


def card(c: float) -> Budget:
    return Budget(gpu=round((c - CONTEXT) * GiB), host=64 * GiB)


def fewest_bytes(seq: list[str], side: int, budget: int) -> int | None:
    """Fewest bytes loaded over runs needing one model each (`seq`), from an empty GPU, with any whole-model
    residency: plan_bound.best at whole-model granularity, in integer bytes."""
    keys = list(MODELS)
    states = [frozenset(k for i, k in enumerate(keys) if mask >> i & 1) for mask in range(1 << len(keys))]
    cost = {frozenset(): 0}
    for need in seq:
        act = round(ACT[side][need] * GiB)
        nxt = {st: min(c + sum(MODELS[k].nbytes for k in st - p) for p, c in cost.items()) for st in states
               if need in st and sum(MODELS[k].nbytes for k in st) + act <= budget}
        if not nxt:
            return None
        cost = nxt
    return min(cost.values())


def edits(n: int, side: int) -> tuple[nx.DiGraph, dict[str, NodeCost]]:
    """n queued edits, inserted prompt by prompt (as graph/workflow/queue.py merges them); the reference is VAE-encoded,
    so the VAE is resident when the first sample ends (its activation here: the decode's, as in plan_bound).

        enc_i ──► ref_i (vae) ──► sample_i (dit) ──► decode_i (vae)        i = 0..n-1
    """
    dag, costs = nx.DiGraph(), {}
    for i in range(n):
        nodes = [(f"enc{i}", "VGTextEncode", "te"), (f"ref{i}", "VGReferenceImage", "vae"),
                 (f"sample{i}", "VGSampler", "dit"), (f"decode{i}", "VGVAEDecode", "vae")]
        for name, cls, m in nodes:
            costs[name] = NodeCost(name, cls, (Variant("gpu", (m,), round(ACT[side][m] * GiB), SEC[side][m]),),
                                   host_bytes=2**20)
            dag.add_node(name)
        nx.add_path(dag, [name for name, _, _ in nodes])
    return dag, costs


GROUPED = ("te", "vae", "dit", "vae")  # encode all, reference all, sample all, decode all


@pytest.mark.parametrize(("side", "card_gib"), [(1536, 12), (2048, 16), (1024, 12), (1024, 24), (2048, 24)])
@pytest.mark.parametrize("n", [2, 8])
def test_queued_edits_move_no_more_than_the_grouped_order(side: int, card_gib: int, n: int) -> None:
    """Where the decode cannot sit beside the transformer (12 GiB at 1536², 16 GiB at 2048²) the transformer is
    loaded once for the whole queue, not once per image: bytes moved <= 1.05x the best grouped order."""
    dag, costs = edits(n, side)
    p = plan(dag, costs, MODELS, card(card_gib), repeat=False)
    best = fewest_bytes([m for m in GROUPED for _ in range(n)], side, card(card_gib).gpu)
    assert best is not None
    assert p.bytes_moved <= 1.05 * best
    assert sum(1 for s in p.steps if isinstance(s.step, Load) and s.step.model == "dit") == 1
    samples = [i for i, s in enumerate(p.steps) if isinstance(s.step, Run) and s.step.node.startswith("sample")]
    if (W["dit"] + W["vae"] + ACT[side]["vae"]) * GiB > card(card_gib).gpu:  # no decode beside the transformer:
        assert samples == list(range(samples[0], samples[0] + n))  # the samples run back to back


def _plan_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """bench/plan_cells.py (the plan-only matrix), with its demo input images in tmp_path."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import plan_cells

    monkeypatch.setattr(plan_cells, "INPUT", tmp_path / "input")
    plan_cells.demo_inputs()
    return plan_cells


@pytest.mark.parametrize(("workflow", "card_gib", "side", "n"), [
    ("edit.json", 8, 512, 8), ("multi_reference.json", 8, 512, 2), ("text_to_image.json", 6, 1024, 8),
    ("edit.json", 6, 1024, 8)])
def test_streamed_queues_move_the_bytes_of_the_grouped_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               workflow: str, card_gib: int, side: int, n: int) -> None:
    """The matrix's cells where the transformer streams and the VAE (0.16 GiB) would cost the next sampler a block:
    the queue loads what the best grouped order loads (the VAE once for the references, once for the decodes; it was
    loaded once per image) and moves, loads and streaming together, no more than it (<= 1.05x is the acceptance)."""
    plan_cells = _plan_cells(tmp_path, monkeypatch)
    row = plan_cells.cell(plan_cells.planning_for(card_gib, None), workflow, side, n, card_gib)
    assert row["variants"]["VGSampler"] == ["stream"]
    assert row["gib_moved"] == row["grouped_loads_gib"]
    assert row["over_grouped"] <= 1.0 + 1e-4


@pytest.mark.parametrize("card_gib", [8, 10, 12])
def test_queued_cfg_samplers_at_2048_stream_no_more_than_one_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   card_gib: int) -> None:
    """Base model with CFG at 2048², two prompts: running CFG's two passes one after the other ("stream-cfg") would
    keep more blocks but stream each of the others twice, 1.5x the bytes for 0.01 % less predicted time; the near
    tie goes to "stream" (planner.TIE), so the queue streams twice what one image streams."""
    plan_cells = _plan_cells(tmp_path, monkeypatch)
    planning = plan_cells.planning_for(card_gib, None)
    one = plan_cells.cell(planning, "text_to_image_base.json", 2048, 1, card_gib)
    two = plan_cells.cell(planning, "text_to_image_base.json", 2048, 2, card_gib)
    assert one["variants"]["VGSampler"] == two["variants"]["VGSampler"] == ["stream"]
    assert two["gib_streamed"] == pytest.approx(2 * one["gib_streamed"], rel=1e-3)


def test_the_grouped_order_pays_for_a_vae_beside_a_streamed_sampler(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One edit on a 6 GiB card at 1024²: the VAE encodes the reference, leaves so that the streamed sampler keeps
    one more block, and comes back for the decode. The oracle counts the blocks it would have cost (0.69 GiB more
    streamed) and agrees: two loads are the fewest bytes, not the 2x of a count of loads alone."""
    plan_cells = _plan_cells(tmp_path, monkeypatch)
    row = plan_cells.cell(plan_cells.planning_for(6, None), "edit.json", 1024, 1, 6)
    assert row["loads"] == 2 and row["gib_moved"] == row["grouped_loads_gib"] == pytest.approx(0.313, abs=1e-3)
    assert row["over_grouped"] == 1.0
    assert row["gib_streamed"] > 0 and row["grouped_gib"] == pytest.approx(row["gib_moved"] + row["gib_streamed"],
                                                                           abs=2e-3)


def test_decode_beside_the_transformer_still_interleaves_nothing_moves() -> None:
    """At 24 GiB everything fits: one load of each model, nothing unloaded, whatever the order.

        enc_i ──► ref_i ──► sample_i ──► decode_i        i = 0..7, 1024²
    """
    dag, costs = edits(8, 1024)
    p = plan(dag, costs, MODELS, card(24), repeat=False)
    assert p.loads == 3 and not any(isinstance(s.step, Unload) for s in p.steps)


def _tool():
    import plan_bound  # tests/plan_bound.py: the shared tool, copied into the repository

    return plan_bound


def test_oracle_is_plan_bound() -> None:
    """The oracle above is plan_bound's whole-model DP (same sizes, same numbers) on the grouped edit queues."""
    tool = _tool()
    assert tool.W == W and tool.ACT == ACT and tool.CONTEXT == CONTEXT
    for side, card_gib in ((1536, 12), (2048, 16), (1024, 12)):
        seq = [m for m in GROUPED for _ in range(8)]
        assert fewest_bytes(seq, side, card(card_gib).gpu) / GiB == pytest.approx(
            tool.best(seq, side, card_gib - tool.CONTEXT, 1), abs=1e-6)


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize(("side", "card_gib"), [(1024, 12), (1536, 12), (2048, 16)])
def test_plans_under_a_profile_against_plan_bound(name: str, side: int, card_gib: int) -> None:
    """Under each cost profile, two images one by one and a queue of eight move no more bytes than plan_bound's
    optimum (x1.05 for the queue's grouped order), and the predicted seconds are the profile's: reloads at its
    pinned bandwidth, GPU compute scaled by its rate.

        enc ──► ref ──► sample ──► decode        (one by one: x2; queued: x8)
    """
    tool = _tool()
    cm = profile(name)
    dag, costs = edits(1, side)
    first = plan(dag, costs, MODELS, card(card_gib), cm)
    second = plan(dag, costs, MODELS, card(card_gib), cm, start=first.end, repeat=False)
    one_by_one = tool.best(list(GROUPED) * 2, side, card_gib - tool.CONTEXT, 1)
    assert (first.bytes_moved + second.bytes_moved) / GiB <= one_by_one + 1e-6
    for s in second.steps:
        if isinstance(s.step, Load):
            assert s.step.source == "pinned" and s.seconds == pytest.approx(MODELS[s.step.model].nbytes / cm.h2d_pinned)
        if isinstance(s.step, Run):
            assert s.seconds == pytest.approx(costs[s.step.node].variants[0].seconds * cm.compute)
    dag, costs = edits(8, side)
    queued = plan(dag, costs, MODELS, card(card_gib), cm, repeat=False)
    assert queued.bytes_moved / GiB <= 1.05 * tool.best([m for m in GROUPED for _ in range(8)], side,
                                                        card_gib - tool.CONTEXT, 1) + 1e-6
    assert queued.cost is cm and f"(costs: {cm.name})" in queued.table()


def test_a_slower_profile_predicts_longer_and_names_itself() -> None:
    """rtx3060 (25 GB/s, 1/8 of the H200's rate) predicts 8x the compute and the reloads at 25 GB/s."""
    dag, costs = edits(2, 1536)
    fast = plan(dag, costs, MODELS, card(12), profile("h200"), repeat=False)
    slow = plan(dag, costs, MODELS, card(12), profile("rtx3060"), repeat=False)
    assert slow.order == fast.order and slow.bytes_moved == fast.bytes_moved
    runs = [(a.seconds, b.seconds) for a, b in zip(fast.steps, slow.steps, strict=True) if isinstance(a.step, Run)]
    assert all(b == pytest.approx(8 * a) for a, b in runs)
    assert slow.to_json()["cost_profile"] == "rtx3060" and fast.to_json()["cost_profile"] == "h200"


def test_profile_names_and_the_assumed_default() -> None:
    with pytest.raises(ValueError, match="no such cost profile; choose one of h200, rtx3060"):
        profile("rtx9090")
    assert cost_for(None, "RTX3060") is PROFILES["rtx3060"]
    off = cost_for(None)  # no GPU to probe: the H200's constants, and the plan says they are assumed
    assert off.h2d_pinned == PROFILES["h200"].h2d_pinned and off.compute == 1.0 and "assumed" in off.name
    with pytest.raises(SystemExit) as bad:  # argparse refuses an unknown name, listing the known ones
        main(["plan", str(ROOT / "workflows" / "text_to_image.json"), "--profile", "nope", "--svg", ""])
    assert bad.value.code == 2


# ------------------------------------------------------------------------------------------ budget


def test_the_plan_off_the_gpu_has_the_budget_of_the_gpu_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`vramgraph plan --vram CARD` without a GPU computes the GPU path's formula with the context estimate; the
    GPU path, on a device whose context measures that much, computes the same Budget."""
    torch = pytest.importorskip("torch")
    total, workspace = 140 * GiB, 32 * 2**20
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(budget_mod, "blas_workspace", lambda index: workspace)  # held by torch, counted as context
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: workspace)
    context = budget_mod.CONTEXT_ESTIMATE - workspace  # the estimate covers both
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (total - context - workspace, total))
    caps = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index=None: caps.append(f))
    for c in (6, 8, 10, 12, 16, 24, 80):
        off = budget_mod.budget_for(None, f"{c}GiB", host="32GiB")
        on = budget_mod.budget_for("cuda", f"{c}GiB", host="32GiB")
        assert off == on
        assert off.gpu == budget_mod.card_budget(c * GiB, budget_mod.CONTEXT_ESTIMATE, DEFAULT_RESERVE)
        assert off.gpu == c * GiB - budget_mod.CONTEXT_ESTIMATE - budget_mod.CARD_MARGIN - DEFAULT_RESERVE
        # torch may hold the plan, the reserve and the workspace
        assert caps[-1] == pytest.approx((off.gpu + DEFAULT_RESERVE + workspace) / total)
    pipe = Pipeline(ROOT / "no-models-here", vram="12GiB", host="32GiB")  # (the free host RAM here changes)
    assert pipe.plan("text_to_image.json").budget == budget_mod.budget_for(None, "12GiB", host="32GiB")
    # the 12 GiB card: 11.02 GiB with the context estimate, at least the card less 1 GiB (engine/budget.py: the margins
    # measured); it was 9.96 with the card margin of 1 GiB
    assert round(budget_mod.budget_for(None, "12GiB").gpu / GiB, 2) == 11.02
    uncapped = budget_mod.budget_for("cuda")  # the device's free memory less the margin and the reserve
    assert uncapped.gpu == total - context - workspace - budget_mod.CARD_MARGIN - DEFAULT_RESERVE


def test_a_given_context_replaces_the_measured_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """`budget_for(..., context=C)` counts C as the CUDA context instead of what the device shows now (the budget a
    fresh process computed, kept by bench/oom_matrix.py for every cell of a warm one), and caps torch to it."""
    torch = pytest.importorskip("torch")
    total, now, fresh = 140 * GiB, 2 * GiB, 700 * 2**20
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: 0)
    monkeypatch.setattr(budget_mod, "blas_workspace", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (total - now, total))
    caps = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index=None: caps.append(f))
    measured = budget_mod.budget_for("cuda", "12GiB")
    given = budget_mod.budget_for("cuda", "12GiB", context=fresh)
    assert measured.gpu == budget_mod.card_budget(12 * GiB, now, DEFAULT_RESERVE)
    assert given.gpu == budget_mod.card_budget(12 * GiB, fresh, DEFAULT_RESERVE) == measured.gpu + now - fresh
    assert given.outside_allocator == fresh + budget_mod.CARD_MARGIN
    assert caps[-1] == pytest.approx((given.gpu + DEFAULT_RESERVE) / total)


def test_reserve_default_is_the_documented_one(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {DEFAULT_RESERVE // 2**20}MiB)" in text
    assert budget_mod.budget_for(None, "12GiB").reserve == DEFAULT_RESERVE == 128 * 2**20
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"`--reserve` ({DEFAULT_RESERVE // 2**20} MiB)" in readme


def test_a_card_smaller_than_the_context_plans_to_a_clear_rejection(capsys: pytest.CaptureFixture) -> None:
    assert budget_mod.budget_for(None, "768MiB").gpu == 0
    assert main(["plan", str(ROOT / "workflows" / "text_to_image.json"), "--vram", "768MiB", "--svg", ""]) == 3
    assert "needs" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ queues in plan


def test_plan_command_plans_a_queue(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two workflows, each queued twice: four prompts in one plan, one load of each model on a 24 GiB card; the
    SVG's title names the queue."""
    wfs = [str(ROOT / "workflows" / "text_to_image.json"), str(ROOT / "workflows" / "text_to_image_base.json")]
    svg = tmp_path / "q.svg"
    assert main(["plan", *wfs, "--prompts", "2", "--vram", "24GiB", "--models", str(tmp_path / "none"), "--json",
                 "--svg", str(svg)]) == 0
    doc = json.loads(capsys.readouterr().out)
    runs = [s for s in doc["steps"] if s["kind"] == "run"]
    samplers = [s["node"] for s in runs if s["node"].endswith(":6")]
    assert len(samplers) == 4 and len({s["node"] for s in runs if s["node"].endswith(":8")}) == 4
    loads = [s["model"] for s in doc["steps"] if s["kind"] == "load"]
    assert len(loads) == len(set(loads)) == 4  # two transformers (distilled and base), the text encoder, the VAE
    assert "text_to_image.json + text_to_image_base.json x 2" in svg.read_text(encoding="utf-8")
    assert main(["plan", wfs[0], "--prompts", "0", "--svg", ""]) == 2


def test_pipeline_plan_of_a_queue_matches_the_merged_queue(tmp_path: Path) -> None:
    """Pipeline.plan(prompts=8) of an edit is the plan of eight queued edits: grouped, one transformer load even
    where the decode cannot sit beside it (12 GiB at 1536²)."""
    from vramgraph.graph.engine.runtime import DEMO_IMAGES, demo_image

    (tmp_path / "input").mkdir()
    for i, (name, size) in enumerate(DEMO_IMAGES.items()):
        demo_image(size, i).save(tmp_path / "input" / name)
    pipe = Pipeline(tmp_path / "none", vram="12GiB", input=tmp_path / "input")
    p = pipe.plan("edit.json", size="1536x1536", prompts=8)
    transformer = [s for s in p.steps if isinstance(s.step, Load) and s.step.model.startswith("transformer")]
    assert len(transformer) == 1 and p.loads == 3
    assert sum(1 for s in p.steps if isinstance(s.step, Run) and p.classes[s.step.node] == "VGSampler") == 8
