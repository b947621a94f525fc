"""graph/workflow/parse.py: loading workflows in either format, and the UI format converted like ComfyUI's front end.

The real templates come from the PyPI package comfyui-workflow-templates-json (a test extra); the small
hand-written UI fixtures are in tests/data/ui/.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from vramgraph.graph.workflow.errors import WorkflowError
from vramgraph.graph.workflow.parse import (
    Workflow,
    WorkflowFormatError,
    is_api_format,
    is_ui_format,
    load_workflow,
    ui_to_api,
    widget_slots,
)
from vramgraph.nodes import ENGINE_NODES

DATA = Path(__file__).parent / "data" / "ui"
T2I = "image_flux2_klein_text_to_image.json"
EDIT_DISTILLED = "image_flux2_klein_image_edit_4b_distilled.json"
EDIT_BASE = "image_flux2_klein_image_edit_4b_base.json"


def templates_dir() -> Path:
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the comfyui-workflow-templates-json package (test extra)")
    return Path(next(iter(spec.submodule_search_locations))) / "templates"


def template(name: str) -> dict:
    return json.loads((templates_dir() / name).read_text(encoding="utf-8"))


def fixture(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def node(kind: str, inputs: dict[str, Any], title: str | None = None) -> dict:
    return {"inputs": inputs, "class_type": kind, "_meta": {"title": title or kind}}


def inputs_of(prompt: dict) -> dict[str, dict]:
    return {k: v["inputs"] for k, v in prompt.items()}


def ui_node(prompt_ui: dict, node_id: int) -> dict:
    return next(n for n in prompt_ui["nodes"] if n["id"] == node_id)


def assert_well_formed(prompt: dict) -> None:
    """JSON-serialisable, every link points at a node in the prompt, every input name is the class's."""
    json.dumps(prompt)
    for node_id, api in prompt.items():
        assert isinstance(node_id, str)
        cls = ENGINE_NODES.get(api["class_type"])
        spec = cls.INPUT_TYPES(folders=None) if cls is not None else {}
        names = set(spec.get("required", {})) | set(spec.get("optional", {}))
        for name, value in api["inputs"].items():
            if cls is not None:
                assert name in names, (node_id, api["class_type"], name)
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                assert value[0] in prompt, (node_id, name, value)


# ------------------------------------------------------------------------------------------------ templates


def test_text_to_image_template_flattens_the_active_subgraph() -> None:
    """
    76 Prompt ──text──► 75 [subgraph, mode 0] ──IMAGE──► 9 SaveImage
                 └────► 77 [subgraph, bypassed] ──IMAGE──► 78 SaveImage (bypassed)
    79 MarkdownNote
    """
    ui = template(T2I)
    prompt = ui_to_api(ui, ENGINE_NODES)
    text = ui_node(ui, 76)["widgets_values"][0]
    assert prompt == {
        "9": node("SaveImage", {"filename_prefix": "Flux2-Klein", "images": ["75:65", 0]}),
        "76": node("PrimitiveStringMultiline", {"value": text}, "Prompt"),
        "75:61": node("KSamplerSelect", {"sampler_name": "euler"}),
        "75:62": node("Flux2Scheduler", {"steps": 20, "width": ["75:68", 0], "height": ["75:69", 0]}),
        "75:63": node("CFGGuider", {"cfg": 5, "model": ["75:70", 0], "positive": ["75:74", 0],
                                    "negative": ["75:67", 0]}),
        "75:64": node("SamplerCustomAdvanced", {"noise": ["75:73", 0], "guider": ["75:63", 0],
                                                "sampler": ["75:61", 0], "sigmas": ["75:62", 0],
                                                "latent_image": ["75:66", 0]}),
        "75:65": node("VAEDecode", {"samples": ["75:64", 0], "vae": ["75:72", 0]}),
        "75:66": node("EmptyFlux2LatentImage", {"width": ["75:68", 0], "height": ["75:69", 0], "batch_size": 1}),
        "75:67": node("CLIPTextEncode", {"text": "", "clip": ["75:71", 0]}, "CLIP Text Encode (Negative Prompt)"),
        "75:68": node("PrimitiveInt", {"value": 1024}, "Width"),
        "75:69": node("PrimitiveInt", {"value": 1024}, "Height"),
        "75:73": node("RandomNoise", {"noise_seed": 0}),
        "75:70": node("UNETLoader", {"unet_name": "flux-2-klein-base-4b.safetensors", "weight_dtype": "default"}),
        "75:71": node("CLIPLoader", {"clip_name": "qwen_3_4b.safetensors", "type": "flux2", "device": "default"}),
        "75:72": node("VAELoader", {"vae_name": "flux2-vae.safetensors"}),
        "75:74": node("CLIPTextEncode", {"text": ["76", 0], "clip": ["75:71", 0]},
                      "CLIP Text Encode (Positive Prompt)"),
    }
    assert_well_formed(prompt)


def test_text_to_image_second_instance_when_enabled() -> None:
    """Un-bypass 77 and 78: the distilled subgraph flattens beside the first, under its own prefix."""
    ui = template(T2I)
    ui_node(ui, 77)["mode"] = 0
    ui_node(ui, 78)["mode"] = 0
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert prompt["78"]["inputs"] == {"filename_prefix": "Flux2-Klein", "images": ["77:65", 0]}
    assert prompt["77:74"]["inputs"] == {"text": ["76", 0], "clip": ["77:71", 0]}
    assert prompt["77:62"]["inputs"] == {"steps": 4, "width": ["77:68", 0], "height": ["77:69", 0]}
    assert prompt["77:63"]["inputs"] == {"cfg": 1, "model": ["77:70", 0], "positive": ["77:74", 0],
                                         "negative": ["77:76", 0]}
    assert prompt["77:73"]["inputs"] == {"noise_seed": 432262096973490}
    assert prompt["77:70"]["inputs"]["unet_name"] == "flux-2-klein-4b.safetensors"
    assert {k for k in prompt if k.startswith("75:")} == {f"75:{i}" for i in (61, 62, 63, 64, 65, 66, 67, 68, 69,
                                                                            70, 71, 72, 73, 74)}
    assert_well_formed(prompt)


def test_edit_distilled_template() -> None:
    """
    76 LoadImage ──► 75 [subgraph, mode 0; promoted widgets unet/clip/vae/text/seed] ──► 9 SaveImage
       └─────────► 92 [subgraph with nested subgraphs, bypassed] ──► 94 SaveImage (bypassed)
    81 LoadImage ──► 92
    """
    prompt = ui_to_api(template(EDIT_DISTILLED), ENGINE_NODES)
    assert prompt == {
        "9": node("SaveImage", {"filename_prefix": "Flux2-Klein", "images": ["75:65", 0]}),
        "81": node("LoadImage", {"image": "comfy_logo_blue.png"}),
        "76": node("LoadImage", {"image": "handbag_white.png"}),
        "75:61": node("KSamplerSelect", {"sampler_name": "euler"}),
        "75:70": node("UNETLoader", {"unet_name": "flux-2-klein-4b-fp8.safetensors", "weight_dtype": "default"}),
        "75:71": node("CLIPLoader", {"clip_name": "qwen_3_4b.safetensors", "type": "flux2", "device": "default"}),
        "75:72": node("VAELoader", {"vae_name": "flux2-vae.safetensors"}),
        "75:66": node("EmptyFlux2LatentImage", {"width": ["75:99", 0], "height": ["75:99", 1], "batch_size": 1}),
        "75:80": node("ImageScaleToTotalPixels", {"upscale_method": "nearest-exact", "megapixels": 1,
                                                  "resolution_steps": 1, "image": ["76", 0]}),
        "75:62": node("Flux2Scheduler", {"steps": 4, "width": ["75:99", 0], "height": ["75:99", 1]}),
        "75:74": node("CLIPTextEncode", {"text": "Change the bag color to blue.", "clip": ["75:71", 0]},
                      "CLIP Text Encode (Positive Prompt)"),
        "75:82": node("ConditioningZeroOut", {"conditioning": ["75:74", 0]}),
        "75:121": node("ReferenceLatent", {"conditioning": ["75:82", 0], "latent": ["75:122", 0]}),
        "75:99": node("GetImageSize", {"image": ["75:80", 0]}),
        "75:123": node("ReferenceLatent", {"conditioning": ["75:74", 0], "latent": ["75:122", 0]}),
        "75:122": node("VAEEncode", {"pixels": ["75:80", 0], "vae": ["75:72", 0]}),
        "75:64": node("SamplerCustomAdvanced", {"noise": ["75:73", 0], "guider": ["75:63", 0],
                                                "sampler": ["75:61", 0], "sigmas": ["75:62", 0],
                                                "latent_image": ["75:66", 0]}),
        "75:65": node("VAEDecode", {"samples": ["75:64", 0], "vae": ["75:72", 0]}),
        "75:73": node("RandomNoise", {"noise_seed": 43301611940728}),
        "75:63": node("CFGGuider", {"cfg": 1, "model": ["75:70", 0], "positive": ["75:123", 0],
                                    "negative": ["75:121", 0]}),
    }
    assert_well_formed(prompt)


def test_edit_base_template_promoted_widgets() -> None:
    ui = template(EDIT_BASE)
    prompt = ui_to_api(ui, ENGINE_NODES)
    unet, clip, vae, text, seed = ui_node(ui, 75)["widgets_values"]
    assert prompt["75:70"]["inputs"] == {"unet_name": unet, "weight_dtype": "default"}
    assert unet == "flux-2-klein-base-4b-fp8.safetensors"
    assert prompt["75:71"]["inputs"] == {"clip_name": clip, "type": "flux2", "device": "default"}
    assert prompt["75:72"]["inputs"] == {"vae_name": "full_encoder_small_decoder.safetensors"} == {"vae_name": vae}
    assert prompt["75:74"]["inputs"] == {"text": text, "clip": ["75:71", 0]}
    assert text.startswith("Change the background to a cozy")
    assert prompt["75:73"]["inputs"] == {"noise_seed": seed} == {"noise_seed": 1111443136920027}
    assert prompt["75:62"]["inputs"] == {"steps": 20, "width": ["75:100", 0], "height": ["75:100", 1]}
    assert prompt["75:63"]["inputs"]["cfg"] == 5
    assert prompt["76"]["inputs"] == {"image": "robed_women.png"}
    assert prompt["75:80"]["inputs"]["image"] == ["76", 0]
    assert prompt["9"]["inputs"]["images"] == ["75:65", 0]
    assert not [k for k in prompt if k.startswith("92") or k == "94" or k == "97"]
    assert_well_formed(prompt)


def test_edit_template_bypassed_instance_passes_its_image_through() -> None:
    """Re-enable only SaveImage 94: bypassed instance 92's IMAGE output takes its first IMAGE input (slot 1)."""
    ui = template(EDIT_DISTILLED)
    ui_node(ui, 94)["mode"] = 0
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert prompt["94"]["inputs"] == {"filename_prefix": "Flux2-Klein", "images": ["76", 0]}
    assert not [k for k in prompt if k.startswith("92:")]


def test_edit_template_nested_subgraphs_when_enabled() -> None:
    """
    Enable 92 and 94: 92 holds two nested "Reference Conditioning" subgraphs (112, 84).
    109 text ──► 112 [117 ReferenceLatent, 116 VAEEncode, 115 ReferenceLatent] ──► 84 [120, 119, 118] ──► 103 CFG
    """
    ui = template(EDIT_DISTILLED)
    ui_node(ui, 92)["mode"] = 0
    ui_node(ui, 94)["mode"] = 0
    prompt = ui_to_api(ui, ENGINE_NODES)
    unet, clip, vae, text, seed = ui_node(ui, 92)["widgets_values"]
    assert prompt["94"]["inputs"]["images"] == ["92:105", 0]
    assert prompt["92:107"]["inputs"] == {"unet_name": unet, "weight_dtype": "default"}
    assert prompt["92:108"]["inputs"] == {"clip_name": clip, "type": "flux2", "device": "default"}
    assert prompt["92:110"]["inputs"] == {"vae_name": vae}
    assert prompt["92:109"]["inputs"] == {"text": text, "clip": ["92:108", 0]}
    assert text.startswith("stylize the handbag")
    assert prompt["92:106"]["inputs"] == {"noise_seed": seed} == {"noise_seed": 786795143695419}
    assert prompt["92:111"]["inputs"]["image"] == ["76", 0]
    assert prompt["92:85"]["inputs"]["image"] == ["81", 0]
    assert prompt["92:112:116"]["inputs"] == {"pixels": ["92:111", 0], "vae": ["92:110", 0]}
    assert prompt["92:112:117"]["inputs"] == {"conditioning": ["92:109", 0], "latent": ["92:112:116", 0]}
    assert prompt["92:112:115"]["inputs"] == {"conditioning": ["92:86", 0], "latent": ["92:112:116", 0]}
    assert prompt["92:84:119"]["inputs"] == {"pixels": ["92:85", 0], "vae": ["92:110", 0]}
    assert prompt["92:84:120"]["inputs"] == {"conditioning": ["92:112:117", 0], "latent": ["92:84:119", 0]}
    assert prompt["92:84:118"]["inputs"] == {"conditioning": ["92:112:115", 0], "latent": ["92:84:119", 0]}
    assert prompt["92:103"]["inputs"] == {"cfg": 1, "model": ["92:107", 0], "positive": ["92:84:120", 0],
                                          "negative": ["92:84:118", 0]}
    assert not [k for k in prompt if k in ("92", "92:112", "92:84")]
    assert_well_formed(prompt)


def test_every_template_converts() -> None:
    """Every UI workflow in the package converts without error, serialises, and links only to its own nodes."""
    count = 0
    for path in sorted(templates_dir().glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not is_ui_format(data):
            continue
        workflow = load_workflow(path)
        assert workflow.ui == data
        assert_well_formed(workflow.prompt)
        count += 1
    assert count > 100


# ------------------------------------------------------------------------------------------------ fixtures


def test_bypass_chain_and_mute() -> None:
    """
    1 LoadImage ──► 2 Scale (bypassed) ──► 3 Scale (bypassed) ──► 4 VAEEncode ◄── 5 VAELoader (bypassed)
       └──────────► 6 Scale (muted) ──────────────────────────► 7 VAEEncode ◄── 8 VAELoader
    """
    prompt = load_workflow(DATA / "bypass_mute.json").prompt
    assert prompt == {
        "1": node("LoadImage", {"image": "handbag.png"}),
        "4": node("VAEEncode", {"pixels": ["1", 0]}),  # the bypassed loader has no VAE input to pass through
        "7": node("VAEEncode", {"vae": ["8", 0]}, "Encode after a muted node"),
        "8": node("VAELoader", {"vae_name": "flux2-vae.safetensors"}),
    }


def test_reroutes_primitive_and_notes() -> None:
    """
    1 CLIPLoader ──► 10 Reroute ──► 11 Reroute ──► 2 CLIPTextEncode
    5 PrimitiveNode (768) ──width──► 6 EmptyFlux2LatentImage
                          └─width──► 7 Flux2Scheduler
    20 Note, 21 MarkdownNote; 22 RandomNoise stores its widgets_values as a dict
    """
    prompt = load_workflow(DATA / "reroute_primitive_note.json").prompt
    assert prompt == {
        "1": node("CLIPLoader", {"clip_name": "qwen_3_4b.safetensors", "type": "flux2", "device": "default"}),
        "2": node("CLIPTextEncode", {"text": "a red fox in the snow", "clip": ["1", 0]}, "Positive"),
        "6": node("EmptyFlux2LatentImage", {"width": 768, "height": 640, "batch_size": 1}),
        "7": node("Flux2Scheduler", {"steps": 4, "width": 768, "height": 640}),
        "22": node("RandomNoise", {"noise_seed": 1234}),
    }


def test_subgraph_promoted_widgets_and_passthrough() -> None:
    """
    1 CLIPLoader ──clip──► 2 [sg-encode: 10 CLIPTextEncode, 11 RandomNoise, 12 Note; clip passes to output 2]
    2:0 ──► 3 ConditioningZeroOut;  2:1 ──► 5 SamplerCustomAdvanced;  2:2 (= 1:0) ──► 4 CLIPTextEncode
    Instance widgets_values ["a red fox", 42] are the promoted inputs text and noise_seed, in subgraph order.
    """
    prompt = load_workflow(DATA / "subgraph.json").prompt
    assert prompt == {
        "1": node("CLIPLoader", {"clip_name": "qwen_3_4b.safetensors", "type": "flux2", "device": "default"}),
        "2:10": node("CLIPTextEncode", {"text": "a red fox", "clip": ["1", 0]}),
        "2:11": node("RandomNoise", {"noise_seed": 42}),
        "3": node("ConditioningZeroOut", {"conditioning": ["2:10", 0]}),
        "4": node("CLIPTextEncode", {"text": "through the subgraph", "clip": ["1", 0]}),
        "5": node("SamplerCustomAdvanced", {"noise": ["2:11", 0]}),
    }


def test_subgraph_widget_values_on_inner_nodes_or_by_name() -> None:
    ui = fixture("subgraph.json")
    instance = ui_node(ui, 2)
    instance["widgets_values"] = []  # newer front ends ("proxyWidgets"): the values stay in the inner nodes
    instance["properties"] = {"proxyWidgets": [["-1", "text"], ["11", "noise_seed"]]}
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert prompt["2:10"]["inputs"] == {"text": "inner text", "clip": ["1", 0]}
    assert prompt["2:11"]["inputs"] == {"noise_seed": 5}
    instance["widgets_values"] = {"text": "by name"}
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert prompt["2:10"]["inputs"] == {"text": "by name", "clip": ["1", 0]}
    assert prompt["2:11"]["inputs"] == {"noise_seed": 5}


def test_subgraph_input_linked_from_outside_wins_over_its_widget() -> None:
    ui = fixture("subgraph.json")
    ui["nodes"].append({"id": 9, "type": "PrimitiveNode", "mode": 0,
                        "outputs": [{"name": "STRING", "type": "STRING", "links": [9]}],
                        "widgets_values": ["from a primitive"]})
    ui["links"].append([9, 9, 0, 2, 1, "STRING"])
    ui_node(ui, 2)["inputs"][1]["link"] = 9
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert prompt["2:10"]["inputs"] == {"text": "from a primitive", "clip": ["1", 0]}
    assert "9" not in prompt


def test_muted_and_bypassed_subgraph_instance() -> None:
    ui = fixture("subgraph.json")
    ui_node(ui, 2)["mode"] = 2
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert not [k for k in prompt if k.startswith("2")]
    assert prompt["3"]["inputs"] == {}
    assert prompt["4"]["inputs"] == {"text": "through the subgraph"}
    assert prompt["5"]["inputs"] == {}
    ui_node(ui, 2)["mode"] = 4  # CLIP output 2 passes the CLIP input through; nothing matches the others
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert not [k for k in prompt if k.startswith("2")]
    assert prompt["3"]["inputs"] == {}
    assert prompt["4"]["inputs"] == {"text": "through the subgraph", "clip": ["1", 0]}
    assert prompt["5"]["inputs"] == {}


def test_recursive_subgraph_is_an_error() -> None:
    ui = fixture("subgraph.json")
    sg = ui["definitions"]["subgraphs"][0]
    sg["nodes"].append({"id": 13, "type": "sg-encode", "mode": 0, "inputs": [], "outputs": []})
    with pytest.raises(WorkflowFormatError, match="contains itself"):
        ui_to_api(ui, ENGINE_NODES)


def test_bypass_prefers_the_input_at_the_output_index() -> None:
    """
    1 LoadImage ──a──► 2 Blend (bypassed; unknown type; outputs IMAGE, IMAGE) ──output 1──► 4 VAEEncode
    3 LoadImage ──b──┘
    7 CLIPTextEncode ──(input 1)──► 5 ReferenceLatent (bypassed; input 0 is LATENT) ──► 6 ConditioningZeroOut
    """
    ui = {"nodes": [
        {"id": 1, "type": "LoadImage", "mode": 0, "widgets_values": ["a.png", "image"],
         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]}]},
        {"id": 3, "type": "LoadImage", "mode": 0, "widgets_values": ["b.png", "image"],
         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [2]}]},
        {"id": 2, "type": "Blend", "mode": 4,
         "inputs": [{"name": "a", "type": "IMAGE", "link": 1}, {"name": "b", "type": "IMAGE", "link": 2}],
         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": []},
                     {"name": "IMAGE", "type": "IMAGE", "links": [3]}]},
        {"id": 4, "type": "VAEEncode", "mode": 0, "inputs": [{"name": "pixels", "type": "IMAGE", "link": 3}]},
        {"id": 7, "type": "CLIPTextEncode", "mode": 0, "widgets_values": ["x"],
         "outputs": [{"name": "CONDITIONING", "type": "CONDITIONING", "links": [4]}]},
        {"id": 5, "type": "ReferenceLatent", "mode": 4,
         "inputs": [{"name": "latent", "type": "LATENT", "link": None},
                    {"name": "conditioning", "type": "CONDITIONING", "link": 4}],
         "outputs": [{"name": "CONDITIONING", "type": "CONDITIONING", "links": [5]}]},
        {"id": 6, "type": "ConditioningZeroOut", "mode": 0,
         "inputs": [{"name": "conditioning", "type": "CONDITIONING", "link": 5}]}],
        "links": [[1, 1, 0, 2, 0, "IMAGE"], [2, 3, 0, 2, 1, "IMAGE"], [3, 2, 1, 4, 0, "IMAGE"],
                  [4, 7, 0, 5, 1, "CONDITIONING"], [5, 5, 0, 6, 0, "CONDITIONING"]]}
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert prompt["4"]["inputs"] == {"pixels": ["3", 0]}
    assert prompt["6"]["inputs"] == {"conditioning": ["7", 0]}
    assert set(prompt) == {"1", "3", "4", "6", "7"}


def test_unknown_node_type_is_kept_with_its_links() -> None:
    ui = fixture("bypass_mute.json")
    ui["nodes"].append({"id": 30, "type": "SomeCustomNode", "mode": 0, "title": "Custom",
                        "inputs": [{"name": "image", "type": "IMAGE", "link": 30},
                                   {"name": "mask", "type": "MASK", "link": None}],
                        "widgets_values": [1, "two"]})
    ui["links"].append([30, 1, 0, 30, 0, "IMAGE"])
    prompt = ui_to_api(ui, ENGINE_NODES)
    expected = node("SomeCustomNode", {"image": ["1", 0]}, "Custom")
    expected["_meta"]["widgets_values"] = [1, "two"]  # kept for validation to read (graph/workflow/families.py)
    assert prompt["30"] == expected


def test_link_to_a_missing_node_is_dropped() -> None:
    ui = fixture("bypass_mute.json")
    ui["links"].append([40, 99, 0, 4, 1, "VAE"])
    ui_node(ui, 4)["inputs"][1]["link"] = 40
    assert ui_to_api(ui, ENGINE_NODES)["4"]["inputs"] == {"pixels": ["1", 0]}


# ------------------------------------------------------------------------------------------------ widgets


def test_widget_slots_skip_control_and_upload_values() -> None:
    slots = {s.name: s for s in widget_slots(ENGINE_NODES["KSampler"])}
    assert list(slots) == ["seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"]
    assert slots["seed"].control and not slots["steps"].control
    (image,) = widget_slots(ENGINE_NODES["LoadImage"])
    assert image.name == "image" and image.upload
    ui = {"nodes": [{"id": 1, "type": "KSampler", "mode": 0, "inputs": [],
                     "widgets_values": [43301611940728, "randomize", 20, 5.0, "euler", "simple", 1.0]},
                    {"id": 2, "type": "PrimitiveInt", "mode": 0, "widgets_values": [1024, "fixed"]},
                    {"id": 3, "type": "EmptyFlux2LatentImage", "mode": 0, "widgets_values": [512]}],
          "links": []}
    prompt = ui_to_api(ui, ENGINE_NODES)
    assert prompt["1"]["inputs"] == {"seed": 43301611940728, "steps": 20, "cfg": 5.0, "sampler_name": "euler",
                                     "scheduler": "simple", "denoise": 1.0}
    assert prompt["2"]["inputs"] == {"value": 1024}
    assert prompt["3"]["inputs"] == {"width": 512}  # missing values are left for validation to report


# ------------------------------------------------------------------------------------------------ loading


def test_formats_are_recognised() -> None:
    api = {"1": node("VAELoader", {"vae_name": "flux2-vae.safetensors"})}
    ui = fixture("subgraph.json")
    assert is_api_format(api) and not is_ui_format(api)
    assert is_ui_format(ui) and not is_api_format(ui)
    assert not is_api_format({}) and not is_ui_format({}) and not is_ui_format({"nodes": [1]})


def test_api_format_passes_through_as_a_copy(tmp_path: Path) -> None:
    api = {"1": node("VAELoader", {"vae_name": "flux2-vae.safetensors"}),
           "2": node("VAEDecode", {"samples": ["3", 0], "vae": ["1", 0]})}
    workflow = load_workflow(api)
    assert workflow == Workflow(api, None, "<dict>")
    workflow.prompt["2"]["inputs"]["vae"][0] = "9"
    assert api["2"]["inputs"]["vae"] == ["1", 0]
    path = tmp_path / "api.json"
    path.write_text(json.dumps(api))
    assert load_workflow(path) == Workflow(api, None, str(path))
    assert load_workflow(str(path)).source == str(path)


def test_ui_format_keeps_the_original() -> None:
    ui = fixture("subgraph.json")
    original = copy.deepcopy(ui)
    workflow = load_workflow(DATA / "subgraph.json")
    assert workflow.ui == original
    assert workflow.prompt == ui_to_api(original, ENGINE_NODES)
    assert ui == original  # converting does not modify its input
    assert load_workflow(ui).source == "<dict>"


def test_prompt_wrapper() -> None:
    api = {"1": node("VAELoader", {"vae_name": "flux2-vae.safetensors"})}
    ui = fixture("subgraph.json")
    body = {"prompt": api, "client_id": "abc", "extra_data": {"extra_pnginfo": {"workflow": ui}}}
    assert load_workflow(body) == Workflow(api, ui, "<dict>")
    assert load_workflow({"prompt": json.dumps(api)}) == Workflow(api, None, "<dict>")
    assert load_workflow({"prompt": api, "workflow": ui}).ui == ui
    assert load_workflow({"prompt": ui}).prompt == ui_to_api(ui, ENGINE_NODES)


def test_neither_format_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"templates": [1, 2, 3]}))
    with pytest.raises(WorkflowFormatError, match="expected ComfyUI's API format") as info:
        load_workflow(path)
    assert isinstance(info.value, ValueError) and isinstance(info.value, WorkflowError)
    error = info.value.to_dict()
    assert set(error) == {"type", "message", "details", "extra_info"}
    assert str(path) in error["message"] and error["extra_info"] == {"source": str(path)}
    path.write_text("{not json")
    with pytest.raises(WorkflowFormatError, match="not valid JSON"):
        load_workflow(path)
    with pytest.raises(WorkflowFormatError, match="cannot read workflow file"):
        load_workflow(tmp_path / "missing.json")
    with pytest.raises(WorkflowFormatError, match="holds no workflow"):
        load_workflow({"prompt": {"a": 1}})
    with pytest.raises(WorkflowFormatError):
        load_workflow({"nodes": "x"})
