"""fp8 against bf16 for the full-size klein-4B transformer at 1024²: step time, weight bytes and activation peak of
bf16, fp8 dequantize-just-in-time and fp8 torch._scaled_mm, all in one run on the same random weights.

The random bf16 transformer (our Flux2Transformer, klein-4B shapes, seeded) is quantised the way ComfyUI stores
BFL's klein fp8 files (models/tiny.py `quantize_fp8`): every Linear of the double and single blocks as
float8_e4m3fn with a per-tensor `weight_scale` (amax / 448) and a static `input_scale` calibrated on one bf16
forward (amax of the layer's input / 448), marked by `_quantization_metadata` in the header; the rest (img_in,
txt_in, time_in, the three modulations, final_layer) stays bf16; BFL key names without a prefix. The file is
written to disk and loaded back through our loader (header recognition, host-read path), so what is timed is
what a user's file gives. Each mode runs the same inputs; outputs are compared with the bf16 model's.

    python bench/fp8.py OUT.json [--steps 10] [--keep /path/flux-2-klein-4b-fp8.safetensors]
    python bench/fp8.py --convert IN.safetensors OUT.safetensors   # any bf16 klein transformer file -> ComfyUI fp8

`--convert` writes the same format from an existing bf16 file (e.g. the peer harness's random
`diffusion_models/flux-2-klein-4b.safetensors`), with input_scale 1.0 (no calibration data), for ComfyUI's
UNETLoader and ours side by side.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from vramgraph.models import flux2, fp8, loading
from vramgraph.models.tiny import quantize_fp8

GiB = 2**30


def _block_linear(key: str) -> bool:
    return key.startswith(("double_blocks.", "single_blocks.")) and key.endswith(".weight")


def write_fp8(sd: dict[str, torch.Tensor], path: Path, input_scales: dict | float | None = 1.0) -> Path:
    """A bf16 BFL-named transformer state dict -> a ComfyUI-format fp8 file (block linears e4m3, rest as given)."""
    from safetensors.torch import save_file

    sd = {k: v for k, v in sd.items() if not k.endswith(".comfy_quant")}
    tensors, meta = quantize_fp8(sd, layers=lambda k: _block_linear(k) and sd[k].ndim == 2, input_scale=input_scales)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def convert(src: Path, dst: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(src))
    prefix = next((p for p in flux2.BFL_PREFIXES if all(k.startswith(p) for k in sd)), "")
    write_fp8({k.removeprefix(prefix): v for k, v in sd.items()}, dst, 1.0)
    spec = loading.inspect(dst).transformer
    print(f"{dst}: {spec.quant_layers} fp8 layers, {spec.nbytes('bf16') / GiB:.3f} GiB loaded "
          f"(bf16: {spec.params * 2 / GiB:.3f} GiB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--keep", type=Path, help="write the fp8 file here (and keep it) instead of a temporary folder")
    ap.add_argument("--convert", nargs=2, type=Path, metavar=("IN", "OUT"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing")
    a = ap.parse_args()
    if a.convert:
        convert(*a.convert)
        return
    if not a.out:
        sys.exit("usage: bench/fp8.py OUT.json | --convert IN OUT")
    from _common import env, peak_on, rel_l2, timed_on, write_report
    from vramgraph.models.tiny import TINY_TRANSFORMER

    dev = torch.device("cpu" if a.tiny else "cuda")
    cfg = TINY_TRANSFORMER if a.tiny else flux2.KLEIN_4B
    side = 64 if a.tiny else a.side
    dt = torch.bfloat16
    torch.manual_seed(0)
    with torch.device(dev):
        model = flux2.Flux2Transformer(cfg).to(dt).eval().requires_grad_(False)
        for p in model.parameters():  # norm scales off 1.0 so that they matter
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    h = w = side // 16
    g = torch.Generator(device=dev).manual_seed(1)
    img = torch.randn(1, h * w, cfg.in_channels, device=dev, generator=g, dtype=dt)
    txt = torch.randn(1, 512, cfg.context_dim, device=dev, generator=g, dtype=dt)
    sigma = torch.tensor([0.7], device=dev)
    rope = flux2.rope_table(cfg, torch.cat([flux2.text_ids(512), flux2.image_ids(h, w)]), dev)

    def step(m):
        with torch.inference_mode():
            return m(img, txt, sigma, rope)

    # calibration: the static input scale of each block linear, amax of its input over one bf16 forward / 448
    amax: dict[str, float] = {}
    hooks = [mod.register_forward_hook(lambda mod, inp, out, n=n: amax.__setitem__(
        n + ".weight", max(amax.get(n + ".weight", 0.0), float(inp[0].abs().amax()))))
        for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and _block_linear(n + ".weight")]
    ref = step(model).float()
    for hk in hooks:
        hk.remove()
    report: dict = {"env": env(), "side": side, "tokens": h * w + 512, "steps_timed": a.steps, "modes": {}}
    step(model)
    bf16_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    times = timed_on(partial(step, model), a.steps, dev)
    report["modes"]["bf16"] = {"step_s": statistics.median(times), "steps_s": times, "weights_bytes": bf16_weights,
                               "activation_peak_bytes": peak_on(partial(step, model), dev), "rel_l2_vs_bf16": 0.0}
    folder = a.keep.parent if a.keep else Path(tempfile.mkdtemp(prefix="vg-fp8-"))
    path = a.keep or folder / "flux-2-klein-4b-fp8.safetensors"
    t0 = time.perf_counter()
    write_fp8(model.state_dict(), path, {k: v / 448.0 for k, v in amax.items()})
    report["write_s"] = time.perf_counter() - t0
    report["file_bytes"] = path.stat().st_size
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    spec = loading.inspect(path).transformer
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    t0 = time.perf_counter()
    m8 = loading.load(spec, dtype=dt, device=dev, fp8_compute="dequant")
    report["load_s"] = time.perf_counter() - t0
    weights = (torch.cuda.memory_allocated(dev) - before) if dev.type == "cuda" else \
        sum(t.numel() * t.element_size() for t in m8.state_dict().values())
    report["fp8_spec"] = {"quantized_layers": spec.quant_layers, "nbytes_bf16_compute": spec.nbytes("bf16"),
                          "dtype_mix": dict(spec.dtype_mix), "measured_weight_bytes": weights}
    variants = [("fp8_dequant", "dequant", None), ("fp8_scaled_mm", "scaled_mm", None),
                ("fp8_scaled_mm_input_scale_1", "scaled_mm", 1.0)]
    outs = {}
    for name, compute, force_scale in variants:
        fp8.set_compute(m8, compute)
        if force_scale is not None:
            for mod in m8.modules():
                if isinstance(mod, fp8.FP8Linear) and hasattr(mod, "input_scale"):
                    mod.input_scale.fill_(force_scale)
        y = step(m8).float()
        outs[name] = y
        times = timed_on(lambda: step(m8), a.steps, dev)
        report["modes"][name] = {"step_s": statistics.median(times), "steps_s": times, "weights_bytes": weights,
                                 "activation_peak_bytes": peak_on(lambda: step(m8), dev),
                                 "rel_l2_vs_bf16": rel_l2(y, ref)}
    report["rel_l2_scaled_mm_vs_dequant"] = rel_l2(outs["fp8_scaled_mm"], outs["fp8_dequant"])
    bf = report["modes"]["bf16"]
    for r in report["modes"].values():
        r["step_vs_bf16"] = r["step_s"] / bf["step_s"]
        r["weights_vs_bf16"] = r["weights_bytes"] / bf["weights_bytes"]
    dq, mm = report["modes"]["fp8_dequant"], report["modes"]["fp8_scaled_mm"]
    same_quality = mm["rel_l2_vs_bf16"] <= 1.5 * dq["rel_l2_vs_bf16"] + 1e-3
    report["faster"] = "scaled_mm" if mm["step_s"] < dq["step_s"] else "dequant"
    report["choice"] = report["faster"] if same_quality else "dequant"
    report["default_in_code"] = fp8.DEFAULT_COMPUTE
    # the planner's activation estimate for this model against what was measured
    from vramgraph.nodes import estimates
    from vramgraph.nodes.types import CondInfo, LatentInfo, ModelInfo

    info = ModelInfo("t", "transformer", "transformer", spec.nbytes("bf16"), spec.config, spec, "bf16")
    est = estimates.sampling(info, LatentInfo(1, h, w), CondInfo(1, 512), 1, 1).activation
    report["estimate_activation_bytes"] = est
    report["estimate_over_measured"] = {n: est / r["activation_peak_bytes"] for n, r in report["modes"].items()
                                        if n.startswith("fp8") and r["activation_peak_bytes"]}
    if not a.keep:
        path.unlink()
    write_report(a.out, report)


if __name__ == "__main__":
    main()
