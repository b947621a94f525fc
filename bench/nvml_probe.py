"""Where does device memory outside torch's allocator come from during our heavy ops? (diagnostic)

    python3 bench/nvml_probe.py OUT.json

Polls cudaMemGetInfo every 2 ms in a thread (_common.DevicePoll) while running the VAE decode (1024², 2048²) and a
klein-4B transformer step, with cuDNN on and off, and reports the peak device use minus torch's peak reserved.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from _common import DevicePoll
from vramgraph.models.flux2 import KLEIN_4B, Flux2Transformer
from vramgraph.models.vae import Flux2VAE
from vramgraph.nodes import ops

GiB = 2**30


def probe(name: str, fn) -> dict:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    base_outside = (total - free) - torch.cuda.memory_reserved()
    with DevicePoll(0.002) as p:
        fn()
        torch.cuda.synchronize()
        time.sleep(0.02)
    free, total = torch.cuda.mem_get_info()
    after_outside = (total - free) - torch.cuda.memory_reserved()
    r = {"case": name, "device_peak_gib": round(p.peak / GiB, 3),
         "max_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 3),
         "outside_before_gib": round(base_outside / GiB, 3), "outside_after_gib": round(after_outside / GiB, 3),
         "transient_outside_gib": round((p.peak - torch.cuda.max_memory_reserved() - base_outside) / GiB, 3)}
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    out = []
    with torch.device("cuda"):
        vae = Flux2VAE().to(torch.bfloat16).eval()
    for cudnn in (True, False):
        torch.backends.cudnn.enabled = cudnn
        for side in (1024, 2048):
            lat = torch.randn(1, 128, side // 16, side // 16)
            out.append(probe(f"decode {side} cudnn={cudnn}", lambda lat=lat, m=vae: ops.vae_decode(m, lat, "gpu")))
            out.append(probe(f"decode {side} cudnn={cudnn} 2nd", lambda lat=lat, m=vae: ops.vae_decode(m, lat, "gpu")))
    torch.backends.cudnn.enabled = True
    del vae
    with torch.device("cuda"):
        tr = Flux2Transformer(KLEIN_4B).to(torch.bfloat16).eval()
    from vramgraph.nodes.values import Noise

    emb = torch.randn(1, 512, 7680)
    for side in (1024, 2048):
        lat = torch.zeros(1, 128, side // 16, side // 16)
        nz = Noise(1).generate_noise({"samples": lat})
        out.append(probe(f"sampler step {side}", lambda lat=lat, nz=nz: ops.run_sampler(
            tr, nz, lat, emb, None, 1.0, [1.0, 0.5], [])))
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
