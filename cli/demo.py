"""`vramgraph demo`: the whole path on a machine without real weights.

Writes tiny random-weight models shaped like FLUX.2 [klein] (transformer, Qwen3 encoder, VAE) as a
ComfyUI `models/` folder with the real key names (`models/tiny.py`), then recognises, loads and runs
them exactly as `vramgraph generate` does: a text-to-image and an edit of that image. The pictures are
noise (the weights are random); what the demo shows is that the install, the loaders and the sampler work.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from ..api.pipeline import Pipeline, load, resize


def run_demo(out: Path, size: int = 256) -> tuple[list[Path], float]:
    """Tiny models under the shipped workflows' file names in `out/models`, then the shipped text-to-image
    workflow and an edit of its picture through the Python API; returns the PNGs and the seconds taken."""
    pipe = Pipeline.demo(out)
    t0 = time.perf_counter()
    pngs: list[Path] = []
    for name in ("text_to_image", "edit"):
        wf = load(f"{name}.json")
        resize(wf.prompt, size, size)
        if name == "edit":  # the edit's reference is the picture just made
            shutil.copy(pngs[0], pipe.folders.input / "reference.png")
        pngs += pipe.run(wf.prompt).paths
    return pngs, time.perf_counter() - t0
