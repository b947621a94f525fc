"""Settings to engine: the models/input/output folders, the budget and the device, from `Settings` (or any
object with the same attributes, such as the command line's arguments), the environment and a config file.

The config file is `config`, else $VRAMGRAPH_CONFIG, else ./vramgraph.json, else
~/.config/vramgraph/config.json; its keys are models, extra_model_paths, input, output, temp, vram and reserve
(another key is refused, naming the closest one).

The models folders are `models`, else $VRAMGRAPH_MODELS, else the config's "models", else ./models only if it
looks like a ComfyUI models folder (a `diffusion_models/`, `unet/`, `text_encoders/`, `clip/`, `vae/`,
`checkpoints/` or `diffusers/` inside), so that the source folder `models/` of this repository is never taken
for one. A ComfyUI root or a folder one level too deep is taken for its models folder, and ComfyUI's
`extra_model_paths.yaml` files are read: the ones given (`extra_model_paths`, the command line's
`--extra-model-paths-config`) and the one in the ComfyUI root of a models folder (nodes/modelpaths.py).
With none, `Folders.models` is empty and `no_models_hint` says what to do.

`prepare_demo(folder)` writes tiny random-weight models under the shipped workflows' file names and the
input images those workflows load, for a first run without any download.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_KEYS = ("models", "extra_model_paths", "input", "output", "temp", "vram", "reserve", "max_image_pixels",
               "front_end", "user_dir")
CONFIG_PLACES = (Path("vramgraph.json"), Path.home() / ".config" / "vramgraph" / "config.json")
MODEL_SUBFOLDERS = ("diffusion_models", "unet", "text_encoders", "clip", "vae", "checkpoints", "diffusers")
DEMO_FOLDER = Path("vramgraph-demo")
DEMO_IMAGES = {"reference.png": (96, 80), "reference_2.png": (80, 96)}  # what edit.json / multi_reference.json load


@dataclass(frozen=True)
class Settings:
    """Everything an engine is made from; None means the environment's, the config's or the built-in default."""

    models: Sequence[str | Path] | str | Path | None = None
    config: str | Path | None = None
    input: str | Path | None = None
    output: str | Path | None = None
    vram: str | int | None = None  # a card size with a unit ("12GiB") or bytes as an int
    reserve: str | int | None = None
    device: str | None = None  # "cuda", "cuda:1", "cpu"
    devices: str | None = None  # several: "cuda:0,cuda:1" or "all" (graph/engine/devices.py); --vram then per device
    dtype: str | None = None  # "bf16" or "fp32"
    host: str | int | None = None  # host RAM budget
    profile: str | None = None  # cost profile name (graph/engine/costs.py); None: probe the GPU
    checkpoints: Sequence[str | Path] = ()  # extra roots whose subfolders are checkpoints
    extra_model_paths: Sequence[str | Path] = ()  # ComfyUI extra_model_paths.yaml files (nodes/modelpaths.py)
    extra_folders: Sequence[Any] = ()  # more model folders (nodes.modelpaths.ExtraPath), e.g. of a file given by path
    loras: Sequence[str | Path] = ()  # extra folders of LoRA files

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def settings_of(obj: Any) -> Settings:
    """`obj` as Settings: itself, or the attributes of the same names of any object (argparse's Namespace), but
    `host`, which is an address to `serve` (a host RAM budget is only ever given as Settings)."""
    if isinstance(obj, Settings):
        return obj
    many = ("checkpoints", "extra_model_paths", "extra_folders", "loras")
    return Settings(**{f.name: getattr(obj, f.name, None) if f.name not in many else
                       tuple(getattr(obj, f.name, None) or ()) for f in dataclasses.fields(Settings)
                       if f.name != "host"})


def read_config(s: Settings) -> dict:
    places = [Path(s.config)] if s.config else list(CONFIG_PLACES)
    if os.environ.get("VRAMGRAPH_CONFIG") and not s.config:
        places.insert(0, Path(os.environ["VRAMGRAPH_CONFIG"]))
    for p in places:
        if p.is_file():
            try:
                config = json.loads(p.read_text())
            except ValueError as e:
                raise ValueError(f"config {p}: not valid JSON ({e})") from e
            return _checked_config(p, config)
        if s.config:
            raise ValueError(f"config {p}: no such file")
    return {}


def _checked_config(path: Path, config: Any) -> dict:
    """The config file's object, its keys known ones: a typo is refused with the closest key."""
    import difflib

    if not isinstance(config, dict):
        raise ValueError(f"config {path}: write a JSON object of {', '.join(CONFIG_KEYS)}")
    for key in config:
        if key not in CONFIG_KEYS:
            close = difflib.get_close_matches(str(key), CONFIG_KEYS, n=1)
            raise ValueError(f"config {path}: unknown key '{key}'" + (f"; did you mean '{close[0]}'?" if close else
                                                                      f"; the keys are {', '.join(CONFIG_KEYS)}"))
    return config


def looks_like_models_folder(p: Path) -> bool:
    return p.is_dir() and any((p / n).is_dir() for n in MODEL_SUBFOLDERS)


def models_folders(settings: Any) -> tuple[Path, ...]:
    """The models folders given (a ComfyUI root or a `models/<kind>` folder taken for its models folder), or
    ./models when it looks like one."""
    from ...nodes.modelpaths import models_root

    s = settings_of(settings)
    given = s.models or (os.environ.get("VRAMGRAPH_MODELS") or None) or read_config(s).get("models")
    if not given:
        return (Path("models"),) if looks_like_models_folder(Path("models")) else ()
    given = [given] if isinstance(given, str | Path) else list(given)
    return tuple(dict.fromkeys(models_root(m) for m in given))


def no_models_hint(folders: Any) -> str | None:
    """A line saying that no models folder was given or found, or None when there is one."""
    if folders.models:
        missing = [str(m) for m in folders.models if not m.is_dir()]
        return f"models folder {', '.join(missing)} does not exist" if missing else None
    return ("no models folder: give --models DIR (a ComfyUI models folder), set $VRAMGRAPH_MODELS or \"models\" in "
            "vramgraph.json, or try --demo for tiny random-weight models")


def folders_from(settings: Any) -> Any:
    from ...nodes.files import Folders

    s = settings_of(settings)
    cfg = read_config(s)
    from ...nodes.modelpaths import extra_paths

    output = Path(s.output or cfg.get("output", "output")).expanduser()
    models = models_folders(s)
    yamls = list(s.extra_model_paths) or list(_listed(cfg.get("extra_model_paths")))
    return Folders(models=models, input=Path(s.input or cfg.get("input", "input")).expanduser(),
                   output=output, temp=Path(cfg.get("temp", output / "temp")).expanduser(),
                   checkpoints=tuple(Path(c).expanduser() for c in s.checkpoints),
                   extra=tuple(s.extra_folders) + extra_paths(yamls, models), max_image_pixels=image_cap(cfg),
                   loras=tuple(Path(c).expanduser() for c in s.loras))


def _listed(value: Any) -> list:
    return [] if value is None else [value] if isinstance(value, str | Path) else list(value)


def image_cap(cfg: dict) -> int:
    """The config's "max_image_pixels" (nodes/images.py), checked; the default when it is not set."""
    from ...nodes.images import MAX_IMAGE_PIXELS

    cap = cfg.get("max_image_pixels", MAX_IMAGE_PIXELS)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"config: \"max_image_pixels\" {cap!r} must be a whole number of pixels, e.g. 33554432")
    return cap


def parse_device(text: str | None) -> Any:
    """`text` as a torch device that exists here; a ValueError in one line otherwise."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {text}: not a device; write cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text}: only cpu and cuda devices are supported")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {text}: no CUDA device here; use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {text}: there are {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return device


def engine_from(settings: Any, allow_builtin: bool = False, host: str | None = None) -> Any:
    """An Engine from settings (Settings or an object with its attributes): folders, device, dtype, budget."""
    from .budget import budget_for
    from .executor import Engine

    s = settings_of(settings)
    cfg = read_config(s)
    if s.dtype not in (None, "bf16", "fp32"):
        raise ValueError(f"--dtype {s.dtype}: write bf16 or fp32")
    from .costs import cost_for, profile

    if s.profile:
        profile(s.profile)  # a wrong name is refused before anything is measured
    if s.devices:
        return _devices_from(s, cfg, allow_builtin, host)
    device = parse_device(s.device)
    budget = budget_for(device, s.vram or cfg.get("vram"), s.reserve or cfg.get("reserve"), host or s.host)
    return Engine(folders_from(s), device=str(device), dtype=s.dtype, budget=budget, allow_builtin=allow_builtin,
                  cost=cost_for(device, s.profile))


def _devices_from(s: Settings, cfg: dict, allow_builtin: bool, host: str | None) -> Any:
    """--devices: one engine per device (graph/engine/devices.py), each with its own budget (--vram one size or one per
    device) and an equal part of the host RAM budget; a device that cannot be opened is left out with a warning."""
    import torch

    from ..plan.placement import parse_devices, split_sizes
    from .budget import budget_for, host_available, parse_size
    from .costs import cost_for
    from .devices import devices_from
    from .executor import Engine

    if s.device is not None:
        raise ValueError("--device and --devices: give one of them")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = parse_devices(s.devices, visible if s.devices == "all" else None)  # a missing one: left out below
    sizes = split_sizes(s.vram or cfg.get("vram"), len(names))
    given = host or s.host
    share = (parse_size(given) if given is not None else host_available()) // len(names)
    folders = folders_from(s)

    def make(name: str, vram: str | None) -> Engine:
        budget = budget_for(parse_device(name), vram, s.reserve or cfg.get("reserve"), share)
        return Engine(folders, device=name, dtype=s.dtype, budget=budget, allow_builtin=allow_builtin,
                      cost=cost_for(parse_device(name), s.profile))

    return devices_from(names, make, sizes)


def prepare_demo(folder: str | Path = DEMO_FOLDER) -> tuple[Path, Path]:
    """Tiny random-weight models under the shipped workflows' file names in `folder/models`, and the input images
    the shipped edit workflows load in `folder/input`, each written once; returns (models, input)."""
    from ...models.tiny import SHIPPED_NAMES, write_tiny_models

    folder = Path(folder)
    models, inputs = folder / "models", folder / "input"
    names = [n for v in SHIPPED_NAMES.values() for n in ([v] if isinstance(v, str) else v)]
    if not all(any((models / d / n).is_file() for d in ("diffusion_models", "text_encoders", "vae")) for n in names):
        write_tiny_models(models, names=SHIPPED_NAMES)
    inputs.mkdir(parents=True, exist_ok=True)
    for i, (name, size) in enumerate(DEMO_IMAGES.items()):
        if not (inputs / name).is_file():
            demo_image(size, i).save(inputs / name)
    return models, inputs


def demo_image(size: tuple[int, int], variant: int = 0) -> Any:
    """A small picture with some structure (gradients and a disc), as a PIL image."""
    import numpy as np
    from PIL import Image

    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    disc = ((x - w * (0.35 + 0.3 * variant)) ** 2 + (y - h / 2) ** 2) < (min(w, h) / 4) ** 2
    rgb = np.stack([x / w, y / h, 1 - x / w], axis=-1) * 200 + 30
    rgb[disc] = (230, 60 + 120 * variant, 40)
    return Image.fromarray(rgb.clip(0, 255).astype(np.uint8))
