"""Same picture as ComfyUI per sampler/scheduler pair: a ComfyUI-API client that runs ComfyUI's core FLUX.2-klein
graph with KSampler for every pair, on any server that speaks the API (ComfyUI, `vramgraph serve`), and a
comparison of two such runs.

    python3 bench/peer_samplers.py run --port 8188 --label comfy --out DIR [--side 512] [--steps 6]
    python3 bench/peer_samplers.py compare DIR comfy ours OUT.json

`run` writes DIR/{label}_{sampler}_{scheduler}.png and DIR/samplers_{label}.json (status and seconds per pair);
`compare` writes, per pair, the mean absolute pixel difference (0..255), its maximum and PSNR.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from pathlib import Path

WORKFLOW = Path(__file__).parents[1] / "workflows" / "core_text_to_image.json"
SAMPLERS = ["euler", "euler_ancestral", "heun", "dpmpp_sde", "dpmpp_2m", "dpmpp_2m_sde", "lcm"]
SCHEDULERS = ["simple", "sgm_uniform", "karras", "exponential", "beta", "normal"]
TEXT = "a lighthouse on a rocky coast at dusk, oil painting"
SEED = 42


def pairs() -> list[tuple[str, str]]:
    return [(a, b) for a in SAMPLERS for b in SCHEDULERS]


def ksampler_graph(sampler: str, scheduler: str, side: int, steps: int, prefix: str) -> dict:
    """workflows/core_text_to_image.json with ComfyUI's KSampler (cfg 1, the zeroed negative) in place of the
    custom-sampling nodes."""
    g = json.loads(WORKFLOW.read_text())
    for n in ("6", "7", "8", "9", "11"):
        del g[n]
    g["4"]["inputs"]["text"] = TEXT
    g["10"]["inputs"].update(width=side, height=side)
    g["20"] = {"class_type": "KSampler", "inputs": {
        "model": ["1", 0], "seed": SEED, "steps": steps, "cfg": 1.0, "sampler_name": sampler,
        "scheduler": scheduler, "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["10", 0],
        "denoise": 1.0}}
    g["12"]["inputs"]["samples"] = ["20", 0]
    g["13"]["inputs"]["filename_prefix"] = prefix
    return g


async def run(port: int, label: str, out: Path, side: int, steps: int) -> dict:
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    rows = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        for sampler, scheduler in pairs():
            key = f"{sampler}_{scheduler}"
            body = {"prompt": ksampler_graph(sampler, scheduler, side, steps, f"samplers_{label}_{key}"),
                    "client_id": str(uuid.uuid4())}
            t0 = time.time()
            async with s.post(base + "/prompt", json=body) as r:
                answer = await r.json()
            if "prompt_id" not in answer:
                rows[key] = {"status": "refused", "error": answer}
                continue
            pid, entry = answer["prompt_id"], None
            while time.time() - t0 < 300:
                async with s.get(f"{base}/history/{pid}") as r:
                    entry = (await r.json()).get(pid)
                if entry and entry.get("status", {}).get("completed") is not None:
                    break
                await asyncio.sleep(0.05)
            seconds = round(time.time() - t0, 3)
            images = [im for o in (entry or {}).get("outputs", {}).values() for im in o.get("images", [])]
            if not images:
                rows[key] = {"status": (entry or {}).get("status", {}).get("status_str", "timeout"), "s": seconds}
                continue
            im = images[0]
            async with s.get(base + "/view", params={"filename": im["filename"], "subfolder": im.get("subfolder", ""),
                                                     "type": im.get("type", "output")}) as r:
                (out / f"{label}_{key}.png").write_bytes(await r.read())
            rows[key] = {"status": "success", "s": seconds}
    return {"label": label, "side": side, "steps": steps, "seed": SEED, "pairs": rows}


def compare(folder: Path, a: str, b: str) -> dict:
    import numpy as np
    from PIL import Image

    rows = {}
    for sampler, scheduler in pairs():
        key = f"{sampler}_{scheduler}"
        pa, pb = folder / f"{a}_{key}.png", folder / f"{b}_{key}.png"
        if not (pa.exists() and pb.exists()):
            rows[key] = None
            continue
        x = np.asarray(Image.open(pa).convert("RGB"), dtype=np.float64)
        y = np.asarray(Image.open(pb).convert("RGB"), dtype=np.float64)
        d = np.abs(x - y)
        mse = float((d ** 2).mean())
        rows[key] = {"mean_abs": round(float(d.mean()), 4), "max": int(d.max()),
                     "psnr_db": round(10 * math.log10(255 ** 2 / mse), 2) if mse > 0 else None}
    done = [r["mean_abs"] for r in rows.values() if r]
    return {"a": a, "b": b, "pairs": rows, "compared": len(done), "of": len(rows),
            "worst_mean_abs": max(done) if done else None, "within_2_of_255": sum(v <= 2 for v in done)}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--port", type=int, default=8188)
    r.add_argument("--label", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--side", type=int, default=512)
    r.add_argument("--steps", type=int, default=6)
    c = sub.add_parser("compare")
    c.add_argument("folder")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("out")
    args = ap.parse_args()
    if args.cmd == "run":
        out = Path(args.out)
        res = asyncio.run(run(args.port, args.label, out, args.side, args.steps))
        (out / f"samplers_{args.label}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v["status"] for k, v in res["pairs"].items() if v["status"] != "success"}), flush=True)
    else:
        res = compare(Path(args.folder), args.a, args.b)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(json.dumps({k: res[k] for k in ("compared", "of", "worst_mean_abs", "within_2_of_255")}))
        sys.exit(0)


if __name__ == "__main__":
    main()
