"""Block streaming on the H200: cards smaller than the transformer, against the uncapped run of the same process.

    python3 bench/streaming.py OUT.json        (or: bash bench/run_device.sh "streaming")

Random bf16 weights at klein-4B shapes (bench/plan_matrix.py writes them to /dev/shm, ComfyUI layout), the shipped
text-to-image workflow through the Engine the CLI uses, `--vram CARD` semantics. Every cell starts with all
weights in pinned host RAM and nothing on the GPU and runs two images (new prompt, new seed). Reported:

- "constants": pinned host->GPU bandwidth (one 2 GiB copy), the bandwidth of block-sized copies of separate
  tensors (one klein-4B single block) alone and while a block computes on the other stream, and one double and
  one single block's compute time at 1024² and 2048² (the constants graph/plan/residency.py and nodes/estimates.py use);
- "exact": the streamed sampler (some blocks resident, the others streamed) against the resident one on the GPU,
  bit for bit;
- the cells (uncapped, 8 GiB and 6 GiB at 1024², uncapped and 10 GiB at 2048²): plan text, per-node predicted vs
  measured peaks, times, and the summary: time ratios vs uncapped, estimate/measured per node.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch
from _common import GiB, env
from plan_matrix import ROOT, prompt_for, reset, run_cell, write_models
from vramgraph.graph.engine.budget import budget_for
from vramgraph.graph.engine.executor import Engine
from vramgraph.models.sampling import image_ids, rope_table, sample, text_ids
from vramgraph.models.streaming import _tensors, stream_blocks
from vramgraph.nodes.files import Folders


def _bw(fn, nbytes: int, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return nbytes * repeats / (time.perf_counter() - t0)


def _pinned_bw() -> float:
    big = torch.empty(2 * GiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(big, device="cuda")
    return _bw(lambda: dst.copy_(big, non_blocking=True), big.numel(), 3)


def _block_times(cfg, double, single, side_px: int, copy_block) -> dict:
    h = w = side_px // 16
    n_txt, n_img = 512, h * w
    rope = rope_table(cfg, torch.cat([text_ids(n_txt), image_ids(h, w)]), torch.device("cuda"))
    x = torch.randn(1, n_img, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(1, n_txt, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    mod6 = tuple(0.1 * torch.randn(1, 1, cfg.hidden, device="cuda", dtype=torch.bfloat16) for _ in range(6))
    hcat = torch.cat([c, x], 1)
    n = n_img + n_txt
    with torch.no_grad():
        td = 1 / _bw(lambda: double(x, c, mod6, mod6, rope), 1, 10)
        ts = 1 / _bw(lambda: single(hcat, mod6[:3], rope), 1, 10)

        def both() -> None:  # a block's copy on the side stream beside a single block's compute
            copy_block()
            single(hcat, mod6[:3], rope)

        tb = 1 / _bw(both, 1, 10)
    return {"tokens": n, "double_s": td, "single_s": ts, "double_s_per_token": td / n, "single_s_per_token": ts / n,
            "single_with_block_copy_s": tb}


def constants(host: torch.nn.Module) -> dict:
    """Bandwidths and per-block compute times measured with the transformer's pinned host copy."""
    pinned = _pinned_bw()
    torch.cuda.empty_cache()
    single = host.single_blocks[0]
    tensors = [t.data for _, _, t in _tensors(single)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    outs = [torch.empty_like(t, device="cuda") for t in tensors]
    side = torch.cuda.Stream()

    def copy_block() -> None:
        with torch.cuda.stream(side):
            for o, t in zip(outs, tensors, strict=True):
                o.copy_(t, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    alone = _bw(copy_block, nbytes)
    double = copy.deepcopy(host.double_blocks[0]).cuda()
    gpu_single = copy.deepcopy(single).cuda()
    times = {side_px: _block_times(host.cfg, double, gpu_single, side_px, copy_block) for side_px in (1024, 2048)}
    return {"pinned_h2d_GBps": round(pinned / 1e9, 2), "block_copy_GBps": round(alone / 1e9, 2),
            "block_copy_over_pinned": round(alone / pinned, 3), "block_bytes": nbytes,
            "block_copy_s": nbytes / alone, "block_times": times}


def exact(engine: Engine, key: str) -> dict:
    """The sampler with the transformer resident vs streamed (half the blocks resident): the same bits?"""
    host = engine.ledger.entries[key].copy.module
    torch.manual_seed(0)
    lat = torch.randn(1, 128, 32, 32)
    ctx = torch.randn(1, 512, host.cfg.context_dim, dtype=torch.bfloat16)
    sig = [1.0, 0.5, 0.0]
    engine.ledger.load(key, "pinned")
    with torch.no_grad():
        ref = sample(engine.ledger.module(key), lat, ctx, sig).cpu()
    engine.ledger.unload(key, "pinned")
    torch.cuda.empty_cache()
    out = {}
    for name, res in (("none_resident", ()), ("odd_resident", tuple(range(1, 25, 2))), ("14_resident", range(14))):
        with torch.no_grad(), stream_blocks(host, "cuda", tuple(res)) as m:
            got = sample(m, lat, ctx, sig).cpu()
        out[name] = bool(torch.equal(got, ref))
    torch.cuda.empty_cache()
    return out


def main() -> None:
    out_path = sys.argv[1]
    t0 = time.perf_counter()
    write_models(ROOT)
    folders = Folders(models=(ROOT / "models",), input=ROOT / "input", output=ROOT / "output", temp=ROOT / "temp")
    engine = Engine(folders, device="cuda", dtype="bf16", budget=budget_for("cuda"))
    report: dict = {"env": env(), "setup_s": round(time.perf_counter() - t0, 1)}
    engine.run(copy.deepcopy(prompt_for(1024, 0)))  # warm-up: every kernel once, every model read
    reset(engine)
    key = next(k for k, e in engine.ledger.entries.items() if e.info.kind == "transformer")
    for step, fn in (("constants", lambda: constants(engine.ledger.entries[key].copy.module)),
                     ("exact", lambda: exact(engine, key))):
        try:
            report[step] = fn()
        except Exception as e:  # reported, never hidden
            report[step] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(step, json.dumps(report[step]), flush=True)
        torch.cuda.empty_cache()
    cells = []
    for card, side in ((0, 1024), (8, 1024), (6, 1024), (0, 2048), (10, 2048)):
        cell = run_cell(engine, card, side)
        cells.append(cell)
        print(json.dumps({k: v for k, v in cell.items() if k != "images"}), [
            {k: im.get(k) for k in ("seconds", "loads", "error")} for im in cell["images"]], flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0)
    report["cells"] = cells
    report["summary"] = summarize(cells)
    Path(out_path).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))


def summarize(cells: list[dict]) -> dict:
    ok = [c for c in cells if "rejected" not in c and all("seconds" in i for i in c["images"])]
    total = {(c["card_gib"], c["side"]): sum(i["seconds"] for i in c["images"]) for c in ok}
    unc = {side: t for (card, side), t in total.items() if card is None}
    nodes = [dict(n, card=c["card_gib"], side=c["side"]) for c in ok for i in c["images"] for n in i["nodes"]
             if n["measured_gib"]]
    return {
        "time_vs_uncapped": {f"{card}GiB/{side}": round(t / unc[side], 3) for (card, side), t in total.items()
                             if card is not None and side in unc},
        "estimate_over_measured": {"min": min((n["ratio"] for n in nodes), default=None),
                                   "max": max((n["ratio"] for n in nodes), default=None), "nodes": len(nodes)},
        "over_estimate": [n for n in nodes if n["ratio"] < 1.0],
        "errors": [(c["card_gib"], c["side"], i.get("error")) for c in cells for i in c["images"] if "error" in i],
        "rejected": [(c["card_gib"], c["side"], c["rejected"]["message"]) for c in cells if "rejected" in c],
        "streaming": [line for c in ok for i in c["images"][:1] for line in i["plan"].splitlines()
                      if "blocks resident" in line and line.startswith("Run ")],
    }


if __name__ == "__main__":
    main()
