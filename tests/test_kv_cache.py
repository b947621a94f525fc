"""klein-9B-kv with ComfyUI's FluxKVCache semantics, against diffusers' Flux2KleinKVPipeline (diffusers 0.42.1).

What both do (and what is checked to be equal): reference tokens are modulated with the t=0 embedding (text and
target tokens with t), reference i sits at time index 10*(i+1), the first step runs over [text, target, references]
and caches the references' keys and values of every block, every later step runs on [text, target] alone and
attends to the cached reference keys as well.

Where they differ, and why the comparison below removes one thing from diffusers:
- Step-0 attention. diffusers' `_flux2_kv_causal_attention` (extract mode) lets the reference queries attend only to
  the reference keys (text and target queries attend to everything); ComfyUI (comfy_extras/nodes_flux.py
  FluxKVCache, comfy/ldm/flux) adds no mask: every token attends to every token on step 0, so the references' hidden
  states (and so the cached K/V from the second block on) depend on the prompt and the noisy target. We follow
  ComfyUI, so our step 0 and therefore the picture differ from the unmodified pipeline
  (`test_cached_keys_are_pre_rope` shows the step-0 output and the cached keys differing). For the equality
  checks diffusers' extract-mode attention is replaced by plain full attention (`comfy_attention` below), which is
  exactly ComfyUI's step 0; every other part (modulation blending, ids, caching, the cached steps) is diffusers' own.
- Where the keys are cached. diffusers caches them after RoPE, ComfyUI (and we) before it and rotate them with the
  references' own positions every later step (the rotary table keeps the references' rows). The two are the same
  numbers; `test_cached_keys_are_pre_rope` shows it on the cache itself.
- Layout: diffusers orders [text, references, target], ComfyUI and we [text, target, references]. Attention without
  a mask does not depend on the order.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from diffusers.models.transformers import transformer_flux2 as tf2
from helpers import qwen_tokenizer_dir, rel_l2, save
from PIL import Image
from refmodels import diffusers_transformer, diffusers_vae, transformer_to_bfl, transformers_qwen3, vae_to_bfl
from vramgraph.models import flux2
from vramgraph.models.pipeline import generate, load_models
from vramgraph.models.sampling import noise, pack_references, sample, sigmas
from vramgraph.nodes import estimates
from vramgraph.nodes.types import CondInfo, LatentInfo, ModelInfo

TOK_DIR = qwen_tokenizer_dir()
W, H = 64, 48
_diffusers_kv_attention = tf2._flux2_kv_causal_attention


def comfy_attention(query, key, value, num_txt_tokens, num_ref_tokens, kv_cache=None, backend=None):
    """diffusers' KV attention with ComfyUI's step 0: no mask (the cached steps are diffusers' own)."""
    if kv_cache is None and num_ref_tokens > 0:
        return tf2.dispatch_attention_fn(query, key, value, backend=backend)
    return _diffusers_kv_attention(query, key, value, num_txt_tokens, num_ref_tokens, kv_cache, backend)


def _sharp(model):
    """Sharper attention (q/k norm scales x3: logits ~9x), so that who attends to whom shows in the outputs; at the
    random init every token attends almost evenly and the step-0 mask would change the output by only ~1e-5."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(f"norm_{x}.weight" in name for x in ("q", "k", "added_q", "added_k")):
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def refs():
    return {"transformer": _sharp(diffusers_transformer(seed=15)), "text_encoder": transformers_qwen3(seed=16),
            "vae": diffusers_vae(seed=17)}


@pytest.fixture(scope="module")
def ckpts(refs, tmp_path_factory):
    comfy = tmp_path_factory.mktemp("kv") / "models"
    save(transformer_to_bfl(refs["transformer"].state_dict()),
         comfy / "diffusion_models" / "flux-2-klein-9b-kv.safetensors")
    save({k: v for k, v in refs["text_encoder"].state_dict().items() if k != "lm_head.weight"},
         comfy / "text_encoders" / "qwen_3_8b.safetensors")
    save(vae_to_bfl(refs["vae"].state_dict(), 4), comfy / "vae" / "flux2-vae.safetensors")
    shutil.copy(TOK_DIR / "tokenizer.json", comfy / "text_encoders" / "tokenizer.json")
    return comfy


@pytest.fixture(scope="module")
def models(ckpts):
    return load_models(ckpts, dtype=torch.float32)


def _kv_pipe(refs):
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline
    from transformers import Qwen2TokenizerFast

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096,
                                            time_shift_type="exponential")
    pipe = Flux2KleinKVPipeline(scheduler=sched, vae=refs["vae"], text_encoder=refs["text_encoder"],
                                tokenizer=Qwen2TokenizerFast.from_pretrained(str(TOK_DIR)),
                                transformer=refs["transformer"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _images():
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 255, (64, 80, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 255, (96, 64, 3), dtype=np.uint8))]


def _unit(pixels):
    return ((pixels.float() + 1) / 2).clamp(0, 1)


def _run_pipe(refs, images, seed=9, steps=2):
    return _kv_pipe(refs)(prompt="put the hat on the fox", image=images, height=H, width=W,
                          num_inference_steps=steps, output_type="pt", latents=noise(seed, 1, H // 16, W // 16)).images


def test_edit_matches_the_kv_pipeline_with_comfyui_step_zero(refs, models, monkeypatch):
    """Two references, a first (caching) and a cached step: our FluxKVCache sampling = Flux2KleinKVPipeline with
    the step-0 mask removed, text encoder and VAE included."""
    images = _images()
    got = generate(models, "put the hat on the fox", width=W, height=H, seed=9, steps=2, references=images,
                   kv_cache=True)
    monkeypatch.setattr(tf2, "_flux2_kv_causal_attention", comfy_attention)
    want = _run_pipe(refs, images)
    assert got.shape == want.shape == (1, 3, H, W)
    assert rel_l2(_unit(got), want) < 1e-5  # measured 9e-7; the unmodified pipeline is 1.4e-4 away


class _Spy:
    """Records the image tokens and the RefKV of every transformer call."""

    def __init__(self, model: flux2.Flux2Transformer) -> None:
        self.calls: list[tuple[int, flux2.RefKV | None]] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        kv = args[5] if len(args) > 5 else kwargs.get("kv")
        self.calls.append((args[0].shape[1], kv))


def _tiny_model(seed: int = 0) -> flux2.Flux2Transformer:
    torch.manual_seed(seed)
    cfg = flux2.Flux2Config(hidden=256, heads=2, depth_double=2, depth_single=2, context_dim=64)
    return flux2.Flux2Transformer(cfg).eval().requires_grad_(False)


def test_references_leave_the_sequence_after_step_zero() -> None:
    """Step 0 sends target + references; every later step the target alone; the cache holds a key and a value row per
    reference token, batch image and block: estimates.kv_cache_bytes, counted on the real cache."""
    model = _tiny_model()
    spy = _Spy(model)
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(2, 128, 3, 4, generator=g)
    ctx = torch.randn(2, 16, 64, generator=g)
    refs = pack_references([torch.randn(1, 128, 2, 3, generator=g), torch.randn(1, 128, 3, 3, generator=g)])
    sample(model, lat, ctx, sigmas(3, 12), references=refs, kv_cache=True)
    n_target, n_ref = 12, 6 + 9
    assert [n for n, _ in spy.calls] == [n_target + n_ref, n_target, n_target]
    kv = spy.calls[0][1]
    assert kv is not None and kv.filled and all(c[1] is kv for c in spy.calls)
    assert len(kv.double) == 2 and len(kv.single) == 2
    assert all(k.shape == (2, n_ref, 2, 128) for k, _ in kv.double + kv.single)
    assert kv.nbytes == estimates.kv_cache_bytes(2, n_ref, 256, 4, 4)
    # with cfg (cond and uncond in one batch) the cache holds both halves
    spy.calls.clear()
    cached = sample(model, lat, ctx, sigmas(3, 12), negative=ctx.flip(0), guidance=3.0, references=refs,
                    kv_cache=True)
    assert [n for n, _ in spy.calls] == [n_target + n_ref, n_target, n_target]
    assert spy.calls[0][1].nbytes == estimates.kv_cache_bytes(4, n_ref, 256, 4, 4)
    # the cache is another sampling than references re-sent at t every step; without references it is the plain one
    plain = sample(model, lat, ctx, sigmas(3, 12), negative=ctx.flip(0), guidance=3.0, references=refs)
    assert rel_l2(cached, plain) > 1e-4  # equal would be ~1e-7 in fp32
    assert torch.equal(sample(model, lat, ctx, sigmas(3, 12), kv_cache=True), sample(model, lat, ctx, sigmas(3, 12)))


@torch.no_grad()
def test_cached_keys_are_pre_rope(refs, models, monkeypatch) -> None:
    """Our cache holds the references' keys before RoPE (as ComfyUI's); rotated with the references' positions they
    are diffusers' post-RoPE cache, block for block (both with ComfyUI's unmasked step 0)."""
    monkeypatch.setattr(tf2, "_flux2_kv_causal_attention", comfy_attention)
    ref_model = refs["transformer"]
    for blk in ref_model.transformer_blocks:
        blk.attn.set_processor(tf2.Flux2KVAttnProcessor())
    for blk in ref_model.single_transformer_blocks:
        blk.attn.set_processor(tf2.Flux2KVParallelSelfAttnProcessor())
    ours = models.transformer  # the same weights, loaded from the BFL file
    g = torch.Generator().manual_seed(4)
    n_txt, (h, w) = 8, (2, 3)
    x = torch.randn(1, h * w, 128, generator=g)
    ref = torch.randn(1, 4, 128, generator=g)
    ctx = torch.randn(1, n_txt, 192, generator=g)
    ref_ids = flux2.image_ids(2, 2, 10)
    ids = torch.cat([flux2.text_ids(n_txt), flux2.image_ids(h, w), ref_ids])
    rope = flux2.rope_table(ours.cfg, ids)
    kv = flux2.RefKV()
    sig = torch.tensor([0.7])
    mine = ours(torch.cat([x, ref], 1), ctx, sig, rope, h * w, kv)
    theirs, cache = ref_model(hidden_states=torch.cat([ref, x], 1), encoder_hidden_states=ctx, timestep=sig,
                              img_ids=torch.cat([ref_ids, flux2.image_ids(h, w)])[None],
                              txt_ids=flux2.text_ids(n_txt)[None], guidance=None, return_dict=False,
                              kv_cache_mode="extract", num_ref_tokens=4)
    assert rel_l2(mine, theirs) < 1e-6  # step 0
    # the one difference: diffusers' own step 0 lets the references attend only to themselves
    monkeypatch.setattr(tf2, "_flux2_kv_causal_attention", _diffusers_kv_attention)
    masked, masked_cache = ref_model(hidden_states=torch.cat([ref, x], 1), encoder_hidden_states=ctx, timestep=sig,
                                     img_ids=torch.cat([ref_ids, flux2.image_ids(h, w)])[None],
                                     txt_ids=flux2.text_ids(n_txt)[None], guidance=None, return_dict=False,
                                     kv_cache_mode="extract", num_ref_tokens=4)
    monkeypatch.setattr(tf2, "_flux2_kv_causal_attention", comfy_attention)
    assert rel_l2(mine, masked) > 1e-4  # measured 1.8e-4 (ours against diffusers unmasked: 9e-8)
    assert rel_l2(masked_cache.get_single(0).get()[0], cache.get_single(0).get()[0]) > 1e-3
    ref_rope = rope[n_txt + h * w:]
    for i, (k, v) in enumerate(kv.double):
        dk, dv = cache.get_double(i).get()
        assert rel_l2(k, dk) > 1e-2  # not the rotated keys ...
        assert rel_l2(flux2.apply_rope(k, ref_rope), dk) < 1e-4 and rel_l2(v, dv) < 1e-4  # ... their source
    for i, (k, v) in enumerate(kv.single):
        dk, dv = cache.get_single(i).get()
        assert rel_l2(flux2.apply_rope(k, ref_rope), dk) < 1e-4 and rel_l2(v, dv) < 1e-4
    # a cached step, from each side's own cache
    sig = torch.tensor([0.4])
    mine = ours(x, ctx, sig, rope, h * w, kv)
    theirs = ref_model(hidden_states=x, encoder_hidden_states=ctx, timestep=sig, img_ids=flux2.image_ids(h, w)[None],
                       txt_ids=flux2.text_ids(n_txt)[None], guidance=None, return_dict=False, kv_cache=cache,
                       kv_cache_mode="cached")[0]
    assert rel_l2(mine, theirs) < 1e-6
    with pytest.raises(ValueError, match="target tokens only"):
        ours(torch.cat([x, ref], 1), ctx, sig, rope, h * w, kv)


def test_sampler_estimate() -> None:
    """klein-9B, 1024² target, two 1024² references, cfg 1: the first step runs over every token and ends holding the
    cache (2 GiB per reference at 9B: 2 x 32 blocks x 4096 tokens x 4096 x 2 bytes); later steps run without the
    references (a smaller activation) beside the cache; the planner gets the larger, the first."""
    cfg = flux2.KLEIN_9B
    model = ModelInfo("transformer:9b-kv:bf16", "transformer", "transformer", 0, cfg)
    kv_model = ModelInfo("transformer:9b-kv:bf16", "transformer", "transformer", 0, cfg, kv_cache=True)
    latent = LatentInfo(1, 64, 64)
    pos = CondInfo(1, 512, ((64, 64), (64, 64)))
    blocks = cfg.depth_double + cfg.depth_single
    cache = estimates.kv_cache_bytes(1, 8192, cfg.hidden, blocks, 2)
    assert cache == 4 * 2**30
    first, later = estimates.kv_sampling_bytes(1, 4096 + 512 + 8192, 8192, cfg.hidden, blocks, 2)
    plain_first = estimates.sampling_bytes(1, 4096 + 512 + 8192, cfg.hidden, 2)
    plain_later = estimates.sampling_bytes(1, 4096 + 512, cfg.hidden, 2)
    assert first == plain_first + cache
    assert later - cache < plain_first and later == pytest.approx(plain_later + cache + 2 * 8192 * 4096 * 2)
    plain, kv = estimates.sampling(model, latent, pos, 1, 4), estimates.sampling(kv_model, latent, pos, 1, 4)
    preview = 2 * 64 * 64 * 128 * 4
    assert kv.activation == int(np.ceil((first + preview) * estimates.MARGIN))
    assert kv.activation - plain.activation == pytest.approx(cache * estimates.MARGIN, abs=2)
    assert kv.seconds < plain.seconds  # steps 1..3 without the 8192 reference tokens
    # without references the patch changes nothing
    bare = CondInfo(1, 512)
    assert estimates.sampling(kv_model, latent, bare, 1, 4) == estimates.sampling(model, latent, bare, 1, 4)


def test_flux_kv_cache_node() -> None:
    """The core node: MODEL in, the same model (same key, same weights) marked for the cache out."""
    from vramgraph.nodes import ENGINE_NODES
    from vramgraph.nodes.values import ModelHandle

    node = ENGINE_NODES["FluxKVCache"]
    assert node.INPUT_TYPES()["required"]["model"][0] == "MODEL" and node.RETURN_TYPES == ("MODEL",)
    info = ModelInfo("transformer:x:bf16", "transformer", "transformer", 10, flux2.KLEIN_9B)
    (out,) = node.vg_estimate(None, info).outputs
    assert out.key == info.key and out.kv_cache and not info.kv_cache and out.nbytes == info.nbytes
    (handle,) = node().execute(ModelHandle(info))
    assert handle.key == info.key and handle.info.kv_cache
