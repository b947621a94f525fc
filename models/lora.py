"""Applying LoRA, LoHa and LoKr adapters (models/lora_format.py reads the files) to our torch modules.

The math is ComfyUI's (comfy/weight_adapter/lora.py, loha.py, lokr.py, base.py `weight_decompose`), computed in
fp32 and rounded once to the layer's dtype:

- LoRA: dW = (alpha / rank) * up @ down (alpha absent: 1); LoHa: dW = (alpha / rank) * (w1a @ w1b) * (w2a @ w2b);
  LoKr: dW = scale * kron(w1, w2), w1 = lokr_w1 or w1a @ w1b, likewise w2, scale = alpha / (rank of w2's factors,
  else of w1's), 1 when neither is factored or alpha is absent.
- W' = W + strength * dW; with DoRA (`dora_scale`): W_c = W + dW, W_d = dora_scale * W_c / ||W_c|| (the norm over
  each input column for a (1, in) scale as LyCORIS/ComfyUI store it, over each output row for an (out,) scale as
  PEFT does), W' = W + strength * (W_d - W).
- Several LoRAs on one layer apply one after another, in the order they were chained.

Two ways to apply them, with identical results up to rounding:

- merged: W' is written over the weights once (one pass over each layer changed); the weights before merging are
  kept aside (on the host for GPU weights) so that another LoRA set or none restores them without reading the base
  file. The pinned host copy is never written: on the host a merged layer is a new tensor.
- on the fly: a forward hook adds strength * h(x) to the layer's output, with h(x) = scale * (x @ down.T) @ up.T
  for a LoRA (LoKr by the Kronecker identity, LoHa from its materialised dW; a DoRA layer recomputes W' per call).
  Nothing is written to the weights: fp8 layers and streamed blocks take LoRAs this way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .lora_format import LoraError, LoraFile, Target, use_signature

log = logging.getLogger(__name__)

MODES = ("merged", "onthefly")
_STATE = "_vg_lora_merged"
_CACHE = "_vg_lora_tensors"


@dataclass(frozen=True)
class Adapter:
    """One adapter's tensors (fp32, on one device) and where it goes."""

    target: Target
    tensors: Mapping[str, torch.Tensor] = field(repr=False)
    alpha: float | None = None

    def delta(self) -> torch.Tensor:
        """dW in fp32, alpha scaling included, strength not: (rows of the target, in)."""
        t, k = self.target, self.tensors
        if t.kind == "lora":
            dw = k["up"].flatten(1) @ k["down"].flatten(1)
            scale = self.alpha / k["down"].shape[0] if self.alpha is not None else 1.0
        elif t.kind == "loha":
            dw = (k["w1a"] @ k["w1b"].flatten(1)) * (k["w2a"] @ k["w2b"].flatten(1))
            scale = self.alpha / k["w1b"].shape[0] if self.alpha is not None else 1.0

        else:
            w1, w2, dim = self._kron_factors()
            dw = torch.kron(w1, w2)
            scale = self.alpha / dim if self.alpha is not None and dim is not None else 1.0
        dw = dw * scale
        if t.swap:
            a, b = dw.chunk(2, 0)
            dw = torch.cat([b, a], 0)
        return dw

    def _kron_factors(self) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        k, dim = self.tensors, None
        if "w1" in k:
            w1 = k["w1"].flatten(1)
        else:
            w1, dim = k["w1a"] @ k["w1b"].flatten(1), k["w1b"].shape[0]
        if "w2" in k:
            w2 = k["w2"].flatten(1)
        else:
            w2, dim = k["w2a"] @ k["w2b"].flatten(1), k["w2b"].shape[0]
        return w1, w2, dim

    @property
    def dora(self) -> torch.Tensor | None:
        return self.tensors.get("dora_scale")

    def merge(self, w: torch.Tensor, strength: float) -> torch.Tensor:
        """This adapter applied at `strength` to fp32 weights `w` of the target's rows (in place where it can)."""
        dw = self.delta()
        d = self.dora
        if d is None:
            return w.add_(dw, alpha=strength)
        wc = w + dw
        if d.dim() == 2 and d.shape[0] == 1 and d.shape[1] == w.shape[1]:  # (1, in): LyCORIS / ComfyUI
            norm = wc.norm(dim=0, keepdim=True)
        else:  # (out,) or (out, 1): PEFT's magnitude vector
            d = d.reshape(-1, 1)
            norm = wc.norm(dim=1, keepdim=True)
        wd = wc * (d / norm)
        return w.add_(wd - w, alpha=strength)

    def h(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's output for input rows `x` (any dtype): x @ dW.T, without materialising dW for LoRA/LoKr."""
        t, k = self.target, self.tensors
        if t.kind == "lora":
            scale = self.alpha / k["down"].shape[0] if self.alpha is not None else 1.0
            out = F.linear(F.linear(x, k["down"].flatten(1).to(x.dtype)), k["up"].flatten(1).to(x.dtype)) * scale
        elif t.kind == "lokr":
            w1, w2, dim = self._kron_factors()
            scale = self.alpha / dim if self.alpha is not None and dim is not None else 1.0
            # kron(w1, w2) @ v == vec(w2 @ V @ w1.T) with V the input cut into w1.shape[1] groups
            g = x.reshape(*x.shape[:-1], w1.shape[1], w2.shape[1])
            y = F.linear(F.linear(g, w2.to(x.dtype)).transpose(-1, -2), w1.to(x.dtype))  # (..., out2, out1)
            out = y.transpose(-1, -2).reshape(*x.shape[:-1], -1) * scale
        else:
            return F.linear(x, self.delta().to(x.dtype))
        if t.swap:
            a, b = out.chunk(2, -1)
            out = torch.cat([b, a], -1)
        return out


@dataclass(frozen=True)
class Use:
    """One LoRA file applied to one component at a strength."""

    file: LoraFile
    component: str
    strength: float

    @property
    def signature(self) -> tuple:
        return use_signature(self.file.path, self.component, self.strength)


def read_adapters(use: Use) -> list[Adapter]:
    """The adapters of one LoRA file for one component, read in fp32 on the host; LoraError for NaN/inf weights."""
    from safetensors import safe_open

    out = []
    path = use.file.path
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for t in use.file.component(use.component):
                tensors = {role: f.get_tensor(key).float() for role, key in t.keys}
                bad = [role for role, v in tensors.items() if not torch.isfinite(v).all()]
                if bad:
                    raise LoraError(f"{path}: module {t.module!r} has NaN or infinite values in {', '.join(bad)}; "
                                    "the file is damaged (or the training diverged)")
                for role in ("mid", "t1", "t2"):
                    if role in tensors:
                        raise LoraError(f"{path}: module {t.module!r} has a Tucker/LoCon '{role}' tensor, which is for "
                                        "convolutions; FLUX.2's layers are linear")
                alpha = tensors.pop("alpha", None)
                out.append(Adapter(t, tensors, None if alpha is None else float(alpha.reshape(-1)[0])))
    except (OSError, RuntimeError, ValueError) as e:
        if isinstance(e, LoraError):
            raise
        raise LoraError(f"{path}: cannot read its tensors ({e}); the file is damaged") from e
    return out


def _adapters(module: nn.Module, uses: Sequence[Use]) -> list[tuple[Adapter, float]]:
    """The adapters of `uses` in chain order, read once per file version and kept on the module."""
    cache: dict = module.__dict__.setdefault(_CACHE, {})
    out = []
    for u in uses:
        if u.strength == 0:
            continue
        key = u.signature[:4]
        if key not in cache:
            cache[key] = read_adapters(u)
        out += [(a, u.strength) for a in cache[key]]
    live = {u.signature[:4] for u in uses}
    for k in [k for k in cache if k not in live]:
        del cache[k]
    return out


def _linear_of(module: nn.Module, param: str) -> nn.Module:
    return module.get_submodule(param.removesuffix(".weight"))


def _is_quantized(layer: nn.Module) -> bool:
    """An fp8 or GGUF layer (models/fp8.py, models/gguf_layers.py): its weight is not a plain float tensor."""
    return hasattr(layer, "dequantized")


def _rows(w: torch.Tensor, t: Target) -> torch.Tensor:
    return w.narrow(0, t.rows[0], t.rows[1]) if t.rows else w


@dataclass
class _Merged:
    signature: tuple
    base: dict[str, torch.Tensor]  # param -> the weights before merging (a host copy for GPU weights)
    inplace: dict[str, bool]


def restore(module: nn.Module) -> int:
    """Undo a merge: every merged layer gets its weights from before (no file is read); bytes restored."""
    st: _Merged | None = module.__dict__.pop(_STATE, None)
    if st is None:
        return 0
    restored = 0
    for name, base in st.base.items():
        p = module.get_parameter(name)
        if st.inplace[name]:
            p.data.copy_(base, non_blocking=False)
        else:
            p.data = base.to(p.device)
        restored += p.numel() * p.element_size()
    return restored


def forget(module: nn.Module) -> None:
    """The weights were replaced by a fresh copy of the base (the ledger loaded or unloaded them): nothing merged."""
    module.__dict__.pop(_STATE, None)


def merged_signature(module: nn.Module) -> tuple | None:
    """The signatures (`Use.signature`, chain order) of the LoRAs merged into the module's weights now; None: none."""
    st = module.__dict__.get(_STATE)
    return st.signature if st is not None else None


@dataclass(frozen=True)
class Applied:
    """What `applied` did before its block ran: the bytes of weights it merged (0 when the same LoRAs were merged
    already) and restored (another set's merge undone), the seconds that took, and the layers it hooked (on the fly)."""

    mode: str
    merged: int = 0
    restored: int = 0
    seconds: float = 0.0
    hooked: int = 0


def merge(module: nn.Module, uses: Sequence[Use], host: Mapping[str, torch.Tensor] | None = None) -> Applied:
    """Merge `uses` into the module's plain (not fp8) layers, first undoing another merged set.

    `host`: the model's pinned host copy (parameter name -> tensor), if it has one: GPU weights are restored from it
    later, so nothing is copied aside; without it, the layers a merge changes are first copied to the host."""
    signature = tuple(u.signature for u in uses if u.strength != 0)
    if merged_signature(module) == signature:
        return Applied("merged")
    restored = restore(module)
    if not signature:
        return Applied("merged", restored=restored)
    by_param: dict[str, list[tuple[Adapter, float]]] = {}
    for a, s in _adapters(module, uses):
        if not _is_quantized(_linear_of(module, a.target.param)):
            by_param.setdefault(a.target.param, []).append((a, s))
    st = _Merged(signature, {}, {})
    written = 0
    with torch.no_grad():
        for name, items in by_param.items():
            p = module.get_parameter(name)
            w = p.data
            new = w.float().clone() if w.dtype == torch.float32 else w.float()
            for a, s in items:
                rows = _rows(new, a.target)
                rows.copy_(a_merge(a, rows.clone(), s, w.device))
            if w.device.type == "cpu":  # never write the host copy: a new tensor, the old one kept
                st.base[name], st.inplace[name] = w, False
                p.data = new.to(w.dtype)
            else:
                kept = host.get(name) if host is not None else None
                st.base[name] = kept if kept is not None and kept.shape == w.shape else w.to("cpu", copy=True)
                st.inplace[name] = True
                w.copy_(new)
            written += w.numel() * w.element_size()
    module.__dict__[_STATE] = st
    return Applied("merged", written, restored)


def a_merge(a: Adapter, w: torch.Tensor, strength: float, device: torch.device) -> torch.Tensor:
    moved = Adapter(a.target, {k: v.to(device) for k, v in a.tensors.items()}, a.alpha)
    return moved.merge(w, strength)


class _Hook:
    """The forward hook of one layer: its adapters added to the output (or, with DoRA, the output recomputed)."""

    def __init__(self, layer: nn.Module, items: list[tuple[Adapter, float]]) -> None:
        self.layer, self.items = layer, items
        self.dora = any(a.dora is not None for a, _ in items)
        self.moved: dict[tuple, list[tuple[Adapter, float]]] = {}

    def _on(self, device: torch.device, dtype: torch.dtype) -> list[tuple[Adapter, float]]:
        """The adapters on the layer's device, in the activations' dtype (fp32 for DoRA, which rebuilds W)."""
        dt = torch.float32 if self.dora else dtype
        if (device, dt) not in self.moved:
            self.moved[(device, dt)] = [(Adapter(a.target, {k: v.to(device, dt) for k, v in a.tensors.items()},
                                                 a.alpha), s) for a, s in self.items]
        return self.moved[(device, dt)]

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for a in self.moved.values() for b, _ in a for v in b.tensors.values())

    def __call__(self, layer: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        items = self._on(x.device, x.dtype)
        if self.dora:
            w = (layer.dequantized(torch.float32) if _is_quantized(layer) else layer.weight.float()).clone()
            for a, s in items:
                rows = _rows(w, a.target)
                rows.copy_(a.merge(rows.clone(), s))
            return F.linear(x, w.to(x.dtype))
        for a, s in items:  # (in place: under no_grad/inference nothing else holds the layer's fresh output)
            d = a.h(x)
            part = out.narrow(-1, a.target.rows[0], a.target.rows[1]) if a.target.rows else out
            part.add_(d, alpha=s)
        return out


@contextlib.contextmanager
def applied(module: nn.Module, uses: Sequence[Use], mode: str = "merged",
            host: Mapping[str, torch.Tensor] | None = None) -> Iterator[Applied]:
    """The module with `uses` applied while the block runs: merged (the merge stays after the block, for the next
    node using the same set) or on the fly (hooks, removed after). fp8 layers always take them on the fly. Every
    adapter is read (and checked) before any weight changes. Yields what it did (`Applied`)."""
    if mode not in MODES:
        raise ValueError(f"unknown LoRA mode {mode!r}; use one of {', '.join(MODES)}")
    live = [u for u in uses if u.strength != 0]
    _adapters(module, live)  # a damaged file fails here, with nothing changed
    t0 = time.perf_counter()
    done = merge(module, live, host) if mode == "merged" else Applied(mode, restored=restore(module))
    if done.merged or done.restored:
        _sync(module)
    hooks = []
    if live:
        by_layer: dict[str, list[tuple[Adapter, float]]] = {}
        for a, s in _adapters(module, live):
            layer = _linear_of(module, a.target.param)
            if mode == "onthefly" or _is_quantized(layer):
                by_layer.setdefault(a.target.param, []).append((a, s))
        for name, items in by_layer.items():
            layer = _linear_of(module, name)
            hooks.append(layer.register_forward_hook(_Hook(layer, items)))
    try:
        yield Applied(mode, done.merged, done.restored, time.perf_counter() - t0, len(hooks))
    finally:
        for h in hooks:
            h.remove()


def _sync(module: nn.Module) -> None:
    """Wait for the module's device (a merge's seconds are measured, not only queued)."""
    p = next(module.parameters(), None)
    if p is not None and p.device.type == "cuda":
        torch.cuda.synchronize(p.device)
