"""ComfyUI v0.29.0's declarations for the core node types our engine runs: combo lists, categories, display names
and tooltips, as ComfyUI's /object_info answers them (nodes.py, comfy_extras/, comfy/samplers.py at the commit
"ComfyUI v0.29.0"; tests/data/comfyui-0.29-object_info.json is the snapshot the tests compare against).

A combo lists every value ComfyUI lists, so a workflow made in ComfyUI opens unchanged here and the reverse; a
listed value we do not run is refused at validation by `refusal`, naming the input, the value and what we run.
"""

from __future__ import annotations

# comfy/samplers.py SAMPLER_NAMES (KSAMPLER_NAMES + ddim, uni_pc, uni_pc_bh2), in ComfyUI's order
COMFY_SAMPLERS = (
    "euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "exp_heun_2_x0",
    "exp_heun_2_x0_sde", "dpm_2", "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral",
    "dpmpp_2s_ancestral_cfg_pp", "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp", "dpmpp_2m_sde",
    "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm",
    "ipndm", "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp", "res_multistep_ancestral",
    "res_multistep_ancestral_cfg_pp", "gradient_estimation", "gradient_estimation_cfg_pp", "er_sde", "seeds_2",
    "seeds_3", "sa_solver", "sa_solver_pece", "ddim", "uni_pc", "uni_pc_bh2")
# nodes.py CLIPLoader's `type`
CLIP_TYPES = (
    "stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos", "lumina2", "wan",
    "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image", "flux2", "ovis", "longcat_image",
    "cogvideox", "lens", "pixeldit", "ideogram4", "boogu", "krea2", "joyimage", "mage")
RUN_CLIP_TYPES = ("flux2",)
# VAELoader lists it always (a VAE that leaves pixels as they are); we run the FLUX.2 VAE from a file only
PIXEL_SPACE = "pixel_space"

# ComfyUI's NODE_DISPLAY_NAME_MAPPINGS and v3 display_name for our core types (a type without one shows its name)
DISPLAY_NAMES: dict[str, str] = {
    "UNETLoader": "Load Diffusion Model", "CLIPLoader": "Load CLIP", "VAELoader": "Load VAE",
    "CLIPTextEncode": "CLIP Text Encode (Prompt)", "ConditioningZeroOut": "Conditioning Zero Out",
    "ReferenceLatent": "Set Reference Latent", "CFGGuider": "CFG Guider",
    "EmptyFlux2LatentImage": "Empty Flux 2 Latent", "VAEDecode": "VAE Decode", "VAEEncode": "VAE Encode",
    "LoadImage": "Load Image",
    "ImageScaleToTotalPixels": "Scale Image to Total Pixels", "GetImageSize": "Get Image Size",
    "PrimitiveInt": "Int", "PrimitiveFloat": "Float", "PrimitiveBoolean": "Boolean", "PrimitiveString": "Text",
    "PrimitiveStringMultiline": "Text (Multiline)", "FluxKVCache": "Flux KV Cache", "SaveImage": "Save Image",
    "PreviewImage": "Preview Image", "LoraLoader": "Load LoRA (Model and CLIP)", "LoraLoaderModelOnly": "Load LoRA",
    "KSampler": "KSampler",
    # ComfyUI-GGUF's (its classes' TITLE)
    "UnetLoaderGGUF": "Unet Loader (GGUF)", "UnetLoaderGGUFAdvanced": "Unet Loader (GGUF/Advanced)",
    "CLIPLoaderGGUF": "CLIPLoader (GGUF)"}

KSAMPLER_TIPS: dict[str, str] = {
    "model": "The model used for denoising the input latent.",
    "seed": "The random seed used for creating the noise.",
    "steps": "The number of steps used in the denoising process.",
    "cfg": "The Classifier-Free Guidance scale balances creativity and adherence to the prompt. Higher values result "
           "in images more closely matching the prompt however too high values will negatively impact quality.",
    "sampler_name": "The algorithm used when sampling, this can affect the quality, speed, and style of the generated "
                    "output.",
    "scheduler": "The scheduler controls how noise is gradually removed to form the image.",
    "positive": "The conditioning describing the attributes you want to include in the image.",
    "negative": "The conditioning describing the attributes you want to exclude from the image.",
    "latent_image": "The latent image to denoise.",
    "denoise": "The amount of denoising applied, lower values will maintain the structure of the initial image "
               "allowing for image to image sampling."}
LORA_TIPS: dict[str, str] = {
    "model": "The diffusion model the LoRA will be applied to.",
    "clip": "The CLIP model the LoRA will be applied to.",
    "lora_name": "The name of the LoRA.",
    "strength_model": "How strongly to modify the diffusion model. This value can be negative.",
    "strength_clip": "How strongly to modify the CLIP model. This value can be negative."}
SAVE_PREFIX_TIP = ("The prefix for the file to save. This may include formatting information such as "
                   "%date:yyyy-MM-dd% or %Empty Latent Image.width% to include values from nodes.")


def tip(opts: dict, text: str | None) -> dict:
    """A widget's options with ComfyUI's tooltip added (none when ComfyUI declares none)."""
    return {**opts, "tooltip": text} if text else opts


def refusal(input_name: str, value: str, runs: tuple[str, ...] | list[str], why: str) -> str | None:
    """None when `value` is one we run; else the message that refuses it: the input, the value, why, what we run.

    >>> refusal("type", "flux2", ("flux2",), "x") is None
    True
    >>> refusal("type", "sd3", ("flux2",), "vramgraph runs FLUX.2 [klein]'s Qwen3 text encoder")
    "type 'sd3' is not run by vramgraph (vramgraph runs FLUX.2 [klein]'s Qwen3 text encoder); set type to flux2"
    """
    if value in runs:
        return None
    choose = f"set {input_name} to {runs[0]}" if len(runs) == 1 else f"choose one of {', '.join(runs)}"
    return f"{input_name} '{value}' is not run by vramgraph ({why}); {choose}"
