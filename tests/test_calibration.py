"""The activation estimates have provenance: the constants in nodes/estimates.py are the least-squares fit of the
measured peaks in bench/results/calibrate.json (written by bench/calibrate.py on the H200), rounded to 4
significant digits, and the estimates' own formulas predict every measured point within 1 %; with the planner's
MARGIN no estimate is below a measurement. Rerunning bench/calibrate.py and committing its report makes this test
say which constants to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vramgraph.models.vae_config import VAEConfig
from vramgraph.nodes import calibration, estimates
from vramgraph.nodes.types import LatentInfo, ModelInfo

DATA = Path(__file__).resolve().parents[1] / "bench" / "results" / "calibrate.json"
WITHIN = 0.01  # each point's prediction / measurement - 1, both ways


@pytest.fixture(scope="module")
def points() -> dict:
    return json.loads(DATA.read_text())["calibration"]


def test_the_constants_in_use_are_the_fit_of_the_calibration_data(points: dict) -> None:
    assert all(points[k] for k in calibration.KINDS)  # every node kind has measurements
    fitted = calibration.fit(points)
    assert set(fitted) == set(calibration.CONSTANTS)
    rounded = {k: float(f"{v:.4g}") for k, v in fitted.items()}
    assert rounded == calibration.in_use(), {k: (v, calibration.in_use()[k]) for k, v in rounded.items()}


def test_every_calibration_point_is_predicted_within_one_percent_and_never_above_its_estimate(points: dict) -> None:
    errs = calibration.errors(points)
    assert len(errs) == sum(len(points[k]) for k in calibration.KINDS) >= 20
    worst = max(errs, key=lambda e: abs(e[2]))
    assert abs(worst[2]) <= WITHIN, worst
    for kind, p, _ in errs:
        assert calibration.predict(kind, p) * estimates.MARGIN >= p["bytes"], (kind, p)


def test_the_fit_is_the_formula_the_planner_uses(points: dict) -> None:
    """A decode point predicted by the fit's formula is what vae_decode estimates for that latent (before MARGIN),
    and the formula scales with the compute dtype's item size (fp32 twice bf16; fp8-stored weights as bf16)."""
    p = next(p for p in points["decode"] if p["side"] == 1024)
    side = p["side"] // 16
    for dtype, item in (("bf16", 2), ("fp32", 4), ("f8_e4m3", 2)):
        vae = ModelInfo("vae:x", "vae", "vae", 0, VAEConfig(), dtype=dtype)
        gpu = estimates.vae_decode(vae, LatentInfo(1, side, side))[0]
        expected = calibration.predict("decode", {**p, "dtype": dtype if dtype != "f8_e4m3" else "bf16"})
        assert gpu.activation == pytest.approx(expected * estimates.MARGIN, rel=1e-9, abs=1)
        assert expected == pytest.approx(calibration.predict("decode", p) * item / 2, rel=0.01)
