"""The README's commands run as written: every `vramgraph ...` line of its `sh` blocks (and the Python API
block) in an empty folder, each exiting 0.

A block right after an HTML comment that starts with "real weights" needs real model files and is skipped;
every other line must run with what --demo provides. `session` reads an empty stdin (it ends at once);
`serve` runs until it says where it listens, then gets Ctrl-C and must exit 0.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!--(?P<note>.*?)-->\s*)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def blocks(lang: str) -> list[str]:
    return [m["body"] for m in BLOCK.finditer(README.read_text()) if m["lang"] == lang
            and not (m["note"] or "").strip().startswith("real weights")]


def commands() -> list[list[str]]:
    """Each `vramgraph ...` command of the runnable sh blocks (also after `&&`), as argument lists."""
    found = []
    for body in blocks("sh"):
        for line in body.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words and words[0] == "vramgraph":
                    found.append(words[1:])
    return found


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("readme")


def _env(folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VRAMGRAPH_MODELS", "VRAMGRAPH_CONFIG")}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), "HOME": str(folder)}


def test_the_readme_documents_every_command() -> None:
    import argparse

    from vramgraph.cli.main import _parser

    shipped = next(a.choices for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    ran = {args[0] for args in commands() if args and not args[0].startswith("-")}
    assert ran == set(shipped) and "serve" in ran, "every command has a README line that runs"
    assert ["--version"] in commands()


def _free_port(cmd: list[str]) -> list[str]:
    """`cmd` with its `--port N` replaced by a port that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    i = cmd.index("--port")
    return [*cmd[:i + 1], str(port), *cmd[i + 2:]]


@pytest.mark.slow  # every command README.md lists, end to end (about 45 s of CPU): CI runs it (`pytest -m slow`)
def test_readme_commands_exit_0(folder: Path) -> None:
    for args in commands():
        cmd = [sys.executable, "-m", "vramgraph", *args]
        if args[0] == "serve":
            cmd = _free_port(cmd)  # the README's port may be taken (a server a reader left running)
            proc = subprocess.Popen(cmd, cwd=folder, env=_env(folder), text=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                seen = []
                for line in proc.stderr:
                    seen.append(line)
                    if "vramgraph serve on http://" in line:
                        break
                else:
                    raise AssertionError(f"vramgraph {shlex.join(args)} ended: {''.join(seen)}")
                proc.send_signal(signal.SIGINT)
                proc.communicate(timeout=60)
            finally:
                proc.kill()
            assert proc.returncode == 0, shlex.join(args)
            continue
        done = subprocess.run(cmd, cwd=folder, env=_env(folder), text=True, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=600)
        assert done.returncode == 0, f"vramgraph {shlex.join(args)}: {done.stderr[-2000:]}"


def test_readme_python_api_runs(folder: Path) -> None:
    (code,) = blocks("python")
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, env=_env(folder), text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "fox-api.png").is_file() and "Load" in done.stdout


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_a_short_page_and_every_link_resolves() -> None:
    """README.md is a newcomer's page (<= 150 lines); it and every page of docs/ link only to files that exist."""
    assert len(README.read_text().splitlines()) <= 150
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 6
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor on the same page
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    linked = {(ROOT / t.split("#")[0]).resolve() for t in LINK.findall(README.read_text()) if t.startswith("docs/")}
    assert linked >= set(pages[1:]), "every docs page is linked from the README"
