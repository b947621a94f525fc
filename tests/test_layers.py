"""The layers as DESIGN.md draws them: entry points (cli/, server/) -> graph/ -> nodes/ -> models/, arrows only
down, and the pure layers (parsing, validation, estimation, planning, node declarations) importing without torch.

Each torch check runs in a fresh interpreter, since this one has imported torch long ago."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
import vramgraph

ROOT = Path(vramgraph.__file__).parent
PACKAGE = vramgraph.__name__
# The rooms, top to bottom (DESIGN.md; graph/__init__.py draws them): the entry points, graph's four rooms, the nodes,
# the models. What each room may import from the package (its own modules aside; the package root is ComfyUI's entry).
ROOMS = ("cli", "server", "api", "graph.engine", "graph.draw", "graph.workflow", "graph.plan", "nodes", "models")
_GRAPH = {"graph.engine", "graph.draw", "graph.workflow", "graph.plan"}
MAY_IMPORT = {
    "cli": {"api", *_GRAPH, "nodes", "models"},  # the command line is a shell over the Python API
    "server": {*_GRAPH, "nodes", "models"},
    "api": {*_GRAPH, "nodes", "models"},
    "graph.engine": {"graph.workflow", "graph.plan", "nodes", "models"},
    "graph.draw": {"graph.plan"},
    "graph.workflow": {"graph.plan", "nodes", "models"},
    "graph.plan": {"nodes"},  # only under TYPE_CHECKING (test_the_planner_sees_costs_not_nodes)
    "nodes": {"models"},
    "models": set(),
}
PURE = [
    "graph", "graph.workflow", "graph.workflow.parse", "graph.workflow.validate", "graph.workflow.estimate",
    "graph.workflow.errors", "graph.workflow.queue", "graph.workflow.families", "graph.workflow.uiedit",
    "graph.workflow.roles", "graph.plan", "graph.plan.planner", "graph.plan.types", "graph.plan.early",
    "graph.plan.residency", "graph.plan.sizes", "graph.plan.order", "graph.plan.assign", "graph.plan.placement",
    "graph.draw", "graph.draw.timeline", "graph.engine", "graph.engine.planning", "graph.engine.budget",
    "graph.engine.cache", "graph.engine.run",
    "graph.engine.runtime", "api",
    "nodes", "nodes.types", "nodes.estimates", "nodes.catalog", "nodes.files", "nodes.core", "nodes.vg",
    "nodes.output", "nodes.comfy", "nodes.foreign",
    "models.dtypes", "models.headers", "models.loading", "models.flux2_config", "models.qwen3_config",
    "models.vae_config",
]
WORKFLOW = ROOT / "workflows" / "text_to_image.json"


def _python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT.parent), "PATH": "/usr/bin:/bin", "HOME": str(cwd or ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd or ROOT.parent,
                          env=env, timeout=120)


# ------------------------------------------------------------------------------------------- (a) torch-free


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_without_torch(module: str) -> None:
    done = _python(f"import importlib, json, sys; importlib.import_module('{PACKAGE}.{module}'); "
                   "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], f"importing {module} imports torch"


def test_node_declarations_are_data() -> None:
    """Every node's INPUT_TYPES and RETURN_TYPES can be read, and the built-in sizes computed, without torch."""
    code = f"""
import json, sys
from {PACKAGE}.nodes import ENGINE_NODES
from {PACKAGE}.nodes.catalog import ModelCatalog
from {PACKAGE}.nodes.files import Folders
for cls in ENGINE_NODES.values():
    cls.INPUT_TYPES(folders=Folders())
    tuple(cls.RETURN_TYPES)
cat = ModelCatalog(Folders(), "bf16", allow_builtin=True)
sizes = [cat.model_info(k, "flux-2-klein-4b.safetensors").nbytes for k in ("transformer", "text_encoder", "vae")]
print(json.dumps({{"torch": "torch" in sys.modules, "sizes": sizes, "nodes": len(ENGINE_NODES)}}))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["torch"] is False and out["nodes"] > 20
    transformer, text_encoder, vae = out["sizes"]
    assert round(transformer / 2**30, 2) == 7.22 and round(text_encoder / 2**30, 2) == 5.8  # DESIGN.md's sizes
    assert 0 < vae < 2**30


# --------------------------------------------------------------------------------------------- (b) arrows


def _imports(path: Path, top_only: bool = False) -> list[tuple[str, int]]:
    """(absolute module or module.name, line) of every import of the package in a file: lazy ones inside functions
    too, or with `top_only` only those the module runs when it is imported (not under `if TYPE_CHECKING:`)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target] if node.module else [[*target, a.name] for a in node.names]
            elif node.module and node.module.split(".")[0] == PACKAGE:
                names = [node.module.split(".")[1:]]
            else:
                continue
            found += [(".".join(n), node.lineno) for n in names]
        elif isinstance(node, ast.Import):
            found += [(".".join(a.name.split(".")[1:]), node.lineno) for a in node.names
                      if a.name.split(".")[0] == PACKAGE]
    return found


def _files() -> list[Path]:
    return sorted(p for room in ROOMS for p in ROOT.joinpath(*room.split(".")).rglob("*.py"))


def _room(module: str) -> str:
    """The room of a dotted module name: `graph.plan.order.Shape` -> `graph.plan`, `nodes.types` -> `nodes`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "graph" else parts[0]


def test_arrows_only_point_down() -> None:
    wrong = []
    rooms = nx.DiGraph()
    for path in _files():
        room = _room(".".join(path.relative_to(ROOT).parts))
        for target, line in _imports(path):
            other = _room(target) if target else ""
            if other in ("", room) or other not in ROOMS:
                continue  # the package root (ComfyUI's entry, __version__) and the room's own modules
            rooms.add_edge(room, other)
            if other not in MAY_IMPORT[room]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({room}/ may not import {other}/)")
    assert not wrong, "\n".join(wrong)
    assert nx.is_directed_acyclic_graph(rooms), list(nx.simple_cycles(rooms))
    assert rooms.number_of_edges() >= 12  # the check saw the real imports


def test_no_import_cycles_between_modules() -> None:
    """Module-level imports (those run at import time) form no cycle inside any room either."""
    graph = nx.DiGraph()
    for path in _files():
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for target, _ in _imports(path, top_only=True):
            target = _module_of(target)
            if _room(target) in ROOMS and target != mod:
                graph.add_edge(mod, target)
    assert graph.number_of_edges() > 20
    assert nx.is_directed_acyclic_graph(graph), list(nx.simple_cycles(graph))[:5]


def _module_of(target: str) -> str:
    """`graph.plan.planner.Budget` -> `graph.plan.planner` (a name imported from a module), a module as it is."""
    parts = target.split(".")
    while parts and not ((ROOT.joinpath(*parts).with_suffix(".py")).is_file() or (ROOT.joinpath(*parts)).is_dir()):
        parts.pop()
    return ".".join(parts)


PLANNER = tuple(sorted(p.stem for p in (ROOT / "graph" / "plan").glob("*.py") if p.stem != "__init__"))


def test_the_planner_package_is_complete() -> None:
    assert set(PLANNER) >= {"planner", "types", "sizes", "order", "assign", "early", "residency", "placement"}


@pytest.mark.parametrize("name", PLANNER)
def test_the_planner_sees_costs_not_nodes(name: str) -> None:
    """The planner (graph/plan/: the planner, its types, sizes and passes, block residency, placement) imports nothing
    of ours at run time but its own modules: the Variant and Blocks types of nodes/types.py are only names in their
    annotations, under `if TYPE_CHECKING:`."""
    path = ROOT / "graph" / "plan" / f"{name}.py"
    tree = ast.parse(path.read_text())
    guarded = [n for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
               for n in ast.walk(block) if isinstance(n, ast.ImportFrom)]
    ours = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    outside = [n for n in ours if n not in guarded]
    assert all(n.level == 1 and (n.module or "").split(".")[0] in (*PLANNER, "") for n in outside), \
        "an import of ours outside the planner's modules"
    assert all(n.module in PLANNER for n in outside if n.module) and \
        all(a.name in PLANNER for n in outside if not n.module for a in n.names)
    assert all((n.module == "nodes.types" and n.level == 3) or (n.level == 1 and n.module in PLANNER) for n in guarded)
    assert {a.name for n in guarded if n.level == 3 for a in n.names} <= {"Variant", "Blocks"}
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import) and n.names[0].name.split(".")[0] == "torch"]


# ------------------------------------------------------------------------------------ (c) the commands


_RUN = """
import atexit, json, runpy, sys
atexit.register(lambda: print(json.dumps({{"torch": "torch" in sys.modules}}), file=sys.stderr))
sys.argv = ["vramgraph", *{argv!r}]
runpy.run_module("{package}", run_name="__main__")
"""


def _command(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, bool]:
    done = _python(_RUN.format(argv=argv, package=PACKAGE), cwd=cwd)
    last = done.stderr.strip().splitlines()[-1]
    return done, json.loads(last)["torch"]


def test_plan_from_builtin_sizes_imports_no_torch(tmp_path: Path) -> None:
    done, torch_loaded = _command(["plan", str(WORKFLOW), "--vram", "12GiB", "--svg", ""], tmp_path)
    assert done.returncode == 0, done.stderr
    # the 12 GiB card minus the CUDA context estimate, the card margin and the reserve: the GPU run's budget
    assert "of 11.02 GiB" in done.stdout
    assert torch_loaded is False


def test_plan_and_validate_read_model_files_without_torch(tmp_path: Path, tiny_models: Path) -> None:
    """With real checkpoint files the sizes come from their headers (json + struct), still without torch."""
    done, torch_loaded = _command(["plan", str(WORKFLOW), "--vram", "12GiB", "--svg", "", "--json",
                                   "--models", str(tiny_models)], tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    loaded = {s["model"] for s in plan["steps"] if s["kind"] == "load"}
    assert loaded and all(str(tiny_models) in key for key in loaded)  # the files' infos, not the built-in specs
    assert torch_loaded is False
    done, torch_loaded = _command(["validate", str(WORKFLOW), "--json", "--models", str(tiny_models)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["ok"] is True
    assert torch_loaded is False


def test_validate_with_missing_files_imports_no_torch(tmp_path: Path) -> None:
    done, torch_loaded = _command(["validate", str(WORKFLOW)], tmp_path)
    assert done.returncode == 1 and "value_not_in_list" in done.stdout + done.stderr
    assert torch_loaded is False


def test_a_demo_whose_files_exist_validates_and_plans_without_torch(tmp_path: Path) -> None:
    """The first `--demo` writes the tiny models (that needs torch); later ones only read their headers."""
    done, _ = _command(["validate", str(WORKFLOW), "--demo"], tmp_path)
    assert done.returncode == 0, done.stderr
    plan = ["plan", str(WORKFLOW), "--demo", "--vram", "12GiB", "--svg", ""]
    for argv in (["validate", str(WORKFLOW), "--demo"], plan):
        done, torch_loaded = _command(argv, tmp_path)
        assert done.returncode == 0, done.stderr
        assert torch_loaded is False, argv
