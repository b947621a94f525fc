"""Our /object_info for ComfyUI's core node types is ComfyUI v0.29.0's: categories, display names, input names and
order, combo values, outputs, tooltips (tests/data/comfyui-0.29-object_info.json, read from ComfyUI's sources at the
commit "ComfyUI v0.29.0"); a listed value we do not run is refused at validation, naming the input and what we run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_engine import core_text_to_image
from vramgraph.graph.engine.executor import Engine
from vramgraph.graph.workflow.validate import validate
from vramgraph.nodes import CORE_NODES, ENGINE_NODES, gguf
from vramgraph.nodes.core import SAMPLERS
from vramgraph.nodes.files import Folders
from vramgraph.server.formats import object_info

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "comfyui-0.29-object_info.json").read_text())["nodes"]


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("meta")
    return object_info(ENGINE_NODES, Folders(models=(root / "models",), input=root / "input"))


@pytest.fixture
def folders(tiny_models: Path, input_dir: Path, tmp_path: Path) -> Folders:
    return Folders(models=(tiny_models,), input=input_dir, output=tmp_path / "output", temp=tmp_path / "temp")


def test_every_core_type_is_in_the_snapshot(ours: dict):
    """Each ComfyUI core type we run is compared; the GGUF pack's loaders are as ComfyUI-GGUF lists them."""
    assert set(CORE_NODES) - set(gguf.NODES) == set(SNAPSHOT)
    assert {ours[n]["display_name"] for n in gguf.NODES} == {"Unet Loader (GGUF)", "Unet Loader (GGUF/Advanced)",
                                                            "CLIPLoader (GGUF)"}
    assert {ours[n]["category"] for n in gguf.NODES} == {"bootleg"}
    assert ours["CLIPLoaderGGUF"]["input"]["required"]["type"][0] == SNAPSHOT["CLIPLoader"]["combos"]["type"]


@pytest.mark.parametrize("name", sorted(SNAPSHOT))
def test_object_info_is_comfyuis(ours: dict, name: str):
    want, got = SNAPSHOT[name], ours[name]
    assert got["category"] == want["category"]
    assert got["display_name"] == (want["display_name"] or name)
    assert got["input_order"].get("required", []) == want["required"]
    assert got["input_order"].get("optional", []) == want["optional"]
    inputs = {**got["input"].get("required", {}), **got["input"].get("optional", {})}
    for x, values in want["combos"].items():
        assert inputs[x][0] == values, x
    assert got["output"] == want["output"] and got["output_name"] == want["output_name"]
    assert got["output_node"] is want["output_node"]
    for x in inputs:  # ComfyUI's tooltip where it has one, none where it has none
        assert (inputs[x][1] if len(inputs[x]) > 1 else {}).get("tooltip") == want["tooltips"].get(x), x
    assert got.get("output_tooltips") == want["output_tooltips"]
    assert got.get("experimental", False) is want.get("experimental", False)


# (node id in the core graph, input, a value ComfyUI lists that we do not run, what the message says); a `type` that
# names another model family ("sd3", "wan", ...) is refused before this, for the whole workflow (test_families.py)
REFUSED = [
    ("7", "sampler_name", "uni_pc", "sampler_name 'uni_pc' is not run by vramgraph"),
    ("2", "type", "stable_diffusion", "type 'stable_diffusion' is not run by vramgraph (it runs FLUX.2 [klein]'s "
                                      "Qwen3 text encoder only); set type to flux2"),
    ("3", "vae_name", "pixel_space", "'pixel_space' (ComfyUI's VAE for pixel-space models) is not run"),
    ("1", "weight_dtype", "fp8_e5m2", "weight_dtype 'fp8_e5m2': casting"),
]


@pytest.mark.parametrize(("node", "x", "value", "says"), REFUSED)
def test_listed_values_we_do_not_run_are_refused_at_validation(folders: Folders, node: str, x: str, value: str,
                                                              says: str):
    g = core_text_to_image(None, 1, 1)
    g[node]["inputs"][x] = value
    v = validate(g, ENGINE_NODES, folders)
    assert not v.ok
    (err,) = v.node_errors[node]["errors"]
    assert err["type"] == "custom_validation_failed" and err["extra_info"]["input_name"] == x
    assert err["details"].startswith(f"{x} - ") and says in err["details"]
    g[node]["inputs"][x] = value + "_unknown"  # a value nobody lists is not in the list, as in ComfyUI
    (err,) = validate(g, ENGINE_NODES, folders).node_errors[node]["errors"]
    assert err["type"] == "value_not_in_list"


def test_ksampler_and_gguf_clip_loader_refuse_the_same(folders: Folders):
    g = core_text_to_image(None, 1, 1)
    g["20"] = {"class_type": "KSampler", "inputs": {
        "model": ["1", 0], "seed": 0, "steps": 1, "cfg": 1.0, "sampler_name": "ddim", "scheduler": "simple",
        "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["10", 0], "denoise": 1.0}}
    g["12"]["inputs"]["samples"] = ["20", 0]
    g["2"]["class_type"] = "CLIPLoaderGGUF"
    g["2"]["inputs"] = {"clip_name": "qwen_3_4b.safetensors", "type": "joyimage"}
    errors = validate(g, ENGINE_NODES, folders).node_errors
    assert "sampler_name 'ddim' is not run by vramgraph" in errors["20"]["errors"][0]["details"]
    assert ", ".join(SAMPLERS) in errors["20"]["errors"][0]["details"]
    assert errors["2"]["errors"][0]["details"].startswith("type - type 'joyimage' is not run by vramgraph")


def test_save_image_passes_its_images_on(folders: Folders):
    """ComfyUI 0.29's SaveImage has an IMAGE output: a PreviewImage fed from it shows the same picture."""
    g = core_text_to_image(None, 3, 1, 32)
    g["30"] = {"class_type": "PreviewImage", "inputs": {"images": ["13", 0]}}
    images = Engine(folders, device="cpu").run(g).images
    assert sorted(p.parent.name for p in images) == ["output", "temp"]
    saved, shown = (np.asarray(Image.open(p).convert("RGB")) for p in images)
    assert saved.shape == (32, 32, 3) and np.array_equal(saved, shown)
