"""The residency ledger: where every model's weights are (GPU, pinned host copy, only the file).

Owned by the executor and changed only by the plan's Load/Unload steps. A model keeps one module
object; its parameters point either at host tensors (pinned when the host budget allows) or at GPU
copies of them, so an unload to the host moves nothing: the GPU copies are simply dropped. A model
without a host copy is read from its memory-mapped file straight onto the GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..models import loading
from ..nodes.types import ModelInfo

log = logging.getLogger("vramgraph.ledger")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Entry:
    info: ModelInfo
    module: torch.nn.Module | None = None  # exists while the weights are anywhere but the file
    host: dict[str, torch.Tensor] | None = None  # host copies of every parameter and buffer
    pinned: bool = False
    on_device: bool = False
    flat: torch.Tensor | None = None  # the one pinned buffer every host tensor is a view of
    gpu_flat: torch.Tensor | None = None  # its GPU copy while loaded


@dataclass
class Event:
    kind: str  # "load", "unload", "pin"
    model: str
    source: str
    seconds: float
    nbytes: int


@dataclass
class Ledger:
    device: torch.device
    entries: dict[str, Entry] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def register(self, info: ModelInfo) -> None:
        if info.key not in self.entries:
            self.entries[info.key] = Entry(info)

    @property
    def on_gpu(self) -> frozenset[str]:
        return frozenset(k for k, e in self.entries.items() if e.on_device)

    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(k for k, e in self.entries.items() if e.host is not None)

    def _tensors(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        named = dict(module.named_parameters())
        named.update(dict(module.named_buffers()))
        return named

    def _build_host(self, e: Entry, pin: bool) -> None:
        spec = e.info.spec
        if spec is None:
            raise RuntimeError(f"{e.info.label} '{e.info.key}' has no checkpoint file; it can be planned, not run")
        pinned = pin and self.device.type == "cuda"
        module = loading.load(spec, dtype=DTYPES[e.info.dtype], device="pinned" if pinned else "cpu")
        module.requires_grad_(False).eval()
        tensors = self._tensors(module)
        if pinned:  # every tensor is a view of one page-locked buffer (models.common.pinned_arena)
            storage = next(iter(tensors.values())).untyped_storage()
            e.flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
            e.pinned = True
        e.module, e.host = module, {n: t.data for n, t in tensors.items()}

    def pin(self, key: str) -> None:
        """Read the file into (pinned) host memory, so later loads run at the host link's speed."""
        e = self.entries[key]
        if e.host is None:
            t0 = time.perf_counter()
            self._build_host(e, pin=True)
            self.events.append(Event("pin", key, "file", time.perf_counter() - t0, e.info.nbytes))

    def load(self, key: str, source: str = "pinned") -> None:
        e = self.entries[key]
        if e.on_device:
            return
        t0 = time.perf_counter()
        if e.host is None and source == "file" and self.device.type == "cuda":
            module = loading.load(e.info.spec, dtype=DTYPES[e.info.dtype], device=self.device)
            e.module = module.requires_grad_(False).eval()
        else:
            if e.host is None:
                self._build_host(e, pin=self.device.type == "cuda")
            if e.flat is not None:  # one copy of the whole pinned buffer, then views at the same offsets
                e.gpu_flat = torch.empty(e.flat.shape, dtype=torch.uint8, device=self.device)
                e.gpu_flat.copy_(e.flat, non_blocking=True)
                for name, t in self._tensors(e.module).items():
                    h = e.host[name]
                    off = h.storage_offset() * h.element_size()
                    t.data = e.gpu_flat[off:off + h.numel() * h.element_size()].view(h.dtype).view(h.shape)
                torch.cuda.synchronize(self.device)
            elif self.device.type != "cpu":
                for name, t in self._tensors(e.module).items():
                    t.data = e.host[name].to(self.device, non_blocking=True)
                torch.cuda.synchronize(self.device)
        e.on_device = True
        self.events.append(Event("load", key, source, time.perf_counter() - t0, e.info.nbytes))

    def unload(self, key: str, to: str = "pinned") -> None:
        e = self.entries[key]
        t0 = time.perf_counter()
        if to == "drop" or e.host is None:
            e.module, e.host, e.pinned, e.flat = None, None, False, None
        elif self.device.type != "cpu":
            for name, t in self._tensors(e.module).items():
                t.data = e.host[name]
        e.gpu_flat = None
        e.on_device = False
        self.events.append(Event("unload", key, to, time.perf_counter() - t0, e.info.nbytes))

    def module(self, key: str) -> torch.nn.Module:
        e = self.entries.get(key)
        if e is None or e.module is None:
            raise RuntimeError(f"model {key} is not loaded; the plan must load it before the node that uses it")
        return e.module

    def forget(self, keep: set[str]) -> None:
        """Drop models no cached output refers to any more."""
        for key in [k for k in self.entries if k not in keep]:
            self.unload(key, "drop")
            del self.entries[key]
