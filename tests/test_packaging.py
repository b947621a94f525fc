"""A pack the ComfyUI registry and ComfyUI-Manager accept: pyproject.toml checked against the registry's published
rules (written down below), requirements.txt for Manager's git install without torch, and that install done for
real in a fresh ComfyUI-like environment that already has torch (a venv that sees the installed packages), with
torch's version and location unchanged and the pack importable as ComfyUI imports it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# The ComfyUI registry's rules for pyproject.toml (https://docs.comfy.org/registry/specifications, read 2026-12-06):
# [project]
#   name        required; under 100 characters; only letters, digits, '-', '_', '.'; no two special characters in a
#               row; starts with a letter (not a digit or special character); advice: no "ComfyUI" in it
#   version     required; semantic version X.Y.Z
#   license     optional; { file = "LICENSE" } (a file that exists) or { text = "..." }; a bare string is wrong
#   description recommended
#   [project.urls] Repository   required (the repository's address)
#   requires-python             recommended
#   classifiers  "Operating System :: ..." (OS Independent, Microsoft, POSIX, MacOS) and "Environment :: GPU :: ..."
#               (NVIDIA CUDA, AMD ROCm, Intel Arc, Apple Metal) or "Environment :: NPU :: Huawei Ascend" say where the
#               pack runs
# [tool.comfy]
#   PublisherId  required: the registry publisher's id (lowercase letters, digits, '-')
#   DisplayName  optional: the name shown
#   Icon         optional: an image URL (SVG, PNG, JPG or GIF; square, at most 400x400)
#   includes     optional: a list of folders to publish that .gitignore would leave out
OS_CLASSIFIERS = ("OS Independent", "Microsoft", "POSIX", "MacOS")
ACCELERATORS = ("GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "GPU :: Apple Metal",
                "NPU :: Huawei Ascend")


def test_pyproject_follows_the_registry_rules() -> None:
    project, comfy = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
    name = project["name"]
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z0-9._-]+", name) and re.match(r"[A-Za-z]", name)
    assert not re.search(r"[._-]{2}", name) and "comfyui" not in name.lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    lic = project["license"]
    assert isinstance(lic, dict) and (("file" in lic and (ROOT / lic["file"]).is_file()) or lic.get("text"))
    assert "Apache License" in (ROOT / "LICENSE").read_text() and lic.get("text", "Apache-2.0") == "Apache-2.0"
    assert project["description"] and project["requires-python"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", project["urls"]["Repository"])
    classifiers = project["classifiers"]
    assert any(c.removeprefix("Operating System :: ").split(" :: ")[0] in OS_CLASSIFIERS
               for c in classifiers if c.startswith("Operating System :: "))
    assert any(c.removeprefix("Environment :: ") in ACCELERATORS for c in classifiers)
    assert project["authors"] and project["keywords"]
    assert re.fullmatch(r"[a-z0-9-]+", comfy["PublisherId"])
    assert comfy["DisplayName"]
    icon = comfy["Icon"]
    assert re.fullmatch(r"https://\S+\.(svg|png|jpg|gif)", icon)
    local = ROOT / icon.split("/main/", 1)[1]  # the icon is this repository's file at that address
    size = re.search(r'width="(\d+)" height="(\d+)"', local.read_text())
    assert size and size.group(1) == size.group(2) and int(size.group(1)) <= 400
    assert isinstance(comfy.get("includes", []), list)


def _requirements() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def test_requirements_are_the_dependencies_without_torch() -> None:
    reqs = _requirements()
    assert "torch" not in {_name(r) for r in reqs}
    assert sorted(reqs) == sorted(d for d in PYPROJECT["project"]["dependencies"] if _name(d) != "torch")


def _env_python(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / "python"


TORCH = "import json, torch; print(json.dumps([torch.__version__, torch.__file__]))"


def test_a_manager_install_leaves_comfyuis_torch_alone(tmp_path: Path) -> None:
    """ComfyUI-Manager's git install: the pack in custom_nodes/, then `pip install -r requirements.txt` in ComfyUI's
    environment (here a fresh venv that sees the installed packages, torch among them; no index: nothing may need
    downloading). torch is unchanged, and ComfyUI's way of importing the pack (its folder as a module) works."""
    venv = tmp_path / "comfy-env"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = _env_python(venv)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL")}
    before = subprocess.run([str(python), "-c", TORCH], env=env, capture_output=True, text=True, check=True).stdout
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
                              "-r", str(ROOT / "requirements.txt")], env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    assert "torch" not in install.stdout.lower().replace("requirement already satisfied", "")
    after = subprocess.run([str(python), "-c", TORCH], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(after) == json.loads(before)
    load = ("import importlib.util, sys, json\n"
            f"spec = importlib.util.spec_from_file_location('vramgraph_pack', {str(ROOT / '__init__.py')!r}, "
            f"submodule_search_locations=[{str(ROOT)!r}])\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['vramgraph_pack'] = m; spec.loader.exec_module(m)\n"
            "print(json.dumps([len(m.NODE_CLASS_MAPPINGS), m.WEB_DIRECTORY]))")
    got = subprocess.run([str(python), "-c", load], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    count, web = json.loads(got.stdout)
    assert count > 0 and web == "./web"


@pytest.mark.parametrize("path", ["LICENSE", "requirements.txt", "docs/icon.svg"])
def test_the_files_the_registry_reads_are_in_the_repository(path: str) -> None:
    assert (ROOT / path).is_file()
