"""LoRAs as ComfyUI users chain them: `LoraLoaderModelOnly` and `LoraLoader` (ComfyUI's names, inputs and outputs),
`VGLoraLoader` for our own graph, and how the plan applies them.

A LoRA changes no file and no ledger key: the node returns the same model info with the LoRA appended to its
`loras` (a `LoraRef`: file, strength, adapter bytes, layers changed), so the base weights are shared by every LoRA
set and a LoRA change never reads the base file again. The nodes that run the model apply the chain
(`applied`), in the way the plan chose for their variant (`Variant.lora_mode`, decided by `with_lora_costs` from
predicted seconds and bytes):

- merged: one pass over each changed layer before the node runs; nothing per step. The merge stays on the
  resident weights for the next node using the same chain, in this prompt or the next (whose plan counts it as done:
  `share_merges`); another chain first restores the layers from the pinned host copy (models/lora.py).
- on the fly: each changed layer adds its low-rank product to its output every call; the adapters and one layer's
  extra output are on the GPU while the node runs. Streamed blocks and fp8 layers always take LoRAs this way.

A text encoding depends only on the text encoder's LoRAs: LoRA nodes sign their outputs by what they are
(`VG_SIGNS_OUTPUTS`), so changing the model's LoRA or strength keeps the cached conditioning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

from .context import Context
from .core import file_changed, file_check
from .declared import LORA_TIPS, tip
from .files import Folders, file_list, identity
from .types import CLIP, FLOAT, MODEL, VG_CLIP, VG_MODEL, Cost, LoraRef, ModelInfo, Variant
from .values import ModelHandle

log = logging.getLogger("vramgraph.lora")

STRENGTH = (FLOAT, {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01})  # ComfyUI's LoraLoader inputs
FOLDER = "loras"

# Predicted seconds of applying LoRAs. ASSUMED, NOT MEASURED (unlike the constants of nodes/estimates.py): the H200's
# spec-sheet figures with an assumed efficiency. Both ways are bound by memory traffic, not by the low-rank matmuls.
# How they get measured: `bash bench/run_device.sh lora_cost` on the GPU (bench/lora_cost.py) times models/lora.py's
# merge and restore per GiB of the layers changed, and a model call with the on-the-fly hooks against one without
# (klein-4B's widths, ranks 16 and 64, at 1024² and at 76 tokens), each against these constants' prediction; its
# `suggested` values replace the three below, with the results file and commit named here.
HBM_BYTES_PER_S = 4.8e12 * 0.6  # assumed: H200 HBM3e 4.8 TB/s (spec sheet) at 60 % (merge pass: 3 x the layer bytes)
H2D_PINNED_BYTES_PER_S = 55.3e9  # host->GPU from pinned memory, H200 measured (graph/plan/types.py CostModel); restore
KERNEL_SECONDS = 6e-6  # assumed: one small kernel launch with its sync-free overhead
KERNELS_PER_ADAPTER = 3  # on the fly: x @ down.T, @ up.T, the add


def _folders(env: Any) -> Any:
    return getattr(env, "folders", None)


def lora_ref(env: Any, name: str, strength: float, component: str, transformer: Any, text_encoder: Any) -> LoraRef:
    """The LoRA file `name` in loras/ as it applies to one component (header only); LoraError if it cannot."""
    from ..models import lora_format

    folders = _folders(env)
    if folders is None:
        raise FileNotFoundError(f"'{name}': no models folders to find loras/ in")
    path = folders.resolve(FOLDER, name)
    lf = lora_format.parse(path, transformer, text_encoder)
    parts = lf.component(component)
    shapes = _shapes(component, transformer if component == "transformer" else text_encoder)
    touched = tuple(sorted({(t.param, *shapes[t.param]) for t in parts}))
    infos, _ = lora_format.read(path) if parts else ({}, {})
    nbytes = sum(infos[k].nbytes for t in parts for _, k in t.keys)
    return LoraRef(str(path), float(strength), identity(path), nbytes, len(touched), lf.rank, lf.adapters, touched, lf)


def _shapes(component: str, cfg: Any) -> dict[str, tuple[int, ...]]:
    from ..models import flux2_config, qwen3_config

    family = flux2_config if component == "transformer" else qwen3_config
    return family.parameter_shapes(cfg) if cfg is not None else {}


def with_lora(info: ModelInfo, ref: LoraRef) -> ModelInfo:
    """The model with one more LoRA in its chain (a LoRA of strength 0 or that changes nothing of it: as it was)."""
    if ref.strength == 0 or not ref.layers:
        return info
    return dataclasses.replace(info, loras=(*info.loras, ref))


def check_strength(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{name} must be a finite number (got {value!r}); 1.0 applies the LoRA as trained, 0 turns it off"
    return None


def identity_of(value: Any) -> Any:
    """What a LoRA node's output is, for the cache signature of the nodes it feeds (a model by its file, dtype and
    LoRA chain; anything else as it is)."""
    if isinstance(value, ModelInfo):
        return [value.key, value.source, value.placement, value.kv_cache,
                [[r.path, r.source, r.strength] for r in value.loras]]
    return repr(value)


# ------------------------------------------------------------------------------------------------ costs


@dataclasses.dataclass(frozen=True)
class LoraCost:
    """What applying a model's LoRA chain costs one node, each way. fp8 layers take their LoRAs on the fly either
    way (a merge would have to dequantize, merge and quantize again): their share is counted in both."""

    adapter_bytes: int  # adapter tensors on the GPU while the node runs (on the fly)
    fly_activation: int  # extra output of the widest changed layer (on the fly)
    fly_seconds: float  # over the node's model calls
    merge_transient: int  # the widest plain layer in fp32 twice, while merging
    merge_seconds: float  # restoring and merging every changed plain layer once
    fp8_bytes: int = 0  # adapters and activation of the fp8 layers' LoRAs (on the fly also when merging)
    fp8_seconds: float = 0.0

    def mode(self, streamed: bool) -> str:
        merged = self.merge_seconds + self.fp8_seconds
        return "onthefly" if streamed or self.fly_seconds <= merged else "merged"


def _fp8_blocks(model: ModelInfo) -> frozenset[str]:
    """The blocks ("double_blocks.3", "layers.7") whose weights the checkpoint stores in fp8."""
    quant = getattr(model.spec, "quant_blocks", ()) if model.spec is not None else ()
    return frozenset(b for b, n, _ in quant if n)


def _block(param: str) -> str:
    parts = param.split(".")
    return ".".join(parts[:2]) if parts[0] in ("double_blocks", "single_blocks", "layers") else "shared"


def _fly(refs: tuple[tuple[LoraRef, tuple], ...], tokens: int, item: int) -> tuple[float, int, int]:
    """(seconds per call, adapter bytes, activation) of these LoRAs' layers on the fly."""
    per_call, adapters, widest = 0.0, 0, 0
    for r, touched in refs:
        for _, o, i in touched:
            # read x and the low-rank middle, read and write the layer's output; a few small kernels
            per_call += tokens * (i + 2 * o + 2 * (r.rank or 1)) * item / HBM_BYTES_PER_S
            per_call += KERNELS_PER_ADAPTER * KERNEL_SECONDS
            widest = max(widest, o)
        adapters += r.nbytes * len(touched) // max(r.layers, 1)  # as stored (bf16 files: as used)
    return per_call, adapters, tokens * widest * item


def lora_cost(model: ModelInfo, tokens: int, calls: int, item: int = 2) -> LoraCost:
    """Bytes and seconds of `model.loras` for a node making `calls` model calls over `tokens` tokens each."""
    fp8 = _fp8_blocks(model)
    split = {q: tuple((r, tuple(t for t in r.touched if (_block(t[0]) in fp8) == q)) for r in model.loras)
             for q in (False, True)}
    per_call, adapters, act = _fly(tuple((r, r.touched) for r in model.loras), tokens, item)
    q_call, q_adapters, q_act = _fly(split[True], tokens, item)
    plain = {p: (o, i) for _, touched in split[False] for p, o, i in touched}  # a merge covers a layer's LoRAs at once
    layer_bytes = sum(o * i * item for o, i in plain.values())
    merge = 3 * layer_bytes / HBM_BYTES_PER_S + layer_bytes / H2D_PINNED_BYTES_PER_S  # merge in fp32, restore
    big = max((o * i for o, i in plain.values()), default=0)
    return LoraCost(adapters, act, per_call * calls, 2 * 4 * big, merge, q_adapters + q_act, q_call * calls)


@dataclasses.dataclass(frozen=True)
class LoraChoice:
    """What a variant of a node running a LoRA'd model knows of its LoRAs: the chain (for nodes sharing one merge)
    and both ways' costs, and the variant as it was without them (to apply the other way)."""

    chain: tuple  # the model key and its LoRAs (path, file identity, strength)
    cost: LoraCost
    base: Variant
    count: int  # LoRAs in the chain
    layers: int  # layers they change, counted per LoRA
    component: str = ""  # the model's kind: "transformer", "text_encoder"
    warm: bool = False  # counted as merged already: the resident weights hold this chain from an earlier prompt


def with_lora_costs(model: ModelInfo, variants: tuple[Variant, ...], tokens: int, calls: int,
                    item: int = 2) -> tuple[Variant, ...]:
    """Each variant with its way of applying the model's LoRAs (the faster by predicted seconds; streamed
    variants on the fly) and what that way adds to its bytes and seconds, said in its note."""
    if not model.loras:
        return variants
    c = lora_cost(model, tokens, calls, item)
    chain = (model.key, tuple((r.path, r.source, r.strength) for r in model.loras))
    out = []
    for v in variants:
        choice = LoraChoice(chain, c, v, len(model.loras), sum(r.layers for r in model.loras), model.kind)
        mode = "onthefly" if model.placement == "cpu" and v.name == "cpu" else c.mode(_streamed(v))
        out.append(_applied_way(choice, mode))
    return tuple(out)


def _applied_way(choice: LoraChoice, mode: str, why: str = "") -> Variant:
    """The variant without LoRAs (`choice.base`) with what applying them `mode`'s way adds ("warm": merged, and the
    merge is on the resident weights already, so only the fp8 layers' part on the fly is left)."""
    v, c = choice.base, choice.cost
    fp8 = f"; its fp8 layers on the fly: {c.fp8_seconds:.3f} s, {c.fp8_bytes / 2**20:.0f} MiB" if c.fp8_bytes else ""
    adapters = f"{c.adapter_bytes / 2**20:.1f} MiB of adapters"
    if mode == "warm":
        extra, secs = c.fp8_bytes, c.fp8_seconds
        what = f"{choice.count} LoRA(s) merged into {choice.layers} layers already (kept on the resident weights " \
               f"from an earlier prompt: 0 s, 0 MiB to merge{fp8})"
        choice, mode = dataclasses.replace(choice, warm=True), "merged"
    elif mode == "merged":
        extra, secs = max(c.merge_transient, c.fp8_bytes), c.merge_seconds + c.fp8_seconds
        what = f"{choice.count} LoRA(s) merged into {choice.layers} layers{why} ({adapters}; " \
               f"{c.merge_seconds:.3f} s once, {c.merge_transient / 2**20:.0f} MiB while merging{fp8})"
    else:
        extra, secs = c.adapter_bytes + c.fly_activation, c.fly_seconds
        what = f"{choice.count} LoRA(s) on the fly ({c.adapter_bytes / 2**20:.1f} MiB of adapters, " \
               f"{c.fly_activation / 2**20:.0f} MiB activation, {secs:.3f} s)"
    note = f"{v.note}; {what}" if v.note else what
    blocks = dataclasses.replace(v.blocks, activation=v.blocks.activation + extra) if v.blocks else None
    activation = blocks.min_gpu() if blocks is not None else v.activation + extra
    return dataclasses.replace(v, activation=activation, seconds=v.seconds + secs, note=note, blocks=blocks,
                               lora_mode=mode, lora=choice)


def share_merges(costs: Mapping[str, Cost], merged: Mapping[str, tuple] | None = None) -> dict[str, Cost]:
    """The nodes of a prompt (or of a queue planned as one) that run the same model with the same LoRAs, knowing that
    a merge stays on the resident weights:

    - already merged: `merged` (model key -> the signature of the LoRAs merged into its GPU-resident weights now, as
      the engine's ledger tells) holds their chain, so their variants that keep the model resident take it merged at
      no cost (the plan is checked to keep the model resident until then: graph/engine/planning.py);
    - else one merge serves them all: when their on-the-fly seconds add up to more than one merge, their resident
      variants merge (each still counts the merge's bytes; the seconds of one merge each, an upper bound).

    Streamed variants stay on the fly."""
    merged = merged or {}
    groups: dict[tuple, list[str]] = {}
    for node, cost in costs.items():
        chains = {v.lora.chain for v in cost.variants if v.lora is not None and v.lora_mode and not _streamed(v)}
        for chain in chains:
            groups.setdefault(chain, []).append(node)
    out = dict(costs)
    for chain, nodes in groups.items():
        mine = {n: [v.lora for v in costs[n].variants if _resident(v, chain)] for n in nodes}
        first = mine[nodes[0]][0]
        if chain[0] in merged and merged[chain[0]] == merge_signature(first):
            way, why = "warm", ""
        else:
            fly = sum(max(c.cost.fly_seconds for c in cs) for cs in mine.values())
            once = first.cost.merge_seconds + sum(max(c.cost.fp8_seconds for c in cs) for cs in mine.values())
            if len(nodes) < 2 or fly <= once:
                continue
            way, why = "merged", f", shared by {len(nodes)} nodes"
        for n in nodes:
            variants = tuple(_applied_way(v.lora, way, why) if _resident(v, chain) and (
                chain[0] in v.models if way == "warm" else v.lora_mode == "onthefly") else v for v in costs[n].variants)
            out[n] = dataclasses.replace(costs[n], variants=variants)
    return out


def merge_signature(choice: LoraChoice) -> tuple:
    """What merging the choice's chain records on the weights (models/lora.py `merged_signature`): its files as they
    are now, component and strengths; () when a file is gone (it cannot be what is merged)."""
    from ..models.lora_format import use_signature

    try:
        return tuple(use_signature(path, choice.component, strength) for path, _, strength in choice.chain[1])
    except OSError:
        return ()


def _resident(v: Variant, chain: tuple) -> bool:
    """A variant that applies `chain` and does not stream its model."""
    return v.lora is not None and v.lora.chain == chain and not _streamed(v)


def _streamed(v: Variant) -> bool:
    return bool(v.streams) or v.name.startswith("stream")


# ------------------------------------------------------------------------------------------------ at run time


def _uses(info: ModelInfo) -> list:
    from ..models import lora, lora_format

    uses = []
    for r in info.loras:
        lf = r.file if isinstance(r.file, lora_format.LoraFile) else None
        if lf is None:
            raise lora_format.LoraError(f"{r.path}: not read before the run")
        uses.append(lora.Use(lf, info.kind, r.strength))
    return uses


@contextlib.contextmanager
def applied(vg: Context, handle: ModelHandle, module: Any) -> Iterator[Any]:
    """`module` with the handle's LoRA chain applied the way the plan chose for this node (none: a merge left by an
    earlier node is undone). Inside ComfyUI, which moves our modules between devices, always on the fly."""
    from ..models import lora

    chosen = vg.chosen
    mode = (chosen.lora_mode if chosen is not None else "") or ("merged" if chosen is not None else "onthefly")
    with lora.applied(module, _uses(handle.info), mode, vg.host_weights(handle)) as done:
        vg.lora_applied(handle, done)
        yield module


# ------------------------------------------------------------------------------------------------ nodes


def _validate(lora_name: str, folders: Any, **strengths: Any) -> bool | dict[str, str]:
    for k, v in strengths.items():
        bad = check_strength(k, v)
        if bad:
            return {k: bad}
    found = file_check(folders, FOLDER, lora_name)
    if found is not True:
        return {"lora_name": found}
    if folders is not None and not folders.inside_comfyui and lora_name:  # the file's own check (inside
        # ComfyUI: when the node runs); its fit to the model is the estimate's
        from ..models import lora_format

        try:
            lora_format.read(folders.resolve(FOLDER, lora_name))
        except (OSError, ValueError) as e:
            return {"lora_name": str(e)}
    return True


class LoraLoaderModelOnly:
    """ComfyUI's LoraLoaderModelOnly: a LoRA's transformer part applied to the model (its text encoder part, if any,
    is left aside, as ComfyUI does). Chain as many as you like; strength 0 turns one off."""

    CATEGORY = "model/loaders"
    RETURN_TYPES = (MODEL,)
    OUTPUT_TOOLTIPS = ("The modified diffusion model.",)
    FUNCTION = "load_lora_model_only"
    VG_SIGNS_OUTPUTS = True
    model_type = MODEL

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"model": (cls.model_type,), "lora_name": (file_list(folders, FOLDER),),
                             "strength_model": STRENGTH}, "hidden": {"vg": "VG_CONTEXT"}}

    @classmethod
    def VALIDATE_INPUTS(cls, lora_name: str = "", strength_model: Any = 1.0, folders: Any = None
                        ) -> bool | dict[str, str]:
        return _validate(lora_name, folders, strength_model=strength_model)

    @classmethod
    def IS_CHANGED(cls, lora_name: str, folders: Any = None, **_: Any) -> str:
        return file_changed(folders, FOLDER, lora_name)

    @classmethod
    def vg_estimate(cls, env: Any, model: ModelInfo, lora_name: str, strength_model: float = 1.0) -> Cost:
        return Cost((_on_model(env, model, lora_name, strength_model),))

    def load_lora_model_only(self, model: ModelHandle, lora_name: str, strength_model: float = 1.0,
                             *, vg: Context) -> tuple:
        info = _on_model(_Env(vg), model.info, lora_name, strength_model)
        return (dataclasses.replace(model, info=info),)


def _on_model(env: Any, model: ModelInfo, name: str, strength: float) -> ModelInfo:
    if model.kind != "transformer":
        raise ValueError(f"the model input is a {model.label}, not the FLUX.2 transformer")
    if strength == 0:
        return model
    return with_lora(model, lora_ref(env, name, strength, "transformer", model.config, None))


def _on_clip(env: Any, clip: ModelInfo, model: ModelInfo | None, name: str, strength: float) -> ModelInfo:
    if strength == 0:
        return clip
    cfg = model.config if model is not None else None
    return with_lora(clip, lora_ref(env, name, strength, "text_encoder", cfg, clip.config))


@dataclasses.dataclass(frozen=True)
class _Env:
    """A running node's context seen as an estimate's env: where loras/ is."""

    vg: Context

    @property
    def folders(self) -> Folders:
        return self.vg.folders


class LoraLoader(LoraLoaderModelOnly):
    """ComfyUI's LoraLoader: a LoRA applied to the model and to the text encoder (CLIP), each at its own strength."""

    RETURN_TYPES = (MODEL, CLIP)
    OUTPUT_TOOLTIPS = ("The modified diffusion model.", "The modified CLIP model.")
    FUNCTION = "load_lora"
    clip_type = CLIP

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        types = {"model": (cls.model_type, {}), "clip": (cls.clip_type, {}),
                 "lora_name": (file_list(folders, FOLDER), {}), "strength_model": STRENGTH, "strength_clip": STRENGTH}
        return {"required": {k: (t, tip(o, LORA_TIPS[k])) for k, (t, o) in types.items()},
                "hidden": {"vg": "VG_CONTEXT"}}

    @classmethod
    def VALIDATE_INPUTS(cls, lora_name: str = "", strength_model: Any = 1.0, strength_clip: Any = 1.0,
                        folders: Any = None) -> bool | dict[str, str]:
        return _validate(lora_name, folders, strength_model=strength_model, strength_clip=strength_clip)

    @classmethod
    def vg_estimate(cls, env: Any, model: ModelInfo, clip: ModelInfo, lora_name: str, strength_model: float = 1.0,
                    strength_clip: float = 1.0) -> Cost:
        return Cost((_on_model(env, model, lora_name, strength_model),
                     _on_clip(env, clip, model, lora_name, strength_clip)))

    def load_lora(self, model: ModelHandle, clip: ModelHandle, lora_name: str, strength_model: float = 1.0,
                  strength_clip: float = 1.0, *, vg: Context) -> tuple:
        env = _Env(vg)
        return (dataclasses.replace(model, info=_on_model(env, model.info, lora_name, strength_model)),
                dataclasses.replace(clip, info=_on_clip(env, clip.info, model.info, lora_name, strength_clip)))


class VGLoraLoader(LoraLoader):
    """A LoRA on the model and the text encoder (vramgraph's handles): strength 0 turns a part off."""

    CATEGORY = "vramgraph"
    RETURN_TYPES = (VG_MODEL, VG_CLIP)
    RETURN_NAMES = ("model", "text_encoder")
    DESCRIPTION = __doc__
    model_type, clip_type = VG_MODEL, VG_CLIP
