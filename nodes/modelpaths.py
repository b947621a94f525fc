"""Where model files are looked for, the way ComfyUI looks: models roots, `extra_model_paths.yaml`, and what a
"not found" says.

- `models_root(path)`: what a user points `--models` at, made into a models folder: a ComfyUI root (its
  main.py and custom_nodes/, or a `models/` folder with model folders in it) gives its `models/`; a folder one
  level too deep (`…/models/diffusion_models`) gives its parent. Anything else is taken as given.
- `read_extra_model_paths(yaml)`: ComfyUI's `extra_model_paths.yaml` (utils/extra_config.py): top-level groups,
  each with an optional `base_path` (`~` and `$VARS` expanded, relative to the YAML's folder) and `is_default`
  (its folders are searched first, and `vramgraph fetch` downloads into them), then `folder_name: path` entries
  (several paths one per line, as a YAML `|` block). A path is joined to `base_path`, else to the YAML's folder.
  The legacy names `unet` and `clip` are ComfyUI's `diffusion_models` and `text_encoders`.
- `missing_file(folders, folder, name)`: the one line every "not found" says: the file, the folders searched,
  the closest name there (or the kind of folder it was found in instead), and how to get it.

PyYAML reads the YAML; ComfyUI requires it, so any ComfyUI install has it (elsewhere: the optional extra
`vramgraph[comfy-paths]`, or `pip install pyyaml`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KIND_FOLDERS = ("diffusion_models", "unet", "text_encoders", "clip", "vae", "checkpoints", "diffusers")
LEGACY = {"unet": "diffusion_models", "clip": "text_encoders"}  # ComfyUI's folder_paths.map_legacy
EXTRA_YAML = "extra_model_paths.yaml"


@dataclass(frozen=True)
class ExtraPath:
    """One folder of `extra_model_paths.yaml`: ComfyUI's folder name (legacy names mapped), where it is, whether
    its group was `is_default`, and the YAML it came from."""

    folder: str
    path: Path
    is_default: bool = False
    source: Path | None = None


def looks_like_models_folder(p: Path) -> bool:
    return p.is_dir() and any((p / n).is_dir() for n in KIND_FOLDERS)


def models_root(path: str | Path) -> Path:
    """`path` as a models folder: a ComfyUI root -> its `models/`; a `models/<kind>` folder -> `models/`."""
    p = Path(path).expanduser()
    if not looks_like_models_folder(p):
        if looks_like_models_folder(p / "models") or (is_comfy_root(p) and (p / "models").is_dir()):
            return p / "models"
        if p.name in KIND_FOLDERS and p.parent.is_dir():
            return p.parent
    return p


def file_or_name(folder: str, value: str | Path) -> tuple[str, ExtraPath | None]:
    """A model file given as a path or as a name in `folder`: (the name to load, the folder to search first for
    it, or None for a name). A path is anything with a folder part that exists, or that starts with ~, / or .;
    one that does not exist is refused naming it."""
    text = str(value)
    p = Path(text).expanduser()
    looks = text.startswith(("~", "/", ".")) or p.is_absolute()
    if p.is_file():
        return p.name, ExtraPath(folder, p.resolve().parent, True)
    if looks or (("/" in text or os.sep in text) and p.parent.is_dir()):
        raise ValueError(f"{text}: no such file (give a path to a .safetensors file, or a name in the models "
                         f"folder's {folder}/)")
    return text, None


def is_comfy_root(p: Path) -> bool:
    """A ComfyUI installation's folder: its main.py beside custom_nodes/ (a fresh one, with empty model folders)."""
    return (p / "main.py").is_file() and (p / "custom_nodes").is_dir()


def comfy_root_of(models: Path) -> Path | None:
    """The ComfyUI root a models folder belongs to when an `extra_model_paths.yaml` sits there (ComfyUI reads the
    one beside its main.py), else None."""
    for root in (models.parent, models):
        if (root / EXTRA_YAML).is_file():
            return root
    return None


def read_extra_model_paths(yaml_path: str | Path) -> tuple[ExtraPath, ...]:
    """The folders an `extra_model_paths.yaml` adds, by ComfyUI's rules; a ValueError naming the file otherwise."""
    path = Path(yaml_path).expanduser()
    try:
        import yaml
    except ImportError:
        raise ValueError(f"{path}: reading extra_model_paths.yaml needs PyYAML: pip install pyyaml "
                         "(ComfyUI installs it; or pip install 'vramgraph[comfy-paths]')") from None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if config is None:
        return ()
    if not isinstance(config, dict):
        raise ValueError(f"{path}: write groups of 'folder_name: path' entries, as ComfyUI's "
                         "extra_model_paths.yaml.example does")
    here = path.resolve().parent
    found: list[ExtraPath] = []
    for group, conf in config.items():
        if conf is None:
            continue
        if not isinstance(conf, dict):
            raise ValueError(f"{path}: group '{group}' must hold 'folder_name: path' entries")
        conf = dict(conf)
        base = conf.pop("base_path", None)
        if base is not None:
            base = Path(os.path.expandvars(os.path.expanduser(str(base))))
            base = base if base.is_absolute() else (here / base)
        is_default = bool(conf.pop("is_default", False))
        for folder, value in conf.items():
            if not isinstance(value, str):
                raise ValueError(f"{path}: {group}.{folder} must be a path (several: one per line in a '|' block)")
            for line in value.split("\n"):
                line = line.strip()
                if not line:
                    continue
                full = base / line if base is not None else (Path(line) if Path(line).is_absolute() else here / line)
                found.append(ExtraPath(LEGACY.get(str(folder), str(folder)), Path(os.path.normpath(full)),
                                       is_default, path))
    return tuple(found)


def extra_paths(configs: Iterable[str | Path], models: Iterable[Path]) -> tuple[ExtraPath, ...]:
    """The folders of every YAML given (`--extra-model-paths-config`), then of the `extra_model_paths.yaml` of
    every ComfyUI root among the models folders, each file read once."""
    files: list[Path] = [Path(c).expanduser() for c in configs]
    for c in files:
        if not c.is_file():
            raise ValueError(f"--extra-model-paths-config {c}: no such file")
    for m in models:
        root = comfy_root_of(m)
        if root is not None:
            files.append(root / EXTRA_YAML)
    seen: set[Path] = set()
    out: list[ExtraPath] = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            out += read_extra_model_paths(f)
    return tuple(out)


# ------------------------------------------------------------------------------------------ not found

def _close(name: str, names: Iterable[str]) -> str | None:
    """The name most like `name` (also by file name alone, for one in a subfolder), or None."""
    names = list(names)
    by_base = {n.rsplit("/", 1)[-1]: n for n in names}
    if name in by_base and by_base[name] != name:
        return by_base[name]
    got = difflib.get_close_matches(name, names, n=1, cutoff=0.6) or \
        difflib.get_close_matches(name.rsplit("/", 1)[-1], list(by_base), n=1, cutoff=0.6)
    return (by_base.get(got[0], got[0])) if got else None


def missing_file(folders: Any, folder: str, name: str) -> str:
    """Why `name` is not found in the model folder `folder` (ComfyUI's name) of `folders`, in one line: the
    folders searched, the closest name there (or the folder it is in instead), how to get it."""
    return f"'{name}' is not in {folder}/ ({_where(folders, folder, name)})"


def _where(folders: Any, folder: str, name: str) -> str:
    """The folders searched for `name`, the closest name there (or the folder it is in instead), how to get it."""
    from .sources import fetch_hint

    dirs = folders.model_dirs(folder)
    if dirs:
        where = "searched " + ", ".join(str(d) for d in dirs)
    elif folders.models:
        roots = ", ".join(str(m) for m in folders.models)
        missing = [str(m) for m in folders.models if not m.is_dir()]
        where = (f"the models folder {', '.join(missing)} does not exist" if missing else
                 f"no {folder}/ folder under {roots}")
    else:
        where = "no models folder given: --models DIR, $VRAMGRAPH_MODELS or \"models\" in vramgraph.json"
    close = _close(name, folders.list(folder))
    if close:
        where += f"; did you mean '{close}'?"
    else:
        for other in ("diffusion_models", "text_encoders", "vae"):
            if other != folder and name in folders.list(other):
                where += f"; it is in {other}/, which holds another kind of model: pick a {folder} file"
                break
    return f"{where}; {fetch_hint(name, folder)}"


def not_listed(folders: Any, cls: type, input_name: str, value: Any) -> str | None:
    """What a validation's "value not in list" adds for a model file input (the folders searched, the closest
    name, how to get it); None for any other input."""
    from .sources import file_inputs

    folder = file_inputs(cls).get(input_name)
    if folders is None or not isinstance(value, str) or folder in (None, "input", "checkpoints"):
        return None
    return _where(folders, folder, value)


def models_warning(folders: Any) -> str | None:
    """Why a server started on `folders` could not run a prompt, said at its start: no models folder, one that does
    not exist, or none holding a transformer (a diffusion_models/ or unet/ file, or a checkpoint folder); None when
    there is one."""
    if not folders.models and not folders.extra:
        return ("no models folder: give --models DIR (a ComfyUI models folder or ComfyUI's own folder); every prompt "
                "will be refused until then")
    missing = [str(m) for m in folders.models if not m.is_dir()]
    if missing:
        return f"the models folder {', '.join(missing)} does not exist; prompts that load models will be refused"
    if not folders.list("diffusion_models") and not folders.list("checkpoints"):
        roots = ", ".join(str(m) for m in folders.models) or "the extra model paths"
        return (f"no FLUX.2 [klein] transformer in {roots} (diffusion_models/, unet/ or a checkpoint folder); fetch "
                "one: vramgraph fetch --model flux-2-klein-4b.safetensors --models DIR")
    return None
