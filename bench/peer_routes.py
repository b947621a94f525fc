"""A server plugin for the side-by-side benchmark: the memory probe its client reads from both servers.

    vramgraph serve --plugin bench/peer_routes.py ...

GET /peer/mem answers the torch allocator's figures (peaks since the last reset, across nodes), the
device's free memory and the models on the GPU; POST /peer/reset_peak restarts the peak counters
first. shared/tools/comfyui-peer reads the same route from ComfyUI through its own plugin. These routes
exist only in benchmark runs, never in the production server.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


def memory_stats(engine: Any, reset: bool = False) -> dict:
    """Torch allocator figures (peaks since the last reset, across nodes) and the models on the GPU; `reset`
    restarts the peak counters first."""
    import torch

    out: dict[str, Any] = {"loaded_models": sorted(engine.ledger.on_gpu)}
    if engine.device.type == "cuda":
        max_allocated, max_reserved = engine.peaks(reset)
        free, total = torch.cuda.mem_get_info(engine.device)
        out.update(max_allocated=max_allocated, max_reserved=max_reserved,
                   allocated=torch.cuda.memory_allocated(engine.device),
                   reserved=torch.cuda.memory_reserved(engine.device), dev_free=free, dev_total=total)
    return out


def setup(app: web.Application, engine: Any) -> None:
    app.router.add_get("/peer/mem", lambda request: web.json_response(memory_stats(engine)))
    app.router.add_post("/peer/reset_peak", lambda request: web.json_response(memory_stats(engine, reset=True)))
