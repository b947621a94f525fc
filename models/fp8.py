"""fp8 layers: the weights stay fp8 (1 byte per element) wherever the model lives; each layer computes either

- "dequant": the weight is dequantized just in time to the compute dtype, `w.to(dt) * weight_scale`, and a
  plain matmul runs (as ComfyUI's `dequantize_per_tensor_fp8` followed by a bf16 GEMM); or
- "scaled_mm": torch's scaled fp8 matmul, `torch._scaled_mm(x_q, w.t(), input_scale, weight_scale)` with fp32
  accumulation, the activation quantized to float8_e4m3fn with the static input_scale (1.0 when the file has
  none) and clamped to +-448, as ComfyUI does. Only on GPUs with fp8 tensor cores (compute capability >= 8.9,
  ComfyUI's rule), only for layers not marked full_precision_matrix_mult, and only where both matrix sides
  are multiples of 16 (what the kernel takes); every other case dequantizes.

Text encoders always dequantize (ComfyUI builds them with full_precision_mm). Which one a transformer uses
by default, DEFAULT_COMPUTE, was chosen from bench/fp8.py on the H200 (bench/results/fp8.json).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .dtypes import stored_torch_dtype
from .headers import CheckpointError
from .quant import QuantLayer

COMPUTES = ("dequant", "scaled_mm")
# bench/results/fp8.json (H200, klein-4B at 1024², block linears fp8 as BFL's files): a step takes 77.4 ms with
# scaled_mm, 104.1 ms dequantizing, 86.3 ms in bf16; both fp8 paths are 0.5-0.6 % rel-L2 from the bf16 output
DEFAULT_COMPUTE = "scaled_mm"
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: activations are clamped to it


def fp8_matmul_supported(device: torch.device) -> bool:
    """ComfyUI's `supports_fp8_compute` for NVIDIA: compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(nn.Module):
    """A bias-free Linear whose weight is stored in fp8 with a per-tensor scale (and maybe a static input scale).

    Parameters and buffers: `weight` (out, in) in float8_e4m3fn or float8_e5m2, `weight_scale` () fp32 when the
    file has one, `input_scale` () fp32 when the file has one; the module moves and streams like any other.
    """

    def __init__(self, in_features: int, out_features: int, storage: torch.dtype, compute_dtype: torch.dtype, *,
                 weight_scale: bool, input_scale: bool, compute: str = "dequant", full_precision: bool = False
                 ) -> None:
        super().__init__()
        if compute not in COMPUTES:
            raise ValueError(f"unknown fp8 compute {compute!r}; use one of {', '.join(COMPUTES)}")
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.full_precision = full_precision  # the file says: always dequantize this layer
        self.compute = "dequant" if full_precision else compute
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=storage), requires_grad=False)
        if weight_scale:
            self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32))
        if input_scale:
            self.register_buffer("input_scale", torch.ones((), dtype=torch.float32))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {str(self.weight.dtype).removeprefix('torch.')}, " \
               f"compute={self.compute}"

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in `dtype` (the compute dtype): w.to(dtype) * weight_scale, as ComfyUI computes it."""
        dt = dtype or self.compute_dtype
        w = self.weight.to(dt)
        scale = getattr(self, "weight_scale", None)
        return w if scale is None else w.mul_(scale.to(dt))

    def _scaled_mm_ok(self, x: torch.Tensor) -> bool:
        return (self.compute == "scaled_mm" and x.is_cuda and self.in_features % 16 == 0
                and self.out_features % 16 == 0 and fp8_matmul_supported(x.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._scaled_mm_ok(x):
            return F.linear(x, self.dequantized(x.dtype))
        flat = x.reshape(-1, self.in_features)
        s_in = getattr(self, "input_scale", None)
        if s_in is None:
            s_in = torch.ones((), dtype=torch.float32, device=x.device)
            q = flat.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        else:
            q = (flat * (1.0 / s_in).to(flat.dtype)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        s_w = getattr(self, "weight_scale", None)
        if s_w is None:
            s_w = torch.ones((), dtype=torch.float32, device=x.device)
        out = torch._scaled_mm(q, self.weight.t(), scale_a=s_in.float(), scale_b=s_w.float(), out_dtype=x.dtype,
                               use_fast_accum=False)
        return out.reshape(*x.shape[:-1], self.out_features)


class FP8Embedding(nn.Module):
    """An embedding table stored in fp8: rows are looked up as bytes, then dequantized to the compute dtype."""

    def __init__(self, num: int, dim: int, storage: torch.dtype, compute_dtype: torch.dtype, *,
                 weight_scale: bool) -> None:
        super().__init__()
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=storage), requires_grad=False)
        if weight_scale:
            self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.view(torch.uint8)[ids].view(self.weight.dtype).to(self.compute_dtype)
        scale = getattr(self, "weight_scale", None)
        return rows if scale is None else rows * scale.to(self.compute_dtype)


def quantizable(module: nn.Module) -> dict[str, str]:
    """Our parameter names that may be stored quantised: the weights of Linear and Embedding layers."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and m.bias is None:
            out[f"{name}.weight"] = "linear"
        elif isinstance(m, nn.Embedding):
            out[f"{name}.weight"] = "embedding"
    return out


def swap_in(module: nn.Module, quantized: Mapping[str, QuantLayer], compute_dtype: torch.dtype,
            compute: str) -> dict[str, torch.dtype]:
    """Replace (on the meta device) each quantised layer's module by its fp8 twin; the dtypes its tensors keep."""
    keep: dict[str, torch.dtype] = {}
    for name, q in quantized.items():
        path = name.removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        old = getattr(parent, attr)
        if q.marking == "gguf":  # GGML blocks kept as bytes, dequantized just in time (models/gguf_layers.py)
            from .gguf_layers import gguf_twin

            setattr(parent, attr, gguf_twin(old, q, compute_dtype))
            keep[name] = torch.uint8
            continue
        storage = stored_torch_dtype(q.storage or "")
        if storage is None:
            raise CheckpointError(f"{q.file}: layer {q.layer}: this torch has no {q.storage}")
        if isinstance(old, nn.Linear):
            new: nn.Module = FP8Linear(old.in_features, old.out_features, storage, compute_dtype,
                                       weight_scale=q.weight_scale is not None, input_scale=q.input_scale is not None,
                                       compute=compute, full_precision=q.full_precision)
        elif isinstance(old, nn.Embedding):
            new = FP8Embedding(old.num_embeddings, old.embedding_dim, storage, compute_dtype,
                               weight_scale=q.weight_scale is not None)
        else:
            raise CheckpointError(f"{q.file}: layer {q.layer} is quantised but is not a linear or embedding layer")
        setattr(parent, attr, new)
        keep[name] = storage
        for buf, _ in new.named_buffers():
            keep[f"{path}.{buf}"] = torch.float32
    return keep


def set_compute(module: nn.Module, compute: str) -> int:
    """Switch every fp8 layer of a loaded model not marked full precision to `compute`; how many were switched."""
    if compute not in COMPUTES:
        raise ValueError(f"unknown fp8 compute {compute!r}; use one of {', '.join(COMPUTES)}")
    n = 0
    for m in module.modules():
        if isinstance(m, FP8Linear) and not m.full_precision:
            m.compute = compute
            n += 1
    return n
