"""What applying a LoRA costs on this device, against what nodes/lora.py predicts (its constants HBM_BYTES_PER_S,
H2D_PINNED_BYTES_PER_S and KERNEL_SECONDS are spec-sheet assumptions until this runs on the GPU).

    python3 bench/lora_cost.py OUT.json [--ranks 16,64] [--double 2] [--single 4] [--repeats 5]
    python3 bench/lora_cost.py OUT.json --tiny        (the test suite's tiny transformer on the CPU: checks the script)
    bash bench/run_device.sh lora_cost                 (on the device machine)

The model is klein-4B at its real widths with `--double` double and `--single` single blocks (bf16 on the GPU, its
pinned host copy beside it, as the engine holds them). For each rank, a random LoRA file on every linear layer (BFL
keys, models/lora_make.py), read by the same code the nodes use (nodes/lora.py `lora_ref`), and:

- merge: `models/lora.merge` with the pinned copy, then `restore`, timed apart; per GiB of the layers changed. The
  plan's merge seconds are the two together: one pass over the layers (3 x their bytes at HBM_BYTES_PER_S) and the
  restore (their bytes at H2D_PINNED_BYTES_PER_S);
- on the fly: one model call with the hooks against one without, at 1024² (4096 image + 512 text tokens) and at 76
  tokens; the extra seconds per call against `lora_cost(...).fly_seconds` for one call. At 76 tokens the extra is the
  kernels' overhead: per adapted layer it is KERNELS_PER_ADAPTER x KERNEL_SECONDS in the plan;
- GPU bytes: the peak of a merge and of a hooked call above a plain one, against the plan's merge transient and its
  adapters plus activation.

Each result holds the measured value, the predicted one and their ratio, and `suggested` gives the constants that
would make the prediction equal the measurement (the slowest rank, the safe side): put them in nodes/lora.py with
this report's file name and commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
from _common import peak_on, sync, write_report
from vramgraph.models import flux2_config, lora, lora_format, tiny
from vramgraph.models.flux2 import Flux2Transformer, image_ids, rope_table, text_ids
from vramgraph.models.lora_make import transformer_modules, write_lora
from vramgraph.nodes import lora as lora_nodes
from vramgraph.nodes.files import Folders
from vramgraph.nodes.types import ModelInfo

GiB = 2**30


@dataclasses.dataclass
class Setup:
    model: Flux2Transformer
    host: dict[str, torch.Tensor] | None  # the pinned host copy (GPU only), as the ledger keeps it
    dev: torch.device
    text: int  # text tokens of a call at the real size
    side: int  # image tokens per side at the real size


def setup(args: argparse.Namespace) -> Setup:
    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    cfg = tiny.TINY_TRANSFORMER if args.tiny else dataclasses.replace(
        flux2_config.KLEIN_4B, depth_double=args.double, depth_single=args.single)
    torch.manual_seed(0)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    with torch.device(dev):
        model = Flux2Transformer(cfg).to(dtype).eval().requires_grad_(False)
    host = {n: p.detach().cpu().pin_memory() for n, p in model.named_parameters()} if dev.type == "cuda" else None
    return Setup(model, host, dev, 5 if args.tiny else 512, 4 if args.tiny else 64)


def lora_file(folder: Path, s: Setup, rank: int) -> tuple[lora.Use, ModelInfo]:
    """A random LoRA on every linear layer, as the node reads it (its LoraRef) and as it is applied (its Use)."""
    cfg = s.model.cfg
    write_lora(folder / "loras" / f"r{rank}.safetensors", transformer_modules(cfg, "bfl"), rank=rank, alpha=rank / 2)
    env = types.SimpleNamespace(folders=Folders(models=(folder,)))
    ref = lora_nodes.lora_ref(env, f"r{rank}.safetensors", 1.0, "transformer", cfg, None)
    nbytes = sum(p.numel() * p.element_size() for p in s.model.parameters())
    info = ModelInfo("bench", "transformer", "transformer", nbytes, cfg, loras=(ref,))
    return lora.Use(lora_format.parse(ref.path, cfg, None), "transformer", 1.0), info


def call(s: Setup, image_side: int, text: int):
    """One model call over `image_side`² image tokens and `text` text tokens."""
    cfg, g = s.model.cfg, torch.Generator().manual_seed(1)
    img = torch.randn(1, image_side * image_side, cfg.in_channels, generator=g).to(s.dev, s.model.dtype)
    txt = torch.randn(1, text, cfg.context_dim, generator=g).to(s.dev, s.model.dtype)
    sigma = torch.tensor([0.7], device=s.dev)
    rope = rope_table(cfg, torch.cat([text_ids(text), image_ids(image_side, image_side)]), s.dev)
    return lambda: s.model(img, txt, sigma, rope)


def best(fn, repeats: int, dev: torch.device) -> float:
    """The fastest of `repeats` timed calls (after one untimed)."""
    fn()
    out = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t0)
    return min(out)


def measure_merge(s: Setup, use: lora.Use, info: ModelInfo, repeats: int) -> dict:
    layer_bytes = sum(o * i * s.model.img_in.weight.element_size() for _, o, i in _touched(info))
    lora.merge(s.model, [use], s.host)  # reads the adapters once (kept on the module, as in the engine)
    lora.restore(s.model)
    merge_s, restore_s = [], []
    for _ in range(repeats):
        sync(s.dev)
        t0 = time.perf_counter()
        lora.merge(s.model, [use], s.host)
        sync(s.dev)
        t1 = time.perf_counter()
        lora.restore(s.model)
        sync(s.dev)
        merge_s.append(t1 - t0)
        restore_s.append(time.perf_counter() - t1)
    peak = peak_on(lambda: lora.merge(s.model, [use], s.host), s.dev)
    lora.restore(s.model)
    item = s.model.img_in.weight.element_size()
    cost = lora_nodes.lora_cost(info, 1, 1, item)
    predicted_pass = 3 * layer_bytes / lora_nodes.HBM_BYTES_PER_S
    predicted_restore = layer_bytes / lora_nodes.H2D_PINNED_BYTES_PER_S
    m, r = min(merge_s), min(restore_s)
    return {"layer_bytes": layer_bytes, "merge_s": m, "restore_s": r,
            "merge_s_per_gib": m / (layer_bytes / GiB), "restore_s_per_gib": r / (layer_bytes / GiB),
            "predicted_merge_s": predicted_pass, "predicted_restore_s": predicted_restore,
            "merge_ratio": _ratio(m, predicted_pass), "restore_ratio": _ratio(r, predicted_restore),
            "cycle_ratio": _ratio(m + r, cost.merge_seconds),
            "peak_bytes": peak, "predicted_transient_bytes": cost.merge_transient,
            "peak_ratio": _ratio(peak, cost.merge_transient)}


def measure_fly(s: Setup, use: lora.Use, info: ModelInfo, repeats: int) -> dict:
    out: dict = {}
    item = s.model.img_in.weight.element_size()
    layers = len(_touched(info))
    for name, side, text in (("real", s.side, s.text), ("small", 4, 60 if s.text > 5 else 5)):
        fn = call(s, side, text)
        plain = best(fn, repeats, s.dev)
        plain_peak = peak_on(fn, s.dev)
        with lora.applied(s.model, [use], "onthefly", s.host):
            hooked = best(fn, repeats, s.dev)
            hooked_peak = peak_on(fn, s.dev)
        tokens = side * side + text
        cost = lora_nodes.lora_cost(info, tokens, 1, item)
        extra = hooked - plain
        out[name] = {"tokens": tokens, "plain_s": plain, "hooked_s": hooked, "extra_s": extra,
                     "predicted_extra_s": cost.fly_seconds, "ratio": _ratio(extra, cost.fly_seconds),
                     "extra_s_per_layer": extra / layers, "extra_peak_bytes": hooked_peak - plain_peak,
                     "predicted_bytes": cost.adapter_bytes + cost.fly_activation,
                     "peak_ratio": _ratio(hooked_peak - plain_peak, cost.adapter_bytes + cost.fly_activation)}
    out["layers"] = layers
    return out


def _touched(info: ModelInfo) -> set[tuple[str, int, int]]:
    """(parameter, out, in) of every layer the model's LoRAs change."""
    return {t for r in info.loras for t in r.touched}


def _ratio(measured: float, predicted: float) -> float | None:
    return round(measured / predicted, 3) if predicted else None


def suggested(ranks: dict) -> dict:
    """Constants that make the prediction equal the slowest rank's measurement."""
    worst = lambda key: max(r[key] for r in ranks.values())  # noqa: E731
    merge = max(r["merge"]["merge_s"] / (3 * r["merge"]["layer_bytes"]) for r in ranks.values())
    restore = max(r["merge"]["restore_s"] / r["merge"]["layer_bytes"] for r in ranks.values())
    small = max(r["fly"]["small"]["extra_s_per_layer"] for r in ranks.values())
    return {"HBM_BYTES_PER_S (merge pass)": round(1 / merge) if merge > 0 else None,
            "H2D_PINNED_BYTES_PER_S (restore)": round(1 / restore) if restore > 0 else None,
            "KERNEL_SECONDS": small / lora_nodes.KERNELS_PER_ADAPTER,
            "worst on-the-fly ratio at the real size": worst("fly_ratio")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--tiny", action="store_true", help="the tiny test transformer on the CPU (checks the script)")
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--double", type=int, default=2, help="double blocks of klein-4B's width (default 2)")
    p.add_argument("--single", type=int, default=4, help="single blocks (default 4)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    s = setup(args)
    ranks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rank in (int(r) for r in args.ranks.split(",")):
            use, info = lora_file(Path(tmp), s, rank)
            fly = measure_fly(s, use, info, args.repeats)
            ranks[str(rank)] = {"merge": measure_merge(s, use, info, args.repeats), "fly": fly,
                                "fly_ratio": fly["real"]["ratio"] or 0.0}
    report = {"device": torch.cuda.get_device_name(s.dev) if s.dev.type == "cuda" else "cpu",
              "tiny": args.tiny, "dtype": str(s.model.dtype), "blocks": [s.model.cfg.depth_double,
                                                                         s.model.cfg.depth_single],
              "assumed": {"HBM_BYTES_PER_S": lora_nodes.HBM_BYTES_PER_S,
                          "H2D_PINNED_BYTES_PER_S": lora_nodes.H2D_PINNED_BYTES_PER_S,
                          "KERNEL_SECONDS": lora_nodes.KERNEL_SECONDS},
              "ranks": ranks, "suggested": suggested(ranks)}
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
