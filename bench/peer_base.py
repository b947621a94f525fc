"""Base-model jobs through the ComfyUI API, on ComfyUI and `vramgraph serve` alike (bench/peer_compare.sh, BASE=1):
where the sampler step is the job.

    python3 bench/peer_base.py run --port 8188 --label comfy_card12 --out LOGS --png PNGS [--jobs 1024_s42,...]
    python3 bench/peer_base.py compare LOGS OUT.json       # $OUT/peer_base.json

The graph is ComfyUI's own FLUX.2 [klein] base template (`image_flux2_klein_text_to_image`, flattened): core
nodes, Flux2Scheduler with 20 steps, CFGGuider with CFG 5 and a real negative prompt (CLIPTextEncode of ""), euler;
so each step runs the transformer twice. The transformer file is the harness's random-weight klein-4B
(`flux-2-klein-4b.safetensors`): base and distilled klein have the same shapes, so the seconds are the base
model's. Same seeds and prompts on both servers; the first job of a server that has run nothing yet is its cold
job, the others warm (the record says which). `compare` gives, per setting and job, ours / ComfyUI (wall and
sampler seconds), both sides' seconds per step (the sampler node's seconds / 20, and from its progress events) for
`comfyui_step_s` in bench/results/step.json, and the mean absolute pixel difference in levels of 255.
`--tiny` (a CPU check against tiny models): sides / 16, 2 steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from peer_client import compare_main, run_jobs, write_part

WORKFLOW = Path(__file__).parents[1] / "workflows" / "core_text_to_image.json"
TEXTS = {42: "a small fishing boat on white background, watercolor",
         43: "a red bicycle leaning against a brick wall, photograph",
         44: "a lighthouse on a rocky coast at dusk, oil painting"}
JOBS = {f"{side}_s{seed}": (side, seed) for side in (1024, 2048) for seed in TEXTS}
DEFAULT_JOBS = "1024_s42,1024_s43,2048_s42"  # cold 1024², warm 1024², warm 2048²
STEPS, CFG = 20, 5.0  # the template's


def graph(text: str, seed: int, side: int, prefix: str, steps: int = STEPS, cfg: float = CFG) -> dict:
    """ComfyUI's base text-to-image graph (its template's nodes and values) at `side`², as an API prompt."""
    g = json.loads(WORKFLOW.read_text())
    g["4"]["inputs"]["text"] = text
    g["5"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["2", 0]}}  # the template's negative
    g["6"]["inputs"]["cfg"] = cfg
    g["8"]["inputs"].update(steps=steps, width=side, height=side)
    g["9"]["inputs"]["noise_seed"] = seed
    g["10"]["inputs"].update(width=side, height=side)
    g["13"]["inputs"]["filename_prefix"] = prefix
    return g


def jobs(names: str, label: str, tiny: bool = False) -> list[tuple[str, dict]]:
    out = []
    for name in names.split(","):
        if name not in JOBS:
            sys.exit(f"peer_base: unknown job {name!r}; jobs: {', '.join(JOBS)}")
        side, seed = JOBS[name]
        out.append((name, graph(TEXTS[seed], seed, side // 16 if tiny else side, f"{label}_base_{name}",
                                steps=2 if tiny else STEPS)))
    return out


def main() -> None:
    if sys.argv[1:2] == ["compare"]:
        compare_main("base", sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--label", required=True, help="comfy_SETTING or ours_SETTING")
    r.add_argument("--out", type=Path, required=True, help="folder of the JSON report")
    r.add_argument("--png", type=Path, required=True, help="folder of the pictures")
    r.add_argument("--jobs", default=DEFAULT_JOBS)
    r.add_argument("--wait", type=float, default=150, help="seconds the server may take to answer")
    r.add_argument("--pid", type=int, help="the server's pid: stop waiting if it exits")
    r.add_argument("--tiny", action="store_true", help="tiny models on the CPU: sides / 16, 2 steps")
    sub.add_parser("compare", help="compare LOGS OUT.json")
    a = ap.parse_args()
    a.png.mkdir(parents=True, exist_ok=True)
    todo = jobs(a.jobs, a.label, a.tiny)
    report = asyncio.run(run_jobs("base", a.port, a.label, a.png, todo, wait=a.wait, pid=a.pid))
    report["graph"] = {"steps": 2 if a.tiny else STEPS, "cfg": CFG, "negative": "CLIPTextEncode ''"}
    sys.exit(write_part(a.out, "base", a.label, report))


if __name__ == "__main__":
    main()
