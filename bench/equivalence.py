"""Full-shape numerical equivalence on the GPU: our models against diffusers / transformers on identical
random weights at FLUX.2-klein-4B shapes, in fp32 (TF32 off) and bf16.

- transformer: 1024² target + two 1024² references (12288 image tokens) + 512 text tokens, sigma 0.9
- VAE: decode of a 1024² latent, encode (mean) of a 1024² image
- text encoder: embeddings of 2 prompts of different lengths at all 512 positions

    python bench/equivalence.py OUT.json
"""

from __future__ import annotations

import gc
import sys

import torch
from _common import cosine, env, ref_qwen3, ref_transformer, ref_vae, rel_l2, to_dtype_keep_rope, write_report
from vramgraph.models import flux2, qwen3, vae
from vramgraph.models.common import infos_from_state_dict

FP32_MAX, BF16_MAX, BF16_COS = 1e-4, 3e-2, 0.999


def compare(ours: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor | None = None) -> dict:
    out = {"rel_l2": rel_l2(ours, ref), "cosine": cosine(ours, ref), "shape": list(ref.shape)}
    if truth is not None:
        out["rel_l2_vs_fp32_reference"] = rel_l2(ours, truth)
        out["reference_bf16_rel_l2_vs_fp32"] = rel_l2(ref, truth)
    return out


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@torch.no_grad()
def transformer_case() -> dict:
    g = torch.Generator().manual_seed(11)
    side = 64  # latent grid of a 1024² image
    n = side * side
    x = torch.randn(1, n, 128, generator=g)
    refs = [torch.randn(1, n, 128, generator=g) for _ in range(2)]
    ctx = torch.randn(1, 512, 7680, generator=g)
    sigma = torch.tensor([0.9])
    ids = torch.cat([flux2.image_ids(side, side), flux2.image_ids(side, side, 10), flux2.image_ids(side, side, 20)])
    img = torch.cat([x, *refs], 1).cuda()
    ctx = ctx.cuda()
    res = {}
    ref = ref_transformer(torch.float32)
    sd = ref.state_dict()

    def run_ref(ref, dt):
        return ref(hidden_states=img.to(dt), encoder_hidden_states=ctx.to(dt), timestep=sigma.cuda().to(dt),
                   img_ids=ids[None].cuda(), txt_ids=flux2.text_ids(512)[None].cuda(), guidance=None,
                   return_dict=False)[0][:, :n].float()

    def run_ours(model):
        rope = flux2.rope_table(model.cfg, torch.cat([flux2.text_ids(512), ids]), "cuda")
        return model(img, ctx, sigma.cuda(), rope, n).float()

    want32 = run_ref(ref, torch.float32)
    ours = flux2.load_transformer(infos_from_state_dict(sd), dtype=torch.float32, device="cuda")
    res["fp32"] = compare(run_ours(ours), want32)
    del ours
    free()
    ours = flux2.load_transformer(infos_from_state_dict(sd), dtype=torch.bfloat16, device="cuda")
    del sd
    ref.to(torch.bfloat16)
    free()
    res["bf16"] = compare(run_ours(ours), run_ref(ref, torch.bfloat16), want32)
    del ours, ref
    free()
    return res


@torch.no_grad()
def vae_case() -> dict:
    g = torch.Generator().manual_seed(12)
    z = torch.randn(1, 32, 128, 128, generator=g).cuda()
    image = (torch.rand(1, 3, 1024, 1024, generator=g) * 2 - 1).cuda()
    ref = ref_vae(torch.float32)
    sd = ref.state_dict()
    dec32 = ref.decode(z).sample.float()
    enc32 = ref.encode(image).latent_dist.mode().float()
    res = {}
    ours = vae.load_vae(infos_from_state_dict(sd), dtype=torch.float32, device="cuda")
    res["decode_fp32"] = compare(ours.decode_unpacked(z).float(), dec32)
    res["encode_fp32"] = compare(ours.encode_moments_mean(image).float(), enc32)
    ours = vae.load_vae(infos_from_state_dict(sd), dtype=torch.bfloat16, device="cuda")
    ref.to(torch.bfloat16)
    zb, ib = z.bfloat16(), image.bfloat16()
    res["decode_bf16"] = compare(ours.decode_unpacked(zb).float(), ref.decode(zb).sample.float(), dec32)
    res["encode_bf16"] = compare(ours.encode_moments_mean(ib).float(), ref.encode(ib).latent_dist.mode().float(), enc32)
    del ours, ref
    free()
    return res


@torch.no_grad()
def text_case() -> dict:
    tok = qwen3.PromptTokenizer.bundled()
    ids, mask = tok.encode(["A red fox jumping over a frozen river at dawn, cinematic light, 35mm photo",
                            "a cat"])
    ids, mask = ids.cuda(), mask.cuda()
    ref = ref_qwen3(torch.float32)
    sd = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}

    def run_ref(ref):
        hs = ref.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        return torch.stack([hs[9], hs[18], hs[27]], 1).permute(0, 2, 1, 3).reshape(2, 512, -1).float()

    want32 = run_ref(ref)
    res = {"real_tokens": mask.sum(1).tolist()}
    ours = qwen3.load_qwen3(infos_from_state_dict(sd), dtype=torch.float32, device="cuda")
    res["fp32"] = compare(ours(ids, mask).float(), want32)
    del ours
    free()
    ours = qwen3.load_qwen3(infos_from_state_dict(sd), dtype=torch.bfloat16, device="cuda")
    del sd
    to_dtype_keep_rope(ref, torch.bfloat16)
    free()
    res["bf16"] = compare(ours(ids, mask).float(), run_ref(ref), want32)
    del ours, ref
    free()
    return res


def verdict(report: dict) -> dict:
    checks = {}
    for comp in ("transformer", "vae", "text_encoder"):
        for name, r in report[comp].items():
            if not isinstance(r, dict):
                continue
            if "fp32" in name:
                checks[f"{comp}.{name}"] = r["rel_l2"] < FP32_MAX
            else:
                checks[f"{comp}.{name}"] = r["rel_l2"] < BF16_MAX and r["cosine"] > BF16_COS
    return {"thresholds": {"fp32_rel_l2": FP32_MAX, "bf16_rel_l2": BF16_MAX, "bf16_cosine": BF16_COS},
            "pass": all(checks.values()), "checks": checks}


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report = {"env": env(), "tf32": False}
    report["transformer"] = transformer_case()
    report["vae"] = vae_case()
    report["text_encoder"] = text_case()
    report["verdict"] = verdict(report)
    write_report(sys.argv[1] if len(sys.argv) > 1 else "equivalence.json", report)


if __name__ == "__main__":
    main()
