"""Writing real GGUF files with the `gguf` package's writer, and the weights they hold: for the tests and benchmarks
(the package is the `gguf` extra; nothing at run time imports this module).

`write_gguf` quantises a state dict the way ComfyUI-GGUF's converter and llama.cpp's quantizer lay files out:
2-d weights in the chosen GGML type where their rows are whole blocks (else F16, as llama.cpp falls back), 1-d
tensors in F32. Types the `gguf` package can quantise (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16) are quantised from
the weights; K-quants, which it cannot, get random blocks with small finite scales. It returns what each tensor
holds as fp32, dequantized by the `gguf` package's numpy code: the oracle the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from .dtypes import GGML_BLOCKS
from .gguf import LAYER_NAMES, MODEL_NAMES

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # what gguf.quants can quantise
# where each block type keeps its fp16 scales (d, and dmin or m), by byte offset in the block
SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
          "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2)}
# types with a min: the second scale is the first times this, so that random quants and sub-block scales average
# to 0 (K-quants: d*sc*q - dmin*m with sc, m alike and dmin = d * mean(q); Q4_1/Q5_1: d*q + m, m = -d * mean(q))
CENTRE = {"Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5, "Q4_1": -7.5, "Q5_1": -15.5}
# the fp16 scale that makes random blocks' weights a few hundredths (sub-block scales and quants multiply it)
SIZE = {"Q2_K": 1e-3, "Q3_K": 3e-4, "Q4_K": 6e-5, "Q5_K": 3e-5, "Q6_K": 1e-5,
        "Q8_0": 2e-4, "Q4_0": 4e-3, "Q4_1": 2e-3, "Q5_0": 2e-3, "Q5_1": 1e-3}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, scale: float | None = None
                  ) -> np.ndarray:
    """Random bytes of `rows` x `cols` elements in `kind`, with each block's fp16 scales small and finite and its
    weights centred on 0 (random weights of one sign would grow a deep model's activations layer by layer)."""
    size, nbytes = GGML_BLOCKS[kind]
    scale = SIZE[kind] if scale is None else scale
    raw = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    d = (rng.uniform(0.25, 1.0, (rows, cols // size)) * scale).astype(np.float32)
    for i, at in enumerate(SCALES[kind]):  # d, then the min's scale (or the min) that centres the block on 0
        v = (d if i == 0 else d * CENTRE[kind]).astype(np.float16)
        raw[:, :, at:at + 2] = v.view(np.uint8).reshape(rows, cols // size, 2)
    return raw.reshape(rows, -1)


def llama_name(hf: str) -> str:
    """Hugging Face's Qwen3 name as llama.cpp's ('model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight')."""
    for ll, ours in MODEL_NAMES.items():
        if hf == ours:
            return ll
    parts = hf.split(".")
    if hf.startswith("model.layers."):
        rest = ".".join(parts[3:-1])
        short = next(k for k, v in LAYER_NAMES.items() if v == rest)
        return f"blk.{parts[2]}.{short}.{parts[-1]}"
    return hf


def encode(w: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, T]:
    """`w` (fp32, 2-d or 1-d) stored as `kind`: (the bytes or array to write, its GGML type)."""
    if kind == "F32":
        return w.astype(np.float32), T.F32
    if kind == "F16":
        return w.astype(np.float16), T.F16
    if kind == "BF16" or kind in QUANTIZABLE:
        return quants.quantize(w.astype(np.float32), T[kind]), T[kind]
    return random_blocks(kind, w.shape[0], w.shape[1], rng), T[kind]


def write_gguf(path: Path, sd: Mapping[str, torch.Tensor], kind: str | Callable[[str], str], *, arch: str = "flux",
               llama_names: bool = False, tokenizer: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write `sd` as a GGUF file; return each tensor as the file holds it, in fp32 (by the state dict's names)."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer and arch == "qwen3":
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(["a", "b", "c"])
    held: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        arr = t.detach().float().numpy()
        want = kind(key) if callable(kind) else kind
        block = GGML_BLOCKS.get(want, (1, 0))[0]
        if arr.ndim == 1:
            want = "F32"
        elif arr.shape[-1] % block:
            want = "F16"  # rows that are no whole number of blocks: llama.cpp's fallback
        data, qtype = encode(arr, want, rng)
        held[key] = torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, qtype)).reshape(arr.shape).copy())
        w.add_tensor(llama_name(key) if llama_names else key, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def write_random_gguf(path: Path, shapes: Mapping[str, tuple[int, ...]], kind: str, *, arch: str = "flux",
                      llama_names: bool = False, seed: int = 0) -> int:
    """A GGUF file of random weights with these shapes, without making them in float first (a full-size klein-9B in
    Q4_K is written from its blocks): 2-d weights as `kind` blocks with small scales where rows are whole blocks,
    else F16 (randn / sqrt(fan-in)); 1-d tensors F32 (1 + 0.1 randn). Returns the file's size."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    for key, shape in shapes.items():
        block = GGML_BLOCKS[kind][0]
        if len(shape) == 1:
            data, qtype = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32), T.F32
        elif len(shape) == 2 and shape[1] % block == 0:
            data, qtype = random_blocks(kind, shape[0], shape[1], rng), T[kind]
        else:
            data = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float16)
            qtype = T.F16
        w.add_tensor(llama_name(key) if llama_names else key, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size
