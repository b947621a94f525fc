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
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import CheckpointError, RMSNorm, Source, TensorInfo, load_weights


@dataclass(frozen=True)
class Flux2Config:
    """Hyperparameters; the defaults are FLUX.2 [klein] 4B."""

    hidden: int = 3072
    heads: int = 24
    head_dim: int = 128
    depth_double: int = 5
    depth_single: int = 20
    in_channels: int = 128
    context_dim: int = 7680  # 3 x Qwen3 hidden
    mlp_ratio: float = 3.0
    rope_axes: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: float = 2000.0
    time_dim: int = 256
    eps: float = 1e-6

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)


KLEIN_4B = Flux2Config()
KLEIN_9B = Flux2Config(hidden=4096, heads=32, depth_double=8, depth_single=24, context_dim=12288)
VARIANTS = {"klein-4b": KLEIN_4B, "klein-9b": KLEIN_9B}


def variant_name(cfg: Flux2Config) -> str:
    """'klein-4b', 'klein-9b', or 'custom' for any other shape (tiny test models)."""
    for name, v in VARIANTS.items():
        if v == cfg:
            return name
    return "custom"


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


def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Unmasked attention over all tokens of (B, S, H, D) tensors; returns (B, S, H*D)."""
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift


class DoubleBlock(nn.Module):
    """Separate weights for text and image streams, joint attention over [text, image]."""

    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.img_attn = Attention(cfg)
        self.txt_attn = Attention(cfg)
        self.img_mlp = MLP(cfg)
        self.txt_mlp = MLP(cfg)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, mod_img: tuple[torch.Tensor, ...],
                mod_txt: tuple[torch.Tensor, ...], rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = mod_img
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = mod_txt
        iq, ik, iv = self.img_attn.qkv_heads(modulate(img, i_shift1, i_scale1, self.eps))
        tq, tk, tv = self.txt_attn.qkv_heads(modulate(txt, t_shift1, t_scale1, self.eps))
        n_txt = txt.shape[1]
        attn = joint_attention(torch.cat([tq, iq], 1), torch.cat([tk, ik], 1), torch.cat([tv, iv], 1), rope)
        img = img + i_gate1 * self.img_attn.proj(attn[:, n_txt:])
        txt = txt + t_gate1 * self.txt_attn.proj(attn[:, :n_txt])
        img = img + i_gate2 * self.img_mlp(modulate(img, i_shift2, i_scale2, self.eps))
        txt = txt + t_gate2 * self.txt_mlp(modulate(txt, t_shift2, t_scale2, self.eps))
        return img, txt


class SingleBlock(nn.Module):
    """One stream over [text, image]: attention and MLP in parallel from one fused projection."""

    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.heads = cfg.heads
        self.hidden = cfg.hidden
        self.mlp_hidden = cfg.mlp_hidden
        self.linear1 = nn.Linear(cfg.hidden, 3 * cfg.hidden + 2 * cfg.mlp_hidden, bias=False)
        self.linear2 = nn.Linear(cfg.hidden + cfg.mlp_hidden, cfg.hidden, bias=False)
        self.norm = QKNorm(cfg.head_dim, cfg.eps)

    def forward(self, x: torch.Tensor, mod: tuple[torch.Tensor, ...], rope: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = mod
        qkv, gate_up = self.linear1(modulate(x, shift, scale, self.eps)).split(
            [3 * self.hidden, 2 * self.mlp_hidden], dim=-1)
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).unbind(2)
        q, k = self.norm.query_norm(q), self.norm.key_norm(k)
        attn = joint_attention(q, k, v, rope)
        a, b = gate_up.chunk(2, dim=-1)
        return x + gate * self.linear2(torch.cat([attn, F.silu(a) * b], dim=-1))


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
        return self.img_in.weight.dtype

    def forward(self, img: torch.Tensor, txt: torch.Tensor, sigma: torch.Tensor, rope: torch.Tensor,
                n_target: int | None = None) -> torch.Tensor:
        """Velocity for the first `n_target` image tokens.

        img: (B, N, in_channels) packed tokens, target first then references; txt: (B, T, context_dim);
        sigma: (B,) noise levels in [0, 1]; rope: `rope_table` of [text ids; image ids] (T + N rows).
        """
        dt = self.dtype
        n_target = img.shape[1] if n_target is None else n_target
        # The references feed the model 1000*sigma rounded through the model dtype.
        s = sigma.to(dt) * 1000
        vec = self.time_in(timestep_embedding(s, self.cfg.time_dim).to(dt))
        mod_img = self.double_stream_modulation_img(vec)
        mod_txt = self.double_stream_modulation_txt(vec)
        mod_single = self.single_stream_modulation(vec)
        x = self.img_in(img.to(dt))
        c = self.txt_in(txt.to(dt))
        for block in self.double_blocks:
            x, c = block(x, c, mod_img, mod_txt, rope)
        n_txt = c.shape[1]
        h = torch.cat([c, x], dim=1)
        for block in self.single_blocks:
            h = block(h, mod_single, rope)
        return self.final_layer(h[:, n_txt:n_txt + n_target], vec)


# ---------------------------------------------------------------------------------------------
# Checkpoint naming

BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")


def is_bfl(keys: Collection[str]) -> bool:
    return "img_in.weight" in keys


def is_diffusers(keys: Collection[str]) -> bool:
    return "x_embedder.weight" in keys


def config_from_checkpoint(infos: Mapping[str, TensorInfo]) -> Flux2Config:
    """Infer the hyperparameters from tensor shapes (BFL or diffusers names, prefix already stripped)."""
    keys = infos.keys()
    if is_bfl(keys):
        img_in, txt_in, blocks = "img_in.weight", "txt_in.weight", r"(double|single)_blocks\.(\d+)\."
        qnorm = "double_blocks.0.img_attn.norm.query_norm.scale"
        mlp_in = "double_blocks.0.img_mlp.0.weight"
    elif is_diffusers(keys):
        img_in, txt_in, blocks = "x_embedder.weight", "context_embedder.weight", \
            r"(transformer|single_transformer)_blocks\.(\d+)\."
        qnorm = "transformer_blocks.0.attn.norm_q.weight"
        mlp_in = "transformer_blocks.0.ff.linear_in.weight"
    else:
        raise CheckpointError("not a FLUX.2 transformer: neither img_in.weight (BFL) nor x_embedder.weight "
                              "(diffusers) is present")
    try:
        hidden, in_ch = infos[img_in].shape
        context_dim = infos[txt_in].shape[1]
        head_dim = infos[qnorm].shape[0]
        mlp_hidden = infos[mlp_in].shape[0] // 2
    except KeyError as e:
        raise CheckpointError(f"not a FLUX.2 transformer: {e.args[0]} is missing") from e
    depth = {"double": 0, "single": 0, "transformer": 0, "single_transformer": 0}
    for k in keys:
        m = re.match(blocks, k)
        if m:
            depth[m[1]] = max(depth[m[1]], int(m[2]) + 1)
    n_double = depth["double"] or depth["transformer"]
    n_single = depth["single"] or depth["single_transformer"]
    if "guidance_in.in_layer.weight" in keys or "time_guidance_embed.guidance_embedder.linear_1.weight" in keys:
        raise CheckpointError("this transformer has a guidance embedding: it is FLUX.2 [dev], not [klein]")
    return Flux2Config(hidden=hidden, heads=hidden // head_dim, head_dim=head_dim, depth_double=n_double,
                       depth_single=n_single, in_channels=in_ch, context_dim=context_dim,
                       mlp_ratio=mlp_hidden / hidden)


_DIFFUSERS_TOP = {
    "img_in.weight": "x_embedder.weight",
    "txt_in.weight": "context_embedder.weight",
    "time_in.in_layer.weight": "time_guidance_embed.timestep_embedder.linear_1.weight",
    "time_in.out_layer.weight": "time_guidance_embed.timestep_embedder.linear_2.weight",
    "double_stream_modulation_img.lin.weight": "double_stream_modulation_img.linear.weight",
    "double_stream_modulation_txt.lin.weight": "double_stream_modulation_txt.linear.weight",
    "single_stream_modulation.lin.weight": "single_stream_modulation.linear.weight",
    "final_layer.linear.weight": "proj_out.weight",
}
_DIFFUSERS_DOUBLE = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "img_attn.proj.weight": "attn.to_out.0.weight",
    "img_mlp.0.weight": "ff.linear_in.weight",
    "img_mlp.2.weight": "ff.linear_out.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
    "txt_attn.proj.weight": "attn.to_add_out.weight",
    "txt_mlp.0.weight": "ff_context.linear_in.weight",
    "txt_mlp.2.weight": "ff_context.linear_out.weight",
}
_DIFFUSERS_SINGLE = {
    "linear1.weight": "attn.to_qkv_mlp_proj.weight",
    "linear2.weight": "attn.to_out.weight",
    "norm.query_norm.scale": "attn.norm_q.weight",
    "norm.key_norm.scale": "attn.norm_k.weight",
}


def _diffusers_source(name: str) -> Source:
    if name in _DIFFUSERS_TOP:
        return Source((_DIFFUSERS_TOP[name],))
    if name == "final_layer.adaLN_modulation.1.weight":
        return Source(("norm_out.linear.weight",), "swap_halves")  # diffusers stores (scale, shift)
    m = re.fullmatch(r"double_blocks\.(\d+)\.(.+)", name)
    if m:
        p = f"transformer_blocks.{m[1]}."
        if m[2] == "img_attn.qkv.weight":
            return Source(tuple(p + f"attn.to_{x}.weight" for x in "qkv"), "cat0")
        if m[2] == "txt_attn.qkv.weight":
            return Source(tuple(p + f"attn.add_{x}_proj.weight" for x in "qkv"), "cat0")
        return Source((p + _DIFFUSERS_DOUBLE[m[2]],))
    m = re.fullmatch(r"single_blocks\.(\d+)\.(.+)", name)
    if m:
        return Source((f"single_transformer_blocks.{m[1]}." + _DIFFUSERS_SINGLE[m[2]],))
    raise KeyError(name)


def sources(cfg: Flux2Config, keys: Collection[str]) -> dict[str, Source]:
    """Where each of our parameters comes from in a checkpoint with these (prefix-stripped) keys."""
    with torch.device("meta"):
        names = [n for n, _ in Flux2Transformer(cfg).named_parameters()]
    bfl = is_bfl(keys)
    out = {n: Source((n,)) if bfl else _diffusers_source(n) for n in names}
    missing = sorted({k for s in out.values() for k in s.keys} - set(keys))
    if missing:
        raise CheckpointError(f"FLUX.2 transformer checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return out


def block_of(name: str) -> str:
    """The planner's unit a parameter belongs to: 'double_blocks.3', 'single_blocks.12' or 'shared'."""
    m = re.match(r"(double_blocks|single_blocks)\.(\d+)\.", name)
    return f"{m[1]}.{m[2]}" if m else "shared"


def load_transformer(infos: Mapping[str, TensorInfo], cfg: Flux2Config | None = None, *,
                     dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Flux2Transformer:
    """Build the transformer from prefix-stripped checkpoint tensors, without random init."""
    cfg = cfg or config_from_checkpoint(infos)
    return load_weights(lambda: Flux2Transformer(cfg), sources(cfg, infos.keys()), infos, dtype=dtype, device=device)
