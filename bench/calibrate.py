"""Measure the activation peaks the estimates are fitted on, on the GPU, and fit them (nodes/calibration.py).

    python3 bench/calibrate.py OUT.json [--dtypes bf16,fp32] [--sides 256,512,768,1024,1536,2048]

Run from the repository root with vramgraph importable (bench/run_device.sh does: `bash bench/run_device.sh
calibrate`); about 2-4 minutes on one H200. Builds our own klein-4B-shaped transformer, Qwen3 encoder and FLUX.2 VAE
with random weights on the GPU in each compute dtype and measures, with the executor's measure (peak allocated
above the resident weights, bench/_common.peak_bytes), each heavy node's torch work (nodes/ops.py) over shapes:

- text encode: batch 1 and 2 (512 padded tokens);
- sampler, one Euler step: square sides, cfg 1 and 4 (a batch of 2), 1 and 2 reference latents (1024²) at 512 and
  1024;
- VAE decode: square sides, a batch of 2 at 512, a 2:1 frame; tiled decode at 1536, 2048 and 2048x1024;
- VAE encode: square sides up to 1024.

OUT.json holds the points under "calibration" (the schema nodes/calibration.py reads: shapes, "dtype", widths,
"bytes") and `nodes.calibration.report` of them: the constants fitted ("fit", unrounded; "constants" as
nodes/estimates.py writes them), the constants in use and whether they are that fit, each point's error with the fit
and the worst per kind and dtype. To adopt a run: copy OUT.json to bench/results/calibrate.json and set
nodes/estimates.py's constants to its "constants"; tests/test_calibration.py then checks that they are the fit of the
committed points and that the report says so. fp8-stored weights compute in bf16 and the small decoder is a
`decoder_width` parameter of the formula; neither is measured here.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import GiB, env, peak_bytes, write_report
from vramgraph.models.flux2 import KLEIN_4B, Flux2Transformer
from vramgraph.models.qwen3 import PromptTokenizer, Qwen3Config, Qwen3Encoder
from vramgraph.models.vae import Flux2VAE
from vramgraph.nodes import calibration, ops
from vramgraph.nodes.values import Noise

TEXT_TOKENS = 512


def build(dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """Random-weight models of klein-4B shapes, built on the GPU (no files: this measures activations only)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        mods = {"transformer": Flux2Transformer(KLEIN_4B), "text_encoder": Qwen3Encoder(Qwen3Config()),
                "vae": Flux2VAE()}
    return {k: m.to(dtype).eval().requires_grad_(False) for k, m in mods.items()}


def measure(dtype_name: str, sides: list[int], tok: PromptTokenizer) -> dict[str, list[dict]]:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    mods = build(dtype)
    hidden_te, hidden_tr = Qwen3Config().hidden_size, KLEIN_4B.hidden
    width = mods["vae"].cfg.channels[0]
    base = {"dtype": dtype_name}
    out: dict[str, list[dict]] = {k: [] for k in calibration.KINDS}
    with torch.no_grad():
        # a first encode, not measured: torch allocates its cuBLAS workspace on the process's first matrix product and
        # keeps it (the engine makes it before planning, graph/budget.blas_workspace); measured, it made bf16's first
        # point 34 MiB too high in the first runs and a fixed part of 66 MiB in their fit
        ops.encode_text(mods["text_encoder"], tok, ["warm-up"])
        for batch in (1, 2):
            texts = [f"a lighthouse on a cliff, number {i}" for i in range(batch)]
            out["text_encode"].append({**base, "batch": batch, "tokens": TEXT_TOKENS, "hidden": hidden_te,
                                       "bytes": peak_bytes(ops.encode_text, mods["text_encoder"], tok, texts)})
        emb = ops.encode_text(mods["text_encoder"], tok, ["a lighthouse"])
        for side in sides:
            h = side // 16
            lat = torch.zeros(1, 128, h, h)
            noise = Noise(1).generate_noise({"samples": lat})
            for cfg, refs in ((1.0, 0), (4.0, 0), (1.0, 1), (1.0, 2)):
                if refs and side not in (512, 1024):
                    continue
                ref_lats = [torch.randn(1, 128, 64, 64) for _ in range(refs)]
                b = peak_bytes(ops.run_sampler, mods["transformer"], noise, lat, emb, emb if cfg != 1 else None, cfg,
                               [1.0, 0.5], ref_lats)
                out["sampler"].append({**base, "side": side, "cfg": cfg, "refs": refs, "hidden": hidden_tr,
                                       "tokens": h * h + TEXT_TOKENS + refs * 64 * 64,
                                       "batch": 2 if cfg != 1 else 1, "bytes": b})
            decode = [(1, side, side)] + ([(2, side, side)] if side == 512 else []) + \
                ([(1, side // 2, side)] if side == 1024 else [])
            for batch, hh, ww in decode:
                z = torch.randn(batch, 128, hh // 16, ww // 16)
                out["decode"].append({**base, "batch": batch, "height": hh, "width": ww, "decoder_width": width,
                                      "bytes": peak_bytes(ops.vae_decode, mods["vae"], z, "gpu")})
            for hh, ww in [(side, side)] + ([(side // 2, side)] if side == 2048 else []) if side >= 1536 else []:
                z = torch.randn(1, 128, hh // 16, ww // 16)
                out["tiled"].append({**base, "batch": 1, "height": hh, "width": ww, "decoder_width": width,
                                     "bytes": peak_bytes(ops.vae_decode, mods["vae"], z, "tiled")})
            if side <= 1024:
                img = torch.rand(1, side, side, 3)
                out["vae_encode"].append({**base, "batch": 1, "side": side, "decoder_width": width,
                                          "bytes": peak_bytes(ops.vae_encode, mods["vae"], img)})
            print(dtype_name, side, f"{torch.cuda.max_memory_allocated() / GiB:.1f} GiB", flush=True)
    del mods
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--sides", default="256,512,768,1024,1536,2048")
    a = ap.parse_args()
    t0 = time.perf_counter()
    tok = PromptTokenizer.find(None)
    sides = [int(s) for s in a.sides.split(",")]
    points: dict[str, list[dict]] = {k: [] for k in calibration.KINDS}
    for name in a.dtypes.split(","):
        for kind, pts in measure(name, sides, tok).items():
            points[kind] += pts
    report = {"env": env(), "seconds": round(time.perf_counter() - t0, 1), "calibration": points,
              **calibration.report(points)}
    write_report(a.out, report)


if __name__ == "__main__":
    main()
