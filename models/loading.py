"""Finding, recognising and loading FLUX.2 [klein] checkpoints in the layouts users have.

- HF diffusers folder: model_index.json, transformer/ vae/ text_encoder/ (sharded safetensors with an
  index), tokenizer/.
- BFL single files: the transformer (keys with or without `model.diffusion_model.`) and the VAE.
- ComfyUI split files: models/diffusion_models/, models/text_encoders/, models/vae/.
- GGUF files (ComfyUI-GGUF's transformers, llama.cpp's Qwen3 text encoders) among them: models/gguf.py.

Every file is recognised from its safetensors header (which tensors it holds), never from its name.
`inspect()` reads headers only and returns a `ModelSpec`: per component its files, dtype,
hyperparameters and bytes per block, which is what the planner plans from. `load()` then builds one
component from its spec.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import flux2_config, qwen3_config, vae_config
from .dtypes import compute_name, itemsize, torch_dtype
from .gguf import tokenizer_note
from .headers import CheckpointError, TensorInfo, read_header, read_headers, strip_prefix
from .paths import walk_files
from .quant import check_weights, quant_layers, scale_sources, stored_nbytes

log = logging.getLogger(__name__)
COMPONENTS = ("transformer", "text_encoder", "vae")
CHECKPOINT_EXTENSIONS = (".safetensors", ".gguf")  # files looked at in a folder (recognised by their headers)
_PREFIXES = {
    "transformer": flux2_config.BFL_PREFIXES,
    "text_encoder": (),
    "vae": ("vae.", "first_stage_model."),
}


def _bare(keys: Iterable[str]) -> set[str]:
    out = set()
    for k in keys:
        for p in flux2_config.BFL_PREFIXES + _PREFIXES["vae"]:
            k = k.removeprefix(p)
        out.add(k)
    return out


def kind_of(keys: Iterable[str]) -> str | None:
    """Which of our components a tensor table is, from its key names; None if none of them.

    Strict enough to pick ours out of a full ComfyUI models/ folder: FLUX.1 transformers have no
    shared modulation, FLUX.2 [dev] has a guidance embedding, FLUX.1/SD VAEs have no BatchNorm
    statistics, Qwen2/2.5 have no q_norm.
    """
    k = _bare(keys)
    guided = "guidance_in.in_layer.weight" in k or "time_guidance_embed.guidance_embedder.linear_1.weight" in k
    if not guided and ({"img_in.weight", "double_stream_modulation_img.lin.weight"} <= k or
                       {"x_embedder.weight", "double_stream_modulation_img.linear.weight"} <= k):
        return "transformer"
    if "bn.running_mean" in k and ("decoder.conv_in.weight" in k or "encoder.conv_in.weight" in k):
        return "vae"
    if "layers.0.self_attn.q_norm.weight" in k or "model.layers.0.self_attn.q_norm.weight" in k:
        return "text_encoder"
    return None


def _not_ours(keys: Iterable[str]) -> str:
    """What a checkpoint that kind_of() refused looks like, for the error message."""
    k = _bare(keys)
    if "img_in.weight" in k or "x_embedder.weight" in k:
        return "FLUX.2 [dev] (it has a guidance embedding)" if "double_stream_modulation_img.lin.weight" in k or \
            "double_stream_modulation_img.linear.weight" in k else "a FLUX.1-style transformer"
    if "decoder.conv_in.weight" in k or "encoder.conv_in.weight" in k:
        return "a VAE without FLUX.2's latent statistics (FLUX.1 or SD)"
    if any(x.endswith("self_attn.q_proj.weight") for x in k):
        return "a language model without q_norm (not Qwen3)"
    return "none of them"


@dataclass(frozen=True)
class ComponentSpec:
    """One component as its checkpoint headers describe it: enough to plan, before loading a byte."""

    kind: str
    layout: str  # where it was found: "hf" (diffusers folder), "comfyui" (models/ folder), "files", "file"
    files: tuple[Path, ...]
    dtype: str  # storage dtype of most of its bytes: "bf16", "fp16", "fp32", "f8_e4m3"
    config: object  # flux2_config.Flux2Config | qwen3_config.Qwen3Config | vae_config.VAEConfig
    block_params: tuple[tuple[str, int], ...]  # (block name, parameter count) of what gets loaded
    file_bytes: int  # bytes of the tensors in the files (all of them, loaded or not)
    infos: Mapping[str, TensorInfo] = field(repr=False, compare=False, default_factory=dict)
    # (block name, parameters stored quantised, their bytes as loaded: 1 per fp8 element plus fp32 scales);
    # those keep their storage whatever the compute dtype, the others are cast to it
    quant_blocks: tuple[tuple[str, int, int], ...] = ()
    dtype_mix: tuple[tuple[str, int], ...] = ()  # (stored dtype, bytes) of the tensors that get loaded
    quant_layers: int = 0  # how many layers are quantised (fp8)
    quant_largest: int = 0  # elements of the largest quantised linear (dequantized just in time: a transient)

    @property
    def params(self) -> int:
        return sum(n for _, n in self.block_params)

    def nbytes(self, dtype: Any) -> int:
        """Bytes of the weights once loaded to compute in `dtype` (a name, "bf16", or a torch dtype): plain
        weights in `dtype`, fp8 layers as stored (1 byte per element plus their scales)."""
        return sum(self.block_bytes(dtype).values())

    def block_bytes(self, dtype: Any) -> dict[str, int]:
        quant = {name: (n, b) for name, n, b in self.quant_blocks}
        return {name: (n - quant.get(name, (0, 0))[0]) * itemsize(dtype) + quant.get(name, (0, 0))[1]
                for name, n in self.block_params}


@dataclass(frozen=True)
class ModelSpec:
    """A FLUX.2 [klein] model: its components, variant and whether it is step-distilled."""

    variant: str  # "klein-4b", "klein-9b" or "custom"
    distilled: bool
    distilled_from: str  # where that came from: "model_index.json", "metadata", "file name", "default"
    transformer: ComponentSpec | None
    text_encoder: ComponentSpec | None
    vae: ComponentSpec | None
    tokenizer: Path | None  # tokenizer.json found beside the model, else None (the bundled one is used)

    def component(self, kind: str) -> ComponentSpec:
        spec = getattr(self, kind)
        if spec is None:
            raise CheckpointError(f"no {kind.replace('_', ' ')} checkpoint was given or found")
        return spec


def _block_of(name: str) -> str:
    m = re.match(r"(double_blocks|single_blocks|layers)\.(\d+)\.", name)
    if m:
        return f"{m[1]}.{m[2]}"
    m = re.match(r"(encoder|decoder)\.", name)
    return m[1] if m else "shared"


def _quantizable(kind: str, cfg: Any) -> dict[str, str]:
    """Our parameters that may be stored quantised (models/fp8.py runs them), from shapes alone: every 2-d weight
    of the transformer and of the text encoder's layers is a bias-free Linear, the encoder's table an embedding;
    nothing in the VAE."""
    if kind == "vae":
        return {}
    family = flux2_config if kind == "transformer" else qwen3_config
    out = {n: "linear" for n, shape in family.parameter_shapes(cfg).items() if len(shape) == 2}
    if kind == "text_encoder":
        out["embed_tokens.weight"] = "embedding"
    return out


def _component(kind: str, layout: str, files: Sequence[Path]) -> ComponentSpec:
    infos = strip_prefix(read_headers(list(files)), _PREFIXES[kind])
    if kind == "transformer":
        cfg = flux2_config.config_from_checkpoint(infos)
        src = flux2_config.sources(cfg, infos.keys())
    elif kind == "text_encoder":
        cfg = qwen3_config.config_from_checkpoint(infos)
        src = qwen3_config.sources(cfg, infos.keys())
    else:
        cfg = vae_config.config_from_checkpoint(infos)
        src = vae_config.sources(cfg, infos.keys())
    how = _quantizable(kind, cfg)
    quantized = check_weights(src, infos, quant_layers(infos), how)
    blocks: dict[str, int] = {}
    quant: dict[str, tuple[int, int]] = {}
    for name, s in src.items():
        block = _block_of(name)
        n = sum(math.prod(infos[k].shape) for k in s.keys)
        blocks[block] = blocks.get(block, 0) + n
        if name in quantized:
            qn, qb = quant.get(block, (0, 0))
            quant[block] = (qn + n, qb + stored_nbytes(quantized[name], infos))
    mix: dict[str, int] = {}
    for s in [*src.values(), *scale_sources(quantized).values()]:
        for k in s.keys:
            stored = infos[k].dtype
            q = next((q for q in quantized.values() if q.weight == k), None)
            stored = q.storage if q is not None and q.storage else stored
            mix[stored] = mix.get(stored, 0) + (infos[k].nbytes if stored == infos[k].dtype else
                                                math.prod(infos[k].shape))
    by_dtype: dict[str, int] = {}
    for info in infos.values():
        by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + info.nbytes
    main = max(mix, key=mix.get) if mix else "BF16"
    return ComponentSpec(kind, layout, tuple(files), compute_name(main), cfg,
                         tuple(blocks.items()), sum(by_dtype.values()), infos,
                         tuple((b, n, nb) for b, (n, nb) in quant.items()),
                         tuple(sorted(mix.items(), key=lambda kv: -kv[1])), len(quantized),
                         # an embedding table dequantizes only the rows it looks up: the linears' largest counts
                         max((math.prod(infos[q.weight].shape) for n, q in quantized.items() if how[n] == "linear"),
                             default=0))


def _candidates(files: Iterable[Path]) -> list[tuple[str, list[Path]]]:
    """(component kind, files) for each checkpoint among `files`; the shards an index names are one."""
    files = sorted(set(files))
    groups: list[list[Path]] = []
    sharded: set[Path] = set()
    for index in sorted({f.parent for f in files}):
        for idx in sorted(index.glob("*.safetensors.index.json")):
            try:
                shards = sorted({index / n for n in json.loads(idx.read_text())["weight_map"].values()})
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{idx}: unreadable shard index ({e})") from e
            missing = [s for s in shards if not s.is_file()]
            if missing:
                raise CheckpointError(f"{idx} names shards that are missing: {', '.join(m.name for m in missing)}")
            groups.append(shards)
            sharded.update(shards)
    groups += [[f] for f in files if f not in sharded]
    out = []
    for g in groups:
        keys = [k for f in g for k in read_header(f)[0]]
        kind = kind_of(keys)
        if kind is not None:
            out.append((kind, g))
    return out


def _find_tokenizer(*folders: Path) -> Path | None:
    for d in folders:
        for cand in (d / "tokenizer.json", d / "tokenizer" / "tokenizer.json"):
            if cand.is_file():
                return cand
    return None


def _distilled(index: dict | None, metas: Iterable[dict[str, str]], names: Iterable[str]) -> tuple[bool, str]:
    if index is not None and "is_distilled" in index:
        return bool(index["is_distilled"]), "model_index.json"
    for meta in metas:
        if "is_distilled" in meta:
            return meta["is_distilled"].strip().lower() in ("1", "true", "yes"), "metadata"
        title = " ".join(v for k, v in meta.items() if k.startswith("modelspec.")).lower()
        if "klein" in title:
            return "base" not in title, "metadata"
    for n in names:
        if re.search(r"(^|[-_.])base([-_.]|$)", n.lower()):
            return False, "file name"
    return True, "default"


def inspect(paths: str | Path | Sequence[str | Path]) -> ModelSpec:
    """Recognise the components in the given files and folders by their headers, loading nothing.

    A path may be an HF diffusers folder (with model_index.json), a ComfyUI `models/` folder (with
    diffusion_models/, text_encoders/, vae/), a folder of single files, or single files. Each
    component must be found exactly once; several candidates for one component is an error that
    names them (pass the file you mean instead of the folder).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    found: dict[str, list[tuple[str, list[Path]]]] = {k: [] for k in COMPONENTS}
    index: dict | None = None
    tokenizer: Path | None = None
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise CheckpointError(f"{p}: no such file or folder")
        if p.is_file():
            cands = _candidates([p])
            if not cands:
                raise CheckpointError(f"{p}: not a FLUX.2 [klein] transformer, Qwen3 text encoder or FLUX.2 VAE; "
                                      f"its tensors look like {_not_ours(read_header(p)[0])}")
            layout, folders = "file", [p.parent]
        elif (p / "model_index.json").is_file():
            try:
                index = json.loads((p / "model_index.json").read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{p / 'model_index.json'}: unreadable ({e})") from e
            cands = _candidates(f for kind in COMPONENTS for f in (p / kind).glob("*.safetensors"))
            layout, folders = "hf", [p / "tokenizer", p]
        else:
            subdirs = [p / s for s in ("diffusion_models", "unet", "text_encoders", "clip", "vae") if (p / s).is_dir()]
            # ComfyUI lets users sort models into subfolders of its model folders
            cands = _candidates(d / f for d in subdirs for f in walk_files(d, CHECKPOINT_EXTENSIONS)) if subdirs \
                else _candidates(f for e in CHECKPOINT_EXTENSIONS for f in p.glob("*" + e))
            layout, folders = ("comfyui" if subdirs else "files"), [p, *subdirs]
            if not cands:
                raise CheckpointError(f"{p}: no FLUX.2 [klein] checkpoint in this folder")
        for kind, files in cands:
            found[kind].append((layout, files))
        tokenizer = tokenizer or _find_tokenizer(*folders)
    specs: dict[str, ComponentSpec | None] = {}
    for kind in COMPONENTS:
        cands = found[kind]
        if kind == "text_encoder" and len(cands) > 1 and specs["transformer"] is not None:
            # several Qwen3 sizes side by side (qwen_3_4b, qwen_3_8b): keep the one the transformer reads
            width = specs["transformer"].config.context_dim
            cands = [c for c in cands
                     if qwen3_config.config_from_checkpoint(read_headers(c[1])).out_dim == width] or cands
        if len(cands) > 1:
            names = ", ".join(str(fs[0]) for _, fs in cands)
            raise CheckpointError(f"several {kind.replace('_', ' ')} checkpoints found ({names}); "
                                  "pass the one you mean as a file")
        specs[kind] = _component(kind, cands[0][0], cands[0][1]) if cands else None
    tr = specs["transformer"]
    variant = flux2_config.variant_name(tr.config) if tr is not None else "unknown"
    metas = [read_header(f)[1] for f in (tr.files if tr is not None else ())]
    distilled, source = _distilled(index, metas, [f.name for f in (tr.files if tr is not None else ())])
    te = specs["text_encoder"]
    if tr is not None and te is not None:
        want = tr.config.context_dim
        have = te.config.out_dim
        if want != have:
            raise CheckpointError(f"the text encoder gives {have}-wide embeddings but the transformer expects {want}: "
                                  "klein-4B pairs with Qwen3-4B and klein-9B with Qwen3-8B")
    return ModelSpec(variant, distilled, source, tr, te, specs["vae"], tokenizer)


def gguf_tokenizer_note(te: ComponentSpec | None, tokenizer: Path | None) -> str | None:
    """Which tokenizer a GGUF text encoder gets (None for any other text encoder): said once where the encoder is
    loaded or first described (not at every validation, which reads the header again)."""
    for f in te.files if te is not None else ():
        meta = read_header(f)[1]
        if "gguf.tokenizer" in meta:
            return tokenizer_note(f, meta) if tokenizer is None else f"{f.name}: the tokenizer {tokenizer} is used"
    return None


def load(spec: ComponentSpec, *, dtype: Any = "bf16", device: Any = "cpu",
         parts: tuple[str, ...] = ("encoder", "decoder"), fp8_compute: str | None = None) -> Any:
    """Build one component from its spec (a torch module): memory-mapped reads straight into a meta-built module.

    `dtype` is a name ("bf16") or a torch dtype, the compute dtype (fp8 layers stay fp8 and compute in it, by
    `fp8_compute` for the transformer: "dequant", "scaled_mm", None for models.fp8.DEFAULT_COMPUTE); this is
    the only function here that imports torch.
    """
    dt = torch_dtype(dtype)
    if spec.kind == "transformer":
        from .flux2 import load_transformer

        return load_transformer(spec.infos, spec.config, dtype=dt, device=device, fp8_compute=fp8_compute)
    if spec.kind == "text_encoder":
        from .qwen3 import load_qwen3

        return load_qwen3(spec.infos, spec.config, dtype=dt, device=device)
    from .vae import load_vae

    return load_vae(spec.infos, spec.config, parts=parts, dtype=dt, device=device)
