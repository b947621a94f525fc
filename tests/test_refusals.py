"""Every refusal says why, in one line, wherever it surfaces (Python exception, session, server log and /prompt
answer, command line), and the console says what tools people know say: what a plan assumed, progress named by node
title and type, one line per prompt on the server, CPU wording on the CPU. Real runs on the tiny models."""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from pathlib import Path

import pytest
from test_cli import template
from vramgraph.__main__ import main as entry
from vramgraph.api.pipeline import Pipeline
from vramgraph.api.progress import Progress, ProgressBar
from vramgraph.cli import main
from vramgraph.cli.session import Session, repl
from vramgraph.graph.workflow.errors import ValidationFailed
from vramgraph.graph.workflow.parse import load_workflow
from vramgraph.nodes.catalog import builtin_bytes, builtin_config

T2I = Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json"
MISSING = "node 1 (VGLoadTransformer): file: 'flux-2-klein-4b.safetensors' not in [] (the list is empty); "


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VRAMGRAPH_MODELS", raising=False)
    monkeypatch.delenv("VRAMGRAPH_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_a_refused_prompt_is_one_line_in_python_and_in_the_session(here: Path) -> None:
    (here / "models").mkdir()
    pipe = Pipeline(models=here / "models", device="cpu")
    with pytest.raises(ValidationFailed) as e:
        pipe.generate("a fox", width=64, height=64)
    assert str(e.value).startswith(MISSING) and "\n" not in str(e.value)
    assert "(and 2 more)" in str(e.value) and "vramgraph fetch --model flux-2-klein-4b.safetensors" in str(e.value)
    said: list[str] = []
    lines = iter(["a fox", "!quit"])
    repl(Session(pipe), read=lambda _: next(lines), say=said.append)
    assert any(s.startswith(f"error: {MISSING}") for s in said), said


def test_plan_says_what_it_assumed(here: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vramgraph"):
        assert main(["plan", str(T2I), "--svg", "", "--device", "cpu"]) == 0
        assert main(["plan", str(T2I), "--svg", "", "--vram", "12GiB", "--profile", "h200"]) == 0
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("no GPU here and no --vram: planned against host RAM") for m in said), said
    assert any(m.startswith("planned for a 12.00 GiB card (--vram)") and "cost profile h200" in m for m in said)


def test_a_template_without_its_images_is_planned_with_stand_ins(here: Path, capsys: pytest.CaptureFixture,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vramgraph"):
        assert main(["plan", str(template("image_flux2_klein_image_edit_4b_distilled.json")), "--vram", "12GiB",
                     "--svg", "", "--json"]) == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "image 'handbag_white.png' is not in input: planned as a 1024x1024 image" in said
    assert "no models folder" not in capsys.readouterr().err
    assert not (here / "input").exists()  # the stand-ins are not left behind


def test_an_absent_fp8_file_is_planned_at_its_fp8_size() -> None:
    """flux-2-klein-4b-fp8.safetensors is 4,070,624,520 bytes (/work/shared/reference/checkpoint-formats.md 1e): the
    built-in size of that name is within 0.01% of it (the rest: scales and the header), about half the bf16 size."""
    fp8 = builtin_bytes("transformer", "flux-2-klein-4b-fp8.safetensors",
                        builtin_config("transformer", "flux-2-klein-4b-fp8.safetensors"), "bf16")
    bf16 = builtin_bytes("transformer", "flux-2-klein-4b.safetensors",
                         builtin_config("transformer", "flux-2-klein-4b.safetensors"), "bf16")
    assert abs(fp8 - 4_070_624_520) / 4_070_624_520 < 1e-4 and fp8 < 0.53 * bf16


def test_serve_warns_at_start_about_a_models_folder_that_is_not_there(here: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as s, caplog.at_level(logging.WARNING):
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert entry(["serve", "--models", str(here / "nope"), "--device", "cpu", "--port",
                      str(s.getsockname()[1])]) == 2  # the busy port ends it after the start-up
    assert f"the models folder {here / 'nope'} does not exist" in caplog.text
    (here / "models" / "vae").mkdir(parents=True)
    with socket.socket() as s, caplog.at_level(logging.WARNING):
        s.bind(("127.0.0.1", 0))
        s.listen()
        entry(["serve", "--models", str(here / "models"), "--device", "cpu", "--port", str(s.getsockname()[1])])
    assert "no FLUX.2 [klein] transformer in" in caplog.text and "vramgraph fetch" in caplog.text


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/prompt", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_server_logs_each_refusal_and_each_prompt_in_one_line(tiny_models: Path, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ServerThread, make_app

    folders = Folders(models=(tiny_models,), input=tmp_path / "in", output=tmp_path / "out", temp=tmp_path / "tmp")
    prompt = load_workflow(T2I).prompt
    prompt["5"]["inputs"].update(width=64, height=64)
    bad = json.loads(json.dumps(prompt))
    bad["1"]["inputs"]["file"] = "flux-2-klein-4b-typo.safetensors"
    with caplog.at_level(logging.INFO, logger="vramgraph"), ServerThread(make_app(Engine(folders))) as srv:
        status, answer = _post(srv.url, {"prompt": bad, "prompt_id": "bad-1"})
        assert status == 400 and "searched " in json.dumps(answer)
        assert "did you mean 'flux-2-klein-4b" in json.dumps(answer)
        status, _ = _post(srv.url, {"prompt": prompt, "prompt_id": "good-1"})
        assert status == 200
        end = time.monotonic() + 120
        while "good-1" not in caplog.text and time.monotonic() < end:
            time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records]
    refused = next(m for m in lines if m.startswith("prompt bad-1 refused: "))
    assert "node 1 (VGLoadTransformer): file: 'flux-2-klein-4b-typo.safetensors'" in refused
    done = next(m for m in lines if m.startswith("prompt good-1 executed in "))
    assert done.endswith("s; outputs 8: 1 image(s)")


def test_progress_reaches_a_callback_named_by_title_and_type(here: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Progress] = []
    pipe = Pipeline.demo(here / "demo", device="cpu")
    with caplog.at_level(logging.INFO, logger="vramgraph"):
        pipe.generate("a fox", seed=1, width=64, height=64, steps=3, progress=seen.append)
    assert [(p.class_type, p.title, p.value, p.total) for p in seen] == [("VGSampler", "Sampler", i, 3)
                                                                         for i in (1, 2, 3)]
    assert seen[0].label == "Sampler (VGSampler)"
    assert "loaded for the CPU from" in caplog.text and "onto the GPU" not in caplog.text  # CPU wording
    pipe.generate("a fox", seed=2, width=64, height=64, steps=2, progress=True)  # the bar: drawn and closed


def test_a_bar_counts_from_the_first_step_it_saw() -> None:
    """Made at step 1 of 4, a bar's rate is over the steps it timed, not 1 step in no time."""
    bar = ProgressBar()
    bar(Progress("6", "VGSampler", "Sampler", 1, 4))
    assert bar.bar.initial == 1 and bar.bar.n == 1 and bar.bar.desc.startswith("Sampler (VGSampler)")
    bar(Progress("6", "VGSampler", "Sampler", 2, 4))
    assert bar.bar.n == 2
    bar(Progress("6", "VGSampler", "Sampler", 4, 4))
    assert bar.bar is None  # closed at its last step


def test_the_command_line_labels_its_bars(here: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", str(T2I), "--demo", "--set", "Size.width=64", "--set", "Size.height=64"]) == 0
    assert "Sampler (VGSampler)" in capsys.readouterr().err
