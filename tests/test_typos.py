"""Typos are errors with a suggestion, never silently ignored: --set targets (node and input), node types, sizes that
are no multiple of their step; --set values keep their text for text inputs; '#' lines of a prompts file are
comments. The shipped workflows and the real command line, with --demo's tiny models; nothing is run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from vramgraph.api.pipeline import load
from vramgraph.cli import main
from vramgraph.cli.main import _prompts, parse_sets
from vramgraph.graph.workflow.validate import validate
from vramgraph.nodes import ENGINE_NODES

T2I = str(Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json")


@pytest.fixture(autouse=True)
def _demo_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # --demo writes its tiny models to ./vramgraph-demo


@pytest.mark.parametrize(("target", "said"), [
    ("Size.widht=256", "node Size (VGEmptyLatent) has no input 'widht'; did you mean 'width'?"),
    ("Sise.width=256", "no node with id or title 'Sise'; did you mean 'Size'?"),
    ("Sampler.sed=7", "has no input 'sed'; did you mean 'seed'?"),
])
def test_unknown_set_targets_are_refused_with_the_closest(target: str, said: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", T2I, "--demo", "--set", target]) == 2
    assert said in capsys.readouterr().err


def _inputs(sets: list[str]) -> dict[str, dict]:
    return {n["_meta"]["title"]: n["inputs"] for n in load(T2I, parse_sets(sets)).prompt.values() if "_meta" in n}


def test_set_values_take_the_inputs_type() -> None:
    got = _inputs(["Prompt.text=1984", "Sampler.seed=7", "Sampler.guidance=2.5"])
    assert got["Prompt"]["text"] == "1984"  # text stays text
    assert got["Sampler"]["seed"] == 7 and got["Sampler"]["guidance"] == 2.5
    assert _inputs(['Prompt.text="q"'])["Prompt"]["text"] == '"q"'  # as typed, quotes and all
    assert _inputs(["Sampler.seed=abc"])["Sampler"]["seed"] == "abc"  # left for validation to refuse, naming it


def test_a_size_that_is_no_multiple_of_its_step_is_refused(capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", T2I, "--demo", "--set", "Size.width=1000"]) == 1
    err = capsys.readouterr().err
    assert "node 5 (VGEmptyLatent): width: must be a multiple of 16; use 992 or 1008 [value_not_a_multiple]" in err
    assert main(["validate", T2I, "--demo", "--set", "Size.width=1008"]) == 0


def test_a_mistyped_node_type_gets_a_suggestion() -> None:
    r = validate({"1": {"class_type": "KSamplr", "inputs": {}}}, ENGINE_NODES).response()
    assert r["error"]["type"] == "missing_node_type"
    assert r["error"]["details"] == "Node ID '#1'; did you mean 'KSampler'?"
    r = validate({"1": {"class_type": "FluxGuidance", "inputs": {}}}, ENGINE_NODES).response()
    assert "did you mean" not in r["error"]["details"]  # another node, not a typo: no guess


def test_hash_lines_of_a_prompts_file_are_comments(tmp_path: Path) -> None:
    file = tmp_path / "prompts.txt"
    file.write_text("# my prompts\na red fox\n\n  # a commented-out one\na boat # with a hash inside\n")
    args = argparse.Namespace(prompt=["from -p"], prompts=str(file))
    assert _prompts(args) == ["from -p", "a red fox", "a boat # with a hash inside"]
