"""`Context`: everything a running node may ask of whoever runs it, passed as the node's `vg` argument.

Two implementations: our engine's `NodeContext` (graph/engine/executor.py: the plan decides where models live) and
`ComfyContext` (nodes/comfy.py: ComfyUI's model management decides). graph/engine/conform.py returns each as this
protocol and `.ci/run` runs mypy over it, so a member added here and missing or typed otherwise there fails the type
check; tests/test_node_context.py checks that every `vg.<member>` the nodes use is declared here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ..models.qwen3 import PromptTokenizer
    from .files import Folders
    from .types import ModelInfo, Variant
    from .values import ModelHandle


class Context(Protocol):
    """What a running node may ask of its runner (the engine, or ComfyUI through nodes/comfy.py).

    How a new node uses it: declare `"hidden": HIDDEN` (nodes/core.py, `{"vg": "VG_CONTEXT"}`) in `INPUT_TYPES`,
    take a keyword-only `vg: Context` in its FUNCTION and ask it for everything outside its inputs: the torch module
    of a `ModelHandle` (`vg.module(handle)`, where the runner placed it), files (`vg.resolve`), progress and
    interruption (`vg.progress`, `vg.check_interrupted`). Never build a context: the engine passes its own, and
    inside ComfyUI the pack's node classes (nodes/comfy.py `comfy_nodes`) pass a `ComfyContext`.
    """

    # -- what the runner chose for this node
    @property
    def variant(self) -> str: ...  # the name of the plan's Variant for this node ("gpu" inside ComfyUI)

    @property
    def chosen(self) -> Variant | None: ...  # the plan's Variant itself (None: no plan, as inside ComfyUI)

    @property
    def seed(self) -> int | None: ...  # the seed of the run's sampler, for file metadata (None: not known)

    @property
    def device(self) -> torch.device: ...

    # -- models
    def module(self, handle: ModelHandle) -> torch.nn.Module: ...  # the model where the runner placed it

    def host_module(self, handle: ModelHandle) -> torch.nn.Module: ...  # its host-memory copy (to stream from)

    def host_weights(self, handle: ModelHandle) -> dict[str, torch.Tensor] | None: ...  # host copy by name, if read

    def lora_applied(self, handle: ModelHandle, done: Any) -> None: ...  # what applying its LoRAs did (models/lora.py
    #                                                                      Applied: bytes merged, restored), recorded

    def kept_blocks(self, handle: ModelHandle) -> Any: ...  # models/streaming.py Kept, or None: nothing kept

    def resident_blocks(self, handle: ModelHandle) -> tuple[int, ...]: ...  # blocks of a streamed model kept on GPU

    def tokenizer(self, handle: ModelHandle) -> PromptTokenizer: ...

    def tokenizer_for(self, info: ModelInfo) -> Path | None: ...

    def model_info(self, kind: str, name: str, dtype: str = "default") -> ModelInfo: ...

    def checkpoint_infos(self, name: str) -> tuple[ModelInfo, ModelInfo, ModelInfo]: ...

    # -- files
    @property
    def folders(self) -> Folders: ...  # the model, input, output and temp folders

    def resolve(self, folder: str, name: str) -> Path: ...  # a file in a models folder or input/

    @property
    def max_image_pixels(self) -> int: ...  # images read from files larger than this are refused (nodes/images.py)

    @property
    def output_dir(self) -> Path: ...

    @property
    def temp_dir(self) -> Path: ...

    # -- progress
    def progress(self, value: int, total: int) -> None: ...  # also raises when the run was interrupted

    def check_interrupted(self) -> None: ...

    @property
    def preview(self) -> Callable[[torch.Tensor, int, int], None] | None: ...  # step previews, if wanted


__all__ = ["Context"]
