"""Our nodes inside ComfyUI: the `vg` context built from ComfyUI's own services.

ComfyUI passes no VG_CONTEXT hidden input (it does not know the type), so the classes registered with ComfyUI
are `comfy_nodes(VG_NODES, runtime())`: each FUNCTION gets `vg=` a `ComfyContext` (nodes/context.py
`Context`) on that runtime, passed in explicitly, backed by ComfyUI's
`folder_paths` (files), `comfy.model_management` (device, memory, interruption) and
`comfy.utils.ProgressBar` (the progress bar of the running node). Nothing here is imported by ComfyUI
unless one of our nodes runs there, and nothing imports ComfyUI until then.

Memory policy (cooperate with ComfyUI's model management instead of fighting it):
- A model is read from its file into host RAM once and kept in a small per-process cache (the process
  is ComfyUI's, which gives no other owner): at most `KEEP` models, least recently used dropped first.
  The cache holds CPU weights only.
- Before a node uses a model, the context asks ComfyUI to free the model's bytes plus ComfyUI's minimum
  inference memory on its device (`model_management.free_memory`, as ComfyUI's own loader does), which
  unloads ComfyUI's own models as needed; only then does the model move to the GPU.
- When the node returns, every model it moved goes back to the CPU and `soft_empty_cache()` hands the
  cached blocks back, so between nodes our nodes hold no GPU memory and ComfyUI can use all of it.
  The release happens when the context is released: `release()`, `with`, or when it is dropped at the
  node function's return (a finalizer; in CPython immediately). A context left alive by an exception's
  traceback is released when the next one is made.
The price: a model used by two nodes moves to the GPU twice, as ComfyUI's own models may. Our planner's
residency decisions are not used inside ComfyUI, where ComfyUI owns the GPU. The decode runs whole
("gpu"); ComfyUI's free_memory has made room for it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..models import loading
from .catalog import FOLDERS, ModelCatalog
from .files import Folders, comfy_list, safe_name
from .types import ModelInfo, Variant
from .values import ModelHandle

if TYPE_CHECKING:
    import torch

    from ..models.qwen3 import PromptTokenizer

log = logging.getLogger("vramgraph.comfy")
KEEP = 3  # models kept in host RAM between nodes (the three parts of FLUX.2 [klein])
GiB = 1 << 30


def _mm() -> Any:
    import comfy.model_management as mm  # type: ignore[import-not-found]

    return mm


def _folder_paths() -> Any:
    import folder_paths  # type: ignore[import-not-found]

    return folder_paths


def comfy_folders() -> Folders:
    """Our `Folders` from ComfyUI's folder_paths (model roots are the parents of its model folders)."""
    fp = _folder_paths()
    roots: list[Path] = []
    for folder in FOLDERS.values():
        for p in fp.get_folder_paths(folder):
            parent = Path(p).parent
            if parent not in roots:
                roots.append(parent)
    return Folders(models=tuple(roots), input=Path(fp.get_input_directory()), output=Path(fp.get_output_directory()),
                   temp=Path(fp.get_temp_directory()))


class ComfyRuntime:
    """Per-process state of our nodes inside ComfyUI: the model catalogue (infos and tokenizers, the same
    `ModelCatalog` our engine uses) and the CPU modules (an LRU of KEEP)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.lock = threading.RLock()
        self.catalog = ModelCatalog()  # files are found through ComfyUI's folder_paths, then `info_at`
        self.modules: OrderedDict[str, torch.nn.Module] = OrderedDict()
        self.on_device: list[torch.nn.Module] = []  # moved to the GPU by the context of the running node

    def module(self, info: ModelInfo) -> torch.nn.Module:
        """The model's module with its weights in host RAM (read from the file on first use)."""
        with self.lock:
            if info.key in self.modules:
                self.modules.move_to_end(info.key)
                return self.modules[info.key]
            log.info("vramgraph: reading %s (%.2f GiB) into RAM", info.label, info.nbytes / GiB)
            module = loading.load(info.spec, dtype=info.dtype, device="cpu").requires_grad_(False).eval()
            self.modules[info.key] = module
            while len(self.modules) > self.keep:
                self.modules.popitem(last=False)
            return module

    def release(self, modules: list[torch.nn.Module] | None = None) -> None:
        """Move modules a node put on the GPU back to the CPU and give the cached blocks back to ComfyUI."""
        with self.lock:
            moved = self.on_device if modules is None else modules
            if not moved:
                return
            for m in moved:
                m.to("cpu")
            moved.clear()
            _mm().soft_empty_cache()


@cache
def runtime() -> ComfyRuntime:
    """The one runtime of this ComfyUI process."""
    return ComfyRuntime()


def _dtype(device: torch.device) -> str:
    import torch

    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


class ComfyContext:
    """What our nodes ask of `vg`, answered by ComfyUI (see the module docstring for the memory policy)."""

    variant = "gpu"
    chosen: Variant | None = None  # ComfyUI has no plan

    def __init__(self, rt: ComfyRuntime, name: str) -> None:
        self.rt = rt
        self.rt.release()  # a previous node's models, if its context outlived it
        self.name = name  # the node's class
        self.device = _mm().get_torch_device()
        self.dtype = _dtype(self.device)
        self.seed: int | None = None  # ComfyUI tells nodes nothing of their ancestors
        self._moved: list[torch.nn.Module] = []
        self._bar: Any = None
        self._finalizer = weakref.finalize(self, self.rt.release, self._moved)

    # -- models
    def module(self, handle: ModelHandle) -> torch.nn.Module:
        """The model on ComfyUI's device, after asking ComfyUI to make room for it and the node's work."""
        module = self.rt.module(handle.info)
        mm = _mm()
        room = getattr(mm, "minimum_inference_memory", lambda: GiB)()
        mm.free_memory(handle.info.nbytes + room, self.device)  # ComfyUI unloads its own models as needed
        module.to(self.device)
        with self.rt.lock:
            if not any(m is module for m in self._moved):
                self._moved.append(module)
            self.rt.on_device = self._moved
        return module

    def host_module(self, handle: ModelHandle) -> torch.nn.Module:
        """The model's weights in host RAM (the runtime's cache; nothing streams inside ComfyUI, whose variant is
        always "gpu", so this is only asked for by a node that computes on the CPU)."""
        return self.rt.module(handle.info)

    def host_weights(self, handle: ModelHandle) -> dict[str, torch.Tensor] | None:
        return None  # LoRAs are applied on the fly inside ComfyUI: no merge to undo

    def lora_applied(self, handle: ModelHandle, done: Any) -> None:
        pass  # on the fly, nothing merged: nothing for ComfyUI to record

    def kept_blocks(self, handle: ModelHandle) -> None:
        return None  # nothing stays on the GPU between nodes here

    def resident_blocks(self, handle: ModelHandle) -> tuple[int, ...]:
        return ()

    def tokenizer(self, handle: ModelHandle) -> PromptTokenizer:
        return self.rt.catalog.tokenizer(handle.tokenizer)

    def model_info(self, kind: str, name: str, dtype: str = "default") -> ModelInfo:
        return self.rt.catalog.info_at(kind, self.resolve(FOLDERS[kind], name), self.dtype, name)

    def checkpoint_infos(self, name: str) -> tuple[ModelInfo, ModelInfo, ModelInfo]:
        from .files import comfy_checkpoint_roots, find_checkpoint

        p = find_checkpoint(comfy_checkpoint_roots(), name)  # only folders listed under ComfyUI's model folders
        return self.rt.catalog.checkpoint_infos_at(p, self.dtype)

    def tokenizer_for(self, info: ModelInfo) -> Path | None:
        return self.rt.catalog.tokenizer_for(info)

    # -- files
    @property
    def folders(self) -> Folders:
        return comfy_folders()

    def resolve(self, folder: str, name: str) -> Path:
        fp = _folder_paths()
        if folder == "input":
            path = Path(fp.get_input_directory()) / name
            if safe_name(name) and path.is_file():  # links in the input folder are followed (files.safe_name)
                return path.resolve()
        else:
            found = fp.get_full_path(folder, name)
            if found is not None and Path(found).is_file():
                return Path(found)
        raise FileNotFoundError(f"'{name}' is not in ComfyUI's {folder} folder; put the file there")

    @property
    def max_image_pixels(self) -> int:
        from .images import MAX_IMAGE_PIXELS

        return MAX_IMAGE_PIXELS

    @property
    def output_dir(self) -> Path:
        return Path(_folder_paths().get_output_directory())

    @property
    def temp_dir(self) -> Path:
        return Path(_folder_paths().get_temp_directory())

    # -- progress
    def progress(self, value: int, total: int) -> None:
        self.check_interrupted()
        if self._bar is None:
            import comfy.utils  # type: ignore[import-not-found]

            self._bar = comfy.utils.ProgressBar(total)
        self._bar.update_absolute(value, total)

    def check_interrupted(self) -> None:
        _mm().throw_exception_if_processing_interrupted()

    @property
    def preview(self) -> Callable[[torch.Tensor, int, int], None] | None:
        return None  # ComfyUI draws its own step previews


    # -- lifetime
    def release(self) -> None:
        """Give the GPU back now (also done when the context is dropped)."""
        self._finalizer()

    def __enter__(self) -> ComfyContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ComfyFiles:
    """Files as ComfyUI's folder_paths show them (nodes/files.py `Files`): what the pack's classes pass as `folders`
    to INPUT_TYPES, VALIDATE_INPUTS and IS_CHANGED, which ComfyUI calls without one."""

    inside_comfyui = True

    def list(self, folder: str) -> list[str]:
        return comfy_list(folder)

    def resolve(self, folder: str, name: str) -> Path:
        return comfy_folders().resolve(folder, name)


def _with_files(base: type, name: str, files: ComfyFiles) -> classmethod | None:
    """`base`'s class method `name` with `folders=files` given, its signature (which ComfyUI reads to choose the
    inputs it passes VALIDATE_INPUTS) without `folders`; None where it takes no `folders`."""
    method = getattr(base, name, None)
    if method is None or "folders" not in inspect.signature(method).parameters:
        return None
    fn = method.__func__

    def call(cls: type, *args: Any, **kwargs: Any) -> Any:
        return fn(cls, *args, folders=files, **kwargs)

    sig = inspect.signature(fn)
    kept = [p for p in sig.parameters.values() if p.name != "folders"]
    call.__signature__ = sig.replace(parameters=kept)  # type: ignore[attr-defined]
    call.__name__ = call.__qualname__ = name
    return classmethod(call)


def comfy_node(base: type, rt: ComfyRuntime, files: ComfyFiles | None = None) -> type:
    """`base` as ComfyUI runs it, the ComfyUI runtime passed in explicitly: its FUNCTION gets `vg=` a `ComfyContext`
    on `rt`, released (models back to the CPU) when the node returns or raises, and its class methods get
    `folders=` ComfyUI's files. A node that takes neither is `base` itself."""
    files = files or ComfyFiles()
    extra: dict[str, Any] = {}
    run = getattr(base, base.FUNCTION)
    if "vg" in inspect.signature(run).parameters:

        @functools.wraps(run)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with ComfyContext(rt, type(self).__name__) as vg:
                return run(self, *args, vg=vg, **kwargs)

        extra[base.FUNCTION] = call
    for name in ("INPUT_TYPES", "VALIDATE_INPUTS", "IS_CHANGED"):
        method = _with_files(base, name, files)
        if method is not None:
            extra[name] = method
    if not extra:
        return base
    return type(base.__name__, (base,), {**extra, "__module__": base.__module__, "__qualname__": base.__qualname__,
                                         "__doc__": base.__doc__})


def comfy_nodes(classes: Mapping[str, type], rt: ComfyRuntime) -> dict[str, type]:
    """The node classes registered in ComfyUI (NODE_CLASS_MAPPINGS), each bound to the process's runtime `rt`."""
    return {name: comfy_node(cls, rt) for name, cls in classes.items()}


__all__ = ["KEEP", "ComfyContext", "ComfyRuntime", "comfy_folders", "comfy_node", "comfy_nodes", "runtime"]
