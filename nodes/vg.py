"""Our own node set, `VG`-prefixed: what a FLUX.2 [klein] graph needs, with fewer wires than ComfyUI's.

Model handles use VG_MODEL / VG_CLIP / VG_VAE so that inside ComfyUI they never meet ComfyUI's own
MODEL/CLIP/VAE objects; IMAGE and LATENT follow ComfyUI's conventions and connect to core nodes.
"""

from __future__ import annotations

from typing import Any

from . import core
from .context import Context
from .files import file_list
from .output import PreviewImage, SaveImage
from .types import (
    CONDITIONING,
    FLOAT,
    IMAGE,
    INT,
    LATENT,
    STRING,
    VG_CLIP,
    VG_MODEL,
    VG_VAE,
    CondInfo,
    Cost,
    ImageInfo,
    LatentInfo,
    ModelInfo,
)
from .values import ModelHandle, Noise, with_reference

CATEGORY = "vramgraph"
HIDDEN = core.HIDDEN


class VGLoadCheckpoint:
    """A whole FLUX.2 [klein] model: a folder from checkpoints/ or diffusers/ of the models folders (an HF diffusers
    folder, a folder of the three files, or a ComfyUI-style models folder). Only listed folders load."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (VG_MODEL, VG_CLIP, VG_VAE)
    RETURN_NAMES = ("model", "text_encoder", "vae")
    FUNCTION = "load"
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"checkpoint": (file_list(folders, "checkpoints"),)}, "hidden": HIDDEN}

    @classmethod
    def VALIDATE_INPUTS(cls, checkpoint: str = "", folders: Any = None) -> bool | str:
        return core.file_check(folders, "checkpoints", checkpoint)

    @classmethod
    def vg_estimate(cls, env: Any, checkpoint: str) -> Cost:
        return Cost(tuple(env.checkpoint_infos(checkpoint)))

    @classmethod
    def IS_CHANGED(cls, checkpoint: str, folders: Any = None, **_: Any) -> str:
        return core.file_changed(folders, "checkpoints", checkpoint)

    def load(self, checkpoint: str, *, vg: Context) -> tuple:
        tr, te, vae = vg.checkpoint_infos(checkpoint)
        return (ModelHandle(tr), ModelHandle(te, vg.tokenizer_for(te)), ModelHandle(vae))


def _file_loader(name: str, kind: str, folder: str, io: str, doc: str) -> type:
    def inputs(cls: type, folders: Any = None) -> dict:
        return {"required": {"file": (file_list(folders, folder),)}, "hidden": HIDDEN}

    def estimate(cls: type, env: Any, file: str) -> Cost:
        return Cost((env.model_info(kind, file),))

    def load(self: Any, file: str, *, vg: Context) -> tuple:
        info = vg.model_info(kind, file)
        return (ModelHandle(info, vg.tokenizer_for(info) if kind == "text_encoder" else None),)

    def changed(cls: type, file: str, folders: Any = None, **_: Any) -> str:
        return core.file_changed(folders, folder, file)

    def check(cls: type, file: str = "", folders: Any = None) -> bool | str:
        return core.file_check(folders, folder, file)

    return type(name, (), {"CATEGORY": CATEGORY, "RETURN_TYPES": (io,), "FUNCTION": "load", "DESCRIPTION": doc,
                           "INPUT_TYPES": classmethod(inputs), "vg_estimate": classmethod(estimate), "load": load,
                           "IS_CHANGED": classmethod(changed), "VALIDATE_INPUTS": classmethod(check),
                           "__doc__": doc})


VGLoadTransformer = _file_loader("VGLoadTransformer", "transformer", "diffusion_models", VG_MODEL,
                                 "The FLUX.2 [klein] transformer from a file in diffusion_models/.")
VGLoadTextEncoder = _file_loader("VGLoadTextEncoder", "text_encoder", "text_encoders", VG_CLIP,
                                 "The Qwen3 text encoder from a file in text_encoders/.")
VGLoadVAE = _file_loader("VGLoadVAE", "vae", "vae", VG_VAE, "The FLUX.2 VAE from a file in vae/.")


class VGTextEncode(core.CLIPTextEncode):
    """A prompt -> conditioning (Qwen3 layers 9, 18, 27; 512 tokens)."""

    CATEGORY = CATEGORY
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"text_encoder": (VG_CLIP,), "text": (STRING, {"multiline": True})}, "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, text_encoder: ModelInfo, text: Any) -> Cost:
        return super().vg_estimate(env, text, text_encoder)

    def encode(self, text_encoder: ModelHandle, text: str, *, vg: Context) -> tuple:
        return super().encode(text, text_encoder, vg=vg)


class VGEmptyLatent(core.EmptyFlux2LatentImage):
    """An empty latent of the picture's size (multiples of 16)."""

    CATEGORY = CATEGORY
    DESCRIPTION = __doc__


class VGSampler:
    """Sampling in one node: seed, steps and guidance; a negative prompt only matters with guidance != 1."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (LATENT,)
    FUNCTION = "sample"
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {
            "model": (VG_MODEL,), "positive": (CONDITIONING,), "latent": (LATENT,),
            "seed": (INT, {"default": 0, "min": 0, "max": core.SEED_MAX, "control_after_generate": True}),
            "steps": (INT, {"default": 4, "min": 1, "max": 1000}),
            "guidance": (FLOAT, {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.1})},
            "optional": {"negative": (CONDITIONING,)}, "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, model: ModelInfo, positive: CondInfo, latent: LatentInfo, seed: int, steps: int,
                    guidance: float, negative: CondInfo | None = None) -> Cost:
        return core._sampling_cost(model, positive, negative, guidance, latent, steps, (latent,))

    def sample(self, model: ModelHandle, positive: list, latent: dict, seed: int, steps: int, guidance: float,
               negative: list | None = None, *, vg: Context) -> tuple:
        from ..models.sampling import sigmas

        h, w = latent["samples"].shape[2:]
        sig = sigmas(steps, h * w)
        return (core._sample(vg, model, Noise(seed), latent, positive, negative, guidance, sig)[0],)


class VGReferenceImage:
    """Attach a reference image for editing: scaled to at most 1024² (multiples of 16), encoded, appended."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (CONDITIONING,)
    FUNCTION = "reference"
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"conditioning": (CONDITIONING,), "vae": (VG_VAE,), "image": (IMAGE,)},
                "hidden": HIDDEN}

    @staticmethod
    def _size(image: ImageInfo) -> tuple[int, int]:
        w, h = image.width, image.height
        if w * h > 1024 * 1024:
            s = (1024 * 1024 / (w * h)) ** 0.5
            w, h = max(16, int(w * s)), max(16, int(h * s))
        return max(16, w // 16 * 16), max(16, h // 16 * 16)

    @classmethod
    def vg_estimate(cls, env: Any, conditioning: CondInfo, vae: ModelInfo, image: ImageInfo) -> Cost:
        w, h = cls._size(image)
        refs = conditioning.refs + ((h // 16, w // 16),) * image.batch
        return Cost((CondInfo(conditioning.batch, conditioning.tokens, refs),),
                    (core.estimates.vae_encode(vae, 1, h, w),))

    def reference(self, conditioning: list, vae: ModelHandle, image: Any, *, vg: Context) -> tuple:
        from ..models.sampling import prepare_reference
        from . import ops

        module = vg.module(vae)
        for pil in ops.to_pil(image):
            pixels = prepare_reference(pil)
            lat = module.encode(pixels.to(next(module.parameters()).device), vg.check_interrupted).float().cpu()
            conditioning = with_reference(conditioning, lat)
        return (conditioning,)


class VGVAEDecode(core.VAEDecode):
    """Latent -> image; the plan picks a full GPU, tiled or CPU decode ahead of time."""

    CATEGORY = CATEGORY
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"samples": (LATENT,), "vae": (VG_VAE,)}, "hidden": HIDDEN}


class VGVAEEncode(core.VAEEncode):
    """Image -> latent (cropped to multiples of 16)."""

    CATEGORY = CATEGORY
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"pixels": (IMAGE,), "vae": (VG_VAE,)}, "hidden": HIDDEN}


class VGLoadImage(core.LoadImage):
    """An image from the input folder (IMAGE and MASK, as ComfyUI's LoadImage)."""

    CATEGORY = CATEGORY
    DESCRIPTION = __doc__


class VGSaveImage(SaveImage):
    """Save PNGs with the workflow and the seed in their metadata."""

    CATEGORY = CATEGORY
    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"images": (IMAGE,), "filename_prefix": (STRING, {"default": "vramgraph"})},
                "hidden": core.HIDDEN | {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}}


class VGPreviewImage(PreviewImage):
    """Show images without keeping them (temp folder)."""

    CATEGORY = CATEGORY
    DESCRIPTION = __doc__


NODES = {c.__name__: c for c in (VGLoadCheckpoint, VGLoadTransformer, VGLoadTextEncoder, VGLoadVAE, VGTextEncode,
                                 VGEmptyLatent, VGSampler, VGReferenceImage, VGVAEDecode, VGVAEEncode, VGLoadImage,
                                 VGSaveImage, VGPreviewImage)}
DISPLAY_NAMES = {
    "VGLoadCheckpoint": "Load FLUX.2 klein (folder)", "VGLoadTransformer": "Load Transformer",
    "VGLoadTextEncoder": "Load Text Encoder", "VGLoadVAE": "Load VAE", "VGTextEncode": "Text Encode",
    "VGEmptyLatent": "Empty Latent", "VGSampler": "Sampler", "VGReferenceImage": "Reference Image",
    "VGVAEDecode": "VAE Decode", "VGVAEEncode": "VAE Encode", "VGLoadImage": "Load Image",
    "VGSaveImage": "Save Image", "VGPreviewImage": "Preview Image",
}
DISPLAY_NAMES = {k: f"{v} (vramgraph)" for k, v in DISPLAY_NAMES.items()}
