"""FLUX.2 [klein] transformer: hyperparameters, checkpoint naming and parameter shapes, without torch.

`flux2.py` builds and runs the model; this part is what planning needs: a config read from a
checkpoint's header, the size of every parameter, and where each comes from in BFL or diffusers files.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .headers import CheckpointError, Source, TensorInfo


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


def parameter_shapes(cfg: Flux2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter of `Flux2Transformer(cfg)`, in its order, with its shape (without building it)."""
    h, m, hd = cfg.hidden, cfg.mlp_hidden, cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"img_in.weight": (h, cfg.in_channels), "txt_in.weight": (h, cfg.context_dim),
                                       "time_in.in_layer.weight": (h, cfg.time_dim),
                                       "time_in.out_layer.weight": (h, h)}
    for name, n in (("double_stream_modulation_img", 6), ("double_stream_modulation_txt", 6),
                    ("single_stream_modulation", 3)):
        out[f"{name}.lin.weight"] = (n * h, h)
    for i in range(cfg.depth_double):
        p = f"double_blocks.{i}."
        for stream in ("img", "txt"):
            out |= {f"{p}{stream}_attn.qkv.weight": (3 * h, h), f"{p}{stream}_attn.norm.query_norm.scale": (hd,),
                    f"{p}{stream}_attn.norm.key_norm.scale": (hd,), f"{p}{stream}_attn.proj.weight": (h, h)}
        for stream in ("img", "txt"):
            out |= {f"{p}{stream}_mlp.0.weight": (2 * m, h), f"{p}{stream}_mlp.2.weight": (h, m)}
    for i in range(cfg.depth_single):
        p = f"single_blocks.{i}."
        out |= {f"{p}linear1.weight": (3 * h + 2 * m, h), f"{p}linear2.weight": (h, h + m),
                f"{p}norm.query_norm.scale": (hd,), f"{p}norm.key_norm.scale": (hd,)}
    out |= {"final_layer.adaLN_modulation.1.weight": (2 * h, h), "final_layer.linear.weight": (cfg.in_channels, h)}
    return out


@dataclass(frozen=True)
class StepFlop:
    """Floating-point operations of one transformer forward (one sampling pass), from the model's shapes."""

    linear: int  # every matrix product with a weight: the blocks' projections and MLPs, embedders, final layer
    attention: int  # Q K^T and P V of every block (softmax and the elementwise work not counted)

    @property
    def total(self) -> int:
        return self.linear + self.attention


def step_flop(cfg: Flux2Config, image_tokens: int, text_tokens: int, batch: int = 1) -> StepFlop:
    """FLOP of one forward of `batch` sequences of `image_tokens` (target and references) and `text_tokens`.

    A token passes 13 hidden² weights in every block (a double block: qkv 3h², proj h², MLP 2m·h + m·h with
    m = 3h; a single block: linear1 (3h + 2m)·h, linear2 (h + m)·h), 2 FLOP per multiply-add; attention is
    2·S²·h for Q K^T and as much for P V over all S tokens of the joint sequence.

    >>> f = step_flop(Flux2Config(), 4096, 512)
    >>> round(f.linear / 1e12, 1), round(f.attention / 1e12, 2)
    (28.3, 6.52)
    """
    h, m, s = cfg.hidden, cfg.mlp_hidden, image_tokens + text_tokens
    per_token = 3 * h * h + h * h + 2 * m * h + m * h  # one block, one token (the same for both kinds)
    blocks = cfg.depth_double + cfg.depth_single
    linear = 2 * s * blocks * per_token
    linear += 2 * (image_tokens * cfg.in_channels * h + text_tokens * cfg.context_dim * h + image_tokens * h
                   * cfg.in_channels)  # img_in, txt_in, final layer
    linear += 2 * (cfg.time_dim * h + h * h + 15 * h * h + 2 * h * h)  # time embedding, modulations, final adaLN
    attention = 4 * s * s * h * blocks
    return StepFlop(batch * linear, batch * attention)


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
    names = list(parameter_shapes(cfg))
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
