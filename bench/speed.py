"""Resident 1024² text-to-image, ours against diffusers' Flux2KleinPipeline, same random klein-4B weights
(bf16), both fully on the GPU, timed alternately in one run.

Each timed generation is prompt -> 4 sampling steps -> decoded pixels copied to the host, with a new
prompt every time so the text encoder runs. Both start from the same noise (ours drawn from the
seed, handed to diffusers as `latents`), so their images are compared too.

    python bench/speed.py OUT.json [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import TOKENIZER_DIR, cosine, env, ref_qwen3, ref_transformer, ref_vae, rel_l2, timed, write_report
from vramgraph.models import flux2, qwen3, vae
from vramgraph.models.common import infos_from_state_dict
from vramgraph.models.pipeline import Flux2Models, generate
from vramgraph.models.sampling import noise


def diffusers_pipeline(tr, te, ae):
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen2TokenizerFast

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                            base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                            max_image_seq_len=4096, time_shift_type="exponential")
    tok = Qwen2TokenizerFast.from_pretrained(str(TOKENIZER_DIR))
    pipe = Flux2KleinPipeline(scheduler=sched, vae=ae, text_encoder=te, tokenizer=tok, transformer=tr,
                              is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--side", type=int, default=1024)
    a = ap.parse_args()
    dt = torch.bfloat16
    tr, ae, te = ref_transformer(dt), ref_vae(dt), ref_qwen3(dt)
    pipe = diffusers_pipeline(tr, te, ae)
    ours = Flux2Models(
        transformer=flux2.load_transformer(infos_from_state_dict(tr.state_dict()), dtype=dt, device="cuda"),
        text_encoder=qwen3.load_qwen3(infos_from_state_dict(
            {k: v for k, v in te.state_dict().items() if k != "lm_head.weight"}), dtype=dt, device="cuda"),
        vae=vae.load_vae(infos_from_state_dict(ae.state_dict()), dtype=dt, device="cuda"),
        tokenizer=qwen3.PromptTokenizer.bundled(),
        distilled=True,
    )
    side, seed = a.side, 42
    start = noise(seed, 1, side // 16, side // 16)
    counter = iter(range(10**6))

    def run_ours():
        i = next(counter)
        return generate(ours, f"a lighthouse on a cliff, photo {i}", width=side, height=side, seed=seed).float().cpu()

    def run_diffusers():
        i = next(counter)
        return pipe(prompt=f"a lighthouse on a cliff, photo {i}", height=side, width=side, num_inference_steps=4,
                    latents=start.to("cuda", dt), output_type="pt").images.float().cpu()

    with torch.no_grad():
        # same prompt and noise: the two images should agree up to bf16 rounding
        img_ours = generate(ours, "a lighthouse on a cliff", width=side, height=side, seed=seed).float().cpu()
        img_ref = pipe(prompt="a lighthouse on a cliff", height=side, width=side, num_inference_steps=4,
                       latents=start.to("cuda", dt), output_type="pt").images.float().cpu()
        img_ours01 = (img_ours.clamp(-1, 1) + 1) / 2  # diffusers' "pt" output is already in [0, 1]
        for _ in range(2):  # warm-up
            run_ours()
            run_diffusers()
        t_ours, t_ref = [], []
        for _ in range(a.repeats):
            t_ours += timed(run_ours, 1)
            t_ref += timed(run_diffusers, 1)
    mo, mr = statistics.median(t_ours), statistics.median(t_ref)
    report = {
        "env": env(), "side": side, "steps": 4, "dtype": "bf16", "repeats": a.repeats,
        "ours_s": t_ours, "diffusers_s": t_ref,
        "ratio_ours_over_diffusers_median": mo / mr,
        "image_agreement": {"rel_l2": rel_l2(img_ours01, img_ref), "cosine": cosine(img_ours01, img_ref)},
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "pass": mo / mr <= 1.0,
    }
    write_report(a.out, report)


if __name__ == "__main__":
    main()
