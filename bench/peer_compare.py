"""Summarise a side-by-side run (bench/peer_compare.sh): ours / ComfyUI per job and setting, memory, pixels.

    python3 bench/peer_compare.py LOGS_DIR PNG_DIR OUT.json

The shared client's first job (1024_s42) is "cold 1024²" only where it was the server's first prompt; where other
parts ran before it on that server (`order_<label>.txt`, written by peer_compare.sh), it is named after them. A
setting whose runs failed (a server that never answered, a job with an error, a side missing) is listed under
`problems`, and the script exits 1 after writing the report.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
from PIL import Image

GiB = 2**30
NAMES = {"1024_s42": "cold 1024²", "1024_s43": "warm 1024² (1)", "1024_s44": "warm 1024² (2)",
         "512_s42": "warm 512²", "2048_s42": "2048²"}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def pixels(a: Path, b: Path) -> dict | None:
    if not (a.exists() and b.exists()):
        return None
    x = np.asarray(Image.open(a).convert("RGB"), dtype=np.float64)
    y = np.asarray(Image.open(b).convert("RGB"), dtype=np.float64)
    if x.shape != y.shape:
        return {"error": f"sizes differ: {x.shape} vs {y.shape}"}
    d = np.abs(x - y)
    mse = float((d**2).mean())
    return {"mean_abs": round(float(d.mean()), 4), "max": int(d.max()),
            "psnr_db": round(10 * math.log10(255**2 / mse), 2) if mse > 0 else None,
            "identical_pixels": round(float((d.max(axis=2) == 0).mean()), 4)}


def setting_order(setting: str) -> tuple:
    """capN and cardN from the largest card down, uncapped last."""
    m = re.fullmatch(r"(cap|card)(\d+)", setting)
    return (setting == "uncapped", -int(m[2]) if m else 0, setting)


def job_name(job: str, logs: Path, setting: str) -> str:
    before = [p for label in ("comfy", "ours") if (f := logs / f"order_{label}_{setting}.txt").exists()
              for p in f.read_text().split()]
    if job == "1024_s42" and before and before[0] != "bench":
        return f"1024² after {'+'.join(sorted(set(before) - {'bench'}))} (not cold)"
    return NAMES.get(job, job)


def problems_of(setting: str, side: str, res: dict | None) -> list[str]:
    if res is None:
        return [f"{setting}: no results of {side}"]
    out = [f"{setting} {side}: {res['error']}"] if res.get("error") else []
    return out + [f"{setting} {side} {r.get('job')}: {str(r['error'])[:300]}" for r in res.get("jobs", [])
                  if r.get("error")]


def job_row(rec: dict) -> dict:
    mem = rec.get("mem_after") or {}
    return {"wall_s": rec.get("wall_s"), "server_exec_s": rec.get("server_exec_s"),
            "node_s": rec.get("node_durations"), "error": rec.get("error"),
            "nvml_peak_gib": round(rec["dev_used_max_during"] / GiB, 3) if rec.get("dev_used_max_during") else None,
            "torch_max_allocated_gib": round(mem["max_allocated"] / GiB, 3) if "max_allocated" in mem else None,
            "loaded_after": mem.get("loaded_models")}


def main() -> None:
    logs, pngs, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    report: dict = {"settings": {}, "problems": []}
    found = {f.name.split("_", 2)[2][:-5] for f in logs.glob("results_*_*.json")}
    for setting in sorted(found, key=setting_order):
        comfy, ours = _load(logs / f"results_comfy_{setting}.json"), _load(logs / f"results_ours_{setting}.json")
        report["problems"] += problems_of(setting, "ComfyUI", comfy) + problems_of(setting, "ours", ours)
        if comfy is None or ours is None:
            continue
        rows = {}
        by_c = {r["job"]: r for r in comfy["jobs"]}
        by_o = {r["job"]: r for r in ours["jobs"]}
        for job in by_c:
            c, o = job_row(by_c[job]), job_row(by_o.get(job, {}))
            rows[job_name(job, logs, setting)] = {
                "comfyui": c, "ours": o,
                "ours_over_comfyui": round(o["wall_s"] / c["wall_s"], 3) if c["wall_s"] and o["wall_s"] else None,
                "pixels": pixels(pngs / f"ours_{setting}_{job}.png", pngs / f"comfy_{setting}_{job}.png")}
        qc, qo = _load(logs / f"queue_comfy_{setting}.json"), _load(logs / f"queue_ours_{setting}.json")
        queue = None
        if qc and qo:
            queue = {"comfyui_s": qc["total_s"], "ours_s": qo["total_s"],
                     "ours_over_comfyui": round(qo["total_s"] / qc["total_s"], 3) if qc["total_s"] and qo["total_s"]
                     else None, "comfyui_status": qc["status"], "ours_status": qo["status"]}
        report["settings"][setting] = {
            "jobs": rows, "queue_of_8_1024": queue,
            "nvml_peak_overall_gib": {"comfyui": round((comfy.get("dev_used_max_overall") or 0) / GiB, 3),
                                      "ours": round((ours.get("dev_used_max_overall") or 0) / GiB, 3)},
            "server_ready_s": {"comfyui": comfy.get("server_ready_after_s"), "ours": ours.get("server_ready_after_s")}}
    sets = report["settings"]
    for setting, s in sets.items():  # ours on a small card against ours uncapped, job by job
        if setting == "uncapped" or "uncapped" not in sets:
            continue
        report[f"ours_{setting}_over_ours_uncapped"] = {
            job: round(r["ours"]["wall_s"] / sets["uncapped"]["jobs"][job]["ours"]["wall_s"], 3)
            for job, r in s["jobs"].items()
            if r["ours"]["wall_s"] and (sets["uncapped"]["jobs"].get(job) or {}).get("ours", {}).get("wall_s")}
    pack = _load(logs / "pack_check.json")
    if pack is not None:
        report["comfyui_pack_check"] = {"vg_nodes": len(pack["vg_nodes"]),
                                        "categories": sorted({v["category"] for v in pack["vg_nodes"].values()}),
                                        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                                                 for k, v in pack["runs"].items()}}
    out.write_text(json.dumps(report, indent=1))
    for setting, s in report["settings"].items():
        print(setting, {k: (v["ours_over_comfyui"], (v["pixels"] or {}).get("mean_abs")) for k, v in s["jobs"].items()},
              "queue", (s["queue_of_8_1024"] or {}).get("ours_over_comfyui"), "nvml", s["nvml_peak_overall_gib"])
    if report["problems"]:
        sys.exit("peer_compare FAILED: " + "; ".join(report["problems"]))


if __name__ == "__main__":
    main()
