"""A workflow for a model vramgraph does not run is refused at validation by its model family, never with a
missing-node message that blames a custom node (graph/workflow/families.py): over every template ComfyUI ships (PyPI:
comfyui-workflow-templates-json), and from model file headers when the files are present."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from vramgraph.cli import main
from vramgraph.graph.workflow.families import unsupported_model
from vramgraph.graph.workflow.parse import load_workflow
from vramgraph.graph.workflow.validate import validate
from vramgraph.nodes import ENGINE_NODES
from vramgraph.nodes.files import Folders

ROOT = Path(__file__).resolve().parents[1]
MESSAGE = re.compile(r"^this workflow uses (.+), which vramgraph does not run(: FLUX\.3 klein is not supported)?$")
KLEIN = {"image_flux2_text_to_image_9b"}  # FLUX.2 [klein] 9B base by its files, besides image_flux2_klein_*
NO_MODEL = {"basic_datatype_conversion", "basic_image_color_adjustment", "basic_mask_operations_and_compositing",
            "utility_image_stitch", "utility_interpolation_image_upscale"}  # image utilities: no model at all
# where the family we name is not a word of the template's index entry ("models"), and why it is still the right one
NAMED_OTHERWISE = {
    "api_openrouter_": "OpenRouter",  # the cloud service the node calls; the index names the model behind it
    "api_pruna_": "Pruna", "api_higgsfield_": "Higgsfield", "api_tencent_hy_": "Hunyuan",  # likewise
    "api_bytedance_seed": "ByteDance",
    "image_marigold_v2_": "Qwen-Image-Edit",  # Marigold v2 runs on the Qwen-Image-Edit model its loader names
    "image_netayume_lumina_t2i": "Lumina",  # the index says OmniGen; the checkpoint is NetaYume Lumina
    "sd3.5_large_depth": "Stable Diffusion",  # its depth preprocessor (Lotus, SD 1.5) is named before SD 3.5
    "utility_pid_latent_upscale_dit": "Z-Image",  # PiD upscales the latents of the Z-Image model it loads
    "basic_switch_node": "Z-Image", "templates_ohneis_i2v": "Z-Image",
}
STOP = {"the", "api", "model", "file", "image", "video", "language", "safetensors", "node", "edit", "cloud"}
SPELLINGS = {"sdxl": "stablediffusionxl", "sd35": "stablediffusion35", "sd15": "stablediffusion15",
             "svd": "stablevideodiffusion", "hunyuanvideo": "hunyuanvideo"}


def _templates() -> Path:
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    assert spec is not None and spec.submodule_search_locations, "pip install comfyui-workflow-templates-json"
    return Path(next(iter(spec.submodule_search_locations))) / "templates"


def _index() -> dict[str, list[str]]:
    out = {}
    for category in json.loads((_templates() / "index.json").read_text()):
        for t in category["templates"]:
            out[t["name"]] = [m for m in t.get("models") or [] if m != "None"]
    return out


def _workflows() -> list[Path]:
    return sorted(p for p in _templates().glob("*.json") if not p.stem.startswith("index") and p.stem != "fuse_options")


def _norm(text: str) -> str:
    text = re.sub(r"[^a-z0-9]", "", text.lower())
    return SPELLINGS.get(text, text)


def _agrees(family: str, models: list[str]) -> bool:
    """Does the family we name agree with the template's index entry (one of its words in one of the models)?"""
    words = [_norm(w) for w in re.split(r"[\s()/,]+", family)] + re.findall(r"[a-z]+", family.lower())
    words = [w for w in words if len(w) >= 3 and w not in STOP]
    return any(w in _norm(m) or _norm(m) in w for w in words for m in models)


def test_every_template_we_do_not_run_is_refused_by_its_model_family(tmp_path):
    index = _index()
    folders = Folders(models=(tmp_path / "models",), input=tmp_path / "input")
    refused = 0
    for path in _workflows():
        name = path.stem
        check = validate(load_workflow(path).prompt, ENGINE_NODES, folders)
        error = check.response()["error"]
        if name.startswith("image_flux2_klein_") or name in KLEIN:  # ours: never refused for its model
            assert error is None or error["type"] != "unsupported_model", (name, error)
            continue
        if name in NO_MODEL:
            assert error["type"] == "missing_node_type", (name, error)
            continue
        assert not check.ok and error["type"] == "unsupported_model", (name, error)
        match = MESSAGE.match(error["message"])
        assert match, (name, error["message"])
        family = match.group(1)
        assert family == error["extra_info"]["family"]
        assert "custom node" not in error["message"] + error["details"]
        assert f"node {error['extra_info']['node_id']} ({error['extra_info']['class_type']})" in error["details"]
        expected = next((v for k, v in NAMED_OTHERWISE.items() if name.startswith(k)), None)
        if expected is not None:
            assert expected in family, (name, family)
        else:
            assert _agrees(family, index[name]), (name, family, index[name])
        refused += 1
    assert refused >= 600  # the package holds some 640 templates; all but the klein ones and 5 utilities


@pytest.mark.parametrize(("name", "family"), [
    ("image_flux3_klein_t2i", "FLUX.3 klein"), ("image_flux3_klein_distilled_image_edit", "FLUX.3 klein"),
    ("image_z_image_turbo", "Z-Image"), ("image_z_image", "Z-Image"),
    ("sdxl_simple_example", "Stable Diffusion XL"), ("sd3.5_simple_example", "Stable Diffusion 3.5"),
    ("image_flux2", "FLUX.2 [dev]"), ("flux_schnell", "FLUX.1"), ("video_wan2_2_14B_t2v", "Wan 2.2"),
    ("api_bfl_flux3_t2i", "the Black Forest Labs API (FLUX Pro/Max)"),
])
def test_the_families_the_brief_names(name, family):
    found = unsupported_model(load_workflow(_templates() / f"{name}.json").prompt, ENGINE_NODES)
    assert found is not None and found.family == family
    if family == "FLUX.3 klein":
        assert found.message == "this workflow uses FLUX.3 klein, which vramgraph does not run: FLUX.3 klein is " \
                                "not supported"
        # the evidence is in the graph, not only a file name: the loader's type and the FLUX.3 node types
        assert "loads a text encoder of type 'flux3'" in found.details and found.class_type == "CLIPLoader"


def _write(path: Path, keys: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.zeros((2, 2), np.float16) for k in keys}, str(path))


def test_present_files_are_judged_by_their_headers_not_their_names(tmp_path, tiny_models):
    """A file the models folder holds is recognised from its tensor names: an SDXL UNet under a neutral name is
    refused as SDXL, and our own klein transformer under an SDXL-like name is not refused at all."""
    models = tmp_path / "models"
    shutil.copytree(tiny_models, models)
    _write(models / "diffusion_models" / "my_model.safetensors",
           ["input_blocks.0.0.weight", "label_emb.0.0.weight", "middle_block.0.in_layers.0.weight"])
    _write(models / "diffusion_models" / "video.safetensors",
           ["blocks.0.cross_attn.k.weight", "patch_embedding.weight", "head.head.weight"])
    klein = next(p for p in (models / "diffusion_models").glob("flux-2-klein-4b.safetensors"))
    shutil.copy(klein, models / "diffusion_models" / "sd_xl_base_1.0.safetensors")
    folders = Folders(models=(models,), input=tmp_path / "input")
    prompt = json.loads((ROOT / "workflows" / "core_text_to_image.json").read_text())
    assert unsupported_model(prompt, ENGINE_NODES, folders) is None
    for file, family in (("my_model.safetensors", "Stable Diffusion XL"), ("video.safetensors", "Wan"),
                         ("sd_xl_base_1.0.safetensors", None)):
        prompt["1"]["inputs"]["unet_name"] = file
        found = unsupported_model(prompt, ENGINE_NODES, folders)
        assert (found and found.family) == family, file
        if found:
            assert f"loads {file}, whose tensors are {family}'s" in found.details
    # absent, the name is all there is, and the details say so
    prompt["1"]["inputs"]["unet_name"] = "z_image_turbo_bf16.safetensors"
    found = unsupported_model(prompt, ENGINE_NODES, folders)
    assert found.family == "Z-Image" and "by its name; the file is not in the models folders" in found.details


def test_cli_validate_names_the_model(tmp_path, capsys):
    assert main(["validate", str(_templates() / "image_flux3_klein_t2i.json"), "--models", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "this workflow uses FLUX.3 klein, which vramgraph does not run: FLUX.3 klein is not supported" in err
    assert "custom node" not in err
    assert main(["validate", str(_templates() / "image_z_image_turbo.json"), "--models", str(tmp_path),
                 "--json"]) == 1
    body = json.loads(capsys.readouterr().out)
    assert body["error"]["type"] == "unsupported_model" and body["error"]["extra_info"]["family"] == "Z-Image"
