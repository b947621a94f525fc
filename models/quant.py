"""Quantised layers as ComfyUI marks them, recognised from safetensors headers alone (no torch).

ComfyUI accepts three markings of a quantised layer and normalises them to one form; so do we:

1. `__metadata__["_quantization_metadata"]`: JSON `{"format_version": "1.0", "layers": {"<layer>": {"format":
   "float8_e4m3fn"}, ...}}` (layer names in the file's own key space, prefix included);
2. a uint8 tensor `<layer>.comfy_quant` holding the same per-layer JSON (what ComfyUI writes when it saves);
3. legacy "scaled fp8", used only where no file has `_quantization_metadata`: a marker tensor `scaled_fp8`
   and per layer `<layer>.scale_weight` (becomes the weight scale, format always float8_e4m3fn) and
   optionally `<layer>.scale_input` (the input scale; ComfyUI drops it when it is 1.0, which computes the
   same); a two-element marker means `full_precision_matrix_mult`.

The per-layer JSON fields read are `format` and `full_precision_matrix_mult`. We run `float8_e4m3fn` and
`float8_e5m2` with per-tensor (one-element) `weight_scale` / `input_scale`; the weight may be stored as
F8_E4M3, F8_E5M2 or as uint8 bytes of the format. An fp8 weight no marking names is used as stored, i.e.
cast with scale 1.0 (ComfyUI casts such weights to the compute dtype). Any other format (nvfp4, mxfp8,
int8_tensorwise/convrot, w4a8, an unknown string) is refused (`QuantError`) when the model is inspected, naming
the file, the layer and the format: at validation already (the loader nodes' VALIDATE_INPUTS read the header),
never a crash mid-run, never a silent upcast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .dtypes import GGML_BLOCKS, PLAIN, stored_bytes
from .headers import CheckpointError, Source, TensorInfo, read_header

FORMATS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}  # formats we run -> their storage dtype
FP8_STORED = tuple(FORMATS.values())
MARKER = "scaled_fp8"  # the legacy marker tensor (possibly under the file's prefix)


class QuantError(CheckpointError):
    """A checkpoint whose quantisation we do not run (or whose quantisation marking is damaged), found from its
    header: validation refuses it (nodes/catalog.py `header_refusal`), before anything runs."""


@dataclass(frozen=True)
class QuantLayer:
    """One quantised layer, by prefix-stripped names (the keys of the tensor table it was found in)."""

    layer: str  # "double_blocks.0.img_attn.qkv"; its weight is `layer + ".weight"`
    format: str  # the per-layer format string ("float8_e4m3fn", "nvfp4", ...)
    marking: str  # "metadata", "comfy_quant", "scaled_fp8", "unmarked" or "gguf" (a GGML block type, stored as is)
    file: str  # the file's name, for messages
    storage: str | None = None  # dtype the weight's bytes are read as ("F8_E4M3", GGUF's "Q4_K"); None if unusable
    weight_scale: str | None = None  # key of the per-tensor weight scale; None: 1.0 (unmarked fp8 weights)
    input_scale: str | None = None  # key of the static activation scale; None: 1.0
    full_precision: bool = False  # always dequantize (full_precision_matrix_mult, or an unmarked weight)
    problem: str | None = None  # why we cannot run it (None: we can)

    @property
    def weight(self) -> str:
        return self.layer + ".weight"


def _json(raw: bytes | str, what: str) -> dict:
    try:
        out = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise QuantError(f"{what} is not JSON: the file is damaged or not a ComfyUI quantised checkpoint") from e
    if not isinstance(out, dict):
        raise QuantError(f"{what} is not a JSON object: the file is damaged or not a ComfyUI quantised checkpoint")
    return out


def _tensor_bytes(info: TensorInfo) -> bytes:
    """The raw bytes of a small tensor (a `.comfy_quant` marker), from memory or straight from its file."""
    if info.tensor is not None:
        t = info.tensor
        return bytes(t.reshape(-1).tolist()) if hasattr(t, "reshape") else bytes(t)
    if info.file is None or info.offset < 0:
        return b""
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        return f.read(info.nbytes)


def _file_name(info: TensorInfo | None) -> str:
    return info.file.name if info is not None and info.file is not None else "the state dict"


def _one_element(infos: Mapping[str, TensorInfo], key: str | None, what: str) -> str | None:
    """None if `key` is a usable per-tensor scale, else what is wrong with it."""
    if key is None:
        return None
    info = infos[key]
    if math.prod(info.shape) != 1:
        return (f"its {what} has shape {list(info.shape)}; only per-tensor (one-element) scales are supported "
                "(ComfyUI's fp8 matmul assumes them too)")
    if info.dtype not in PLAIN:
        return f"its {what} is stored as {info.dtype}, not as a float"
    return None


def quant_layers(infos: Mapping[str, TensorInfo], metas: Mapping[Path, Mapping[str, str]] | None = None
                 ) -> dict[str, QuantLayer]:
    """Every quantised layer of a (prefix-stripped) tensor table, by the key of its weight.

    `metas` gives each file's `__metadata__` (read from the files' headers when omitted). Layers we
    cannot run are returned too, with `problem` set; `check_weights` refuses those a model uses.
    """
    files = sorted({i.file for i in infos.values() if i.file is not None}, key=str)
    if metas is None:
        metas = {f: read_header(f)[1] for f in files}
    by_file_key = {(i.file, i.name): k for k, i in infos.items()}
    by_name = {i.name: k for k, i in infos.items()}  # shards: one file's metadata may name another's tensors
    marked: dict[str, tuple[dict, str, str]] = {}  # layer -> (per-layer JSON, marking, file name)
    with_metadata = False
    for f in files:
        raw = (metas.get(f) or {}).get("_quantization_metadata")
        if raw is None:
            continue
        with_metadata = True
        layers = _json(raw, f"{f.name}: its _quantization_metadata").get("layers", {})
        if not isinstance(layers, dict):
            raise QuantError(f"{f.name}: its _quantization_metadata has no table of layers")
        for name, conf in layers.items():
            key = by_file_key.get((f, f"{name}.weight")) or by_name.get(f"{name}.weight")
            layer = key.removesuffix(".weight") if key is not None else name
            if isinstance(conf, dict):
                marked[layer] = (conf, "metadata", f.name)
    for key, info in infos.items():
        if key.endswith(".comfy_quant"):
            layer = key.removesuffix(".comfy_quant")
            if layer not in marked:
                what = f"{_file_name(info)}: {key}"
                marked[layer] = (_json(_tensor_bytes(info), what), "comfy_quant", _file_name(info))
    marker = next((k for k in infos if k == MARKER or k.endswith("." + MARKER)), None)
    legacy = marker is not None and not with_metadata
    out: dict[str, QuantLayer] = {}
    for layer, (conf, marking, fname) in marked.items():
        scale, inp = f"{layer}.weight_scale", f"{layer}.input_scale"
        out[layer + ".weight"] = _layer(infos, layer, str(conf.get("format")), marking, fname,
                                        scale if scale in infos else None, inp if inp in infos else None,
                                        bool(conf.get("full_precision_matrix_mult", False)))
    if legacy:
        full = math.prod(infos[marker].shape) == 2
        for key, info in infos.items():
            if key.endswith(".scale_weight"):
                layer = key.removesuffix(".scale_weight")
                if layer + ".weight" in out:
                    continue
                inp = f"{layer}.scale_input"
                out[layer + ".weight"] = _layer(infos, layer, "float8_e4m3fn", "scaled_fp8", _file_name(info), key,
                                                inp if inp in infos else None, full)
    for key, info in infos.items():  # GGUF block quantisations (models/gguf.py): the stored type says it all
        if key not in out and info.dtype in GGML_BLOCKS:
            out[key] = QuantLayer(key.removesuffix(".weight"), info.dtype, "gguf", _file_name(info), info.dtype)
    for key, info in infos.items():
        if key not in out and key.endswith(".weight") and info.dtype in FP8_STORED:
            out[key] = QuantLayer(key.removesuffix(".weight"), next(f for f, s in FORMATS.items() if s == info.dtype),
                                  "unmarked", _file_name(info), info.dtype, None, None, True)
    return out


def _layer(infos: Mapping[str, TensorInfo], layer: str, fmt: str, marking: str, fname: str, scale: str | None,
           inp: str | None, full: bool) -> QuantLayer:
    weight = infos.get(layer + ".weight")
    storage, problem = None, None
    if fmt not in FORMATS:
        problem = (f"it is quantised as {fmt!r}, which vramgraph does not run (it runs "
                   f"{' and '.join(FORMATS)} with per-tensor scales)")
    elif weight is None:
        problem = f"it is marked {fmt} but the file has no {layer}.weight"
    elif weight.dtype in FP8_STORED:
        storage = weight.dtype
    elif weight.dtype == "U8":
        storage = FORMATS[fmt]  # fp8 bytes stored as uint8: read as the format's dtype
    else:
        problem = f"it is marked {fmt} but its weight is stored as {weight.dtype}"
    if problem is None and scale is None:
        problem = f"it is marked {fmt} but has no weight_scale"
    problem = problem or _one_element(infos, scale, "weight_scale") or _one_element(infos, inp, "input_scale")
    return QuantLayer(layer, fmt, marking, fname, storage if problem is None else None, scale, inp, full, problem)


def check_weights(sources: Mapping[str, Source], infos: Mapping[str, TensorInfo],
                  layers: Mapping[str, QuantLayer], quantizable: Mapping[str, str]) -> dict[str, QuantLayer]:
    """The quantised layers among the weights `sources` reads, by our parameter name; refuses what we do not run.

    `quantizable` names, by our parameter name, the weights that may be quantised and how they compute
    ("linear" or "embedding"). Every other weight must be stored as a plain float (F32, BF16, F16).
    """
    out: dict[str, QuantLayer] = {}
    for name, s in sources.items():
        for k in s.keys:
            q = layers.get(k)
            info = infos.get(k)
            where = _file_name(info)
            if q is not None:
                if q.problem is not None:
                    raise QuantError(f"{where}: layer {q.layer}: {q.problem}; use the bf16 or fp8 file of "
                                          "this model")
                if name not in quantizable:
                    raise QuantError(f"{where}: layer {q.layer} is quantised ({q.format}) but vramgraph runs "
                                          "that tensor only unquantised; use the bf16 file of this model")
                if s.op not in ("copy", "swap_halves") or len(s.keys) != 1:
                    raise QuantError(f"{where}: layer {q.layer} is quantised ({q.format}) in a layout whose "
                                          "tensors must be joined (split q/k/v); use a ComfyUI or BFL fp8 file")
                out[name] = q
            elif info is not None and info.dtype not in PLAIN:
                raise QuantError(f"{k} in {where} is stored as {info.dtype} and is not marked as a quantised "
                                      "layer vramgraph runs (fp8 with per-tensor scales); use the bf16 or fp8 file "
                                      "of this model")
    return out


def scale_sources(quantized: Mapping[str, QuantLayer]) -> dict[str, Source]:
    """Sources of the scale buffers of quantised layers (`<our layer>.weight_scale`, `.input_scale`)."""
    out: dict[str, Source] = {}
    for name, q in quantized.items():
        ours = name.removesuffix(".weight")
        if q.weight_scale is not None:
            out[f"{ours}.weight_scale"] = Source((q.weight_scale,), "reshape")
        if q.input_scale is not None:
            out[f"{ours}.input_scale"] = Source((q.input_scale,), "reshape")
    return out


def stored_nbytes(q: QuantLayer, infos: Mapping[str, TensorInfo]) -> int:
    """Bytes a quantised layer takes once loaded: 1 per weight element plus its fp32 scales (fp8); its stored
    blocks (GGUF)."""
    w = infos[q.weight]
    if q.marking == "gguf":
        return w.nbytes
    return stored_bytes(q.storage or "U8") * math.prod(w.shape) + 4 * ((q.weight_scale is not None) +
                                                                        (q.input_scale is not None))
