"""Symbolic links in the models and input folders (common in ComfyUI set-ups, where one model store serves several
tools): linked files and linked folders are listed, validate, plan and run exactly as real files do, and a whole
checkpoint folder reached through links loads. Names still never leave the folders: '..' and absolute names are
refused even when they name a real model file; a link the user placed inside a folder is trusted wherever it leads.

The layout, with every model file stored once under store/ (a tiny random-weight models folder):

    models/diffusion_models/flux-2-klein-4b.safetensors -> store/diffusion_models/flux-2-klein-4b.safetensors
    models/text_encoders/qwen_3_4b.safetensors          -> store/text_encoders/qwen_3_4b.safetensors
    models/vae/linked/                                  -> store/vae/ (a linked folder)
    models/checkpoints/klein/                           -> a folder whose diffusion_models/ is a link
    input/ref.png                                       -> elsewhere/picture.png
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.plan import planner
from vramgraph.graph.workflow.validate import validate
from vramgraph.models.tiny import write_tiny_models
from vramgraph.nodes import ENGINE_NODES
from vramgraph.nodes.files import Folders

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
TR, TE, VAE = "flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(store: the real files, models: the linked models folder, input: the linked input folder)."""
    root = tmp_path_factory.mktemp("links")
    store = write_tiny_models(root / "store", names={"transformer": TR, "text_encoder": TE, "vae": VAE})
    models = root / "models"
    for folder, name in (("diffusion_models", TR), ("text_encoders", TE)):
        (models / folder).mkdir(parents=True)
        (models / folder / name).symlink_to(store / folder / name)
    (models / "vae").mkdir()
    (models / "vae" / "linked").symlink_to(store / "vae", target_is_directory=True)
    klein = models / "checkpoints" / "klein"
    klein.mkdir(parents=True)
    (klein / "diffusion_models").symlink_to(store / "diffusion_models", target_is_directory=True)
    for folder in ("text_encoders", "vae"):
        (klein / folder).mkdir()
        for f in (store / folder).iterdir():
            (klein / folder / f.name).symlink_to(f)
    (models / "vae" / "loop").symlink_to(models / "vae", target_is_directory=True)  # a link loop ends the walk
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    Image.fromarray(np.full((64, 64, 3), 128, dtype=np.uint8)).save(elsewhere / "picture.png")
    inp = root / "input"
    inp.mkdir()
    (inp / "ref.png").symlink_to(elsewhere / "picture.png")
    return store, models, inp


def folders(models: Path, inp: Path, out: Path) -> Folders:
    return Folders(models=(models,), input=inp, output=out / "output", temp=out / "temp")


def text_to_image(vae: str) -> dict:
    p = json.loads((WORKFLOWS / "text_to_image.json").read_text())
    p["5"]["inputs"].update(width=64, height=64)
    p["6"]["inputs"]["steps"] = 2
    p["3"]["inputs"]["file"] = vae
    return p


def from_checkpoint(name: str) -> dict:
    p = text_to_image(VAE)
    for n in ("1", "2", "3"):
        del p[n]
    p["10"] = {"class_type": "VGLoadCheckpoint", "inputs": {"checkpoint": name}}
    p["4"]["inputs"]["text_encoder"] = ["10", 1]
    p["6"]["inputs"]["model"] = ["10", 0]
    p["7"]["inputs"]["vae"] = ["10", 2]
    return p


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).copy()


def test_linked_files_and_folders_are_listed(layout: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, models, inp = layout
    f = folders(models, inp, tmp_path)
    assert f.list("diffusion_models") == [TR]
    assert f.list("text_encoders") == [TE]
    assert VAE not in f.list("vae") and f"linked/{VAE}" in f.list("vae")  # through the linked folder
    assert "klein" in f.list("checkpoints")
    assert f.list("input") == ["ref.png"]


def test_linked_models_validate_plan_and_run_as_the_real_files_do(layout: tuple[Path, Path, Path],
                                                                  tmp_path: Path) -> None:
    store, models, inp = layout
    real = Engine(folders(store, inp, tmp_path / "real"), device="cpu").run(text_to_image(VAE))

    linked = Engine(folders(models, inp, tmp_path / "linked"), device="cpu")
    prompt = text_to_image(f"linked/{VAE}")
    assert validate(prompt, ENGINE_NODES, linked.folders).ok
    prep = linked.prepare(prompt)
    assert {m.label for m in prep.plan.models.values()} == {"transformer", "text encoder", "vae"}
    assert sum(isinstance(s.step, planner.Load) for s in prep.plan.steps) == 3
    result = linked.run(prep)
    assert np.array_equal(pixels(result.images[0]), pixels(real.images[0]))

    ckpt = Engine(folders(models, inp, tmp_path / "ckpt"), device="cpu").run(from_checkpoint("klein"))
    assert np.array_equal(pixels(ckpt.images[0]), pixels(real.images[0]))


def test_linked_input_image_loads(layout: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, models, inp = layout
    f = folders(models, inp, tmp_path)
    assert f.resolve("input", "ref.png").read_bytes() == (inp / "ref.png").read_bytes()
    e = Engine(f, device="cpu")
    assert e.catalog.image_size("ref.png") == (64, 64)


@pytest.mark.parametrize("name", ["../../store/vae/flux2-vae.safetensors", "linked/../vae/flux2-vae.safetensors",
                                  "ABSOLUTE"])
def test_names_never_leave_the_folders(name: str, layout: tuple[Path, Path, Path], tmp_path: Path) -> None:
    store, models, inp = layout
    if name == "ABSOLUTE":
        name = str(store / "vae" / VAE)
    f = folders(models, inp, tmp_path)
    assert (models / "vae" / name).is_file()  # the operating system finds a real model file by that spelling
    with pytest.raises(FileNotFoundError, match="is not in vae"):
        f.resolve("vae", name)
    assert not validate(text_to_image(name), ENGINE_NODES, f).ok
