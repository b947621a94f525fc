"""SaveImage and PreviewImage: PNGs with ComfyUI-readable `prompt` and `workflow` text chunks.

Files are named as ComfyUI names them (`{prefix}_{counter:05}_.png`, the counter continuing after
the files already there); a prefix may name a subfolder but never leaves the output folder. Each PNG
is written to a temporary name and renamed, so a failed run never leaves a half-written image.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .comfy import context as comfy_context
from .types import IMAGE, STRING, Cost

if TYPE_CHECKING:
    import torch

COMPRESS_LEVEL = 1  # zlib level (ComfyUI: 4); on a smooth 1024² picture: files 16 % larger, written 10x faster
HIDDEN = {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO", "vg": "VG_CONTEXT"}


def _target(root: Path, prefix: str) -> tuple[Path, str]:
    folder = (root / prefix).parent.resolve()
    if not folder.is_relative_to(root.resolve()):
        raise ValueError(f"filename_prefix '{prefix}' points outside the output folder {root}; use a relative name")
    return folder, Path(prefix).name or "image"


def next_counter(folder: Path, name: str) -> int:
    pat = re.compile(re.escape(name) + r"_(\d+)_\.png$")
    found = [int(m.group(1)) for p in folder.glob(f"{name}_*_.png") if (m := pat.match(p.name))]
    return max(found, default=0) + 1


def save_images(images: torch.Tensor, root: Path, prefix: str, kind: str, prompt: Any = None,
                extra_pnginfo: dict | None = None, seed: int | None = None) -> list[dict]:
    """Write one PNG per image; return ComfyUI's ui entries {filename, subfolder, type}."""
    from . import ops, png

    root = Path(root)
    folder, name = _target(root, prefix)
    folder.mkdir(parents=True, exist_ok=True)
    text = {}
    if prompt is not None:
        text["prompt"] = json.dumps(prompt)
    for key, value in (extra_pnginfo or {}).items():
        text[key] = json.dumps(value)
    if seed is not None:
        text["seed"] = str(seed)
    counter = next_counter(folder, name)
    results = []
    for pixels in ops.to_uint8(images):
        path = folder / f"{name}_{counter:05}_.png"
        png.write(path, pixels, text, COMPRESS_LEVEL)
        sub = folder.relative_to(root.resolve()).as_posix()
        results.append({"filename": path.name, "subfolder": "" if sub == "." else sub, "type": kind})
        counter += 1
    return results


class SaveImage:
    CATEGORY = "image"
    RETURN_TYPES = ()
    FUNCTION = "save_images"
    OUTPUT_NODE = True
    KIND = "output"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"images": (IMAGE,), "filename_prefix": (STRING, {"default": "ComfyUI"})},
                "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, images: Any, filename_prefix: str = "ComfyUI") -> Cost:
        return Cost(())

    def save_images(self, images: torch.Tensor, filename_prefix: str = "ComfyUI", prompt: Any = None,
                    extra_pnginfo: dict | None = None, vg: Any = None) -> dict:
        vg = vg or comfy_context(self)
        root = vg.output_dir if self.KIND == "output" else vg.temp_dir
        results = save_images(images, root, filename_prefix, self.KIND, prompt, extra_pnginfo, vg.seed)
        return {"ui": {"images": results}}


class PreviewImage(SaveImage):
    KIND = "temp"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"images": (IMAGE,)}, "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, images: Any) -> Cost:
        return Cost(())

    def save_images(self, images: torch.Tensor, filename_prefix: str = "ComfyUI_temp", prompt: Any = None,
                    extra_pnginfo: dict | None = None, vg: Any = None) -> dict:
        return super().save_images(images, "ComfyUI_temp_preview", prompt, extra_pnginfo, vg)
