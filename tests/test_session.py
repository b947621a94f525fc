"""Residency for the runs to come (graph/plan/session.py): images sent one by one against an exact oracle.

The oracle (`exhaustive`) is bench/session_bound.py's dynamic programme over every resident subset of every streamed
model's blocks (the bench keeps evenly spread counts and `choose`'s sets, which the real 25-block transformer needs),
over all the images at once, from the same start, with the same cost model. Tiny models: a 4-block text encoder, a
4-block transformer run 8 passes an image, a VAE; bytes and seconds are made up, the relations are not.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import networkx as nx
import pytest
from vramgraph.graph.plan import planner, session
from vramgraph.graph.plan.planner import Budget, CostModel, ModelCost, NodeCost, Residency
from vramgraph.nodes.types import Blocks, Variant

ROOT = Path(__file__).resolve().parents[1]
CM = CostModel(h2d_pinned=100.0, name="tiny")  # 100 B/s: a block of 50 B copies in half a second
MODELS = {"te": ModelCost("te", 200, "text encoder"), "dit": ModelCost("dit", 220, "transformer"),
          "vae": ModelCost("vae", 10, "vae")}


def graph(passes: int = 8, te_block_s: float = 0.05, dit_block_s: float = 0.5
          ) -> tuple[nx.DiGraph, dict[str, NodeCost]]:
    """One image, as the shipped workflow runs it; the encoder and the sampler can run streamed.

        enc (te: gpu | stream) ──► sample (dit: gpu | stream, `passes` passes) ──► decode (vae)
    """
    te = Blocks("te", (50,) * 4, (te_block_s,) * 4, fixed=0, activation=2, passes=1, unit="encode")
    dit = Blocks("dit", (50,) * 4, (dit_block_s,) * 4, fixed=20, activation=10, passes=passes)
    costs = {
        "enc": NodeCost("enc", "VGTextEncode", (Variant("gpu", ("te",), 2, 4 * te_block_s),
                                                Variant("stream", (), te.min_gpu(), 4 * te_block_s, streams=("te",),
                                                        blocks=te))),
        "sample": NodeCost("sample", "VGSampler", (Variant("gpu", ("dit",), 10, passes * 4 * dit_block_s),
                                                   Variant("stream", (), dit.min_gpu(), passes * 4 * dit_block_s,
                                                           streams=("dit",), blocks=dit))),
        "decode": NodeCost("decode", "VGVAEDecode", (Variant("gpu", ("vae",), 60, 0.1),)),
    }
    return nx.DiGraph([("enc", "sample"), ("sample", "decode")]), costs


def one_by_one(dag: nx.DiGraph, costs: dict[str, NodeCost], budget: Budget, n: int, use_session: bool = True
               ) -> list[planner.Plan]:
    """n images, each planned from the last one's end with `repeat`, one context (as an engine plans them)."""
    context = planner.PlanContext(session=use_session)
    start, out = Residency(pinned=frozenset(MODELS)), []
    for _ in range(n):
        p = planner.plan(dag, costs, MODELS, budget, CM, start, context=context)
        assert p.peak <= budget.gpu
        out.append(p)
        start = p.end
    return out


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import session_bound

    return session_bound


def exhaustive(costs: dict[str, NodeCost], gpu: int, n: int) -> dict:
    """The exact bound over every resident subset of the blocks (module docstring)."""
    bound = _bench().Bound

    class Every(bound):  # type: ignore[misc,valid-type]
        def sets(self, j: int, spec: Blocks) -> list[tuple[int, ...]]:
            k = len(spec.sizes)
            return [c for r in range(k + 1) for c in itertools.combinations(range(k), r)]

    return Every([costs[x] for x in ("enc", "sample", "decode")], MODELS, gpu, CM).report(n)


def totals(plans: list[planner.Plan]) -> tuple[float, int]:
    return sum(p.seconds for p in plans), sum(p.bytes_moved + p.streamed_bytes for p in plans)


ROOMS = [300, 340, 380, 430]  # the transformer streams, fits alone, fits beside a part of the text encoder or all of it


@pytest.mark.parametrize("gpu", ROOMS)
@pytest.mark.parametrize("passes", [1, 8])
def test_images_one_by_one_within_the_exact_bound(gpu: int, passes: int) -> None:
    """Six images one by one: predicted seconds within 1.05x the oracle's least, and bytes within 1.2x the fewest of
    the oracle's paths within 1 % of that least (what the planner's rule promises is its own 4-image look ahead;
    this is the bar of issue 35)."""
    dag, costs = graph(passes)
    plans = one_by_one(dag, costs, Budget(gpu, 10**6), 6)
    secs, nbytes = totals(plans)
    bound = exhaustive(costs, gpu, 6)
    assert secs <= 1.05 * bound["seconds"]
    assert nbytes <= 1.2 * bound["within_gib"] * 2**30 + 1e-6


def test_kept_parts_instead_of_streaming_the_transformer_every_pass() -> None:
    """The issue's 12 GiB card in small: the text encoder (200 B) and the transformer (220 B) do not fit together,
    and the transformer's copies hide behind its compute. Pass 3 alone keeps the encoder whole, which runs once an
    image, and streams most of the transformer in each of its 8 passes; planned for the images to come, the encoder
    streams once an image and the transformer keeps a part that stays from image to image: no slower, and less than
    half the bytes.

        enc ──► sample ──► decode        x6, 400 B of GPU
    """
    dag, costs = graph(8, dit_block_s=0.5)
    budget = Budget(400, 10**6)
    alone = one_by_one(dag, costs, budget, 6, use_session=False)
    ahead = one_by_one(dag, costs, budget, 6)
    assert alone[-1].variant_of("sample") == "stream" and alone[-1].variant_of("enc") == "gpu"
    assert ahead[-1].variant_of("enc") == "stream" and ahead[-1].bytes_moved == 0  # nothing loaded whole
    assert any(k.startswith("dit#kept=") for k in ahead[-1].end.gpu)
    (t_alone, b_alone), (t_ahead, b_ahead) = totals(alone), totals(ahead)
    assert t_ahead <= t_alone and 2 * b_ahead < b_alone
    assert "chosen for the runs to come" in ahead[-1].table()


def test_where_everything_fits_the_plan_is_pass_3s() -> None:
    """500 B: every model fits with every node. Pass 3 loads each once and moves nothing after: its plan stands (the
    oracle streams the first image's transformer behind its compute, 5 % faster over six images at one pass an
    image; every plan reads each model once)."""
    dag, costs = graph(1)
    budget = Budget(500, 10**6)
    ahead, alone = one_by_one(dag, costs, budget, 6), one_by_one(dag, costs, budget, 6, use_session=False)
    assert [p.steps for p in ahead] == [p.steps for p in alone] and ahead[0].loads == 3 and ahead[1].loads == 0


@pytest.mark.parametrize("gpu", ROOMS)
def test_never_slower_than_pass_3_alone_by_more_than_the_rule(gpu: int) -> None:
    """The rule's promise over its look ahead: the chosen plans are within 1 % of pass 3's own in seconds, or copy
    fewer bytes (here over six images, each planned for the four to come)."""
    dag, costs = graph(8)
    budget = Budget(gpu, 10**6)
    (t_alone, b_alone), (t_ahead, b_ahead) = (totals(one_by_one(dag, costs, budget, 6, s)) for s in (False, True))
    assert t_ahead <= t_alone * (1 + session.WITHIN) + 1e-9 or b_ahead < b_alone


def test_remembered_choice_is_the_same_plan() -> None:
    """A session's runs come back to the same start: the remembered choice (PlanContext.sessions) gives the plan that
    a fresh context computes."""
    dag, costs = graph(8)
    budget = Budget(400, 10**6)
    plans = one_by_one(dag, costs, budget, 3)
    fresh = planner.plan(dag, costs, MODELS, budget, CM, plans[1].end, context=planner.PlanContext(session=True))
    assert plans[2].steps == fresh.steps and plans[2].end == fresh.end


def test_the_next_prompts_follow_the_chosen_path_without_the_programme(monkeypatch) -> None:
    """The programme runs for the first prompt of a session only: the next ones take the moves its path chose for
    the starts they come to (remembered in the context), and plan what a fresh context plans from there."""
    dag, costs = graph(8, dit_block_s=0.5)
    budget = Budget(400, 10**6)
    calls = []
    choose = session.choose
    monkeypatch.setattr(session, "choose", lambda *a: calls.append(a[8]) or choose(*a))  # a[8]: the start
    plans = one_by_one(dag, costs, budget, 6)
    assert len(calls) == 1 and calls[0] == Residency(pinned=frozenset(MODELS))
    assert plans[-1].variant_of("enc") == "stream"  # the programme's path, not pass 3's (see the test above)
    fresh = planner.plan(dag, costs, MODELS, budget, CM, plans[1].end, context=planner.PlanContext(session=True))
    assert fresh.steps == plans[2].steps


def test_a_run_without_repeat_and_a_queue_are_pass_3s() -> None:
    """Only a small run that will run again is planned for the runs to come: without `repeat` (the last prompt of a
    batch) the plan is pass 3's own, and a run of more than SMALL_NODES nodes that use the GPU (a queue) is too."""
    dag, costs = graph(8, dit_block_s=0.5)
    budget, start = Budget(400, 10**6), Residency(pinned=frozenset(MODELS))
    once = planner.plan(dag, costs, MODELS, budget, CM, start, repeat=False)
    alone = planner.plan(dag, costs, MODELS, budget, CM, start, repeat=False,
                         context=planner.PlanContext(session=False))
    assert once.steps == alone.steps
    assert session.Session.small([costs["enc"]] * session.SMALL_NODES, Residency())
    assert not session.Session.small([costs["enc"]] * (session.SMALL_NODES + 1), Residency())


BASE_MODELS = {"te": ModelCost("te", 120, "text encoder"), "dit": ModelCost("dit", 125, "transformer"),
               "vae": ModelCost("vae", 5, "vae")}


def base_graph() -> tuple[nx.DiGraph, dict[str, NodeCost]]:
    """The base model on a 12 GiB card in small: a 12-block encoder (120 B) and a transformer (125 B: 2 blocks of
    20 B, 8 of 10 B) that runs 20 passes an image, whose copies hide behind its compute; they do not fit together,
    and the VAE decode needs 15 B beside what stays.

        enc (te: gpu | stream) ──► sample (dit: gpu | stream, 20 passes) ──► decode (vae)
    """
    te = Blocks("te", (10,) * 12, (0.01,) * 12, fixed=0, activation=2, passes=1, unit="encode")
    dit = Blocks("dit", (20,) * 2 + (10,) * 8, (0.2,) * 10, fixed=5, activation=5, passes=20)
    costs = {
        "enc": NodeCost("enc", "VGTextEncode", (Variant("gpu", ("te",), 2, 0.12),
                                                Variant("stream", (), te.min_gpu(), 0.12, streams=("te",),
                                                        blocks=te))),
        "sample": NodeCost("sample", "VGSampler", (Variant("gpu", ("dit",), 5, 40.0),
                                                   Variant("stream", (), dit.min_gpu(), 40.0, streams=("dit",),
                                                           blocks=dit))),
        "decode": NodeCost("decode", "VGVAEDecode", (Variant("gpu", ("vae",), 10, 0.01),)),
    }
    return nx.DiGraph([("enc", "sample"), ("sample", "decode")]), costs


def test_a_transformer_kept_all_but_a_block_beside_the_encoders_part() -> None:
    """The fewest bytes within 1 % keep all of the transformer but one small block, streamed each pass, and the most
    of the encoder that stays beside it through the decode: parts that the 1/PARTS ladder has not (`near`, `fill`).
    Six images one by one against the bench's bound (every count of blocks, 64 rooms): seconds within 1.05x and bytes
    within 1.2x of its fewest within 1 % (1.37x without those parts)."""
    dag, costs = base_graph()
    budget, start = Budget(210, 10**6), Residency(pinned=frozenset(BASE_MODELS))
    context, plans = planner.PlanContext(session=True), []
    for _ in range(6):
        plans.append(planner.plan(dag, costs, BASE_MODELS, budget, CM, start, context=context))
        start = plans[-1].end
    secs, nbytes = totals(plans)
    bound = _bench().Bound([costs[x] for x in ("enc", "sample", "decode")], BASE_MODELS, 210, CM).report(6)
    assert secs <= 1.05 * bound["seconds"]
    assert nbytes <= 1.2 * bound["within_gib"] * 2**30 + 1e-6


def test_keep_all_but_streams_the_smallest_blocks_spread() -> None:
    """All but two of six blocks: the two streamed are 50 B ones (the fewest bytes a pass), spread among the four."""
    spec = Blocks("m", (100, 100, 50, 50, 50, 50), (0.1,) * 6, fixed=0, activation=1, passes=4)
    assert session.keep_all_but(spec, 2) == (0, 1, 2, 4)
    assert session.keep_all_but(spec, 5) == (0,)


def test_the_next_price_is_where_the_chosen_and_the_next_slower_tie() -> None:
    """10 s with 1000 B is chosen (10.5 s is over 1 %); at 100 B/s the two cost the same at 0.5 s per 9 s of copy."""
    chosen = session.Chosen(None, frozenset())
    candidates = [((10.0, 1000), chosen), ((10.5, 100), chosen), ((12.0, 50), chosen)]
    assert session.tie(candidates, 100.0) == pytest.approx(0.5 * 100 / 900)
    assert session.tie(candidates[:1], 100.0) is None


def test_an_engine_plans_ahead_only_when_asked(monkeypatch) -> None:
    """Off by default (pass 3 alone, as measured on the GPU so far); VRAMGRAPH_PLAN_AHEAD=on turns the rule on for an
    engine's plans; any other value is refused, naming the variable."""
    from vramgraph.graph.engine.executor import plan_ahead

    monkeypatch.delenv("VRAMGRAPH_PLAN_AHEAD", raising=False)
    assert plan_ahead() is False and planner.PlanContext().session is False
    monkeypatch.setenv("VRAMGRAPH_PLAN_AHEAD", "on")
    assert plan_ahead() is True
    monkeypatch.setenv("VRAMGRAPH_PLAN_AHEAD", "yes")
    with pytest.raises(ValueError, match="VRAMGRAPH_PLAN_AHEAD='yes': use on or off"):
        plan_ahead()


def _walk(s: session.Session, runs: int, price: float) -> list[list[session.Move]]:
    """`Session.paths` written as the plain walk it replaces: per node run, each state's cheapest way in (the first
    of the cheapest, in the order of the states and their ways), then back from the cheapest state at the end."""
    per_byte, n = price / s.bw, len(s.nodes)
    cost = {s.start: 0.0}
    back = []
    for step in range(runs * n):
        nxt: dict[tuple[int, ...], float] = {}
        how: dict[tuple[int, ...], tuple[tuple[int, ...], session.Move]] = {}
        for state, c in cost.items():
            ways = s.ways(step % n, state)
            for after, secs, copied, move in zip(ways.after, ways.secs, ways.copied, ways.moves, strict=True):
                total = c + secs + copied * per_byte
                if total < nxt.get(after, float("inf")):
                    nxt[after], how[after] = total, (state, move)
        if not nxt:
            return []
        cost = nxt
        back.append(how)
    at = min(cost, key=cost.__getitem__)
    moves = []
    for how in reversed(back):
        at, move = how[at]
        moves.append(move)
    moves.reverse()
    return [moves[r * n:(r + 1) * n] for r in range(runs)]


@pytest.mark.parametrize(("make", "models", "gpu"), [(graph, MODELS, 400), (graph, MODELS, 300),
                                                      (base_graph, BASE_MODELS, 210), (base_graph, BASE_MODELS, 160)])
def test_the_programme_takes_the_paths_of_the_plain_walk(make, models, gpu) -> None:
    """`Session.paths` (each node's ways from a list of states built once, the cheapest way into each state picked
    with numpy) gives the path of the plain walk over the ways, at every price the rule tries."""
    from vramgraph.graph.plan.sizes import Sizes

    _, costs = make()
    s = session.Session([costs["enc"], costs["sample"], costs["decode"]], Sizes(models), Budget(gpu, 10**6), CM,
                        Residency(pinned=frozenset(models)))
    paths = {}
    for price in (*session.BYTE_PRICES, 0.01, 0.3, 1.0):
        paths[price] = s.paths(session.HORIZON, price)
        assert len(paths[price]) == session.HORIZON and paths[price] == _walk(s, session.HORIZON, price)
    assert len({repr(p) for p in paths.values()}) >= 2  # the prices lead to different paths: the walk is not trivial
