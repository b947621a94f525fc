"""Prompts built from the shipped workflows: text to image, base with a negative, edit, multi-reference.

The workflow is filled in by the roles its nodes play, found from their class types and links, never from
fixed node ids: the sampler (`VGSampler`), the positive prompt (the `VGTextEncode` at the end of the sampler's
positive chain of `VGReferenceImage`s), the negative prompt (the sampler's `negative`), the latent size
(`VGEmptyLatent`), the three loaders and the reference images' `VGLoadImage`s, in the chain's order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

WORKFLOWS = Path(__file__).parents[2] / "workflows"
LOADERS = {"transformer": "VGLoadTransformer", "text_encoder": "VGLoadTextEncoder", "vae": "VGLoadVAE"}


@dataclass(frozen=True)
class Roles:
    """Node ids by role in one prompt."""

    sampler: str
    positive: str  # the VGTextEncode of the prompt
    negative: str | None
    latent: str
    loaders: Mapping[str, str]  # transformer / text_encoder / vae -> loader node id
    references: tuple[tuple[str, str], ...]  # (VGReferenceImage id, its VGLoadImage id), first attached first
    save: str


def _only(prompt: Mapping[str, dict], class_type: str, name: str) -> str:
    ids = [i for i, n in prompt.items() if n.get("class_type") == class_type]
    if len(ids) != 1:
        raise ValueError(f"{name}: the workflow needs exactly one {class_type} node, it has {len(ids)}")
    return ids[0]


def _source(prompt: Mapping[str, dict], node: str, name: str) -> str | None:
    v = prompt[node]["inputs"].get(name)
    return v[0] if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and v[0] in prompt else None


def find_roles(prompt: Mapping[str, dict], name: str = "workflow") -> Roles:
    """The role of each node of a klein workflow of VG nodes; a ValueError names what is missing."""
    sampler = _only(prompt, "VGSampler", name)
    refs: list[tuple[str, str]] = []
    node = _source(prompt, sampler, "positive")
    while node is not None and prompt[node]["class_type"] == "VGReferenceImage":
        image = _source(prompt, node, "image")
        if image is None or prompt[image]["class_type"] != "VGLoadImage":
            raise ValueError(f"{name}: reference node {node} does not take its image from a VGLoadImage")
        refs.append((node, image))
        node = _source(prompt, node, "conditioning")
    if node is None or prompt[node]["class_type"] != "VGTextEncode":
        raise ValueError(f"{name}: the sampler's positive input does not come from a VGTextEncode")
    negative = _source(prompt, sampler, "negative")
    if negative is not None and prompt[negative]["class_type"] != "VGTextEncode":
        raise ValueError(f"{name}: the sampler's negative input does not come from a VGTextEncode")
    latent = _source(prompt, sampler, "latent")
    if latent is None or prompt[latent]["class_type"] != "VGEmptyLatent":
        raise ValueError(f"{name}: the sampler's latent does not come from a VGEmptyLatent")
    loaders = {kind: _only(prompt, cls, name) for kind, cls in LOADERS.items()}
    return Roles(sampler, node, negative, latent, loaders, tuple(reversed(refs)), _only(prompt, "VGSaveImage", name))


def _fresh(prompt: Mapping[str, dict]) -> str:
    return str(max((int(i) for i in prompt if i.isdigit()), default=0) + 1)


def build_prompt(text: str, *, width: int = 1024, height: int = 1024, seed: int = 0, steps: int | None = None,
                 guidance: float | None = None, negative: str | None = None, references: tuple[str, ...] = (),
                 transformer: str = "flux-2-klein-4b.safetensors", text_encoder: str = "qwen_3_4b.safetensors",
                 vae: str = "flux2-vae.safetensors", checkpoint: str | None = None,
                 loras: tuple[tuple[str, float], ...] = ()) -> dict:
    """One of the shipped workflows (text to image, base with a negative, edit, multi-reference), filled in.

    `references` are names in the input folder. With `checkpoint` (the name of a checkpoint folder in the
    checkpoints list) one VGLoadCheckpoint replaces the three file loaders. `loras`: (name in the loras list,
    strength) chained by VGLoraLoader nodes onto the model and the text encoder.
    """
    base = negative is not None
    name = "text_to_image_base" if base and not references else "multi_reference" if len(references) > 1 else \
        "edit" if references else "text_to_image"
    prompt = json.loads((WORKFLOWS / f"{name}.json").read_text())
    roles = find_roles(prompt, f"{name}.json")
    sampler = prompt[roles.sampler]["inputs"]
    sampler.update(seed=seed, steps=steps or (50 if base else 4),
                   guidance=guidance if guidance is not None else (4.0 if base else 1.0))
    prompt[roles.positive]["inputs"]["text"] = text
    if base:
        neg = roles.negative
        if neg is None:
            neg = _fresh(prompt)
            prompt[neg] = {"class_type": "VGTextEncode", "inputs": {"text_encoder": [roles.loaders["text_encoder"], 0],
                                                                    "text": ""}, "_meta": {"title": "Negative prompt"}}
            sampler["negative"] = [neg, 0]
        prompt[neg]["inputs"]["text"] = negative
    prompt[roles.latent]["inputs"].update(width=width, height=height)
    chain = list(roles.references)
    for ref in references[len(chain):]:  # more references than the workflow has: chain further load + attach pairs
        load = _fresh(prompt)
        prompt[load] = {"class_type": "VGLoadImage", "inputs": {"image": ref}}
        attach = _fresh(prompt)
        prompt[attach] = {"class_type": "VGReferenceImage", "inputs": {
            "conditioning": [chain[-1][0], 0], "vae": [roles.loaders["vae"], 0], "image": [load, 0]}}
        sampler["positive"] = [attach, 0]
        chain.append((attach, load))
    for (_, load), ref in zip(chain, references, strict=False):
        prompt[load]["inputs"]["image"] = ref
    if checkpoint:
        ids = roles.loaders
        slot = {ids["transformer"]: 0, ids["text_encoder"]: 1, ids["vae"]: 2}
        for node_id in ids.values():
            del prompt[node_id]
        loader = ids["transformer"]
        prompt[loader] = {"class_type": "VGLoadCheckpoint", "inputs": {"checkpoint": checkpoint},
                          "_meta": {"title": "Checkpoint"}}
        for node in prompt.values():
            for k, v in node["inputs"].items():
                if isinstance(v, list) and len(v) == 2 and v[0] in slot:
                    node["inputs"][k] = [loader, slot[v[0]]]
    else:
        for kind, file in (("transformer", transformer), ("text_encoder", text_encoder), ("vae", vae)):
            prompt[roles.loaders[kind]]["inputs"]["file"] = file
    return _chain_loras(prompt, roles.sampler, loras)


def _chain_loras(prompt: dict, sampler: str, loras: tuple[tuple[str, float], ...]) -> dict:
    """VGLoraLoader nodes between the model and text encoder sources and their consumers, in the given order."""
    if not loras:
        return prompt
    model = list(prompt[sampler]["inputs"]["model"])
    encoders = [n for n, node in prompt.items() if node["class_type"] == "VGTextEncode"]
    clip = list(prompt[encoders[0]]["inputs"]["text_encoder"])
    for name, strength in loras:
        node = _fresh(prompt)
        prompt[node] = {"class_type": "VGLoraLoader", "inputs": {
            "model": model, "clip": clip, "lora_name": name, "strength_model": strength, "strength_clip": strength},
            "_meta": {"title": f"LoRA {name}"}}
        model, clip = [node, 0], [node, 1]
    prompt[sampler]["inputs"]["model"] = model
    for n in encoders:
        prompt[n]["inputs"]["text_encoder"] = clip
    return prompt
