"""The one model catalogue: model infos by kind and file, the tokenizers beside them, their labels.

Both runtimes use it: our engine (graph/engine/executor.py), which resolves names under its `Folders`, and
the context our nodes get inside ComfyUI (nodes/comfy.py), which resolves them through ComfyUI's
`folder_paths` and asks for the info of the file it found (`info_at`). Infos come from safetensors
headers (read with json + struct) or, when the caller only plans and the file is absent, from the
built-in klein-4B/9B specs; nothing here imports torch except `tokenizer`, which loads one.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models import flux2_config, loading, qwen3_config, vae_config
from ..models.dtypes import itemsize
from ..models.gguf import GGUFError, type_from_name
from ..models.gguf import builtin_bytes as gguf_bytes
from ..models.headers import CheckpointError
from ..models.quant import QuantError
from .files import Files, Folders, identity
from .types import ModelInfo

log = logging.getLogger(__name__)

KINDS = ("transformer", "text_encoder", "vae")
FOLDERS = {"transformer": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}  # ComfyUI's names
LABELS = {"transformer": "transformer", "text_encoder": "text encoder", "vae": "vae"}


def builtin_config(kind: str, name: str) -> Any:
    """The built-in spec a file name stands for when the file is absent: klein-9B's parts by name, else 4B's; the
    small decoder by its name (full_encoder_small_decoder)."""
    big = "9b" in name.lower() or "8b" in name.lower()
    if kind == "transformer":
        return flux2_config.KLEIN_9B if big else flux2_config.KLEIN_4B
    if kind == "text_encoder":
        return qwen3_config.QWEN3_8B if big else qwen3_config.Qwen3Config()
    return vae_config.SMALL_DECODER if "small_decoder" in name.lower() else vae_config.VAEConfig()


def builtin_params(kind: str, config: Any) -> int:
    """Parameters of a model built from `config` (what loading it puts on the GPU), counted without building it."""
    family = {"transformer": flux2_config, "text_encoder": qwen3_config, "vae": vae_config}[kind]
    return sum(math.prod(s) for s in family.parameter_shapes(config).values())


def _fp8_layer(kind: str, key: str, shape: tuple[int, ...]) -> bool:
    """A layer an fp8 file of `kind` stores in fp8: the block linears of a transformer (what the 4B fp8 file's size
    shows, /work/shared/reference/checkpoint-formats.md 1e), the layer linears of a text encoder (assumed alike)."""
    inside = "_blocks." in key if kind == "transformer" else key.startswith("layers.")
    return inside and key.endswith(".weight") and len(shape) == 2


def builtin_bytes(kind: str, name: str, config: Any, dtype: str) -> int:
    """What loading the built-in spec `config` puts on the GPU at `dtype`; a file named fp8 keeps its fp8 layers at
    one byte a parameter, as loading the real file does (models/quant.py); a GGUF name's quantization is counted
    (models/gguf.py)."""
    stored = type_from_name(name) if kind != "vae" else None
    if stored is not None:
        return gguf_bytes({"transformer": flux2_config, "text_encoder": qwen3_config}[kind].parameter_shapes(config),
                          stored, itemsize(dtype))
    if "fp8" not in name.lower() or kind == "vae":
        return builtin_params(kind, config) * itemsize(dtype)
    family = {"transformer": flux2_config, "text_encoder": qwen3_config}[kind]
    return sum(math.prod(shape) * (1 if _fp8_layer(kind, key, shape) else itemsize(dtype))
               for key, shape in family.parameter_shapes(config).items())


def header_refusal(folders: Files | None, folder: str, name: str) -> str | None:
    """Why the model file (or checkpoint folder) `name` in `folder` cannot be loaded, from its header alone: a
    quantisation vramgraph does not run (`QuantError`: the file, the layer and the format) or a GGUF file that is
    damaged or not ours (`GGUFError`: the file and what is wrong), else None. The loader
    nodes' VALIDATE_INPUTS ask this, so such a file is refused at validation, not when the prompt runs. A file that
    is absent (planning from the built-in specs) or unreadable, or no folders, leaves it to the loader (None).
    Nothing is kept between calls: a header is read again at each validation (a few milliseconds for a FLUX.2
    transformer's 149 tensors), so a file replaced under the same name is judged anew."""
    if folders is None:
        return None
    try:
        path = folders.resolve(folder, name)
    except (ImportError, OSError, ValueError):  # an absent or unreadable file; ComfyUI's folder_paths not there
        return None
    try:
        loading.inspect([path])
    except (QuantError, GGUFError) as e:  # GGUF: a damaged or foreign file is refused here too
        return str(e)
    except Exception:  # not a quantisation problem (damaged, not ours, ...): the loader reports it when it runs
        return None
    return None


@dataclass
class ModelCatalog:
    """Model infos by (kind, file) under `folders` (None: callers resolve files themselves and use `info_at`),
    cached by path and file identity (size, mtime, inode), and one tokenizer per tokenizer file."""

    folders: Folders | None = None
    dtype: str = "bf16"
    allow_builtin: bool = False  # plan without files: use the built-in klein specs by name
    _cache: dict = field(default_factory=dict, repr=False)
    _tokenizers: dict = field(default_factory=dict, repr=False)
    _lock: Any = field(default_factory=threading.RLock, repr=False)

    # -- infos
    def _info(self, kind: str, path: Path, spec: loading.ComponentSpec, tokenizer: Path | None, dtype: str,
              source: str) -> ModelInfo:
        info = ModelInfo(f"{kind}:{path}:{dtype}", kind, LABELS[kind], spec.nbytes(dtype), spec.config, spec, dtype,
                         source)
        self._cache[("tokenizer", info.key)] = tokenizer
        note = loading.gguf_tokenizer_note(spec, tokenizer) if kind == "text_encoder" else None
        if note:
            log.info("%s", note)
        return info

    def info_at(self, kind: str, path: Path, dtype: str | None = None, name: str | None = None) -> ModelInfo:
        """The info of the `kind` component in the file (or folder) at `path`."""
        dtype = dtype or self.dtype
        source = identity(path)
        stamp = (kind, str(path), source, dtype)
        with self._lock:
            if stamp not in self._cache:
                spec = loading.inspect([path])
                comp = getattr(spec, kind)
                if comp is None:
                    found = [k for k in KINDS if getattr(spec, k) is not None]
                    what = found[0].replace("_", " ") if found else "unknown model"
                    raise CheckpointError(f"{name or path.name} is a {what}, not a {kind.replace('_', ' ')}; "
                                          f"pick a file from {FOLDERS[kind]}/")
                self._cache[stamp] = self._info(kind, path, comp, spec.tokenizer, dtype, source)
            return self._cache[stamp]

    def model_info(self, kind: str, name: str, dtype: str = "default") -> ModelInfo:
        """What a loader of `kind` given the file `name` loads (a built-in spec if absent and `allow_builtin`)."""
        try:
            if self.folders is None:
                raise FileNotFoundError(f"'{name}': this catalogue has no folders to look in")
            path = self.folders.resolve(FOLDERS[kind], name)
        except FileNotFoundError:
            if not self.allow_builtin:
                raise
            config = builtin_config(kind, name)
            key = ("builtin", kind, name)
            with self._lock:
                if key not in self._cache:
                    self._cache[key] = builtin_bytes(kind, name, config, self.dtype)
                # one info per name, as a file's (info_at): the estimates are worked out once per info
                # (nodes/estimates.py `_per_model`), not again for every prompt planned
                info = ("builtin info", kind, name, self.dtype)
                if info not in self._cache:
                    self._cache[info] = ModelInfo(f"{kind}:{name}:{self.dtype}", kind, LABELS[kind], self._cache[key],
                                                  config, None, self.dtype)
                return self._cache[info]
        return self.info_at(kind, path, name=name)

    def checkpoint_infos_at(self, path: Path, dtype: str | None = None) -> tuple[ModelInfo, ModelInfo, ModelInfo]:
        """The three components of a whole model at `path` (HF folder, ComfyUI models folder, folder of files)."""
        dtype = dtype or self.dtype
        source = identity(path) if path.exists() else ""
        stamp = ("checkpoint", str(path), source, dtype)
        with self._lock:
            if stamp not in self._cache:
                spec = loading.inspect([path])
                self._cache[stamp] = tuple(self._info(k, path, spec.component(k), spec.tokenizer, dtype, source)
                                           for k in KINDS)
            return self._cache[stamp]

    def checkpoint_infos(self, name: str) -> tuple[ModelInfo, ModelInfo, ModelInfo]:
        """The three components of a whole model: a checkpoint folder listed under the folders (never another
        path)."""
        if self.folders is None:
            raise FileNotFoundError(f"'{name}': no models folders to find checkpoints in")
        return self.checkpoint_infos_at(self.folders.resolve("checkpoints", name))

    def tokenizer_for(self, info: ModelInfo) -> Path | None:
        """The tokenizer.json found beside a text encoder's checkpoint (None: the bundled one)."""
        with self._lock:
            return self._cache.get(("tokenizer", info.key))

    # -- tokenizers
    def tokenizer(self, path: Path | None) -> Any:
        """The PromptTokenizer of a tokenizer.json (None: the bundled one), made once."""
        with self._lock:
            if path not in self._tokenizers:
                from ..models.qwen3 import PromptTokenizer

                self._tokenizers[path] = PromptTokenizer.find(path)
            return self._tokenizers[path]

    # -- what estimates ask (nodes.types.EstimateEnv)
    def image_size(self, name: str) -> tuple[int, int]:
        from .images import open_image

        if self.folders is None:
            raise FileNotFoundError(f"'{name}': this catalogue has no input folder")
        path = self.folders.resolve("input", name)
        with open_image(path, self.folders.max_image_pixels, f"input image {name}") as im:
            return im.size

    @property
    def compute_dtype(self) -> str:
        return self.dtype
