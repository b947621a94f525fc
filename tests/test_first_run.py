"""The first run, as a new user meets it: --demo everywhere, one-line errors, generate's refusals, --version,
the default models folder, and `serve` saying where it listens only once it does.

In-process runs (`vramgraph.cli.main([...])`) in an empty temporary folder; the signal and server cases run
`python -m vramgraph` as a real process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from PIL import Image
from vramgraph import __version__
from vramgraph.__main__ import main as entry
from vramgraph.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "Size.width=64", "--set", "Size.height=64"]
SHIPPED = {"text_to_image": SMALL, "text_to_image_base": [*SMALL, "--set", "Sampler.steps=2"], "edit": SMALL,
           "multi_reference": SMALL,
           "core_text_to_image": [*SMALL, "--set", "Scheduler.width=64", "--set", "Scheduler.height=64"]}


@pytest.fixture
def empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty current folder, no models folder from the environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VRAMGRAPH_MODELS", raising=False)
    monkeypatch.delenv("VRAMGRAPH_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.config/vramgraph/config.json
    return tmp_path


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_every_shipped_workflow_runs_with_demo(empty: Path, capsys: pytest.CaptureFixture) -> None:
    """--demo writes the tiny models and the input images edit.json and multi_reference.json load."""
    for name, sets in SHIPPED.items():
        assert main(["run", f"workflows/{name}.json", "--demo", *sets]) == 0, name
        (printed,) = capsys.readouterr().out.split()
        assert Path(printed).name == f"{name}_00001_.png" and Image.open(printed).size == (64, 64)
    assert sorted(p.name for p in (empty / "vramgraph-demo" / "input").iterdir()) == ["reference.png",
                                                                                       "reference_2.png"]
    assert main(["validate", "workflows/multi_reference.json", "--demo"]) == 0
    assert main(["plan", "workflows/edit.json", "--demo", "--vram", "12GiB", "--svg", ""]) == 0
    out = empty / "fox.png"
    assert main(["generate", "-p", "a fox", "--demo", "-W", "64", "-H", "64", "-S", "3", "-o", str(out)]) == 0
    assert Image.open(out).text["seed"] == "3"


def test_errors_are_one_line_and_json_on_request(empty: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "workflows/text_to_image.json"]) == 1  # no models anywhere
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vramgraph run: node 1 (VGLoadTransformer): ")
    assert "[value_not_in_list]" in err and "no models folder: give --models DIR" in err and "--demo" in err
    assert main(["run", "workflows/text_to_image.json", "--json"]) == 1
    body = json.loads(capsys.readouterr().err)
    assert body["error"]["type"] == "prompt_outputs_failed_validation" and "1" in body["node_errors"]
    assert main(["run", "nothing-here.json"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing-here.json" in err and "Traceback" not in err
    assert main(["plan", "workflows/text_to_image.json", "--vram", "1GiB", "--svg", ""]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vramgraph plan: ")


def test_validate_in_the_repository_root_does_not_take_the_source_models_folder(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("VRAMGRAPH_MODELS", raising=False)
    monkeypatch.delenv("VRAMGRAPH_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert (ROOT / "models" / "flux2.py").is_file()  # the source folder models/ is there
    assert main(["validate", "workflows/text_to_image.json"]) == 1
    err = capsys.readouterr().err
    assert "no models folder: give --models DIR" in err and str(ROOT / "models") not in err
    assert all(line.startswith("vramgraph validate: ") for line in err.splitlines())


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "--steps 0: must be a whole number from 1 to 1000"),
    (["-W", "1000"], "--width 1000: must be a multiple of 16 from 16 to 16384"),
    (["-H", "32768"], "--height 32768: must be a multiple of 16 from 16 to 16384"),
    (["--guidance", "-1"], "--guidance -1.0: must be a number from 0.0 to 100.0"),
    (["-S", "-5"], "--seed -5: must be a whole number from 0"),
    (["--vram", "12"], "--vram 12: '12' has no unit; write 12GiB"),
    (["--device", "nonsense"], "--device nonsense: not a device"),
    (["--device", "cuda:9"], "--device cuda:9:"),
])
def test_generate_refuses_impossible_values(empty: Path, capsys: pytest.CaptureFixture, args: list[str],
                                            message: str) -> None:
    assert main(["generate", "-p", "a fox", "--demo", "-W", "64", "-H", "64", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (empty / "vramgraph.png").exists()


def test_generate_never_overwrites_without_force_and_records_the_seed(
        empty: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "vramgraph")
    small = ["-p", "a fox", "--demo", "-W", "64", "-H", "64"]
    assert main(["generate", *small]) == 0
    captured = capsys.readouterr()
    png = empty / "vramgraph.png"
    seed = Image.open(png).text["seed"]
    assert captured.out.split() == ["vramgraph.png"] and f"seed {seed}: vramgraph.png" in caplog.messages
    before = png.read_bytes()
    assert main(["generate", *small, "-S", "1"]) == 2
    assert "vramgraph.png already exists; pass --force" in capsys.readouterr().err
    assert png.read_bytes() == before
    assert main(["generate", *small, "-S", "1", "--force"]) == 0
    assert Image.open(png).text["seed"] == "1"


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"vramgraph {__version__}"


def _sigint_as_in_a_shell() -> None:
    """Ctrl-C's default action in the child, as in a user's terminal: a pytest-xdist worker ignores SIGINT, and an
    ignored signal stays ignored across exec (Python would then never raise KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vramgraph", *args], cwd=cwd, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_as_in_a_shell)


def _wait_for(proc: subprocess.Popen, needle: str, timeout: float = 300) -> tuple[str, list[str]]:
    """Read stderr lines until one holds `needle`; returns it and the lines before. A process that has not printed it
    within `timeout` seconds is killed (the test fails with what it printed, and never hangs the suite)."""
    seen = []
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        for line in proc.stderr:
            if needle in line:
                return line, seen
            seen.append(line)
    finally:
        watchdog.cancel()
    raise AssertionError(f"the process ended (or was killed after {timeout:.0f} s) without printing {needle!r}: "
                         f"{''.join(seen)}")


def test_ctrl_c_is_one_line_and_exit_130(empty: Path) -> None:
    # 1024x1024 and 1000 steps: the run cannot end before the signal comes, however slowly this process reads
    proc = _start(["run", "workflows/text_to_image.json", "--demo", "--set", "Sampler.steps=1000"], empty)
    try:
        _wait_for(proc, "load transformer")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert [p for p in (empty / "output").rglob("*") if p.is_file()] == []  # nothing written, not even in part


def test_serve_says_where_it_listens_once_it_does(empty: Path) -> None:
    """... and serves ComfyUI's user folder given by --user-dir to the front end's /settings, read-only."""
    settings = empty / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"Comfy.ColorPalette": "light"}))
    proc = _start(["serve", "--demo", "--port", "0", "--user-dir", str(empty / "user")], empty)
    try:
        line, _ = _wait_for(proc, "vramgraph serve on http://127.0.0.1:")
        url = line.split(" on ", 1)[1].split()[0]
        with urllib.request.urlopen(f"{url}/system_stats", timeout=30) as r:  # listening already
            assert r.status == 200 and "system" in json.loads(r.read())
        with urllib.request.urlopen(f"{url}/settings", timeout=30) as r:
            assert json.loads(r.read()) == {"Comfy.ColorPalette": "light"}
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err


def test_busy_port_is_one_line(empty: Path, capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert entry(["serve", "--demo", "--port", str(port)]) == 2  # serve lives in server/: the entry point adds it
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"vramgraph serve: cannot listen on 127.0.0.1:{port}") and "--port" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_comfy_registry_metadata() -> None:
    """[tool.comfy] as the Comfy registry reads it; the node id follows its naming rules."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    comfy = data["tool"]["comfy"]
    assert set(comfy) >= {"PublisherId", "DisplayName", "Icon"} and comfy["PublisherId"] and comfy["DisplayName"]
    name = data["project"]["name"]
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*([-_.][A-Za-z0-9]+)*", name) and "comfyui" not in name.lower()
    assert len(name) < 100 and re.fullmatch(r"\d+\.\d+\.\d+", data["project"]["version"])


def test_a_file_that_is_no_checkpoint_is_named_not_quoted(empty: Path, capsys: pytest.CaptureFixture) -> None:
    """The reader's error for a non-checkpoint file names the file and says what is wrong, never its bytes."""
    import struct

    text = b"root:x:0:0:root:/root:/bin/bash\n"
    fake = empty / "passwd.safetensors"
    fake.write_bytes(text)
    assert main(["inspect", str(fake)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(fake) in err and "not a safetensors file" in err
    assert "root" not in err.replace(str(fake), "") and str(struct.unpack("<Q", text[:8])[0]) not in err
