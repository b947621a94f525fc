"""Two GPUs (issue 17's acceptance), on the nvidia-h200-x2 machine: one card against two, same queue, one run.

    python3 bench/two_gpu.py OUT.json [--n 8] [--side 1024]

Random full-size klein-4B checkpoints (as bench/plan_matrix.py writes them). Cases, each warm (every model
read once before, nothing cached, the models where the previous queue of the same case left them):
- 2 images at 1024² on two 12 GiB cards: the model moves after the first load (target 0);
- a queue of N on one 12 GiB card vs on two (target >= 1.3x faster);
- a queue of N on one 24 GiB card vs on two (target >= 1.8x faster);
- every image of the two-card runs bit for bit the one-card image of the same prompt.
With one GPU only the one-card cases run, and the report says the two-card ones were not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from _common import env
from plan_matrix import ROOT, prompt_for, write_models
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.devices import Devices
from vramgraph.graph.engine.executor import Engine
from vramgraph.nodes.files import Folders


def folders(tag: str) -> Folders:
    return Folders(models=(ROOT / "models",), input=ROOT / "input", output=ROOT / f"output-{tag}",
                   temp=ROOT / f"temp-{tag}")


def engine(device: str, card: int, tag: str) -> Engine:
    return Engine(folders(tag), device=device, dtype="bf16", budget=budget_for(device, f"{card}GiB"))


def pixels(paths: list[Path]) -> dict[str, np.ndarray]:
    return {p.name.split("_")[0]: np.asarray(Image.open(p)) for p in paths}


def queue(n: int, side: int, start: int = 0) -> list[dict]:
    out = []
    for i in range(start, start + n):
        p = prompt_for(side, i)
        p["8"]["inputs"]["filename_prefix"] = f"img{i}"
        out.append(p)
    return out


def timed(runner, prompts: list[dict]) -> tuple[float, object]:
    prep, _ = runner.prepare_queue(prompts)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = runner.run(prep)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, result


def one_vs_two(card: int, n: int, side: int, two: bool) -> dict:
    out: dict = {"card_gib": card, "n": n}
    single = engine("cuda:0", card, f"one{card}")
    timed(single, queue(n, side, 1000))  # first loads and kernels: not measured
    secs, res = timed(single, queue(n, side))
    out["one_card"] = {"seconds": round(secs, 3), "loads": res.loads, "unloads": res.unloads}
    want = pixels(res.images)
    if not two:
        out["two_cards"] = "not run: one GPU here"
        return out
    devs = Devices({"cuda:0": engine("cuda:0", card, f"a{card}"), "cuda:1": engine("cuda:1", card, f"b{card}")})
    timed(devs, queue(n, side, 1000))
    secs2, res2 = timed(devs, queue(n, side))
    got = pixels(res2.images)
    out["two_cards"] = {"seconds": round(secs2, 3), "loads": res2.loads, "unloads": res2.unloads,
                        "placement": res2.placement.kind, "predicted_s": round(res2.placement.finish, 3),
                        "same_pictures": sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k])
                                                                              for k in want)}
    out["speedup"] = round(secs / secs2, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--side", type=int, default=1024)
    a = ap.parse_args()
    write_models(ROOT)
    gpus = torch.cuda.device_count()
    report: dict = {"env": env(), "gpus": gpus, "side": a.side}
    if gpus >= 2:
        devs = Devices({"cuda:0": engine("cuda:0", 12, "m0"), "cuda:1": engine("cuda:1", 12, "m1")})
        timed(devs, queue(2, a.side, 2000))  # first load
        _, again = timed(devs, queue(2, a.side, 3000))
        report["two_images_12gib"] = {"loads_after_first": again.loads, "unloads_after_first": again.unloads,
                                      "placement": again.placement.kind}
    report["queue_12gib"] = one_vs_two(12, a.n, a.side, gpus >= 2)
    report["queue_24gib"] = one_vs_two(24, a.n, a.side, gpus >= 2)
    report["targets"] = {"two_images_moves": 0, "queue_12gib_speedup": 1.3, "queue_24gib_speedup": 1.8}
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
