"""Values that flow between nodes at run time, in ComfyUI's conventions where ComfyUI has one.

IMAGE: float tensor (B, H, W, 3) in 0..1 on the CPU. LATENT: {"samples": (B, 128, H/16, W/16)}, the
normalised FLUX.2 latent. CONDITIONING: a list of [embeddings (B, 512, D), {"reference_latents": [...]}]
pairs. Models travel as handles; where the weights are is the residency ledger's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .types import ModelInfo

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelHandle:
    """A model as a node output: what to load (its info and spec); the ledger holds the weights."""

    info: ModelInfo
    tokenizer: Path | None = None  # text encoders: tokenizer.json found beside the checkpoint

    @property
    def key(self) -> str:
        return self.info.key


@dataclass(frozen=True)
class Noise:
    """ComfyUI's RandomNoise: float32 randn on the CPU from manual_seed(seed), the latent's shape."""

    seed: int

    def generate_noise(self, latent: dict[str, Any]) -> torch.Tensor:
        import torch

        samples = latent["samples"]
        g = torch.Generator("cpu").manual_seed(self.seed)
        return torch.randn(tuple(samples.shape), generator=g, dtype=torch.float32, device="cpu")


@dataclass(frozen=True)
class Guider:
    """CFGGuider: the model, positive and negative conditioning, and the guidance scale."""

    model: ModelHandle
    positive: list
    negative: list | None
    cfg: float


@dataclass(frozen=True)
class Sampler:
    name: str


def conditioning(embeddings: torch.Tensor, references: list[torch.Tensor] | None = None) -> list:
    return [[embeddings, {"reference_latents": list(references or [])}]]


def cond_parts(cond: list, what: str = "conditioning") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(embeddings, reference latents) of a CONDITIONING made by our nodes (one entry)."""
    if not isinstance(cond, list) or not cond:
        raise ValueError(f"{what} is empty; connect a text encode node")
    if len(cond) != 1:
        raise ValueError(f"{what} has {len(cond)} entries (combined conditionings are not supported); "
                         "use one text encode per prompt")
    emb, extra = cond[0]
    return emb, list(extra.get("reference_latents") or [])


def with_reference(cond: list, latent: torch.Tensor) -> list:
    emb, refs = cond_parts(cond)
    return [[emb, {**cond[0][1], "reference_latents": [*refs, latent]}]]
