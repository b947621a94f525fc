"""The Python API (api/pipeline.py): a Pipeline over tiny random-weight models, on the CPU.

Generations are 64x64 so the file runs in seconds; the same budget, planner and errors as the command line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vramgraph import Pipeline
from vramgraph.graph.plan import planner
from vramgraph.graph.workflow.errors import ValidationFailed
from vramgraph.graph.workflow.roles import build_prompt, find_roles
from vramgraph.graph.workflow.validate import validate
from vramgraph.nodes import ENGINE_NODES
from vramgraph.nodes.files import Folders

ROOT = Path(__file__).resolve().parents[1]
SIDE = 64


@pytest.fixture
def pipe(tiny_models: Path, tmp_path: Path) -> Pipeline:
    return Pipeline(tiny_models, input=tmp_path / "input", output=tmp_path / "output")


def _loads(pipe: Pipeline, since: int) -> list[str]:
    return [e.model.split(":")[0] for e in pipe.engine.ledger.events.since(since) if e.kind == "load"]


def test_import_is_light_and_pipeline_is_lazy() -> None:
    """`import vramgraph` imports no torch; `from vramgraph import Pipeline` works (PEP 562) and neither does."""
    code = ("import sys, vramgraph; assert 'torch' not in sys.modules; from vramgraph import Pipeline; "
            "assert 'torch' not in sys.modules; print(Pipeline.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["vramgraph.api.pipeline"]


def test_generate_records_the_seed_and_keeps_models(pipe: Pipeline) -> None:
    fox = pipe.generate("a red fox", seed=7, width=SIDE, height=SIDE)
    assert fox.seed == 7 and fox.text == "a red fox"
    (image,) = fox.images
    (path,) = fox.paths
    assert image.size == (SIDE, SIDE) and path.is_file() and path.parent == pipe.folders.output / "vramgraph"
    assert image.info["seed"] == "7" and json.loads(image.info["prompt"]) == fox.prompt
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(path)))
    n = pipe.engine.ledger.events.mark()
    again = pipe.generate("a red fox", seed=8, width=SIDE, height=SIDE)
    assert _loads(pipe, n) == []  # the models stayed loaded
    assert not np.array_equal(np.asarray(again.images[0]), np.asarray(image))  # another seed, another picture
    rand = pipe.generate("a red fox", width=SIDE, height=SIDE)  # no seed: a random one, recorded
    assert rand.images[0].info["seed"] == str(rand.seed)


def test_generate_many_is_one_queue_with_counted_seeds(pipe: Pipeline) -> None:
    n = pipe.engine.ledger.events.mark()
    made = pipe.generate(["a boat", "a lighthouse", "a gull"], seed=3, width=SIDE, height=SIDE)
    assert [g.seed for g in made] == [3, 4, 5]
    assert sorted(_loads(pipe, n)) == ["text_encoder", "transformer", "vae"]  # one load each for three images
    for g in made:
        assert json.loads(g.images[0].info["prompt"]) == g.prompt
        assert g.images[0].info["seed"] == str(g.seed)
    alone = pipe.generate("a lighthouse", seed=4, width=SIDE, height=SIDE)
    assert np.array_equal(np.asarray(alone.images[0]), np.asarray(made[1].images[0]))  # bit for bit


def test_generate_with_reference_images(pipe: Pipeline, input_dir: Path) -> None:
    pil = Image.open(input_dir / "reference_2.png")
    one = pipe.generate("make it blue", seed=1, width=SIDE, height=SIDE, images=[input_dir / "reference.png"])
    assert {n["class_type"] for n in one.prompt.values()} >= {"VGLoadImage", "VGReferenceImage"}
    three = pipe.generate("all three", seed=1, width=SIDE, height=SIDE,
                          images=[input_dir / "reference.png", pil, str(input_dir / "handbag_white.png")])
    roles = find_roles(three.prompt)
    assert len(roles.references) == 3
    names = [three.prompt[load]["inputs"]["image"] for _, load in roles.references]
    assert len(set(names)) == 3 and all((pipe.folders.input / n).is_file() for n in names)
    assert three.images[0].size == (SIDE, SIDE)
    with pytest.raises(ValueError, match="not a readable image"):
        pipe.generate("x", width=SIDE, height=SIDE, images=[input_dir])


@pytest.mark.parametrize(("kw", "message"), [
    ({"steps": 0}, "steps=0: must be a whole number from 1 to 1000"),
    ({"width": 100}, "width=100: must be a multiple of 16 from 16 to 16384"),
    ({"height": 0}, "height=0: must be a multiple of 16"),
    ({"guidance": -1.0}, "guidance=-1.0: must be a number from 0.0 to 100.0"),
    ({"seed": -1}, "seed=-1: must be a whole number from 0"),
    ({"steps": 2.5}, "steps=2.5: must be a whole number"),
])
def test_generate_refuses_impossible_values(pipe: Pipeline, kw: dict, message: str) -> None:
    args = {"width": SIDE, "height": SIDE, **kw}
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        pipe.generate("a fox", **args)
    assert not pipe.folders.output.exists()  # refused before anything ran


def test_run_a_workflow_file_or_dict(pipe: Pipeline, input_dir: Path) -> None:
    pipe.folders.input.mkdir(parents=True)
    shutil.copy(input_dir / "reference.png", pipe.folders.input / "reference.png")
    out = pipe.run("workflows/edit.json", set={"Prompt.text": "make it blue", "5.width": SIDE, "Size.height": SIDE})
    assert list(out.files) == ["8"] and out.paths == out.files["8"]
    (image,) = out.images["8"]
    assert image.size == (SIDE, SIDE)
    assert json.loads(image.info["prompt"])["4"]["inputs"]["text"] == "make it blue"
    prompt = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompt["5"]["inputs"].update(width=SIDE, height=SIDE)
    a, b = pipe.run([prompt, "text_to_image.json"], set={"5.width": SIDE, "5.height": SIDE, "6.seed": 43})
    assert a.result is b.result and a.result.loads == 0  # one queue; the models were still loaded from the edit
    assert a.images["8"][0].info["seed"] == "43" and b.images["8"][0].info["seed"] == "43"
    with pytest.raises(ValueError, match="no node with id or title 'Nope'"):
        pipe.run("text_to_image.json", set={"Nope.seed": 1})


def test_errors_are_the_engines(pipe: Pipeline, tmp_path: Path) -> None:
    prompt = build_prompt("x", width=SIDE, height=SIDE, transformer="absent.safetensors")
    with pytest.raises(ValidationFailed) as info:
        pipe.run(prompt)
    (error,) = info.value.node_errors["1"]["errors"]
    assert error["type"] == "value_not_in_list"
    with pytest.raises(planner.PlanError):
        pipe.plan("text_to_image.json", vram="1MiB")
    with pytest.raises(ValueError, match="write 12GiB"):
        Pipeline(tmp_path, vram="12")
    with pytest.raises(ValueError, match=r"cuda:7"):
        Pipeline(tmp_path, device="cuda:7")


def test_plan_loads_no_weights(tmp_path: Path) -> None:
    """A plan from the built-in klein-4B sizes: nothing on disk, nothing loaded, the allocator not capped. (Host RAM
    as on the GPU host: with less than the transformer's 7.2 GiB free here, it could not be pinned, and streaming it
    would beat reading it from the file.)"""
    pipe = Pipeline(tmp_path / "no-models", vram="11GiB", host="64GiB")
    plan = pipe.plan("text_to_image.json")
    big = pipe.plan("text_to_image.json", size="1536x1536")
    assert pipe._engine is None  # no running engine was made
    labels = [plan.label(s.step.model) for s in plan.steps if isinstance(s.step, planner.Load)]
    assert sorted(labels) == ["text encoder", "transformer", "vae"]  # one after the other: nothing streams at 11 GiB
    assert [s for s in plan.steps if s.blocks is not None] == []
    small = pipe.plan("text_to_image.json", vram="8GiB")  # the transformer does not fit the card: streamed
    assert [small.label(s.blocks.model) for s in small.steps if s.blocks is not None] == ["transformer"]
    assert plan.budget.gpu <= 11 * 2**30 and plan.peak <= plan.budget.gpu
    def unloads(p: planner.Plan) -> list[str]:
        return [p.label(s.step.model) for s in p.steps if isinstance(s.step, planner.Unload)]

    # at 1536² the decode no longer fits beside the transformer: the transformer leaves for it
    assert unloads(plan) == ["text encoder"] and unloads(big) == ["text encoder", "transformer"]
    assert pipe.plan("text_to_image.json", vram="80GiB").budget.gpu > plan.budget.gpu
    assert not (tmp_path / "no-models").exists()


def test_demo_pipeline_runs_every_shipped_workflow(tmp_path: Path) -> None:
    """Pipeline.demo writes tiny models and the input images the shipped edit workflows load."""
    pipe = Pipeline.demo(tmp_path / "demo")
    assert sorted(p.name for p in (tmp_path / "demo" / "input").iterdir()) == ["reference.png", "reference_2.png"]
    for wf in sorted((ROOT / "workflows").glob("*.json")):
        sets = {"10.width": SIDE, "10.height": SIDE, "8.width": SIDE, "8.height": SIDE} \
            if wf.stem == "core_text_to_image" else {"5.width": SIDE, "5.height": SIDE, "Sampler.steps": 2}
        out = pipe.run(wf, set=sets)
        assert [im.size for ims in out.images.values() for im in ims] == [(SIDE, SIDE)], wf.name


def test_prompts_come_from_roles_not_ids() -> None:
    """The roles of a shipped workflow are found whatever its ids; build_prompt fills them in."""
    wf = json.loads((ROOT / "workflows" / "multi_reference.json").read_text())
    ids = {old: f"n{i}" for i, old in enumerate(reversed(list(wf)))}
    renamed = {ids[k]: {**v, "inputs": {n: [ids[x[0]], x[1]] if isinstance(x, list) else x
                                       for n, x in v["inputs"].items()}} for k, v in wf.items()}
    roles = find_roles(renamed)
    assert roles.sampler == ids["6"] and roles.positive == ids["4"] and roles.latent == ids["5"]
    assert roles.references == ((ids["11"], ids["10"]), (ids["13"], ids["12"])) and roles.negative is None
    assert dict(roles.loaders) == {"transformer": ids["1"], "text_encoder": ids["2"], "vae": ids["3"]}
    base_edit = build_prompt("a", negative="blurry", references=("r1.png",))
    r = find_roles(base_edit)
    assert base_edit[r.negative]["inputs"]["text"] == "blurry" and base_edit[r.sampler]["inputs"]["guidance"] == 4.0
    four = build_prompt("b", references=("a.png", "b.png", "c.png", "d.png"))
    r = find_roles(four)
    assert [four[load]["inputs"]["image"] for _, load in r.references] == ["a.png", "b.png", "c.png", "d.png"]


def _checkpoint_root(tiny_models: Path, tmp_path: Path) -> Path:
    """A models folder whose checkpoints/ holds one whole model: a folder of the three component files."""
    models = tmp_path / "models"
    ckpt = models / "checkpoints" / "klein-tiny"
    ckpt.mkdir(parents=True)
    for rel in ("diffusion_models/flux-2-klein-4b.safetensors", "text_encoders/qwen_3_4b.safetensors",
                "vae/flux2-vae.safetensors"):
        shutil.copy(tiny_models / rel, ckpt / Path(rel).name)
    (models / "checkpoints" / "not-a-model").mkdir()
    return models


def test_checkpoints_come_only_from_the_list(tiny_models: Path, tmp_path: Path) -> None:
    models = _checkpoint_root(tiny_models, tmp_path)
    folders = Folders(models=(models,), input=tmp_path / "in", output=tmp_path / "out")
    (choices,) = ENGINE_NODES["VGLoadCheckpoint"].INPUT_TYPES(folders=folders)["required"]["checkpoint"]
    assert choices == ["klein-tiny"]
    for bad in ("/etc", "../models/checkpoints/klein-tiny", str(models / "checkpoints" / "klein-tiny"),
                "not-a-model"):
        check = validate(build_prompt("x", checkpoint=bad), ENGINE_NODES, folders)
        (error,) = check.response()["node_errors"]["1"]["errors"]
        assert error["type"] == "value_not_in_list", bad
    pipe = Pipeline(models, checkpoint="klein-tiny", input=tmp_path / "in", output=tmp_path / "out")
    made = pipe.generate("a fox", seed=2, width=SIDE, height=SIDE)
    assert made.prompt["1"]["class_type"] == "VGLoadCheckpoint" and made.images[0].size == (SIDE, SIDE)
    files = Pipeline(tiny_models, input=tmp_path / "in", output=tmp_path / "out2")
    same = files.generate("a fox", seed=2, width=SIDE, height=SIDE)
    assert np.array_equal(np.asarray(same.images[0]), np.asarray(made.images[0]))  # the same weights


def test_checkpoint_path_adds_its_parent_as_a_root(tiny_models: Path, tmp_path: Path) -> None:
    models = _checkpoint_root(tiny_models, tmp_path)
    elsewhere = tmp_path / "elsewhere" / "my-klein"
    shutil.copytree(models / "checkpoints" / "klein-tiny", elsewhere)
    pipe = Pipeline(tmp_path / "empty", checkpoint=elsewhere, input=tmp_path / "in", output=tmp_path / "out")
    assert pipe.checkpoint == "my-klein" and pipe.folders.list("checkpoints") == ["my-klein"]
    assert pipe.generate("a fox", seed=2, width=SIDE, height=SIDE).prompt["1"]["inputs"] == {"checkpoint": "my-klein"}
    with pytest.raises(ValueError, match="no such folder"):
        Pipeline(tmp_path, checkpoint=tmp_path / "absent" / "x")
