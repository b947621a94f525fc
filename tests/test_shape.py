"""Nodes that need nothing (plan/order.py `Shape`): one variant without models, streams or GPU bytes, whose outputs
hold no host RAM (a loader, a save, ComfyUI's guider and zeroed conditioning). The passes order only the other nodes;
each of these runs as soon as its inputs are ready, and an output read through them lives until the nodes after them
that read it have run. Every test draws its DAG and asserts the exact order of the plan's runs.

Sizes as in tests/test_planner.py (klein-4B: text encoder 5.80 GiB, transformer 7.22, VAE 0.09)."""

from __future__ import annotations

import networkx as nx
from test_planner import MODELS, card, decode, encode, gib, sample
from vramgraph.graph.plan.planner import GiB, NodeCost, Run, plan
from vramgraph.nodes.types import Variant

FREE = Variant("host", (), 0, 0.0)


def comfy_queue(n: int, conditioning: int) -> tuple[nx.DiGraph, dict[str, NodeCost]]:
    """n prompts of ComfyUI's own nodes, one loader shared, each prompt inserted after the last:

        loader ──► enc_i ──► zero_i ──► guider_i ──► sample_i ──► decode_i ──► save_i
                      └─────────────────────┘
    """
    dag, costs = nx.DiGraph(), {"loader": NodeCost("loader", "CLIPLoader", (FREE,))}
    dag.add_node("loader")
    for i in range(n):
        e, z, g, s, d, v = (f"{x}{i}" for x in ("enc", "zero", "guider", "sample", "decode", "save"))
        nx.add_path(dag, ["loader", e, z, g, s, d, v])
        dag.add_edge(e, g)
        costs[e] = NodeCost(e, "CLIPTextEncode", encode(e).variants, host_bytes=conditioning)
        costs[z] = NodeCost(z, "ConditioningZeroOut", (FREE,))
        costs[g] = NodeCost(g, "CFGGuider", (FREE,))
        costs[s], costs[d] = sample(s), decode(d)
        costs[v] = NodeCost(v, "SaveImage", (FREE,))
    return dag, costs


def runs(p) -> list[str]:
    return [s.step.node for s in p.steps if isinstance(s.step, Run)]


def test_nodes_that_need_nothing_run_as_soon_as_their_inputs_are_ready():
    """Everything fits (80 GiB): the encodes go first (the text encoder stays), each zeroed conditioning and guider
    right after its encode, each save right after its decode (which pass 3 runs as soon as the VAE can join)."""
    dag, costs = comfy_queue(2, 8 * 2**20)
    p = plan(dag, costs, MODELS, card(80))
    assert runs(p) == ["loader", "enc0", "zero0", "guider0", "enc1", "zero1", "guider1",
                       "sample0", "decode0", "save0", "sample1", "decode1", "save1"]
    gpu = {s.step.node: s.gpu_bytes for s in p.steps if isinstance(s.step, Run)}
    assert gpu["loader"] == 0 and gpu["guider1"] == gib(5.80)  # they run on the GPU as they find it
    assert gpu["save0"] == gib(5.80) + gib(7.22) + gib(0.09)


def test_a_conditioning_read_through_a_guider_lives_until_its_sampler():
    """Each conditioning holds 1 GiB of host RAM and 1.5 GiB are free for outputs: the guider reads it and passes it
    on, so it lives until the sampler has run, and the second encode waits for the first image's sampler. (Counted
    as freed when the guider ran, both would be held at once: 2 GiB.) With room for both, both encodes go first."""
    dag, costs = comfy_queue(2, GiB)
    p = plan(dag, costs, MODELS, card(80, host=1.5))
    assert runs(p) == ["loader", "enc0", "zero0", "guider0", "sample0", "decode0", "save0",
                       "enc1", "zero1", "guider1", "sample1", "decode1", "save1"]
    wide = plan(dag, costs, MODELS, card(80, host=2.5))
    assert runs(wide)[:7] == ["loader", "enc0", "zero0", "guider0", "enc1", "zero1", "guider1"]
