"""SaveImage and PreviewImage: PNGs with ComfyUI-readable `prompt` and `workflow` text chunks.

As ComfyUI's nodes.py and folder_paths.get_save_image_path do it:
- files are named `{prefix}_{counter:05}_.png`, the counter one past the highest of the files already
  there whose name is `{prefix}_<digits>_...` (any extension); `%width%`, `%height%`, `%year%`, `%month%`,
  `%day%`, `%hour%`, `%minute%`, `%second%` in the prefix and `%batch_num%` in its last part are filled in;
  a prefix may name a subfolder (the ui entry's `subfolder`) but never leaves the output folder;
- the text chunks are `prompt` (the API-format prompt, `json.dumps`) and then one per `extra_pnginfo` key
  (the front end sends `workflow`, the UI-format graph), each `json.dumps`; we add `seed`;
- SaveImage writes to the output folder (ui type "output"); PreviewImage to the temp folder (type "temp")
  under the prefix `ComfyUI_temp_` + five random letters, drawn anew for each node instance.
Each PNG is written to a temporary name and renamed, so a failed run never leaves a half-written image.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .context import Context
from .declared import SAVE_PREFIX_TIP
from .types import IMAGE, STRING, Cost

if TYPE_CHECKING:
    import torch

COMPRESS_LEVEL = 1  # zlib level (ComfyUI: 4); on a smooth 1024² picture: files 16 % larger, written 10x faster
HIDDEN = {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO", "vg": "VG_CONTEXT"}


TEMP_LETTERS = "abcdefghijklmnopqrstupvxyz"  # ComfyUI's alphabet for PreviewImage's prefix (its "u" twice, no "w")


def fill_prefix(prefix: str, width: int, height: int, now: time.struct_time | None = None) -> str:
    """ComfyUI's server-side prefix variables (%width%, %height% of the first image; the local time's parts)."""
    if "%" not in prefix:
        return prefix
    t = now or time.localtime()
    for key, value in (("width", width), ("height", height), ("year", t.tm_year), ("month", f"{t.tm_mon:02}"),
                       ("day", f"{t.tm_mday:02}"), ("hour", f"{t.tm_hour:02}"), ("minute", f"{t.tm_min:02}"),
                       ("second", f"{t.tm_sec:02}")):
        prefix = prefix.replace(f"%{key}%", str(value))
    return prefix


def _target(root: Path, prefix: str) -> tuple[Path, str]:
    folder = (root / prefix).parent.resolve()
    if not folder.is_relative_to(root.resolve()):
        raise ValueError(f"filename_prefix '{prefix}' points outside the output folder {root}; use a relative name")
    return folder, Path(prefix).name or "image"


def next_counter(folder: Path, name: str) -> int:
    """One past the highest counter of the files `{name}_<digits>` or `{name}_<digits>_...` in `folder`."""
    pat = re.compile(re.escape(name) + r"_(\d+)(?:_|$)")
    try:
        found = [int(m.group(1)) for p in folder.iterdir() if (m := pat.match(p.name))]
    except FileNotFoundError:
        return 1
    return max(found, default=0) + 1


def save_images(images: torch.Tensor, root: Path, prefix: str, kind: str, prompt: Any = None,
                extra_pnginfo: dict | None = None, seed: int | None = None) -> list[dict]:
    """Write one PNG per image; return ComfyUI's ui entries {filename, subfolder, type}."""
    from . import ops, png

    root = Path(root)
    if len(images):
        prefix = fill_prefix(prefix, int(images[0].shape[1]), int(images[0].shape[0]))
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
    for batch_number, pixels in enumerate(ops.to_uint8(images)):
        path = folder / f"{name.replace('%batch_num%', str(batch_number))}_{counter:05}_.png"
        png.write(path, pixels, text, COMPRESS_LEVEL)
        sub = folder.relative_to(root.resolve()).as_posix()
        results.append({"filename": path.name, "subfolder": "" if sub == "." else sub, "type": kind})
        counter += 1
    return results


class SaveImage:
    """ComfyUI's SaveImage: PNGs in the output folder, and (as ComfyUI 0.29) the images passed on unchanged."""

    CATEGORY = "image"
    DESCRIPTION = "Saves the input images to your ComfyUI output directory."
    RETURN_TYPES = (IMAGE,)
    RETURN_NAMES = ("images",)
    FUNCTION = "save_images"
    OUTPUT_NODE = True
    KIND = "output"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"images": (IMAGE, {"tooltip": "The images to save."}),
                             "filename_prefix": (STRING, {"default": "ComfyUI", "tooltip": SAVE_PREFIX_TIP})},
                "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, images: Any, filename_prefix: str = "ComfyUI") -> Cost:
        return Cost((images,))

    def save_images(self, images: torch.Tensor, filename_prefix: str = "ComfyUI", prompt: Any = None,
                    extra_pnginfo: dict | None = None, *, vg: Context) -> dict:
        root = vg.output_dir if self.KIND == "output" else vg.temp_dir
        results = save_images(images, root, filename_prefix, self.KIND, prompt, extra_pnginfo, vg.seed)
        return {"ui": {"images": results}, "result": (images,)}


class PreviewImage(SaveImage):
    """ComfyUI's PreviewImage: PNGs in the temp folder, shown on the node; the images passed on unchanged."""

    DESCRIPTION = "Preview the images without saving them to the ComfyUI output directory."
    KIND = "temp"

    def __init__(self) -> None:
        self.prefix_append = "_temp_" + "".join(random.choice(TEMP_LETTERS) for _ in range(5))

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"images": (IMAGE,)}, "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, images: Any) -> Cost:
        return Cost((images,))

    def save_images(self, images: torch.Tensor, filename_prefix: str = "ComfyUI", prompt: Any = None,
                    extra_pnginfo: dict | None = None, *, vg: Context) -> dict:
        return super().save_images(images, filename_prefix + self.prefix_append, prompt, extra_pnginfo, vg=vg)
