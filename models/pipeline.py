"""Text-to-image and reference editing with all three models resident: plain functions over loaded models.

This is the whole generation in one call, for the command line and for benchmarks. The graph
engine runs the same steps as separate nodes (encode, sample, decode) so it can plan memory
between them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from . import loading
from .flux2 import Flux2Transformer
from .qwen3 import PromptTokenizer, Qwen3Encoder, encode_prompts
from .sampling import Progress, latent_size, noise, pack_references, prepare_reference, sample, sigmas
from .vae import Flux2VAE

log = logging.getLogger(__name__)

DISTILLED_STEPS, DISTILLED_GUIDANCE = 4, 1.0
BASE_STEPS, BASE_GUIDANCE = 50, 4.0


@dataclass
class Flux2Models:
    """The three loaded components of one FLUX.2 [klein] model, and its tokenizer."""

    transformer: Flux2Transformer
    text_encoder: Qwen3Encoder
    vae: Flux2VAE
    tokenizer: PromptTokenizer
    distilled: bool = True


def load_models(paths: loading.ModelSpec | str | Path | Sequence[str | Path], *,
                dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Flux2Models:
    """Load every component of a spec (or of the checkpoints at `paths`) onto `device`."""
    spec = paths if isinstance(paths, loading.ModelSpec) else loading.inspect(paths)
    note = loading.gguf_tokenizer_note(spec.text_encoder, spec.tokenizer)
    if note:
        log.info("%s", note)
    return Flux2Models(
        transformer=loading.load(spec.component("transformer"), dtype=dtype, device=device),
        text_encoder=loading.load(spec.component("text_encoder"), dtype=dtype, device=device),
        vae=loading.load(spec.component("vae"), dtype=dtype, device=device),
        tokenizer=PromptTokenizer.find(spec.tokenizer),
        distilled=spec.distilled,
    )


@torch.no_grad()
def encode_references(models: Flux2Models, images: Sequence[Image.Image]) -> list[torch.Tensor]:
    """Normalised latents (1, 128, h, w) of reference images, each prepared as the references are."""
    w = next(models.vae.parameters())
    return [models.vae.encode(prepare_reference(im).to(w.device, w.dtype)) for im in images]


@torch.no_grad()
def generate(models: Flux2Models, prompt: str | Sequence[str], *, width: int = 1024, height: int = 1024,
             seed: int = 0, steps: int | None = None, guidance: float | None = None, negative: str = "",
             references: Sequence[Image.Image] = (), progress: Progress | None = None,
             kv_cache: bool = False) -> torch.Tensor:
    """Pixels (B, 3, height, width) in about [-1, 1] for one or several prompts (one image each).

    Distilled models default to 4 steps without guidance; base models to 50 steps with classifier-
    free guidance 4.0 against `negative`. With references the model edits/combines them; the output
    size is still `width` x `height`. kv_cache: the references' keys and values cached on the first step, as
    ComfyUI's FluxKVCache does for klein-9B-kv (models.sampling.sample).
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    steps = steps if steps is not None else (DISTILLED_STEPS if models.distilled else BASE_STEPS)
    guidance = guidance if guidance is not None else (DISTILLED_GUIDANCE if models.distilled else BASE_GUIDANCE)
    h, w = latent_size(width, height)
    context = encode_prompts(models.text_encoder, models.tokenizer, prompts)
    neg = encode_prompts(models.text_encoder, models.tokenizer, [negative] * len(prompts)) if guidance != 1.0 else None
    refs = pack_references(encode_references(models, references)) if references else None
    start = noise(seed, len(prompts), h, w)
    latent = sample(models.transformer, start, context, sigmas(steps, h * w), negative=neg, guidance=guidance,
                    references=refs, progress=progress, kv_cache=kv_cache)
    v = next(models.vae.parameters())
    return models.vae.decode(latent.to(v.device, v.dtype))
