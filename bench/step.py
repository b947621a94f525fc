"""The sampling step at the GPU's limit: per card, size, model, dtype and CFG passes, the step time of the plain path
and of each lever (models/step.py), its FLOP count from the model's shapes (models/flux2_config.step_flop), the
card's matmul rate measured in the same run, and their ratio. Random full-size weights, seeded; warm; uncapped.

    python3 bench/step.py OUT.json [--models 4b,9b] [--sizes 512,1024,2048] [--cfg 1,2] [--reps 5]
                                   [--variants plain,fast,fp8_static,fp8_rowwise,fp8_fast] [--levers]
    python3 bench/step.py OUT.json --tiny      # tiny shapes on the CPU: checks the script, measures nothing

Variants: "plain" (SDPA's own attention, eager: the path before this bench), "fast" (models/step.py: attention
picked per shape, blocks compiled with dynamic shapes), "fp8_static" (the fp8 file's static input scale,
torch._scaled_mm per tensor: fp8.DEFAULT_COMPUTE before), "fp8_rowwise" (per-row activation scales, eager),
"fp8_fast" (per-row scales, compiled, attention picked). --levers adds, per cell, each attention backend alone and
the compile with static shapes. The report's `cells` follow the issue's schema (card, size, model, dtype,
cfg_passes, step_s, flop, matmul_flop_s), step_s being the product's path ("fast", or "fp8_fast" for fp8), and
`variants` holds every variant's seconds, peak and deviation from the plain bf16 output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import peak_on, sync, timed_on
from vramgraph.models import flux2, fp8, step
from vramgraph.models.flux2_config import step_flop

MODELS = {"4b": flux2.KLEIN_4B, "9b": flux2.KLEIN_9B}
TEXT_TOKENS = 512


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=False).stdout.strip() or os.environ.get("VG_COMMIT", "")
    except OSError:
        return os.environ.get("VG_COMMIT", "")


def timed(fn, reps: int, dev: torch.device) -> float:
    """Median seconds of `reps` calls after one warm-up, each waited for on `dev`."""
    fn()
    return statistics.median(timed_on(fn, reps, dev))


def matmul_rate(dev: torch.device, n: int = 8192, reps: int = 10) -> dict:
    """The card's dense bf16 and fp8 (per-row scaled) matmul FLOP/s on random n x n x n operands."""
    if dev.type != "cuda":
        return {"bf16": 0.0, "fp8": 0.0}
    a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    rate = {"bf16": 2 * n**3 / timed(lambda: a @ b, reps, dev)}
    try:
        qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        sa, sb = torch.ones(n, 1, device=dev), torch.ones(1, n, device=dev)
        rate["fp8"] = 2 * n**3 / timed(lambda: torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=a.dtype,
                                                                 use_fast_accum=True), reps, dev)
    except RuntimeError:
        rate["fp8"] = 0.0
    return rate


def build(cfg: flux2.Flux2Config, dev: torch.device, dt: torch.dtype) -> flux2.Flux2Transformer:
    torch.manual_seed(0)
    with torch.device(dev):
        m = flux2.Flux2Transformer(cfg).to(dt).eval().requires_grad_(False)
    with torch.no_grad():
        for p in m.parameters():  # norm scales off 1.0; weights scaled so activations stay in a sane range
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return m


def to_fp8(model: flux2.Flux2Transformer, amax: dict[str, float]) -> None:
    """Quantize the block linears in place as BFL's fp8 files hold them: e4m3 weights, per-tensor weight_scale,
    static input_scale = amax(input) / 448 from a bf16 forward (the rest stays bf16)."""
    for name, mod in list(model.named_modules()):
        if not (isinstance(mod, torch.nn.Linear) and name.startswith(("double_blocks.", "single_blocks."))):
            continue
        w = mod.weight
        q = fp8.FP8Linear(mod.in_features, mod.out_features, torch.float8_e4m3fn, w.dtype, weight_scale=True,
                          input_scale=True, compute="scaled_mm").to(w.device)
        s = w.float().abs().amax() / fp8.FP8_MAX
        q.weight.data = (w.float() / s).to(torch.float8_e4m3fn)
        q.weight_scale.fill_(float(s))
        q.input_scale.fill_(amax.get(name, 1.0) / fp8.FP8_MAX)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, q)


def calibrate(model: flux2.Flux2Transformer, run) -> dict[str, float]:
    amax: dict[str, float] = {}
    hooks = [mod.register_forward_hook(lambda mod, inp, out, n=n: amax.__setitem__(
        n, max(amax.get(n, 0.0), float(inp[0].abs().amax()))))
        for n, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and n.startswith(("double_blocks.", "single_blocks."))]
    run(model)
    for h in hooks:
        h.remove()
    return amax


def inputs(cfg: flux2.Flux2Config, side: int, passes: int, dev: torch.device, dt: torch.dtype) -> dict:
    h = w = side // 16
    g = torch.Generator(device=dev).manual_seed(1)
    img = torch.randn(1, h * w, cfg.in_channels, device=dev, generator=g, dtype=dt).expand(passes, -1, -1)
    txt = torch.randn(passes, TEXT_TOKENS, cfg.context_dim, device=dev, generator=g, dtype=dt)
    rope = flux2.rope_table(cfg, torch.cat([flux2.text_ids(TEXT_TOKENS), flux2.image_ids(h, w)]), dev)
    return {"img": img, "txt": txt, "sigma": torch.full((passes,), 0.7, device=dev), "rope": rope}


def forward(model, x: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(x["img"], x["txt"], x["sigma"], x["rope"])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def set_variant(model, name: str, shape: step.StepShape, cache: Path, backend: str) -> dict:
    """Put `model` in variant `name`; what it took (attention picked, compile seconds)."""
    info: dict = {}
    fp8_compute = {"fp8_static": "scaled_mm", "fp8_rowwise": "rowwise", "fp8_fast": "rowwise",
                   "fp8_fast_static": "scaled_mm"}.get(name)
    if fp8_compute:
        fp8.set_compute(model, fp8_compute)
    if name.startswith("attn_"):
        step.set_compiled(model, False)
        step.set_attention(model, name.removeprefix("attn_"))
        return info
    fast = name in ("fast", "fp8_fast", "fast_static", "fp8_fast_static")
    if not fast:
        step.set_compiled(model, False)
        step.set_attention(model, "sdpa")
        return info
    pick, secs, missing = step.pick_attention(model.img_in.weight.device, model.dtype, shape.batch, model.cfg.heads,
                                              shape.tokens, model.cfg.head_dim)
    step.set_attention(model, pick)
    info.update(attention=pick, attention_s=secs, attention_missing=list(missing))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    step.set_compiled(model, True, backend, dynamic=name != "fast_static")
    return info


def run_cell(model, key: str, dtype: str, side: int, passes: int, variants: list[str], a, dev, ref_out) -> dict:
    cfg = model.cfg
    dt = torch.bfloat16
    x = inputs(cfg, side, passes, dev, dt)
    shape = step.StepShape(passes, (side // 16) ** 2, TEXT_TOKENS)
    out: dict = {}
    for v in variants:
        info = set_variant(model, v, shape, Path(a.cache), a.backend)
        t0 = time.perf_counter()
        try:
            y = forward(model, x)
        except Exception as e:  # a lever that fails here is reported, not fatal to the run
            out[v] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            step.set_compiled(model, False)
            continue
        sync(dev)
        info["first_call_s"] = time.perf_counter() - t0
        info["step_s"] = timed(lambda: forward(model, x), a.reps, dev)
        info["peak_bytes"] = peak_on(lambda: forward(model, x), dev)
        if ref_out is not None and (key, side, passes) in ref_out:
            info["rel_l2_vs_plain_bf16"] = rel(y.float(), ref_out[(key, side, passes)])
        elif v == "plain" and dtype == "bf16":
            ref_out[(key, side, passes)] = y.float()
        out[v] = info
        print(f"{key} {dtype} {side}² cfg{passes} {v}: {info['step_s'] * 1e3:.1f} ms "
              f"(first {info['first_call_s']:.1f} s) {info.get('attention', '')} "
              f"rel {info.get('rel_l2_vs_plain_bf16', 0):.4f}", flush=True)
    step.set_compiled(model, False)
    return out


def sampling_check(dev: torch.device, steps: int, side: int, tiny: bool) -> dict:
    """The product path end to end: models.sampling.sample with CFG over `steps` steps, plain, then with the step's
    levers (compile "on", then "auto" on the compiled model); seconds with the compile, and the latents' deviation."""
    from vramgraph.models.sampling import noise, sample, sigmas
    from vramgraph.models.tiny import TINY_TRANSFORMER

    cfg = TINY_TRANSFORMER if tiny else flux2.KLEIN_4B
    model = build(cfg, dev, torch.bfloat16)
    h = side // 16
    lat = noise(42, 1, h, h)
    g = torch.Generator().manual_seed(3)
    ctx, neg = (torch.randn(1, TEXT_TOKENS, cfg.context_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    sig = sigmas(steps, h * h)
    out: dict = {"steps": steps, "size": side, "cfg": 5.0}
    for name, opts in (("plain", step.PLAIN), ("compile_on", step.StepOptions(compile="on")),
                       ("auto_after", step.StepOptions())):
        sync(dev)
        t0 = time.perf_counter()
        x = sample(model, lat, ctx, sig, negative=neg, guidance=5.0, step=opts)
        sync(dev)
        out[name] = {"seconds": time.perf_counter() - t0}
        if name == "plain":
            ref = x.float()
        else:
            out[name]["rel_l2_vs_plain"] = rel(x.float(), ref)
        print(f"sample {name}: {out[name]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default="4b,9b")
    ap.add_argument("--sizes", default="512,1024,2048")
    ap.add_argument("--cfg", default="1,2")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bf16-variants", default="plain,fast")
    ap.add_argument("--fp8-variants", default="fp8_static,fp8_rowwise,fp8_fast")
    ap.add_argument("--levers", action="store_true", help="also each attention backend alone, and static compile")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--cache", default=None, help="inductor cache folder (default: a fresh temporary one: cold)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing")
    ap.add_argument("--sample", type=int, default=0, help="first, sample this many CFG steps at 1024² through "
                    "models.sampling with the levers off and on (the product's path)")
    a = ap.parse_args()
    a.cache = a.cache or tempfile.mkdtemp(prefix="vg-step-cache-")
    dev = torch.device("cpu" if a.tiny else "cuda")
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rate = matmul_rate(dev)
    report: dict = {"commit": _commit(), "card": card, "torch": torch.__version__, "date": time.strftime("%F %T"),
                    "matmul_flop_s": rate, "text_tokens": TEXT_TOKENS, "reps": a.reps, "cells": [], "variants": []}
    if dev.type == "cuda":
        report["cudnn"] = torch.backends.cudnn.version()
    print(f"{card}: bf16 matmul {rate['bf16'] / 1e12:.0f} TFLOP/s, fp8 {rate['fp8'] / 1e12:.0f}", flush=True)
    if a.sample:
        report["sampling"] = sampling_check(dev, a.sample, 64 if a.tiny else 1024, a.tiny)
    ref_out: dict = {}
    from vramgraph.models.tiny import TINY_TRANSFORMER

    for key in a.models.split(","):
        cfg = TINY_TRANSFORMER if a.tiny else MODELS[key]
        model = build(cfg, dev, torch.bfloat16)
        sizes = [64] if a.tiny else [int(s) for s in a.sizes.split(",")]
        for dtype in a.dtypes.split(","):
            if dtype == "fp8":
                x = inputs(cfg, 1024 if not a.tiny else 64, 1, dev, torch.bfloat16)
                to_fp8(model, calibrate(model, lambda m, x=x: forward(m, x)))
            variants = (a.bf16_variants if dtype == "bf16" else a.fp8_variants).split(",")
            if a.levers and dtype == "bf16":
                variants += ["attn_cudnn", "attn_flash", "attn_efficient", "fast_static"]
            for side in sizes:
                for passes in [int(c) for c in a.cfg.split(",")]:
                    res = run_cell(model, key, dtype, side, passes, variants, a, dev, ref_out)
                    flop = step_flop(cfg, (side // 16) ** 2, TEXT_TOKENS, passes).total
                    best = "fp8_fast" if dtype == "fp8" else "fast"
                    plain = "fp8_static" if dtype == "fp8" else "plain"
                    cell = {"card": card, "size": side, "model": f"klein-{key}", "dtype": dtype, "cfg_passes": passes,
                            "step_s": res.get(best, {}).get("step_s"), "plain_step_s": res.get(plain, {}).get("step_s"),
                            "flop": flop, "matmul_flop_s": rate["bf16"]}
                    if cell["step_s"] and rate["bf16"]:
                        cell["limit_share"] = flop / rate["bf16"] / cell["step_s"]
                        cell["step_over_flop_at_rate"] = cell["step_s"] * rate["bf16"] / flop
                    report["cells"].append(cell)
                    report["variants"].append({**{k: cell[k] for k in ("size", "model", "dtype", "cfg_passes")},
                                               "results": res})
                    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(a.out).write_text(json.dumps(report, indent=1))
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for c in report["cells"]:
        print(f"{c['model']} {c['dtype']} {c['size']}² cfg{c['cfg_passes']}: step {c['step_s']} plain "
              f"{c['plain_step_s']} share {c.get('limit_share', 0):.2f}")


if __name__ == "__main__":
    sys.exit(main())
