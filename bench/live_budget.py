"""The live budget on the H200 (issue 15, items 1, 2 and 5): another process takes GPU memory between prompts and
during a prompt, and an interrupt during a 2048² VAE decode.

    python3 bench/live_budget.py OUT.json [--leave 1,3,9] [--sides 1024,2048]

Same random klein-4B checkpoints and Engine as bench/plan_matrix.py, at the engine's default budget (the device's
free memory at start, as `vramgraph serve` runs). A second process (a child that allocates with torch and holds it,
told by a line on its stdin) takes all but LEAVE GiB of what is free:

- "between": before the prompt, with the engine's models resident from the prompt before;
- "cold": before the prompt, with every model unloaded to pinned host RAM (nothing of ours on the GPU);
- "during": when the sampler (node 6) starts, so that its activation, the decode's or a load finds less than planned.

Each case runs the shipped text-to-image workflow at 1024² and 2048²; it must succeed wherever a plan exists, else
fail with the live-budget message ("other processes hold ..."), never with "estimate is wrong"; a success writes one
whole PNG, a failure none. Memory is then returned, and after a failure the next prompt must succeed.

Interrupts: the decoder's resnet blocks are timed with CUDA events on a 2048² decode, and the stretches between its
interrupt checks with the host clock (the checks wait for the GPU); then decodes are interrupted
from a timer thread at a quarter, half and three quarters of the decode, through the decode the node runs (its
`between` check waits for the GPU before checking) and through the model's decode without that wait, and the time from
the interrupt to the raise is reported against one block's time. Last, one 2048² prompt is interrupted in its decode
through the engine (Engine.interrupt).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from _common import GiB, env, write_report
from plan_matrix import ROOT, prompt_for, reset, write_models
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import planner
from vramgraph.graph.workflow.errors import InterruptedRun, NodeExecutionError
from vramgraph.models.vae import ResnetBlock
from vramgraph.nodes import ops
from vramgraph.nodes.files import Folders

HOG = r"""
import sys, torch
torch.empty(1, device="cuda")
held = []
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "take":
        leave = int(cmd[1])
        while True:
            want = torch.cuda.mem_get_info()[0] - leave
            if want < 32 << 20:
                break
            try:
                held.append(torch.empty(min(want, 8 << 30), dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    elif cmd[0] == "release":
        held.clear()
        torch.cuda.empty_cache()
    print("ok", torch.cuda.mem_get_info()[0], sum(t.numel() for t in held), flush=True)
"""


class Hog:
    """The other process: `take(leave)` leaves `leave` bytes free on the device, `release()` frees all it took."""

    def __init__(self) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._ask("noop")

    def _ask(self, line: str) -> tuple[int, int]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        _, free, held = self.p.stdout.readline().split()
        return int(free), int(held)

    def take(self, leave: int) -> tuple[int, int]:
        return self._ask(f"take {leave}")

    def release(self) -> tuple[int, int]:
        return self._ask("release")

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait(timeout=30)


def pngs(folder: Path) -> set[Path]:
    return set(folder.rglob("*.png"))


def whole(path: Path) -> bool:
    try:
        with Image.open(path) as im:
            im.load()
        return True
    except Exception:
        return False


class Cases:
    def __init__(self, engine: Engine, hog: Hog, out: Path) -> None:
        self.engine, self.hog, self.out, self.seed = engine, hog, out, 1000

    def prompt(self, side: int) -> dict:
        self.seed += 1
        return prompt_for(side, self.seed)

    def run(self, side: int, leave: int | None = None, when: str = "between") -> dict:
        """One prompt with the other process taking all but `leave` bytes `when`; memory is returned after it."""
        e = self.engine
        if when == "cold":
            reset(e)
        before = pngs(self.out)
        case: dict = {"side": side, "leave_gib": None if leave is None else leave / GiB, "when": when}
        if leave is not None and when in ("between", "cold"):
            case["free_after_take_gib"] = round(self.hog.take(leave)[0] / GiB, 3)
        seen: list[tuple[str, dict]] = []

        def events(kind: str, data: dict) -> None:
            seen.append((kind, data))
            if leave is not None and when == "during" and kind == "executing" and data.get("node") == "6":
                case["free_after_take_gib"] = round(self.hog.take(leave)[0] / GiB, 3)

        t0 = time.perf_counter()
        try:
            r = e.run(self.prompt(side), events=events)
            case.update(ok=True, decode=[n.variant for n in r.nodes if n.class_type == "VGVAEDecode"],
                        loads=r.loads, unloads=r.unloads)
        except (planner.PlanError, NodeExecutionError) as err:
            msg = err.message if isinstance(err, planner.PlanError) else err.exception_message
            case.update(ok=False, error=type(err).__name__, message=msg[:900],
                        live_message="other processes hold" in msg)
        case["seconds"] = round(time.perf_counter() - t0, 3)
        case["estimate_wrong"] = any("estimate is wrong" in str(d) for _, d in seen) or "estimate is wrong" in \
            case.get("message", "")
        case["replans"] = [{k: d[k] for k in ("node", "reason", "budget_bytes", "others_bytes")} | {
            "steps": [f"{s['kind']} {s.get('model') or s.get('node')} {s.get('variant') or s.get('to') or ''}".strip()
                      for s in d["plan"]["steps"]]} for k, d in seen if k == "vg_replan"]
        new = sorted(pngs(self.out) - before)
        case["pngs"], case["pngs_whole"] = len(new), sum(whole(p) for p in new)
        if leave is not None:
            self.hog.release()
        case["half_written"] = case["pngs"] != (1 if case.get("ok") else 0) or case["pngs_whole"] != case["pngs"]
        return case


def block_times(vae: torch.nn.Module, latent: torch.Tensor) -> dict:
    """Each decoder resnet block's GPU time in one 2048² decode (CUDA events), and the whole decode's."""
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    hooks = []
    for m in vae.decoder.modules():
        if isinstance(m, ResnetBlock):
            def pre(mod: torch.nn.Module, args: object) -> None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append((ev, ev))

            def post(mod: torch.nn.Module, args: object, out: object) -> None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks[-1] = (marks[-1][0], ev)

            hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    stamps: list[float] = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ops.vae_decode(vae, latent, "gpu", lambda: stamps.append(time.perf_counter()))  # its checks wait for the GPU
    torch.cuda.synchronize()
    end = time.perf_counter()
    for h in hooks:
        h.remove()
    ms = [a.elapsed_time(b) for a, b in marks]
    gaps = [(b - a) * 1e3 for a, b in zip([t0, *stamps], [*stamps, end], strict=True)]
    return {"blocks": len(ms), "block_ms_max": round(max(ms), 3), "block_ms_mean": round(sum(ms) / len(ms), 3),
            "checks": len(stamps), "between_checks_ms_max": round(max(gaps), 3), "decode_s": round(end - t0, 4)}


def interrupted_decode(decode: object, delay: float) -> dict:
    """Interrupt `decode(between)` `delay` seconds after it starts: the time from the interrupt to the raise, and to
    the GPU being idle after it."""
    flag = threading.Event()
    asked: list[float] = []

    def between() -> None:
        if flag.is_set():
            raise InterruptedRun("bench", "VAEDecode")

    def interrupt() -> None:
        asked.append(time.perf_counter())
        flag.set()

    torch.cuda.synchronize()
    timer = threading.Timer(delay, interrupt)
    t0 = time.perf_counter()
    timer.start()
    raised = None
    try:
        decode(between)  # type: ignore[operator]
    except InterruptedRun:
        raised = time.perf_counter()
    torch.cuda.synchronize()
    idle = time.perf_counter()
    timer.cancel()
    if raised is None or not asked:
        return {"delay_s": delay, "raised": False, "decode_s": round(idle - t0, 4)}
    return {"delay_s": delay, "raised": True, "to_raise_ms": round((raised - asked[0]) * 1e3, 2),
            "to_gpu_idle_ms": round((idle - asked[0]) * 1e3, 2)}


def interrupts(engine: Engine, cases: Cases) -> dict:
    vae_key = next(k for k, e in engine.ledger.entries.items() if e.info.label == "vae")
    engine.ledger.load(vae_key, "pinned")
    vae = engine.ledger.module(vae_key)
    latent = torch.randn(1, 128, 128, 128, device="cuda", dtype=torch.bfloat16)
    ops.vae_decode(vae, latent, "gpu", None)  # warm
    blocks = block_times(vae, latent)
    d = blocks["decode_s"]

    def node_decode(b: object) -> object:  # what the decode node runs: its checks wait for the GPU
        return ops.vae_decode(vae, latent, "gpu", b)  # type: ignore[arg-type]

    def model_decode(b: object) -> object:  # the model's decode with the same checks, not waiting
        return vae.decode(latent, b).float().cpu()  # type: ignore[arg-type]

    paced = [interrupted_decode(node_decode, f * d) for f in (0.25, 0.5, 0.75)]
    unpaced = [interrupted_decode(model_decode, f * d) for f in (0.25, 0.5, 0.75)]
    torch.cuda.empty_cache()
    # through the engine: a 2048² prompt interrupted half way through its decode
    asked: list[float] = []

    def events(kind: str, data: dict) -> None:
        if kind == "executing" and data.get("node") == "7":
            def go() -> None:
                asked.append(time.perf_counter())
                engine.interrupt()
            threading.Timer(0.5 * d, go).start()

    before = pngs(cases.out)
    engine_case: dict = {}
    try:
        engine.run(cases.prompt(2048), events=events)
        engine_case["raised"] = False
    except InterruptedRun as e:
        engine_case.update(raised=True, node=e.node_id, to_raise_ms=round((time.perf_counter() - asked[0]) * 1e3, 2)
                           if asked else None)
    engine_case["pngs"] = len(pngs(cases.out) - before)
    block = max(blocks["block_ms_max"], blocks["between_checks_ms_max"])  # the longest stretch without a check
    worst = max(c.get("to_raise_ms", float("inf")) for c in paced)
    return {"blocks": blocks, "paced": paced, "unpaced": unpaced, "engine": engine_case,
            "worst_paced_to_raise_over_max_block": round(worst / block, 3),
            "within_one_block": worst <= block and (engine_case.get("to_raise_ms") or float("inf")) <= block}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--leave", default="1,3,9")
    ap.add_argument("--sides", default="1024,2048")
    a = ap.parse_args()
    t_start = time.perf_counter()
    write_models(ROOT)
    out = ROOT / "output"
    folders = Folders(models=(ROOT / "models",), input=ROOT / "input", output=out, temp=ROOT / "temp")
    engine = Engine(folders, device="cuda", dtype="bf16", budget=budget_for("cuda"))
    engine.run(prompt_for(1024, 99))  # warm-up: pins every model, runs every kernel once
    hog = Hog()
    cases = Cases(engine, hog, out)
    results = []
    try:
        for leave in (int(float(x) * GiB) for x in a.leave.split(",")):
            for when in ("between", "during", "cold"):
                for side in (int(s) for s in a.sides.split(",")):
                    c = cases.run(side, leave, when)
                    results.append(c)
                    print({k: v for k, v in c.items() if k not in ("replans", "message")}, c.get("message", ""),
                          flush=True)
                    if not c.get("ok"):  # memory returned: the next prompt must succeed
                        nxt = cases.run(1024)
                        c["next_after_release"] = {k: nxt[k] for k in ("ok", "seconds", "half_written")}
        hog.release()
        ints = interrupts(engine, cases)
        print(ints, flush=True)
    finally:
        hog.close()
    ok = [c for c in results if c.get("ok")]
    failed = [c for c in results if not c.get("ok")]
    summary = {
        "cases": len(results), "succeeded": len(ok), "failed_with_live_message": sum(bool(c.get("live_message"))
                                                                                     for c in failed),
        "failed_otherwise": [c for c in failed if not c.get("live_message")],
        "estimate_wrong_anywhere": any(c["estimate_wrong"] for c in results),
        "half_written_anywhere": any(c["half_written"] for c in results),
        "next_after_release_all_ok": all(c["next_after_release"]["ok"] for c in failed),
        "replanned_cases": sum(bool(c["replans"]) for c in results),
        "interrupt_within_one_block": ints["within_one_block"],
        "interrupt_worst_over_block": ints["worst_paced_to_raise_over_max_block"],
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    write_report(a.out, {"env": env(), "summary": summary, "cases": results, "interrupts": ints, "gib": GiB})


if __name__ == "__main__":
    main()
