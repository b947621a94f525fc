"""Which model a workflow is for, when it is not one vramgraph runs (FLUX.2 [klein] 4B/9B).

ComfyUI ships hundreds of templates for other models (FLUX.3 klein, Stable Diffusion, Z-Image, Wan, LTX, cloud
API nodes, ...). Such a workflow would otherwise fail validation on its first node type we lack, with ComfyUI's
"The custom node may not be installed", which sends the user looking for a custom node that does not exist.
`unsupported_model` finds the evidence of the model instead, strongest first:

1. model file headers, when a named file is present in the models folders (the tensor names say SDXL, SD3,
   FLUX.1, Wan, ...; a FLUX.2 or Qwen3 file is ours, whatever its name);
2. ComfyUI's API nodes, which send the work to a cloud service (Kling, Gemini, OpenAI, ...); a graph that only
   generates text (TextGenerate, no sampler) is a language model's;
3. a text-encoder loader's `type` (CLIPLoader type "flux3", "lumina2", "wan", ...; ours is "flux2");
4. node types that exist only for one model family (Flux3LayoutPrompt, WanImageToVideo, LTXVConditioning, ...);
5. model file names, for files that are absent (the names ComfyUI's templates use: "z_image_turbo_bf16",
   "sd_xl_base_1.0", "wan2.2_t2v_..."), and last the kind of model a node type needs (an upscale model, ...).
The family named is the most precise one the evidence gives: a loader's file name refines a node's or a
loader type's family ("Wan" -> "Wan 2.2", "FLUX.3" -> "FLUX.3 klein"). A file name is never the evidence for a
file that is present: its header decides.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...nodes.files import MODEL_EXTENSIONS, safe_name
from ...nodes.types import is_mapping

OURS = "FLUX.2 [klein] 4B/9B"
FLUX3_KLEIN = "FLUX.3 klein"
# ComfyUI's model folder names (and their legacy aliases) where a loader's file may be
MODEL_DIRS = ("diffusion_models", "unet", "checkpoints", "text_encoders", "clip", "vae", "loras", "controlnet",
              "upscale_models", "clip_vision", "model_patches", "latent_upscale_models", "audio_encoders",
              "style_models", "background_removal", "frame_interpolation", "diffusers")


@dataclass(frozen=True)
class Finding:
    family: str  # "Z-Image", "FLUX.3 klein", "the Kling API", ...
    node: str  # the node id that shows it
    class_type: str
    evidence: str  # what in that node shows it

    @property
    def message(self) -> str:
        text = f"this workflow uses {self.family}, which vramgraph does not run"
        return text + (f": {FLUX3_KLEIN} is not supported" if self.family == FLUX3_KLEIN else "")

    @property
    def details(self) -> str:
        return (f"node {self.node} ({self.class_type}) {self.evidence}; vramgraph runs {OURS} (ComfyUI's "
                "image_flux2_klein_* templates and the VG nodes); open this workflow in ComfyUI instead")


# ------------------------------------------------------------------------------------------------ headers

def _has(keys: frozenset[str], *parts: str) -> bool:
    return all(any(p in k for k in keys) for p in parts)


HEADER_FAMILIES: tuple[tuple[str, Any], ...] = (  # (family, test over the tensor names); None: ours
    (None, lambda k: _has(k, "double_stream_modulation_img") or _has(k, "single_stream_modulation")),  # FLUX.2
    (None, lambda k: _has(k, "layers.0.self_attn.q_norm", "embed_tokens")),  # Qwen3 text encoder
    (None, lambda k: _has(k, "decoder.up_blocks", "bn.running_mean") or _has(k, "decoder.up.0", "bn.running_mean")),
    ("Stable Diffusion 3", lambda k: _has(k, "joint_blocks.0.")),
    ("Stable Diffusion XL", lambda k: _has(k, "input_blocks.0.0.", "label_emb") or _has(k, "conditioner.embedders.1")),
    ("Stable Diffusion 1.x/2.x", lambda k: _has(k, "input_blocks.0.0.") or _has(k, "cond_stage_model.")),
    ("HunyuanVideo", lambda k: _has(k, "double_blocks.0.", "txt_in.individual_token_refiner")),
    ("Chroma", lambda k: _has(k, "double_blocks.0.", "distilled_guidance_layer")),
    ("FLUX.1", lambda k: _has(k, "double_blocks.0.img_attn", "single_blocks.0.linear1")),
    ("HiDream", lambda k: _has(k, "double_stream_blocks.0.")),
    ("Wan", lambda k: _has(k, "blocks.0.cross_attn.", "patch_embedding")),
    ("Z-Image / Lumina 2", lambda k: _has(k, "cap_embedder", "noise_refiner")),
    ("Qwen-Image", lambda k: _has(k, "transformer_blocks.0.img_mod", "txt_norm")),
    ("LTX-Video", lambda k: _has(k, "adaln_single", "transformer_blocks.0.attn1")),
    ("a T5 text encoder (FLUX.1, SD3, ...)", lambda k: _has(k, "encoder.block.0.layer.0.SelfAttention")),
    ("a CLIP text encoder (Stable Diffusion, FLUX.1, ...)", lambda k: _has(k, "text_model.encoder.layers.0.")),
)


def header_family(path: Path) -> tuple[bool, str | None]:
    """(recognised, family) of a safetensors file from its tensor names: (True, None) for our models."""
    from ...models.headers import read_header

    try:
        infos, _meta = read_header(path)
    except Exception:  # not a safetensors file we can read: the header says nothing
        return False, None
    keys = frozenset(infos)
    for family, test in HEADER_FAMILIES:
        if test(keys):
            return True, family
    return False, None


# ------------------------------------------------------------------------------------------------ node types

API_SERVICES: tuple[tuple[str, str], ...] = (  # ComfyUI's API nodes (comfy_api_nodes): type-name prefix -> service
    (r"^Flux(2|3|3Max|Pro|Kontext(Pro|Max)|Erase|VTO|Video)\w*Node$", "the Black Forest Labs API (FLUX Pro/Max)"),
    (r"^Bria", "the BRIA API"), (r"^ByteDance", "the ByteDance API (Seedream, Seedance)"),
    (r"^Claude", "the Anthropic Claude API"), (r"^ElevenLabs", "the ElevenLabs API"),
    (r"^FishAudio", "the Fish Audio API"), (r"^Gemini", "the Google Gemini API (Nano Banana, Veo)"),
    (r"^Veo", "the Google Veo API"), (r"^Grok", "the xAI Grok API"), (r"^HappyHorse", "the HappyHorse API"),
    (r"^HeyGen", "the HeyGen API"), (r"^Higgsfield", "the Higgsfield API"), (r"^HitPaw", "the HitPaw API"),
    (r"^Hunyuan\w*Api$", "the Tencent Hunyuan API"), (r"^Tencent\w*Node$", "the Tencent Hunyuan 3D API"),
    (r"^Ideogram(?!4Scheduler)", "the Ideogram API"),
    (r"^Kling", "the Kling API"), (r"^Krea\d*\w*Node$", "the Krea API"), (r"^LtxApi", "the LTX API"),
    (r"^Luma", "the Luma API"), (r"^Magnific", "the Magnific API"), (r"^Meshy", "the Meshy API"),
    (r"^MetaMuse", "the Meta Muse API"), (r"^Minimax", "the MiniMax Hailuo API"), (r"^Mirelo", "the Mirelo API"),
    (r"^OpenAI", "the OpenAI API (GPT Image, ChatGPT)"), (r"^OpenRouter", "the OpenRouter API"),
    (r"^Pixverse", "the PixVerse API"), (r"^Pruna", "the Pruna API"), (r"^Quiver", "the Quiver API"),
    (r"^Recraft", "the Recraft API"), (r"^Rodin3D", "the Rodin 3D API"), (r"^Runway", "the Runway API"),
    (r"^Sonilo", "the Sonilo API"), (r"^Sync(LipSync|TalkingImage)", "the Sync API"), (r"^Topaz", "the Topaz API"),
    (r"^Tripo(?!Splat)", "the Tripo API"), (r"^Veed", "the VEED API"), (r"^Vidu", "the Vidu API"),
    (r"^Wan\w*Api$", "the Alibaba Wan API"), (r"^Qwen\w*Api$", "the Alibaba Qwen API"),
    (r"^Wavespeed", "the WaveSpeed API"), (r"^BeebleSwitchX", "the Beeble SwitchX API"),
    (r"^ClarityCrystal", "the Clarity Crystal API"), (r"^Stability", "the Stability AI API"),
    (r"^Moonvalley", "the Moonvalley API"), (r"^Pika", "the Pika API"),
)
NODE_FAMILIES: tuple[tuple[str, str], ...] = (  # node types of one local model family
    (r"^Flux3", "FLUX.3"), (r"^(Wan|WanAnimate|WanDancer|WanSCAIL)", "Wan"), (r"^SCAIL", "SCAIL-2 (Wan)"),
    (r"^LTX(V|AV)|^TextGenerateLTX", "LTX-Video"), (r"Hunyuan3D", "Hunyuan3D"),
    (r"HunyuanVideo|HunyuanLatentVideo", "HunyuanVideo"), (r"AceStep", "ACE-Step"), (r"^MiniMaxH3", "MiniMax H3"),
    (r"^MiniMaxMusic3|MiniMaxMusic3", "MiniMax Music 3"), (r"^Kandinsky5", "Kandinsky 5"),
    (r"QwenImage", "Qwen-Image"), (r"HiDream", "HiDream"), (r"Trellis", "TRELLIS.2"),
    (r"SeedVR2", "SeedVR2"), (r"SDPose", "SDPose"), (r"SAM3DBody", "SAM 3D Body"), (r"^VOID", "VOID"),
    (r"SAM3", "SAM 3"),
    (r"^(DA3|LoadDA3)", "Depth Anything 3"), (r"^SVD_img2vid", "Stable Video Diffusion"),
    (r"StableCascade", "Stable Cascade"), (r"ChromaRadiance", "Chroma Radiance"), (r"^YuE2", "YuE2"),
    (r"MOSSImage", "MOSS-Image"), (r"Boogu", "Boogu"), (r"Fibo2", "Fibo 2.0"), (r"JoyImage", "JoyAI Image"),
    (r"MageFlow", "Mage-Flow"), (r"MingImage", "Ming Image"), (r"Pixal3D", "Pixal3D"), (r"TripoSplat", "TripoSplat"),
    (r"^Bernini", "Bernini-R"), (r"^PiD", "PiD"), (r"MarigoldV2", "Marigold v2"),
    (r"^Anima", "Anima"), (r"^Lotus", "Lotus (Stable Diffusion)"),
    (r"^ARVideo|^SamplerARVideo", "an autoregressive video model"), (r"^SheetSage", "SheetSage"), (r"MoGe", "MoGe"),
)
GENERIC_NODES: tuple[tuple[str, str], ...] = (  # node types of a kind of model, when nothing names the model
    (r"^TextGenerate$", "a language model for text generation (TextGenerate)"),
    (r"^(LoadBackgroundRemovalModel|RemoveBackground)$", "a background removal model"),
    (r"^(UpscaleModelLoader|ImageUpscaleWithModel)$", "an upscale model"),
    (r"^(FrameInterpolationModelLoader|FrameInterpolate)$", "a frame interpolation model"),
    (r"^(OpticalFlowLoader)$", "an optical flow model"),
    (r"^(Load3D|Preview3D|SaveGLB|VoxelToMesh)", "a 3D model pipeline"),
    (r"^(LoadAudio|SaveAudio|VAEDecodeAudio|AudioEncoderLoader)", "an audio model"),
    (r"^(LoadVideo|SaveVideo|CreateVideo|SaveWEBM)$", "a video model"),
)

CLIP_TYPES = {  # ComfyUI's CLIPLoader / DualCLIPLoader types; "flux2" is ours ("stable_diffusion", the loader's
    # default, is what many other models' workflows leave it at, so it says nothing)
    "stable_cascade": "Stable Cascade", "sd3": "Stable Diffusion 3",
    "sdxl": "Stable Diffusion XL", "stable_audio": "Stable Audio", "mochi": "Mochi", "ltxv": "LTX-Video",
    "pixart": "PixArt", "cosmos": "Cosmos", "lumina2": "Z-Image / Lumina 2", "wan": "Wan", "hidream": "HiDream",
    "chroma": "Chroma", "ace": "ACE-Step", "omnigen2": "OmniGen2", "qwen_image": "Qwen-Image",
    "hunyuan_image": "HunyuanImage", "hunyuan_video": "HunyuanVideo", "hunyuan_video_15": "HunyuanVideo 1.5",
    "ovis": "Ovis-Image", "kandinsky5": "Kandinsky 5", "kandinsky5_image": "Kandinsky 5", "flux": "FLUX.1",
    "flux3": "FLUX.3", "newbie": "NewBie", "longcat_image": "LongCat-Image",
}

# types only ComfyUI's DualCLIPLoader has (two encoders: CLIP-L + T5 for FLUX.1, CLIP-L + G for SDXL, ...); in the
# one-encoder CLIPLoader they are just values not in its list
DUAL_ONLY = frozenset({"flux", "sdxl", "hunyuan_video", "hunyuan_video_15", "kandinsky5", "kandinsky5_image", "newbie"})

NAME_FAMILIES: tuple[tuple[str, str | None], ...] = (  # lower-case file name patterns, most specific first
    (r"flux-2-klein|flux2[-_]klein|^qwen_3_[48]b|^flux2-vae|^full_encoder_small_decoder", None),  # ours
    (r"flux[-_.]?3.*klein", FLUX3_KLEIN), (r"flux[-_.]?3", "FLUX.3"),
    (r"flux[-_.]?2[-_]dev|mistral_3_small_flux2|flux_?2[-_]turbo", "FLUX.2 [dev]"),
    (r"^pid_", "PiD"), (r"chroma", "Chroma"),
    (r"flux[-_.]?1|flux[-_](dev|schnell|kontext)|^ae\.safetensors$|^t5xxl|^clip_l\.", "FLUX.1"),
    (r"z[-_]?image", "Z-Image"),
    (r"qwen[-_]?image[-_]?edit|qwen[-_]edit", "Qwen-Image-Edit"), (r"qwen[-_]?image[-_]?layered", "Qwen-Image-Layered"),
    (r"qwen[-_]?image[-_]?2\.1", "Qwen-Image 2.1"), (r"qwen[-_]?image|qwen[-_]360", "Qwen-Image"),
    (r"wan[-_]?animate", "Wan Animate"), (r"scail", "SCAIL-2 (Wan 2.1)"), (r"infinitetalk", "Wan 2.1 InfiniteTalk"),
    (r"humo", "HuMo (Wan)"), (r"chrono[-_]?edit", "ChronoEdit (Wan 2.1)"), (r"bernini", "Bernini-R (Wan 2.2)"),
    (r"causal[-_]forcing", "Causal Forcing (Wan 2.1)"), (r"wan[-_.]?2\.?2|wan22", "Wan 2.2"),
    (r"wan[-_.]?2[-_.]?1|wan21|wan_alpha", "Wan 2.1"), (r"wan|umt5", "Wan"),
    (r"ltx[-_.]?2\.?5", "LTX-2.5"), (r"ltx[-_.]?2\.?3", "LTX-2.3"), (r"ltx[-_.]?2", "LTX-2"), (r"ltx", "LTX-Video"),
    (r"hunyuan[-_]?3d", "Hunyuan3D"), (r"capybara", "Capybara"), (r"hunyuan[-_]?video|hunyuanvideo", "HunyuanVideo"),
    (r"hidream", "HiDream"), (r"sd3", "Stable Diffusion 3.5"), (r"sd_xl|sdxl|clip_vision_g", "Stable Diffusion XL"),
    (r"svd", "Stable Video Diffusion"), (r"lotus", "Lotus (Stable Diffusion 1.5)"),
    (r"v1-5|sd15|sd[-_]1\.5|vae-ft-mse", "Stable Diffusion 1.5"),
    (r"stable[-_]?audio", "Stable Audio"), (r"ace[-_]?step|acestep|ace_1\.5|ace15", "ACE-Step"), (r"yue2", "YuE2"),
    (r"minimax[-_]?music", "MiniMax Music 3"), (r"minimax[-_]?h3|fasth3", "MiniMax H3"),
    (r"kandinsky", "Kandinsky 5"), (r"omnigen", "OmniGen2"), (r"netayume|lumina", "NetaYume Lumina"),
    (r"newbie", "NewBie"), (r"ovis", "Ovis-Image"), (r"pixeldit", "PixelDiT"), (r"longcat", "LongCat-Image"),
    (r"joyai|joyimage", "JoyAI Image Edit"), (r"firered", "FireRed Image Edit"), (r"ernie", "ERNIE-Image"),
    (r"fibo", "Fibo 2.0"), (r"ideogram", "Ideogram 4"), (r"krea2", "Krea 2"), (r"^lens", "Lens"),
    (r"mage_flow", "Mage-Flow"), (r"marigold", "Marigold v2"), (r"ming_image", "Ming Image"),
    (r"moss_image", "MOSS-Image"), (r"anima", "Anima"), (r"boogu", "Boogu"), (r"pixal3d", "Pixal3D"),
    (r"triposplat", "TripoSplat"), (r"trellis", "TRELLIS.2"), (r"sam_3d_body", "SAM 3D Body"), (r"moge", "MoGe"),
    (r"sam3", "SAM 3"), (r"sdpose", "SDPose"), (r"seedvr2", "SeedVR2"), (r"depth_anything", "Depth Anything 3"),
    (r"birefnet", "BiRefNet"), (r"film_net|rife", "FILM / RIFE frame interpolation"),
    (r"esrgan|ultrasharp", "Real-ESRGAN"), (r"void_pass", "VOID"), (r"cogvideo", "CogVideoX"),
    (r"gemma[-_]?4", "Gemma 4"), (r"qwen3\.5", "Qwen3.5"), (r"qwen3vl", "Qwen3-VL"), (r"cosmos", "Cosmos"),
)

SAMPLERS = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced")
LANGUAGE_MODEL_NODES = ("TextGenerate",)
LOADER_ORDER = ("UNETLoader", "CheckpointLoaderSimple", "ImageOnlyCheckpointLoader", "CheckpointLoader")


def _match(table: tuple[tuple[str, Any], ...], text: str) -> tuple[bool, Any]:
    for pattern, family in table:
        if re.search(pattern, text):
            return True, family
    return False, None


def _strings(node: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(input name or "widget", value) of every literal string of a node, its raw widget values included."""
    inputs = node.get("inputs") if is_mapping(node.get("inputs")) else {}
    out = [(str(k), v) for k, v in inputs.items() if isinstance(v, str)]
    meta = node.get("_meta") if is_mapping(node.get("_meta")) else {}
    raw = meta.get("widgets_values")
    values = raw.values() if is_mapping(raw) else raw if isinstance(raw, list) else ()
    return out + [("widget", v) for v in values if isinstance(v, str)]


def _model_file(folders: Any, name: str) -> Path | None:
    for root in getattr(folders, "models", ()) or ():
        for sub in MODEL_DIRS if safe_name(name) else ():
            p = Path(root) / sub / name
            if p.is_file():
                return p
    return None


def _named(found: Finding, by_name: list[Finding], nodes: Mapping[str, type]) -> Finding:
    """A node type or a loader's type shows the family ("Wan", "LTX-Video"); the file the workflow's model loader
    names may name the model more precisely ("Wan 2.2", "FLUX.3 klein", or a model built on that family): that
    name is reported, with both pieces of evidence."""
    def main(f: Finding) -> bool:
        return f.class_type in LOADER_ORDER

    def same(f: Finding) -> bool:
        return _same_family(f.family, found.family)

    tests = (lambda f: main(f) and same(f), main, same, lambda f: f.class_type not in nodes and "Load" in f.class_type)
    for test in tests:  # a model loader's file of that family first, then any model loader's, then other loaders
        for named in by_name:
            if test(named):
                if named.family == found.family:
                    return found
                return Finding(named.family, found.node, found.class_type, f"{found.evidence}, and node "
                               f"{named.node} ({named.class_type}) {named.evidence}")
    return found


def _same_family(named: str, shown: str) -> bool:
    head = shown.lower().split()[0]
    if not any(c.isdigit() for c in head):
        head = re.match(r"[a-z]*", head).group(0)
    return bool(head) and named.lower().startswith(head)


def _by_type(items: list[tuple[str, Mapping]], table: tuple[tuple[str, str], ...], nodes: Mapping[str, type],
             what: str) -> Finding | None:
    unknown = [(node_id, node["class_type"]) for node_id, node in items if node["class_type"] not in nodes]
    for pattern, family in table:  # the table's order is the evidence's priority; known types once, not per pattern
        for node_id, cls in unknown:
            if re.search(pattern, cls):
                return Finding(family, node_id, cls, what.format(family=family))
    return None


def unsupported_model(prompt: Mapping[str, Any], nodes: Mapping[str, type], folders: Any = None) -> Finding | None:
    """The evidence that `prompt` is for a model vramgraph does not run (strongest first), or None."""
    items = [(str(i), n) for i, n in prompt.items() if is_mapping(n) and isinstance(n.get("class_type"), str)]
    rank = {c: i for i, c in enumerate(LOADER_ORDER)}
    order = sorted(items, key=lambda x: (rank.get(x[1]["class_type"], len(rank)), x[0]))
    by_name: list[Finding] = []
    for node_id, node in order:  # 1. headers of present files (and the names of absent ones, kept for 5.)
        cls = node["class_type"]
        for _key, value in _strings(node):
            if not value.lower().endswith(MODEL_EXTENSIONS):
                continue
            path = _model_file(folders, value) if folders is not None else None
            if path is not None:
                known, family = header_family(path)
                if known and family is not None:
                    return Finding(family, node_id, cls, f"loads {value}, whose tensors are {family}'s")
                continue
            hit, family = _match(NAME_FAMILIES, Path(value).name.lower())
            if hit and family is not None:
                by_name.append(Finding(family, node_id, cls, f"loads {value} (a {family} file by its name; the "
                                                            "file is not in the models folders)"))
    found = _by_type(items, API_SERVICES, nodes, "is a ComfyUI API node: it sends the work to {family}'s cloud "
                                                 "service")
    if found is not None:  # 2. API nodes
        return _named(found, by_name, nodes)
    samplers = [n for n, node in items if "Sampler" in node["class_type"] or node["class_type"] in SAMPLERS]
    llm = next(((n, node) for n, node in items if node["class_type"] in LANGUAGE_MODEL_NODES), None)
    if llm is not None and not samplers:  # a language model's workflow: its text encoder file is the model
        files = [v for _n, node in order if "CLIPLoader" in node["class_type"] for _k, v in _strings(node)
                 if v.lower().endswith(MODEL_EXTENSIONS)]
        what = f"{files[0]} as a language model" if files else "a language model"
        return Finding(what, llm[0], llm[1]["class_type"], "generates text with a language model and nothing samples "
                                                           "an image")
    for node_id, node in items:  # 3. a text-encoder loader's type
        cls = node["class_type"]
        if "CLIPLoader" in cls:
            for key, value in _strings(node):
                single = cls == "CLIPLoader" and value in DUAL_ONLY
                if value in CLIP_TYPES and key in ("type", "widget") and not single:
                    return _named(Finding(CLIP_TYPES[value], node_id, cls,
                                          f"loads a text encoder of type '{value}'"), by_name, nodes)
    found = _by_type(items, NODE_FAMILIES, nodes, "is a node for {family}")  # 4. node types of one family
    if found is not None:
        return _named(found, by_name, nodes)
    if by_name:  # 5. names of absent files
        return by_name[0]
    return _by_type(items, GENERIC_NODES, nodes, "is a node for {family}")


__all__ = ["FLUX3_KLEIN", "Finding", "header_family", "unsupported_model"]
