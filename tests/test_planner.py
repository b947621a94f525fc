"""The ahead-of-time GPU memory planner: every test draws its DAG and asserts the exact plan.

Sizes are FLUX.2-klein-4B's (reference/anchors-h200.json): text encoder "te" 5.80 GiB, transformer "dit"
7.22 GiB, VAE decoder "vae" 0.09 GiB. A card of C GiB gives a budget of C - 0.6 GiB (CUDA context).

Pinned copies: a model is a candidate for a pinned host copy (`Load(pin=True)`, later `Unload(to="pinned")`)
if the plan unloads it (in this run or, with repeat, in the next one) or if the models the run uses (the chosen
variants' models and streams) cannot all be resident together with the largest chosen activation: then every
used model is a candidate, since another prompt may push any of them out. Candidates are pinned while host RAM
allows. When everything fits, nothing is pinned and every model is loaded with `Load(model, "file")`.
"""

from __future__ import annotations

import gc
import json
import re
from xml.etree import ElementTree

import networkx as nx
import pytest
from vramgraph.graph.draw.timeline import timeline_data, timeline_svg
from vramgraph.graph.plan.planner import (
    TIE,
    Budget,
    CostModel,
    GiB,
    Load,
    ModelCost,
    NodeCost,
    Plan,
    PlanError,
    Residency,
    Run,
    Unload,
    plan,
)
from vramgraph.nodes.types import Blocks, Variant

MiB = 2**20


def gib(x: float) -> int:
    return round(x * GiB)


def card(c: float, host: float = 64) -> Budget:
    return Budget(gpu=gib(c - 0.6), host=gib(host))


MODELS = {k: ModelCost(k, gib(w), label) for k, w, label in
          (("te", 5.80, "text encoder"), ("dit", 7.22, "transformer"), ("vae", 0.09, "vae"))}
# activation GiB and compute seconds by image side (measured on the H200; 2048 extrapolated)
ACT = {1024: {"te": 0.2, "dit": 0.57, "vae": 2.38}, 1536: {"te": 0.2, "dit": 1.2, "vae": 5.35},
       2048: {"te": 0.2, "dit": 2.3, "vae": 9.5}}
SEC = {1024: {"te": 0.033, "dit": 4 * 0.083, "vae": 0.086}, 1536: {"te": 0.033, "dit": 4 * 0.17, "vae": 0.205},
       2048: {"te": 0.033, "dit": 4 * 0.33, "vae": 0.40}}
CPU_DECODE = Variant("cpu", (), 0, 134.0, "decodes on the CPU: 134 s")


def encode(node: str, side: int = 1024, cpu: bool = True) -> NodeCost:
    gpu = Variant("gpu", ("te",), gib(ACT[side]["te"]), SEC[side]["te"])
    return NodeCost(node, "CLIPTextEncode", (gpu, Variant("cpu", (), 0, 9.0, "encodes on the CPU")) if cpu else (gpu,),
                    host_bytes=8 * MiB)


def sample(node: str, side: int = 1024) -> NodeCost:
    return NodeCost(node, "KSampler", (Variant("gpu", ("dit",), gib(ACT[side]["dit"]), SEC[side]["dit"]),),
                    host_bytes=1 * MiB)


def decode(node: str, side: int = 1024, variants: tuple[Variant, ...] | None = None) -> NodeCost:
    gpu = Variant("gpu", ("vae",), gib(ACT[side]["vae"]), SEC[side]["vae"])
    tiled = Variant("tiled", ("vae",), gib(0.5), 4 * SEC[side]["vae"], "decodes in tiles")
    return NodeCost(node, "VAEDecode", variants or (gpu, tiled, CPU_DECODE), host_bytes=12 * MiB)


def chains(n: int, side: int = 1024, cpu: bool = True, suffix: bool = True) -> tuple[nx.DiGraph, dict[str, NodeCost]]:
    """n independent chains enc_i -> sample_i -> decode_i, inserted chain by chain."""
    dag, costs = nx.DiGraph(), {}
    for i in range(n):
        e, s, d = (f"{x}{i}" if suffix else x for x in ("enc", "sample", "decode"))
        dag.add_edge(e, s)
        dag.add_edge(s, d)
        costs.update({e: encode(e, side, cpu), s: sample(s, side), d: decode(d, side)})
    return dag, costs


def steps(p: Plan) -> list[object]:
    return [s.step for s in p.steps]


def images(dag: nx.DiGraph, costs: dict[str, NodeCost], budget: Budget, n: int, last_repeat: bool = True
           ) -> list[Plan]:
    """Plan n runs of the same graph, each starting from the previous run's end residency."""
    out, start = [], Residency()
    for i in range(n):
        p = plan(dag, costs, MODELS, budget, start=start, repeat=last_repeat or i < n - 1)
        out.append(p)
        start = p.end
    return out


FILE_PIN, PINNED = {"source": "file", "pin": True}, {"source": "pinned"}


def test_everything_fits_no_unload():
    """All three models fit together on an 80 GiB budget: load each once, never unload, so none gets a
    pinned copy (it would never be reloaded from it).

        enc ──► sample ──► decode
    """
    dag, costs = chains(1, suffix=False)
    p = plan(dag, costs, MODELS, Budget(gib(80), gib(64)))
    assert steps(p) == [Load("te", "file"), Run("enc", "gpu"), Load("dit", "file"), Run("sample", "gpu"),
                        Load("vae", "file"), Run("decode", "gpu")]
    assert p.end == Residency(frozenset(MODELS), frozenset())
    assert p.peak == gib(5.80) + gib(7.22) + gib(0.09) + gib(2.38)
    assert p.loads == 3 and p.bytes_moved == sum(m.nbytes for m in MODELS.values())
    again = plan(dag, costs, MODELS, Budget(gib(80), gib(64)), start=p.end)
    assert again.loads == 0
    assert steps(again) == [Run("enc", "gpu"), Run("sample", "gpu"), Run("decode", "gpu")]


def test_12gib_two_images_swap_encoder_and_transformer():
    """12 GiB card, 1024²: te (5.80) + dit (7.22) never fit together, the decode fits beside dit.

        enc ──► sample ──► decode          (run twice: image 2 starts from image 1's end)

    Image 2 swaps: unload dit, load te, encode, unload te, load dit, sample; the encoder never goes to the CPU.
    te + dit + vae + the decode's activation exceed the budget, so all three get pinned copies (the vae too,
    though this plan never unloads it).
    """
    dag, costs = chains(1, suffix=False)
    one, two = images(dag, costs, card(12), 2)
    assert steps(one) == [Load("te", **FILE_PIN), Run("enc", "gpu"), Unload("te", "pinned"),
                          Load("dit", **FILE_PIN), Run("sample", "gpu"), Load("vae", **FILE_PIN), Run("decode", "gpu")]
    assert one.end == Residency(frozenset({"dit", "vae"}), frozenset({"te", "dit", "vae"}))
    assert steps(two) == [Unload("dit", "pinned"), Load("te", **PINNED), Run("enc", "gpu"), Unload("te", "pinned"),
                          Load("dit", **PINNED), Run("sample", "gpu"), Run("decode", "gpu")]
    assert one.variant_of("enc") == two.variant_of("enc") == "gpu"
    assert max(one.peak, two.peak) <= card(12).gpu
    assert two.steps[0].note == "makes room for enc (CLIPTextEncode)"


def test_12gib_1536_decode_unloads_transformer_and_reloads_it_at_the_sampler():
    """12 GiB card, 1536²: the decode (0.09 + 5.35 GiB) does not fit beside dit (7.22): dit goes to its
    pinned copy before the decode and comes back at the next image's sampler; the vae stays resident (it gets
    a pinned copy all the same: the three models and the decode's activation cannot be resident together).

        enc ──► sample ──► decode          (run twice)
    """
    dag, costs = chains(1, side=1536, suffix=False)
    one, two = images(dag, costs, card(12), 2)
    assert steps(one) == [Load("te", **FILE_PIN), Run("enc", "gpu"), Unload("te", "pinned"),
                          Load("dit", **FILE_PIN), Run("sample", "gpu"), Unload("dit", "pinned"),
                          Load("vae", **FILE_PIN), Run("decode", "gpu")]
    assert steps(two) == [Load("te", **PINNED), Run("enc", "gpu"), Unload("te", "pinned"), Load("dit", **PINNED),
                          Run("sample", "gpu"), Unload("dit", "pinned"), Run("decode", "gpu")]
    assert two.end == Residency(frozenset({"vae"}), frozenset({"te", "dit", "vae"}))
    assert [p.variant_of(n) for p in (one, two) for n in ("enc", "decode")] == ["gpu"] * 4


def test_16gib_unloads_the_cheaper_model_for_the_decode():
    """16 GiB card, 1024²: te + dit fit (13.59 GiB), adding the decode (15.49) does not: the encoder, cheaper
    to reload than the transformer, makes room; tiled decode (0.34 s) loses to a 0.11 s pinned reload.
    Only te is ever unloaded, but te + dit + vae + the decode's activation (15.49) exceed the budget (15.40), so
    all three get pinned copies.

        enc ──► sample ──► decode          (run twice)
    """
    dag, costs = chains(1, suffix=False)
    one, two = images(dag, costs, card(16), 2)
    assert steps(one) == [Load("te", **FILE_PIN), Run("enc", "gpu"), Load("dit", **FILE_PIN), Run("sample", "gpu"),
                          Unload("te", "pinned"), Load("vae", **FILE_PIN), Run("decode", "gpu")]
    assert steps(two) == [Load("te", **PINNED), Run("enc", "gpu"), Run("sample", "gpu"), Unload("te", "pinned"),
                          Run("decode", "gpu")]


def test_unused_resident_model_is_evicted_first():
    """A 3 GiB model left by an earlier workflow and never used here leaves before the transformer does. It is
    dropped (never used, it gets no pinned copy); te and vae, loaded here, get pinned copies since the three used
    models and the decode's activation exceed the budget (dit, already resident, is never read from the file).

        enc ──► sample ──► decode          start: dit and "old" resident, 16 GiB card
    """
    dag, costs = chains(1, suffix=False)
    models = {**MODELS, "old": ModelCost("old", gib(3.0), "old")}
    p = plan(dag, costs, models, card(16), start=Residency(frozenset({"old", "dit"})))
    assert steps(p)[:3] == [Unload("old", "drop"), Load("te", **FILE_PIN), Run("enc", "gpu")]
    assert steps(p)[3:] == [Run("sample", "gpu"), Unload("te", "pinned"), Load("vae", **FILE_PIN),
                            Run("decode", "gpu")]
    assert p.end == Residency(frozenset({"dit", "vae"}), frozenset({"te", "vae"}))


@pytest.mark.parametrize(("host", "cpu_s", "expected_variant"), [
    (64, 2.0, "gpu"),   # dit has a pinned copy: unload + 0.14 s reload beats a 2 s CPU decode
    (0, 2.0, "cpu"),    # no host RAM for a pinned copy: the reload reads 7.22 GiB from disk (3.9 s)
    (0, 134.0, "gpu"),  # ...but not against the real 134 s CPU decode
])
def test_cpu_variant_only_when_cheaper(host: float, cpu_s: float, expected_variant: str):
    """10 GiB card, 1024²: decode (2.47 GiB) does not fit beside dit (7.22); no text encoder in the graph.

        sample ──► decode          (repeat: sample runs again next)
    """
    dag = nx.DiGraph([("sample", "decode")])
    cpu = Variant("cpu", (), 0, cpu_s, f"decodes on the CPU: {cpu_s:g} s")
    gpu = Variant("gpu", ("vae",), gib(2.38), 0.086)
    costs = {"sample": sample("sample"), "decode": decode("decode", variants=(gpu, cpu))}
    p = plan(dag, costs, MODELS, card(10, host=host))
    pin = {"source": "file", "pin": host > 0}
    assert p.variant_of("decode") == expected_variant
    if expected_variant == "cpu":
        assert steps(p) == [Load("dit", "file"), Run("sample", "gpu"), Run("decode", "cpu")]
        note = p.steps[-1].note
        assert note.startswith("decodes on the CPU: 2 s; chosen at 2.000 s over gpu: ")
        assert float(re.search(r"gpu: ([\d.]+) s", note)[1]) > 3.8  # 0.086 + 3.876 (dit reload) + 0.048
    else:
        to = "pinned" if host > 0 else "drop"
        # the vae stays resident into the next run's sample (7.88 GiB fit) but is pinned where host RAM allows:
        # dit + vae + the decode's activation (9.69 GiB) exceed the budget (9.40)
        assert steps(p) == [Load("dit", **pin), Run("sample", "gpu"), Unload("dit", to), Load("vae", **pin),
                            Run("decode", "gpu")]
        assert p.steps[-1].note == ""


@pytest.mark.parametrize(("slower", "expected"), [(1.0005, "cpu"), (1.002, "gpu")])
def test_a_near_tie_goes_to_the_variant_that_copies_fewer_bytes(slower: float, expected: str):
    """The decode alone on a 10 GiB card: "gpu" loads the VAE from its file (it copies 0.09 GiB), "cpu" copies
    nothing. At 0.05 % more predicted time "cpu" counts as equally fast and wins, and its note says what it won
    over; at 0.2 % more the faster "gpu" wins."""
    gpu = Variant("gpu", ("vae",), gib(2.38), 0.086)
    t_gpu = CostModel().run_seconds(gpu) + CostModel().load_seconds(MODELS["vae"].nbytes, False)
    assert 1.0005 < 1 + TIE < 1.002
    cpu = Variant("cpu", (), 0, t_gpu * slower, "decodes on the CPU")
    p = plan(_one("decode"), {"decode": decode("decode", variants=(gpu, cpu))}, MODELS, card(10))
    assert p.variant_of("decode") == expected
    if expected == "cpu":
        assert p.loads == 0
        assert p.steps[-1].note.endswith("gpu is within 0.1% of it and would copy 0.09 GiB more")
    else:
        assert p.loads == 1 and p.steps[-1].note == ""


def _one(node: str) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_node(node)
    return dag


def test_tiled_decode_when_the_reload_is_slow():
    """Same as above with tiled decode (0.34 s): cheaper than a 3.9 s disk reload of dit.

        sample ──► decode          10 GiB card, no host RAM for pinned copies
    """
    dag = nx.DiGraph([("sample", "decode")])
    p = plan(dag, {"sample": sample("sample"), "decode": decode("decode")}, MODELS, card(10, host=0))
    assert steps(p) == [Load("dit", "file"), Run("sample", "gpu"), Load("vae", "file"), Run("decode", "tiled")]
    assert p.steps[-1].note.startswith("decodes in tiles; chosen at 0.392 s over gpu: 4.")
    assert "cpu: 134.000 s" in p.steps[-1].note


def test_infeasible_node_raises_plan_error():
    """A 2048² decode on a 10 GiB card: even tiled (9.6 GiB of activations) does not fit beside nothing.

        enc ──► sample ──► decode
    """
    dag, costs = chains(1, suffix=False)
    costs["decode"] = decode("decode", 2048, (Variant("gpu", ("vae",), gib(9.5), 0.4),
                                              Variant("tiled", ("vae",), gib(9.6), 1.6)))
    with pytest.raises(PlanError) as e:
        plan(dag, costs, MODELS, card(10))
    err = e.value
    assert isinstance(err, ValueError)
    assert (err.node, err.class_type, err.needed, err.budget) == ("decode", "VAEDecode", gib(0.09) + gib(9.5),
                                                                  card(10).gpu)
    assert str(err) == ("node 'decode' (VAEDecode) needs 9.59 GiB of GPU memory with its smallest variant 'gpu' "
                        "(weights 0.09 GiB + activation 9.50 GiB) but the budget is 9.40 GiB; it would fit with a "
                        "budget of at least 9.59 GiB, or with 'gpu' at an activation of at most 9.31 GiB "
                        "(a smaller image or batch)")
    d = err.to_dict()
    assert d["type"] == "vram_plan_infeasible" and d["message"] == str(err)
    assert d["details"] == ("gpu: 9.59 GiB (weights 0.09 + activation 9.50); "
                            "tiled: 9.69 GiB (weights 0.09 + activation 9.60)")
    assert d["extra_info"]["node_id"] == "decode" and d["extra_info"]["min_budget_gib"] == 9.59
    json.dumps(d)


def test_plan_leaves_the_garbage_collector_as_it_found_it():
    """plan() pauses Python's cyclic collector while it plans (graph/plan/planner.py) and turns it back on afterwards, a
    PlanError included; one that something else turned off stays off.

        enc ──► sample ──► decode
    """
    dag, costs = chains(1, suffix=False)
    bad = dict(costs, decode=decode("decode", 2048, (Variant("gpu", ("vae",), gib(9.5), 0.4),)))
    was = gc.isenabled()
    try:
        gc.enable()
        plan(dag, costs, MODELS, card(12))
        assert gc.isenabled()
        with pytest.raises(PlanError):
            plan(dag, bad, MODELS, card(10))
        assert gc.isenabled()
        gc.disable()
        plan(dag, costs, MODELS, card(12))
        assert not gc.isenabled()
        with pytest.raises(PlanError):
            plan(dag, bad, MODELS, card(10))
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_weights_alone_too_big():
    """The text encoder's weights (5.80 GiB) exceed a 4 GiB budget.

        enc
    """
    dag = nx.DiGraph()
    dag.add_node("enc")
    with pytest.raises(PlanError, match=r"^node 'enc' \(CLIPTextEncode\) needs 6\.00 GiB .* its weights alone "
                                        r"\(5\.80 GiB\) exceed the budget; it needs a budget of at least 6\.00 GiB$"):
        plan(dag, {"enc": encode("enc", cpu=False)}, MODELS, Budget(gib(4), gib(64)))


def test_queue_of_three_groups_by_model():
    """Three prompts sharing one te/dit/vae on a 12 GiB card: encode all, then sample and decode each in turn (the
    decode fits beside the transformer, so decoding each image as soon as it is sampled moves no extra byte: the VAE
    is loaded once, after the first sample). The three models cannot be resident together with the decode's
    activation, so all three get pinned copies.

        enc0 ──► sample0 ──► decode0
        enc1 ──► sample1 ──► decode1
        enc2 ──► sample2 ──► decode2
    """
    dag, costs = chains(3)
    p = plan(dag, costs, MODELS, card(12))
    assert steps(p) == [Load("te", **FILE_PIN), Run("enc0", "gpu"), Run("enc1", "gpu"), Run("enc2", "gpu"),
                        Unload("te", "pinned"), Load("dit", **FILE_PIN), Run("sample0", "gpu"),
                        Load("vae", **FILE_PIN), Run("decode0", "gpu"), Run("sample1", "gpu"), Run("decode1", "gpu"),
                        Run("sample2", "gpu"), Run("decode2", "gpu")]
    assert [s.step.model for s in p.steps if isinstance(s.step, Load)] == ["te", "dit", "vae"]


def test_queue_of_eight_decodes_each_image_once_it_is_sampled_where_that_moves_nothing_more():
    """Eight 1024² prompts on a 12 GiB card: the decode (0.09 + 2.38 GiB) fits beside the transformer (7.22 GiB), so
    each image is decoded right after its sample, with the same three loads as sampling all first; the first image
    comes after one sample. At 1536² (5.35 GiB) it does not fit beside the transformer: decoding early would evict it
    before the next sample, so the decodes wait until every image is sampled, as before.

        enc0 ──► sample0 ──► decode0
        ...
        enc7 ──► sample7 ──► decode7
    """
    dag, costs = chains(8)
    p = plan(dag, costs, MODELS, card(12))
    assert p.order == (*(f"enc{i}" for i in range(8)), *(x for i in range(8) for x in (f"sample{i}", f"decode{i}")))
    assert [s.step.model for s in p.steps if isinstance(s.step, Load)] == ["te", "dit", "vae"]
    assert not [s for s in p.steps if isinstance(s.step, Unload) and s.step.model != "te"]
    dag, costs = chains(8, side=1536)
    p = plan(dag, costs, MODELS, card(12))
    assert p.order == tuple(f"{x}{i}" for x in ("enc", "sample", "decode") for i in range(8))
    assert [s.step.model for s in p.steps if isinstance(s.step, Load)] == ["te", "dit", "vae"]


def streamed_chains(n: int, slack: float) -> tuple[nx.DiGraph, dict[str, NodeCost], Budget, Blocks]:
    """n chains enc_i -> sample_i -> decode_i (512²) whose sampler streams the transformer (it does not fit whole: 7.22
    + 0.22 GiB): 25 blocks of 0.28 GiB, slower to copy than to compute. The budget is what the sampler takes with 19
    of them resident (its fastest choice in any room this size: 6.32 GiB), plus `slack`."""
    blocks = Blocks("dit", (gib(0.28),) * 25, (0.0016,) * 25, fixed=gib(0.22), activation=gib(0.22), passes=4)
    stream = Variant("stream", (), blocks.min_gpu(), 4 * 0.039, streams=("dit",), blocks=blocks)
    dag, costs = nx.DiGraph(), {}
    for i in range(n):
        costs[f"enc{i}"] = encode(f"enc{i}", cpu=False)
        costs[f"sample{i}"] = NodeCost(f"sample{i}", "KSampler", (Variant("gpu", ("dit",), gib(0.22), 4 * 0.039),
                                                                  stream), host_bytes=1 * MiB)
        costs[f"decode{i}"] = decode(f"decode{i}", variants=(Variant("gpu", ("vae",), gib(0.6), 0.022),))
        nx.add_path(dag, [f"enc{i}", f"sample{i}", f"decode{i}"])
    return dag, costs, Budget(blocks.gpu_bytes(tuple(range(6))) + gib(slack), gib(64)), blocks


@pytest.mark.parametrize(("slack", "early"), [(0.05, False), (0.2, True), (0.7, True)])
def test_queue_that_streams_moves_what_the_grouped_order_moves(slack: float, early: bool):
    """Four prompts whose sampler streams the transformer: the queue moves what the grouped order moves (the text
    encoder and the VAE loaded once, the first sampler's 19 resident blocks uploaded once and kept on the GPU for the
    samplers after it, the other 6 streamed per step), and decodes each image right after its sample where the VAE
    costs the next sampler no block.
    0.05 GiB spare: the VAE (0.09 GiB) would cost a block, and decoding early would unload and reload it once per image
    (as the planner did before): the decodes wait until every image is sampled. 0.2 GiB: it sits beside the blocks,
    each image is decoded once sampled. 0.7 GiB: the sampler's least need fits beside the text encoder, which the
    order pass took for room to sample each image once encoded (the text encoder was loaded once per image): the
    encodes still come first.

        enc_i ──► sample_i (streams dit) ──► decode_i        i = 0..3
    """
    from vramgraph.graph.plan import residency

    dag, costs, budget, blocks = streamed_chains(4, slack)
    p = plan(dag, costs, MODELS, budget, repeat=False)
    assert [s.step.model for s in p.steps if isinstance(s.step, Load)] == ["te", "vae"]
    assert {p.variant_of(f"sample{i}") for i in range(4)} == {"stream"}
    bp = residency.choose(blocks, budget.gpu, p.cost.h2d_pinned)
    assert len(bp.resident) == 19
    assert p.bytes_moved == MODELS["te"].nbytes + MODELS["vae"].nbytes
    assert p.streamed_bytes == bp.resident_bytes + 4 * bp.total_streamed
    runs = [s for s in p.steps if s.blocks is not None]
    assert [s.blocks.reused for s in runs] == [0] + [bp.resident_bytes] * 3
    assert [s.blocks.resident for s in runs] == [bp.resident] * 4
    then = [x for i in range(4) for x in (f"sample{i}", f"decode{i}")] if early else \
        [f"{x}{i}" for x in ("sample", "decode") for i in range(4)]
    assert p.order == (*(f"enc{i}" for i in range(4)), *then)


def test_finish_early_moves_only_nodes_whose_descendants_need_no_other_model():
    """The pass alone, on a hand-made order (plan/early.py): a decode joins the resident transformer only when every
    node left that uses those models still fits; a sampler (its decode needs the VAE) never moves; a save (no model,
    nothing after it) follows its decode.

        enc0 ──► sample0 ──► decode0 ──► save0
        enc1 ──► sample1 ──► decode1 ──► save1
    """
    from vramgraph.graph.plan.early import FinishEarly

    dag, costs = chains(2)
    for i in range(2):
        dag.add_edge(f"decode{i}", f"save{i}")
        costs[f"save{i}"] = NodeCost(f"save{i}", "SaveImage", (Variant("host", (), 0, 0.0),))
    names = list(dag)  # the pass sees nodes by number (graph/plan/order.py `Shape`)
    number = {n: i for i, n in enumerate(names)}
    prov = [costs[n].variants[0] for n in names]
    grouped = ["enc0", "enc1", "sample0", "sample1", "decode0", "save0", "decode1", "save1"]
    w = {k: m.nbytes for k, m in MODELS.items()}
    succs = [[number[s] for s in dag.successors(n)] for n in names]

    def finish_early(order: list[str], gpu: int) -> list[str]:
        o = [number[n] for n in order]
        return [names[i] for i in FinishEarly(succs, o, prov, w, gpu)(o)]

    assert finish_early(grouped, card(12).gpu) == [
        "enc0", "enc1", "sample0", "decode0", "save0", "sample1", "decode1", "save1"]
    tight = gib(9.5)  # the decode (0.09 + 2.38 GiB) does not fit beside the transformer (7.22 GiB)
    assert finish_early(grouped, tight) == grouped
    assert finish_early(grouped, gib(100)) == [
        "enc0", "enc1", "sample0", "decode0", "save0", "sample1", "decode1", "save1"]


def test_queue_host_ram_limits_grouping():
    """Host RAM for two 8 MiB embeddings but not three: the third prompt waits until a chain has finished.

        enc0 ──► sample0 ──► decode0        host 20 MiB: no pinned copies fit either,
        enc1 ──► sample1 ──► decode1        so unloads drop and reloads read the file
        enc2 ──► sample2 ──► decode2
    """
    dag, costs = chains(3)
    p = plan(dag, costs, MODELS, Budget(card(12).gpu, 20 * MiB))
    assert p.order == ("enc0", "enc1", "sample0", "decode0", "sample1", "decode1", "enc2", "sample2", "decode2")
    assert steps(p) == [Load("te", "file"), Run("enc0", "gpu"), Run("enc1", "gpu"), Unload("te", "drop"),
                        Load("dit", "file"), Run("sample0", "gpu"), Load("vae", "file"), Run("decode0", "gpu"),
                        Run("sample1", "gpu"), Run("decode1", "gpu"), Unload("dit", "drop"), Load("te", "file"),
                        Run("enc2", "gpu"), Unload("te", "drop"), Load("dit", "file"), Run("sample2", "gpu"),
                        Run("decode2", "gpu")]


def test_cpu_nodes_need_no_loads():
    """CPU-only nodes (no models) run where the order puts them and never move weights. Everything fits on
    24 GiB: nothing is unloaded, nothing pinned.

        prompt ──► enc ──► sample ──► decode ──► save
    """
    dag = nx.DiGraph([("prompt", "enc"), ("enc", "sample"), ("sample", "decode"), ("decode", "save")])
    cpu = (Variant("cpu", (), 0, 0.001),)
    costs = {"prompt": NodeCost("prompt", "PrimitiveString", cpu, 1024), "enc": encode("enc"),
             "sample": sample("sample"), "decode": decode("decode"), "save": NodeCost("save", "SaveImage", cpu)}
    p = plan(dag, costs, MODELS, card(24))
    assert steps(p) == [Run("prompt", "cpu"), Load("te", "file"), Run("enc", "gpu"), Load("dit", "file"),
                        Run("sample", "gpu"), Load("vae", "file"), Run("decode", "gpu"), Run("save", "cpu")]


def test_no_host_room_for_pinned_copies():
    """1 GiB of host RAM: no room for a pinned copy of te or dit, the models unloaded: they are dropped and reread
    from the file. The vae (0.09 GiB) is a candidate too (the three models and the decode's activation exceed
    the budget) and fits in the host RAM: it alone gets a pinned copy.

        enc ──► sample ──► decode          12 GiB card, run twice
    """
    dag, costs = chains(1, suffix=False)
    one, two = images(dag, costs, card(12, host=1), 2)
    assert steps(one) == [Load("te", "file"), Run("enc", "gpu"), Unload("te", "drop"), Load("dit", "file"),
                          Run("sample", "gpu"), Load("vae", **FILE_PIN), Run("decode", "gpu")]
    assert steps(two) == [Unload("dit", "drop"), Load("te", "file"), Run("enc", "gpu"), Unload("te", "drop"),
                          Load("dit", "file"), Run("sample", "gpu"), Run("decode", "gpu")]
    assert two.end.pinned == frozenset({"vae"})
    assert two.steps[1].seconds == pytest.approx(gib(5.80) / 2.0e9)


def test_host_room_for_one_big_copy_pins_the_largest():
    """7.5 GiB of host RAM holds the transformer's pinned copy (7.22) or the encoder's (5.80), not both:
    the transformer, the larger (more reload time saved), gets it; the vae, a candidate since the three models
    and the decode's activation exceed the budget, fits in what is left and gets one too.

        enc ──► sample ──► decode          12 GiB card, run twice
    """
    dag, costs = chains(1, suffix=False)
    one, two = images(dag, costs, card(12, host=7.5), 2)
    assert steps(one)[:4] == [Load("te", "file"), Run("enc", "gpu"), Unload("te", "drop"), Load("dit", **FILE_PIN)]
    assert steps(two)[:5] == [Unload("dit", "pinned"), Load("te", "file"), Run("enc", "gpu"), Unload("te", "drop"),
                              Load("dit", **PINNED)]
    assert one.end.pinned == frozenset({"dit", "vae"})


def test_pinned_copies_for_unloaded_models_or_when_the_used_models_do_not_fit_together():
    """The pinning rule: a model gets a pinned copy if the plan unloads it (in this run or, with repeat, in the
    next one), or, when the models the run uses cannot all be resident together with the largest activation,
    every used model does (another prompt may push any of them out). When everything fits, nothing is pinned.

        enc ──► sample ──► decode          80 GiB: all fit; 12 GiB: te + dit + vae + 2.38 > 11.40;
                                           18 GiB with a 3 GiB leftover "old": the used models fit (15.49)
    """
    dag, costs = chains(1, suffix=False)

    def pinned(p: Plan) -> set[str]:
        return {s.model for s in steps(p) if isinstance(s, Load) and s.pin}

    def unloaded(p: Plan) -> set[str]:
        return {s.model for s in steps(p) if isinstance(s, Unload)}

    fits = plan(dag, costs, MODELS, Budget(gib(80), gib(64)))
    assert unloaded(fits) == set()
    assert pinned(fits) == set() and fits.end.pinned == frozenset()

    swap = plan(dag, costs, MODELS, card(12))  # only te is unloaded, but all three used models are pinned
    assert unloaded(swap) == {"te"}
    assert pinned(swap) == {"te", "dit", "vae"} and swap.end.pinned == frozenset({"te", "dit", "vae"})
    once = plan(dag, costs, MODELS, card(12), repeat=False)  # no next run: the same, the models still do not fit
    assert unloaded(once) == {"te"}
    assert pinned(once) == {"te", "dit", "vae"} and once.end.pinned == frozenset({"te", "dit", "vae"})

    # the used models fit together, but a leftover model makes room scarce: only the unloaded model is pinned
    models = {**MODELS, "old": ModelCost("old", gib(3.0), "old")}
    left = Residency(frozenset({"old"}))
    last = plan(dag, costs, models, card(18), start=left, repeat=False)  # dit, not needed again, leaves
    assert steps(last)[3:] == [Run("sample", "gpu"), Unload("dit", "pinned"), Load("vae", "file"),
                               Run("decode", "gpu")]
    assert pinned(last) == {"dit"} and last.end.pinned == frozenset({"dit"})
    again = plan(dag, costs, models, card(18), start=left)  # "old" leaves instead: never used, never pinned
    assert unloaded(again) == {"old"} and Unload("old", "drop") in steps(again)
    assert pinned(again) == set() and again.end.pinned == frozenset()


# ------------------------------------------------------------------------------------- oracle (whole-model DP)


def best_bytes(seq: list[tuple[str, int]], budget: int) -> int | None:
    """Fewest bytes loaded over a sequence of (model, activation) runs, from a cold GPU: an exact dynamic
    programme over which whole models are resident (as /work/shared/tools/plan_bound.py, in integer bytes)."""
    keys = list(MODELS)
    states = [frozenset(k for i, k in enumerate(keys) if mask >> i & 1) for mask in range(1 << len(keys))]
    cost: dict[frozenset[str], int] = {frozenset(): 0}
    for need, act in seq:
        nxt = {}
        for st in states:
            if need in st and sum(MODELS[k].nbytes for k in st) + act <= budget:
                nxt[st] = min(c + sum(MODELS[k].nbytes for k in st - p) for p, c in cost.items())
        if not nxt:
            return None
        cost = nxt
    return min(cost.values())


ORACLE_CASES = [(side, c, n) for side in (1024, 2048) for c in (12, 16, 24) for n in (1, 2)] + [(1024, 12, 8)]


@pytest.mark.parametrize(("side", "card_gib", "n"), ORACLE_CASES)
def test_oracle_one_by_one(side: int, card_gib: int, n: int):
    """n images one after the other (each plan starts from the previous end; the last one plans with
    repeat=False, as the DP sees no image after it) move no more bytes than the whole-model optimum.

        enc ──► sample ──► decode          (x n, one run each)
    """
    dag, costs = chains(1, side, cpu=False, suffix=False)
    gpu_only = {k: NodeCost(c.node, c.class_type, c.variants[:1], c.host_bytes) for k, c in costs.items()}
    plans = images(dag, gpu_only, card(card_gib), n, last_repeat=False)
    seq = [(m, gib(ACT[side][m])) for _ in range(n) for m in ("te", "dit", "vae")]
    optimum = best_bytes(seq, card(card_gib).gpu)
    assert optimum is not None
    assert sum(p.bytes_moved for p in plans) <= optimum
    if (side, card_gib, n) == (1024, 12, 8):  # DESIGN.md's table: 104 GiB
        assert round(optimum / GiB) == 104


def test_oracle_queue_of_eight():
    """Eight prompts planned as one queue on a 12 GiB card: one load of each model (13.11 GiB).

        enc0 ──► sample0 ──► decode0
        ...
        enc7 ──► sample7 ──► decode7
    """
    dag, costs = chains(8)
    p = plan(dag, costs, MODELS, card(12), repeat=False)
    seq = [(m, gib(ACT[1024][m])) for m in ("te", "dit", "vae") for _ in range(8)]
    assert p.bytes_moved == best_bytes(seq, card(12).gpu) == sum(m.nbytes for m in MODELS.values())


def test_oracle_matches_plan_bound_tool():
    """The in-test DP agrees with the shared tool's whole-model DP (tests/plan_bound.py, a copy of the tool)."""
    import plan_bound as tool
    for side, card_gib, n in ORACLE_CASES:
        seq = tool.nodes_for(side, n, False)
        ours = best_bytes([(m, gib(ACT[side][m])) for m in seq], card(card_gib).gpu)
        theirs = tool.best(seq, side, card_gib - tool.CONTEXT, 1)
        assert ours / GiB == pytest.approx(theirs, abs=1e-6), (side, card_gib, n)


# ------------------------------------------------------------------------------------------- outputs


def test_outputs_json_table_graph_timeline():
    """The 1536² plan of the second image renders as JSON, a table, a graph and a timeline.

        enc ──► sample ──► decode          12 GiB card, second image
    """
    dag, costs = chains(1, side=1536, suffix=False)
    _, p = images(dag, costs, card(12), 2)
    doc = p.to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["steps"][0] == {"kind": "load", "model": "te", "source": "pinned", "pin": False,
                               "gpu_bytes": gib(5.80) + gib(0.09), "resident": ["vae", "te"],
                               "seconds": gib(5.80) / 55.3e9, "note": "for enc"}
    assert doc["order"] == ["enc", "sample", "decode"] and doc["loads"] == 2 and doc["peak"] == p.peak

    table = p.table()
    for word in ("Load", "Unload", "Run", "text encoder", "transformer", "enc (CLIPTextEncode)", "to pinned"):
        assert word in table
    assert len(table.splitlines()) == len(p.steps) + 3

    g = p.graph()
    assert set(g.nodes) == {"load:te@0", "enc", "unload:te@2", "load:dit@3", "sample", "unload:dit@5", "decode"}
    assert list(nx.topological_sort(g)) == ["load:te@0", "enc", "unload:te@2", "load:dit@3", "sample",
                                            "unload:dit@5", "decode"]
    assert g.edges["sample", "unload:dit@5"]["kind"] == "memory" and g.nodes["unload:dit@5"]["kind"] == "unload"
    assert g.has_edge("unload:te@2", "load:dit@3") and g.has_edge("load:dit@3", "sample")

    data = timeline_data(p)
    assert [s["kind"] for s in data["steps"]] == ["load", "run", "unload", "load", "run", "unload", "run"]
    assert data["steps"][4]["models"] == {"vae": gib(0.09), "dit": gib(7.22)}
    assert data["steps"][4]["activation"] == gib(1.2) and data["budget"] == card(12).gpu
    svg = timeline_svg(p, "1536² on a 12 GiB card")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count('class="band"') == 3 and 'class="budget"' in svg
    assert svg.count('class="mark load"') == 2 and svg.count('class="mark unload"') == 2
    assert "budget 11.40 GiB" in svg and "1536² on a 12 GiB card" in svg
    root = ElementTree.fromstring(svg)  # well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_graph_edges_without_memory_steps():
    """Everything fits on the second run: the graph is the chain of runs joined by order edges.

        enc ──► sample ──► decode
    """
    dag, costs = chains(1, suffix=False)
    first = plan(dag, costs, MODELS, card(80))
    g = plan(dag, costs, MODELS, card(80), start=first.end).graph()
    assert list(g.edges(data="kind")) == [("enc", "sample", "order"), ("sample", "decode", "order")]


def test_bad_inputs():
    """A node without a NodeCost, an unknown model and a cycle are ValueErrors that name the culprit; a cycle is named
    first.

        a ──► b ──► a
    """
    dag = nx.DiGraph([("enc", "sample")])
    with pytest.raises(ValueError, match="node 'sample' has no NodeCost"):
        plan(dag, {"enc": encode("enc")}, MODELS, card(12))
    with pytest.raises(ValueError, match="needs model 'te'"):
        plan(dag, {"enc": encode("enc"), "sample": sample("sample")}, {"dit": MODELS["dit"]}, card(12))
    with pytest.raises(ValueError, match="cycle"):
        plan(nx.DiGraph([("a", "b"), ("b", "a")]), {}, MODELS, card(12))
    ring = nx.DiGraph([("enc", "sample"), ("sample", "enc")])  # every node estimated: pass 1 finds the cycle
    with pytest.raises(ValueError, match=r"cycle through \['enc', 'sample'\]"):
        plan(ring, {"enc": encode("enc"), "sample": sample("sample")}, MODELS, card(12))
    with pytest.raises(ValueError, match="cycle"):  # named before a node that fits no budget
        plan(ring, {"enc": encode("enc"), "sample": sample("sample")}, MODELS, card(1))
