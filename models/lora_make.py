"""Random LoRA/LoHa/LoKr files in the key styles trainers write, for the tests and the GPU comparison with ComfyUI
(bench/peer_compare.sh): real safetensors files whose layers are those of a FLUX.2 [klein] transformer or its Qwen3
text encoder at any size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import flux2_config, qwen3_config

TRANSFORMER_STYLES = ("bfl", "diffusers", "kohya", "lycoris", "onetrainer", "diffsynth", "linear1_qkv")
TEXT_ENCODER_STYLES = ("comfy_te", "comfy_te_bare", "kohya_te")


def transformer_modules(cfg: flux2_config.Flux2Config, style: str) -> list[tuple[str, int, int]]:
    """(module name, out, in) of every linear layer of the transformer in a trainer's key style."""
    out = []
    for p, shape in flux2_config.parameter_shapes(cfg).items():
        if len(shape) != 2:
            continue
        m = p.removesuffix(".weight")
        if style == "bfl":
            out.append((f"diffusion_model.{m}", *shape))
        elif style == "kohya":
            out.append((f"lora_unet_{m.replace('.', '_')}", *shape))
        elif style == "linear1_qkv":
            if p.endswith("linear1.weight"):
                out.append((f"diffusion_model.{m}_qkv", 3 * cfg.hidden, shape[1]))
        else:
            src = flux2_config._diffusers_source(p)
            for k in src.keys:
                d = k.removesuffix(".weight")
                name = {"diffusers": f"transformer.{d}", "lycoris": f"lycoris_{d.replace('.', '_')}",
                        "onetrainer": f"lora_transformer_{d.replace('.', '_')}", "diffsynth": d}[style]
                out.append((name, shape[0] // len(src.keys), shape[1]))
    return out


def text_encoder_modules(cfg: qwen3_config.Qwen3Config, style: str) -> list[tuple[str, int, int]]:
    shapes = qwen3_config.parameter_shapes(cfg)
    out = []
    for p, shape in shapes.items():
        if len(shape) != 2 or p.startswith("embed"):
            continue
        m = p.removesuffix(".weight")
        name = {"comfy_te": f"text_encoders.qwen3_4b.transformer.model.{m}",
                "comfy_te_bare": f"text_encoders.transformer.model.{m}", "kohya_te": f"lora_te_{m.replace('.', '_')}"}
        out.append((name[style], *shape))
    return out


def _factor(n: int) -> tuple[int, int]:
    """n = a * b with a as close to sqrt(n) as divides it (LyCORIS' factorization, roughly)."""
    a = int(n ** 0.5)
    while n % a:
        a -= 1
    return a, n // a


def adapter_tensors(name: str, out: int, inp: int, kind: str, rank: int, g: Any, *, alpha: float | None,
                    peft: bool, dora: bool, scale: float) -> dict:
    """Random tensors of one adapter (fp32): up/B nonzero, so every adapter changes its layer."""
    import torch

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    t: dict[str, torch.Tensor] = {}
    if kind == "lora":
        up, down = ("lora_B.weight", "lora_A.weight") if peft else ("lora_up.weight", "lora_down.weight")
        t[f"{name}.{up}"], t[f"{name}.{down}"] = r(out, rank), r(rank, inp)
    elif kind == "loha":
        for w in ("w1", "w2"):
            t[f"{name}.hada_{w}_a"], t[f"{name}.hada_{w}_b"] = r(out, rank), r(rank, inp)
    elif kind == "lokr":
        (o1, o2), (i1, i2) = _factor(out), _factor(inp)
        t[f"{name}.lokr_w1"] = r(o1, i1)
        t[f"{name}.lokr_w2_a"], t[f"{name}.lokr_w2_b"] = r(o2, min(rank, o2, i2)), r(min(rank, o2, i2), i2)
    else:
        raise ValueError(f"unknown adapter {kind!r}")
    if alpha is not None:
        t[f"{name}.alpha"] = torch.tensor(float(alpha))
    if dora:
        t[f"{name}.dora_scale"] = 1 + 0.1 * torch.randn(1, inp, generator=g)
    return t


def write_lora(path: str | Path, modules: list[tuple[str, int, int]], *, kind: str = "lora", rank: int = 4,
               alpha: float | None = None, dtype: str = "bfloat16", seed: int = 0, peft: bool | None = None,
               dora: bool = False, scale: float = 0.05) -> Path:
    """Write a random adapter for each (module, out, in) to a safetensors file in `dtype`; returns the path."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, out, inp in modules:
        use_peft = peft if peft is not None else name.startswith(("transformer.", "diffusion_model.", "text_encoders."))
        sd.update(adapter_tensors(name, out, inp, kind, rank, g, alpha=alpha, peft=use_peft, dora=dora, scale=scale))
    dt = getattr(torch, dtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: (v if k.endswith(".alpha") else v.to(dt)).contiguous() for k, v in sd.items()}, str(path))
    return path
