"""Port types, the values nodes see ahead of time, and what a node tells the planner it costs.

Ports are typed here and only here; `compatible` is the one function that says whether an output may
feed an input. Before anything runs, every node's outputs are known as *infos*: shapes and model
sizes, never tensors (an INT or a STRING is known exactly). A node's `vg_estimate` turns its input
infos into its output infos and a `Cost`: the models it needs on the GPU and its activation peak,
for each way it can run (full GPU, tiled, CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
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
class Variant:
    """One way a node can run (full GPU, tiled, CPU, streamed): what a node's estimate offers and the planner
    chooses from. The planner (graph/planner.py) takes these as they are."""

    name: str  # "gpu", "tiled", "cpu", "host", "stream"
    models: tuple[str, ...] = ()  # model keys that must be resident on the GPU while it runs
    activation: int = 0  # bytes of GPU memory above the resident weights (its peak)
    seconds: float = 0.0  # predicted compute time
    note: str = ""  # why/what, shown to users (e.g. "decodes on the CPU: 134 s")
    streams: tuple[str, ...] = ()  # models read from host memory while it runs, never resident (their transfer
    #                                costs bytes / bandwidth of their source every time, and they get pinned)


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


class RunContext(Protocol):
    """What a running node may ask of the engine. ComfyUI does not pass one; our nodes then run alone."""

    variant: str  # the name of the Variant the plan chose for this node

    def module(self, model: Any) -> Any: ...  # the loaded torch module where the plan placed it

    def resolve(self, folder: str, name: str) -> Any: ...  # a file in models/ or input/

    def progress(self, value: int, total: int) -> None: ...

    def check_interrupted(self) -> None: ...

    @property
    def output_dir(self) -> Any: ...
