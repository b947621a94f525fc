"""A PNG is a workflow (its `prompt` and `workflow` text chunks, as ComfyUI writes them), and values set with
--set are written back into the UI workflow where the UI keeps them (graph/workflow/uiedit.py), or the UI workflow is
left out when it cannot hold them."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from vramgraph.api.pipeline import load
from vramgraph.graph.workflow.parse import WorkflowFormatError, load_workflow, ui_to_api
from vramgraph.graph.workflow.uiedit import ui_with_sets
from vramgraph.nodes import ENGINE_NODES

API = {"5": {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": 512, "height": 256, "batch_size": 1},
             "_meta": {"title": "Size"}}}


def _latent(node_id: int, values: list, inputs: list | None = None) -> dict:
    return {"id": node_id, "type": "EmptyFlux2LatentImage", "mode": 0, "inputs": inputs or [],
            "outputs": [{"name": "LATENT", "type": "LATENT", "links": []}], "widgets_values": values}


def _png(path, **text) -> None:
    info = PngInfo()  # as ComfyUI's SaveImage writes them: PIL's add_text, json.dumps
    for key, value in text.items():
        info.add_text(key, value if isinstance(value, str) else json.dumps(value))
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(path, pnginfo=info)


def test_a_comfyui_png_runs_its_prompt_and_keeps_its_workflow(tmp_path):
    ui = {"nodes": [_latent(5, [512, 256, 1])], "links": [], "version": 0.4}
    _png(tmp_path / "ComfyUI_00001_.png", prompt=API, workflow=ui)
    wf = load_workflow(tmp_path / "ComfyUI_00001_.png")
    assert wf.prompt == API and wf.ui == ui
    _png(tmp_path / "ui_only.png", workflow=ui)  # no prompt chunk: the UI workflow is converted
    assert load_workflow(tmp_path / "ui_only.png").prompt["5"]["inputs"] == API["5"]["inputs"]
    _png(tmp_path / "api_only.png", prompt=API)
    assert load_workflow(tmp_path / "api_only.png").ui is None


def test_a_png_without_a_workflow_is_a_clear_error(tmp_path):
    _png(tmp_path / "plain.png", comment="hello")
    with pytest.raises(WorkflowFormatError, match="carries no workflow") as e:
        load_workflow(tmp_path / "plain.png")
    assert "'prompt' and 'workflow' text chunks" in e.value.to_dict()["details"]
    _png(tmp_path / "broken.png", prompt="{not json")
    with pytest.raises(WorkflowFormatError, match="'prompt' text chunk is not JSON"):
        load_workflow(tmp_path / "broken.png")


def test_set_writes_the_node_widget_and_the_primitive_that_feeds_it():
    ui = {"nodes": [_latent(5, [1024, 1024, 1], [{"name": "width", "type": "INT", "widget": {"name": "width"},
                                                   "link": 1}]),
                    {"id": 9, "type": "PrimitiveNode", "mode": 0, "outputs": [{"type": "INT", "links": [1],
                                                                                "widget": {"name": "width"}}],
                     "widgets_values": [768, "fixed"]}],
          "links": [[1, 9, 0, 5, 0, "INT"]], "version": 0.4}
    assert ui_to_api(ui, ENGINE_NODES)["5"]["inputs"] == {"width": 768, "height": 1024, "batch_size": 1}
    edited, why = ui_with_sets(ui, [("5", "width", 320), ("5", "height", 192)], ENGINE_NODES)
    assert why == "" and edited["nodes"][1]["widgets_values"] == [320, "fixed"]  # the primitive holds the width
    assert edited["nodes"][0]["widgets_values"] == [1024, 192, 1]
    assert ui_to_api(edited, ENGINE_NODES)["5"]["inputs"] == {"width": 320, "height": 192, "batch_size": 1}
    assert ui["nodes"][1]["widgets_values"] == [768, "fixed"]  # the original is left alone


def test_set_over_a_link_unlinks_the_input():
    ui = {"nodes": [_latent(5, [1024, 1024, 1], [{"name": "width", "type": "INT", "widget": {"name": "width"},
                                                   "link": 3}]),
                    {"id": 7, "type": "PrimitiveInt", "mode": 0, "outputs": [{"type": "INT", "links": [3]}],
                     "widgets_values": [640, "fixed"]}],
          "links": [[3, 7, 0, 5, 0, "INT"]], "version": 0.4}
    assert ui_to_api(ui, ENGINE_NODES)["5"]["inputs"]["width"] == ["7", 0]
    edited, why = ui_with_sets(ui, [("5", "width", 256)], ENGINE_NODES)
    assert why == ""
    assert edited["links"] == [] and edited["nodes"][0]["inputs"][0]["link"] is None
    assert edited["nodes"][1]["outputs"][0]["links"] == []
    assert ui_to_api(edited, ENGINE_NODES)["5"]["inputs"]["width"] == 256


def _subgraph_ui(instances: list[int], promoted: bool) -> dict:
    inner = _latent(2, [1024, 1024, 1], [{"name": "width", "type": "INT", "widget": {"name": "width"}, "link": 1}]
                    if promoted else [])
    sg = {"id": "sg-1", "name": "Size", "nodes": [inner], "inputs": ([{"name": "width", "type": "INT",
                                                                         "linkIds": [1]}] if promoted else []),
          "outputs": [{"name": "LATENT", "type": "LATENT", "linkIds": [2]}],
          "links": ([{"id": 1, "origin_id": -10, "origin_slot": 0, "target_id": 2, "target_slot": 0, "type": "INT"}]
                    if promoted else [])
          + [{"id": 2, "origin_id": 2, "origin_slot": 0, "target_id": -20, "target_slot": 0, "type": "LATENT"}]}
    nodes = [{"id": i, "type": "sg-1", "mode": 0, "inputs": [], "outputs": [{"type": "LATENT", "links": []}],
              "widgets_values": [1024] if promoted else []} for i in instances]
    return {"nodes": nodes, "links": [], "definitions": {"subgraphs": [sg]}, "version": 0.4}


def test_set_inside_subgraphs():
    promoted = _subgraph_ui([75], promoted=True)  # the instance holds the promoted widget's value
    edited, why = ui_with_sets(promoted, [("75:2", "width", 448)], ENGINE_NODES)
    assert why == "" and edited["nodes"][0]["widgets_values"] == [448]
    assert ui_to_api(edited, ENGINE_NODES)["75:2"]["inputs"]["width"] == 448

    one = _subgraph_ui([75], promoted=False)  # the inner node holds it (newer front ends): written there
    edited, why = ui_with_sets(one, [("75:2", "height", 320)], ENGINE_NODES)
    assert why == "" and edited["definitions"]["subgraphs"][0]["nodes"][0]["widgets_values"] == [1024, 320, 1]

    shared = _subgraph_ui([75, 80], promoted=False)  # two instances share the inner node: no faithful UI workflow
    edited, why = ui_with_sets(shared, [("75:2", "height", 320)], ENGINE_NODES)
    assert edited is None and "80:2.height" in why
    both, why = ui_with_sets(shared, [("75:2", "height", 320), ("80:2", "height", 320)], ENGINE_NODES)
    assert why == "" and ui_to_api(both, ENGINE_NODES)["80:2"]["inputs"]["height"] == 320


def test_load_with_sets_keeps_a_faithful_workflow_or_none(tmp_path, caplog):
    path = tmp_path / "shared.json"
    path.write_text(json.dumps(_subgraph_ui([75, 80], promoted=False)))
    with caplog.at_level(logging.WARNING, logger="vramgraph"):
        wf = load(path, {"75:2.height": 320})
    assert wf.prompt["75:2"]["inputs"]["height"] == 320 and wf.prompt["80:2"]["inputs"]["height"] == 1024
    assert wf.ui is None and "no 'workflow' chunk" in caplog.text and "80:2.height" in caplog.text
    wf = load(path, {"75:2.height": 320, "80:2.height": 320})
    assert wf.ui is not None and ui_to_api(wf.ui, ENGINE_NODES) == wf.prompt
    assert load(path).ui == json.loads(path.read_text())  # nothing set: the file as it is
