"""ComfyUI-GGUF's loader nodes (city96/ComfyUI-GGUF: `UnetLoaderGGUF`, `UnetLoaderGGUFAdvanced`, `CLIPLoaderGGUF`),
run by our engine on our GGUF support (models/gguf.py), so that a workflow saved with that pack runs unchanged.

Same class names, input names and order as the pack. Registered only in our engine, never inside ComfyUI, where
the pack's own classes are the real ones (our pack registers VG-named nodes only; the VG loaders read .gguf files
too). The pack's GGUF folders (`unet_gguf`, `clip_gguf`) are ComfyUI's diffusion_models/unet and
text_encoders/clip folders: `.gguf` files in them.

The pack's advanced inputs are accepted and need no effect here: `dequant_dtype` (ours always dequantizes in fp32,
bit for bit the `gguf` package's values, and casts once to the compute dtype, which no choice of the pack's would
make more precise), `patch_dtype` and `patch_on_device` (LoRA patches on GGUF weights).
"""

from __future__ import annotations

from typing import Any

from .context import Context
from .core import HIDDEN, clip_check, clip_placed, file_changed, file_check
from .declared import CLIP_TYPES
from .files import file_list
from .types import CLIP, MODEL, Cost
from .values import ModelHandle

CATEGORY = "bootleg"  # the pack's category
DTYPES = ["default", "target", "float32", "float16", "bfloat16"]  # UnetLoaderGGUFAdvanced's dequant/patch dtypes


def gguf_list(folders: Any, folder: str) -> list[str]:
    """The `.gguf` files of a model folder (what the pack's `unet_gguf` / `clip_gguf` lists show)."""
    return [n for n in file_list(folders, folder) if n.lower().endswith(".gguf")]


def _gguf_check(folders: Any, folder: str, name: str, node: str, other: str) -> bool | str:
    if name and not name.lower().endswith(".gguf"):
        return f"{node} loads .gguf files; '{name}' is not one: choose a .gguf file or load it with {other}"
    return file_check(folders, folder, name)


class UnetLoaderGGUF:
    """The FLUX.2 [klein] transformer from a .gguf file in diffusion_models/ (or unet/)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (MODEL,)
    FUNCTION = "load_unet"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"unet_name": (gguf_list(folders, "diffusion_models"),)}, "hidden": HIDDEN}

    @classmethod
    def VALIDATE_INPUTS(cls, unet_name: str = "", folders: Any = None) -> bool | dict[str, str]:
        found = _gguf_check(folders, "diffusion_models", unet_name, cls.__name__, "UNETLoader")
        return True if found is True else {"unet_name": found}

    @classmethod
    def vg_estimate(cls, env: Any, unet_name: str, **_: Any) -> Cost:
        return Cost((env.model_info("transformer", unet_name, "default"),))

    @classmethod
    def IS_CHANGED(cls, unet_name: str, folders: Any = None, **_: Any) -> str:
        return file_changed(folders, "diffusion_models", unet_name)

    def load_unet(self, unet_name: str, dequant_dtype: str | None = None, patch_dtype: str | None = None,
                  patch_on_device: bool | None = None, *, vg: Context) -> tuple:
        return (ModelHandle(vg.model_info("transformer", unet_name, "default")),)


class UnetLoaderGGUFAdvanced(UnetLoaderGGUF):
    """UnetLoaderGGUF with the pack's dtype and patch options (accepted; see the module's docstring)."""

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"unet_name": (gguf_list(folders, "diffusion_models"),),
                             "dequant_dtype": (DTYPES, {"default": "default"}),
                             "patch_dtype": (DTYPES, {"default": "default"}),
                             "patch_on_device": ("BOOLEAN", {"default": False})}, "hidden": HIDDEN}


class CLIPLoaderGGUF:
    """The Qwen3 text encoder from a file in text_encoders/ (or clip/): .gguf, or a file CLIPLoader reads."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (CLIP,)
    FUNCTION = "load_clip"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"clip_name": (file_list(folders, "text_encoders"),), "type": (list(CLIP_TYPES),)},
                "hidden": HIDDEN}  # the pack lists CLIPLoader's `type`

    @classmethod
    def VALIDATE_INPUTS(cls, clip_name: str = "", type: str = "flux2", folders: Any = None
                        ) -> bool | dict[str, str]:
        return clip_check(folders, clip_name, type)

    @classmethod
    def vg_estimate(cls, env: Any, clip_name: str, type: str = "flux2") -> Cost:
        return Cost((clip_placed(env.model_info("text_encoder", clip_name), "default"),))

    @classmethod
    def IS_CHANGED(cls, clip_name: str, folders: Any = None, **_: Any) -> str:
        return file_changed(folders, "text_encoders", clip_name)

    def load_clip(self, clip_name: str, type: str = "flux2", *, vg: Context) -> tuple:
        info = vg.model_info("text_encoder", clip_name)
        return (ModelHandle(info, vg.tokenizer_for(info)),)


NODES: dict[str, type] = {"UnetLoaderGGUF": UnetLoaderGGUF, "UnetLoaderGGUFAdvanced": UnetLoaderGGUFAdvanced,
                          "CLIPLoaderGGUF": CLIPLoaderGGUF}
