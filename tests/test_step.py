"""The sampling step's levers (models/step.py) and their fallbacks on the CPU, the FLOP count, fp8 per-row scales."""

from __future__ import annotations

import dataclasses
import doctest
import logging

import pytest
import torch
from vramgraph.models import flux2, flux2_config, fp8, step
from vramgraph.models.sampling import sample
from vramgraph.models.tiny import TINY_TRANSFORMER

CFG = dataclasses.replace(TINY_TRANSFORMER, depth_double=2, depth_single=2)


def _model(cfg: flux2.Flux2Config = CFG) -> flux2.Flux2Transformer:
    torch.manual_seed(0)
    return flux2.Flux2Transformer(cfg).eval().requires_grad_(False)


SMALL = dataclasses.replace(CFG, hidden=64, heads=2, head_dim=32, rope_axes=(8, 8, 8, 8), depth_double=1,
                            depth_single=1)  # what a compile test traces: one block of each kind


def _inputs(batch: int = 2, h: int = 4, w: int = 4, t: int = 8, cfg: flux2.Flux2Config = CFG) -> tuple:
    g = torch.Generator().manual_seed(1)
    img = torch.randn(batch, h * w, cfg.in_channels, generator=g)
    txt = torch.randn(batch, t, cfg.context_dim, generator=g)
    rope = flux2.rope_table(cfg, torch.cat([flux2.text_ids(t), flux2.image_ids(h, w)]))
    return img, txt, torch.full((batch,), 0.6), rope


def test_doctests() -> None:
    for mod in (flux2_config, step):
        assert doctest.testmod(mod).failed == 0


def test_flop_count_from_shapes() -> None:
    """By hand for a tiny shape: every token passes 13 h² weights per block, attention 4 S² h per block."""
    cfg = dataclasses.replace(CFG, hidden=8, heads=2, head_dim=4, in_channels=4, context_dim=6, time_dim=2)
    f = flux2_config.step_flop(cfg, 10, 3)
    h, s, blocks = 8, 13, 4
    assert f.attention == 4 * s * s * h * blocks
    embed = 2 * (10 * 4 * h + 3 * 6 * h + 10 * h * 4) + 2 * (2 * h + h * h + 15 * h * h + 2 * h * h)
    assert f.linear == 2 * s * blocks * 13 * h * h + embed
    assert flux2_config.step_flop(cfg, 10, 3, batch=2).total == 2 * f.total
    big = flux2_config.step_flop(flux2.KLEIN_9B, 4096, 512)
    assert 2.0 < big.total / flux2_config.step_flop(flux2.KLEIN_4B, 4096, 512).total < 2.3


def test_compile_pays_by_predicted_seconds() -> None:
    assert not step.compile_pays(4, 0.085, step.COMPILE_COLD_S)  # a one-image distilled job stays eager
    assert not step.compile_pays(40, 0.09, step.COMPILE_WARM_S)  # 20 steps CFG at 1024²: warm compile is too dear
    assert step.compile_pays(10_000, 0.09, step.COMPILE_COLD_S)  # a long queue pays even a cold compile


def test_cpu_falls_back_to_plain_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    m = _model()
    x = _inputs()
    ref = m(*x)
    with caplog.at_level(logging.INFO, logger="vramgraph.models.step"):
        got = step.prepare(m, step.StepShape(2, 16, 8), step.StepOptions(attention="cudnn", compile="auto"), 100)
    assert got.attention == "sdpa" and not got.compiled
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "cudnn attention (no CUDA device)" in lines[0] and "torch.compile (no CUDA device)" in lines[0]
    assert all(b.attend is None for b in m.streamed_blocks())
    assert torch.equal(m(*x), ref)


def test_fp8_without_fp8_matmuls_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A layer asking for scaled matmuls on a device without them dequantizes, and prepare names it."""
    m = _model()
    lin = m.single_blocks[0].linear2
    q = fp8.FP8Linear(lin.in_features, lin.out_features, torch.float8_e4m3fn, torch.float32, weight_scale=True,
                      input_scale=False, compute="rowwise")
    q.weight.data = lin.weight.to(torch.float8_e4m3fn)
    m.single_blocks[0].linear2 = q
    with caplog.at_level(logging.INFO, logger="vramgraph.models.step"):
        step.prepare(m, step.StepShape(1, 16, 8), step.StepOptions(compile="off"), 4)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "fp8 matmuls" in line and "dequantized" in line
    x = torch.randn(3, lin.in_features)
    assert torch.allclose(q(x), torch.nn.functional.linear(x, q.dequantized()))


def test_compiled_blocks_compute_the_same(tmp_path) -> None:
    """compile "on" (dynamo with the eager backend on the CPU: the same graph capture, no C++ build): one graph per
    block class serves both sizes; the output is the plain path's; the ledger records the compile."""
    m = _model(SMALL)
    opts = step.StepOptions(compile="on", cache_dir=str(tmp_path))
    got = step.prepare(m, step.StepShape(2, 16, 8), opts, 4, backend="eager")
    assert got.compiled and got.compile_s > 0
    assert len(step.CompileLedger(tmp_path).read()) == 1
    x, x2 = _inputs(cfg=SMALL), _inputs(h=6, w=6, cfg=SMALL)
    with torch.no_grad():
        y, y2 = m(*x), m(*x2)
    step.set_compiled(m, False)
    assert not step._is_compiled(m)
    with torch.no_grad():
        assert torch.allclose(y, m(*x), atol=1e-5) and torch.allclose(y2, m(*x2), atol=1e-5)


def test_compile_failure_falls_back(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    def broken(gm, example_inputs):  # a backend that cannot build what it is given
        raise RuntimeError("no C compiler found")

    m = _model(SMALL)
    x = _inputs(cfg=SMALL)
    ref = m(*x)
    with caplog.at_level(logging.INFO, logger="vramgraph.models.step"):
        got = step.prepare(m, step.StepShape(2, 16, 8), step.StepOptions(compile="on", cache_dir=str(tmp_path)), 4,
                           backend=broken)
    assert not got.compiled and not step._is_compiled(m)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "torch.compile" in line and "no C compiler found" in line
    assert torch.equal(m(*x), ref)
    assert step.CompileLedger(tmp_path).read() == {}


def test_sampling_with_step_options_matches_plain() -> None:
    m = _model()
    latent = torch.randn(1, CFG.in_channels, 4, 4)
    ctx, neg = torch.randn(1, 8, CFG.context_dim), torch.randn(1, 8, CFG.context_dim)
    sig = [1.0, 0.6, 0.0]
    plain = sample(m, latent, ctx, sig, negative=neg, guidance=3.0)
    fast = sample(m, latent, ctx, sig, negative=neg, guidance=3.0, step=step.StepOptions())
    assert torch.equal(plain, fast)


def test_options_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMGRAPH_COMPILE", "off")
    assert step.StepOptions.from_env() == step.StepOptions(compile="off")
    monkeypatch.setenv("VRAMGRAPH_ATTENTION", "fast")
    with pytest.raises(ValueError, match="VRAMGRAPH_ATTENTION='fast': use one of auto, sdpa, cudnn"):
        step.StepOptions.from_env()


def test_a_bad_step_setting_is_refused_before_any_work(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    """The CLI says it in one line and exits 2 before reading a model, not as a sampler node's failure mid-run."""
    from vramgraph.cli.main import main

    monkeypatch.setenv("VRAMGRAPH_COMPILE", "yes")
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--demo", "-p", "a cat", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "vramgraph generate: VRAMGRAPH_COMPILE='yes': use one of auto, on, off"
    assert "VGSampler" not in err and not (tmp_path / "x.png").exists()


def test_ledger_tolerates_a_broken_file(tmp_path) -> None:
    led = step.CompileLedger(tmp_path)
    (tmp_path / "compiled.json").write_text("{not json")
    assert led.read() == {}
    led.record("k", 12.3456)
    assert led.read() == {"k": 12.346}


def test_compiling_an_fp8_model_switches_to_per_row_scales(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step, "_trial_forward", lambda model, shape: None)  # the switch, not the trace, is tested
    m = _model()
    lin = m.single_blocks[1].linear1
    q = fp8.FP8Linear(lin.in_features, lin.out_features, torch.float8_e4m3fn, torch.float32, weight_scale=True,
                      input_scale=True, compute="scaled_mm")
    m.single_blocks[1].linear1 = q
    opts = step.StepOptions(compile="on", cache_dir=str(tmp_path))
    assert step.prepare(m, step.StepShape(1, 16, 8), opts, 4, backend="eager").compiled
    assert q.compute == step.FP8_COMPILED == "rowwise"
    step.prepare(m, step.StepShape(1, 16, 8), step.StepOptions(compile="off"), 4)
    assert not step._is_compiled(m) and q.compute == "scaled_mm"


def test_measured_step_peaks_stay_within_the_sampling_estimate() -> None:
    """The step's paths as bench/step.py measured them (plain bf16, compiled, each attention backend, fp8 per-row
    scales compiled) need no more activation memory than the sampler's estimate for a forward of that shape
    (nodes/estimates.sampling_bytes, plus fp8_transient: the largest fp8 layer in bf16, with the margin and preview
    that sampling_variants adds). Not checked: per-row scales uncompiled (1.45-1.5x the bf16 line; not a path the
    sampler takes: prepare() sets them only with the compile), and the eager static-scale fp8 path measured before
    its clamp went in place (3.4 % over at 2048² with CFG; models/fp8.py)."""
    import json
    from pathlib import Path

    from vramgraph.nodes.estimates import _margin, sampling_bytes

    report = json.loads((Path(__file__).parents[1] / "bench/results/step-levers-h100.json").read_text())
    hidden = {"klein-4b": flux2.KLEIN_4B.hidden, "klein-9b": flux2.KLEIN_9B.hidden}
    checked = 0
    for cell in report["variants"]:
        tokens = (cell["size"] // 16) ** 2 + report["text_tokens"]
        h, side = hidden[cell["model"]], cell["size"] // 16
        act = sampling_bytes(cell["cfg_passes"], tokens, h, 2)
        if cell["dtype"] == "fp8":
            act += (3 * h + 2 * int(h * 3.0)) * h * 2  # fp8_transient: single_blocks' linear1 dequantized
        est = _margin(act) + 2 * side * side * 128 * 4  # as sampling_variants' "gpu": margin, the preview's x0
        for name, r in cell["results"].items():
            if "peak_bytes" in r and name not in ("fp8_rowwise", "fp8_static"):
                assert r["peak_bytes"] <= est, (cell["size"], cell["dtype"], cell["cfg_passes"], name)
                checked += 1
    assert checked == 28  # 4 cells x 6 bf16 variants + 4 cells x fp8_fast


def test_every_attention_candidate_is_timed_with_a_callable() -> None:
    """"sdpa" (SDPA's own choice) has no forced kernel but is timed all the same (on the GPU its None callable was
    called: every sampler failed); a backend the device cannot run is named missing, not raised."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    calls: list[str] = []

    def timer(fn) -> float:
        out = fn()
        calls.append("ran")
        assert out.shape == q.shape
        return 1.0

    seconds, missing = step.time_candidates(("sdpa",), q, k, v, timer)
    assert seconds == {"sdpa": 1.0} and missing == [] and calls == ["ran"]

    def refusing(fn) -> float:
        raise RuntimeError("No available kernel")

    assert step.time_candidates(("sdpa", "flash"), q, k, v, refusing) == ({}, ["sdpa", "flash"])
