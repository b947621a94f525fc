"""Command line: `vramgraph generate MODEL... --prompt TEXT --out image.png`.

MODEL is an HF diffusers folder, a ComfyUI `models/` folder, or the component files themselves
(transformer, text encoder, VAE), recognised from their headers. `vramgraph inspect MODEL...` prints
what was found and the bytes each component needs, without loading anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("vramgraph")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vramgraph", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="text to image (and reference editing) with all models resident")
    g.add_argument("models", nargs="+", help="checkpoint folder(s) or files")
    g.add_argument("--prompt", required=True)
    g.add_argument("--negative", default="", help="negative prompt (base models, guidance != 1)")
    g.add_argument("--width", type=int, default=1024)
    g.add_argument("--height", type=int, default=1024)
    g.add_argument("--steps", type=int, default=None, help="default: 4 distilled, 50 base")
    g.add_argument("--guidance", type=float, default=None, help="default: 1 distilled, 4 base")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ref", action="append", default=[], help="reference image for editing (repeatable)")
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    g.add_argument("--out", default="vramgraph.png", help="PNG path (index appended for several prompts)")
    i = sub.add_parser("inspect", help="recognise checkpoints and print their spec (reads headers only)")
    i.add_argument("models", nargs="+")
    d = sub.add_parser("demo", help="write tiny random-weight models and run the whole path on them (CPU)")
    d.add_argument("--out", default="vramgraph-demo", help="folder for the tiny models and the two PNGs")
    return ap


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    pngs, seconds = run_demo(Path(args.out))
    for p in pngs:
        print(p)
    log.info("random weights, so the pictures are noise; the whole path ran (%.1f s)", seconds)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import torch

    from .models import loading

    spec = loading.inspect(args.models)
    out = {"variant": spec.variant, "distilled": spec.distilled, "distilled_from": spec.distilled_from,
           "tokenizer": str(spec.tokenizer) if spec.tokenizer else "bundled"}
    for kind in loading.COMPONENTS:
        c = getattr(spec, kind)
        out[kind] = None if c is None else {
            "layout": c.layout, "files": [str(f) for f in c.files], "dtype": c.dtype, "params": c.params,
            "bf16_gib": round(c.nbytes(torch.bfloat16) / 2**30, 3), "blocks": len(c.block_params)}
    print(json.dumps(out, indent=1))
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch
    from PIL import Image

    from .models import loading
    from .models.pipeline import generate, load_models
    from .models.sampling import images_from_pixels

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    spec = loading.inspect(args.models)
    if device.type == "cuda":
        need = sum(spec.component(k).nbytes(dtype) for k in loading.COMPONENTS)
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            raise ValueError(f"the three models need {need / 2**30:.2f} GiB resident in {args.dtype} but {device} has "
                             f"{free / 2**30:.2f} GiB free; this command keeps every model on the GPU (planned "
                             "swapping comes with the graph engine): use a larger GPU or --device cpu")
    refs = [Image.open(p) for p in args.ref]
    t0 = time.perf_counter()
    models = load_models(spec, dtype=dtype, device=device)
    log.info("loaded in %.1f s", time.perf_counter() - t0)
    t0 = time.perf_counter()
    pixels = generate(models, args.prompt, width=args.width, height=args.height, seed=args.seed, steps=args.steps,
                      guidance=args.guidance, negative=args.negative, references=refs,
                      progress=lambda i, n: log.info("step %d/%d", i, n))
    log.info("generated in %.2f s", time.perf_counter() - t0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for img in images_from_pixels(pixels):
        img.save(out)
        print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parser().parse_args(argv)
    from .models.common import CheckpointError

    try:
        return {"inspect": _inspect, "demo": _demo, "generate": _generate}[args.command](args)
    except (CheckpointError, ValueError, OSError) as e:  # OSError: unreadable --ref image or output path
        print(f"vramgraph {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
