"""Where files live: models under ComfyUI's folder names, input images, outputs.

`Folders` is passed to `INPUT_TYPES(folders=...)` so file lists (COMBO inputs) show what is on disk,
and to running nodes so they resolve names. Inside ComfyUI, ComfyUI's own `folder_paths` is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MODEL_FOLDERS = {  # ComfyUI's folder name -> the names it also answers to
    "diffusion_models": ("diffusion_models", "unet"),
    "text_encoders": ("text_encoders", "clip"),
    "vae": ("vae",),
}
MODEL_EXTENSIONS = (".safetensors", ".sft")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass(frozen=True)
class Folders:
    models: tuple[Path, ...] = ()
    input: Path = field(default_factory=lambda: Path("input"))
    output: Path = field(default_factory=lambda: Path("output"))
    temp: Path = field(default_factory=lambda: Path("temp"))

    def model_dirs(self, folder: str) -> list[Path]:
        names = MODEL_FOLDERS.get(folder, (folder,))
        return [root / n for root in self.models for n in names if (root / n).is_dir()]

    def list(self, folder: str) -> list[str]:
        """File names (relative, with subfolders, '/'-separated) in a model folder or 'input'."""
        if folder == "input":
            dirs, exts = [self.input], IMAGE_EXTENSIONS
        else:
            dirs, exts = self.model_dirs(folder), MODEL_EXTENSIONS
        found: set[str] = set()
        for d in dirs:
            if d.is_dir():
                found.update(p.relative_to(d).as_posix() for p in d.rglob("*")
                             if p.suffix.lower() in exts and p.is_file())
        return sorted(found)

    def resolve(self, folder: str, name: str) -> Path:
        """The file `name` in `folder`; never outside it."""
        dirs = [self.input] if folder == "input" else self.model_dirs(folder)
        for d in dirs:
            p = (d / name).resolve()
            if p.is_relative_to(d.resolve()) and p.is_file():
                return p
        where = ", ".join(str(d) for d in dirs) or f"no '{folder}' folder under {list(map(str, self.models))}"
        raise FileNotFoundError(f"'{name}' is not in {folder} ({where}); put the file there or set --models")


def comfy_list(folder: str) -> list[str]:
    """ComfyUI's file list when we run inside ComfyUI, else empty."""
    try:
        import folder_paths  # type: ignore[import-not-found]
    except ImportError:
        return []
    if folder == "input":
        d = folder_paths.get_input_directory()
        return sorted(p.name for p in Path(d).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
    return list(folder_paths.get_filename_list(folder))


def file_list(folders: Folders | None, folder: str) -> list[str]:
    return folders.list(folder) if folders is not None else comfy_list(folder)
