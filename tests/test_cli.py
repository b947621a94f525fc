"""The command line in-process (`vramgraph.cli.main([...])`): run, validate, plan, generate and run --demo.

Runs use the tiny random-weight models under the shipped workflows' file names and 64x64 pictures
(`--set 5.width=64 --set 5.height=64`), so the whole file runs in seconds on a CPU.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from PIL import Image
from test_validate import CASES
from vramgraph.cli import main
from vramgraph.graph.workflow.parse import load_workflow

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "workflows"
INVALID = Path(__file__).parent / "data" / "invalid"
SMALL = ["--set", "5.width=64", "--set", "5.height=64"]
SHIPPED = {  # workflow -> extra --set to keep it fast (the base workflow samples 50 steps)
    "text_to_image": [], "text_to_image_base": ["--set", "6.steps=2"], "edit": [], "multi_reference": [],
    "core_text_to_image": ["--set", "10.width=64", "--set", "10.height=64", "--set", "8.width=64",
                           "--set", "8.height=64"]}
GiB = 2**30


def template(name: str) -> Path:
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    assert spec is not None and spec.submodule_search_locations, "pip install comfyui-workflow-templates-json"
    return Path(next(iter(spec.submodule_search_locations))) / "templates" / name


def png_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.png")) if folder.exists() else []


def text_chunks(path: Path) -> tuple[tuple[int, int], dict[str, str]]:
    with Image.open(path) as im:
        return im.size, dict(im.text)


def expected_prompt(path: Path, sets: list[str]) -> dict:
    """The API prompt `vramgraph run` runs: the file (converted if UI format) with the --set values."""
    from vramgraph.api.pipeline import apply_sets
    from vramgraph.cli.main import parse_sets

    return apply_sets(load_workflow(path).prompt, parse_sets([s for s in sets if s != "--set"]))


# ------------------------------------------------------------------------------------------ run


@pytest.mark.parametrize("name", list(SHIPPED))
def test_run_writes_a_png_with_its_prompt_and_seed(name: str, tiny_models: Path, input_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    sets = (SMALL if name != "core_text_to_image" else []) + SHIPPED[name]  # its latent is node 10
    out, report = tmp_path / "out", tmp_path / "report.json"
    rc = main(["run", str(WORKFLOWS / f"{name}.json"), "--models", str(tiny_models), "--input", str(input_dir),
               "-o", str(out), "--report", str(report), *sets])
    assert rc == 0
    (png,) = png_files(out)
    assert capsys.readouterr().out.split() == [str(png)]  # stdout: the PNG paths, nothing else
    assert png.parent == out / "vramgraph" and png.name == f"{name}_00001_.png"
    size, text = text_chunks(png)
    assert size == (64, 64)
    assert json.loads(text["prompt"]) == expected_prompt(WORKFLOWS / f"{name}.json", sets)
    assert text["seed"] == "42"
    assert "workflow" not in text  # an API-format file has no UI workflow to embed
    rep = json.loads(report.read_text())
    assert rep["images"] == [str(png)] and rep["loads"] == 3 and rep["plan"]["steps"]


def test_run_ui_format_embeds_the_workflow(tiny_models: Path, input_dir: Path, tmp_path: Path) -> None:
    """A UI-format file (ComfyUI's text-to-image template, a subgraph) also gets the `workflow` chunk: the file with
    the --set values written where the UI keeps them, so that ComfyUI opening the PNG queues the prompt that ran;
    and the PNG itself runs again (`vramgraph run picture.png`) to the same picture."""
    from vramgraph.graph.workflow.parse import ui_to_api
    from vramgraph.nodes import ENGINE_NODES

    src = template("image_flux2_klein_text_to_image.json")
    sets = ["--set", "75:68.value=64", "--set", "75:69.value=64", "--set", "75:62.steps=2"]
    rc = main(["run", str(src), "--models", str(tiny_models), "--input", str(input_dir), "-o", str(tmp_path), *sets])
    assert rc == 0
    (png,) = png_files(tmp_path)
    size, text = text_chunks(png)
    assert size == (64, 64)
    expected = expected_prompt(src, sets)
    assert json.loads(text["prompt"]) == expected
    workflow = json.loads(text["workflow"])
    assert ui_to_api(workflow, ENGINE_NODES) == expected  # the values that ran, not the file's 1024 and 4 steps
    assert ui_to_api(json.loads(src.read_text()), ENGINE_NODES) != expected
    assert {k: v for k, v in workflow.items() if k != "definitions"} == {
        k: v for k, v in json.loads(src.read_text()).items() if k != "definitions"}  # only widget values changed
    assert text["seed"] == "0"

    again = tmp_path / "again"
    assert main(["run", str(png), "--models", str(tiny_models), "--input", str(input_dir), "-o", str(again)]) == 0
    (png2,) = png_files(again)
    size2, text2 = text_chunks(png2)
    assert size2 == (64, 64) and json.loads(text2["prompt"]) == expected and json.loads(text2["workflow"]) == workflow
    with Image.open(png) as a, Image.open(png2) as b:
        assert a.tobytes() == b.tobytes()


def test_set_with_an_unknown_node_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["run", "text_to_image.json", "--models", str(tmp_path), "-o", str(tmp_path), "--set", "99.seed=1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--set 99.seed=1" in err and "no node with id or title '99'" in err
    assert png_files(tmp_path) == []
    assert main(["run", "text_to_image.json", "--models", str(tmp_path), "--set", "Sampler-seed=1"]) == 2
    assert "NODE.INPUT=VALUE" in capsys.readouterr().err


def test_run_demo_in_an_empty_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VRAMGRAPH_MODELS", raising=False)
    monkeypatch.delenv("VRAMGRAPH_CONFIG", raising=False)
    assert main(["run", "text_to_image.json", "--demo", *SMALL]) == 0
    (png,) = png_files(tmp_path / "output")
    assert capsys.readouterr().out.split() == [str(Path("output") / "vramgraph" / png.name)]
    assert text_chunks(png)[0] == (64, 64)
    assert (tmp_path / "vramgraph-demo" / "models" / "vae" / "flux2-vae.safetensors").is_file()


# ------------------------------------------------------------------------------------------ validate


def test_validate_a_valid_workflow(tiny_models: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", str(WORKFLOWS / "text_to_image.json"), "--models", str(tiny_models), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True, "outputs": ["8"]}


@pytest.mark.parametrize(("name", "node", "error_type", "top_type"), CASES, ids=[c[0] for c in CASES])
def test_validate_prints_comfyui_errors(name: str, node: str | None, error_type: str, top_type: str,
                                        tiny_models: Path, capsys: pytest.CaptureFixture) -> None:
    """Every file in tests/data/invalid (see test_validate.py's table): exit 1 and ComfyUI's /prompt error JSON on
    stdout, blaming the node the table names."""
    rc = main(["validate", str(INVALID / f"{name}.json"), "--models", str(tiny_models), "--json"])
    assert rc != 0
    r = json.loads(capsys.readouterr().out)
    assert set(r) == {"error", "node_errors"}
    assert set(r["error"]) == {"type", "message", "details", "extra_info"}
    assert r["error"]["type"] == top_type
    if node is None:
        assert r["node_errors"] == {}
    elif r["node_errors"]:
        assert [e["type"] for e in r["node_errors"][node]["errors"]] == [error_type]
    else:  # errors found before any input is looked at name the node in extra_info, as ComfyUI does
        assert r["error"]["extra_info"]["node_id"] == node


# ------------------------------------------------------------------------------------------ plan


def _plan(tmp_path: Path, *extra: str) -> Path:
    svg = tmp_path / "plan.svg"
    rc = main(["plan", str(WORKFLOWS / "text_to_image.json"), "--vram", "11GiB", "--json", "--models",
               str(tmp_path / "no-models"), "--svg", str(svg), "--host", "64GiB", *extra])  # (not this machine's
    #                                                          free RAM, which may not hold the transformer's copy)
    assert rc == 0
    return svg


def test_plan_needs_no_weights(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Built-in klein-4B specs in bf16: the 11 GiB plan loads the 5.8 GiB encoder, frees it for the 7.2 GiB
    transformer, then adds the VAE (the transformer fits the card alone: nothing streams)."""
    svg = _plan(tmp_path)
    plan = json.loads(capsys.readouterr().out)
    loads = {s["model"]: plan["models"][s["model"]] for s in plan["steps"] if s["kind"] == "load"}
    sizes = {m["label"]: m["nbytes"] / GiB for m in loads.values()}
    assert sizes["text encoder"] == pytest.approx(5.80, abs=0.02)
    assert sizes["vae"] < 0.2
    assert sizes["transformer"] == pytest.approx(7.22, abs=0.02)
    assert not plan.get("streamed_bytes")
    assert plan["budget"]["gpu"] <= 11 * GiB and plan["peak"] <= plan["budget"]["gpu"]
    kinds = [(s["kind"], plan["models"][s["model"]]["label"] if "model" in s else s["node"]) for s in plan["steps"]]
    assert kinds.index(("unload", "text encoder")) < kinds.index(("load", "transformer"))
    assert svg.is_file() and svg.read_text().lstrip().startswith("<svg")
    assert not (tmp_path / "no-models").exists()

    _plan(tmp_path, "--size", "1536x1536")
    big = json.loads(capsys.readouterr().out)
    def act_of(p: dict) -> dict:  # GPU bytes of each run less a streamed model's blocks and staging
        return {s["node"]: s["gpu_bytes"] - (s["blocks"]["resident_bytes"] + s["blocks"]["staging"] if "blocks" in s
                                             else 0) for s in p["steps"] if s["kind"] == "run"}

    act, act_big = act_of(plan), act_of(big)
    assert act_big["6"] > act["6"]  # the sampler's activations grow with the picture
    def unloads(p: dict) -> list[str]:
        return [p["models"][s["model"]]["label"] for s in p["steps"] if s["kind"] == "unload"]

    # at 1536² the decode no longer fits beside the transformer: the transformer leaves for it
    assert unloads(plan) == ["text encoder"] and unloads(big) == ["text encoder", "transformer"]


def test_plan_size_reaches_comfyui_templates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--size sets the template's Width/Height primitives (titled with capitals) inside its subgraph."""
    peaks = []
    for size in ("512x512", "1536x1536"):
        assert main(["plan", str(template("image_flux2_klein_text_to_image.json")), "--vram", "12GiB", "--json",
                     "--models", str(tmp_path), "--svg", "", "--size", size]) == 0
        plan = json.loads(capsys.readouterr().out)
        step = next(s for s in plan["steps"] if s.get("node") == "75:64")
        blocks = step.get("blocks") or {"resident_bytes": 0, "staging": 0}  # a streamed sampler's own weights
        peaks.append(step["gpu_bytes"] - blocks["resident_bytes"] - blocks["staging"])
    assert peaks[1] > peaks[0]


# ------------------------------------------------------------------------------------------ generate


def test_generate_text_to_image_and_edit(tiny_models: Path, input_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "a" / "out.png"
    assert main(["generate", "-p", "a red fox", "-W", "64", "-H", "64", "-S", "7", "-o", str(out),
                 "--models", str(tiny_models)]) == 0
    assert capsys.readouterr().out.split() == [str(out)]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [out]  # one PNG, nothing else left behind
    size, text = text_chunks(out)
    assert size == (64, 64) and text["seed"] == "7"
    prompt = json.loads(text["prompt"])
    assert prompt["4"]["inputs"]["text"] == "a red fox" and "10" not in prompt

    edited = tmp_path / "b" / "edit.png"
    assert main(["generate", "-p", "make it blue", "-W", "64", "-H", "64", "-i", str(input_dir / "reference.png"),
                 "-o", str(edited), "--models", str(tiny_models)]) == 0
    size, text = text_chunks(edited)
    prompt = json.loads(text["prompt"])
    assert size == (64, 64)
    assert {n["class_type"] for n in prompt.values()} >= {"VGLoadImage", "VGReferenceImage"}  # the edit workflow
    assert prompt["8"]["inputs"]["filename_prefix"] == "vramgraph/edit"
