"""bench/oom_matrix.py's bookkeeping on made-up cells: what counts as an OOM and as an error, and the summary's counts
of nodes over +3 % and outside ±10 % of their estimates and of the device's peak over the card (the GPU run is
`bench/oom_matrix.py`; its CPU mode, `--cpu`, runs the same code with tiny models and measures nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def oom_matrix():
    sys.path.insert(0, str(BENCH))
    try:
        import oom_matrix
    finally:
        sys.path.remove(str(BENCH))
    return oom_matrix


def test_failures_are_told_apart(oom_matrix) -> None:
    import torch
    from vramgraph.graph.plan import planner
    from vramgraph.graph.workflow.errors import NodeExecutionError

    oom = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
           NodeExecutionError("6", "VGSampler", "CUDA out of memory", "torch.OutOfMemoryError"),
           NodeExecutionError("7", "VGVAEDecode", "cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "RuntimeError"),
           planner.PlanError("6", "VGSampler", 9, 8, "no plan of the rest fits", "")]  # raised by a run's re-plan
    for e in oom:
        assert oom_matrix.failure(e)[0] == "oom", e
    for e in (NodeExecutionError("7", "VGVAEDecode", "shapes do not match", "RuntimeError"), ValueError("bad")):
        assert oom_matrix.failure(e)[0] == "error", e
    assert oom_matrix.failure(ValueError("bad"))[1] == "ValueError: bad"


def _node(node: str, ratio: float | None, estimate: float = 1.0, measured: float | None = None) -> dict:
    measured = estimate * ratio if measured is None else measured
    return {"node": node, "class_type": "VGSampler", "variant": "gpu", "estimate_gib": estimate,
            "measured_gib": measured, "measured_over_estimate": ratio}


def _cell(side: int, status: str = "ok", over_card: float | None = None, nodes: list | None = None, **kw) -> dict:
    return {"workflow": "text_to_image", "card": 8, "unit": "GiB", "side": side, "status": status,
            "nodes": nodes or [], "device_peak_minus_card_gib": over_card, **kw}


def test_summary_counts_nodes_off_their_estimates_and_devices_over_the_card(oom_matrix) -> None:
    cells = [
        _cell(512, over_card=-0.3, nodes=[_node("4", 1.0), _node("6", 1.05), _node("7", 0.85)]),
        _cell(1024, over_card=0.1, nvml_used_peak_gib=8.6,
              nodes=[_node("6", 1.12), _node("9", None, estimate=0.0, measured=0.2)]),  # measured, no estimate
        _cell(1536, status="rejected", rejected={"kind": "streaming_floor", "message": "streaming needs at least"}),
        _cell(2048, status="oom", error="OutOfMemoryError: CUDA out of memory"),
    ]
    s = oom_matrix.summarize(cells)
    assert (s["cells"], s["ok"], s["rejected"], s["oom"], s["error"]) == (4, 2, 1, 1, 0)
    assert s["nodes_measured"] == 4 and s["measured_over_estimate"] == {"min": 0.85, "max": 1.12}
    assert s["nodes_over_3pct"] == 3  # 1.05, 1.12 and the node with no estimate
    assert s["nodes_outside_10pct"] == 3  # 0.85, 1.12 and the node with no estimate
    assert s["device_peak_minus_card_gib_max"]["8 GiB"]["device"] == 0.1
    assert s["device_peak_minus_card_gib_max"]["8 GiB"]["nvml"] == pytest.approx(0.6)
    assert s["over_card_cells"] == ["text_to_image 8 GiB 1024²"]
    assert s["rejected_cells"][0].startswith("text_to_image 8 GiB 1536²: streaming_floor")
    assert s["measured_over_estimate_by_kind"]["VGSampler/gpu"] == {"n": 4, "min": 0.85, "max": 1.12}
