"""Every measured constant is the number in the results file it cites (DESIGN.md, style 11; docs/cards.md lists them):
the cost probe's H200 matmul rate, the block-time and copy constants of streaming, the H200 anchors of the node
times. A rerun of a bench that changes its file makes these tests name the constant to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vramgraph.graph.engine import costs
from vramgraph.graph.plan import residency
from vramgraph.nodes import estimates

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ANCHORS = RESULTS / "anchors-h200.json"  # ../shared/reference/anchors-h200.json, copied in


def _g4(x: float) -> float:
    return float(f"{x:.4g}")


def test_the_h200_matmul_rate_is_the_cost_probes() -> None:
    probe = json.loads((RESULTS / "cost_probe.json").read_text())
    assert probe["gpu"] == "NVIDIA H200"
    assert costs.H200_MATMUL_FLOPS == _g4(probe["matmul_flops"])
    # the probe on the H200 now gives compute 1.0: the estimates' seconds are the H200's
    assert costs.H200_MATMUL_FLOPS / probe["matmul_flops"] == pytest.approx(1.0, abs=1e-3)


@pytest.fixture(scope="module")
def streaming() -> dict:
    data = json.loads((RESULTS / "streaming-02d12f9.json").read_text())
    assert data["env"]["gpu"] == "NVIDIA H200"
    return data["constants"]


def test_the_block_times_are_the_exact_fit_of_the_two_measured_sizes(streaming: dict) -> None:
    """t(n) = a·n + b·n² through the one-block times at 1024² and 2048², per block kind."""
    times = streaming["block_times"]
    n1, n2 = times["1024"]["tokens"], times["2048"]["tokens"]
    for kind, (a, b) in {"double": (estimates.DIT_DOUBLE_SECONDS_PER_TOKEN, estimates.DIT_DOUBLE_SECONDS_PER_TOKEN2),
                         "single": (estimates.DIT_SINGLE_SECONDS_PER_TOKEN,
                                    estimates.DIT_SINGLE_SECONDS_PER_TOKEN2)}.items():
        t1, t2 = times["1024"][f"{kind}_s"], times["2048"][f"{kind}_s"]
        quad = (t2 / n2 - t1 / n1) / (n2 - n1)
        assert (a, b) == (_g4(t1 / n1 - quad * n1), _g4(quad)), kind


def test_the_copy_efficiency_is_a_block_copy_beside_a_block_compute(streaming: dict) -> None:
    """One single block's bytes over the time of its copy beside a single block's compute, against one 2 GiB pinned
    copy."""
    beside = streaming["block_times"]["1024"]["single_with_block_copy_s"]
    share = streaming["block_bytes"] / beside / (streaming["pinned_h2d_GBps"] * 1e9)
    assert residency.STREAM_COPY_EFFICIENCY == round(share, 3)


def test_the_later_streaming_report_holds_no_constants() -> None:
    """bench/results/streaming.json (commit d0908ed) failed to measure them: the constants cite the run that did."""
    assert "error" in json.loads((RESULTS / "streaming.json").read_text())["constants"]


def test_the_node_times_are_the_h200_anchors() -> None:
    a = json.loads(ANCHORS.read_text())["values"]
    assert estimates.DIT_SECONDS_PER_TOKEN_STEP * 4608 == pytest.approx(a["transformer_step_1024"]["median_s"],
                                                                        abs=5e-4)
    assert estimates.TE_SECONDS_PER_PROMPT == pytest.approx(a["qwen3_encode_512"]["median_s"], abs=5e-4)
    assert estimates.VAE_DECODE_SECONDS_PER_MPIXEL * 1024**2 / 1e6 == pytest.approx(
        a["vae_decode_bfloat16_1024"]["median_s"], abs=5e-4)
