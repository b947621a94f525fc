"""Which dequantizer a GGUF layer's blocks get: the Triton kernels (models/gguf_kernels.py) where the bytes are on a
CUDA device and Triton imports, else the torch code of models/gguf_dequant.py (the reference, and the path of the
CPU, of CPU builds of torch and of CI).

The rules, per call of `gguf_dequant.dequantize` on GGML blocks (`DISPATCH.run`):
- the kernels run where the bytes are on a CUDA device, Triton imports, the output dtype is fp32, bf16 or fp16, the
  type has a kernel (all ten GGML block types do) and its kernel has not failed on that device;
- inside `torch.compile` tracing the torch code is used, so that the compiled graph holds plain torch ops that the
  compiler fuses itself (dynamo's support for user Triton kernels, with our launch options, is not relied on);
- anything else takes the torch code, and the first call that does so for a reason logs one line naming what was
  not available (issue #34's rule): "the CPU", "Triton (ModuleNotFoundError: No module named 'triton')",
  "the Triton Q4_K kernel writing torch.bfloat16 (error ...)"; a kernel that fails to compile or launch is not
  tried again on that device for that dtype.

Both paths give the same values: the kernels compute the reference's fp32 products, in its order, without fused
multiply-adds, and round once (models/gguf_kernels.py; tests/test_gguf_triton.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import ModuleType

import torch

log = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU builds and CI have none
    from . import gguf_kernels as _kernels
    MISSING = ""
except Exception as e:  # not installed, or one that fails to import (a version that does not match torch's)
    _kernels = None  # type: ignore[assignment]
    MISSING = f"Triton ({type(e).__name__}: {e})"


class Dispatch:
    """The choice between the kernels and the torch code, and what was said about it (see the module's rules).

    `kernels`: the kernel module (None: no Triton, `missing` says why); `devices`: the device types the kernels run
    on ("cuda"; tests add "cpu" to run them under TRITON_INTERPRET=1 or to fail them on purpose)."""

    def __init__(self, kernels: ModuleType | None, missing: str = "", devices: tuple[str, ...] = ("cuda",)) -> None:
        self.kernels, self.missing, self.devices = kernels, missing, devices
        self.enabled = True
        self.failed: dict[tuple[str, torch.dtype, str], str] = {}  # (type, dtype, device) -> why not used there
        self.said: set[str] = set()

    def unavailable(self, device: torch.device, kind: str, dtype: torch.dtype) -> str | None:
        """Why the blocks of `kind` on `device` are not dequantized into `dtype` by a kernel; None if they are."""
        if device.type not in self.devices:
            return "the CPU" if device.type == "cpu" else f"a {device.type} device"
        if self.kernels is None:
            return self.missing or "Triton"
        if kind not in self.kernels.KERNELS:
            return f"a Triton kernel for {kind}"
        if dtype not in self.kernels.DTYPES:
            return f"a Triton kernel writing {dtype}"
        return self.failed.get((kind, dtype, str(device)))

    def run(self, raw: torch.Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """`raw`'s blocks dequantized by the kernel into `dtype`, or None where the torch code is to run instead."""
        if not self.enabled or torch.compiler.is_compiling():
            return None
        why = self.unavailable(raw.device, kind, dtype)
        if why is None:
            try:
                return self.kernels.dequantize(raw, kind, shape, dtype)  # type: ignore[union-attr]
            except torch.OutOfMemoryError:
                raise  # not the kernel's fault: the torch code would need more memory still
            except Exception as e:  # a compile or launch failure (no ptxas, a card Triton does not support, ...)
                first = (str(e).strip().splitlines() or [""])[0]  # a compile error goes on for pages
                why = f"the Triton {kind} kernel writing {dtype} ({type(e).__name__}: {first})"
                self.failed[(kind, dtype, str(raw.device))] = why
        if why not in self.said:
            self.said.add(why)
            log.info("GGUF dequantization on %s: torch code (not available: %s)", raw.device, why)
        return None

    @contextlib.contextmanager
    def torch_code(self) -> Iterator[None]:
        """Within: every call takes the torch code, silently (bench/gguf_step.py times both paths)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled


DISPATCH = Dispatch(_kernels, MISSING)
