"""Where files live: models under ComfyUI's folder names, input images, outputs.

`Folders` is passed to `INPUT_TYPES(folders=...)` so file lists (COMBO inputs) show what is on disk,
and to running nodes so they resolve names. Inside ComfyUI, ComfyUI's own `folder_paths` is used.

Whole checkpoints (the `checkpoints` list) are folders, not files: an HF diffusers folder (with
`model_index.json`), a folder holding the three component files, or a ComfyUI-style folder of
`diffusion_models/`, `text_encoders/` and `vae/`; they are found under `checkpoints/` and `diffusers/`
of every models folder, and directly under any extra checkpoint root (`Folders.checkpoints`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import ClassVar, Protocol

from ..models.paths import walk_files
from .images import MAX_IMAGE_PIXELS
from .modelpaths import ExtraPath, missing_file

MODEL_FOLDERS = {  # ComfyUI's folder name -> the names it also answers to
    "diffusion_models": ("diffusion_models", "unet"),
    "text_encoders": ("text_encoders", "clip"),
    "vae": ("vae",),
}
MODEL_EXTENSIONS = (".safetensors", ".sft", ".gguf")  # GGUF: ComfyUI-GGUF's and llama.cpp's files (models/gguf.py)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
CHECKPOINT_FOLDERS = ("checkpoints", "diffusers")  # under a models folder, where whole checkpoints are looked for
HASH_BELOW = 64 << 20  # files smaller than this are known by their content (a hash), larger ones by identity


def identity(path: Path) -> str:
    """A file's identity as the file system tells it: size, mtime_ns and inode of what `path` points to (a folder:
    of every file under it). Any rewrite or replacement changes it; reading the file does not."""
    def one(st: os.stat_result) -> str:
        return f"{st.st_size}-{st.st_mtime_ns}-{st.st_ino}"

    if not path.is_dir():
        return one(path.stat())
    parts = sorted(f"{p.relative_to(path).as_posix()}:{one(p.stat())}" for p in path.rglob("*") if p.is_file())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def fingerprint(path: Path) -> str:
    """What a node reading `path` depends on (ComfyUI's IS_CHANGED value for it): a small file's content hash
    (as ComfyUI's LoadImage), a large file's or a folder's `identity` (hashing gigabytes per prompt is too slow)."""
    if path.is_file() and path.stat().st_size < HASH_BELOW:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return "sha256:" + h.hexdigest()
    return "stat:" + identity(path)


def is_checkpoint_dir(p: Path) -> bool:
    """An HF diffusers folder, a folder of (at least) the three component files, or a ComfyUI-style models folder."""
    try:
        if (p / "model_index.json").is_file():
            return True
        if all(any((p / n).is_dir() for n in names) for names in MODEL_FOLDERS.values()):
            return True
        return sum(1 for f in p.iterdir() if f.is_file() and f.suffix.lower() in MODEL_EXTENSIONS) >= 3
    except OSError:
        return False


def checkpoint_names(roots: list[Path]) -> list[str]:
    """The checkpoint folders under `roots` ('/'-separated names relative to their root; two levels deep)."""
    found: set[str] = set()
    for root in roots:
        if not root.is_dir():
            continue
        for child in sorted(root.iterdir()):
            if not child.is_dir():
                continue
            if is_checkpoint_dir(child):
                found.add(child.name)
            else:
                found.update(f"{child.name}/{g.name}" for g in child.iterdir() if g.is_dir() and is_checkpoint_dir(g))
    return sorted(found)


def find_checkpoint(roots: list[Path], name: str) -> Path:
    """The checkpoint folder `name` under one of `roots`; never outside them, never an arbitrary path."""
    if name in checkpoint_names(roots):  # the list is made by listing the roots, so no name leads outside them
        for root in roots:
            p = root / name
            if p.is_dir() and is_checkpoint_dir(p):
                return p
    where = ", ".join(str(r) for r in roots) or "no checkpoints/ or diffusers/ folder under the models folders"
    raise FileNotFoundError(f"'{name}' is not a checkpoint folder in {where}; put the model folder there "
                            "(or pass --checkpoint PATH on the command line)")


def safe_name(name: str) -> bool:
    """A file name that stays inside the folder it is looked up in, by its spelling alone: relative, no '..'.
    Symbolic links inside a models or input folder are the user's own and are followed wherever they lead
    (as ComfyUI does); only the name itself may never climb out."""
    if not name or "\0" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


@dataclass(frozen=True)
class Folders:
    models: tuple[Path, ...] = ()
    input: Path = field(default_factory=lambda: Path("input"))
    output: Path = field(default_factory=lambda: Path("output"))
    temp: Path = field(default_factory=lambda: Path("temp"))
    checkpoints: tuple[Path, ...] = ()  # extra roots whose subfolders are checkpoints (--checkpoint PATH's parent)
    extra: tuple[ExtraPath, ...] = ()  # extra_model_paths.yaml's folders (nodes/modelpaths.py)
    max_image_pixels: int = MAX_IMAGE_PIXELS  # images from outside larger than this are refused (nodes/images.py)
    loras: tuple[Path, ...] = ()  # extra folders of LoRA files (--lora PATH's folder)
    inside_comfyui: ClassVar[bool] = False  # nodes/files.py `Files`

    def model_dirs(self, folder: str) -> list[Path]:
        """The existing folders searched for `folder`, in ComfyUI's order: extra folders of an `is_default` group
        first, then those under the models folders, then the other extra folders."""
        names = CHECKPOINT_FOLDERS if folder == "checkpoints" else MODEL_FOLDERS.get(folder, (folder,))
        kinds = set(names) | {folder}
        first = [e.path for e in self.extra if e.is_default and e.folder in kinds]
        last = [e.path for e in self.extra if not e.is_default and e.folder in kinds]
        dirs = first + [root / n for root in self.models for n in names] + last
        if folder == "checkpoints":
            dirs += list(self.checkpoints)
        if folder == "loras":
            dirs += list(self.loras)
        return list(dict.fromkeys(d for d in dirs if d.is_dir()))

    def download_dir(self, folder: str) -> Path:
        """Where a downloaded file of `folder` goes: the first folder searched, else `folder` under the first models
        folder (created by the download); a ValueError when there is no models folder at all."""
        dirs = self.model_dirs(folder)
        if dirs:
            return dirs[0]
        if not self.models:
            raise ValueError("no models folder to download into: give --models DIR (a ComfyUI models folder)")
        return self.models[0] / folder

    def list(self, folder: str) -> list[str]:
        """File names (relative, with subfolders, '/'-separated) in a model folder or 'input'."""
        if folder == "checkpoints":
            return checkpoint_names(self.model_dirs(folder))
        if folder == "input":
            dirs, exts = [self.input], IMAGE_EXTENSIONS
        else:
            dirs, exts = self.model_dirs(folder), MODEL_EXTENSIONS
        found: set[str] = set()
        for d in dirs:
            if d.is_dir():
                found.update(walk_files(d, exts))
        return sorted(found)

    def resolve(self, folder: str, name: str) -> Path:
        """The file `name` in `folder` (a checkpoint folder for 'checkpoints'). The name never leads outside the
        folder ('..' and absolute names are refused, see `safe_name`); symbolic links inside it are followed."""
        if folder == "checkpoints":
            return find_checkpoint(self.model_dirs(folder), name)
        dirs = [self.input] if folder == "input" else self.model_dirs(folder)
        for d in dirs if safe_name(name) else []:
            p = d / name
            if p.is_file():
                return p.resolve()
        if folder == "input":
            raise FileNotFoundError(f"'{name}' is not in the input folder {self.input}; put the image there or "
                                    "give --input DIR")
        raise FileNotFoundError(missing_file(self, folder, name))


def comfy_list(folder: str) -> list[str]:
    """ComfyUI's file list when we run inside ComfyUI, else empty."""
    try:
        import folder_paths  # type: ignore[import-not-found]
    except ImportError:
        return []
    if folder == "input":
        d = folder_paths.get_input_directory()
        return sorted(p.name for p in Path(d).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
    if folder == "checkpoints":
        return checkpoint_names(comfy_checkpoint_roots())
    names = set(folder_paths.get_filename_list(folder))
    if folder in MODEL_FOLDERS and folder != "vae":  # GGUF files, which ComfyUI itself lists nowhere here
        for d in folder_paths.get_folder_paths(folder):
            if Path(d).is_dir():
                names.update(walk_files(Path(d), (".gguf",)))
    return sorted(names)


def comfy_checkpoint_roots() -> list[Path]:
    """ComfyUI's `diffusers` and `checkpoints` folders (where whole checkpoint folders may sit)."""
    import folder_paths  # type: ignore[import-not-found]

    roots = []
    for name in CHECKPOINT_FOLDERS:
        try:
            roots += [Path(p) for p in folder_paths.get_folder_paths(name)]
        except KeyError:  # a ComfyUI without that folder name
            continue
    return roots


class Files(Protocol):
    """Where a node's class methods (INPUT_TYPES, VALIDATE_INPUTS, IS_CHANGED) find files: our `Folders`, or inside
    ComfyUI nodes/comfy.py `ComfyFiles`, which the pack's classes pass explicitly (ComfyUI passes none)."""

    @property
    def inside_comfyui(self) -> bool: ...  # ComfyUI skips its list check for inputs VALIDATE_INPUTS names

    def list(self, folder: str) -> list[str]: ...

    def resolve(self, folder: str, name: str) -> Path: ...


def file_list(folders: Files | None, folder: str) -> list[str]:
    """What a file input offers: the files in `folder` (nothing without folders, e.g. INPUT_TYPES() for types)."""
    return folders.list(folder) if folders is not None else []
