"""Port types, the values nodes see ahead of time, and what a node tells the planner it costs.

Ports are typed here and only here; `compatible` is the one function that says whether an output may
feed an input. Before anything runs, every node's outputs are known as *infos*: shapes and model
sizes, never tensors (an INT or a STRING is known exactly). A node's `vg_estimate` turns its input
infos into its output infos and a `Cost`: the models it needs on the GPU and its activation peak,
for each way it can run (full GPU, tiled, CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# Port types (ComfyUI's names; a list of strings in INPUT_TYPES is a COMBO)
MODEL, CLIP, VAE = "MODEL", "CLIP", "VAE"
CONDITIONING, LATENT, IMAGE, MASK = "CONDITIONING", "LATENT", "IMAGE", "MASK"
NOISE, GUIDER, SAMPLER, SIGMAS = "NOISE", "GUIDER", "SAMPLER", "SIGMAS"
INT, FLOAT, STRING, BOOLEAN = "INT", "FLOAT", "STRING", "BOOLEAN"
ANY = "*"
# Our own model handles inside ComfyUI, where MODEL/CLIP/VAE are ComfyUI's objects and must not be mixed
# with ours. In our engine both are our handles, so they are aliases.
VG_MODEL, VG_CLIP, VG_VAE = "VG_MODEL", "VG_CLIP", "VG_VAE"
ALIASES = {VG_MODEL: MODEL, VG_CLIP: CLIP, VG_VAE: VAE}
PRIMITIVES = (INT, FLOAT, STRING, BOOLEAN)


def is_link(value: Any) -> bool:
    """The one rule for "is this input a link" (ComfyUI's): [source node id (a str), output index (an int)]."""
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], int) and not isinstance(value[1], bool))


def is_mapping(x: Any) -> bool:
    """isinstance(x, Mapping), a dict's or None's answered at once (an ABC's isinstance costs ten times a dict's):
    what a prompt's JSON objects are checked with."""
    return x is not None and (isinstance(x, dict) or isinstance(x, Mapping))


def canonical(t: str) -> str:
    return ALIASES.get(t, t)


def compatible(output_type: str, input_type: str | list | tuple) -> bool:
    """May an output of `output_type` feed an input declared as `input_type`?

    A list input is a COMBO (a choice of strings): STRING and COMBO outputs may feed it. "*" matches
    anything; comma-separated types ("IMAGE,MASK") accept any of their parts.
    """
    if isinstance(input_type, list | tuple):
        return output_type in (STRING, "COMBO", ANY) or isinstance(output_type, list | tuple)
    if ANY in (output_type, input_type):
        return True
    outs = {canonical(t.strip()) for t in output_type.split(",")}
    ins = {canonical(t.strip()) for t in input_type.split(",")}
    return bool(outs & ins)


# ---------------------------------------------------------------------------------------------------
# Infos: what flows along the graph ahead of time


@dataclass(frozen=True)
class LoraRef:
    """A LoRA chained onto a model (LoraLoader, LoraLoaderModelOnly, --lora): its file, strength and what it adds."""

    path: str
    strength: float
    source: str  # the file's identity (files.identity) when read
    nbytes: int  # bytes of its adapter tensors for this model
    layers: int  # layers it changes
    rank: int
    adapters: tuple[str, ...]  # "lora", "dora", "loha", "lokr"
    touched: tuple[tuple[str, int, int], ...] = field(default=(), repr=False)  # (parameter, out, in) it changes
    file: Any = field(default=None, repr=False, compare=False)  # models.lora_format.LoraFile


@dataclass(frozen=True)
class ModelInfo:
    """A model's identity and size, from its checkpoint headers (or a built-in spec when absent)."""

    key: str  # identity in the residency ledger: kind, file(s), dtype
    kind: str  # "transformer", "text_encoder", "vae"
    label: str  # short name for tables: "transformer", "text encoder", "vae"
    nbytes: int  # bytes of the weights on the GPU once loaded
    config: Any = None  # flux2.Flux2Config | qwen3.Qwen3Config | vae.VAEConfig
    spec: Any = None  # loading.ComponentSpec, or None when planning without files
    dtype: str = "bf16"
    source: str = ""  # the file's (or folder's) identity when this info was read (files.identity): a replaced
    #                   file gives another info under the same key, so the engine reads the new weights
    kv_cache: bool = False  # a transformer patched by FluxKVCache (same weights, same key; the sampler caches the
    #                         references' keys and values on its first step)
    placement: str = "gpu"  # "gpu": the planner places it; "cpu": its nodes compute on the CPU and it never
    #                          takes GPU memory (ComfyUI's CLIPLoader device "cpu")
    loras: tuple[LoraRef, ...] = ()  # LoRAs applied to it, in chain order (same weights, same key: nodes/lora.py)


@dataclass(frozen=True)
class LatentInfo:
    batch: int
    height: int  # latent grid (pixels / 16)
    width: int
    channels: int = 128


@dataclass(frozen=True)
class ImageInfo:
    batch: int
    height: int
    width: int


@dataclass(frozen=True)
class CondInfo:
    """Prompt embeddings (batch, tokens) plus the reference latents attached to them."""

    batch: int
    tokens: int
    refs: tuple[tuple[int, int], ...] = ()  # latent grid (h, w) of each reference


@dataclass(frozen=True)
class GuiderInfo:
    model: ModelInfo
    positive: CondInfo
    negative: CondInfo | None
    cfg: float


@dataclass(frozen=True)
class SigmasInfo:
    steps: int


@dataclass(frozen=True)
class NoiseInfo:
    seed: int


class Unknown:
    """A value that cannot be known before running (only nodes outside our set produce it)."""

    def __repr__(self) -> str:
        return "Unknown"


UNKNOWN = Unknown()


# ---------------------------------------------------------------------------------------------------
# Costs


@dataclass(frozen=True)
class Blocks:
    """A model a node can run block by block with only some blocks on the GPU (graph/plan/residency.py chooses which):
    the rest is streamed from its pinned host copy for every pass, through staging buffers on the GPU.

    `fixed` are the weights outside the blocks that stay on the GPU for the whole node (embeddings, modulation,
    final layer; 0 when they stay in host memory, as the text encoder's embedding table); `activation` is the
    node's activation peak above the weights. Times are compute seconds of one pass through each block."""

    model: str  # model key
    sizes: tuple[int, ...]  # bytes of each block's weights, in the order a pass runs them
    seconds: tuple[float, ...]  # compute seconds of each block in one pass
    fixed: int  # bytes on the GPU for the whole node besides the blocks
    activation: int  # the node's activation peak above all weights
    passes: int  # passes through all blocks (sampling steps, times two when CFG runs the passes one after another)
    unit: str = "step"  # what the plan calls a pass of `passes_per_unit` passes ("step", "encode")
    passes_per_unit: int = 1

    def staging(self, streamed: tuple[int, ...]) -> int:
        """Bytes of the staging buffers for `streamed` (block indices): two of the largest (one when one block)."""
        if not streamed:
            return 0
        return min(2, len(streamed)) * max(self.sizes[i] for i in streamed)

    def gpu_bytes(self, streamed: tuple[int, ...]) -> int:
        """The node's GPU peak above other resident models with `streamed` blocks streamed, the others resident."""
        resident = sum(self.sizes) - sum(self.sizes[i] for i in set(streamed))
        return self.fixed + resident + self.staging(streamed) + self.activation

    def min_gpu(self) -> int:
        """The least GPU memory it runs in: stream every block up to some size m (the others stay), for the best m."""
        best = self.gpu_bytes(())
        for m in set(self.sizes):
            best = min(best, self.gpu_bytes(tuple(i for i, s in enumerate(self.sizes) if s <= m)))
        return best


@dataclass(frozen=True)
class Variant:
    """One way a node can run (full GPU, tiled, CPU, streamed): what a node's estimate offers and the planner
    chooses from. The planner (graph/plan/planner.py) takes these as they are."""

    name: str  # "gpu", "tiled", "cpu", "host", "stream"
    models: tuple[str, ...] = ()  # model keys that must be resident on the GPU while it runs
    activation: int = 0  # bytes of GPU memory above the resident weights (its peak)
    seconds: float = 0.0  # predicted compute time
    note: str = ""  # why/what, shown to users (e.g. "decodes on the CPU: 134 s")
    streams: tuple[str, ...] = ()  # models read from host memory while it runs, never resident (their transfer
    #                                costs bytes / bandwidth of their source every time, and they get pinned)
    blocks: Blocks | None = None  # with `streams`: the streamed model's blocks, some of which the plan keeps on the
    #                               GPU for the node (its `activation` is then `blocks.min_gpu()`)
    lora_mode: str = ""  # how the model's LoRAs are applied in this variant: "merged", "onthefly" (nodes/lora.py)
    lora: Any = field(default=None, compare=False, repr=False)  # nodes/lora.py LoraChoice: both ways' costs


HOST = Variant("host")  # a node that needs no GPU at all (loaders, images, primitives)


@dataclass(frozen=True)
class Cost:
    outputs: tuple[Any, ...]
    variants: tuple[Variant, ...] = (HOST,)
    host_bytes: int = 0  # host RAM its outputs hold until consumed


class EstimateEnv(Protocol):
    """What estimates may ask of the engine: file lookup and model infos (from headers, or built in)."""

    def model_info(self, kind: str, name: str, dtype: str = "default") -> ModelInfo: ...

    def image_size(self, name: str) -> tuple[int, int]: ...  # (width, height) of an input image

    @property
    def compute_dtype(self) -> str: ...

