"""Shapes ahead of time: every node's output infos and cost, before anything runs.

`ModelCatalog` answers what a loader would load (model infos from checkpoint headers, or from the
built-in klein-4B/9B specs when the files are absent and the caller only plans). `propagate` walks the
graph in topological order and calls each node's `vg_estimate` with its input infos; `planner_inputs`
turns the costs into the planner's torch-free terms.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from ..models import flux2, loading, qwen3, vae
from ..models.common import CheckpointError
from ..nodes.files import Folders
from ..nodes.types import UNKNOWN, Cost, ModelInfo
from . import planner
from .errors import NodeExecutionError

LABELS = {"transformer": "transformer", "text_encoder": "text encoder", "vae": "vae"}
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def _builtin(kind: str, name: str) -> Any:
    big = "9b" in name.lower() or "8b" in name.lower()
    if kind == "transformer":
        return flux2.KLEIN_9B if big else flux2.KLEIN_4B
    if kind == "text_encoder":
        return qwen3.QWEN3_8B if big else qwen3.Qwen3Config()
    return vae.VAEConfig()


def _meta_params(kind: str, config: Any) -> int:
    import torch

    with torch.device("meta"):
        module = (flux2.Flux2Transformer(config) if kind == "transformer" else
                  qwen3.Qwen3Encoder(config) if kind == "text_encoder" else vae.Flux2VAE(config))
    return sum(math.prod(p.shape) for p in module.parameters())


@dataclass
class ModelCatalog:
    """Model infos by (kind, file name) under the folders; cached by path and modification time."""

    folders: Folders
    dtype: str = "bf16"
    allow_builtin: bool = False  # plan without files: use the built-in klein specs by name
    _cache: dict = field(default_factory=dict)

    def _key(self, kind: str, path: Path) -> str:
        return f"{kind}:{path}:{self.dtype}"

    def _from_spec(self, kind: str, path: Path, spec: loading.ComponentSpec, tokenizer: Path | None) -> ModelInfo:
        import torch

        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.dtype]
        info = ModelInfo(self._key(kind, path), kind, LABELS[kind], spec.nbytes(dt), spec.config, spec, self.dtype)
        self._cache[("tokenizer", info.key)] = tokenizer
        return info

    def model_info(self, kind: str, name: str, dtype: str = "default") -> ModelInfo:
        folder = {"transformer": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}[kind]
        try:
            path = self.folders.resolve(folder, name)
        except FileNotFoundError:
            if not self.allow_builtin:
                raise
            config = _builtin(kind, name)
            key = ("builtin", kind, name)
            if key not in self._cache:
                self._cache[key] = _meta_params(kind, config) * ITEMSIZE[self.dtype]
            return ModelInfo(f"{kind}:{name}:{self.dtype}", kind, LABELS[kind], self._cache[key], config, None,
                             self.dtype)
        stamp = (kind, str(path), path.stat().st_mtime_ns, self.dtype)
        if stamp not in self._cache:
            spec = loading.inspect([path])
            comp = getattr(spec, kind)
            if comp is None:
                found = [k for k in ("transformer", "text_encoder", "vae") if getattr(spec, k) is not None]
                raise CheckpointError(f"{name} is a {found[0].replace('_', ' ') if found else 'unknown model'}, "
                                      f"not a {kind.replace('_', ' ')}; pick a file from {folder}/")
            self._cache[stamp] = self._from_spec(kind, path, comp, spec.tokenizer)
        return self._cache[stamp]

    def checkpoint_infos(self, name: str) -> tuple[ModelInfo, ModelInfo, ModelInfo]:
        """The three components of a whole model: a checkpoint folder listed under the folders (never another path)."""
        p = self.folders.resolve("checkpoints", name)
        stamp = ("checkpoint", str(p), p.stat().st_mtime_ns, self.dtype)
        if stamp not in self._cache:
            spec = loading.inspect([p])
            self._cache[stamp] = tuple(self._from_spec(k, p, spec.component(k), spec.tokenizer)
                                       for k in ("transformer", "text_encoder", "vae"))
        return self._cache[stamp]

    def tokenizer_for(self, info: ModelInfo) -> Path | None:
        return self._cache.get(("tokenizer", info.key))

    def image_size(self, name: str) -> tuple[int, int]:
        from PIL import Image

        with Image.open(self.folders.resolve("input", name)) as im:
            return im.size

    @property
    def compute_dtype(self) -> str:
        return self.dtype


def inputs_of(prompt: Mapping[str, dict], node: str, values: Mapping[str, tuple]) -> dict[str, Any]:
    """A node's inputs with links replaced by the producing node's output at that slot."""
    out = {}
    for name, v in prompt[node]["inputs"].items():
        if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
            src = values.get(v[0])
            out[name] = src[v[1]] if src is not None and v[1] < len(src) else UNKNOWN
        else:
            out[name] = v
    return out


def propagate(prompt: Mapping[str, dict], dag: nx.DiGraph, nodes: Mapping[str, type], env: Any,
              with_defaults: Any = None) -> dict[str, Cost]:
    """Every node's Cost (output infos, options) in topological order; `with_defaults(cls, inputs)` fills defaults."""
    costs: dict[str, Cost] = {}
    outputs: dict[str, tuple] = {}
    for node in nx.lexicographical_topological_sort(dag, key=_order_key):
        cls = nodes[prompt[node]["class_type"]]
        inputs = inputs_of(prompt, node, outputs)
        if with_defaults is not None:
            inputs = with_defaults(cls, inputs)
        try:
            cost = cls.vg_estimate(env, **inputs)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # a missing or unreadable file, or a value the node cannot use: the node fails, by name, before any run
            raise NodeExecutionError(node, prompt[node]["class_type"], f"{type(e).__name__}: {e}",
                                     type(e).__name__, traceback.format_exception(e)) from e
        costs[node] = cost
        outputs[node] = cost.outputs
    return costs


def _order_key(node: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in node.split(":"))


def planner_inputs(prompt: Mapping[str, dict], costs: Mapping[str, Cost]
                   ) -> tuple[dict[str, planner.NodeCost], dict[str, planner.ModelCost]]:
    """The planner's view: per node its variants, and every model any variant needs."""
    models: dict[str, planner.ModelCost] = {}
    node_costs = {}
    for node, cost in costs.items():
        for out in cost.outputs:
            if isinstance(out, ModelInfo):
                models[out.key] = planner.ModelCost(out.key, out.nbytes, out.label)
        variants = tuple(planner.Variant(o.name, o.models, o.activation, o.seconds, o.note, o.streams)
                         for o in cost.options)
        node_costs[node] = planner.NodeCost(node, prompt[node]["class_type"], variants, cost.host_bytes)
    return node_costs, models
