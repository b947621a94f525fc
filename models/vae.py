"""FLUX.2 VAE (AutoencoderKLFlux2) in plain PyTorch.

Parameter and buffer names are the BFL/ComfyUI keys of `flux2-vae.safetensors`, so such a file loads
with plain copies; `sources` also maps the diffusers `vae/` folder layout (decoder up blocks stored in
reverse order, mid-attention projections stored as Linear weights).

Latent spaces: the raw latent is the encoder mean, 32 channels at 1/8 of the pixels. The packed
latent the transformer sees patchifies it 2x2 to 128 channels (channel = 4c + 2*py + px) at 1/16 and
normalises it with the BatchNorm running statistics kept in `bn`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import CheckpointError, Source, TensorInfo, load_weights

PARTS = ("encoder", "decoder")


@dataclass(frozen=True)
class VAEConfig:
    """Hyperparameters; the defaults are the released FLUX.2 VAE."""

    in_channels: int = 3
    out_channels: int = 3
    channels: tuple[int, ...] = (128, 256, 512, 512)  # per level, highest resolution first
    layers_per_block: int = 2  # resnets per encoder level; the decoder has one more per level
    latent_channels: int = 32
    norm_groups: int = 32
    eps: float = 1e-6
    bn_eps: float = 1e-4
    patch: int = 2

    @property
    def packed_channels(self) -> int:
        return self.latent_channels * self.patch * self.patch

    @property
    def downscale(self) -> int:
        """Pixels per packed-latent cell along one side (16 for FLUX.2)."""
        return 2 ** (len(self.channels) - 1) * self.patch


# ---------------------------------------------------------------------------------------------------
# layers


# PyTorch's GroupNorm kernel gives each (sample, group) row to one thread block, so at 1024² (a few
# million elements per group, 32 rows) it leaves most of a large GPU idle and takes half the decode
# time. Above this many elements per group the statistics come from two ordinary (grid-wide)
# reductions instead, in fp32, and the affine step is one fused elementwise kernel.
FAST_NORM_MIN = 1 << 18


def group_norm(x: torch.Tensor, norm: nn.GroupNorm, min_group: int = FAST_NORM_MIN) -> torch.Tensor:
    """`norm(x)`, with fp32 statistics; large groups take the faster reduction path."""
    b, c = x.shape[:2]
    g = norm.num_groups
    grad = torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad)
    if grad or x[0].numel() // g < min_group or not x.is_contiguous():
        return norm(x)
    xg = x.view(b, g, -1)
    n = xg.shape[-1]
    mean = xg.mean(-1, dtype=torch.float32)
    var = torch.linalg.vector_norm(xg, dim=-1, dtype=torch.float32).square_().div_(n).sub_(mean.square())
    rstd = var.clamp_min_(0).add_(norm.eps).rsqrt_()  # E[x²] - E[x]², fine for activations in fp32
    scale = norm.weight.float().view(1, g, -1) * rstd[..., None]
    shift = norm.bias.float().view(1, g, -1) - mean[..., None] * scale
    out = torch.empty_like(x)
    return torch.addcmul(shift.view(b, c, 1, 1), x, scale.view(b, c, 1, 1), out=out)  # fp32 math, x's dtype out


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GroupNorm and conv outputs are fresh tensors, so SiLU and the residual add work in place.
        h = self.conv1(F.silu(group_norm(x, self.norm1), inplace=True))
        h = self.conv2(F.silu(group_norm(h, self.norm2), inplace=True))
        return h.add_(x if self.nin_shortcut is None else self.nin_shortcut(x))


class AttnBlock(nn.Module):
    """Single-head self-attention over all pixels; q/k/v/proj_out are 1x1 convs as in the BFL file."""

    def __init__(self, c: int, groups: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, c, eps)
        self.q = nn.Conv2d(c, c, 1)
        self.k = nn.Conv2d(c, c, 1)
        self.v = nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        t = self.norm(x).flatten(2).transpose(1, 2)  # (B, HW, C) tokens
        q, k, v = (F.linear(t, m.weight.flatten(1), m.bias).unsqueeze(1) for m in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        o = F.linear(o, self.proj_out.weight.flatten(1), self.proj_out.bias)
        return x + o.transpose(1, 2).unflatten(2, (h, w))


class Downsample(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class MidBlock(nn.Module):
    def __init__(self, c: int, groups: int, eps: float) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(c, c, groups, eps)
        self.attn_1 = AttnBlock(c, groups, eps)
        self.block_2 = ResnetBlock(c, c, groups, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Level(nn.Module):
    """One resolution level: `block` resnets, then an optional `downsample` or `upsample`."""

    def __init__(self, cin: int, cout: int, n: int, cfg: VAEConfig, resample: str | None) -> None:
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(cin if j == 0 else cout, cout, cfg.norm_groups, cfg.eps)
                                   for j in range(n))
        self.resample = resample
        if resample == "downsample":
            self.downsample = Downsample(cout)
        elif resample == "upsample":
            self.upsample = Upsample(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.block:
            x = blk(x)
        return getattr(self, self.resample)(x) if self.resample else x


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        ch, n = cfg.channels, len(cfg.channels)
        self.conv_in = nn.Conv2d(cfg.in_channels, ch[0], 3, padding=1)
        self.down = nn.ModuleList(
            Level(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, cfg, "downsample" if i < n - 1 else None)
            for i in range(n))
        self.mid = MidBlock(ch[-1], cfg.norm_groups, cfg.eps)
        self.norm_out = nn.GroupNorm(cfg.norm_groups, ch[-1], cfg.eps)
        self.conv_out = nn.Conv2d(ch[-1], 2 * cfg.latent_channels, 3, padding=1)
        self.quant_conv = nn.Conv2d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1)
        self.latent_channels = cfg.latent_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels (B, C, H, W) -> the mean of the latent distribution (B, latent, H/8, W/8)."""
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.conv_out(F.silu(group_norm(self.mid(h), self.norm_out), inplace=True))
        lc = self.latent_channels  # only the mean half of quant_conv is needed
        return F.conv2d(h, self.quant_conv.weight[:lc], self.quant_conv.bias[:lc])


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        ch = cfg.channels
        self.post_quant_conv = nn.Conv2d(cfg.latent_channels, cfg.latent_channels, 1)
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch[-1], 3, padding=1)
        self.mid = MidBlock(ch[-1], cfg.norm_groups, cfg.eps)
        # up[i] works at the resolution of down[i]; it runs from the last level to the first.
        self.up = nn.ModuleList(
            Level(ch[min(i + 1, len(ch) - 1)], ch[i], cfg.layers_per_block + 1, cfg, "upsample" if i > 0 else None)
            for i in range(len(ch)))
        self.norm_out = nn.GroupNorm(cfg.norm_groups, ch[0], cfg.eps)
        self.conv_out = nn.Conv2d(ch[0], cfg.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(self.post_quant_conv(z)))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(group_norm(h, self.norm_out), inplace=True))


class LatentStats(nn.Module):
    """BatchNorm running statistics over the packed latent channels (`bn.*` in both layouts)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))


def patchify(z: torch.Tensor, p: int = 2) -> torch.Tensor:
    """(B, C, H, W) -> (B, C*p*p, H/p, W/p), channel = c*p*p + py*p + px."""
    b, c, h, w = z.shape
    return z.view(b, c, h // p, p, w // p, p).permute(0, 1, 3, 5, 2, 4).reshape(b, c * p * p, h // p, w // p)


def unpatchify(x: torch.Tensor, p: int = 2) -> torch.Tensor:
    """Inverse of `patchify`."""
    b, c, h, w = x.shape
    return x.view(b, c // (p * p), p, p, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // (p * p), h * p, w * p)


class Flux2VAE(nn.Module):
    """The FLUX.2 VAE; `parts` picks which halves are built (the planner may load the decoder alone)."""

    def __init__(self, cfg: VAEConfig | None = None, parts: Iterable[str] = PARTS) -> None:
        super().__init__()
        self.cfg = cfg = cfg or VAEConfig()
        self.parts = _check_parts(parts)
        self.encoder = Encoder(cfg) if "encoder" in self.parts else None
        self.decoder = Decoder(cfg) if "decoder" in self.parts else None
        self.bn = LatentStats(cfg.packed_channels)

    def _dtype(self) -> torch.dtype:
        return self.bn.running_mean.dtype

    def _stats(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.bn.running_mean.view(1, -1, 1, 1)
        std = (self.bn.running_var.float() + self.cfg.bn_eps).sqrt().view(1, -1, 1, 1)
        return mean.to(dtype), std.to(dtype)

    def pack(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latent (B, 32, h, w) -> normalised packed latent (B, 128, h/2, w/2)."""
        x = patchify(z, self.cfg.patch)
        mean, std = self._stats(x.dtype)
        return (x - mean) / std

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised packed latent (B, 128, h, w) -> raw latent (B, 32, 2h, 2w)."""
        mean, std = self._stats(latents.dtype)
        return unpatchify(torch.addcmul(mean, latents, std), self.cfg.patch)

    def encode_moments_mean(self, images: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] (B, 3, H, W) -> raw latent mean (B, 32, H/8, W/8) (diffusers' `.mode()`)."""
        if self.encoder is None:
            raise RuntimeError("this Flux2VAE was built without its encoder (parts=('decoder',))")
        return self.encoder(images.to(self._dtype()))

    def decode_unpacked(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latent (B, 32, h, w) -> pixels (B, 3, 8h, 8w), roughly in [-1, 1] (not clamped)."""
        if self.decoder is None:
            raise RuntimeError("this Flux2VAE was built without its decoder (parts=('encoder',))")
        return self.decoder(z.to(self._dtype()))

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] (B, 3, H, W) -> normalised packed latent (B, 128, H/16, W/16)."""
        return self.pack(self.encode_moments_mean(images))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised packed latent (B, 128, h, w) -> pixels (B, 3, 16h, 16w), roughly in [-1, 1]."""
        return self.decode_unpacked(self.unpack(latents.to(self._dtype())))


def _check_parts(parts: Iterable[str]) -> tuple[str, ...]:
    parts = tuple(parts)
    out = tuple(p for p in PARTS if p in parts)
    bad = set(parts) - set(PARTS)
    if bad or not out:
        raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {tuple(parts)}")
    return out


# ---------------------------------------------------------------------------------------------------
# checkpoints

_RESNET = re.compile(r"^(encoder|decoder)\.(down|up|down_blocks|up_blocks)\.(\d+)\.(block|resnets)\.(\d+)"
                     r"\.conv1\.weight$")


def _naming(keys: Collection[str]) -> str:
    """'bfl' or 'diffusers', from the key names."""
    if any(k.startswith(("encoder.down_blocks.", "decoder.up_blocks.", "encoder.mid_block.", "decoder.mid_block."))
           for k in keys):
        return "diffusers"
    if any(k.startswith(("encoder.down.", "decoder.up.", "encoder.mid.", "decoder.mid.")) for k in keys):
        return "bfl"
    raise CheckpointError(
        f"not a FLUX.2 VAE checkpoint: no encoder.down.* / decoder.up.* (BFL) or encoder.down_blocks.* / "
        f"decoder.up_blocks.* (diffusers) tensors among {len(keys)} keys (e.g. {sorted(keys)[:3]}); "
        "pass the VAE file or the vae/ folder, with any outer prefix stripped")


def _levels(found: dict[int, dict[int, int]], side: str) -> tuple[tuple[int, ...], int]:
    """Per-level output channels and resnets per level from {level: {resnet: out channels}}."""
    n = len(found)
    if sorted(found) != list(range(n)):
        raise CheckpointError(f"FLUX.2 VAE {side}: level indices {sorted(found)} are not 0..{n - 1}")
    counts = {len(found[i]) for i in range(n)}
    if len(counts) != 1 or any(sorted(found[i]) != list(range(len(found[i]))) for i in range(n)):
        raise CheckpointError(f"FLUX.2 VAE {side}: levels have uneven resnet lists {found}")
    return tuple(found[i][0] for i in range(n)), counts.pop()


def config_from_checkpoint(infos: Mapping[str, TensorInfo]) -> VAEConfig:
    """Infer the VAE's hyperparameters from tensor shapes (BFL or diffusers naming, either half or both)."""
    naming = _naming(infos.keys())
    found: dict[str, dict[int, dict[int, int]]] = {"encoder": {}, "decoder": {}}
    for key, info in infos.items():
        m = _RESNET.match(key)
        if m:
            found[m[1]].setdefault(int(m[3]), {})[int(m[5])] = info.shape[0]
    if naming == "diffusers" and found["decoder"]:  # diffusers stores up blocks lowest resolution first
        n = len(found["decoder"])
        found["decoder"] = {n - 1 - i: v for i, v in found["decoder"].items()}

    def shape(key: str) -> tuple[int, ...] | None:
        info = infos.get(key)
        return None if info is None else info.shape

    fields: dict[str, object] = {}
    latent: set[int] = set()
    if found["encoder"]:
        fields["channels"], fields["layers_per_block"] = _levels(found["encoder"], "encoder")
        if (s := shape("encoder.conv_in.weight")) is not None:
            fields["in_channels"] = s[1]
        if (s := shape("encoder.conv_out.weight")) is not None:
            latent.add(s[0] // 2)
    if found["decoder"]:
        ch, n = _levels(found["decoder"], "decoder")
        if "channels" in fields and (fields["channels"], fields["layers_per_block"]) != (ch, n - 1):
            raise CheckpointError(f"FLUX.2 VAE: encoder levels {fields['channels']} x {fields['layers_per_block']} "
                                  f"do not match decoder levels {ch} x {n - 1} (+1) resnets")
        fields["channels"], fields["layers_per_block"] = ch, n - 1
        if (s := shape("decoder.conv_out.weight")) is not None:
            fields["out_channels"] = s[0]
        if (s := shape("decoder.conv_in.weight")) is not None:
            latent.add(s[1])
    if "channels" not in fields or len(latent) != 1:
        raise CheckpointError(f"not a FLUX.2 VAE checkpoint ({naming} naming): cannot find the resnet levels and "
                              f"the latent width (conv_in/conv_out); found latent widths {sorted(latent)}")
    lc = latent.pop()
    bn = shape("bn.running_mean")
    if bn is None:
        raise CheckpointError("not a FLUX.2 VAE checkpoint: no bn.running_mean (the packed-latent statistics every "
                              "FLUX.2 VAE carries); this looks like a FLUX.1 / SD-style VAE")
    patch = math.isqrt(bn[0] // lc)
    if patch * patch * lc != bn[0]:
        raise CheckpointError(f"FLUX.2 VAE: bn.running_mean has {bn[0]} channels, not a square multiple of {lc}")
    return VAEConfig(latent_channels=lc, patch=patch, **fields)  # type: ignore[arg-type]


_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _diffusers_source(name: str, n_levels: int) -> Source:
    """Where one of our (BFL-named) tensors sits in a diffusers AutoencoderKLFlux2 state dict."""
    if name.startswith(("encoder.quant_conv.", "decoder.post_quant_conv.")):
        return Source((name.split(".", 1)[1],))
    if name.startswith("bn."):
        return Source((name,))
    side, rest = name.split(".", 1)
    rest = re.sub(r"^down\.(\d+)\.block\.", r"down_blocks.\1.resnets.", rest)
    rest = re.sub(r"^down\.(\d+)\.downsample\.", r"down_blocks.\1.downsamplers.0.", rest)
    rest = re.sub(r"^up\.(\d+)\.block\.", lambda m: f"up_blocks.{n_levels - 1 - int(m[1])}.resnets.", rest)
    rest = re.sub(r"^up\.(\d+)\.upsample\.", lambda m: f"up_blocks.{n_levels - 1 - int(m[1])}.upsamplers.0.", rest)
    rest = re.sub(r"^mid\.block_(\d)\.", lambda m: f"mid_block.resnets.{int(m[1]) - 1}.", rest)
    rest = rest.replace(".nin_shortcut.", ".conv_shortcut.")
    if rest.startswith("norm_out."):
        rest = "conv_" + rest
    m = re.match(r"^mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)$", rest)
    if m:
        op = "conv1x1" if m[1] != "norm" and m[2] == "weight" else "copy"  # Linear (o, i) -> conv (o, i, 1, 1)
        return Source((f"{side}.mid_block.attentions.0.{_ATTN[m[1]]}.{m[2]}",), op)
    return Source((f"{side}.{rest}",))


def sources(cfg: VAEConfig, keys: Collection[str], parts: Iterable[str] = PARTS) -> dict[str, Source]:
    """For every parameter and buffer of `Flux2VAE(cfg, parts)`, its Source in the checkpoint's naming."""
    naming = _naming(keys)
    with torch.device("meta"):
        model = Flux2VAE(cfg, parts)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    n_levels = len(cfg.channels)
    out = {n: Source((n,)) if naming == "bfl" else _diffusers_source(n, n_levels) for n in names}
    have = set(keys)
    missing = [k for s in out.values() for k in s.keys if k not in have]
    if missing:
        raise CheckpointError(f"FLUX.2 VAE checkpoint ({naming} naming) lacks {len(missing)} of the tensors "
                              f"{'/'.join(model.parts)} needs, e.g. {missing[:4]}")
    return out


def load_vae(infos: Mapping[str, TensorInfo], cfg: VAEConfig | None = None, parts: Iterable[str] = PARTS, *,
             dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Flux2VAE:
    """Build a Flux2VAE (only `parts`) from a checkpoint's tensor table, reading one tensor at a time."""
    cfg = cfg or config_from_checkpoint(infos)
    parts = _check_parts(parts)
    srcs = sources(cfg, infos.keys(), parts)
    model = load_weights(lambda: Flux2VAE(cfg, parts), srcs, infos, dtype=dtype, device=device)
    assert isinstance(model, Flux2VAE)
    return model
