"""FLUX.2 [klein] transformer in plain PyTorch.

Parameter names are the BFL checkpoint keys (also ComfyUI's `diffusion_models/` files), so those
files load tensor for tensor; `sources()` maps diffusers' names onto them (split q/k/v fused back,
the final layer's swapped halves swapped back).

Token order inside the model is [text | target image | reference images...]; the output keeps the
target tokens only. RoPE tables depend only on positions, so callers build them once per
generation with `rope_table()` and pass them to every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .common import RMSNorm, load_weights
from .flux2_config import BFL_PREFIXES as BFL_PREFIXES
from .flux2_config import KLEIN_4B as KLEIN_4B
from .flux2_config import KLEIN_9B as KLEIN_9B
from .flux2_config import VARIANTS as VARIANTS
from .flux2_config import Flux2Config as Flux2Config
from .flux2_config import block_of as block_of
from .flux2_config import config_from_checkpoint as config_from_checkpoint
from .flux2_config import is_bfl as is_bfl
from .flux2_config import is_diffusers as is_diffusers
from .flux2_config import parameter_shapes as parameter_shapes
from .flux2_config import sources as sources
from .flux2_config import variant_name as variant_name
from .headers import TensorInfo

# ---------------------------------------------------------------------------------------------
# Positions and rotary tables


def text_ids(length: int) -> torch.Tensor:
    """(length, 4) position ids of text tokens: (0, 0, 0, l)."""
    ids = torch.zeros(length, 4, dtype=torch.int64)
    ids[:, 3] = torch.arange(length)
    return ids


def image_ids(h: int, w: int, t: int = 0) -> torch.Tensor:
    """(h*w, 4) position ids of an image's tokens, row-major: (t, y, x, 0)."""
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.zeros(h * w, 4, dtype=torch.int64)
    ids[:, 0] = t
    ids[:, 1] = ys.reshape(-1)
    ids[:, 2] = xs.reshape(-1)
    return ids


def rope_table(cfg: Flux2Config, ids: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotation table for position ids (S, 4): (S, 1, head_dim/2, 2) fp32 holding (cos, sin).

    Axis a uses dims [sum(axes[:a]), sum(axes[:a+1])) of each head, rotated in adjacent pairs
    (2j, 2j+1) by angle pos * theta^(-2j/axis_dim). Angles are formed in float64, as the references do.
    """
    device = device if device is not None else ids.device
    pos = ids.to(device=device, dtype=torch.float64)
    angles = []
    for a, dim in enumerate(cfg.rope_axes):
        omega = cfg.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
        angles.append(pos[:, a, None] * omega[None, :])
    ang = torch.cat(angles, dim=-1)
    return torch.stack([ang.cos(), ang.sin()], dim=-1).float()[:, None]


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, H, D) by a `rope_table` (S, 1, D/2, 2), in fp32, returning x's dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = table[..., 0], table[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def timestep_embedding(s: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoid of s (B,), cos half first; frequencies exp(-ln(max_period) * i / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=s.device) / half)
    args = s.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


# ---------------------------------------------------------------------------------------------
# Blocks


class QKNorm(nn.Module):
    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.query_norm = RMSNorm(head_dim, eps, weight_name="scale")
        self.key_norm = RMSNorm(head_dim, eps, weight_name="scale")


class Attention(nn.Module):
    """qkv projection, per-head RMSNorm of q and k, output projection (the joint attention is outside)."""

    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.norm = QKNorm(cfg.head_dim, cfg.eps)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)
        return self.norm.query_norm(q), self.norm.key_norm(k), v


class MLP(nn.Sequential):
    """SwiGLU: Linear to 2 x mlp_hidden, silu(first half) * second half, Linear back."""

    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__(nn.Linear(cfg.hidden, 2 * cfg.mlp_hidden, bias=False), nn.Identity(),
                         nn.Linear(cfg.mlp_hidden, cfg.hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self[0](x).chunk(2, dim=-1)
        return self[2](F.silu(a) * b)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor,
                    attend: Attend | None = None) -> torch.Tensor:
    """Unmasked attention over all tokens of (B, S, H, D) tensors; returns (B, S_q, H*D).

    k and v may be longer than q (cached reference keys appended): q takes the first rows of the rotary table, k all.
    `attend` (B, H, S, D) -> (B, H, S_q, D) is the attention kernel (models/step.py picks one per shape); None: SDPA.
    """
    q, k = apply_rope(q, rope[:q.shape[1]]), apply_rope(k, rope[:k.shape[1]])
    out = (attend or F.scaled_dot_product_attention)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift


# Modulation vectors per token span: ((first token, vectors), ...) in token order, each span running to the next.
# Plain sampling has one span; FluxKVCache's first step gives the reference tokens the t=0 vectors.
Spans = tuple[tuple[int, tuple[torch.Tensor, ...]], ...]


def _parts(spans: Spans, n: int) -> list[tuple[int, int, tuple[torch.Tensor, ...]]]:
    ends = [a for a, _ in spans[1:]] + [n]
    return [(a, min(b, n), m) for (a, m), b in zip(spans, ends, strict=True) if a < min(b, n)]


def adaln(x: torch.Tensor, spans: Spans, shift: int, eps: float) -> torch.Tensor:
    """AdaLN of x (B, S, H) with each span's (shift, scale) = vectors[shift], vectors[shift + 1]."""
    if len(spans) == 1:
        m = spans[0][1]
        return modulate(x, m[shift], m[shift + 1], eps)
    return torch.cat([modulate(x[:, a:b], m[shift], m[shift + 1], eps) for a, b, m in _parts(spans, x.shape[1])], 1)


def gated(x: torch.Tensor, spans: Spans, gate: int, y: torch.Tensor) -> torch.Tensor:
    """The gated residual x + vectors[gate] * y, per span."""
    if len(spans) == 1:
        return x + spans[0][1][gate] * y
    return torch.cat([x[:, a:b] + m[gate] * y[:, a:b] for a, b, m in _parts(spans, x.shape[1])], 1)


@dataclass
class RefKV:
    """ComfyUI's FluxKVCache: the reference tokens' keys and values of every block, cached by the first forward that
    has references and used by every later forward, whose input then holds the target tokens only.

    As ComfyUI caches them: after the q/k norm and before RoPE (the rotary table still holds the references' positions,
    so they are rotated with their own positions each step, as if they were still in the sequence). One per sampling
    run; `nbytes` is what it holds on the GPU.
    """

    double: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    single: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    filling: bool = False

    @property
    def filled(self) -> bool:
        return bool(self.double or self.single) and not self.filling

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.double + self.single for t in kv)

    def take(self, store: list, k: torch.Tensor, v: torch.Tensor, n_ref: int, i: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block i's keys and values: while filling, cache the last n_ref rows (copies, so the step's activations
        are freed) and return k, v; once filled, return them with block i's cached rows appended."""
        if self.filling:
            store.append((k[:, -n_ref:].clone(), v[:, -n_ref:].clone()))
            return k, v
        kr, vr = store[i]
        return torch.cat([k, kr], 1), torch.cat([v, vr], 1)


class DoubleBlock(nn.Module):
    """Separate weights for text and image streams, joint attention over [text, image]."""

    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.attend: Attend | None = None  # the attention kernel (models/step.py); None: SDPA's own choice
        self.img_attn = Attention(cfg)
        self.txt_attn = Attention(cfg)
        self.img_mlp = MLP(cfg)
        self.txt_mlp = MLP(cfg)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, mod_img: Spans, mod_txt: tuple[torch.Tensor, ...],
                rope: torch.Tensor, kv: RefKV | None = None, n_ref: int = 0, index: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """mod_img: the image stream's modulation spans; kv (with n_ref reference tokens at the end of img while it
        fills): the reference keys and values of block `index`."""
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = mod_txt
        iq, ik, iv = self.img_attn.qkv_heads(adaln(img, mod_img, 0, self.eps))
        tq, tk, tv = self.txt_attn.qkv_heads(modulate(txt, t_shift1, t_scale1, self.eps))
        n_txt = txt.shape[1]
        k, v = torch.cat([tk, ik], 1), torch.cat([tv, iv], 1)
        if kv is not None:
            k, v = kv.take(kv.double, k, v, n_ref, index)
        attn = joint_attention(torch.cat([tq, iq], 1), k, v, rope, self.attend)
        img = gated(img, mod_img, 2, self.img_attn.proj(attn[:, n_txt:]))
        txt = txt + t_gate1 * self.txt_attn.proj(attn[:, :n_txt])
        img = gated(img, mod_img, 5, self.img_mlp(adaln(img, mod_img, 3, self.eps)))
        txt = txt + t_gate2 * self.txt_mlp(modulate(txt, t_shift2, t_scale2, self.eps))
        return img, txt


class SingleBlock(nn.Module):
    """One stream over [text, image]: attention and MLP in parallel from one fused projection."""

    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.attend: Attend | None = None  # the attention kernel (models/step.py); None: SDPA's own choice
        self.heads = cfg.heads
        self.hidden = cfg.hidden
        self.mlp_hidden = cfg.mlp_hidden
        self.linear1 = nn.Linear(cfg.hidden, 3 * cfg.hidden + 2 * cfg.mlp_hidden, bias=False)
        self.linear2 = nn.Linear(cfg.hidden + cfg.mlp_hidden, cfg.hidden, bias=False)
        self.norm = QKNorm(cfg.head_dim, cfg.eps)

    def forward(self, x: torch.Tensor, mod: Spans, rope: torch.Tensor, kv: RefKV | None = None, n_ref: int = 0,
                index: int = 0) -> torch.Tensor:
        qkv, gate_up = self.linear1(adaln(x, mod, 0, self.eps)).split([3 * self.hidden, 2 * self.mlp_hidden], dim=-1)
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).unbind(2)
        q, k = self.norm.query_norm(q), self.norm.key_norm(k)
        if kv is not None:
            k, v = kv.take(kv.single, k, v, n_ref, index)
        attn = joint_attention(q, k, v, rope, self.attend)
        a, b = gate_up.chunk(2, dim=-1)
        return gated(x, mod, 2, self.linear2(torch.cat([attn, F.silu(a) * b], dim=-1)))


class Modulation(nn.Module):
    def __init__(self, cfg: Flux2Config, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(cfg.hidden, n * cfg.hidden, bias=False)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None].chunk(self.n, dim=-1)


class TimeEmbed(nn.Module):
    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__()
        self.in_layer = nn.Linear(cfg.time_dim, cfg.hidden, bias=False)
        self.out_layer = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class FinalLayer(nn.Module):
    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.hidden, 2 * cfg.hidden, bias=False))
        self.linear = nn.Linear(cfg.hidden, cfg.in_channels, bias=False)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None].chunk(2, dim=-1)  # BFL order: shift, scale
        return self.linear(modulate(x, shift, scale, self.eps))


class Flux2Transformer(nn.Module):
    """The FLUX.2 [klein] flow transformer: velocity for packed latent tokens at noise level sigma."""

    def __init__(self, cfg: Flux2Config = KLEIN_4B) -> None:
        super().__init__()
        self.cfg = cfg
        self.img_in = nn.Linear(cfg.in_channels, cfg.hidden, bias=False)
        self.txt_in = nn.Linear(cfg.context_dim, cfg.hidden, bias=False)
        self.time_in = TimeEmbed(cfg)
        self.double_stream_modulation_img = Modulation(cfg, 6)
        self.double_stream_modulation_txt = Modulation(cfg, 6)
        self.single_stream_modulation = Modulation(cfg, 3)
        self.double_blocks = nn.ModuleList(DoubleBlock(cfg) for _ in range(cfg.depth_double))
        self.single_blocks = nn.ModuleList(SingleBlock(cfg) for _ in range(cfg.depth_single))
        self.final_layer = FinalLayer(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self.img_in, "compute_dtype", self.img_in.weight.dtype)  # an fp8 layer says what it computes in

    def _vec(self, sigma: torch.Tensor) -> torch.Tensor:
        # The references feed the model 1000*sigma rounded through the model dtype.
        s = sigma.to(self.dtype) * 1000
        return self.time_in(timestep_embedding(s, self.cfg.time_dim).to(self.dtype))

    def streamed_blocks(self) -> list[nn.Module]:
        """The blocks in the order a forward pass runs them (models/streaming.py streams some of them)."""
        return [*self.double_blocks, *self.single_blocks]

    def forward(self, img: torch.Tensor, txt: torch.Tensor, sigma: torch.Tensor, rope: torch.Tensor,
                n_target: int | None = None, kv: RefKV | None = None) -> torch.Tensor:
        """Velocity for the first `n_target` image tokens.

        img: (B, N, in_channels) packed tokens, target first then references; txt: (B, T, context_dim);
        sigma: (B,) noise levels in [0, 1]; rope: `rope_table` of [text ids; image ids] (T + N rows, the references'
        rows included also when kv holds them instead of img).

        kv (ComfyUI's FluxKVCache): while empty, a forward with references (img longer than n_target) modulates the
        reference tokens with the t=0 embedding (text and target tokens with sigma's), attends over all tokens
        unmasked, and caches the references' keys and values of every block; once filled, img holds the n_target
        target tokens only and every block attends over [text, target] plus the cached reference keys.
        """
        n_target = img.shape[1] if n_target is None else n_target
        n_ref = img.shape[1] - n_target
        if kv is not None and kv.filled and n_ref:
            raise ValueError("this forward's references are in its RefKV cache already; pass the target tokens only")
        if kv is not None and not kv.filled and not n_ref:
            kv = None  # nothing to cache (ComfyUI's patch does nothing without references)
        vec = self._vec(sigma)
        mod_img = self.double_stream_modulation_img(vec)
        mod_txt = self.double_stream_modulation_txt(vec)
        mod_single = self.single_stream_modulation(vec)
        spans_img: Spans = ((0, mod_img),)
        spans_single: Spans = ((0, mod_single),)
        n_txt = txt.shape[1]
        if kv is not None and n_ref:  # the first step: references at t=0, their K/V cached
            vec0 = self._vec(torch.zeros_like(sigma))
            spans_img = ((0, mod_img), (n_target, self.double_stream_modulation_img(vec0)))
            spans_single = ((0, mod_single), (n_txt + n_target, self.single_stream_modulation(vec0)))
            kv.filling = True
        x = self.img_in(img.to(self.dtype))
        c = self.txt_in(txt.to(self.dtype))
        for i, block in enumerate(self.double_blocks):
            x, c = block(x, c, spans_img, mod_txt, rope, kv, n_ref, i)
        h = torch.cat([c, x], dim=1)
        del x, c
        for i, block in enumerate(self.single_blocks):
            h = block(h, spans_single, rope, kv, n_ref, i)
        if kv is not None:
            kv.filling = False
        return self.final_layer(h[:, n_txt:n_txt + n_target], vec)


def load_transformer(infos: Mapping[str, TensorInfo], cfg: Flux2Config | None = None, *,
                     dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                     fp8_compute: str | None = None) -> Flux2Transformer:
    """Build the transformer from prefix-stripped checkpoint tensors, without random init; fp8 layers stay fp8 and
    compute by `fp8_compute` ("dequant", "scaled_mm"; None: models.fp8.DEFAULT_COMPUTE)."""
    cfg = cfg or config_from_checkpoint(infos)
    return load_weights(lambda: Flux2Transformer(cfg), sources(cfg, infos.keys()), infos, dtype=dtype, device=device,
                        fp8_compute=fp8_compute)
