"""`vramgraph demo`: the whole path on a machine without real weights.

Writes tiny random-weight models shaped like FLUX.2 [klein] (transformer, Qwen3 encoder, VAE) as a
ComfyUI `models/` folder with the real key names, then recognises, loads and runs them exactly as
`vramgraph generate` does: a text-to-image and an edit of that image. The pictures are noise (the
weights are random); what the demo shows is that the install, the loaders and the sampler work.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from .models.flux2 import KLEIN_4B, Flux2Transformer
from .models.qwen3 import Qwen3Config, Qwen3Encoder
from .models.vae import Flux2VAE, VAEConfig

TINY_QWEN3 = dataclasses.replace(Qwen3Config(), hidden_size=64, intermediate_size=128, num_layers=27, num_heads=4,
                                 num_kv_heads=2, head_dim=16)
TINY_TRANSFORMER = dataclasses.replace(KLEIN_4B, hidden=256, heads=2, depth_double=1, depth_single=2,
                                       context_dim=TINY_QWEN3.out_dim)
TINY_VAE = dataclasses.replace(VAEConfig(), channels=(32, 32, 64, 64), layers_per_block=1)


TINY_NAMES = {"transformer": "flux-2-klein-tiny.safetensors", "text_encoder": "qwen3-tiny.safetensors",
              "vae": "flux2-vae-tiny.safetensors"}


def write_tiny_models(models: Path, seed: int = 0, names: dict[str, str | list[str]] | None = None) -> Path:
    """A ComfyUI-style models/ folder holding tiny random-weight checkpoints; returns it.

    `names` gives the file name(s) per component ("transformer", "text_encoder", "vae"), so that a
    workflow's file names can be served by tiny models.
    """
    torch.manual_seed(seed)
    names = {**TINY_NAMES, **(names or {})}
    weights = {
        "transformer": ("diffusion_models", Flux2Transformer(TINY_TRANSFORMER).state_dict()),
        "text_encoder": ("text_encoders", {"model." + k: v for k, v in Qwen3Encoder(TINY_QWEN3).state_dict().items()}),
        "vae": ("vae", Flux2VAE(TINY_VAE).state_dict()),
    }
    parts = {}
    for kind, (folder, sd) in weights.items():
        for name in [names[kind]] if isinstance(names[kind], str) else names[kind]:
            parts[f"{folder}/{name}"] = sd
    for rel, sd in parts.items():
        path = models / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return models


SHIPPED_NAMES = {"transformer": ["flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"],
                 "text_encoder": "qwen_3_4b.safetensors", "vae": "flux2-vae.safetensors"}


def run_demo(out: Path, size: int = 256) -> tuple[list[Path], float]:
    """Tiny models under the shipped workflows' file names in `out/models`, then the shipped text-to-image
    workflow and an edit of its picture through the graph engine; returns the PNGs and the seconds taken."""
    import json
    import shutil

    from .graph.executor import Engine
    from .nodes.files import Folders

    workflows = Path(__file__).parent / "workflows"
    folders = Folders(models=(out / "models",), input=out / "input", output=out / "output", temp=out / "temp")
    write_tiny_models(out / "models", names=SHIPPED_NAMES)
    engine = Engine(folders)
    t0 = time.perf_counter()
    pngs = []
    for name in ("text_to_image", "edit"):
        prompt = json.loads((workflows / f"{name}.json").read_text())
        prompt["5"]["inputs"].update(width=size, height=size)
        if name == "edit":
            folders.input.mkdir(parents=True, exist_ok=True)
            shutil.copy(pngs[0], folders.input / "reference.png")
        pngs += engine.run(prompt).images
    return pngs, time.perf_counter() - t0
