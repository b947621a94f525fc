"""The one dtype table: our compute names ("bf16", "fp16", "fp32"), safetensors' stored names ("BF16",
"F8_E4M3", ...), their sizes and their torch dtypes.

Importing this module does not import torch (the planner sizes models from it); `torch_dtype` and
`stored_torch_dtype` import torch when called.
"""

from __future__ import annotations

import math
from typing import Any

# safetensors dtype name -> (bytes per element, torch attribute, our compute name if we compute in it)
STORED: dict[str, tuple[int, str, str | None]] = {
    "F64": (8, "float64", None), "F32": (4, "float32", "fp32"), "F16": (2, "float16", "fp16"),
    "BF16": (2, "bfloat16", "bf16"), "I64": (8, "int64", None), "I32": (4, "int32", None),
    "I16": (2, "int16", None), "I8": (1, "int8", None), "U8": (1, "uint8", None), "BOOL": (1, "bool", None),
    "F8_E4M3": (1, "float8_e4m3fn", None), "F8_E5M2": (1, "float8_e5m2", None),
}
# our compute dtype names -> their safetensors name
COMPUTE: dict[str, str] = {name: stored for stored, (_, _, name) in STORED.items() if name is not None}
PLAIN = ("F32", "BF16", "F16")  # stored dtypes we load by a cast; anything else is quantised
# GGML block quantisations that GGUF files store and we run (models/gguf.py): name -> (elements per block, bytes
# per block), as llama.cpp's ggml-common.h lays them out (the `gguf` package's GGML_QUANT_SIZES agrees)
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
# elements dequantized at once into a non-fp32 output (models/gguf_dequant.py): the fp32 working set of one chunk (the
# quants, the products, the result: at most GGML_WORK_BYTES per element, counted from its ops, not measured) stays
# near 128 MiB beside the output, where a whole klein-9B layer (36864 x 4096) in fp32 would take 0.56 GiB per copy
GGML_CHUNK_ELEMENTS = 1 << 23
GGML_WORK_BYTES = 16


def stored_bytes(stored: str, default: int = 2) -> int:
    """Bytes per element of a safetensors dtype ('BF16' -> 2)."""
    entry = STORED.get(stored)
    return entry[0] if entry is not None else default


def tensor_bytes(stored: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` takes stored as `stored`: elements times their size, or whole GGML blocks along
    the last dimension (a row of 4096 Q4_K elements is 16 blocks of 144 bytes)."""
    block = GGML_BLOCKS.get(stored)
    if block is None:
        return stored_bytes(stored) * math.prod(shape)
    return math.prod(stored_shape(stored, shape))


def stored_shape(stored: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a tensor's stored bytes as we hold them: `shape` for element types, (..., bytes per row) of
    uint8 for GGML block types (each row is a whole number of blocks; `gguf.check_rows` refuses any other)."""
    block = GGML_BLOCKS.get(stored)
    if block is None or not shape:
        return tuple(shape)
    return (*shape[:-1], shape[-1] // block[0] * block[1])


def itemsize(dtype: Any) -> int:
    """Bytes per element of a compute dtype given by name ('bf16') or as a torch dtype."""
    if isinstance(dtype, str):
        if dtype not in COMPUTE:
            raise ValueError(f"unknown dtype '{dtype}'; use one of {', '.join(COMPUTE)}")
        return STORED[COMPUTE[dtype]][0]
    return int(dtype.itemsize)


def compute_name(stored: str) -> str:
    """Our name of a safetensors dtype ('BF16' -> 'bf16'); other dtypes lowercased ('F8_E4M3' -> 'f8_e4m3')."""
    entry = STORED.get(stored)
    return entry[2] if entry is not None and entry[2] is not None else stored.lower()


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype of a compute name ('bf16' -> torch.bfloat16); a torch dtype is returned as it is."""
    if not isinstance(dtype, str):
        return dtype
    if dtype not in COMPUTE:
        raise ValueError(f"unknown dtype '{dtype}'; use one of {', '.join(COMPUTE)}")
    return stored_torch_dtype(COMPUTE[dtype])


def stored_torch_dtype(stored: str) -> Any:
    """The torch dtype of a safetensors dtype name, or None where this torch has none."""
    import torch

    entry = STORED.get(stored)
    return getattr(torch, entry[1], None) if entry is not None else None


def stored_name(dtype: Any, default: str = "F32") -> str:
    """The safetensors name of a torch dtype (torch.bfloat16 -> 'BF16')."""
    name = str(dtype).removeprefix("torch.")
    return next((s for s, (_, attr, _) in STORED.items() if attr == name), default)
