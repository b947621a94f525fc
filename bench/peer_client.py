"""A ComfyUI-API client for the side-by-side runs (bench/peer_compare.sh), and their comparison: the same code
against the real ComfyUI and `vramgraph serve`, following the conventions of the shared peer client
(../shared/tools/comfyui-peer/peer_bench.py): connect the websocket, POST /prompt, take each node's seconds from
the `executing` events (a node runs until the next one starts), wait for /history, fetch the PNG through /view,
sample NVML's used memory every 0.1 s.

    python3 bench/peer_client.py wait --port 8188 [--pid PID] [--timeout 150] [--record ready.json]
                                                         # until the server answers (seconds into --record)

Rules: a job's record says `cold` only when it was the server's first prompt (its /history was empty when the
client started); `sampler_s` is the SamplerCustomAdvanced node's seconds, `step_s` those over the scheduler's
`steps`, `step_s_progress` the time between the sampler's first and last progress events over the steps between
them (without the first step's start-up). A job that fails, is refused or saves no picture has an `error`;
`failed` lists those jobs, and the scripts built on this exit non-zero after writing what they have.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

GiB = 2**30
SAMPLER = "SamplerCustomAdvanced"


class MemSampler(threading.Thread):
    """NVML's used memory of device 0 every `period` seconds (no samples without pynvml: the records say None)."""

    def __init__(self, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period, self.samples, self.stop = period, [], False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle, self.nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:  # no NVML (the CPU check): no samples
            self.nvml = None

    def run(self) -> None:
        while not self.stop and self.nvml is not None:
            self.samples.append((time.time(), self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used))
            time.sleep(self.period)

    def peak(self, t0: float, t1: float) -> int | None:
        return max((u for t, u in self.samples if t0 <= t <= t1), default=None)

    def last(self) -> int | None:
        return self.samples[-1][1] if self.samples else None


def alive(pid: int | None) -> bool:
    """Whether process `pid` runs (True when no pid is given)."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


async def wait_ready(session: Any, base: str, timeout: float, pid: int | None = None) -> float:
    """Seconds until GET /system_stats answers; RuntimeError if the server died or never answered."""
    t0 = time.time()
    while True:
        try:
            async with session.get(base + "/system_stats") as r:
                if r.status == 200:
                    return round(time.time() - t0, 2)
        except aiohttp.ClientError:
            pass
        if not alive(pid):
            raise RuntimeError(f"the server (pid {pid}) exited before answering on {base}")
        if time.time() - t0 > timeout:
            raise RuntimeError(f"no answer from {base} after {timeout} s")
        await asyncio.sleep(0.25)


async def history_empty(session: Any, base: str) -> bool:
    async with session.get(base + "/history") as r:
        return r.status == 200 and not await r.json()


def node_seconds(events: list[tuple[str, Any, float]], types: dict[str, str]) -> dict[str, float]:
    """Each executed node's seconds ("CLASS:ID"), from the `executing` events (node, seconds since POST): a node
    runs until the next one starts; the last until the end event (node None)."""
    starts = [(n, t) for kind, n, t in events if kind == "executing"]
    out = {}
    for (node, t), (_, t_next) in itertools.pairwise(starts):
        if node is not None:
            out[f"{types.get(node, '?')}:{node}"] = round(t_next - t, 4)
    return out


def sampler_steps(events: list[tuple[str, Any, float]], node: str) -> tuple[int | None, float | None]:
    """(the sampler's step count from its progress `max`, seconds per step between its first and last progress)."""
    prog = [(d[1], d[2], t) for kind, d, t in events if kind == "progress" and d[0] == node]
    if not prog:
        return None, None
    (v0, _, t0), (v1, m1, t1) = prog[0], prog[-1]
    return m1, (round((t1 - t0) / (v1 - v0), 5) if v1 > v0 else None)


async def run_prompt(session: Any, base: str, prompt: dict, *, name: str, label: str, png: Path,
                     mem: MemSampler, timeout: float = 300) -> dict:
    """Run one API prompt to its end, its picture saved as `png`; its record (see the module's rules)."""
    types = {k: v["class_type"] for k, v in prompt.items()}
    sampler = next((k for k, v in types.items() if v == SAMPLER), None)
    rec: dict[str, Any] = {"job": name, "label": label}
    cid = str(uuid.uuid4())
    events: list[tuple[str, Any, float]] = []
    async with session.ws_connect(f"{base}/ws?clientId={cid}", max_msg_size=0) as ws:
        t0 = time.time()
        rec["nvml_used_at_post"] = mem.last()
        async with session.post(base + "/prompt", json={"prompt": prompt, "client_id": cid}) as r:
            body = await r.json()
        if "prompt_id" not in body or body.get("node_errors"):
            return {**rec, "error": {"refused": body}}
        pid = body["prompt_id"]
        while time.time() - t0 < timeout:
            try:
                msg = await ws.receive(timeout=max(1.0, timeout - (time.time() - t0)))
            except asyncio.TimeoutError:
                break
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                break
            if msg.type != aiohttp.WSMsgType.TEXT:  # previews come as binary
                continue
            m = json.loads(msg.data)
            typ, data = m.get("type"), m.get("data") or {}
            if data.get("prompt_id") not in (None, pid):
                continue
            t = time.time() - t0
            if typ == "executing":
                events.append(("executing", data.get("node"), t))
                if data.get("node") is None:
                    break
            elif typ == "progress":
                events.append(("progress", (data.get("node"), data.get("value"), data.get("max")), t))
            elif typ in ("execution_error", "execution_interrupted"):
                rec["error"] = {k: data.get(k) for k in ("node_type", "node_id", "exception_message")}
                break
            elif typ == "execution_success":
                events.append(("executing", None, t))
                break
        entry = await _history(session, base, pid, t0 + timeout)
    t1 = time.time()
    rec["wall_s"] = round(t1 - t0, 3)
    rec["node_s"] = node_seconds(events, types)
    rec["sampler_s"] = rec["node_s"].get(f"{SAMPLER}:{sampler}")
    rec["steps"] = next((v["inputs"]["steps"] for v in prompt.values() if isinstance(v["inputs"].get("steps"), int)),
                        None)  # the scheduler's
    rec["progress_max"], rec["step_s_progress"] = sampler_steps(events, sampler) if sampler else (None, None)
    if rec["sampler_s"] is not None and rec["steps"]:
        rec["step_s"] = round(rec["sampler_s"] / rec["steps"], 5)
    rec["nvml_peak_bytes"] = mem.peak(t0, t1)
    rec["status"] = (entry or {}).get("status", {}).get("status_str")
    images = [im for o in (entry or {}).get("outputs", {}).values() for im in o.get("images", [])]
    if images:
        im = images[0]
        async with session.get(base + "/view", params={"filename": im["filename"], "subfolder": im.get("subfolder", ""),
                                                       "type": im.get("type", "output")}) as r:
            png.write_bytes(await r.read())
        rec["png"] = str(png)
    if "error" not in rec and (rec["status"] != "success" or "png" not in rec):
        rec["error"] = {"status": rec["status"], "png": rec.get("png"), "history": entry is not None}
    return rec


async def _history(session: Any, base: str, pid: str, deadline: float) -> dict | None:
    while time.time() < deadline:
        async with session.get(f"{base}/history/{pid}") as r:
            entry = (await r.json()).get(pid)
        if entry and entry.get("status", {}).get("completed") is not None:
            return entry
        await asyncio.sleep(0.05)
    return None


async def run_jobs(kind: str, port: int, label: str, pngs: Path, jobs: list[tuple[str, dict]], *,
                   wait: float = 150, pid: int | None = None, timeout: float = 300) -> dict:
    """Wait for the server, then run `jobs` ((name, API prompt)) one by one, the pictures saved as
    `pngs/<kind>_<label>_<name>.png`; the part's report."""
    base = f"http://127.0.0.1:{port}"
    mem = MemSampler()
    mem.start()
    report: dict[str, Any] = {"label": label, "jobs": [], "failed": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        try:
            report["server_ready_s"] = await wait_ready(s, base, wait, pid)
        except RuntimeError as e:
            report["failed"].append(f"server: {e}")
            return report
        cold = await history_empty(s, base)
        report["nvml_used_idle_bytes"] = mem.last()
        for i, (name, prompt) in enumerate(jobs):
            try:
                rec = await run_prompt(s, base, prompt, name=name, label=label, png=pngs / f"{kind}_{label}_{name}.png",
                                       mem=mem, timeout=timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
                rec = {"job": name, "label": label, "error": {"client": repr(e)}}
            rec["cold"] = cold and i == 0
            report["jobs"].append(rec)
            print(json.dumps({k: rec.get(k) for k in ("job", "cold", "wall_s", "sampler_s", "step_s", "error")}),
                  flush=True)
            if "error" in rec:
                report["failed"].append(f"{name}: {json.dumps(rec['error'])[:300]}")
    mem.stop = True
    report["nvml_peak_overall_bytes"] = max((u for _, u in mem.samples), default=None)
    return report


def write_part(out: Path, kind: str, label: str, report: dict) -> int:
    """Write `out/<kind>_<label>.json`; the exit status: 1 if any job failed (named on stderr), else 0."""
    (out / f"{kind}_{label}.json").write_text(json.dumps(report, indent=1))
    for f in report["failed"]:
        print(f"{kind} {label} FAILED {f}", file=sys.stderr)
    return 1 if report["failed"] else 0


def _ready(folder: Path, label: str) -> float | None:
    """Seconds server `label` took to answer after its start (`wait --record`), None if not recorded."""
    f = folder / f"ready_{label}.json"
    return json.loads(f.read_text())["ready_s"] if f.exists() else None


def _held(folder: Path, label: str) -> int | None:
    """Bytes the card emulation's holder held while server `label` ran (bench/hold_memory.py), None if none."""
    f = folder / f"hold_{label}.json"
    return json.loads(f.read_text())["held_bytes"] if f.exists() else None


def _side(rec: dict, held: int | None) -> dict:
    peak = rec.get("nvml_peak_bytes")
    return {"wall_s": rec.get("wall_s"), "sampler_s": rec.get("sampler_s"), "steps": rec.get("steps"),
            "step_s": rec.get("step_s"), "step_s_progress": rec.get("step_s_progress"), "cold": rec.get("cold"),
            "nvml_peak_gib": round(peak / GiB, 3) if peak else None,
            "nvml_peak_less_holder_gib": round((peak - held) / GiB, 3) if peak and held else None,
            "error": rec.get("error")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def picture(png: str | None) -> dict | None:
    """Mean and standard deviation of a PNG's levels: a flat or black picture (NaNs, saturation) shows as std ~0."""
    if not png or not Path(png).exists():
        return None
    import numpy as np
    from PIL import Image

    x = np.asarray(Image.open(png).convert("RGB"), dtype=np.float64)
    return {"mean": round(float(x.mean()), 2), "std": round(float(x.std()), 2)}


def compare(folder: Path, kind: str) -> dict:
    """ComfyUI's runs against ours, setting by setting (files `<kind>_comfy_<setting>.json` and
    `<kind>_ours_<setting>.json` in `folder`), job by job: both sides, ours / ComfyUI (wall and sampler seconds),
    the mean absolute pixel difference in levels of 255, each picture's spread; `problems` lists what is missing
    or failed (any makes the compare step exit non-zero)."""
    from peer_compare import pixels

    report: dict[str, Any] = {"settings": {}, "problems": []}
    for f in sorted(folder.glob(f"{kind}_ours_*.json")):
        if not (folder / f.name.replace("_ours_", "_comfy_", 1)).exists():
            report["problems"].append(f"{f.stem[len(kind) + 6:]}: ours ran, ComfyUI did not")
    for f in sorted(folder.glob(f"{kind}_comfy_*.json")):
        setting = f.stem[len(kind) + 7:]
        o = folder / f"{kind}_ours_{setting}.json"
        if not o.exists():
            report["problems"].append(f"{setting}: ComfyUI ran, ours did not")
            continue
        rc, ro = json.loads(f.read_text()), json.loads(o.read_text())
        report["problems"] += [f"{setting} ComfyUI: {x}" for x in rc["failed"]]
        report["problems"] += [f"{setting} ours: {x}" for x in ro["failed"]]
        hc, ho = _held(folder, f"comfy_{setting}"), _held(folder, f"ours_{setting}")
        by_o = {r["job"]: r for r in ro["jobs"]}
        rows = {}
        for jc in rc["jobs"]:
            jo = by_o.get(jc["job"], {})
            row = {"comfyui": _side(jc, hc), "ours": _side(jo, ho),
                   "wall_ours_over_comfyui": _ratio(jo.get("wall_s"), jc.get("wall_s")),
                   "sampler_ours_over_comfyui": _ratio(jo.get("sampler_s"), jc.get("sampler_s")),
                   "pixels": pixels(Path(jo.get("png") or "-"), Path(jc.get("png") or "-")),
                   "pictures": {"comfyui": picture(jc.get("png")), "ours": picture(jo.get("png"))}}
            if row["wall_ours_over_comfyui"] is None or row["pixels"] is None:
                report["problems"].append(f"{setting} {jc['job']}: no ratio or no pixel difference (a side failed)")
            rows[jc["job"]] = row
        warm = [r["wall_ours_over_comfyui"] for r in rows.values() if not r["comfyui"]["cold"]]
        cold = [r["wall_ours_over_comfyui"] for r in rows.values() if r["comfyui"]["cold"]]
        report["settings"][setting] = {
            "server_ready_s": {"comfyui": _ready(folder, f"comfy_{setting}"),
                               "ours": _ready(folder, f"ours_{setting}")},
            "held_gib": {"comfyui": round(hc / GiB, 3) if hc else None, "ours": round(ho / GiB, 3) if ho else None},
            "wall_ours_over_comfyui": {"cold": cold[0] if cold else None, "warm": warm}, "jobs": rows}
    return report


def compare_main(kind: str, argv: list[str]) -> None:
    """`compare FOLDER OUT.json`: write `compare(FOLDER, kind)`; exit 1 after writing if it found problems."""
    folder, out = Path(argv[0]), Path(argv[1])
    report = compare(folder, kind)
    out.write_text(json.dumps(report, indent=1))
    for setting, s in report["settings"].items():
        print(kind, setting, "ours/ComfyUI wall", s["wall_ours_over_comfyui"],
              {j: (r["sampler_ours_over_comfyui"], (r["pixels"] or {}).get("mean_abs")) for j, r in s["jobs"].items()})
    if report["problems"]:
        sys.exit(f"{kind} compare FAILED: " + "; ".join(report["problems"]))
    if not report["settings"]:
        sys.exit(f"{kind} compare FAILED: no runs in {folder}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--pid", type=int)
    w.add_argument("--timeout", type=float, default=150)
    w.add_argument("--record", type=Path, help="write {\"ready_s\": seconds} here")
    a = ap.parse_args()

    async def wait() -> float:
        async with aiohttp.ClientSession() as s:
            return await wait_ready(s, f"http://127.0.0.1:{a.port}", a.timeout, a.pid)

    try:
        ready = asyncio.run(wait())
    except RuntimeError as e:
        sys.exit(f"FAILED: {e}")
    print(f"server on port {a.port} answered after {ready} s", flush=True)
    if a.record:
        a.record.write_text(json.dumps({"ready_s": ready}))


if __name__ == "__main__":
    main()
