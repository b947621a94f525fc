"""GGUF against bf16 for the full-size klein transformer at 1024²: the dequantizing step's overhead over a bf16 step,
weight bytes and activation peaks, all in one run on the same random weights. The GGUF step is timed with the
Triton dequantizer (models/gguf_triton.py: on a GPU where Triton imports; `gguf_dequant` says which path ran) and,
once, with the torch code it replaces; `dequantize_all` times the dequantization of every layer alone, both ways.

For each GGML type asked for, a random full-size transformer GGUF (klein-4B or klein-9B shapes, BFL names, arch
"flux" as ComfyUI-GGUF writes it; block linears as random blocks with small scales, models/gguf_write.py) is written
to disk and loaded through our loader, so what is timed is what a user's file gives: blocks kept as bytes on the
GPU, dequantized per layer just in time. The bf16 model is the same weights dequantized once (the values the GGUF
model computes with), so the outputs differ by bf16 rounding only. The Qwen3 text encoder of the variant is timed
the same way with --text-encoder (one 512-token prompt).

    python bench/gguf_step.py OUT.json [--variant klein-9b] [--types Q8_0,Q4_K] [--steps 5] [--text-encoder]
    bash bench/run_device.sh gguf_step --variant klein-9b --types Q8_0,Q4_K --text-encoder   # on the device
    python bench/gguf_step.py --write DIR [--variant klein-9b] [--types Q4_K]   # the files only (side by side)
    python bench/gguf_step.py OUT.json --tiny                                   # tiny, on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import peak_on, rel_l2, timed_on
from vramgraph.models import flux2, flux2_config, loading, qwen3_config
from vramgraph.models.gguf_layers import GGUFEmbedding, GGUFLinear
from vramgraph.models.gguf_triton import DISPATCH
from vramgraph.models.gguf_write import write_random_gguf

GiB = 2**30
VARIANTS = {"klein-4b": (flux2_config.KLEIN_4B, qwen3_config.Qwen3Config()),
            "klein-9b": (flux2_config.KLEIN_9B, qwen3_config.QWEN3_8B)}


def write_files(folder: Path, variant: str, kind: str, tiny: bool = False, text_encoder: bool = True) -> dict:
    """Random full-size GGUF files of `variant` in `kind` under a ComfyUI models folder; their paths by component."""
    tr_cfg, te_cfg = _configs(variant, tiny)
    out = {"transformer": folder / "diffusion_models" / f"flux-2-{variant}-{kind}.gguf"}
    write_random_gguf(out["transformer"], flux2_config.parameter_shapes(tr_cfg), kind)
    if text_encoder:
        size = "8B" if variant == "klein-9b" else "4B"
        out["text_encoder"] = folder / "text_encoders" / f"Qwen3-{size}-{kind}.gguf"
        shapes = checkpoint_shapes(te_cfg, lm_head=variant == "klein-9b")
        write_random_gguf(out["text_encoder"], shapes, kind, arch="qwen3", llama_names=True)
    return out


def checkpoint_shapes(cfg: qwen3_config.Qwen3Config, lm_head: bool) -> dict[str, tuple[int, ...]]:
    """Qwen3's tensors as a whole checkpoint holds them (Hugging Face names): all `num_layers` layers, the final
    norm and, for a model whose output is not tied to its embeddings (Qwen3-8B; Qwen3-4B's is tied), `lm_head`
    (llama.cpp's output.weight). We read the first `n_built` layers; ComfyUI builds every layer, and the 8B's
    lm_head, and ComfyUI-GGUF gives a Linear missing from the file a zero fp32 matrix (2.5 GB for that lm_head)."""
    every = dataclasses.replace(cfg, output_layers=(cfg.num_layers,))
    out = {"model." + k: v for k, v in qwen3_config.parameter_shapes(every).items()}
    out["model.norm.weight"] = (cfg.hidden_size,)
    if lm_head:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def _configs(variant: str, tiny: bool) -> tuple:
    """The variant's transformer and text encoder configs; `tiny`: small ones that fit each other (the text
    encoder's rows are whole 256-element K-quant blocks, its hidden states the transformer's context)."""
    if not tiny:
        return VARIANTS[variant]
    from vramgraph.models.tiny import TINY_QWEN3, TINY_TRANSFORMER

    te = dataclasses.replace(TINY_QWEN3, hidden_size=256, intermediate_size=256, num_heads=2, num_kv_heads=1,
                             head_dim=128, num_layers=28)
    return dataclasses.replace(TINY_TRANSFORMER, context_dim=te.out_dim), te


def dequantized_copy(model: torch.nn.Module, build: Callable[[], torch.nn.Module], dtype: torch.dtype
                     ) -> torch.nn.Module:
    """The same model with every GGUF layer's weight dequantized once into a plain `dtype` tensor."""
    state = dict(model.state_dict())
    for name, mod in model.named_modules():
        if isinstance(mod, (GGUFLinear, GGUFEmbedding)):
            full = (mod.dequantized(dtype) if isinstance(mod, GGUFLinear) else
                    mod(torch.arange(mod.num, device=mod.weight.device)).to(dtype))
            state[f"{name}.weight"] = full
    with torch.device("meta"):
        plain = build()
    plain.load_state_dict(state, strict=True, assign=True)
    return plain.eval().requires_grad_(False)


def _weights(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _compare(quant: torch.nn.Module, plain: torch.nn.Module, step, steps: int, dev: torch.device) -> dict:
    """Step time, activation peak and output of the GGUF model (dequantized by the Triton kernels where they run)
    and of its bf16 copy; and one timed step of the GGUF model on the torch code, the path the kernels replace."""
    out: dict = {}
    ys = {}
    for name, m in (("bf16", plain), ("gguf", quant)):
        ys[name] = step(m).float()
        times = timed_on(lambda m=m: step(m), steps, dev)
        out[name] = {"step_s": statistics.median(times), "steps_s": times, "weights_bytes": _weights(m),
                     "activation_peak_bytes": peak_on(lambda m=m: step(m), dev)}
    with DISPATCH.torch_code():
        y_torch = step(quant).float()
        out["gguf_torch_code"] = {"step_s": timed_on(lambda: step(quant), 1, dev)[0],
                                  "activation_peak_bytes": peak_on(lambda: step(quant), dev)}
    out["gguf_dequant"] = _dequant_path(quant, dev)
    out["step_overhead_vs_bf16"] = out["gguf"]["step_s"] / out["bf16"]["step_s"]
    out["step_overhead_torch_code_vs_bf16"] = out["gguf_torch_code"]["step_s"] / out["bf16"]["step_s"]
    out["gguf_equals_torch_code"] = bool(torch.equal(ys["gguf"], y_torch))  # the same weights: the same output
    out["weights_vs_bf16"] = out["gguf"]["weights_bytes"] / out["bf16"]["weights_bytes"]
    out["rel_l2_gguf_vs_bf16"] = rel_l2(ys["gguf"], ys["bf16"])
    out["dequantize_all"] = _dequantize_all(quant, dev)
    return out


def _gguf_layers(model: torch.nn.Module) -> list[GGUFLinear]:
    return [m for m in model.modules() if isinstance(m, GGUFLinear)]


def _dequant_path(model: torch.nn.Module, dev: torch.device) -> str:
    """"triton" where every GGUF linear's blocks go to a kernel, else the reasons they do not."""
    why = {DISPATCH.unavailable(dev, m.kind, m.compute_dtype) for m in _gguf_layers(model)} - {None}
    return "triton" if not why else "torch code: " + "; ".join(sorted(map(str, why)))


def _dequantize_all(model: torch.nn.Module, dev: torch.device, repeats: int = 3) -> dict:
    """Seconds to dequantize every GGUF linear of `model` once (what one step adds to the bf16 step), by the
    kernels and by the torch code, and the kernels' bytes moved (blocks read, weights written) per second."""
    layers = _gguf_layers(model)

    def all_layers() -> None:
        for m in layers:
            m.dequantized()

    all_layers()
    fast = statistics.median(timed_on(all_layers, repeats, dev))
    with DISPATCH.torch_code():
        slow = timed_on(all_layers, 1, dev)[0]
    moved = sum(m.weight.numel() + m.in_features * m.out_features * m.compute_dtype.itemsize for m in layers)
    return {"layers": len(layers), "kernels_s": fast, "torch_code_s": slow, "torch_code_over_kernels": slow / fast,
            "kernels_bytes_per_s": moved / fast}


def bench_transformer(path: Path, side: int, steps: int, dev: torch.device, dt: torch.dtype) -> dict:
    spec = loading.inspect(path).transformer
    t0 = time.perf_counter()
    model = loading.load(spec, dtype=dt, device=dev)
    load_s = time.perf_counter() - t0
    cfg = spec.config
    h = w = side // 16
    g = torch.Generator(device=dev).manual_seed(1)
    img = torch.randn(1, h * w, cfg.in_channels, device=dev, generator=g, dtype=dt)
    txt = torch.randn(1, 512, cfg.context_dim, device=dev, generator=g, dtype=dt)
    sigma = torch.tensor([0.7], device=dev)
    rope = flux2.rope_table(cfg, torch.cat([flux2.text_ids(512), flux2.image_ids(h, w)]), dev)

    def step(m: torch.nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            return m(img, txt, sigma, rope)

    plain = dequantized_copy(model, lambda: flux2.Flux2Transformer(cfg), dt)
    report = {"load_s": load_s, "file_bytes": path.stat().st_size, "spec_bytes_bf16": spec.nbytes("bf16"),
              "dtype_mix": dict(spec.dtype_mix), "quantized_layers": spec.quant_layers,
              **_compare(model, plain, step, steps, dev)}
    from vramgraph.nodes import estimates
    from vramgraph.nodes.types import CondInfo, LatentInfo, ModelInfo

    info = ModelInfo("t", "transformer", "transformer", spec.nbytes("bf16"), cfg, spec, "bf16")
    est = estimates.sampling(info, LatentInfo(1, h, w), CondInfo(1, 512), 1, 1).activation
    report["estimate_activation_bytes"] = est
    measured = report["gguf"]["activation_peak_bytes"]
    report["estimate_over_measured"] = est / measured if measured else None
    return report


def bench_text_encoder(path: Path, steps: int, dev: torch.device, dt: torch.dtype) -> dict:
    from vramgraph.models.qwen3 import Qwen3Encoder

    spec = loading.inspect(path).text_encoder
    model = loading.load(spec, dtype=dt, device=dev)
    ids = torch.randint(0, spec.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(2)).to(dev)
    mask = torch.ones(1, 512, dtype=torch.long, device=dev)

    def step(m: torch.nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            return m(ids, mask)

    plain = dequantized_copy(model, lambda: Qwen3Encoder(spec.config), dt)
    return {"file_bytes": path.stat().st_size, "spec_bytes_bf16": spec.nbytes("bf16"),
            **_compare(model, plain, step, steps, dev)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="klein-9b")
    ap.add_argument("--types", default="Q8_0,Q4_K")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--text-encoder", action="store_true")
    ap.add_argument("--write", type=Path, help="write the GGUF files into this models folder and stop")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing")
    a = ap.parse_args()
    kinds = a.types.split(",")
    if a.write:
        for kind in kinds:
            for part, path in write_files(a.write, a.variant, kind, a.tiny).items():
                print(f"{part}: {path} ({path.stat().st_size / GiB:.3f} GiB)")
        return
    if not a.out:
        sys.exit("usage: bench/gguf_step.py OUT.json | --write DIR")
    from _common import env, write_report

    dev = torch.device("cpu" if a.tiny else "cuda")
    dt = torch.float32 if a.tiny else torch.bfloat16
    side = 64 if a.tiny else a.side
    report: dict = {"env": env(), "variant": a.variant, "side": side, "steps_timed": a.steps, "types": {}}
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="vg-gguf-") as tmp:
            t0 = time.perf_counter()
            files = write_files(Path(tmp), a.variant, kind, a.tiny, a.text_encoder)
            entry = {"write_s": time.perf_counter() - t0,
                     "transformer": bench_transformer(files["transformer"], side, a.steps, dev, dt)}
            gc.collect()
            if a.text_encoder:
                entry["text_encoder"] = bench_text_encoder(files["text_encoder"], a.steps, dev, dt)
        report["types"][kind] = entry
        write_report(a.out, report)  # after every type: a run cut short keeps the types it finished
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
