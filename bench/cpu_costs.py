"""CPU seconds of the text encode and the VAE decode: what the planner's CPU variants cost (nodes/estimates.py
CPU_TEXT_ENCODE_SECONDS_PER_PROMPT and CPU_DECODE_SECONDS_PER_MPIXEL).

    python3 bench/cpu_costs.py OUT.json [--dtype bf16] [--threads N] [--quick]

The real models take minutes a run on a small CPU, so this counts and times separately:
- the work of the real sizes (Qwen3-4B, the 27 layers klein reads, one prompt of 512 tokens; the FLUX.2 VAE decoder
  at 1024², one image) is counted by torch's FlopCounterMode over our models built on the meta device (no memory, no
  time);
- the CPU's rate is timed on the same code at real widths and smaller inputs that run in seconds: `layers` Qwen3
  layers of width 2560 over `tokens` tokens; the whole decoder (128-512 channels) from a small latent. `--quick` uses
  smaller inputs still (CI: a few seconds);
- "tiny": the test suite's tiny models (models/tiny.py), timed and reported, not used (overhead-bound).
Predicted seconds = the real size's FLOPs / the rate timed at real widths. Smaller inputs than the real ones make
smaller matrix products, which no CPU runs faster per FLOP: the prediction errs long, the safe side for a variant that
is only a last resort. The rate is this machine's (cores, load, bf16 support): "cpu" and "threads" say which.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode
from vramgraph.models.dtypes import COMPUTE, torch_dtype
from vramgraph.models.qwen3 import Qwen3Encoder
from vramgraph.models.qwen3_config import Qwen3Config
from vramgraph.models.tiny import TINY_QWEN3, TINY_VAE
from vramgraph.models.vae import Flux2VAE
from vramgraph.models.vae_config import VAEConfig

REAL_TOKENS, REAL_SIDE = 512, 1024


def _encoder(cfg: Qwen3Config, layers: int, device: str, dtype: torch.dtype) -> Qwen3Encoder:
    """`layers` layers of `cfg` (no embedding table: the layers are timed from hidden states)."""
    small = dataclasses.replace(cfg, vocab_size=8, output_layers=(layers,))
    with torch.device(device):
        return Qwen3Encoder(small).to(dtype).requires_grad_(False).eval()


def _encode_call(cfg: Qwen3Config, layers: int, tokens: int, device: str, dtype: torch.dtype) -> Callable[[], object]:
    enc = _encoder(cfg, layers, device, dtype)
    x = torch.randn(1, tokens, cfg.hidden_size, device=device, dtype=dtype)
    mask = torch.ones(1, tokens, device=device, dtype=torch.int64)
    return lambda: enc._layers(x, mask, None)


def _decode_call(cfg: VAEConfig, latent: int, device: str, dtype: torch.dtype) -> Callable[[], object]:
    with torch.device(device):
        vae = Flux2VAE(cfg, parts=("decoder",)).to(dtype).requires_grad_(False).eval()
    z = torch.randn(1, cfg.latent_channels, latent, latent, device=device, dtype=dtype)
    return lambda: vae.decode_unpacked(z)


def flops(call: Callable[[], object]) -> int:
    """FLOPs of one call, as torch's FlopCounterMode counts them (matrix products, convolutions, attention)."""
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        call()
    return int(counter.get_total_flops())


def seconds(call: Callable[[], object], repeats: int = 2) -> float:
    """The least wall time of `repeats` calls after one unmeasured call."""
    best = float("inf")
    with torch.inference_mode():
        call()
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t0)
    return best


def timed(name: str, make: Callable[[str], Callable[[], object]]) -> dict:
    work, secs = flops(make("meta")), seconds(make("cpu"))
    return {"at": name, "flops": work, "seconds": round(secs, 4), "gflops_per_s": round(work / secs / 1e9, 2)}


def measure(dtype: torch.dtype, quick: bool) -> dict:
    """Both kinds: the real size's FLOPs, the rates timed, and the predicted seconds."""
    te, vae = Qwen3Config(), VAEConfig()
    layers, tokens, latent = (1, 32, 4) if quick else (2, 64, 8)
    real_te = _encode_call(te, te.n_built, REAL_TOKENS, "meta", dtype)
    real_vae = _decode_call(vae, REAL_SIDE // 8, "meta", dtype)
    text = {"real": f"Qwen3-4B, {te.n_built} layers, {REAL_TOKENS} tokens, one prompt", "real_flops": flops(real_te),
            "timed": timed(f"real widths, {layers} layers, {tokens} tokens",
                           lambda d: _encode_call(te, layers, tokens, d, dtype)),
            "tiny": timed(f"models/tiny.py TINY_QWEN3, {TINY_QWEN3.n_built} layers, 128 tokens",
                          lambda d: _encode_call(TINY_QWEN3, TINY_QWEN3.n_built, 128, d, dtype))}
    decode = {"real": f"FLUX.2 VAE decoder, {REAL_SIDE}x{REAL_SIDE}, one image", "real_flops": flops(real_vae),
              "timed": timed(f"real widths, latent {latent}x{latent} ({latent * 8}x{latent * 8} pixels)",
                             lambda d: _decode_call(vae, latent, d, dtype)),
              "tiny": timed("models/tiny.py TINY_VAE, 256x256", lambda d: _decode_call(TINY_VAE, 32, d, dtype))}
    for kind in (text, decode):
        kind["predicted_seconds"] = round(kind["real_flops"] / (kind["timed"]["gflops_per_s"] * 1e9), 2)
    mpix = REAL_SIDE * REAL_SIDE / 1e6
    return {"text_encode": {**text, "seconds_per_prompt": text["predicted_seconds"]},
            "decode": {**decode, "seconds_per_mpixel": round(decode["predicted_seconds"] / mpix, 2)}}


def _commit() -> str | None:
    """The checkout's commit, if it is a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bf16", choices=sorted(COMPUTE))
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: its own choice)")
    ap.add_argument("--quick", action="store_true", help="smaller timed inputs (CI)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    report = {"env": {"torch": torch.__version__, "python": platform.python_version(),
                      "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "load_average_1min": os.getloadavg()[0], "commit": _commit()},
              "cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": a.dtype, "quick": a.quick,
              **measure(torch_dtype(a.dtype), a.quick)}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("cpu", "threads", "dtype", "seconds")}), json.dumps(
        {k: {"seconds": report[k]["predicted_seconds"], "rate": report[k]["timed"]["gflops_per_s"]}
         for k in ("text_encode", "decode")}))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
