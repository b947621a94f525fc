"""Prompts built from the shipped workflows: text to image, base with a negative, edit, multi-reference."""

from __future__ import annotations

import json
from pathlib import Path

WORKFLOWS = Path(__file__).parent.parent / "workflows"


def build_prompt(text: str, *, width: int = 1024, height: int = 1024, seed: int = 0, steps: int | None = None,
                 guidance: float | None = None, negative: str | None = None, references: tuple[str, ...] = (),
                 transformer: str = "flux-2-klein-4b.safetensors", text_encoder: str = "qwen_3_4b.safetensors",
                 vae: str = "flux2-vae.safetensors", checkpoint: str | None = None) -> dict:
    """One of the shipped workflows (text to image, base with a negative, edit, multi-reference), filled in.

    `references` are names in the input folder. With `checkpoint` (an HF folder or a folder of the
    three files) one VGLoadCheckpoint replaces the three file loaders.
    """
    base = negative is not None
    name = "text_to_image_base" if base and not references else "multi_reference" if len(references) > 1 else \
        "edit" if references else "text_to_image"
    prompt = json.loads((WORKFLOWS / f"{name}.json").read_text())
    sampler = prompt["6"]["inputs"]
    sampler.update(seed=seed, steps=steps or (50 if base else 4),
                   guidance=guidance if guidance is not None else (4.0 if base else 1.0))
    prompt["4"]["inputs"]["text"] = text
    if base:
        if references:
            prompt["9"] = {"class_type": "VGTextEncode", "inputs": {"text_encoder": ["2", 0], "text": ""}}
            sampler["negative"] = ["9", 0]
        prompt["9"]["inputs"]["text"] = negative
    prompt["5"]["inputs"].update(width=width, height=height)
    refs = list(references)
    if len(refs) > 2:  # more references: chain further load + attach pairs
        for i, ref in enumerate(refs[2:], start=2):
            load, attach = f"{20 + 2 * i}", f"{21 + 2 * i}"
            prev = "13" if i == 2 else f"{21 + 2 * (i - 1)}"
            prompt[load] = {"class_type": "VGLoadImage", "inputs": {"image": ref}}
            prompt[attach] = {"class_type": "VGReferenceImage",
                              "inputs": {"conditioning": [prev, 0], "vae": ["3", 0], "image": [load, 0]}}
            sampler["positive"] = [attach, 0]
    for node, ref in zip(("10", "12"), refs, strict=False):
        prompt[node]["inputs"]["image"] = ref
    if checkpoint:
        prompt["1"] = {"class_type": "VGLoadCheckpoint", "inputs": {"path": checkpoint}}
        del prompt["2"], prompt["3"]
        for node in prompt.values():
            for k, v in node["inputs"].items():
                if isinstance(v, list) and v[0] in ("2", "3"):
                    node["inputs"][k] = ["1", {"2": 1, "3": 2}[v[0]]]
    else:
        prompt["1"]["inputs"]["file"] = transformer
        prompt["2"]["inputs"]["file"] = text_encoder
        prompt["3"]["inputs"]["file"] = vae
    return prompt
