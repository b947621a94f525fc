"""Where a model file can be downloaded from: the URLs a workflow embeds, and a built-in list for the files the
shipped workflows and ComfyUI's six FLUX.2 [klein] templates load.

ComfyUI's templates carry each model's source in the UI workflow, per loader node, as
`properties.models = [{"name", "url", "directory", "hash"?, "hash_type"?}]` (the front end offers to download
what is missing from there). `workflow_sources` reads those (in subgraphs too); `needed_files` lists the model
files an API prompt loads (with the folder each is looked up in), found by asking each node's INPUT_TYPES.

The built-in URLs are the ones the official templates embed (comfyui-workflow-templates 0.1.123,
templates image_flux2_klein_*.json); the FLUX.2 [klein] 9B files are gated on the Hugging Face Hub (FLUX
Non-Commercial License): downloading them needs the license accepted on the model's page and a token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

HUB = "https://huggingface.co"
TOKEN_PAGE = "https://huggingface.co/settings/tokens"
NON_COMMERCIAL = "FLUX Non-Commercial License"


@dataclass(frozen=True)
class Source:
    """A downloadable model file: its name in `folder` (ComfyUI's folder name), its URL, and what is known of
    it: the SHA-256 and size, and the license a gated repository makes you accept first."""

    name: str
    folder: str
    url: str
    sha256: str | None = None
    size: int | None = None
    gated: str | None = None  # the license to accept on the repository's page; None: not gated

    @property
    def hub(self) -> HubFile | None:
        return hub_file(self.url)


@dataclass(frozen=True)
class HubFile:
    """A Hugging Face Hub URL taken apart: https://huggingface.co/REPO/resolve/REVISION/PATH."""

    repo: str
    revision: str
    path: str

    @property
    def page(self) -> str:
        return f"{HUB}/{self.repo}"


def hub_file(url: str) -> HubFile | None:
    """The repository, revision and path of a Hub `resolve` URL, else None (any other URL)."""
    for prefix in (HUB + "/", "https://hf.co/"):
        if url.startswith(prefix):
            parts = url[len(prefix):].split("?", 1)[0].split("/")
            if len(parts) >= 5 and parts[2] == "resolve":
                return HubFile(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
    return None


def _hub(repo: str, path: str) -> str:
    return f"{HUB}/{repo}/resolve/main/{path}"


BUILTIN: tuple[Source, ...] = (
    Source("flux-2-klein-4b.safetensors", "diffusion_models",
           _hub("Comfy-Org/flux2-klein", "split_files/diffusion_models/flux-2-klein-4b.safetensors")),
    Source("flux-2-klein-base-4b.safetensors", "diffusion_models",
           _hub("Comfy-Org/flux2-klein", "split_files/diffusion_models/flux-2-klein-base-4b.safetensors")),
    Source("qwen_3_4b.safetensors", "text_encoders",
           _hub("Comfy-Org/flux2-klein", "split_files/text_encoders/qwen_3_4b.safetensors")),
    # sizes of the next three: /work/shared/reference/checkpoint-formats.md (sections 1e and 4)
    Source("flux2-vae.safetensors", "vae", _hub("Comfy-Org/flux2-dev", "split_files/vae/flux2-vae.safetensors"),
           size=336_213_556),
    Source("flux-2-klein-4b-fp8.safetensors", "diffusion_models",
           _hub("black-forest-labs/FLUX.2-klein-4b-fp8", "flux-2-klein-4b-fp8.safetensors"), size=4_070_624_520),
    Source("full_encoder_small_decoder.safetensors", "vae",
           _hub("black-forest-labs/FLUX.2-small-decoder", "full_encoder_small_decoder.safetensors"),
           size=249_519_092),
    Source("flux-2-klein-base-4b-fp8.safetensors", "diffusion_models",
           _hub("black-forest-labs/FLUX.2-klein-base-4b-fp8", "flux-2-klein-base-4b-fp8.safetensors")),
    Source("qwen_3_8b_fp8mixed.safetensors", "text_encoders",
           _hub("Comfy-Org/flux2-klein-9B", "split_files/text_encoders/qwen_3_8b_fp8mixed.safetensors")),
    Source("flux-2-klein-9b-fp8.safetensors", "diffusion_models",
           _hub("black-forest-labs/FLUX.2-klein-9b-fp8", "flux-2-klein-9b-fp8.safetensors"), gated=NON_COMMERCIAL),
    Source("flux-2-klein-base-9b-fp8.safetensors", "diffusion_models",
           _hub("black-forest-labs/FLUX.2-klein-base-9b-fp8", "flux-2-klein-base-9b-fp8.safetensors"),
           gated=NON_COMMERCIAL),
    Source("flux-2-klein-9b-kv-fp8.safetensors", "diffusion_models",
           _hub("black-forest-labs/FLUX.2-klein-9b-kv-fp8", "flux-2-klein-9b-kv-fp8.safetensors"),
           gated=NON_COMMERCIAL),
)


def builtin(name: str) -> Source | None:
    """The built-in source of a file name (its last path part), or None."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return next((s for s in BUILTIN if s.name == base), None)


def fetch_hint(name: str, folder: str) -> str:
    """How to get a missing model file: the fetch command for a known one, else where to put it."""
    known = builtin(name)
    if known is not None:
        return f"download it with: vramgraph fetch --model {known.name} (from {known.url})"
    return f"put the file in a {folder}/ folder of the models folder, or fetch the workflow that names it with " \
           "`vramgraph fetch WORKFLOW` if it embeds the file's URL"


# ------------------------------------------------------------------------------------------ workflows

def _ui_nodes(ui: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    yield from (n for n in ui.get("nodes") or [] if isinstance(n, Mapping))
    for sub in (ui.get("definitions") or {}).get("subgraphs") or []:
        if isinstance(sub, Mapping):
            yield from (n for n in sub.get("nodes") or [] if isinstance(n, Mapping))


def workflow_sources(ui: Mapping[str, Any] | None) -> dict[str, Source]:
    """The sources a UI-format workflow embeds (`properties.models` of its nodes and subgraphs' nodes), by name;
    an entry without a name, URL or folder is skipped."""
    found: dict[str, Source] = {}
    for node in _ui_nodes(ui or {}):
        models = (node.get("properties") or {}).get("models") or []
        for m in models if isinstance(models, list) else []:
            if not (isinstance(m, Mapping) and all(isinstance(m.get(k), str) and m[k] for k in
                                                   ("name", "url", "directory"))):
                continue
            sha = m.get("hash") if str(m.get("hash_type", "")).lower() == "sha256" else None
            known = builtin(m["name"])
            found.setdefault(m["name"], Source(m["name"], m["directory"], m["url"], sha,
                                               known.size if known else None, known.gated if known else None))
    return found


class _Probe:
    """Folders whose every list is one marker naming the folder: INPUT_TYPES then shows which input is a file of
    which folder."""

    models: tuple = ()

    def list(self, folder: str) -> list[str]:
        return [f"\0{folder}"]


def file_inputs(cls: type) -> dict[str, str]:
    """The inputs of a node class that name a file, with the folder each is listed from (ComfyUI's name); only a
    class whose INPUT_TYPES takes `folders` lists files."""
    import inspect

    if "folders" not in inspect.signature(cls.INPUT_TYPES).parameters:
        return {}
    spec = cls.INPUT_TYPES(folders=_Probe())
    declared = {**spec.get("required", {}), **spec.get("optional", {})}
    # a file list may carry fixed values beside the files (VAELoader's "pixel_space", as in ComfyUI 0.29)
    marked = {name: [v for v in kind if str(v).startswith("\0")] for name, (kind, *_) in declared.items()
              if isinstance(kind, list)}
    return {name: found[0][1:] for name, found in marked.items() if len(found) == 1}


def needed_files(prompt: Mapping[str, Any], nodes: Mapping[str, type]) -> list[tuple[str, str]]:
    """The (folder, file name) of every model file the API-format `prompt` loads, in node order, once each
    (input images and whole-checkpoint folders are not model files)."""
    seen: dict[tuple[str, str], None] = {}
    for node in prompt.values():
        cls = nodes.get(node.get("class_type")) if isinstance(node, Mapping) else None
        if cls is None:
            continue
        files = file_inputs(cls)
        for name, value in (node.get("inputs") or {}).items():
            if name in files and isinstance(value, str) and files[name] not in ("input", "checkpoints"):
                seen.setdefault((files[name], value), None)
    return list(seen)
