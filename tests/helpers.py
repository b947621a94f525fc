"""Small helpers shared by the tests (importable as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def save(sd: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """Write a state dict as a real safetensors file (contiguous CPU copies), creating folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move 1-d parameters (norm scales, biases) off their init values so that they matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model
