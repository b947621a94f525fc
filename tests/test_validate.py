"""Validation of API-format prompts: ComfyUI's error JSON for each kind of defect, and the error hierarchy.

Each file in tests/data/invalid/ is the FLUX.2 [klein] text-to-image graph below with one defect; the
table says which node must be blamed and with which error type. The graph (ids as in the files):

    2 CLIPLoader ─► 4 CLIPTextEncode ─┬──────────────────────────► 6 CFGGuider ◄── 1 UNETLoader
                                      └─► 5 ConditioningZeroOut ──►┘
    9 RandomNoise, 7 KSamplerSelect, 8 Flux2Scheduler, 10 EmptyFlux2LatentImage, 6 ─► 11 SamplerCustomAdvanced
    11, 3 VAELoader ─► 12 VAEDecode ─► 13 SaveImage
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import networkx as nx
import pytest
from vramgraph.graph.workflow.errors import (
    InterruptedRun,
    NodeExecutionError,
    ValidationFailed,
    VramgraphError,
    WorkflowError,
)
from vramgraph.graph.workflow.validate import Validation, inputs_with_defaults, validate
from vramgraph.nodes import ENGINE_NODES
from vramgraph.nodes.files import Folders
from vramgraph.nodes.types import BOOLEAN, IMAGE, STRING

INVALID = Path(__file__).parent / "data" / "invalid"
FAILED = "prompt_outputs_failed_validation"
UNET, TEXT_ENCODER, VAE = "flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"

KLEIN = {
    "1": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
    "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": TEXT_ENCODER, "type": "flux2"}},
    "3": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
    "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox in the snow", "clip": ["2", 0]}},
    "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 0]}},
    "6": {"class_type": "CFGGuider", "inputs": {"model": ["1", 0], "positive": ["4", 0], "negative": ["5", 0],
                                                "cfg": 1.0}},
    "7": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
    "8": {"class_type": "Flux2Scheduler", "inputs": {"steps": 4, "width": 1024, "height": 1024}},
    "9": {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}},
    "10": {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
    "11": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["9", 0], "guider": ["6", 0],
                                                             "sampler": ["7", 0], "sigmas": ["8", 0],
                                                             "latent_image": ["10", 0]}},
    "12": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["3", 0]}},
    "13": {"class_type": "SaveImage", "inputs": {"images": ["12", 0], "filename_prefix": "klein"}},
}


@pytest.fixture
def folders(tmp_path: Path) -> Folders:
    """A real models folder with one (empty) file per loader, so file lists are what is on disk."""
    for sub, name in (("diffusion_models", UNET), ("text_encoders", TEXT_ENCODER), ("vae", VAE)):
        (tmp_path / "models" / sub).mkdir(parents=True)
        (tmp_path / "models" / sub / name).write_bytes(b"")
    (tmp_path / "input").mkdir()
    return Folders(models=(tmp_path / "models",), input=tmp_path / "input")


def prompt(**changes: dict) -> dict:
    """KLEIN with nodes replaced (or added): prompt(**{"6": {...}})."""
    p = copy.deepcopy(KLEIN)
    p.update(copy.deepcopy(changes))
    return p


# ------------------------------------------------------------------------------------------ the valid graph


def test_valid_klein_graph_passes_with_a_sensible_dag(folders: Folders) -> None:
    v = validate(KLEIN, ENGINE_NODES, folders)
    assert v.ok and v.error is None and v.node_errors == {}
    assert v.outputs == ("13",)
    assert set(v.dag.nodes) == set(KLEIN)
    assert nx.is_directed_acyclic_graph(v.dag)
    assert v.dag.nodes["11"]["class_type"] == "SamplerCustomAdvanced"
    assert v.dag.edges["4", "6"]["links"] == [(0, "positive")]
    order = list(nx.topological_sort(v.dag))
    pos = {n: i for i, n in enumerate(order)}
    for a, b in [("2", "4"), ("4", "5"), ("5", "6"), ("1", "6"), ("6", "11"), ("10", "11"), ("11", "12"),
                 ("3", "12"), ("12", "13")]:
        assert pos[a] < pos[b], (a, b, order)
    assert order[-3:] == ["11", "12", "13"]
    assert v.check() is v
    assert v.response() == {"error": None, "node_errors": {}}


def test_only_what_outputs_need_is_validated_and_run(folders: Folders) -> None:
    """A broken node that no output depends on is ignored, as in ComfyUI; it is not in the DAG either."""
    p = prompt(**{"20": {"class_type": "Flux2Scheduler", "inputs": {"steps": -5}}})
    v = validate(p, ENGINE_NODES, folders)
    assert v.ok and v.node_errors == {} and "20" not in v.dag


def test_undeclared_inputs_are_ignored_with_a_warning(folders: Folders, caplog: pytest.LogCaptureFixture) -> None:
    """As ComfyUI: an input key the node does not declare passes validation and is left out of the prompt run."""
    p = prompt(**{"9": {"class_type": "RandomNoise", "inputs": {"noise_seed": 42, "colour": "blue", "vg": [1, 2]}}})
    with caplog.at_level("WARNING", logger="vramgraph.validate"):
        v = validate(p, ENGINE_NODES, folders)
    assert v.ok and v.node_errors == {}
    assert v.prompt["9"]["inputs"] == {"noise_seed": 42}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "node 9 (RandomNoise): input 'colour'" in warned and "'vg'" in warned and "ignored" in warned


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999", float("inf")])
def test_a_float_input_must_be_finite(folders: Folders, value: object) -> None:
    p = prompt(**{"6": {**KLEIN["6"], "inputs": {**KLEIN["6"]["inputs"], "cfg": value}}})
    v = validate(p, ENGINE_NODES, folders)
    assert not v.ok
    (error,) = v.node_errors["6"]["errors"]
    assert error["type"] == "invalid_input_type" and "not a finite number" in error["details"], error


def test_literals_are_converted_like_comfyui(folders: Folders) -> None:
    p = prompt(**{"8": {"class_type": "Flux2Scheduler", "inputs": {"steps": "4", "width": 1024.0, "height": "1024"}},
                  "6": {"class_type": "CFGGuider", "inputs": {**KLEIN["6"]["inputs"], "cfg": "3.5"}},
                  "7": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": {"__value__": "euler"}}},
                  "12": {"class_type": "VAEDecode", "inputs": {"samples": [11, 0], "vae": ["3", 0]}}})
    v = validate(p, ENGINE_NODES, folders)
    assert v.ok, v.response()
    assert v.prompt["8"]["inputs"] == {"steps": 4, "width": 1024, "height": 1024}
    assert v.prompt["6"]["inputs"]["cfg"] == 3.5
    assert v.prompt["7"]["inputs"]["sampler_name"] == "euler"
    assert v.prompt["12"]["inputs"]["samples"] == ["11", 0]  # an int id is accepted and normalised
    assert p["8"]["inputs"]["steps"] == "4"  # the caller's prompt is left alone


# ------------------------------------------------------------------------------------------ invalid files

CASES = [  # (file, node blamed, error type, top-level error type)
    ("missing_text", "4", "required_input_missing", FAILED),  # CLIPTextEncode without its prompt text
    ("missing_vae_link", "12", "required_input_missing", FAILED),  # VAEDecode with vae unconnected
    ("missing_latent_link", "11", "required_input_missing", FAILED),  # sampler without latent_image
    ("link_three_items", "12", "bad_linked_input", FAILED),  # samples: ["11", 0, 1]
    ("link_slot_not_int", "11", "bad_linked_input", FAILED),  # sigmas: ["8", "0"]
    ("link_to_missing_node", "12", "bad_linked_input", FAILED),  # vae: ["99", 0], no node 99
    ("link_slot_out_of_range", "13", "bad_linked_input", FAILED),  # images: ["12", 1], VAEDecode has one output
    ("model_into_vae", "12", "return_type_mismatch", FAILED),  # MODEL wired into VAEDecode.vae
    ("clip_into_positive", "6", "return_type_mismatch", FAILED),  # CLIP wired into CFGGuider.positive
    ("sigmas_into_sampler_combo", "7", "return_type_mismatch", FAILED),  # SIGMAS into a COMBO
    ("steps_not_int", "8", "invalid_input_type", FAILED),  # steps: "four"
    ("cfg_not_float", "6", "invalid_input_type", FAILED),  # cfg: "high"
    ("text_not_string", "4", "invalid_input_type", FAILED),  # text: 42
    ("literal_for_model", "6", "invalid_input_type", FAILED),  # model: a file name instead of a link
    ("steps_zero", "8", "value_smaller_than_min", FAILED),
    ("seed_negative", "9", "value_smaller_than_min", FAILED),
    ("cfg_negative", "6", "value_smaller_than_min", FAILED),
    ("width_too_big", "10", "value_bigger_than_max", FAILED),  # 20000 > 16384
    ("batch_too_big", "10", "value_bigger_than_max", FAILED),
    ("unet_not_in_list", "1", "value_not_in_list", FAILED),  # a file not in models/diffusion_models
    ("sampler_not_in_list", "7", "custom_validation_failed", FAILED),  # dpmpp_3m_sde: ComfyUI lists it, we refuse it
    ("clip_type_not_in_list", "2", "value_not_in_list", FAILED),  # type "flux", not "flux2"
    ("self_cycle", "5", "dependency_cycle", FAILED),  # ConditioningZeroOut fed by itself
    ("two_node_cycle", "5", "dependency_cycle", FAILED),  # 5 -> 14 ReferenceLatent -> 5
    ("error_upstream", "5", "required_input_missing", FAILED),  # the defect is two links above the output
    ("missing_node_type", "6", "missing_node_type", "missing_node_type"),  # BasicGuider is not ours
    ("missing_class_type", "9", "invalid_prompt", "invalid_prompt"),
    ("node_not_object", "7", "invalid_prompt", "invalid_prompt"),  # "7": "euler"
    ("inputs_not_object", "8", "invalid_prompt", "invalid_prompt"),  # inputs: [4, 1024, 1024]
    ("no_outputs", None, "prompt_no_outputs", "prompt_no_outputs"),  # no SaveImage
]


def test_every_invalid_file_is_in_the_table() -> None:
    assert sorted(p.stem for p in INVALID.glob("*.json")) == sorted(c[0] for c in CASES)
    assert len(CASES) >= 22


@pytest.mark.parametrize(("name", "node", "error_type", "top_type"), CASES, ids=[c[0] for c in CASES])
def test_invalid_workflow(folders: Folders, name: str, node: str | None, error_type: str, top_type: str) -> None:
    p = json.loads((INVALID / f"{name}.json").read_text())
    v = validate(p, ENGINE_NODES, folders)
    r = v.response()
    assert not v.ok and v.outputs == () and v.dag.number_of_nodes() == 0
    assert json.loads(json.dumps(r)) == r
    assert set(r) == {"error", "node_errors"}
    assert set(r["error"]) == {"type", "message", "details", "extra_info"}
    assert r["error"]["type"] == top_type
    if top_type != FAILED:  # ComfyUI answers these before looking at inputs: no node_errors
        assert r["node_errors"] == {}
        if node is not None:
            assert r["error"]["extra_info"]["node_id"] == node
            assert f"'#{node}'" in r["error"]["details"]
        if error_type == "missing_node_type":
            assert r["error"]["extra_info"]["class_type"] == p[node]["class_type"]
        return
    assert node in r["node_errors"], r
    entry = r["node_errors"][node]
    assert set(entry) == {"errors", "dependent_outputs", "class_type"}
    assert entry["class_type"] == p[node]["class_type"]
    assert entry["dependent_outputs"] == ["13"]
    assert [e["type"] for e in entry["errors"]] == [error_type]
    e = entry["errors"][0]
    assert set(e) == {"type", "message", "details", "extra_info"}
    name_ = e["extra_info"]["input_name"]
    assert e["details"].startswith(name_), e  # the input is named first, as in ComfyUI
    assert f"Node {node} ({entry['class_type']})" in r["error"]["details"]
    # As in ComfyUI, nodes downstream of the bad one are not listed: they have no error of their own.
    assert all(err["errors"] for err in r["node_errors"].values())
    assert ("13" in r["node_errors"]) == (node == "13")


# ------------------------------------------------------------------------------------------ messages


def _errors(p: dict, folders: Folders | None, node: str) -> list[dict]:
    return validate(p, ENGINE_NODES, folders).node_errors[node]["errors"]


def test_messages_carry_comfyui_wording_and_the_allowed_values(folders: Folders) -> None:
    (e,) = _errors(prompt(**{"8": {"class_type": "Flux2Scheduler", "inputs": {"steps": 0, "width": 1024,
                                                                               "height": 1024}}}), folders, "8")
    assert e["message"] == "Value 0 smaller than min of 1"
    assert e["details"] == "steps: allowed 1..4096; set steps to at least 1"
    assert e["extra_info"] == {"input_name": "steps", "received_value": 0,
                               "input_config": ["INT", {"default": 20, "min": 1, "max": 4096}]}
    (e,) = _errors(prompt(**{"10": {"class_type": "EmptyFlux2LatentImage",
                                    "inputs": {"width": 20000, "height": 1024, "batch_size": 1}}}), folders, "10")
    assert e["message"] == "Value 20000 bigger than max of 16384"
    (e,) = _errors(prompt(**{"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "nope.safetensors",
                                                                          "weight_dtype": "default"}}}),
                   folders, "1")
    assert e["message"] == "Value not in list"
    assert e["details"].startswith(f"unet_name: 'nope.safetensors' not in ['{UNET}']")
    (e,) = _errors(prompt(**{"8": {"class_type": "Flux2Scheduler", "inputs": {"steps": "four", "width": 1024,
                                                                               "height": 1024}}}), folders, "8")
    assert e["message"] == "Failed to convert an input value to a INT value"
    assert e["details"].startswith("steps, four, invalid literal for int()")
    (e,) = _errors(prompt(**{"12": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["1", 0]}}}),
                   folders, "12")
    assert e["message"] == "Return type mismatch between linked nodes"
    assert e["details"].startswith("vae, received_type(MODEL) mismatch input_type(VAE)")
    assert e["extra_info"]["received_type"] == "MODEL" and e["extra_info"]["linked_node"] == ["1", 0]


def test_long_file_lists_are_truncated(tmp_path: Path) -> None:
    d = tmp_path / "diffusion_models"
    d.mkdir()
    for i in range(30):
        (d / f"model_{i:02}.safetensors").write_bytes(b"")
    p = {"1": {"class_type": "VGLoadTransformer", "inputs": {"file": "other.safetensors"}},
         "2": {"class_type": "Out", "inputs": {"value": ["1", 0]}}}
    nodes = {"VGLoadTransformer": ENGINE_NODES["VGLoadTransformer"], "Out": _out_node("VG_MODEL")}
    (e,) = validate(p, nodes, Folders(models=(tmp_path,))).node_errors["1"]["errors"]
    assert e["type"] == "value_not_in_list"
    assert "(list of length 30)" in e["details"] and "model_19" in e["details"] and "model_20" not in e["details"]
    assert f"searched {tmp_path / 'diffusion_models'}" in e["details"]
    assert "put the file in a diffusion_models/ folder" in e["details"]
    assert e["extra_info"]["input_config"] is None  # as ComfyUI: no giant lists in the response


def test_without_folders_a_file_list_is_empty_and_says_so() -> None:
    (e,) = _errors(KLEIN, None, "1")
    assert e["type"] == "value_not_in_list" and "[] (the list is empty)" in e["details"]


def test_top_level_messages() -> None:
    r = validate({"1": {"class_type": "FluxGuidance", "inputs": {}}}, ENGINE_NODES).response()
    assert r["error"]["message"] == "Node 'FluxGuidance' not found. The custom node may not be installed."
    assert r["error"]["details"] == "Node ID '#1'"
    r = validate({"1": {"inputs": {}}}, ENGINE_NODES).response()
    assert r["error"]["message"] == "Cannot execute because a node is missing the class_type property."
    r = validate({}, ENGINE_NODES).response()
    assert r["error"]["type"] == "prompt_no_outputs" and r["error"]["message"] == "Prompt has no outputs"
    r = validate(["not", "a", "prompt"], ENGINE_NODES).response()  # type: ignore[arg-type]
    assert r["error"]["type"] == "invalid_prompt" and r["node_errors"] == {}


def test_cycle_names_the_inputs_and_the_ring(folders: Folders) -> None:
    v = validate(json.loads((INVALID / "two_node_cycle.json").read_text()), ENGINE_NODES, folders)
    assert set(v.node_errors) == {"5", "14"}
    e = v.node_errors["14"]["errors"][0]
    assert e["extra_info"] == {"input_name": "conditioning", "cycle": ["14", "5"]}
    assert "14 -> 5 -> 14" in e["details"]


def test_several_errors_in_one_node_are_all_reported(folders: Folders) -> None:
    p = prompt(**{"8": {"class_type": "Flux2Scheduler", "inputs": {"steps": 0, "width": "wide"}}})
    errors = _errors(p, folders, "8")
    assert [(e["type"], e["extra_info"]["input_name"]) for e in errors] == [
        ("value_smaller_than_min", "steps"), ("invalid_input_type", "width"), ("required_input_missing", "height")]


# ------------------------------------------------------------------------------------------ several outputs


def test_a_bad_branch_drops_only_its_output(folders: Folders) -> None:
    """Two outputs; 15 decodes with a MODEL as its VAE. ComfyUI accepts the prompt and runs output 13 only."""
    p = prompt(**{"15": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["1", 0]}},
                  "16": {"class_type": "PreviewImage", "inputs": {"images": ["15", 0]}}})
    v = validate(p, ENGINE_NODES, folders)
    assert v.ok and v.error is None and v.outputs == ("13",)
    assert list(v.node_errors) == ["15"]
    assert v.node_errors["15"]["dependent_outputs"] == ["16"]
    assert "15" not in v.dag and "16" not in v.dag and "13" in v.dag


def test_a_shared_bad_node_lists_every_output_it_costs(folders: Folders) -> None:
    p = prompt(**{"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "x.safetensors",
                                                               "weight_dtype": "default"}},
                  "16": {"class_type": "PreviewImage", "inputs": {"images": ["12", 0]}}})
    v = validate(p, ENGINE_NODES, folders)
    assert not v.ok and v.node_errors["1"]["dependent_outputs"] == ["13", "16"]


def test_selected_outputs_only(folders: Folders) -> None:
    p = prompt(**{"15": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["1", 0]}},
                  "16": {"class_type": "PreviewImage", "inputs": {"images": ["15", 0]}}})
    assert validate(p, ENGINE_NODES, folders, outputs=["13"]).node_errors == {}
    v = validate(p, ENGINE_NODES, folders, outputs=["16"])
    assert not v.ok and v.error["type"] == FAILED
    v = validate(p, ENGINE_NODES, folders, outputs=["12"])  # not an output node
    assert v.error["type"] == "prompt_no_outputs"


# ------------------------------------------------------------------------------------------ conversions


def _out_node(input_type: object, **opts: object) -> type:
    spec = (input_type, opts) if opts else (input_type,)
    return type("Out", (), {"RETURN_TYPES": (), "OUTPUT_NODE": True,
                            "INPUT_TYPES": classmethod(lambda cls: {"required": {"value": spec},
                                                                    "optional": {"extra": (STRING, {"default": "x"})},
                                                                    "hidden": {"prompt": "PROMPT"}})})


@pytest.mark.parametrize(("value", "expected"), [(True, True), (0, False), ("false", False), ("True", True)])
def test_boolean_accepts_true_false(value: object, expected: bool) -> None:
    v = validate({"1": {"class_type": "Out", "inputs": {"value": value}}}, {"Out": _out_node(BOOLEAN)})
    assert v.ok and v.prompt["1"]["inputs"]["value"] is expected


@pytest.mark.parametrize("value", ["maybe", 2, None, 0.5])
def test_boolean_rejects_the_rest(value: object) -> None:
    v = validate({"1": {"class_type": "Out", "inputs": {"value": value}}}, {"Out": _out_node(BOOLEAN)})
    (e,) = v.node_errors["1"]["errors"]
    assert e["type"] == "invalid_input_type"
    assert e["message"] == "Failed to convert an input value to a BOOLEAN value"


def test_comfy_v3_combo_and_any() -> None:
    nodes = {"Out": _out_node("COMBO", options=["a", "b"])}
    assert validate({"1": {"class_type": "Out", "inputs": {"value": "a"}}}, nodes).ok
    (e,) = validate({"1": {"class_type": "Out", "inputs": {"value": "c"}}}, nodes).node_errors["1"]["errors"]
    assert e["type"] == "value_not_in_list" and "['a', 'b']" in e["details"]
    assert validate({"1": {"class_type": "Out", "inputs": {"value": {"any": 1}}}}, {"Out": _out_node("*")}).ok


def test_hidden_never_required_optional_may_be_absent_and_defaults_not_applied() -> None:
    v = validate({"1": {"class_type": "Out", "inputs": {"value": 1.5}}}, {"Out": _out_node("FLOAT", min=0.0)})
    assert v.ok and v.prompt["1"]["inputs"] == {"value": 1.5}


def test_inputs_with_defaults(folders: Folders) -> None:
    cls = ENGINE_NODES["EmptyFlux2LatentImage"]
    assert inputs_with_defaults(cls, {"width": 512}) == {"width": 512, "height": 1024, "batch_size": 1}
    assert inputs_with_defaults(ENGINE_NODES["SaveImage"], {"images": ["12", 0]}) == {
        "images": ["12", 0], "filename_prefix": "ComfyUI"}
    # Only inputs with a default are filled: links, and COMBOs without one, stay absent.
    assert inputs_with_defaults(ENGINE_NODES["UNETLoader"], {}, folders) == {}
    assert inputs_with_defaults(_out_node(IMAGE), {}) == {"extra": "x"}


def test_input_types_raising_is_reported() -> None:
    def broken(cls: type) -> dict:
        raise RuntimeError("no folder_paths")

    nodes = {"Out": type("Out", (), {"RETURN_TYPES": (), "OUTPUT_NODE": True, "INPUT_TYPES": classmethod(broken)})}
    v = validate({"1": {"class_type": "Out", "inputs": {}}}, nodes)
    (e,) = v.node_errors["1"]["errors"]
    assert e["type"] == "exception_during_validation" and "no folder_paths" in e["details"]


# ------------------------------------------------------------------------------------------ errors


def test_validation_failed_carries_the_response(folders: Folders) -> None:
    v = validate(json.loads((INVALID / "steps_zero.json").read_text()), ENGINE_NODES, folders)
    with pytest.raises(ValidationFailed) as info:
        v.check()
    err = info.value
    assert isinstance(err, VramgraphError)
    assert err.response == v.response() and err.type == FAILED
    assert err.to_dict() == v.response()["error"]
    assert err.node_errors["8"]["class_type"] == "Flux2Scheduler"
    assert isinstance(v, Validation)


def test_error_shapes() -> None:
    for err in (WorkflowError("Not a workflow", "x.json: expected JSON; export with 'Save (API)'"),
                InterruptedRun("11", "SamplerCustomAdvanced")):
        d = err.to_dict()
        assert set(d) == {"type", "message", "details", "extra_info"}
        assert json.loads(json.dumps(d)) == d
    assert WorkflowError("m").type == "invalid_prompt"


def test_node_execution_error_is_comfyui_execution_error() -> None:
    try:
        raise ValueError("the negative conditioning must carry the same reference latents")
    except ValueError as ex:
        err = NodeExecutionError.from_exception("11", "SamplerCustomAdvanced", ex, {"cfg": 2.0, "noise": object()},
                                                prompt_id="p1", executed=["1", "2"])
    d = err.to_dict()
    assert list(d) == ["prompt_id", "node_id", "node_type", "executed", "exception_message", "exception_type",
                       "traceback", "current_inputs", "current_outputs"]
    assert d["node_id"] == "11" and d["node_type"] == "SamplerCustomAdvanced" and d["executed"] == ["1", "2"]
    assert d["exception_type"] == "ValueError" and d["exception_message"].startswith("the negative")
    assert d["traceback"] and "test_validate.py" in d["traceback"][0]
    assert d["current_inputs"]["cfg"] == [2.0] and isinstance(d["current_inputs"]["noise"][0], str)
    assert json.loads(json.dumps(d)) == d
    assert isinstance(err, VramgraphError) and "Node 11 (SamplerCustomAdvanced)" in str(err)
