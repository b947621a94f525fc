"""The activation-peak fit: from measured peaks (bench/calibrate.py's calibration data) to the constants of
nodes/estimates.py, and each point's prediction by the same formulas the planner uses.

Torch-free. A calibration is {"text_encode" | "sampler" | "decode" | "tiled" | "vae_encode": [point, ...]}; a point
holds its measured "bytes" (torch.cuda.max_memory_allocated above the resident weights) and its shape: "side"
(square images, pixels) or "height"/"width", "batch" (images; the sampler's cfg > 1 doubles it), "tokens"
(sampler: image + text + reference tokens; text encode: the padded prompt, 512), "dtype" (compute dtype, "bf16"
unless given), "hidden" (the model's width: 2560 for the Qwen3 encoder, 3072 for the transformer unless given)
and "decoder_width" (the VAE's full-resolution level's channels, 128 unless given: the decoder's for a decode, the
encoder's for an encode; the small decoder's is 96). The fit is least squares of each formula, linear in its
constants (the sampler's two lines each over the points where it is the larger, `_two_lines`):

    text encode   bytes = TE_FIXED_<dtype> + TE_PER_TOKEN_<dtype> * batch * tokens * hidden * item   (bf16, fp32 apart)
    sampler       bytes = batch * hidden * item * max(DIT_PER_TOKEN * tokens + DIT_FIXED,
                                                      DIT_PER_TOKEN_LARGE * tokens + DIT_FIXED_LARGE)
    decode        bytes = VAE_DECODE_PER_PIXEL * pixels * decoder_width * item + VAE_DECODE_FIXED
    encode        bytes = VAE_ENCODE_PER_PIXEL * pixels * decoder_width * item + VAE_ENCODE_FIXED
    tiled decode  bytes = decode(largest tile's pixels) + TILED_CANVAS * pixels   (the decode constants as fitted)

where item is the compute dtype's bytes per element (bf16 2, fp32 4; fp8-stored weights compute in bf16).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import estimates
from .estimates import _itemsize

KINDS = ("text_encode", "sampler", "decode", "tiled", "vae_encode")
TE_DTYPES = {"BF16": 2, "FP32": 4}  # the text encode's constants by the item size they are fitted on
CONSTANTS = ("TE_FIXED_BF16", "TE_PER_TOKEN_BF16", "TE_FIXED_FP32", "TE_PER_TOKEN_FP32", "DIT_PER_TOKEN", "DIT_FIXED",
             "DIT_PER_TOKEN_LARGE", "DIT_FIXED_LARGE", "VAE_DECODE_PER_PIXEL", "VAE_DECODE_FIXED",
             "VAE_ENCODE_PER_PIXEL", "VAE_ENCODE_FIXED", "TILED_CANVAS")
DEFAULT_HIDDEN = {"text_encode": 2560, "sampler": 3072}
Point = Mapping[str, Any]


def _item(p: Point) -> int:
    return _itemsize(p.get("dtype", "bf16"))


def _hidden(kind: str, p: Point) -> int:
    return int(p.get("hidden", DEFAULT_HIDDEN[kind]))


def _width(p: Point) -> int:
    return int(p.get("decoder_width", 128))


def _pixels(p: Point) -> int:
    h, w = p.get("height", p.get("side")), p.get("width", p.get("side"))
    return int(p.get("batch", 1)) * int(h) * int(w)


def _tile_pixels(p: Point) -> int:
    h, w = p.get("height", p.get("side")), p.get("width", p.get("side"))
    return estimates.tile_pixels(int(p.get("batch", 1)), int(h) // 16, int(w) // 16)


def _lstsq(x: Sequence[float], y: Sequence[float], intercept: bool) -> tuple[float, float]:
    a = np.array([[xi, 1.0] if intercept else [xi] for xi in x], dtype=np.float64)
    sol = np.linalg.lstsq(a, np.array(y, dtype=np.float64), rcond=None)[0]
    return float(sol[0]), float(sol[1]) if intercept else 0.0


def _relative(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """The line a * x + b that fits y best in relative error (each row divided by its y)."""
    a = np.array([[xi / yi, 1.0 / yi] for xi, yi in zip(x, y, strict=True)], dtype=np.float64)
    sol = np.linalg.lstsq(a, np.ones(len(y)), rcond=None)[0]
    return float(sol[0]), float(sol[1])


def _two_lines(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float, float]:
    """max(a * x + b, c * x + d) fitted to y: each split of the sorted x into a lower and an upper part (two distinct x
    at least in each) starts a fit; each line is refitted over the points where it is the larger until that stops
    changing; the split whose result has the smallest worst relative error wins."""
    xs = sorted(set(x))
    best: tuple[float, tuple[float, float, float, float]] | None = None
    for cut in xs[2:-1]:
        low = [xi < cut for xi in x]
        for _ in range(20):
            lo = [i for i, v in enumerate(low) if v]
            hi = [i for i, v in enumerate(low) if not v]
            if len({x[i] for i in lo}) < 2 or len({x[i] for i in hi}) < 2:
                break
            a, b = _relative([x[i] for i in lo], [y[i] for i in lo])
            c, d = _relative([x[i] for i in hi], [y[i] for i in hi])
            now = [a * xi + b >= c * xi + d for xi in x]
            if now == low:
                break
            low = now
        else:
            continue
        if len({x[i] for i in lo}) < 2 or len({x[i] for i in hi}) < 2:
            continue
        worst = max(abs(max(a * xi + b, c * xi + d) / yi - 1) for xi, yi in zip(x, y, strict=True))
        if best is None or worst < best[0]:
            best = (worst, (a, b, c, d) if a <= c else (c, d, a, b))
    if best is None:
        raise ValueError("the sampler's fit needs points at four token counts at least")
    return best[1]


def fit(calibration: Mapping[str, Sequence[Point]]) -> dict[str, float]:
    """The estimate constants that fit `calibration` best (least squares), unrounded."""
    c: dict[str, float] = {}
    for name, item in TE_DTYPES.items():  # a fixed part needs two sizes; with one, the per-token term alone
        te = [p for p in calibration["text_encode"] if min(_item(p), 4) == item]
        x = [p["batch"] * p.get("tokens", 512) * _hidden("text_encode", p) * _item(p) for p in te]
        if te:
            c[f"TE_PER_TOKEN_{name}"], c[f"TE_FIXED_{name}"] = _lstsq(x, [p["bytes"] for p in te], len(set(x)) > 1)
    s = calibration["sampler"]
    c["DIT_PER_TOKEN"], c["DIT_FIXED"], c["DIT_PER_TOKEN_LARGE"], c["DIT_FIXED_LARGE"] = _two_lines(
        [p["tokens"] for p in s], [p["bytes"] / (p["batch"] * _hidden("sampler", p) * _item(p)) for p in s])
    for kind, name in (("decode", "VAE_DECODE"), ("vae_encode", "VAE_ENCODE")):
        pts = calibration[kind]
        c[f"{name}_PER_PIXEL"], c[f"{name}_FIXED"] = _lstsq(
            [_pixels(p) * _width(p) * _item(p) for p in pts], [p["bytes"] for p in pts], True)
    t = calibration["tiled"]
    rest = [p["bytes"] - estimates.vae_bytes(_tile_pixels(p), _width(p), _item(p), c["VAE_DECODE_PER_PIXEL"],
                                             c["VAE_DECODE_FIXED"]) for p in t]
    c["TILED_CANVAS"] = _lstsq([_pixels(p) for p in t], rest, False)[0]
    return c


def rounded(c: Mapping[str, float]) -> dict[str, float]:
    """Constants as nodes/estimates.py writes them: 4 significant digits."""
    return {k: float(f"{v:.4g}") for k, v in c.items()}


def report(calibration: Mapping[str, Sequence[Point]]) -> dict[str, Any]:
    """What bench/calibrate.py writes beside its points (bench/results/calibrate.json): the fit ("fit", unrounded;
    "constants", as nodes/estimates.py writes them), the constants in use when the report was made and whether they
    are that fit, each point's error with the fit and the worst per kind and dtype, and the worst with those in use.
    tests/test_calibration.py checks that the committed report's "constants" are the ones in use."""
    fitted = fit(calibration)
    worst: dict[str, float] = {}
    for kind, p, err in errors(calibration, fitted):
        key = f"{kind}/{p['dtype']}"
        worst[key] = max(worst.get(key, 0.0), round(abs(err), 5))
    constants = rounded(fitted)
    return {"fit": fitted, "constants": constants, "in_use": in_use(), "in_use_is_fit": constants == in_use(),
            "worst_error_with_fit": worst, "worst_error_in_use": max(abs(e) for _, _, e in errors(calibration)),
            "errors_with_fit": [[k, {x: v for x, v in p.items() if x != "bytes"}, round(e, 5)]
                                for k, p, e in errors(calibration, fitted)]}


def in_use() -> dict[str, float]:
    """The constants nodes/estimates.py uses now."""
    return {name: float(getattr(estimates, name)) for name in CONSTANTS}


def predict(kind: str, p: Point, c: Mapping[str, float] | None = None) -> float:
    """The activation peak (bytes, before the MARGIN) that the estimates' formula gives point `p` with constants `c`
    (default: those in use)."""
    c = c or in_use()
    if kind == "text_encode":
        name = "FP32" if _item(p) >= 4 else "BF16"
        return estimates.text_encode_bytes(p["batch"], p.get("tokens", 512), _hidden(kind, p), _item(p),
                                           c[f"TE_PER_TOKEN_{name}"], c[f"TE_FIXED_{name}"])
    if kind == "sampler":
        return estimates.sampling_bytes(p["batch"], p["tokens"], _hidden(kind, p), _item(p), (
            c["DIT_PER_TOKEN"], c["DIT_FIXED"], c["DIT_PER_TOKEN_LARGE"], c["DIT_FIXED_LARGE"]))
    if kind in ("decode", "vae_encode"):
        name = "VAE_DECODE" if kind == "decode" else "VAE_ENCODE"
        return estimates.vae_bytes(_pixels(p), _width(p), _item(p), c[f"{name}_PER_PIXEL"], c[f"{name}_FIXED"])
    if kind == "tiled":
        return estimates.tiled_decode_bytes(_tile_pixels(p), _pixels(p), _width(p), _item(p),
                                            c["VAE_DECODE_PER_PIXEL"], c["VAE_DECODE_FIXED"], c["TILED_CANVAS"])
    raise ValueError(f"unknown calibration kind {kind!r}; use one of {', '.join(KINDS)}")


def errors(calibration: Mapping[str, Sequence[Point]], c: Mapping[str, float] | None = None
           ) -> list[tuple[str, Point, float]]:
    """(kind, point, prediction / measurement - 1) of every calibration point."""
    return [(kind, p, predict(kind, p, c) / p["bytes"] - 1) for kind in KINDS for p in calibration.get(kind, ())]
