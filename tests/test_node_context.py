"""nodes/context.py `Context`: every member our nodes ask of `vg` is declared, both runners implement it, and the
ComfyUI context reaches a node only through the pack's classes (nodes/comfy.py `comfy_nodes`), never a `None` default.
(The type-level check is mypy over graph/engine/conform.py in .ci/run.)"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import vramgraph
from vramgraph.graph.engine.executor import NodeContext
from vramgraph.nodes import ENGINE_NODES, VG_NODES
from vramgraph.nodes.comfy import ComfyContext, ComfyRuntime, comfy_node, comfy_nodes
from vramgraph.nodes.context import Context

NODES = Path(vramgraph.__file__).parent / "nodes"


def _members(cls: type) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def _asked(path: Path) -> set[str]:
    """The attributes read from a `vg` parameter (or from `self.vg`) in a module."""
    found = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        takes = any(a.arg == "vg" for a in (*fn.args.args, *fn.args.kwonlyargs))
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute):
                v = node.value
                if (takes and isinstance(v, ast.Name) and v.id == "vg") or (
                        isinstance(v, ast.Attribute) and v.attr == "vg"):
                    found.add(node.attr)
    return found


def test_every_member_the_nodes_use_is_declared() -> None:
    used = set().union(*(_asked(p) for p in NODES.glob("*.py")))
    assert {"module", "resolve", "progress", "host_weights", "kept_blocks", "folders"} <= used  # the walk sees them
    assert used <= _members(Context), sorted(used - _members(Context))


def test_nodes_never_look_a_member_up_by_name() -> None:
    """`getattr(vg, ...)` would hide a member from the protocol (and from the check above)."""
    for path in NODES.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in ("getattr", "hasattr"):
                first = node.args[0] if node.args else None
                assert not (isinstance(first, ast.Name) and first.id == "vg"), f"{path.name}:{node.lineno}"


@pytest.mark.parametrize("impl", [NodeContext, ComfyContext])
def test_both_runners_answer_every_member(impl: type) -> None:
    declared = _members(Context)
    have = {n for n in declared if hasattr(impl, n)}
    if impl is NodeContext:  # set in __init__
        have |= {"variant", "seed", "chosen"} & declared
    else:
        have |= {"seed", "device"} & declared
    assert have == declared, sorted(declared - have)


def test_every_node_function_takes_the_context_explicitly() -> None:
    """A node that takes `vg` has it keyword-only and without a default: no runner is picked by a missing argument."""
    takers = []
    for name, cls in ENGINE_NODES.items():
        param = inspect.signature(getattr(cls, cls.FUNCTION)).parameters.get("vg")
        if param is not None:
            assert param.kind is param.KEYWORD_ONLY and param.default is param.empty, name
            takers.append(name)
    assert {"VGSampler", "VAEDecode", "SaveImage", "LoraLoader", "UnetLoaderGGUF"} <= set(takers)


def test_comfy_classes_pass_a_comfy_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack's class calls the node's function with `vg=` a ComfyContext on the runtime it was given, and
    releases that context when the function returns; a node without `vg` is registered as it is."""
    import vramgraph.nodes.comfy as comfy

    seen: list[tuple] = []

    class FakeContext:
        def __init__(self, rt: ComfyRuntime, name: str) -> None:
            self.rt, self.name, self.released = rt, name, False

        def __enter__(self) -> FakeContext:
            return self

        def __exit__(self, *exc: object) -> None:
            self.released = True

    class Node:
        FUNCTION = "run"

        def run(self, a: int, b: int = 2, *, vg: Context) -> tuple:
            seen.append((a, b, vg))
            return (a + b,)

    monkeypatch.setattr(comfy, "ComfyContext", FakeContext)
    rt = ComfyRuntime()
    wrapped = comfy_node(Node, rt)
    assert wrapped is not Node and issubclass(wrapped, Node) and wrapped.__name__ == "Node"
    assert wrapped().run(1, b=5) == (6,)
    (a, b, vg), = seen
    assert (a, b) == (1, 5) and vg.rt is rt and vg.name == "Node" and vg.released
    mapped = comfy_nodes(VG_NODES, rt)
    assert set(mapped) == set(VG_NODES) and all(issubclass(mapped[k], VG_NODES[k]) for k in mapped)
    assert mapped["VGSampler"] is not VG_NODES["VGSampler"]

    class Plain:
        FUNCTION = "run"

        def run(self, a: int) -> tuple:
            return (a,)

    assert comfy_node(Plain, rt) is Plain  # takes neither a context nor folders


def test_comfy_classes_pass_comfyuis_files() -> None:
    """INPUT_TYPES, VALIDATE_INPUTS and IS_CHANGED get `folders=` ComfyUI's files; the signature ComfyUI reads (to
    choose the inputs it passes VALIDATE_INPUTS, and skip its own list check for them) has no `folders`."""
    from vramgraph.nodes.comfy import ComfyFiles

    calls: list[tuple] = []

    class Loader:
        FUNCTION = "load"

        @classmethod
        def INPUT_TYPES(cls, folders: object = None) -> dict:
            calls.append(("types", folders))
            return {"required": {}}

        @classmethod
        def VALIDATE_INPUTS(cls, file: str = "", folders: object = None) -> bool:
            calls.append(("validate", file, folders))
            return True

        def load(self, file: str) -> tuple:
            return (file,)

    files = ComfyFiles()
    wrapped = comfy_node(Loader, ComfyRuntime(), files)
    assert wrapped.INPUT_TYPES() == {"required": {}} and wrapped.VALIDATE_INPUTS(file="a") is True
    assert calls == [("types", files), ("validate", "a", files)]
    assert inspect.getfullargspec(wrapped.VALIDATE_INPUTS).args == ["cls", "file"]
    assert files.inside_comfyui and wrapped.load is Loader.load


def test_only_the_pack_entry_imports_the_comfyui_side() -> None:
    """No node module reaches for nodes/comfy.py (which imports the catalogue): the ComfyUI runtime comes in from the
    pack's classes, so there is no catalog <-> comfy cycle, lazy imports included."""
    for path in NODES.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = {node.module} if node.module else {a.name for a in node.names}
                assert "comfy" not in names, f"{path.name}:{node.lineno}"
