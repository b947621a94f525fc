"""Placement on several devices (graph/plan/placement.py): exact expected placements on fake devices, and the choice
checked against an exhaustive search over every node-to-device assignment on small cases.

Sizes and seconds are FLUX.2-klein-4B's, as in test_planner.py: text encoder 5.80 GiB, transformer 7.22 GiB,
VAE 0.09 GiB; a card of C GiB gives a budget of C - 0.6 GiB.
"""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from test_planner import MODELS, card, chains, gib
from vramgraph.graph.plan import placement
from vramgraph.graph.plan.placement import Device, parse_devices, place, split_sizes
from vramgraph.graph.plan.planner import Budget, Load, NodeCost, PlanError, Residency, Run, Unload, plan
from vramgraph.nodes.types import Variant


def saved(n: int, side: int = 1024) -> tuple[nx.DiGraph, dict[str, NodeCost]]:
    """n prompts enc_i -> sample_i -> decode_i -> save_i, each with its own free nodes (a loader, an empty
    latent) feeding them, as a merged queue has them."""
    dag, costs = chains(n, side)
    for i in range(n):
        for free, into in ((f"load{i}", f"enc{i}"), (f"latent{i}", f"sample{i}")):
            dag.add_edge(free, into)
            costs[free] = NodeCost(free, "Free", (Variant("cpu", (), 0, 0.0),))
        dag.add_edge(f"decode{i}", f"save{i}")
        costs[f"save{i}"] = NodeCost(f"save{i}", "SaveImage", (Variant("cpu", (), 0, 0.01),))
    return dag, costs


def two(c0: float, c1: float | None = None) -> list[Device]:
    return [Device("cuda:0", card(c0)), Device("cuda:1", card(c1 if c1 is not None else c0))]


def test_one_device_is_exactly_the_one_device_plan():
    dag, costs = saved(2)
    got = place(dag, costs, MODELS, [Device("cuda:0", card(12))])
    assert got.kind == "one device" and got.devices == ("cuda:0",)
    assert got.lanes[0].plan == plan(dag, costs, MODELS, card(12))
    assert got.finish == pytest.approx(got.lanes[0].plan.seconds) and got.transfers == ()


def test_two_12gib_cards_split_the_models_and_never_move_one():
    """Two images at 1024² on two 12 GiB cards: the text encoder on one card, the transformer on the other;
    each model is loaded once and nothing is unloaded, where one 12 GiB card swaps te and dit. (The VAE goes
    beside the text encoder: cold, its file is read while the transformer's is, which the plan predicts
    0.13 s sooner than beside the transformer.) A save, which needs nothing, runs as soon as its decode is done."""
    dag, costs = saved(2)
    got = place(dag, costs, MODELS, two(12))
    assert got.kind == "split models"
    assert got.model_devices() == {"te": ("cuda:0",), "dit": ("cuda:1",), "vae": ("cuda:0",)}
    assert got.loads == 3 and got.bytes_moved == sum(m.nbytes for m in MODELS.values())
    assert not any(isinstance(s.step, Unload) for lane in got.lanes for s in lane.plan.steps)
    te, dit = got.lane("cuda:0").plan, got.lane("cuda:1").plan
    assert [s.step for s in te.steps if isinstance(s.step, Run)] == [
        Run("load0", "cpu"), Run("load1", "cpu"), Run("enc0", "gpu"), Run("enc1", "gpu"), Run("decode0", "gpu"),
        Run("save0", "cpu"), Run("decode1", "gpu"), Run("save1", "cpu")]
    assert dit.order == ("latent0", "latent1", "sample0", "sample1")
    assert got.lane("cuda:1").imports == {"sample0": ("enc0",), "sample1": ("enc1",)}
    assert got.lane("cuda:0").imports == {"decode0": ("sample0",), "decode1": ("sample1",)}
    assert {(t.node, t.source, t.target) for t in got.transfers} == {
        ("enc0", "cuda:0", "cuda:1"), ("enc1", "cuda:0", "cuda:1"), ("sample0", "cuda:1", "cuda:0"),
        ("sample1", "cuda:1", "cuda:0")}
    # the second image finds every model where it was: no model move after the first load
    again = place(dag, costs, MODELS, two(12), starts={lane.device: lane.plan.end for lane in got.lanes})
    assert again.loads == 0
    one = plan(dag, costs, MODELS, card(12))
    assert plan(dag, costs, MODELS, card(12), start=one.end).loads > 0 and got.warm_bytes == 0
    assert got.warm < plan(dag, costs, MODELS, card(12), start=one.end).seconds


def test_two_big_cards_split_the_queue():
    """Eight prompts on two 24 GiB cards: each card holds a full model set, so the queue is dealt out and the
    two work at once; the split by model would leave the transformer's card doing all eight samplings."""
    dag, costs = saved(8)
    got = place(dag, costs, MODELS, two(24))
    assert got.kind == "split queue"
    assert got.model_devices() == {m: ("cuda:0", "cuda:1") for m in ("te", "dit", "vae")}
    assert {n for n in got.lane("cuda:0").plan.order if n.startswith("save")} == {"save0", "save2", "save4", "save6"}
    assert got.transfers == ()
    alone = plan(dag, costs, MODELS, card(24))
    warm_alone = plan(dag, costs, MODELS, card(24), start=alone.end)
    assert warm_alone.loads == 0 and got.warm_bytes == 0
    assert got.warm < 0.55 * warm_alone.seconds  # the two cards each do four of the eight images


def test_the_queue_is_pipelined_across_split_models():
    """Split by model, card 1 samples image k while card 0 encodes image k+1: the predicted finish is below
    the sum of both lanes' work."""
    dag, costs = saved(4)
    devices = two(12)
    got = placement._build("split models", dag, costs, MODELS, devices, placement.CostModel(), {}, True,
                           placement._global_order(dag, costs, MODELS, devices, placement.CostModel()),
                           {**{f"enc{i}": "cuda:0" for i in range(4)},
                            **{f"{x}{i}": "cuda:1" for i in range(4) for x in ("sample", "decode")}})
    assert got.finish < got.sequential - 3 * costs["enc1"].variants[0].seconds + 1e-9


def test_lanes_follow_one_global_order():
    """However the users are assigned, no two lanes wait on each other (the simulation would say so)."""
    dag, costs = saved(2)
    devices = two(40)
    order = placement._global_order(dag, costs, MODELS, devices, placement.CostModel())
    users = [n for n in order if placement._uses(costs[n])]
    for combo in itertools.product(("cuda:0", "cuda:1"), repeat=len(users)):
        p = placement._build("search", dag, costs, MODELS, devices, placement.CostModel(), {}, True, order,
                             dict(zip(users, combo, strict=True)))
        assert p.finish <= p.sequential + 1e-9
        for lane in p.lanes:  # every lane's run order is the global order restricted to the lane
            assert list(lane.plan.order) == [n for n in order if n in set(lane.plan.order)]


@pytest.mark.parametrize("cards,prompts", [((12, 12), 1), ((12, 12), 2), ((12, 8), 2), ((24, 24), 2),
                                           ((16, 10), 2), ((12, 6), 2), ((12, 8), 1)])
def test_candidates_reach_the_exhaustive_optimum(cards, prompts):
    """The candidate families (one device, split models, split queue) against every assignment of the
    model-using nodes to the two devices: the same bytes moved in the next run, its finish within 2 %."""
    dag, costs = saved(prompts)
    devices = two(*cards)
    order = placement._global_order(dag, costs, MODELS, devices, placement.CostModel())
    users = [n for n in order if placement._uses(costs[n])]
    best: list[tuple] = []
    for combo in itertools.product(("cuda:0", "cuda:1"), repeat=len(users)):
        try:
            best.append(placement._build("search", dag, costs, MODELS, devices, placement.CostModel(), {}, True,
                                         order, dict(zip(users, combo, strict=True))).score[:2])
        except PlanError:
            pass
    got = place(dag, costs, MODELS, devices)
    assert got.score[0] == min(best)[0] and got.score[1] <= 1.02 * min(best)[1]


def test_transformer_fits_on_neither_card_is_the_one_device_error():
    dag, costs = saved(1)
    with pytest.raises(PlanError) as e:
        place(dag, costs, MODELS, two(6))
    assert e.value.node == "sample0" and "budget" in e.value.message


def test_a_card_too_small_for_a_model_gets_the_rest():
    """A 6 GiB card beside a 12 GiB one at 2048²: the 6 GiB card cannot hold the transformer nor decode
    (9.5 GiB), so it takes the text encoder and the 12 GiB card the rest, still without a model move."""
    dag, costs = saved(1, side=2048)
    got = place(dag, costs, MODELS, two(6.7, 12))
    assert got.model_devices()["te"] == ("cuda:0",) and got.model_devices()["dit"] == ("cuda:1",)
    one = plan(dag, costs, MODELS, card(12))
    assert got.warm_bytes < plan(dag, costs, MODELS, card(12), start=one.end).bytes_moved


def test_start_residency_is_kept_per_device():
    dag, costs = saved(1)
    starts = {"cuda:0": Residency(frozenset({"te"})), "cuda:1": Residency(frozenset({"dit", "vae"}))}
    got = place(dag, costs, MODELS, two(12), starts=starts)
    assert got.loads == 0 and got.kind in ("split models", "search")


def test_plan_json_and_table_have_one_lane_per_device():
    dag, costs = saved(2)
    got = place(dag, costs, MODELS, two(12))
    js = got.to_json()
    assert [lane["device"] for lane in js["lanes"]] == ["cuda:0", "cuda:1"]
    assert js["loads"] == 3 and {t["node"] for t in js["transfers"]} >= {"enc0", "enc1"}
    assert js["lanes"][1]["plan"]["steps"][0] == {**js["lanes"][1]["plan"]["steps"][0], "kind": "run"}
    text = got.table()
    assert "== cuda:0" in text and "== cuda:1" in text and "copy: output of enc0 from cuda:0 to cuda:1" in text
    assert any(isinstance(s.step, Load) and s.step.model == "te" for s in got.lane("cuda:0").plan.steps)


def test_parse_devices_and_sizes():
    assert parse_devices("cuda:0,cuda:1", 2) == ["cuda:0", "cuda:1"]
    assert parse_devices("all", 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert parse_devices("cuda", 1) == ["cuda:0"]
    for bad, msg in (("cuda:0,cuda:0", "named twice"), ("cuda:2", "2 CUDA device"), ("cpu", "not a CUDA device"),
                     ("cuda:x", "not a CUDA device")):
        with pytest.raises(ValueError, match=msg):
            parse_devices(bad, 2)
    with pytest.raises(ValueError, match="no CUDA device"):
        parse_devices("all", 0)
    assert split_sizes("12GiB,8GiB", 2) == ["12GiB", "8GiB"] and split_sizes("12GiB", 2) == ["12GiB"] * 2
    assert split_sizes(None, 2) == [None, None]
    with pytest.raises(ValueError, match="3 sizes for 2 devices"):
        split_sizes("1GiB,2GiB,3GiB", 2)


def test_budget_is_per_device():
    """A small second card gets only what fits there: with 4 GiB it can hold the VAE alone, and the plan keeps
    the decode beside the transformer or moves it there only when that fits."""
    dag, costs = saved(1)
    got = place(dag, costs, MODELS, [Device("cuda:0", card(24)), Device("cuda:1", Budget(gib(3.4), gib(64)))])
    for lane in got.lanes:
        assert lane.plan.peak <= lane.plan.budget.gpu
