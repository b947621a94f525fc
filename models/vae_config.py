"""FLUX.2 VAE: hyperparameters, checkpoint naming and parameter shapes, without torch.

`vae.py` builds and runs the VAE; this part is what planning needs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from .headers import CheckpointError, Source, TensorInfo

PARTS = ("encoder", "decoder")


@dataclass(frozen=True)
class VAEConfig:
    """Hyperparameters; the defaults are the released FLUX.2 VAE."""

    in_channels: int = 3
    out_channels: int = 3
    channels: tuple[int, ...] = (128, 256, 512, 512)  # per level, highest resolution first
    # The decoder's widths per level when they differ from `channels` (the encoder's): the FLUX.2 small decoder
    # (full_encoder_small_decoder.safetensors) has (96, 192, 384, 384). Empty: the same as the encoder.
    decoder_channels: tuple[int, ...] = ()
    layers_per_block: int = 2  # resnets per encoder level; the decoder has one more per level
    latent_channels: int = 32
    norm_groups: int = 32
    eps: float = 1e-6
    bn_eps: float = 1e-4
    patch: int = 2

    @property
    def decoder_widths(self) -> tuple[int, ...]:
        """The decoder's per-level widths, highest resolution first."""
        return self.decoder_channels or self.channels

    @property
    def packed_channels(self) -> int:
        return self.latent_channels * self.patch * self.patch

    @property
    def downscale(self) -> int:
        """Pixels per packed-latent cell along one side (16 for FLUX.2)."""
        return 2 ** (len(self.channels) - 1) * self.patch


# The FLUX.2 small decoder (BFL's FLUX.2-small-decoder, full_encoder_small_decoder.safetensors): the encoder unchanged,
# a distilled decoder 0.75x as wide at every level (27.9 M parameters against 49.6 M).
SMALL_DECODER = VAEConfig(decoder_channels=(96, 192, 384, 384))


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
        if "channels" in fields:
            enc = fields["channels"]
            if (len(enc), fields["layers_per_block"]) != (len(ch), n - 1):
                raise CheckpointError(f"FLUX.2 VAE: encoder levels {enc} x {fields['layers_per_block']} "
                                      f"do not match decoder levels {ch} x {n - 1} (+1) resnets")
            if ch != enc:
                fields["decoder_channels"] = _narrow_decoder(enc, ch, shape("decoder.conv_in.weight"))
        else:
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


def _narrow_decoder(enc: tuple[int, ...], dec: tuple[int, ...], conv_in: tuple[int, ...] | None) -> tuple[int, ...]:
    """A decoder narrower (or wider) than its encoder, as the FLUX.2 small decoder: accepted when its widths are the
    encoder's level multipliers times one base width, the base width being ComfyUI's rule
    `decoder.conv_in.weight.shape[0] // ch_mult[-1]` (384 // 4 = 96 for the small decoder)."""
    base = enc[0]
    mult = [c // base for c in enc]
    ok = conv_in is not None and all(c == m * base for c, m in zip(enc, mult, strict=True))
    ch = conv_in[0] // mult[-1] if ok and conv_in is not None else 0
    if not ok or dec != tuple(ch * m for m in mult):
        raise CheckpointError(f"FLUX.2 VAE: decoder levels {dec} are not the encoder's level multipliers {tuple(mult)} "
                              f"times one width (encoder levels {enc}); not a FLUX.2 VAE or small decoder")
    return dec


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
    parts = _check_parts(parts)
    names = list(parameter_shapes(cfg, parts))
    n_levels = len(cfg.channels)
    out = {n: Source((n,)) if naming == "bfl" else _diffusers_source(n, n_levels) for n in names}
    have = set(keys)
    missing = [k for s in out.values() for k in s.keys if k not in have]
    if missing:
        raise CheckpointError(f"FLUX.2 VAE checkpoint ({naming} naming) lacks {len(missing)} of the tensors "
                              f"{'/'.join(parts)} needs, e.g. {missing[:4]}")
    return out


def _conv(name: str, cin: int, cout: int, k: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (cout, cin, k, k), f"{name}.bias": (cout,)}


def _norm(name: str, c: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (c,), f"{name}.bias": (c,)}


def _resnet(p: str, cin: int, cout: int) -> dict[str, tuple[int, ...]]:
    out = _norm(f"{p}norm1", cin) | _conv(f"{p}conv1", cin, cout, 3) | _norm(f"{p}norm2", cout)
    out |= _conv(f"{p}conv2", cout, cout, 3)
    return out | (_conv(f"{p}nin_shortcut", cin, cout, 1) if cin != cout else {})


def _mid(p: str, c: int) -> dict[str, tuple[int, ...]]:
    attn = _norm(f"{p}attn_1.norm", c)
    for x in ("q", "k", "v", "proj_out"):
        attn |= _conv(f"{p}attn_1.{x}", c, c, 1)
    return _resnet(f"{p}block_1.", c, c) | attn | _resnet(f"{p}block_2.", c, c)


def parameter_shapes(cfg: VAEConfig, parts: Iterable[str] = PARTS) -> dict[str, tuple[int, ...]]:
    """Every parameter, then every buffer, of `Flux2VAE(cfg, parts)` in its order, with its shape."""
    parts = _check_parts(parts)
    ch, n, lc = cfg.channels, len(cfg.channels), cfg.latent_channels
    out: dict[str, tuple[int, ...]] = {}
    if "encoder" in parts:
        out |= _conv("encoder.conv_in", cfg.in_channels, ch[0], 3)
        for i in range(n):
            for j in range(cfg.layers_per_block):
                out |= _resnet(f"encoder.down.{i}.block.{j}.", ch[max(i - 1, 0)] if j == 0 else ch[i], ch[i])
            if i < n - 1:
                out |= _conv(f"encoder.down.{i}.downsample.conv", ch[i], ch[i], 3)
        out |= _mid("encoder.mid.", ch[-1]) | _norm("encoder.norm_out", ch[-1])
        out |= _conv("encoder.conv_out", ch[-1], 2 * lc, 3) | _conv("encoder.quant_conv", 2 * lc, 2 * lc, 1)
    if "decoder" in parts:
        ch = cfg.decoder_widths
        out |= _conv("decoder.post_quant_conv", lc, lc, 1) | _conv("decoder.conv_in", lc, ch[-1], 3)
        out |= _mid("decoder.mid.", ch[-1])
        for i in range(n):
            for j in range(cfg.layers_per_block + 1):
                out |= _resnet(f"decoder.up.{i}.block.{j}.", ch[min(i + 1, n - 1)] if j == 0 else ch[i], ch[i])
            if i > 0:
                out |= _conv(f"decoder.up.{i}.upsample.conv", ch[i], ch[i], 3)
        out |= _norm("decoder.norm_out", ch[0]) | _conv("decoder.conv_out", ch[0], cfg.out_channels, 3)
    return out | {"bn.running_mean": (cfg.packed_channels,), "bn.running_var": (cfg.packed_channels,)}
