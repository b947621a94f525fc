"""A cheap latent-to-RGB preview: a linear map from the latent's 32 raw channels to RGB.

The 128 packed channels are unpatchified (2x2) to 32 channels at twice the latent's resolution and
mapped per pixel by a 32x3 matrix plus a bias (`data/flux2_preview_rgb.json`; `bench/fit_preview.py`
fits one by least squares against a VAE decoder). A 1024² image previews at 128², in microseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

MAP_FILE = Path(__file__).parent / "data" / "flux2_preview_rgb.json"


def _map(path: Path = MAP_FILE) -> tuple[torch.Tensor, torch.Tensor]:
    """The (weight, bias) map, read at each call (1.7 KB of JSON: tens of microseconds), so that no caller shares a
    tensor another may change."""
    data = json.loads(path.read_text())
    return torch.tensor(data["weight"], dtype=torch.float32), torch.tensor(data["bias"], dtype=torch.float32)


def unpatchify(latent: torch.Tensor) -> torch.Tensor:
    """(B, 128, h, w) packed -> (B, 32, 2h, 2w); channel c*4 + 2*dy + dx goes to (c, 2y+dy, 2x+dx)."""
    b, c, h, w = latent.shape
    return latent.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, 2 * h, 2 * w)


@torch.no_grad()
def preview_rgb(latent: torch.Tensor) -> torch.Tensor:
    """Packed normalised latent (B, 128, h, w), any device -> RGB (B, 2h, 2w, 3) in 0..1 on the CPU."""
    weight, bias = _map()
    raw = unpatchify(latent.float())
    rgb = torch.einsum("bchw,cr->bhwr", raw, weight.to(raw.device)) + bias.to(raw.device)
    return ((rgb.clamp(-1, 1) + 1) / 2).cpu()


def fit_map(raw: torch.Tensor, rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares (weight (32, 3), bias (3,)) with rgb ≈ raw · weight + bias, per pixel.

    raw: (B, 32, H, W) raw latents; rgb: (B, H, W, 3) the decoded (or source) pictures in [-1, 1] at that size.
    """
    x = raw.permute(0, 2, 3, 1).reshape(-1, raw.shape[1]).double()
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    y = rgb.reshape(-1, 3).double()
    sol = torch.linalg.lstsq(x, y).solution
    return sol[:-1].float(), sol[-1].float()


def preview_images(latent: torch.Tensor, max_side: int = 512) -> list[Image.Image]:
    """PIL previews at twice the latent's resolution, enlarged (nearest) up to `max_side` if it is larger."""
    out = []
    for im in (preview_rgb(latent) * 255).round().to(torch.uint8).numpy():
        pil = Image.fromarray(im)
        scale = max(1, max_side // max(pil.size))
        out.append(pil.resize((pil.width * scale, pil.height * scale), Image.Resampling.NEAREST) if scale > 1 else pil)
    return out
