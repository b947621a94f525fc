"""Reference models (diffusers, transformers) at tiny sizes with random weights, and writers for the
checkpoint layouts users have. The key maps here are written independently of the package's own
(from the public key tables), so a mistake in one is caught by the other."""

from __future__ import annotations

import re

import torch
from helpers import perturb_

TINY_TRANSFORMER = dict(num_layers=1, num_single_layers=2, num_attention_heads=2, attention_head_dim=128,
                        joint_attention_dim=192, in_channels=128, guidance_embeds=False)


def diffusers_transformer(seed: int = 0, **overrides):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**{**TINY_TRANSFORMER, **overrides}).float().eval()
    return perturb_(model, seed)


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
