"""klein-9B from GGUF files through the ComfyUI API: the real ComfyUI with ComfyUI-GGUF (city96) against
`vramgraph serve`, the same files and graph (bench/peer_compare.sh, GGUF=1).

    python3 bench/gguf_step.py --write MODELS --variant klein-9b --types Q4_K     # the files (peer_compare.sh)
    python3 bench/peer_gguf.py run --port 8188 --label comfy_card6 --out LOGS --png PNGS
    python3 bench/peer_gguf.py compare LOGS OUT.json      # $OUT/peer_gguf.json

The graph is the one a ComfyUI-GGUF user runs for klein: `UnetLoaderGGUF` (the transformer .gguf), `CLIPLoaderGGUF`
type flux2 (the Qwen3-8B .gguf), `VAELoader`, and the distilled text-to-image sampling of ComfyUI's core graph
(workflows/core_text_to_image.json: CFGGuider with CFG 1 and a zeroed negative, Flux2Scheduler with 4 steps,
euler) at 1024². Jobs: seed 42 (cold: the server's first prompt), then 43 and 44 (warm). `compare` writes ours /
ComfyUI-GGUF per job (wall and sampler), the cold ratio and the warm ones, and the pixel differences.
`--tiny` (a CPU check against gguf_step's tiny files): 64², 2 steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from peer_client import compare_main, run_jobs, write_part

WORKFLOW = Path(__file__).parents[1] / "workflows" / "core_text_to_image.json"
TRANSFORMER, TEXT_ENCODER = "flux-2-klein-9b-Q4_K.gguf", "Qwen3-8B-Q4_K.gguf"  # gguf_step.write_files' names
TEXTS = {42: "a small fishing boat on white background, watercolor",
         43: "a red bicycle leaning against a brick wall, photograph",
         44: "a lighthouse on a rocky coast at dusk, oil painting"}
SEEDS = (42, 43, 44)  # cold, warm, warm


def graph(text: str, seed: int, side: int, prefix: str, steps: int = 4, transformer: str = TRANSFORMER,
          text_encoder: str = TEXT_ENCODER) -> dict:
    """The distilled klein graph with ComfyUI-GGUF's two loaders in place of UNETLoader and CLIPLoader."""
    g = json.loads(WORKFLOW.read_text())
    g["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": transformer}}
    g["2"] = {"class_type": "CLIPLoaderGGUF", "inputs": {"clip_name": text_encoder, "type": "flux2"}}
    g["4"]["inputs"]["text"] = text
    g["8"]["inputs"].update(steps=steps, width=side, height=side)
    g["9"]["inputs"]["noise_seed"] = seed
    g["10"]["inputs"].update(width=side, height=side)
    g["13"]["inputs"]["filename_prefix"] = prefix
    return g


def main() -> None:
    if sys.argv[1:2] == ["compare"]:
        compare_main("gguf", sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--label", required=True, help="comfy_SETTING or ours_SETTING")
    r.add_argument("--out", type=Path, required=True, help="folder of the JSON report")
    r.add_argument("--png", type=Path, required=True, help="folder of the pictures")
    r.add_argument("--side", type=int, default=1024)
    r.add_argument("--transformer", default=TRANSFORMER, help="the transformer .gguf in diffusion_models/")
    r.add_argument("--text-encoder", default=TEXT_ENCODER, help="the Qwen3 .gguf in text_encoders/")
    r.add_argument("--wait", type=float, default=150, help="seconds the server may take to answer")
    r.add_argument("--pid", type=int, help="the server's pid: stop waiting if it exits")
    r.add_argument("--tiny", action="store_true", help="gguf_step's tiny files on the CPU: 64², 2 steps")
    sub.add_parser("compare", help="compare LOGS OUT.json")
    a = ap.parse_args()
    a.png.mkdir(parents=True, exist_ok=True)
    side, steps = (64, 2) if a.tiny else (a.side, 4)
    jobs = [(f"{side}_s{s}", graph(TEXTS[s], s, side, f"{a.label}_gguf_s{s}", steps, a.transformer, a.text_encoder))
            for s in SEEDS]
    report = asyncio.run(run_jobs("gguf", a.port, a.label, a.png, jobs, wait=a.wait, pid=a.pid, timeout=400))
    report["files"] = {"transformer": a.transformer, "text_encoder": a.text_encoder}
    sys.exit(write_part(a.out, "gguf", a.label, report))


if __name__ == "__main__":
    main()
