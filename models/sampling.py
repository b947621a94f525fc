"""Sampling for FLUX.2 [klein] as plain functions: schedule, noise, packing, Euler loop with CFG and
reference images. Models are arguments; nothing here holds state.

Latents live in the VAE's normalised, 2x2-patchified space: (B, 128, H/16, W/16). The transformer
sees them packed as tokens (B, H/16 * W/16, 128), row-major.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from . import samplers
from .flux2 import Flux2Transformer, RefKV, image_ids, rope_table, text_ids
from .step import StepOptions, StepShape
from .step import prepare as prepare_step

# Empirical fit of the schedule's shift mu to the target token count and step count (BFL flux2).
MU_A1, MU_B1 = 8.73809524e-05, 1.89833333
MU_A2, MU_B2 = 0.00016927, 0.45666666
REFERENCE_TIME_STEP = 10  # reference image i (0-based) gets time coordinate 10 + 10*i
REFERENCE_MAX_AREA = 1024 * 1024


def empirical_mu(seq_len: int, steps: int) -> float:
    """Shift of the sigma schedule for `seq_len` target tokens sampled in `steps` steps."""
    if seq_len > 4300:
        return MU_A2 * seq_len + MU_B2
    m10 = MU_A1 * seq_len + MU_B1
    m200 = MU_A2 * seq_len + MU_B2
    a = (m200 - m10) / 190.0
    return a * steps + (m200 - 200.0 * a)


def sigmas(steps: int, seq_len: int) -> list[float]:
    """steps+1 noise levels from 1 to 0: sigma(t) = e^mu / (e^mu + 1/t - 1) on t = linspace(1, 0)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    e = math.exp(empirical_mu(seq_len, steps))
    out = []
    for i in range(steps + 1):
        t = 1.0 - i / steps
        out.append(0.0 if t <= 0 else e / (e + (1.0 / t - 1.0)))
    return out


def latent_size(width: int, height: int) -> tuple[int, int]:
    """(h, w) of the packed latent grid for an image; sides must be multiples of 16."""
    if width % 16 or height % 16 or width < 16 or height < 16:
        raise ValueError(f"width and height must be positive multiples of 16, got {width}x{height}")
    return height // 16, width // 16


def noise(seed: int, batch: int, h: int, w: int) -> torch.Tensor:
    """Initial latent noise (B, 128, h, w), fp32 on the CPU: the same numbers for a seed on any device.

    Drawn as ComfyUI's RandomNoise draws it (a CPU generator seeded with `seed`, one randn call
    for the whole batch), so a seed gives the same starting latent here and there.
    """
    g = torch.Generator("cpu").manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return torch.randn((batch, 128, h, w), generator=g, dtype=torch.float32)


def pack(latent: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C) tokens, row-major."""
    return latent.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, C) tokens -> (B, C, h, w)."""
    return tokens.transpose(1, 2).unflatten(2, (h, w))


def prepare_reference(image: Image.Image, max_area: int = REFERENCE_MAX_AREA) -> torch.Tensor:
    """A reference image as pixels in [-1, 1], (1, 3, H, W) with H, W multiples of 16.

    Scaled down (Lanczos) so its area is at most `max_area`, then scaled to cover and centre-cropped
    to the largest multiple-of-16 size inside it.
    """
    image = image.convert("RGB")
    w, h = image.size
    if w * h > max_area:
        s = math.sqrt(max_area / (w * h))
        w, h = max(16, int(w * s)), max(16, int(h * s))
        image = image.resize((w, h), Image.Resampling.LANCZOS)
    tw, th = max(16, w // 16 * 16), max(16, h // 16 * 16)
    if (tw, th) != (w, h):
        s = max(tw / w, th / h)
        rw, rh = max(tw, round(w * s)), max(th, round(h * s))
        if (rw, rh) != (w, h):
            image = image.resize((rw, rh), Image.Resampling.LANCZOS)
        left, top = (rw - tw) // 2, (rh - th) // 2
        image = image.crop((left, top, left + tw, top + th))
    return pixels_from_image(image)


def pixels_from_image(image: Image.Image) -> torch.Tensor:
    """PIL RGB -> (1, 3, H, W) float32 in [-1, 1]."""
    t = torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8)
    t = t.view(image.height, image.width, 3).permute(2, 0, 1).float()
    return (t / 127.5 - 1.0)[None]


def images_from_pixels(pixels: torch.Tensor, rounding: str = "round") -> list[Image.Image]:
    """(B, 3, H, W) in [-1, 1] -> PIL images. rounding "round" (diffusers) or "floor" (ComfyUI's SaveImage)."""
    x = (pixels.float().clamp(-1, 1) + 1) * 127.5
    x = x.round() if rounding == "round" else x.floor()
    x = x.clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in x]


@dataclass(frozen=True)
class References:
    """Encoded reference images, ready to append to the target tokens every step."""

    tokens: torch.Tensor  # (1, N_ref, 128) packed normalised latents of all references
    ids: torch.Tensor  # (N_ref, 4) positions: (10 + 10*i, y, x, 0)


def pack_references(latents: Sequence[torch.Tensor]) -> References:
    """References from normalised latents (1, 128, h_i, w_i), in the order given."""
    toks, ids = [], []
    for i, lat in enumerate(latents):
        if lat.ndim != 4 or lat.shape[0] != 1:
            raise ValueError(f"reference {i}: expected one latent (1, 128, h, w), got {tuple(lat.shape)}")
        toks.append(pack(lat))
        ids.append(image_ids(lat.shape[2], lat.shape[3], REFERENCE_TIME_STEP * (i + 1)))
    return References(torch.cat(toks, 1), torch.cat(ids, 0))


Progress = Callable[[int, int], None]


@torch.no_grad()
def sample(model: Flux2Transformer, latent: torch.Tensor, context: torch.Tensor, sigma_list: Sequence[float], *,
           negative: torch.Tensor | None = None, guidance: float = 1.0, references: References | None = None,
           progress: Progress | None = None,
           preview: Callable[[torch.Tensor, int, int], None] | None = None, kv_cache: bool = False,
           sampler: str = "euler", seed: int = 0, sequential_cfg: bool = False,
           step: StepOptions | None = None) -> torch.Tensor:
    """Integration of the flow from sigma_list[0] to sigma_list[-1] with `sampler` (models/samplers.py).

    latent: (B, 128, h, w) noise (times sigma_list[0]) in the normalised space, any device;
    context: (B, T, D) prompt embeddings; negative: (B, T, D) or None. With `negative` and
    guidance != 1, the prediction is u + guidance * (c - u) (classifier-free guidance, base models);
    conditional and unconditional passes run as one batch (`sequential_cfg`: one after the other, half the
    activation memory, the same sum in other kernels' rounding; not with kv_cache). Returns the final latent,
    fp32, on the model's device. `preview(x0, step, steps)`, if given, receives each step's denoised estimate
    x - sigma * v as a (B, 128, h, w) latent on the model's device. `seed` fixes the fresh noise of the
    ancestral, SDE and LCM samplers (as ComfyUI draws it from the noise seed). "euler" steps in the
    velocity, x += (sigma_next - sigma) v; the others step from the denoised estimate, with the guidance
    applied to it as ComfyUI does (the same mixture: x0 is affine in v).

    step: how the transformer's forwards run (models/step.py: attention kernel per shape, compiled blocks where that
    pays back within this run); None: as the model is.

    kv_cache (ComfyUI's FluxKVCache, for klein-9B-kv): the first model call runs with the references, modulated at
    t=0, and caches their keys and values (`RefKV`); every later call runs on the target tokens alone against it.
    """
    device = model.img_in.weight.device
    h, w = latent.shape[2:]
    n = h * w
    x = pack(latent).to(device, torch.float32)
    cfg_on = negative is not None and guidance != 1.0
    ctx = context.to(device)
    if cfg_on:
        if negative.shape != context.shape:
            raise ValueError(f"negative embeddings {tuple(negative.shape)} must match the prompt's "
                             f"{tuple(context.shape)}")
        ctx = torch.cat([ctx, negative.to(device)], 0)
    ids = torch.cat([text_ids(context.shape[1]), image_ids(h, w)] +
                    ([references.ids] if references is not None else []))
    rope = rope_table(model.cfg, ids, device)
    ref_tokens = None
    if references is not None:
        ref_tokens = references.tokens.to(device, model.dtype).expand(ctx.shape[0], -1, -1)
    kv = RefKV() if kv_cache and ref_tokens is not None else None
    if step is not None:
        n_img = n + (ref_tokens.shape[1] if ref_tokens is not None else 0)
        split = cfg_on and sequential_cfg and kv is None
        batch = ctx.shape[0] // (2 if split else 1)
        calls = (len(sigma_list) - 1) * (2 if split else 1) * (2 if sampler in ("heun", "dpmpp_sde") else 1)
        if kv is not None:  # keys longer than queries: SDPA's own choice, which falls back where a kernel cannot
            step = dataclasses.replace(step, attention="sdpa")
        prepare_step(model, StepShape(batch, n_img, ctx.shape[1]), step, calls)

    def velocity(x: torch.Tensor, s: float) -> torch.Tensor:
        """The model's (B, n, 128) prediction at sigma s, both halves when guidance is on."""
        inp = x.to(model.dtype)
        if cfg_on:
            inp = torch.cat([inp, inp], 0)
        if ref_tokens is not None and (kv is None or not kv.filled):
            inp = torch.cat([inp, ref_tokens], 1)
        sig = torch.full((inp.shape[0],), s, device=device, dtype=torch.float32)
        if cfg_on and sequential_cfg and kv is None:
            half = inp.shape[0] // 2
            return torch.cat([model(inp[:half], ctx[:half], sig[:half], rope, n).float(),
                              model(inp[half:], ctx[half:], sig[half:], rope, n).float()])
        return (model(inp, ctx, sig, rope, n) if kv is None else model(inp, ctx, sig, rope, n, kv)).float()

    steps = len(sigma_list) - 1
    if sampler != "euler":
        return _sample_denoised(velocity, unpack(x, h, w), sigma_list, cfg_on, guidance, sampler, seed,
                                progress, preview)
    for i in range(steps):
        s, s_next = sigma_list[i], sigma_list[i + 1]
        v = velocity(x, s)
        if cfg_on:
            c, u = v.chunk(2)
            v = u + guidance * (c - u)
        if preview is not None:
            preview(unpack(x - s * v, h, w), i + 1, steps)
        x = x + (s_next - s) * v
        if progress is not None:
            progress(i + 1, steps)
    return unpack(x, h, w)


def _sample_denoised(velocity: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor,
                     sigma_list: Sequence[float], cfg_on: bool, guidance: float, sampler: str, seed: int,
                     progress: Progress | None, preview: Callable[[torch.Tensor, int, int], None] | None
                     ) -> torch.Tensor:
    """Any of models/samplers.py over the denoiser x0 = x - sigma v (ComfyUI's CONST calculate_denoised),
    on the unpacked latent x (B, 128, h, w), so fresh noise has ComfyUI's layout."""
    h, w = x.shape[2:]
    steps = len(sigma_list) - 1
    sigmas = torch.tensor(list(sigma_list), dtype=torch.float32, device=x.device)

    def denoise(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        xt = pack(x)
        v = velocity(xt, float(sigma))
        if not cfg_on:
            return unpack(xt - v * sigma, h, w)
        c, u = v.chunk(2)
        cond, uncond = xt - c * sigma, xt - u * sigma
        return unpack(uncond + (cond - uncond) * guidance, h, w)

    def callback(i: int, denoised: torch.Tensor) -> None:
        if preview is not None:
            preview(denoised, i + 1, steps)
        if progress is not None:
            progress(i + 1, steps)

    return samplers.run(sampler, denoise, x, sigmas, seed, callback)
