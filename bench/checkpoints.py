"""Real-size checkpoints written by the reference implementations, loaded through our loaders.

Runs the shared tool make_checkpoints.py (carried in .whl/tools: diffusers and transformers build
random-weight klein-4B models in bf16 and write them as ComfyUI split files, an HF diffusers folder and
a prefixed BFL file, plus the reference models' outputs for fixed inputs). Then, for each layout,
recognises the files from their headers, loads every component onto the GPU and compares our outputs
with the reference outputs (bf16 thresholds: rel-L2 < 3e-2, cosine > 0.999).

    python bench/checkpoints.py OUT.json [--dir /tmp/ck]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import cosine, env, rel_l2, write_report
from vramgraph.models import flux2, loading

TOOLS = Path(os.environ.get("VG_SHARED_TOOLS", ".whl/tools"))


def layouts(d: Path) -> dict[str, list[Path]]:
    comfy = d / "comfyui" / "models"
    return {
        "comfyui": [comfy],
        "hf": [d / "hf" / "FLUX.2-klein-4B"],
        "bfl_prefixed": [d / "bfl-prefixed-flux-2-klein-4b.safetensors",
                         comfy / "text_encoders" / "qwen_3_4b.safetensors", comfy / "vae" / "flux2-vae.safetensors"],
    }


def check(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    r, c = rel_l2(ours.float().cpu(), ref), cosine(ours.float().cpu(), ref)
    return {"rel_l2": r, "cosine": c, "pass": r < 3e-2 and c > 0.999}


@torch.no_grad()
def run_layout(paths: list[Path], ref: dict, text_ref: torch.Tensor) -> dict:
    t0 = time.perf_counter()
    spec = loading.inspect(paths)
    out = {"inspect_s": time.perf_counter() - t0, "variant": spec.variant, "distilled": spec.distilled,
           "layouts": {k: getattr(spec, k).layout for k in loading.COMPONENTS},
           "gib_bf16": {k: getattr(spec, k).nbytes(torch.bfloat16) / 2**30 for k in loading.COMPONENTS}}
    dev = "cuda"
    t0 = time.perf_counter()
    tr = loading.load(spec.transformer, device=dev)
    torch.cuda.synchronize()
    out["transformer_load_s"] = time.perf_counter() - t0
    n = ref["tr_x"].shape[1]
    img = torch.cat([ref["tr_x"], ref["tr_ref"]], 1).to(dev)
    rope = flux2.rope_table(tr.cfg, torch.cat([ref["tr_txt_ids"][0], ref["tr_img_ids"][0]]), dev)
    out["transformer"] = check(tr(img, ref["tr_ctx"].to(dev), ref["tr_t"].to(dev), rope, n), ref["tr_out"])
    del tr
    gc.collect()
    ae = loading.load(spec.vae, device=dev)
    out["vae_decode"] = check(ae.decode_unpacked(ref["vae_z"].to(dev, torch.bfloat16)), ref["vae_dec"])
    out["vae_encode"] = check(ae.encode_moments_mean(ref["vae_img"].to(dev, torch.bfloat16)), ref["vae_enc_mean"])
    del ae
    te = loading.load(spec.text_encoder, device=dev)
    emb = te(ref["te_ids"].to(dev), ref["te_mask"].to(dev))
    out["text_encoder_vs_tool_output"] = check(emb, ref["te_emb"])
    out["text_encoder"] = check(emb, text_ref)
    del te
    gc.collect()
    torch.cuda.empty_cache()
    return out


@torch.no_grad()
def text_reference(folder: Path, ref: dict, rope: str) -> torch.Tensor:
    """transformers' Qwen3 embeddings for the tool's token ids, from the HF text_encoder/ folder in bf16.

    make_checkpoints.py builds its Qwen3 and then calls .to(bf16), which also rounds the RoPE
    frequencies (inv_freq) to bf16; from_pretrained(dtype=bf16), what users run, keeps them in fp32.
    rope="fp32" is the users' reference; rope="bf16" reproduces the tool's recorded output.
    """
    from transformers import Qwen3ForCausalLM

    m = Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()
    if rope == "bf16":
        rot = m.model.rotary_emb
        rot.inv_freq = rot.inv_freq.to(torch.bfloat16)
    hs = m.model(input_ids=ref["te_ids"].cuda(), attention_mask=ref["te_mask"].cuda(), output_hidden_states=True,
                 use_cache=False).hidden_states
    emb = torch.stack([hs[9], hs[18], hs[27]], 1).permute(0, 2, 1, 3).reshape(2, 512, -1).float().cpu()
    assert m.model.rotary_emb.inv_freq.dtype == (torch.float32 if rope == "fp32" else torch.bfloat16)
    del m, hs
    gc.collect()
    torch.cuda.empty_cache()
    return emb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dir", default="/tmp/ck")
    a = ap.parse_args()
    d = Path(a.dir)
    t0 = time.perf_counter()
    if not (d / "reference_outputs.pt").exists():
        subprocess.run([sys.executable, str(TOOLS / "make_checkpoints.py"), str(d), "--full", "--device", "cuda",
                        "--dtype", "bf16"], check=True, stdout=subprocess.DEVNULL)
    write_s = time.perf_counter() - t0
    ref = torch.load(d / "reference_outputs.pt")
    report = {"env": env(), "checkpoints": "shared/tools/make_checkpoints.py --full --dtype bf16",
              "write_s": write_s, "results": {}}
    hf_te = d / "hf" / "FLUX.2-klein-4B" / "text_encoder"
    text_ref = text_reference(hf_te, ref, "fp32")
    report["tool_text_output_explained"] = {
        "transformers_with_bf16_rope_vs_tool_output": check(text_reference(hf_te, ref, "bf16"), ref["te_emb"]),
        "transformers_with_fp32_rope_vs_tool_output": check(text_ref, ref["te_emb"]),
    }
    for name, paths in layouts(d).items():
        report["results"][name] = run_layout(paths, ref, text_ref)
    report["pass"] = all(r[c]["pass"] for r in report["results"].values()
                         for c in ("transformer", "vae_decode", "vae_encode", "text_encoder"))
    write_report(a.out, report)


if __name__ == "__main__":
    main()
