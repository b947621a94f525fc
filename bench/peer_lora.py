"""LoRAs through the ComfyUI API, the same files on ComfyUI and `vramgraph serve` (bench/peer_compare.sh, LORAS=1).

    python3 bench/peer_lora.py files MODELS_DIR          # random full-size LoRAs into MODELS_DIR/loras
    python3 bench/peer_lora.py run --port 8188 --label comfy_cap12 --out DIR
    python3 bench/peer_lora.py compare DIR comfy ours OUT.json

`files` writes two klein-4B LoRAs in two key styles: rank 16 in BFL/ai-toolkit keys with a kohya text encoder part,
and rank 64 in diffusers/PEFT keys (q/k/v split), models/lora_make.py's random adapters. `run` posts ComfyUI's core
text-to-image graph at 1024² with both stacked (LoraLoader 0.8/0.5, then LoraLoaderModelOnly 0.6), a cold job and
two warm ones, and the same warm jobs without LoRAs; it saves the PNGs (via /view) and the seconds each took until
it was in /history. `compare` gives, per job, the mean absolute pixel difference of ours against ComfyUI's and the
time ratios the issue asks for (ours / ComfyUI with LoRAs; ours with LoRAs / ours without).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

WORKFLOW = Path(__file__).parents[1] / "workflows" / "core_text_to_image.json"
FILES = {"r16_bfl.safetensors": ("bfl", 16, True), "r64_diffusers.safetensors": ("diffusers", 64, False)}
JOBS = [("lora_s42", 42, True), ("lora_s43", 43, True), ("lora_s44", 44, True),  # cold, then warm
        ("plain_s43", 43, False), ("plain_s44", 44, False)]
TEXT = "a small fishing boat on white background, watercolor"


def write_files(models: Path, tiny: bool = False) -> list[Path]:
    """The LoRA files for klein-4B (or, `tiny`, for models/tiny.py's models: a CPU check of this script)."""
    from vramgraph.models import flux2_config, qwen3_config
    from vramgraph.models import tiny as tiny_models
    from vramgraph.models.lora_make import text_encoder_modules, transformer_modules, write_lora

    tr = tiny_models.TINY_TRANSFORMER if tiny else flux2_config.KLEIN_4B
    te_cfg = tiny_models.TINY_QWEN3 if tiny else qwen3_config.Qwen3Config()
    out = []
    for name, (style, rank, te) in FILES.items():
        mods = transformer_modules(tr, style)
        if te:
            mods += text_encoder_modules(te_cfg, "kohya_te")
        out.append(write_lora(models / "loras" / name, mods, rank=rank, alpha=rank / 2, seed=rank, scale=0.02))
    return out


def graph(seed: int, lora: bool, prefix: str, side: int = 1024) -> dict:
    g = json.loads(WORKFLOW.read_text())
    g["4"]["inputs"]["text"] = TEXT
    g["9"]["inputs"]["noise_seed"] = seed
    g["8"]["inputs"].update(width=side, height=side)
    g["10"]["inputs"].update(width=side, height=side)
    g["13"]["inputs"]["filename_prefix"] = prefix
    if lora:
        g["20"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["2", 0],
                                                          "lora_name": "r16_bfl.safetensors", "strength_model": 0.8,
                                                          "strength_clip": 0.5}}
        g["21"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["20", 0],
                                                                   "lora_name": "r64_diffusers.safetensors",
                                                                   "strength_model": 0.6}}
        g["6"]["inputs"]["model"] = ["21", 0]
        g["4"]["inputs"]["clip"] = ["20", 1]
    return g


async def run(port: int, label: str, out: Path, wait: float = 150, side: int = 1024) -> dict:
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    results = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        t_up = time.time()
        while True:  # the server is starting
            try:
                async with s.get(base + "/system_stats") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.time() - t_up > wait:
                raise RuntimeError(f"no server on port {port} after {wait} s")
            await asyncio.sleep(1)
        for name, seed, lora in JOBS:
            body = {"prompt": graph(seed, lora, f"{label}_{name}", side), "client_id": str(uuid.uuid4())}
            t0 = time.time()
            async with s.post(base + "/prompt", json=body) as r:
                answer = await r.json()
            if "prompt_id" not in answer:
                results[name] = {"error": answer}
                continue
            pid = answer["prompt_id"]
            entry: dict = {}
            while time.time() - t0 < 600:
                async with s.get(f"{base}/history/{pid}") as r:
                    entry = (await r.json()).get(pid, {})
                if entry.get("status", {}).get("completed") is not None:
                    break
                await asyncio.sleep(0.02)
            seconds = time.time() - t0
            images = [im for o in entry.get("outputs", {}).values() for im in o.get("images", [])]
            png = None
            if images:
                im = images[0]
                async with s.get(base + "/view", params={"filename": im["filename"], "subfolder": im["subfolder"],
                                                         "type": im["type"]}) as r:
                    png = out / f"{label}_{name}.png"
                    png.write_bytes(await r.read())
            results[name] = {"seconds": round(seconds, 3), "status": entry.get("status", {}).get("status_str"),
                             "png": str(png) if png else None}
            print(label, name, results[name], flush=True)
    return results


def compare(folder: Path, comfy: str, ours: str) -> dict:
    import numpy as np
    from PIL import Image

    out: dict = {"settings": {}}
    labels = sorted({p.name.split("_lora_")[0].split("_plain_")[0] for p in folder.glob("*.png")})
    for lab in [x for x in labels if x.startswith(comfy)]:
        setting = lab.removeprefix(comfy)
        mine = ours + setting
        res_c = json.loads((folder / f"lora_{lab}.json").read_text())
        res_o = json.loads((folder / f"lora_{mine}.json").read_text())
        rows = {}
        for name, _, lora in JOBS:
            a, b = folder / f"{lab}_{name}.png", folder / f"{mine}_{name}.png"
            row: dict = {"comfy_s": res_c.get(name, {}).get("seconds"), "ours_s": res_o.get(name, {}).get("seconds")}
            if a.exists() and b.exists():
                x = np.asarray(Image.open(a).convert("RGB"), dtype=np.float64)
                y = np.asarray(Image.open(b).convert("RGB"), dtype=np.float64)
                row["mean_abs_diff_255"] = round(float(np.abs(x - y).mean()), 3)
            if lora and row["comfy_s"] and row["ours_s"]:
                row["ours_over_comfy"] = round(row["ours_s"] / row["comfy_s"], 3)
            plain = res_o.get(name.replace("lora_", "plain_"), {}).get("seconds")
            if lora and plain and row["ours_s"]:
                row["ours_lora_over_plain"] = round(row["ours_s"] / plain, 3)
            rows[name] = row
        out["settings"][setting.strip("_") or "default"] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("files")
    f.add_argument("models")
    f.add_argument("--tiny", action="store_true", help="for models/tiny.py's models (a CPU check of this script)")
    r = sub.add_parser("run")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--label", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--wait", type=float, default=150)
    r.add_argument("--side", type=int, default=1024)
    c = sub.add_parser("compare")
    c.add_argument("folder")
    c.add_argument("comfy")
    c.add_argument("ours")
    c.add_argument("out")
    a = ap.parse_args()
    if a.cmd == "files":
        for p in write_files(Path(a.models), a.tiny):
            print(p, p.stat().st_size)
    elif a.cmd == "run":
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        res = asyncio.run(run(a.port, a.label, out, a.wait, a.side))
        (out / f"lora_{a.label}.json").write_text(json.dumps(res, indent=1))
    else:
        Path(a.out).write_text(json.dumps(compare(Path(a.folder), a.comfy, a.ours), indent=1))


if __name__ == "__main__":
    main()
