"""Measured against estimated on the GPU: the FLUX.2 small decoder's decode and the klein-9B-kv sampler.

    python3 bench/klein_extras.py OUT.json      (bash bench/run_device.sh klein_extras)

Random weights at the real shapes, bf16, measured as the executor measures a node (bench/_common.peak_bytes: peak
allocated above what was resident). Reports, per point, the measured peak, nodes/estimates.py's prediction (with its
MARGIN) and their ratio:
- decode at 512², 1024², 1536² with the full FLUX.2 decoder and the small decoder, and small / full measured against
  the estimate's 0.75 (BFL's card says ~1.4x less VRAM at decode);
- a klein-9B sampler with two 1024² references at 1024², 4 steps, cfg 1: plain (references re-sent each step) and with
  FluxKVCache (references' K/V cached on step 0), and the time of each (later kv steps run without the references).
About 1-2 minutes on one H200 (the 9B transformer is ~17 GiB in bf16).
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import GiB, env, peak_bytes, write_report
from vramgraph.models.flux2 import KLEIN_9B, Flux2Transformer
from vramgraph.models.vae import Flux2VAE
from vramgraph.models.vae_config import SMALL_DECODER, VAEConfig
from vramgraph.nodes import estimates, ops
from vramgraph.nodes.types import CondInfo, LatentInfo, ModelInfo
from vramgraph.nodes.values import Noise


def decode_points() -> list[dict]:
    out = []
    for name, cfg in (("full", VAEConfig()), ("small", SMALL_DECODER)):
        torch.manual_seed(0)
        with torch.device("cuda"):
            vae = Flux2VAE(cfg, parts=("decoder",)).to(torch.bfloat16).eval().requires_grad_(False)
        info = ModelInfo(f"vae:{name}:bf16", "vae", "vae", 0, cfg)
        for side in (512, 1024, 1536):
            z = torch.randn(1, 128, side // 16, side // 16)
            with torch.no_grad():
                b = peak_bytes(ops.vae_decode, vae, z, "gpu")
            est = next(v.activation for v in estimates.vae_decode(info, LatentInfo(1, side // 16, side // 16))
                       if v.name == "gpu")
            out.append({"decoder": name, "side": side, "width": cfg.decoder_widths[0], "bytes": b, "estimate": est,
                        "estimate_over_measured": est / b})
        del vae
        torch.cuda.empty_cache()
    for p in out:
        if p["decoder"] == "small":
            full = next(q for q in out if q["decoder"] == "full" and q["side"] == p["side"])
            p["small_over_full_measured"] = p["bytes"] / full["bytes"]
            p["small_over_full_estimated"] = p["estimate"] / full["estimate"]
    return out


def kv_points() -> list[dict]:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Flux2Transformer(KLEIN_9B).to(torch.bfloat16).eval().requires_grad_(False)
    lat = torch.zeros(1, 128, 64, 64)
    noise = Noise(1).generate_noise({"samples": lat})
    emb = torch.randn(1, 512, KLEIN_9B.context_dim) * 0.1
    refs = [torch.randn(1, 128, 64, 64) for _ in range(2)]
    sig = [1.0, 0.95, 0.9, 0.75, 0.0]
    out = []
    for kv in (False, True):
        info = ModelInfo("transformer:9b:bf16", "transformer", "transformer", 0, KLEIN_9B, kv_cache=kv)
        est = estimates.sampling(info, LatentInfo(1, 64, 64), CondInfo(1, 512, ((64, 64), (64, 64))), 1, 4)

        def run(kv: bool = kv) -> torch.Tensor:
            return ops.run_sampler(model, noise, lat, emb, None, 1.0, sig, refs, kv_cache=kv)

        run()  # warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b = peak_bytes(run)
        seconds = time.perf_counter() - t0
        out.append({"kv_cache": kv, "bytes": b, "estimate": est.activation,
                    "estimate_over_measured": est.activation / b, "seconds": seconds,
                    "estimated_seconds": est.seconds})
    out[1]["kv_over_plain_seconds"] = out[1]["seconds"] / out[0]["seconds"]
    out[1]["kv_cache_bytes"] = estimates.kv_cache_bytes(1, 8192, KLEIN_9B.hidden,
                                                        KLEIN_9B.depth_double + KLEIN_9B.depth_single, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    a = ap.parse_args()
    dec = decode_points()
    kv = kv_points()
    write_report(a.out, {"env": env(), "decode": dec, "kv_sampler": kv,
                         "worst_estimate_over_measured": min(p["estimate_over_measured"] for p in dec + kv),
                         "peak_gib": torch.cuda.max_memory_allocated() / GiB})


if __name__ == "__main__":
    main()
