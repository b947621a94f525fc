"""The first model load of a fresh process against the second, phase by phase.

    python3 bench/first_load.py MODELS_DIR [pinned|cuda ...]

MODELS_DIR is a ComfyUI `models/` folder (shared/tools/make_checkpoints.py --comfy-only). Loads the text
encoder once per argument (default: pinned pinned cuda cuda) and prints each load's seconds with the
time spent in models/common.py's phases. Before the text encoder's embedding skipped its random init on
the meta device, the first load took 5.66 s against 1.46 s for the second (pinned) and 4.34 s against
0.84 s (cuda) on the H200 host: the difference lay outside every phase (torch importing its compiler).
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import torch
from vramgraph.models import common, loading

PHASES = ("_arena", "_read_spans", "pin_pages", "_host_weights", "_device_weights")


def main() -> None:
    models = Path(sys.argv[1])
    spent: collections.Counter = collections.Counter()
    for name in PHASES:
        fn = getattr(common, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(common, name, timed)
    spec = loading.inspect(models / "text_encoders" / "qwen_3_4b.safetensors").component("text_encoder")
    torch.zeros(1, device="cuda")
    for dev in sys.argv[2:] or ["pinned", "pinned", "cuda", "cuda"]:
        spent.clear()
        t0 = time.perf_counter()
        m = loading.load(spec, device=dev)
        torch.cuda.synchronize()
        print(dev, round(time.perf_counter() - t0, 2), {k: round(v, 2) for k, v in spent.items()}, flush=True)
        del m


if __name__ == "__main__":
    main()
