"""ComfyUI's own FLUX.2 [klein] templates (PyPI: comfyui-workflow-templates-json) run unchanged by `vramgraph run`.

Each template file is copied as it ships (UI format with subgraphs, bypassed alternatives, notes) and run
on tiny random-weight models placed under the file names it references, with the input images it loads
written as small PNGs under their names. Only sizes and step counts are overridden (`--set` with the
flattened subgraph ids, e.g. `75:62` = node 62 inside subgraph instance 75), to keep the runs fast.

The fp8 file names (flux-2-klein-4b-fp8.safetensors, flux-2-klein-base-4b-fp8.safetensors) hold tiny fp32
weights here: the real fp8 checkpoints are refused by our loader, so these only stand in for them so the
templates run unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image
from vramgraph.cli import main
from vramgraph.graph.workflow import ui_to_api
from vramgraph.nodes import ENGINE_NODES

CORE_T2I = {"UNETLoader", "CLIPLoader", "VAELoader", "CLIPTextEncode", "CFGGuider", "KSamplerSelect",
            "Flux2Scheduler", "RandomNoise", "EmptyFlux2LatentImage", "SamplerCustomAdvanced", "VAEDecode",
            "SaveImage"}
CORE_EDIT = CORE_T2I | {"LoadImage", "ImageScaleToTotalPixels", "GetImageSize", "VAEEncode", "ReferenceLatent"}
# the edit templates scale the reference to megapixels; 0.01 MP in steps of 16 gives small pictures
SMALL_EDIT = ["75:80.megapixels=0.01", "75:80.resolution_steps=16"]

TEMPLATES = {  # file -> (--set values, node types that must run with their counts, (width, height), seed, models)
    "image_flux2_klein_text_to_image.json": (
        ["75:68.value=64", "75:69.value=64", "75:62.steps=2"],  # Width, Height primitives; 20 base steps -> 2
        Counter({**dict.fromkeys(CORE_T2I, 1), "CLIPTextEncode": 2, "PrimitiveInt": 2,
                 "PrimitiveStringMultiline": 1}),
        (64, 64), 0, {"flux-2-klein-base-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"}),
    "image_flux2_klein_image_edit_4b_distilled.json": (
        SMALL_EDIT,
        Counter({**dict.fromkeys(CORE_EDIT, 1), "ReferenceLatent": 2, "ConditioningZeroOut": 1}),
        (112, 96), 43301611940728,  # handbag_white.png 80x64 at 0.01 MP in steps of 16
        {"flux-2-klein-4b-fp8.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"}),
    "image_flux2_klein_image_edit_4b_base.json": (
        [*SMALL_EDIT, "75:62.steps=2"],
        Counter({**dict.fromkeys(CORE_EDIT, 1), "ReferenceLatent": 2, "CLIPTextEncode": 2}),
        (96, 112), 1111443136920027,  # robed_women.png 64x80 likewise
        {"flux-2-klein-base-4b-fp8.safetensors", "qwen_3_4b.safetensors", "full_encoder_small_decoder.safetensors"}),
}


def template(name: str) -> Path:
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    assert spec is not None and spec.submodule_search_locations, "pip install comfyui-workflow-templates-json"
    return Path(next(iter(spec.submodule_search_locations))) / "templates" / name


def referenced_files(ui: dict) -> set[str]:
    """Every model file and image a template's nodes name in their widgets (subgraphs included)."""
    nodes = list(ui["nodes"]) + [n for sg in ui.get("definitions", {}).get("subgraphs", []) for n in sg["nodes"]]
    return {v for n in nodes for v in n.get("widgets_values") or [] if isinstance(v, str)
            and v.endswith((".safetensors", ".png"))}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_comfyui_template_runs_unchanged(name: str, tiny_models: Path, input_dir: Path, tmp_path: Path) -> None:
    sets, ran, size, seed, models = TEMPLATES[name]
    src = tmp_path / name
    shutil.copy(template(name), src)
    ui = json.loads(src.read_text())
    have = {p.name for p in tiny_models.rglob("*.safetensors")} | {p.name for p in input_dir.glob("*.png")}
    assert referenced_files(ui) <= have  # every file it names exists under that name (the fixtures' lists)

    out, report = tmp_path / "out", tmp_path / "report.json"
    args = ["run", str(src), "--models", str(tiny_models), "--input", str(input_dir), "-o", str(out),
            "--report", str(report)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert json.loads(src.read_text()) == ui  # the file itself is left as it was

    (png,) = sorted(out.rglob("*.png"))
    with Image.open(png) as im:
        assert im.size == size
        text = dict(im.text)
    prompt = json.loads(text["prompt"])
    workflow, shipped = json.loads(text["workflow"]), json.loads(template(name).read_text())
    converted = ui_to_api(workflow, ENGINE_NODES)  # the template UI JSON with the --set values that ran
    assert {k: v for k, v in converted.items() if k in prompt} == prompt  # (the prompt: the nodes that ran)
    assert {k: v for k, v in workflow.items() if k != "definitions"} == {
        k: v for k, v in shipped.items() if k != "definitions"}
    assert text["seed"] == str(seed)

    rep = json.loads(report.read_text())
    assert Counter(n["class_type"] for n in rep["nodes"]) == ran  # ComfyUI's core nodes, none of ours
    assert {n["class_type"] for n in prompt.values()} == set(ran)
    used = {Path(k.split(":", 1)[1].rsplit(":", 1)[0]).name for k in rep["plan"]["models"]}  # kind:path:dtype
    assert used == models
