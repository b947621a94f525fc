"""ComfyUI's core node types for FLUX.2 [klein], run by our engine on our models.

Same class names, input names, order, defaults and ranges as ComfyUI, so an unchanged ComfyUI
workflow (API or UI format) validates and runs here. These are registered only in our engine, never
inside ComfyUI (where ComfyUI's own classes are the real ones). Each class has `vg_estimate`: its
outputs and cost ahead of time, from input infos.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import estimates
from .catalog import header_refusal
from .context import Context
from .declared import (
    CLIP_TYPES,
    COMFY_SAMPLERS,
    KSAMPLER_TIPS,
    PIXEL_SPACE,
    RUN_CLIP_TYPES,
    refusal,
    tip,
)
from .files import Files, file_list, fingerprint
from .types import (
    BOOLEAN,
    CLIP,
    CONDITIONING,
    FLOAT,
    GUIDER,
    IMAGE,
    INT,
    LATENT,
    MASK,
    MODEL,
    NOISE,
    SAMPLER,
    SIGMAS,
    STRING,
    VAE,
    CondInfo,
    Cost,
    GuiderInfo,
    ImageInfo,
    LatentInfo,
    ModelInfo,
    NoiseInfo,
    SigmasInfo,
)
from .values import Guider, ModelHandle, Noise, Sampler, cond_parts, conditioning, with_reference

if TYPE_CHECKING:
    import torch

MAX_RESOLUTION = 16384
SEED_MAX = 0xFFFF_FFFF_FFFF_FFFF
TEXT_TOKENS = 512
# ComfyUI's samplers and schedulers that we run (models/samplers.py, models/schedules.py), in ComfyUI's order; the
# sampler combos list all of ComfyUI's (declared.COMFY_SAMPLERS) and refuse the others at validation.
SAMPLERS = ["euler", "euler_ancestral", "heun", "dpmpp_sde", "dpmpp_2m", "dpmpp_2m_sde", "lcm"]
SCHEDULERS = ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal", "linear_quadratic",
              "kl_optimal"]
WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]  # UNETLoader's, as ComfyUI lists them
CLIP_DEVICES = ["default", "cpu"]
UPSCALE_METHODS = ["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]
HIDDEN = {"vg": "VG_CONTEXT"}


def file_changed(folders: Files, folder: str, name: str) -> str:
    """ComfyUI's IS_CHANGED value of a node that reads the file `name` in `folder`: its `fingerprint`. An unreadable
    file gets a value of its own (the node then fails when it runs, so nothing is cached for it)."""
    try:
        return fingerprint(folders.resolve(folder, name))
    except OSError as e:
        return f"unreadable: {e}"


def file_check(folders: Files | None, folder: str, name: str) -> bool | str:
    """A loader's VALIDATE_INPUTS answer for its file input: True, or why the file cannot load, from its header alone
    (a quantisation vramgraph does not run: the file, the layer and the format; nodes/catalog.py `header_refusal`).
    Inside ComfyUI, which skips its own list check for an input that VALIDATE_INPUTS names, and without folders, the
    name is checked against the folder's list here. An empty name (the input is linked, not a literal) passes."""
    if not name:
        return True
    if (folders is None or folders.inside_comfyui) and name not in file_list(folders, folder):
        return f"'{name}' is not in {folder}; choose one of the files listed there"
    return header_refusal(folders, folder, name) or True


def _size(**kw: Any) -> tuple[str, dict]:
    return (INT, {"default": 1024, "min": 16, "max": MAX_RESOLUTION, "step": 16, **kw})


class UNETLoader:
    CATEGORY = "model/loaders"
    RETURN_TYPES = (MODEL,)
    FUNCTION = "load_unet"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"unet_name": (file_list(folders, "diffusion_models"),),
                             "weight_dtype": (WEIGHT_DTYPES, {"advanced": True})}, "hidden": HIDDEN}

    @classmethod
    def VALIDATE_INPUTS(cls, unet_name: str = "", weight_dtype: str = "default", folders: Any = None
                        ) -> bool | dict[str, str]:
        try:
            unet_weight_dtype(weight_dtype)
        except ValueError as e:
            return {"weight_dtype": str(e)}
        found = file_check(folders, "diffusion_models", unet_name)
        return True if found is True else {"unet_name": found}

    @classmethod
    def vg_estimate(cls, env: Any, unet_name: str, weight_dtype: str = "default") -> Cost:
        dtype = unet_weight_dtype(weight_dtype)
        return Cost((env.model_info("transformer", unet_name, dtype),))

    @classmethod
    def IS_CHANGED(cls, unet_name: str, folders: Any = None, **_: Any) -> str:
        return file_changed(folders, "diffusion_models", unet_name)

    def load_unet(self, unet_name: str, weight_dtype: str = "default", *, vg: Context) -> tuple:
        return (ModelHandle(vg.model_info("transformer", unet_name, unet_weight_dtype(weight_dtype))),)


def unet_weight_dtype(weight_dtype: str) -> str:
    """The catalogue dtype for UNETLoader's `weight_dtype` (the one place a cast on load plugs in).

    "default" loads the weights as the file stores them. ComfyUI's fp8 choices cast a bf16 file to fp8 while
    loading; we do not run that cast yet, so they are refused before anything runs (UNETLoader.VALIDATE_INPUTS
    and the estimate both ask here). To support a cast, return the catalogue dtype for it here and make
    `ModelCatalog.model_info(kind, name, dtype)` honour that dtype (it ignores it today)."""
    if weight_dtype == "default":
        return "default"
    if weight_dtype in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype '{weight_dtype}': casting the transformer's weights to fp8 while loading "
                         "is not supported; set weight_dtype to 'default' (the weights as the file stores them)")
    raise ValueError(f"weight_dtype '{weight_dtype}' is not one of {', '.join(WEIGHT_DTYPES)}")


class FluxKVCache:
    """ComfyUI's FluxKVCache (for klein-9B-kv): the same model, patched so that a sampler with reference latents
    modulates the references at t=0, caches their keys and values on the first step and samples every later step on
    the target tokens alone (models.flux2.RefKV). Without references it changes nothing."""

    CATEGORY = "experimental"
    EXPERIMENTAL = True
    RETURN_TYPES = (MODEL,)
    OUTPUT_TOOLTIPS = ("The patched model with KV Cache enabled.",)
    FUNCTION = "execute"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"model": (MODEL, {"tooltip": "The model to use KV Cache on."})}}

    @classmethod
    def vg_estimate(cls, env: Any, model: ModelInfo) -> Cost:
        return Cost((dataclasses.replace(model, kv_cache=True),))

    def execute(self, model: ModelHandle) -> tuple:
        return (dataclasses.replace(model, info=dataclasses.replace(model.info, kv_cache=True)),)


class CLIPLoader:
    CATEGORY = "model/loaders"
    RETURN_TYPES = (CLIP,)
    FUNCTION = "load_clip"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"clip_name": (file_list(folders, "text_encoders"),), "type": (list(CLIP_TYPES),)},
                "optional": {"device": (CLIP_DEVICES, {"advanced": True})}, "hidden": HIDDEN}

    @classmethod
    def VALIDATE_INPUTS(cls, clip_name: str = "", type: str = "flux2", folders: Any = None
                        ) -> bool | dict[str, str]:
        return clip_check(folders, clip_name, type)

    @classmethod
    def vg_estimate(cls, env: Any, clip_name: str, type: str = "flux2", device: str = "default") -> Cost:
        return Cost((clip_placed(env.model_info("text_encoder", clip_name), device),))

    @classmethod
    def IS_CHANGED(cls, clip_name: str, folders: Any = None, **_: Any) -> str:
        return file_changed(folders, "text_encoders", clip_name)

    def load_clip(self, clip_name: str, type: str = "flux2", device: str = "default", *, vg: Context) -> tuple:
        info = vg.model_info("text_encoder", clip_name)
        return (ModelHandle(clip_placed(info, device), vg.tokenizer_for(info)),)


def clip_check(folders: Any, clip_name: str, type: str) -> bool | dict[str, str]:
    """CLIPLoader's (and CLIPLoaderGGUF's) VALIDATE_INPUTS: ComfyUI's every `type` is listed, only flux2 runs."""
    refused = refusal("type", type, RUN_CLIP_TYPES, "it runs FLUX.2 [klein]'s Qwen3 text encoder only")
    if refused:
        return {"type": refused}
    found = file_check(folders, "text_encoders", clip_name)
    return True if found is True else {"clip_name": found}


def clip_placed(info: ModelInfo, device: str) -> ModelInfo:
    """The text encoder's info with CLIPLoader's `device`: "cpu" keeps it off the GPU (its encodes run on the
    CPU and plan no GPU memory for it, as ComfyUI's load_device=cpu); "default" lets the planner place it."""
    if device not in CLIP_DEVICES:
        raise ValueError(f"device '{device}' is not one of {', '.join(CLIP_DEVICES)}")
    return replace(info, placement="cpu") if device == "cpu" else info


class VAELoader:
    CATEGORY = "model/loaders"
    RETURN_TYPES = (VAE,)
    FUNCTION = "load_vae"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"vae_name": ([*file_list(folders, "vae"), PIXEL_SPACE],)}, "hidden": HIDDEN}

    @classmethod
    def VALIDATE_INPUTS(cls, vae_name: str = "", folders: Any = None) -> bool | str:
        if vae_name == PIXEL_SPACE:
            return (f"'{PIXEL_SPACE}' (ComfyUI's VAE for pixel-space models) is not run by vramgraph: FLUX.2 [klein] "
                    "needs its VAE; choose a VAE file from the vae folder")
        return file_check(folders, "vae", vae_name)

    @classmethod
    def vg_estimate(cls, env: Any, vae_name: str) -> Cost:
        return Cost((env.model_info("vae", vae_name),))

    @classmethod
    def IS_CHANGED(cls, vae_name: str, folders: Any = None, **_: Any) -> str:
        return file_changed(folders, "vae", vae_name)

    def load_vae(self, vae_name: str, *, vg: Context) -> tuple:
        return (ModelHandle(vg.model_info("vae", vae_name)),)


class CLIPTextEncode:
    CATEGORY = "model/conditioning"
    RETURN_TYPES = (CONDITIONING,)
    OUTPUT_TOOLTIPS = ("A conditioning containing the embedded text used to guide the diffusion model.",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"text": (STRING, {"multiline": True, "dynamicPrompts": True,
                                               "tooltip": "The text to be encoded."}),
                             "clip": (CLIP, {"tooltip": "The CLIP model used for encoding the text."})},
                "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, text: Any, clip: ModelInfo) -> Cost:
        from .lora import with_lora_costs

        variants = estimates.text_encode(clip, 1, TEXT_TOKENS)
        if clip.placement == "cpu":
            variants = (estimates.text_encode_cpu(clip, 1),)
        variants = with_lora_costs(clip, variants, TEXT_TOKENS, 1)
        return Cost((CondInfo(1, TEXT_TOKENS),), variants, host_bytes=TEXT_TOKENS * _context_dim(clip) * 4)

    def encode(self, text: str, clip: ModelHandle, *, vg: Context) -> tuple:
        from . import ops
        from .lora import applied

        if vg.variant == "stream":
            with applied(vg, clip, vg.host_module(clip)) as m:
                emb = ops.encode_text_streamed(m, vg.tokenizer(clip), [text], vg.device, vg.check_interrupted,
                                               resident=vg.resident_blocks(clip), kept=_kept(vg, clip))
        else:
            with applied(vg, clip, vg.module(clip)) as m:
                emb = ops.encode_text(m, vg.tokenizer(clip), [text], vg.check_interrupted)
        return (conditioning(emb),)


def _kept(vg: Context, handle: ModelHandle) -> Any:
    """Where the engine keeps a streamed model's resident part between nodes (None in a context without one)."""
    return vg.kept_blocks(handle)


def _context_dim(clip: ModelInfo) -> int:
    cfg = clip.config
    return cfg.out_dim if cfg is not None else 7680


class ConditioningZeroOut:
    CATEGORY = "model/conditioning/transform"
    RETURN_TYPES = (CONDITIONING,)
    FUNCTION = "zero_out"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"conditioning": (CONDITIONING,)}}

    @classmethod
    def vg_estimate(cls, env: Any, conditioning: CondInfo) -> Cost:
        return Cost((conditioning,))

    def zero_out(self, conditioning: list) -> tuple:
        import torch

        return ([[torch.zeros_like(emb), dict(extra)] for emb, extra in conditioning],)


class ReferenceLatent:
    CATEGORY = "model/conditioning"
    RETURN_TYPES = (CONDITIONING,)
    FUNCTION = "append"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"conditioning": (CONDITIONING,)}, "optional": {"latent": (LATENT,)}}

    @classmethod
    def vg_estimate(cls, env: Any, conditioning: CondInfo, latent: LatentInfo | None = None) -> Cost:
        if latent is None:
            return Cost((conditioning,))
        refs = conditioning.refs + ((latent.height, latent.width),) * latent.batch
        return Cost((CondInfo(conditioning.batch, conditioning.tokens, refs),))

    def append(self, conditioning: list, latent: dict | None = None) -> tuple:
        if latent is None:
            return (conditioning,)
        for i in range(latent["samples"].shape[0]):
            conditioning = with_reference(conditioning, latent["samples"][i:i + 1])
        return (conditioning,)


class CFGGuider:
    CATEGORY = "model/sampling/guiders"
    RETURN_TYPES = (GUIDER,)
    FUNCTION = "get_guider"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"model": (MODEL,), "positive": (CONDITIONING,), "negative": (CONDITIONING,),
                             "cfg": (FLOAT, {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1,
                                             "round": 0.01})}}

    @classmethod
    def vg_estimate(cls, env: Any, model: ModelInfo, positive: CondInfo, negative: CondInfo, cfg: float) -> Cost:
        return Cost((GuiderInfo(model, positive, negative, cfg),))

    def get_guider(self, model: ModelHandle, positive: list, negative: list, cfg: float) -> tuple:
        return (Guider(model, positive, negative, cfg),)


class KSamplerSelect:
    CATEGORY = "model/sampling/samplers"
    RETURN_TYPES = (SAMPLER,)
    FUNCTION = "get_sampler"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"sampler_name": (list(COMFY_SAMPLERS),)}}

    @classmethod
    def VALIDATE_INPUTS(cls, sampler_name: str = "euler") -> bool | dict[str, str]:
        refused = sampler_refusal(sampler_name)
        return {"sampler_name": refused} if refused else True

    @classmethod
    def vg_estimate(cls, env: Any, sampler_name: str) -> Cost:
        if sampler_refusal(sampler_name):
            raise ValueError(sampler_refusal(sampler_name))
        return Cost((sampler_name,))

    def get_sampler(self, sampler_name: str) -> tuple:
        return (Sampler(sampler_name),)


class Flux2Scheduler:
    CATEGORY = "model/sampling/schedulers"
    RETURN_TYPES = (SIGMAS,)
    FUNCTION = "get_sigmas"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"steps": (INT, {"default": 20, "min": 1, "max": 4096}),
                             "width": (INT, {"default": 1024, "min": 16, "max": MAX_RESOLUTION, "step": 1}),
                             "height": (INT, {"default": 1024, "min": 16, "max": MAX_RESOLUTION, "step": 1})}}

    @classmethod
    def vg_estimate(cls, env: Any, steps: int, width: int, height: int) -> Cost:
        return Cost((SigmasInfo(steps),))

    def get_sigmas(self, steps: int, width: int, height: int) -> tuple:
        import torch

        from ..models.sampling import sigmas as flux2_sigmas

        seq_len = round(width * height / (16 * 16))
        return (torch.tensor(flux2_sigmas(steps, seq_len), dtype=torch.float32),)


def sampler_refusal(sampler_name: str) -> str | None:
    """Why a sampler ComfyUI lists is refused here (None: we run it)."""
    return refusal("sampler_name", sampler_name, SAMPLERS, "its samplers are models/samplers.py's")


def scheduled_sigmas(scheduler: str, steps: int, denoise: float) -> torch.Tensor:
    """ComfyUI's sigmas of `scheduler` for a FLUX.2 model (shift 2.02), as its KSampler and BasicScheduler cut
    them for `denoise` < 1: the last steps + 1 of the schedule for int(steps / denoise) steps."""
    import torch

    from ..models.schedules import schedule

    if denoise is None or denoise > 0.9999:
        return schedule(scheduler, steps)
    if denoise <= 0.0:
        return torch.zeros(0, dtype=torch.float32)
    return schedule(scheduler, int(steps / denoise))[-(steps + 1):]


class BasicScheduler:
    """ComfyUI's BasicScheduler: the model's sigma schedule (every FLUX.2 model: shift 2.02, models/schedules.py)."""

    CATEGORY = "model/sampling/schedulers"
    RETURN_TYPES = (SIGMAS,)
    FUNCTION = "get_sigmas"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"model": (MODEL,), "scheduler": (SCHEDULERS,),
                             "steps": (INT, {"default": 20, "min": 1, "max": 10000}),
                             "denoise": (FLOAT, {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01})}}

    @classmethod
    def vg_estimate(cls, env: Any, model: ModelInfo, scheduler: str, steps: int, denoise: float = 1.0) -> Cost:
        _check_schedule(scheduler, steps, denoise)
        return Cost((SigmasInfo(steps if denoise > 0 else 0),))

    def get_sigmas(self, model: ModelHandle, scheduler: str, steps: int, denoise: float = 1.0) -> tuple:
        return (scheduled_sigmas(scheduler, steps, denoise),)


def _check_schedule(scheduler: str, steps: int, denoise: float) -> None:
    """What the schedulers cannot do, said before anything runs."""
    total = steps if denoise > 0.9999 else int(steps / denoise) if denoise > 0 else 0
    if scheduler == "kl_optimal" and 0 < total < 2:
        raise ValueError("scheduler 'kl_optimal' needs at least 2 steps (it divides by steps - 1); "
                         "raise steps or choose another scheduler")


class RandomNoise:
    CATEGORY = "model/sampling/noise"
    RETURN_TYPES = (NOISE,)
    FUNCTION = "get_noise"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"noise_seed": (INT, {"default": 0, "min": 0, "max": SEED_MAX,
                                                  "control_after_generate": True})}}

    @classmethod
    def vg_estimate(cls, env: Any, noise_seed: int) -> Cost:
        return Cost((NoiseInfo(noise_seed),))

    def get_noise(self, noise_seed: int) -> tuple:
        return (Noise(noise_seed),)


class EmptyFlux2LatentImage:
    CATEGORY = "model/latent/flux"
    RETURN_TYPES = (LATENT,)
    FUNCTION = "generate"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"width": _size(), "height": _size(),
                             "batch_size": (INT, {"default": 1, "min": 1, "max": 4096})}}

    @classmethod
    def vg_estimate(cls, env: Any, width: int, height: int, batch_size: int = 1) -> Cost:
        return Cost((LatentInfo(batch_size, height // 16, width // 16),))

    def generate(self, width: int, height: int, batch_size: int = 1) -> tuple:
        import torch

        return ({"samples": torch.zeros(batch_size, 128, height // 16, width // 16)},)


def model_calls(sampler: Any, steps: int) -> int:
    """Transformer evaluations of `sampler` over `steps` steps: heun and dpmpp_sde evaluate twice a step (but
    once on the step to sigma 0), the others once (the time estimate counts these; the peak is one call's)."""
    two = sampler in ("heun", "dpmpp_sde")
    return 2 * steps - 1 if two and steps > 0 else steps


def _sampling_cost(model: ModelInfo, positive: CondInfo, negative: CondInfo | None, cfg: float,
                   latent: LatentInfo, steps: int, outputs: tuple) -> Cost:
    from .lora import with_lora_costs

    cfg_batch = 2 if negative is not None and cfg != 1.0 else 1
    options = estimates.sampling_variants(model, latent, positive, cfg_batch, steps)
    tokens = estimates.sampler_tokens(latent, positive) * latent.batch * cfg_batch
    options = with_lora_costs(model, options, tokens, steps)
    nbytes = latent.batch * latent.channels * latent.height * latent.width * 4
    return Cost(outputs, options, host_bytes=nbytes * len(outputs))


def _sample(vg: Context, model: ModelHandle, noise: Noise, latent: dict, positive: list, negative: list | None,
            cfg: float, sigmas: list[float], sampler: str = "euler") -> tuple[dict, dict]:
    """(output, denoised output): the sampled latent and the last step's denoised estimate (ComfyUI's x0)."""
    import torch

    from . import ops
    from .lora import applied

    pos, refs = cond_parts(positive, "positive")
    neg = None
    if negative is not None and cfg != 1.0:
        neg, neg_refs = cond_parts(negative, "negative")
        if len(neg_refs) != len(refs) or any(a.shape != b.shape or not torch.equal(a, b)
                                             for a, b in zip(neg_refs, refs, strict=False)):
            raise ValueError("the negative conditioning must carry the same reference latents as the positive "
                             "(apply the same ReferenceLatent nodes to both) when cfg != 1")
    sigmas = torch.tensor(sigmas, dtype=torch.float32).tolist()  # float32 as ComfyUI's SIGMAS, whichever node made them
    shown = vg.preview
    last: list = []

    def preview(x0: torch.Tensor, step: int, steps: int) -> None:
        last[:] = [x0]
        if shown is not None:
            shown(x0, step, steps)

    args = (noise.generate_noise(latent), latent["samples"], pos, neg, cfg, sigmas, refs)
    kw = {"progress": vg.progress, "preview": preview, "sampler": sampler, "seed": noise.seed,
          "kv_cache": model.info.kv_cache}
    if vg.variant in ("stream", "stream-cfg"):  # the plan keeps some blocks on the GPU, streams the others
        from ..models.streaming import stream_blocks

        kw["sequential_cfg"] = vg.variant == "stream-cfg"
        with applied(vg, model, vg.host_module(model)) as host, \
                stream_blocks(host, vg.device, vg.resident_blocks(model), _kept(vg, model)) as m:
            out = ops.run_sampler(m, *args, **kw)
    else:  # resident: the step's levers (models/step.py), set by VRAMGRAPH_ATTENTION and VRAMGRAPH_COMPILE
        from ..models.step import StepOptions

        with applied(vg, model, vg.module(model)) as m:
            out = ops.run_sampler(m, *args, **kw, step=StepOptions.from_env())
    return {"samples": out}, ({"samples": last[0].float().cpu()} if last else {"samples": out})


class SamplerCustomAdvanced:
    CATEGORY = "model/sampling/custom"
    RETURN_TYPES = (LATENT, LATENT)
    RETURN_NAMES = ("output", "denoised_output")
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"noise": (NOISE,), "guider": (GUIDER,), "sampler": (SAMPLER,), "sigmas": (SIGMAS,),
                             "latent_image": (LATENT,)}, "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, noise: NoiseInfo, guider: GuiderInfo, sampler: str, sigmas: SigmasInfo,
                    latent_image: LatentInfo) -> Cost:
        return _sampling_cost(guider.model, guider.positive, guider.negative, guider.cfg, latent_image,
                              model_calls(sampler, sigmas.steps), (latent_image, latent_image))

    def sample(self, noise: Noise, guider: Guider, sampler: Sampler, sigmas: torch.Tensor, latent_image: dict,
               *, vg: Context) -> tuple:
        return _sample(vg, guider.model, noise, latent_image, guider.positive, guider.negative, guider.cfg,
                       sigmas.tolist(), sampler.name)


class KSampler:
    """ComfyUI's KSampler: its scheduler's sigmas for a FLUX.2 model (shift 2.02, not Flux2Scheduler's
    resolution-dependent schedule), its sampler, the seed's noise."""

    CATEGORY = "model/sampling"
    RETURN_TYPES = (LATENT,)
    OUTPUT_TOOLTIPS = ("The denoised latent.",)
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        types = {
            "model": (MODEL, {}),
            "seed": (INT, {"default": 0, "min": 0, "max": SEED_MAX, "control_after_generate": True}),
            "steps": (INT, {"default": 20, "min": 1, "max": 10000}),
            "cfg": (FLOAT, {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}),
            "sampler_name": (list(COMFY_SAMPLERS), {}), "scheduler": (SCHEDULERS, {}),
            "positive": (CONDITIONING, {}), "negative": (CONDITIONING, {}), "latent_image": (LATENT, {}),
            "denoise": (FLOAT, {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01})}
        return {"required": {k: (t, tip(o, KSAMPLER_TIPS[k])) for k, (t, o) in types.items()}, "hidden": HIDDEN}

    @classmethod
    def VALIDATE_INPUTS(cls, sampler_name: str = "euler") -> bool | dict[str, str]:
        return KSamplerSelect.VALIDATE_INPUTS(sampler_name)

    @classmethod
    def vg_estimate(cls, env: Any, model: ModelInfo, seed: int, steps: int, cfg: float, sampler_name: str,
                    scheduler: str, positive: CondInfo, negative: CondInfo, latent_image: LatentInfo,
                    denoise: float = 1.0) -> Cost:
        if sampler_refusal(sampler_name):
            raise ValueError(sampler_refusal(sampler_name))
        _check_schedule(scheduler, steps, denoise)
        return _sampling_cost(model, positive, negative, cfg, latent_image, model_calls(sampler_name, steps),
                              (latent_image,))

    def sample(self, model: ModelHandle, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str,
               positive: list, negative: list, latent_image: dict, denoise: float = 1.0, *, vg: Context) -> tuple:
        sig = scheduled_sigmas(scheduler, steps, denoise)
        if len(sig) == 0:
            return (latent_image,)
        return (_sample(vg, model, Noise(seed), latent_image, positive, negative, cfg, sig.tolist(), sampler_name)[0],)


class VAEDecode:
    CATEGORY = "model/latent"
    RETURN_TYPES = (IMAGE,)
    OUTPUT_TOOLTIPS = ("The decoded image.",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"samples": (LATENT, {"tooltip": "The latent to be decoded."}),
                             "vae": (VAE, {"tooltip": "The VAE model used for decoding the latent."})},
                "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, samples: LatentInfo, vae: ModelInfo) -> Cost:
        image = ImageInfo(samples.batch, samples.height * 16, samples.width * 16)
        return Cost((image,), estimates.vae_decode(vae, samples), host_bytes=image_bytes(image))

    def decode(self, samples: dict, vae: ModelHandle, *, vg: Context) -> tuple:
        from . import ops

        return (ops.vae_decode(vg.module(vae), samples["samples"], vg.variant, vg.check_interrupted),)


def image_bytes(image: ImageInfo) -> int:
    return image.batch * image.height * image.width * 3 * 4


class VAEEncode:
    CATEGORY = "model/latent"
    RETURN_TYPES = (LATENT,)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"pixels": (IMAGE,), "vae": (VAE,)}, "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, pixels: ImageInfo, vae: ModelInfo) -> Cost:
        h, w = pixels.height // 16, pixels.width // 16
        return Cost((LatentInfo(pixels.batch, h, w),), (estimates.vae_encode(vae, pixels.batch, h * 16, w * 16),))

    def encode(self, pixels: torch.Tensor, vae: ModelHandle, *, vg: Context) -> tuple:
        from . import ops

        return ({"samples": ops.vae_encode(vg.module(vae), pixels, vg.check_interrupted)},)


class LoadImage:
    CATEGORY = "image"
    RETURN_TYPES = (IMAGE, MASK)
    FUNCTION = "load_image"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"image": (file_list(folders, "input"), {"image_upload": True})}, "hidden": HIDDEN}

    @classmethod
    def vg_estimate(cls, env: Any, image: str) -> Cost:
        w, h = env.image_size(image)
        info = ImageInfo(1, h, w)
        return Cost((info, info), host_bytes=image_bytes(info))

    @classmethod
    def IS_CHANGED(cls, image: str, folders: Any = None, **_: Any) -> str:
        """ComfyUI's LoadImage.IS_CHANGED: the image file's content hash, so a new picture under the same name runs
        again (and everything after it)."""
        return file_changed(folders, "input", image)

    def load_image(self, image: str, *, vg: Context) -> tuple:
        from . import ops

        return ops.load_image(str(vg.resolve("input", image)), vg.max_image_pixels)


class ImageScaleToTotalPixels:
    CATEGORY = "image/upscaling"
    RETURN_TYPES = (IMAGE,)
    FUNCTION = "upscale"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"image": (IMAGE,), "upscale_method": (UPSCALE_METHODS,),
                             "megapixels": (FLOAT, {"default": 1.0, "min": 0.01, "max": 16.0, "step": 0.01}),
                             "resolution_steps": (INT, {"default": 1, "min": 1, "max": 256})}}

    @classmethod
    def vg_estimate(cls, env: Any, image: ImageInfo, upscale_method: str, megapixels: float,
                    resolution_steps: int = 1) -> Cost:
        w, h = estimates.scaled_size(image.width, image.height, megapixels, resolution_steps)
        info = ImageInfo(image.batch, h, w)
        return Cost((info,), host_bytes=image_bytes(info))

    def upscale(self, image: torch.Tensor, upscale_method: str, megapixels: float, resolution_steps: int = 1) -> tuple:
        from . import ops

        w, h = estimates.scaled_size(image.shape[2], image.shape[1], megapixels, resolution_steps)
        return (ops.resize(image, w, h, upscale_method),)


class GetImageSize:
    CATEGORY = "image"
    RETURN_TYPES = (INT, INT, INT)
    RETURN_NAMES = ("width", "height", "batch_size")
    FUNCTION = "get_size"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"image": (IMAGE,)}}

    @classmethod
    def vg_estimate(cls, env: Any, image: ImageInfo) -> Cost:
        return Cost((image.width, image.height, image.batch))

    def get_size(self, image: torch.Tensor) -> tuple:
        return (int(image.shape[2]), int(image.shape[1]), int(image.shape[0]))


def _primitive(name: str, io: str, options: dict) -> type:
    def run(self: Any, value: Any) -> tuple:
        return (value,)

    def inputs(cls: type, folders: Any = None) -> dict:
        return {"required": {"value": (io, dict(options))}}

    def estimate(cls: type, env: Any, value: Any) -> Cost:
        return Cost((value,))

    return type(name, (), {"CATEGORY": "utilities/primitive", "RETURN_TYPES": (io,), "FUNCTION": "run", "run": run,
                           "INPUT_TYPES": classmethod(inputs), "vg_estimate": classmethod(estimate),
                           "__doc__": f"ComfyUI's {name}: outputs its value."})


PrimitiveInt = _primitive("PrimitiveInt", INT, {"min": -sys.maxsize, "max": sys.maxsize,
                                                "control_after_generate": True})
PrimitiveFloat = _primitive("PrimitiveFloat", FLOAT, {"min": -sys.maxsize, "max": sys.maxsize})
PrimitiveBoolean = _primitive("PrimitiveBoolean", BOOLEAN, {})
PrimitiveString = _primitive("PrimitiveString", STRING, {})
PrimitiveStringMultiline = _primitive("PrimitiveStringMultiline", STRING, {"multiline": True})
