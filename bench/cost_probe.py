"""The cost probe the engine runs at start on a CUDA device (graph/engine/costs.py), printed as JSON.

    python3 bench/cost_probe.py [OUT.json]

Run it once on the H200 and set graph/engine/costs.py's H200_MATMUL_FLOPS to the `matmul_flops` it prints, so that the
probe gives compute = 1.0 there (the node estimates' seconds are the H200's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from vramgraph.graph.engine import costs


def main() -> None:
    cm = costs.probe("cuda")
    out = {"gpu": torch.cuda.get_device_name(0), "h2d_pinned_GBps": round(cm.h2d_pinned / 1e9, 2),
           "compute_vs_h200": round(cm.compute, 4), "matmul_flops": costs.H200_MATMUL_FLOPS / cm.compute,
           "assumed_h200_matmul_flops": costs.H200_MATMUL_FLOPS, "name": cm.name}
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
