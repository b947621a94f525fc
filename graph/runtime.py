"""Settings to engine: the models/input/output folders, the budget and the device, from the command line's
arguments (or any object with the same attributes), the environment and a config file.

The config file is --config, else $VRAMGRAPH_CONFIG, else ./vramgraph.json, else
~/.config/vramgraph/config.json; its keys are models, input, output, temp, vram and reserve.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

CONFIG_PLACES = (Path("vramgraph.json"), Path.home() / ".config" / "vramgraph" / "config.json")


def _config(args: argparse.Namespace) -> dict:
    places = [Path(args.config)] if getattr(args, "config", None) else list(CONFIG_PLACES)
    if os.environ.get("VRAMGRAPH_CONFIG") and not getattr(args, "config", None):
        places.insert(0, Path(os.environ["VRAMGRAPH_CONFIG"]))
    for p in places:
        if p.is_file():
            try:
                return json.loads(p.read_text())
            except ValueError as e:
                raise ValueError(f"config {p}: not valid JSON ({e})") from e
        if getattr(args, "config", None):
            raise ValueError(f"config {p}: no such file")
    return {}


def folders_from(args: argparse.Namespace) -> Any:
    from ..nodes.files import Folders

    cfg = _config(args)
    models = args.models or ([os.environ["VRAMGRAPH_MODELS"]] if os.environ.get("VRAMGRAPH_MODELS") else None) \
        or cfg.get("models") or ["models"]
    models = [models] if isinstance(models, str) else models
    return Folders(models=tuple(Path(m).expanduser() for m in models),
                   input=Path(args.input or cfg.get("input", "input")).expanduser(),
                   output=Path(getattr(args, "output", None) or cfg.get("output", "output")).expanduser(),
                   temp=Path(cfg.get("temp", Path(getattr(args, "output", None) or "output") / "temp")).expanduser())


def planning_from(args: argparse.Namespace, host: str | None = None) -> Any:
    """What `vramgraph plan` needs: folders, the catalogue (built-in klein sizes for absent files) and the budget.

    Torch is imported only to measure a device: when --device names a CUDA device, or when no --vram says
    which card to plan for (then the budget is this machine's device, as `run` would see it). With --vram
    and no --device the plan is for a card of that size, as a process finds it before it holds any of it.
    """
    from ..graph.budget import budget_for
    from ..graph.planning import Planning
    from ..nodes.catalog import ModelCatalog

    cfg = _config(args)
    vram = args.vram or cfg.get("vram")
    device = args.device
    if device is None and vram is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    folders = folders_from(args)
    budget = budget_for(device, vram, args.reserve or cfg.get("reserve"), host)
    return Planning(folders, ModelCatalog(folders, args.dtype or "bf16", allow_builtin=True), budget)


def engine_from(args: argparse.Namespace, allow_builtin: bool = False, host: str | None = None) -> Any:
    import torch

    from ..graph.budget import budget_for
    from ..graph.executor import Engine

    cfg = _config(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    budget = budget_for(device, args.vram or cfg.get("vram"), args.reserve or cfg.get("reserve"), host)
    return Engine(folders_from(args), device=str(device), dtype=args.dtype, budget=budget,
                  allow_builtin=allow_builtin)
