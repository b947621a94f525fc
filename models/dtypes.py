"""The one dtype table: our compute names ("bf16", "fp16", "fp32"), safetensors' stored names ("BF16",
"F8_E4M3", ...), their sizes and their torch dtypes.

Importing this module does not import torch (the planner sizes models from it); `torch_dtype` and
`stored_torch_dtype` import torch when called.
"""

from __future__ import annotations

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


def stored_bytes(stored: str, default: int = 2) -> int:
    """Bytes per element of a safetensors dtype ('BF16' -> 2)."""
    entry = STORED.get(stored)
    return entry[0] if entry is not None else default


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
