"""The torch work behind the nodes, shared by ComfyUI's core node types and our VG nodes.

Every function takes loaded modules (wherever the plan put them) and CPU tensors, computes on the
module's device, and returns CPU tensors, so nothing a node produces holds GPU memory after it ran.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ..models.qwen3 import PromptTokenizer, Qwen3Encoder, encode_prompts, encode_prompts_streamed
from ..models.sampling import pack_references, sample
from ..models.step import StepOptions
from ..models.streaming import Kept
from ..models.vae import Flux2VAE
from .estimates import TILE_OVERLAP, tile_spans
from .images import MAX_IMAGE_PIXELS, open_image

Progress = Callable[[int, int], None]
Between = Callable[[], None] | None  # called between the blocks, layers or tiles of a long node (its interrupt check)


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def encode_text(encoder: Qwen3Encoder, tokenizer: PromptTokenizer, texts: list[str],
                between: Between = None) -> torch.Tensor:
    return encode_prompts(encoder, tokenizer, texts, between).cpu()


def encode_text_streamed(encoder: Qwen3Encoder, tokenizer: PromptTokenizer, texts: list[str],
                         device: torch.device, between: Between = None, resident: tuple[int, ...] = (),
                         kept: Kept | None = None) -> torch.Tensor:
    """The encoder's weights stay in pinned host memory and stream through `device` one layer at a time (the
    `resident` layers are copied once for the node, or found in `kept` and left there)."""
    return encode_prompts_streamed(encoder, tokenizer, texts, device, between, resident, kept).cpu()


@torch.no_grad()
def run_sampler(model: torch.nn.Module, noise: torch.Tensor, latent: torch.Tensor, positive: torch.Tensor,
                negative: torch.Tensor | None, cfg: float, sigmas: list[float], references: list[torch.Tensor],
                progress: Progress | None = None,
                preview: Callable[[torch.Tensor, int, int], None] | None = None,
                sampler: str = "euler", seed: int = 0, kv_cache: bool = False,
                sequential_cfg: bool = False, step: StepOptions | None = None) -> torch.Tensor:
    """Sampling as ComfyUI's SamplerCustomAdvanced does it for a FLUX model; returns the final latent on the CPU.

    The start is sigma0 * noise + (1 - sigma0) * latent (ComfyUI's flow-model noise scaling), exactly
    the noise for an empty latent and sigma0 = 1; a schedule that stops above 0 returns x / (1 - sigma_last)
    (its inverse noise scaling). cfg 1.0 skips the negative. `seed` (the noise seed) fixes the fresh noise
    of the stochastic samplers. kv_cache: a model patched by FluxKVCache (the references' keys and values
    cached on the first step, see models.sampling.sample). `step`: how the transformer's forwards run
    (models/step.py); None: as the model is.
    """
    if len(sigmas) < 2:
        return latent.float().clone()
    s0 = float(sigmas[0])
    start = noise * s0 + latent.float() * (1.0 - s0) if s0 != 1.0 or latent.any() else noise
    batch = start.shape[0]
    pos = _batched(positive, batch, "positive")
    neg = _batched(negative, batch, "negative") if negative is not None and cfg != 1.0 else None
    refs = pack_references([r[:1] for r in references]) if references else None
    out = sample(model, start, pos, list(sigmas), negative=neg, guidance=cfg, references=refs, progress=progress,
                 preview=preview, sampler=sampler, seed=seed, kv_cache=kv_cache, sequential_cfg=sequential_cfg,
                 step=step)
    last = torch.tensor(float(sigmas[-1]), dtype=torch.float32, device=out.device)
    if last != 0:
        out = out / (1.0 - last)
    return out.cpu()


def _batched(emb: torch.Tensor, batch: int, what: str) -> torch.Tensor:
    if emb.shape[0] == batch:
        return emb
    if emb.shape[0] == 1:
        return emb.expand(batch, -1, -1)
    raise ValueError(f"the {what} conditioning has {emb.shape[0]} prompts but the latent has {batch} images; "
                     "use one prompt or as many prompts as images")


@torch.no_grad()
def vae_decode(vae: Flux2VAE, samples: torch.Tensor, variant: str = "gpu", between: Between = None) -> torch.Tensor:
    """Latent (B, 128, h, w) -> IMAGE (B, 16h, 16w, 3) in 0..1 on the CPU.

    "gpu" and "cpu" decode in one piece wherever the VAE is; "tiled" decodes overlapping tiles and
    blends them, for when the whole decode does not fit. `between` is called between the decoder's
    blocks (and tiles), so an interrupt lands within one block.
    """
    between = _paced(between, _device(vae))
    if variant == "tiled":
        pixels = _decode_tiled(vae, samples, between)
    else:
        pixels = vae.decode(samples.to(_device(vae)), between).float()
    return ((pixels.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).cpu()


def _paced(between: Between, device: torch.device) -> Between:
    """`between` called once the GPU has caught up with the host: the host would otherwise queue a whole decode's
    kernels ahead and reach its interrupt checks long before the GPU reaches those blocks, so that an interrupt
    landed only at the end. One wait per block (tens of microseconds of idle GPU against milliseconds of work)."""
    if between is None or device.type != "cuda":
        return between

    def check() -> None:
        torch.cuda.current_stream(device).synchronize()
        between()

    return check


def _ramp(n: int, overlap: int, start: bool, end: bool) -> torch.Tensor:
    w = torch.ones(n)
    if overlap > 0:
        r = (torch.arange(overlap, dtype=torch.float32) + 0.5) / overlap
        if not start:
            w[:overlap] = r
        if not end:
            w[-overlap:] = r.flip(0)
    return w


def _decode_tiled(vae: Flux2VAE, samples: torch.Tensor, between: Between = None) -> torch.Tensor:
    dev = _device(vae)
    b, _, h, w = samples.shape
    out = torch.zeros(b, 3, h * 16, w * 16, device=dev)
    weight = torch.zeros(1, 1, h * 16, w * 16, device=dev)
    for _, ya, yb in tile_spans(h):
        for _, xa, xb in tile_spans(w):
            tile = vae.decode(samples[:, :, ya:yb, xa:xb].to(dev), between).float()
            wy = _ramp((yb - ya) * 16, TILE_OVERLAP * 16, ya == 0, yb == h).to(dev)
            wx = _ramp((xb - xa) * 16, TILE_OVERLAP * 16, xa == 0, xb == w).to(dev)
            m = (wy[:, None] * wx[None, :])[None, None]
            out[:, :, ya * 16:yb * 16, xa * 16:xb * 16] += tile * m
            weight[:, :, ya * 16:yb * 16, xa * 16:xb * 16] += m
            del tile
    return out / weight


@torch.no_grad()
def vae_encode(vae: Flux2VAE, image: torch.Tensor, between: Between = None) -> torch.Tensor:
    """IMAGE (B, H, W, 3) in 0..1 -> latent (B, 128, H/16, W/16), cropped centrally to multiples of 16 first."""
    image = crop16(image)
    pixels = image[..., :3].permute(0, 3, 1, 2) * 2 - 1
    return vae.encode(pixels.to(_device(vae)), _paced(between, _device(vae))).float().cpu()


def crop16(image: torch.Tensor) -> torch.Tensor:
    """ComfyUI's VAE-encode crop: the central part whose sides are multiples of 16."""
    h, w = image.shape[1] // 16 * 16, image.shape[2] // 16 * 16
    if h == 0 or w == 0:
        raise ValueError(f"the image is {image.shape[2]}x{image.shape[1]}; it must be at least 16x16 to encode")
    oy, ox = (image.shape[1] % 16) // 2, (image.shape[2] % 16) // 2
    return image[:, oy:oy + h, ox:ox + w]


def resize(image: torch.Tensor, width: int, height: int, method: str) -> torch.Tensor:
    """IMAGE (B, H, W, C) -> (B, height, width, C) with ComfyUI's upscale methods."""
    if (image.shape[2], image.shape[1]) == (width, height):
        return image
    if method == "lanczos":
        out = []
        for im in image:
            arr = (im.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
            pil = Image.fromarray(arr).resize((width, height), Image.Resampling.LANCZOS)
            out.append(torch.from_numpy(np.asarray(pil).astype(np.float32) / 255.0))
        return torch.stack(out)
    x = image.permute(0, 3, 1, 2)
    kw = {"align_corners": False} if method in ("bilinear", "bicubic") else {}
    x = F.interpolate(x, size=(height, width), mode=method, **kw)
    return x.permute(0, 2, 3, 1).clamp(0, 1) if method == "bicubic" else x.permute(0, 2, 3, 1)


def load_image(path: str, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's LoadImage: (IMAGE (1, H, W, 3), MASK (1, H, W)); the mask is 1 - alpha, else zeros. An image of
    more than `max_pixels` pixels is refused before decoding (images.ImageTooLarge)."""
    from PIL import ImageOps

    with open_image(path, max_pixels, f"input image {Path(path).name}") as im:
        im = ImageOps.exif_transpose(im)
        rgb = np.asarray(im.convert("RGB")).astype(np.float32) / 255.0
        if "A" in im.getbands():
            mask = 1.0 - np.asarray(im.getchannel("A")).astype(np.float32) / 255.0
        else:
            mask = np.zeros((64, 64), dtype=np.float32)
    return torch.from_numpy(rgb)[None], torch.from_numpy(mask)[None]


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """IMAGE (B, H, W, C) -> uint8 pixels the way ComfyUI's SaveImage converts (x 255, clip, truncate)."""
    return np.clip(255.0 * image.cpu().float().numpy(), 0, 255).astype(np.uint8)


def to_pil(image: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(a) for a in to_uint8(image)]
