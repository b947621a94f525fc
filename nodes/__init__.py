"""Graph nodes (ComfyUI V1 conventions), each beside its VRAM estimate.

`ENGINE_NODES` is what our engine runs: ComfyUI's core node types for FLUX.2 [klein], ComfyUI-GGUF's loaders
(nodes/gguf.py) and our `VG` nodes. Inside ComfyUI only the `VG` nodes are registered (`VG_NODES`).
"""

from __future__ import annotations

from . import core, gguf, lora, output, vg

CORE_NODES: dict[str, type] = {
    name: getattr(core, name) for name in (
        "UNETLoader", "CLIPLoader", "VAELoader", "CLIPTextEncode", "ConditioningZeroOut", "CFGGuider",
        "KSamplerSelect", "Flux2Scheduler", "RandomNoise", "EmptyFlux2LatentImage", "SamplerCustomAdvanced",
        "VAEDecode", "VAEEncode", "ReferenceLatent", "LoadImage", "ImageScaleToTotalPixels", "GetImageSize",
        "PrimitiveInt", "PrimitiveFloat", "PrimitiveBoolean", "PrimitiveString", "PrimitiveStringMultiline",
        "KSampler", "FluxKVCache", "BasicScheduler")
} | {"SaveImage": output.SaveImage, "PreviewImage": output.PreviewImage,
     "LoraLoader": lora.LoraLoader, "LoraLoaderModelOnly": lora.LoraLoaderModelOnly} | gguf.NODES  # + ComfyUI-GGUF's
VG_NODES: dict[str, type] = dict(vg.NODES) | {"VGLoraLoader": lora.VGLoraLoader}
VG_DISPLAY_NAMES: dict[str, str] = dict(vg.DISPLAY_NAMES) | {"VGLoraLoader": "Load LoRA (vramgraph)"}
ENGINE_NODES: dict[str, type] = CORE_NODES | VG_NODES

__all__ = ["CORE_NODES", "ENGINE_NODES", "VG_DISPLAY_NAMES", "VG_NODES"]
