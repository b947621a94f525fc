"""Reference models (diffusers, transformers) at tiny sizes with random weights, and writers for the
checkpoint layouts users have. The key maps here are written independently of the package's own
(from the public key tables), so a mistake in one is caught by the other."""

from __future__ import annotations

import re

import torch
from helpers import perturb_

TINY_VAE = dict(block_out_channels=(32, 32, 64, 64), layers_per_block=1)
TINY_QWEN3 = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
                  max_position_embeddings=40960, tie_word_embeddings=True)
TINY_TRANSFORMER = dict(num_layers=1, num_single_layers=2, num_attention_heads=2, attention_head_dim=128,
                        joint_attention_dim=192, in_channels=128, guidance_embeds=False)


def diffusers_transformer(seed: int = 0, **overrides):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**{**TINY_TRANSFORMER, **overrides}).float().eval()
    return perturb_(model, seed)


def diffusers_vae(seed: int = 0):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = perturb_(AutoencoderKLFlux2(**TINY_VAE).float().eval(), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(0.3 + 2 * torch.rand(vae.bn.running_var.shape, generator=g))
    return vae.requires_grad_(False)


def transformers_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return perturb_(Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).float().eval(), seed).requires_grad_(False)


def transformer_to_bfl(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers Flux2Transformer2DModel state dict -> BFL (flux-2-klein-*.safetensors) keys."""
    top = {"x_embedder": "img_in", "context_embedder": "txt_in",
           "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
           "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
           "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
           "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
           "single_stream_modulation.linear": "single_stream_modulation.lin", "proj_out": "final_layer.linear"}
    double = {"attn.norm_q.weight": "img_attn.norm.query_norm.scale",
              "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
              "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
              "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
              "attn.to_out.0.weight": "img_attn.proj.weight", "attn.to_add_out.weight": "txt_attn.proj.weight",
              "ff.linear_in.weight": "img_mlp.0.weight", "ff.linear_out.weight": "img_mlp.2.weight",
              "ff_context.linear_in.weight": "txt_mlp.0.weight", "ff_context.linear_out.weight": "txt_mlp.2.weight"}
    single = {"attn.to_qkv_mlp_proj.weight": "linear1.weight", "attn.to_out.weight": "linear2.weight",
              "attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale"}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        base = k.removesuffix(".weight")
        if base in top:
            out[top[base] + ".weight"] = v
        elif k == "norm_out.linear.weight":
            scale, shift = v.chunk(2)
            out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
        elif m := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", k):
            if m[2] in double:
                out[f"double_blocks.{m[1]}.{double[m[2]]}"] = v
            else:
                assert re.fullmatch(r"attn\.(to_[qkv]|add_[qkv]_proj)\.weight", m[2]), k
        elif m := re.fullmatch(r"single_transformer_blocks\.(\d+)\.(.+)", k):
            out[f"single_blocks.{m[1]}.{single[m[2]]}"] = v
        else:
            raise KeyError(k)
        if m := re.fullmatch(r"transformer_blocks\.(\d+)\.attn\.to_q\.weight", k):
            p = f"transformer_blocks.{m[1]}.attn."
            out[f"double_blocks.{m[1]}.img_attn.qkv.weight"] = torch.cat([sd[p + f"to_{x}.weight"] for x in "qkv"])
            out[f"double_blocks.{m[1]}.txt_attn.qkv.weight"] = torch.cat(
                [sd[p + f"add_{x}_proj.weight"] for x in "qkv"])
    return out


_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out": "proj_out"}


def vae_to_bfl(sd: dict[str, torch.Tensor], n_levels: int, reverse_up: bool = True,
                       swap_up: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderKLFlux2 state dict -> BFL flux2-vae keys (written here, on purpose separately).

    reverse_up=False keeps diffusers' up-block indices (a wrong file); swap_up exchanges the resnets of two
    BFL up levels (a wrong file whose shapes still fit).
    """
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        p = key.split(".")
        if p[0] in ("quant_conv", "post_quant_conv"):
            p = ["encoder" if p[0] == "quant_conv" else "decoder", *p]
        elif p[0] in ("encoder", "decoder"):
            side, sub = p[0], p[1]
            if sub == "down_blocks":  # encoder.down_blocks.i.{resnets.j | downsamplers.0}.rest
                p = [side, "down", p[2], *(["block", p[4]] if p[3] == "resnets" else ["downsample"]), *p[5:]]
            elif sub == "up_blocks":
                i = n_levels - 1 - int(p[2]) if reverse_up else int(p[2])
                if p[3] == "resnets" and swap_up and i in swap_up:
                    i = swap_up[1] if i == swap_up[0] else swap_up[0]
                p = [side, "up", str(i), *(["block", p[4]] if p[3] == "resnets" else ["upsample"]), *p[5:]]
            elif sub == "mid_block" and p[2] == "resnets":
                p = [side, "mid", f"block_{int(p[3]) + 1}", *p[4:]]
            elif sub == "mid_block":  # attentions.0.{group_norm|to_q|to_k|to_v|to_out.0}.{weight|bias}
                p = [side, "mid", "attn_1", _ATTN[p[4]], p[-1]]
                if p[3] != "norm" and p[4] == "weight":
                    t = t.reshape(*t.shape, 1, 1)  # Linear -> 1x1 conv
            elif sub == "conv_norm_out":
                p = [side, "norm_out", *p[2:]]
        p = ["nin_shortcut" if s == "conv_shortcut" else s for s in p]
        out[".".join(p)] = t
    assert len(out) == len(sd)
    return out
