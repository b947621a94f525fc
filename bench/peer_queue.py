"""ComfyUI-API client for the queue job: POST N prompts of ComfyUI's core FLUX.2-klein graph at once and time
them until the last one is in /history. Works unchanged against ComfyUI and `vramgraph serve`.

    python3 bench/peer_queue.py --port 8188 --label comfy_cap12 --out DIR [--n 8] [--side 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

import aiohttp

PROMPTS = ["a small fishing boat on white background, watercolor", "a red bicycle leaning against a brick wall",
           "a lighthouse on a rocky coast at dusk, oil painting", "a bowl of ramen, studio photograph",
           "a snowy mountain village at night", "a robot reading a newspaper in a cafe",
           "a field of sunflowers under a storm sky", "a cat sleeping on a pile of books"]


WORKFLOW = Path(__file__).parents[1] / "workflows" / "core_text_to_image.json"


def comfy_graph(text: str, seed: int, w: int, h: int, prefix: str) -> dict:
    """ComfyUI's text-to-image graph for FLUX.2 [klein] distilled, core node types only (workflows/)."""
    g = json.loads(WORKFLOW.read_text())
    g["4"]["inputs"]["text"] = text
    g["9"]["inputs"]["noise_seed"] = seed
    g["8"]["inputs"].update(width=w, height=h)
    g["10"]["inputs"].update(width=w, height=h)
    g["13"]["inputs"]["filename_prefix"] = prefix
    return g


async def run(port: int, label: str, n: int, side: int, out: Path) -> dict:
    base = f"http://127.0.0.1:{port}"
    cid = str(uuid.uuid4())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        ids = []
        t0 = time.time()
        for i in range(n):
            body = {"prompt": comfy_graph(PROMPTS[i % len(PROMPTS)] + f", take {i}", 1000 + i, side, side,
                                          f"{label}_queue{i}"), "client_id": cid}
            async with s.post(base + "/prompt", json=body) as r:
                ids.append((await r.json())["prompt_id"])
        t_posted = time.time() - t0
        done: dict[str, float] = {}
        status: dict[str, str] = {}
        while len(done) < n and time.time() - t0 < 600:
            async with s.get(base + "/history") as r:
                hist = await r.json()
            for pid in ids:
                st = hist.get(pid, {}).get("status", {})
                if pid not in done and st.get("completed") is not None and st.get("status_str") in ("success",
                                                                                                   "error"):
                    done[pid], status[pid] = time.time() - t0, st["status_str"]
            await asyncio.sleep(0.05)
        async with s.get(base + "/peer/mem") as r:
            mem = await r.json() if r.status == 200 else {"status": r.status}
    return {"label": label, "n": n, "side": side, "posted_s": round(t_posted, 3),
            "total_s": round(max(done.values()), 3) if len(done) == n else None,
            "completed": [round(done[p], 3) for p in ids if p in done], "status": [status.get(p) for p in ids],
            "mem_after": mem}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8188)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--side", type=int, default=1024)
    a = ap.parse_args()
    out = Path(a.out)
    res = asyncio.run(run(a.port, a.label, a.n, a.side, out))
    (out / f"queue_{a.label}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "mem_after"}), flush=True)


if __name__ == "__main__":
    main()
