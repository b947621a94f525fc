"""Fit the latent-to-RGB preview map against a real FLUX.2 VAE and store it in models/data/.

    python3 bench/fit_preview.py VAE.safetensors IMAGE_DIR [--out models/data/flux2_preview_rgb.json]

Each image is encoded (normalised packed latent, as the sampler sees it), unpatchified to the 32 raw
channels at 1/8 resolution, and its own decoded picture, reduced (area) to that size, is the target; a least
squares fit gives the 32x3 matrix and the bias. Natural photographs make the right training set. Runs on
the CPU or the GPU. The repository's current map is ComfyUI's published one (see the JSON's "source"): the
real decoder's weights could not be obtained where this project was built.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from vramgraph.models import loading
from vramgraph.models.preview import MAP_FILE, fit_map, unpatchify
from vramgraph.models.sampling import prepare_reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("vae")
    ap.add_argument("images")
    ap.add_argument("--out", default=str(MAP_FILE))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    spec = loading.inspect([a.vae]).component("vae")
    vae = loading.load(spec, dtype=torch.float32, device=a.device)
    raws, rgbs = [], []
    files = sorted(p for p in Path(a.images).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
    with torch.no_grad():
        for path in files:
            pixels = prepare_reference(Image.open(path), max_area=512 * 512).to(a.device)
            latent = vae.encode(pixels)
            decoded = vae.decode(latent).clamp(-1, 1)
            raw = unpatchify(latent)
            target = F.interpolate(decoded, size=raw.shape[2:], mode="area")
            raws.append(raw.cpu())
            rgbs.append(target.permute(0, 2, 3, 1).cpu())
    weight, bias = fit_map(torch.cat([r.flatten(2) for r in raws], 2)[..., None],
                           torch.cat([t.reshape(1, -1, 1, 3) for t in rgbs], 1))
    Path(a.out).write_text(json.dumps({"source": f"fitted by bench/fit_preview.py on {len(files)} images with {a.vae}",
                                       "layout": "32 raw latent channels -> RGB in [-1, 1]",
                                       "weight": weight.tolist(), "bias": bias.tolist()}, indent=1))
    print(f"{a.out}: fitted on {len(files)} images")


if __name__ == "__main__":
    main()
