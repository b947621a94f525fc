"""Peak host memory while loading the real-size klein-4B transformer from a BFL single file.

Writes a bf16 file with the real shapes and key names (with the `model.diffusion_model.` prefix, as
some BFL/ComfyUI files have), then loads it in fresh processes, onto the GPU and onto the CPU, and
reports each process's peak RSS (ru_maxrss) as a ratio to the file size.

    python bench/load_rss.py OUT.json [--dir /tmp/rss]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LOADER = r"""
import json, resource, sys, time, torch
from vramgraph.models import loading
path, device = sys.argv[1], sys.argv[2]
if device == "cuda":
    torch.zeros(1, device="cuda")  # the CUDA context is not part of loading
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
spec = loading.inspect(path)
model = loading.load(spec.component("transformer"), dtype=torch.bfloat16, device=device)
checksum = sum(float(p.float().sum()) for p in model.parameters())  # touch every weight
if device == "cuda":
    torch.cuda.synchronize()
print(json.dumps({"device": device, "seconds": time.perf_counter() - t0,
                  "rss_before_bytes": base,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "variant": spec.variant, "params": spec.transformer.params, "checksum_finite": checksum == checksum}))
"""


def write_file(path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from vramgraph.models import flux2

    with torch.device("meta"):
        model = flux2.Flux2Transformer(flux2.KLEIN_4B)
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {"model.diffusion_model." + n: (0.02 * torch.randn(p.shape, generator=g, device="cuda")).bfloat16().cpu()
          for n, p in model.named_parameters()}
    save_file(sd, str(path))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dir", default="/tmp/rss")
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "flux-2-klein-4b.safetensors"
    t0 = time.perf_counter()
    if not path.exists():
        subprocess.run([sys.executable, __file__, "--write", str(path)], check=True)
    write_s = time.perf_counter() - t0
    size = path.stat().st_size
    runs = []
    for device in ("cuda", "cpu"):
        r = subprocess.run([sys.executable, "-c", LOADER, str(path), device], check=True, capture_output=True,
                           text=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["peak_rss_over_file"] = res["peak_rss_bytes"] / size
        runs.append(res)
    report = {"file_bytes": size, "write_s": write_s, "runs": runs, "limit": 1.25,
              "pass": all(r["peak_rss_over_file"] <= 1.25 for r in runs)}
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        write_file(Path(sys.argv[2]))
    else:
        main()
