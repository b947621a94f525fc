"""Qwen3 text encoder: hyperparameters, checkpoint naming and parameter shapes, without torch.

`qwen3.py` builds and runs the encoder; this part is what planning needs.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .headers import CheckpointError, Source, TensorInfo

_LEAVES = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)


@dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 hyperparameters (defaults: Qwen3-4B) and how FLUX.2-klein reads it."""

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_layers: int = 36  # in the checkpoint; only `n_built` are built
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    output_layers: tuple[int, ...] = (9, 18, 27)  # transformers' hidden_states indices (0 = embeddings)
    max_length: int = 512
    pad_id: int = 151643

    @property
    def n_built(self) -> int:
        """Decoder layers that are built and run: hidden state k is the output of layer k - 1."""
        return max(self.output_layers)

    @property
    def out_dim(self) -> int:
        return len(self.output_layers) * self.hidden_size


QWEN3_8B = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                       head_dim=128)


def _prefix(keys: Collection[str]) -> str:
    """'model.' for transformers/ComfyUI names, '' for bare names; CheckpointError if neither."""
    for p in ("model.", ""):
        if f"{p}embed_tokens.weight" in keys and f"{p}layers.0.self_attn.q_proj.weight" in keys:
            return p
    raise CheckpointError(
        "not a Qwen3 text encoder: no 'model.embed_tokens.weight' / 'model.layers.0.self_attn.q_proj.weight' "
        "(expected a Qwen3-4B/8B checkpoint such as ComfyUI's text_encoders/qwen_3_4b.safetensors or the "
        "text_encoder/ folder of FLUX.2-klein)")


def config_from_checkpoint(infos: Mapping[str, TensorInfo], base: Qwen3Config | None = None) -> Qwen3Config:
    """Infer the shapes of a Qwen3 checkpoint from its header; other fields come from `base`."""
    base = base or Qwen3Config()
    p = _prefix(infos.keys())
    qn = infos.get(f"{p}layers.0.self_attn.q_norm.weight")
    if qn is None:
        raise CheckpointError("not a Qwen3 text encoder: attention has no q_norm (Qwen2 or another model?); "
                              "FLUX.2-klein needs Qwen3-4B or Qwen3-8B")
    pat = re.compile(re.escape(p) + r"layers\.(\d+)\.")
    layers = {int(m.group(1)) for k in infos if (m := pat.match(k))}
    n_layers = max(layers) + 1
    if layers != set(range(n_layers)):
        raise CheckpointError(f"Qwen3 checkpoint has gaps in its layers: {sorted(set(range(n_layers)) - layers)[:5]}"
                              " are missing (an incomplete set of shards?)")
    if n_layers < base.n_built:
        raise CheckpointError(f"Qwen3 checkpoint has {n_layers} layers but hidden states {base.output_layers} need "
                              f"at least {base.n_built}: use the full Qwen3-4B/8B text encoder")
    try:
        vocab, hidden = infos[f"{p}embed_tokens.weight"].shape
        (head_dim,) = qn.shape
        q_rows = infos[f"{p}layers.0.self_attn.q_proj.weight"].shape[0]
        kv_rows = infos[f"{p}layers.0.self_attn.k_proj.weight"].shape[0]
        inter = infos[f"{p}layers.0.mlp.gate_proj.weight"].shape[0]
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"not a usable Qwen3 text encoder: {e} (missing or misshapen tensor)") from e
    if q_rows % head_dim or kv_rows % head_dim:
        raise CheckpointError(f"Qwen3 q/k projections ({q_rows}, {kv_rows} rows) are not multiples of head_dim "
                              f"{head_dim}")
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=n_layers,
                       num_heads=q_rows // head_dim, num_kv_heads=kv_rows // head_dim, head_dim=head_dim,
                       rms_eps=base.rms_eps, rope_theta=base.rope_theta, output_layers=base.output_layers,
                       max_length=base.max_length, pad_id=base.pad_id)


def parameter_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter of `Qwen3Encoder(cfg)` (the `n_built` layers), in its order, with its shape."""
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    leaf = {"self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d), "self_attn.v_proj.weight": (kv, d),
            "self_attn.o_proj.weight": (d, q), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
            "mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d), "mlp.down_proj.weight": (d, inter),
            "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    order = ("input_layernorm.weight", *_LEAVES[:6], "post_attention_layernorm.weight", *_LEAVES[6:9])  # modules'
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_built):
        out |= {f"layers.{i}.{name}": leaf[name] for name in order}
    return out


def sources(cfg: Qwen3Config, keys: Collection[str]) -> dict[str, Source]:
    """Checkpoint key of every encoder parameter (layers past n_built, model.norm and lm_head are unused)."""
    keys = set(keys)
    p = _prefix(keys)
    names = ["embed_tokens.weight"] + [f"layers.{i}.{leaf}" for i in range(cfg.n_built) for leaf in _LEAVES]
    missing = [p + name for name in names if p + name not in keys]
    if missing:
        raise CheckpointError(f"Qwen3 checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]} "
                              "(an incomplete set of shards, or not a Qwen3 text encoder)")
    return {name: Source((p + name,)) for name in names}
