"""FLUX.2 VAE (AutoencoderKLFlux2) in plain PyTorch.

Parameter and buffer names are the BFL/ComfyUI keys of `flux2-vae.safetensors`, so such a file loads
with plain copies; `sources` also maps the diffusers `vae/` folder layout (decoder up blocks stored in
reverse order, mid-attention projections stored as Linear weights).

Latent spaces: the raw latent is the encoder mean, 32 channels at 1/8 of the pixels. The packed
latent the transformer sees patchifies it 2x2 to 128 channels (channel = 4c + 2*py + px) at 1/16 and
normalises it with the BatchNorm running statistics kept in `bn`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .common import load_weights
from .headers import TensorInfo
from .vae_config import PARTS as PARTS
from .vae_config import VAEConfig as VAEConfig
from .vae_config import _check_parts as _check_parts
from .vae_config import config_from_checkpoint as config_from_checkpoint
from .vae_config import parameter_shapes as parameter_shapes
from .vae_config import sources as sources

Between = Callable[[], None] | None  # called between blocks of a long encode or decode (an interrupt check)

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

    def forward(self, x: torch.Tensor, between: Between = None) -> torch.Tensor:
        for blk in self.block:
            x = blk(x)
            if between is not None:
                between()
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

    def forward(self, x: torch.Tensor, between: Between = None) -> torch.Tensor:
        """Pixels (B, C, H, W) -> the mean of the latent distribution (B, latent, H/8, W/8)."""
        h = self.conv_in(x)
        for level in self.down:
            h = level(h, between)
        h = self.conv_out(F.silu(group_norm(self.mid(h), self.norm_out), inplace=True))
        lc = self.latent_channels  # only the mean half of quant_conv is needed
        return F.conv2d(h, self.quant_conv.weight[:lc], self.quant_conv.bias[:lc])


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        ch = cfg.decoder_widths  # the small decoder's are narrower than the encoder's
        self.post_quant_conv = nn.Conv2d(cfg.latent_channels, cfg.latent_channels, 1)
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch[-1], 3, padding=1)
        self.mid = MidBlock(ch[-1], cfg.norm_groups, cfg.eps)
        # up[i] works at the resolution of down[i]; it runs from the last level to the first.
        self.up = nn.ModuleList(
            Level(ch[min(i + 1, len(ch) - 1)], ch[i], cfg.layers_per_block + 1, cfg, "upsample" if i > 0 else None)
            for i in range(len(ch)))
        self.norm_out = nn.GroupNorm(cfg.norm_groups, ch[0], cfg.eps)
        self.conv_out = nn.Conv2d(ch[0], cfg.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor, between: Between = None) -> torch.Tensor:
        h = self.mid(self.conv_in(self.post_quant_conv(z)))
        if between is not None:
            between()
        for level in reversed(self.up):
            h = level(h, between)
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

    def encode_moments_mean(self, images: torch.Tensor, between: Between = None) -> torch.Tensor:
        """Pixels in [-1, 1] (B, 3, H, W) -> raw latent mean (B, 32, H/8, W/8) (diffusers' `.mode()`)."""
        if self.encoder is None:
            raise RuntimeError("this Flux2VAE was built without its encoder (parts=('decoder',))")
        return self.encoder(images.to(self._dtype()), between)

    def decode_unpacked(self, z: torch.Tensor, between: Between = None) -> torch.Tensor:
        """Raw latent (B, 32, h, w) -> pixels (B, 3, 8h, 8w), roughly in [-1, 1] (not clamped)."""
        if self.decoder is None:
            raise RuntimeError("this Flux2VAE was built without its decoder (parts=('encoder',))")
        return self.decoder(z.to(self._dtype()), between)

    def encode(self, images: torch.Tensor, between: Between = None) -> torch.Tensor:
        """Pixels in [-1, 1] (B, 3, H, W) -> normalised packed latent (B, 128, H/16, W/16); `between` is called
        after every resnet block (a running node's interrupt check)."""
        return self.pack(self.encode_moments_mean(images, between))

    def decode(self, latents: torch.Tensor, between: Between = None) -> torch.Tensor:
        """Normalised packed latent (B, 128, h, w) -> pixels (B, 3, 16h, 16w), roughly in [-1, 1]; `between` is
        called after the middle block and after every resnet block (a running node's interrupt check)."""
        return self.decode_unpacked(self.unpack(latents.to(self._dtype())), between)


def load_vae(infos: Mapping[str, TensorInfo], cfg: VAEConfig | None = None, parts: Iterable[str] = PARTS, *,
             dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Flux2VAE:
    """Build a Flux2VAE (only `parts`) from a checkpoint's tensor table, reading one tensor at a time."""
    cfg = cfg or config_from_checkpoint(infos)
    parts = _check_parts(parts)
    srcs = sources(cfg, infos.keys(), parts)
    model = load_weights(lambda: Flux2VAE(cfg, parts), srcs, infos, dtype=dtype, device=device)
    assert isinstance(model, Flux2VAE)
    return model
