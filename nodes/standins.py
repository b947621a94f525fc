"""Stand-in input images for planning a workflow whose images are not here (ComfyUI's edit templates name pictures
the user has not got yet): `stand_ins(prompts, nodes, folders, folder)` writes, into `folder`, a black PNG of the
size it can infer for every missing image (the workflow's latent size when it gives one as a literal, else
1024x1024, the size the klein templates scale references to) and links the images that are there, so the plan
sees every input; it returns one note per stand-in saying what was assumed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import Folders, safe_name
from .sources import file_inputs

SIZE_NODES = ("EmptyFlux2LatentImage", "VGEmptyLatent", "EmptyLatentImage", "EmptySD3LatentImage")
DEFAULT_SIDE = 1024


@dataclass(frozen=True)
class StandIn:
    """A missing input image planned as a black picture of `size` (width, height)."""

    node: str
    class_type: str
    name: str
    size: tuple[int, int]

    def note(self, input_dir: Path) -> str:
        return (f"node {self.node} ({self.class_type}): image '{self.name}' is not in {input_dir}: planned as a "
                f"{self.size[0]}x{self.size[1]} image; put it there to plan with its real size")


def _latent_size(prompt: Mapping[str, Any]) -> tuple[int, int] | None:
    for node in prompt.values():
        inputs = node.get("inputs", {}) if isinstance(node, Mapping) else {}
        w, h = inputs.get("width"), inputs.get("height")
        if node.get("class_type") in SIZE_NODES and type(w) is int and type(h) is int:
            return w, h
    return None


def missing_images(prompts: Sequence[Mapping[str, Any]], nodes: Mapping[str, type], folders: Folders
                   ) -> list[StandIn]:
    """The input images the prompts load that the input folder lacks, each with the size it will be planned at."""
    found: dict[str, StandIn] = {}
    for prompt in prompts:
        size = _latent_size(prompt) or (DEFAULT_SIDE, DEFAULT_SIDE)
        for nid, node in prompt.items():
            cls = nodes.get(node.get("class_type")) if isinstance(node, Mapping) else None
            if cls is None:
                continue
            for name, folder in file_inputs(cls).items():
                value = node.get("inputs", {}).get(name)
                if folder == "input" and isinstance(value, str) and safe_name(value) and value not in found \
                        and not (folders.input / value).is_file():
                    found[value] = StandIn(str(nid), node["class_type"], value, size)
    return list(found.values())


def stand_ins(prompts: Sequence[Mapping[str, Any]], nodes: Mapping[str, type], folders: Folders, folder: Path
              ) -> tuple[Folders, list[str]]:
    """Folders whose input folder is `folder`, holding the prompts' images (links to those that are there, black
    stand-ins for the others), and the notes of the stand-ins; `folders` itself and no notes when none is missing."""
    from PIL import Image

    missing = missing_images(prompts, nodes, folders)
    if not missing:
        return folders, []
    for entry in folders.input.iterdir() if folders.input.is_dir() else ():  # files and subfolders, as they are
        os.symlink(entry.resolve(), folder / entry.name)
    for s in missing:
        target = folder / s.name
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", s.size).save(target, format="PNG")
    from dataclasses import replace

    return replace(folders, input=folder), [s.note(folders.input) for s in missing]
