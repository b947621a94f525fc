"""`vramgraph demo`: the whole path on a machine without real weights.

Writes tiny random-weight models shaped like FLUX.2 [klein] (transformer, Qwen3 encoder, VAE) as a
ComfyUI `models/` folder with the real key names (`models/tiny.py`), then recognises, loads and runs
them exactly as `vramgraph generate` does: a text-to-image and an edit of that image. The pictures are
noise (the weights are random); what the demo shows is that the install, the loaders and the sampler work.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..models.tiny import SHIPPED_NAMES, write_tiny_models


def run_demo(out: Path, size: int = 256) -> tuple[list[Path], float]:
    """Tiny models under the shipped workflows' file names in `out/models`, then the shipped text-to-image
    workflow and an edit of its picture through the graph engine; returns the PNGs and the seconds taken."""
    import json
    import shutil

    from ..graph.executor import Engine
    from ..nodes.files import Folders

    workflows = Path(__file__).parent.parent / "workflows"
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
