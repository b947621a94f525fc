"""No module-level mutable state in library code (DESIGN.md, style 5): a pool, cache or registry belongs to an object
with a lifetime (and a `close()` where it holds threads or files), never to a module, where it outlives every run,
leaks between tests and between the engines of one process.

The rule, checked on the AST of every module of the package (tests/ and bench/, scripts, are not library code):
- a module-level name may not be bound to a mutable display or comprehension (dict, list, set) unless it is a
  constant table: an UPPER_CASE name, not empty, that no module of the package ever changes (item assignment or
  deletion, augmented assignment, a mutating method such as `.append` or `.update`, a `global` rebinding);
  (`__all__` and other dunders count as UPPER_CASE; `dict(...)`/`list(...)` of something is a display too);
- a module-level name may not be bound to another call, except of a callable known to build an immutable value
  (IMMUTABLE_CALLS; and, found by the scan: the package's frozen dataclasses, NamedTuples and Enums, its stateless
  classes (no `__init__`, no attribute ever set: sentinels), and its class factories (a function that defines the
  class it returns: node classes made per file kind));
- no `global` statement in a function (rebinding module state at run time);
- no `functools.cache` / `lru_cache` on any function or method (a process-wide memo, holding its arguments alive);
- no process-wide registration anywhere in the package (REGISTRATIONS: `mimetypes.add_type`, `atexit.register`, ...):
  what an answer needs is set on that answer, what a run needs is undone by the object that did it.
Each exception is in ALLOWED with the reason it is not state the library owns.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import vramgraph

ROOT = Path(vramgraph.__file__).parent
NOT_LIBRARY = {"tests", "bench", "web", "workflows", "docs"}

# Callables whose result is immutable (or a logger, owned by logging's own registry): binding one at module level
# makes a constant. Frozen dataclasses, NamedTuples and Enums of the package are added by the scan.
IMMUTABLE_CALLS = {
    "frozenset", "tuple", "str", "int", "float", "bytes", "Path", "MappingProxyType", "namedtuple", "NamedTuple",
    "TypeVar", "ParamSpec", "NewType", "compile", "getLogger", "replace", "AppKey", "object", "Fraction", "field",
    "dtype", "Final", "cast", "frozen", "Enum", "IntEnum", "range", "bytes.fromhex",
}
TABLE_CALLS = {"dict", "list", "set", "OrderedDict"}
MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear", "remove",
            "discard", "sort", "reverse", "appendleft", "extendleft", "__setitem__", "__delitem__"}
CACHES = {"cache", "lru_cache"}
REGISTRATIONS = {("mimetypes", "add_type"), ("mimetypes", "init"), ("atexit", "register"), ("signal", "signal"),
                 ("sys", "setrecursionlimit"), ("torch", "set_default_dtype"), ("copyreg", "pickle")}

# (module path relative to the package, name): why it is allowed.
ALLOWED: dict[tuple[str, str], str] = {
    ("nodes/comfy.py", "runtime"): "ComfyUI's process owns our nodes there: one runtime per ComfyUI process, made on "
                                   "first use, is the state of that host, not of the library (issue #36 item 4 passes "
                                   "it explicitly)",
    ("graph/engine/budget.py", "_WORKSPACE"): "a record of torch's own process state: torch makes one cuBLAS workspace "
                                              "per thread and device on the first matrix product and keeps it until "
                                              "the process ends; its size can only be measured then (a second "
                                              "measurement sees 0), so the record lives as long as the workspace",
    ("models/gguf_triton.py", "DISPATCH"): "a record of the process's Triton: whether it imports and whether a "
                                           "kernel compiled for a device is a fact of this process (Triton's own "
                                           "JIT cache holds the compiled kernels as long); kept so that a failed "
                                           "kernel is not compiled again for every layer and each fallback is "
                                           "logged once, not once per layer call",
    ("graph/workflow/queue.py", "_KEY_TEXT"): "a json.JSONEncoder configured once; encode() keeps nothing between "
                                              "calls",
}


@dataclass(frozen=True)
class Finding:
    """A module-level binding or cache the rule refuses, where it is and what it is."""

    module: str
    line: int
    name: str
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} {self.name}: {self.what}"


def library_modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_LIBRARY or "__pycache__" in rel.parts or rel.parts[0].startswith("."):
            continue  # (hidden folders: a device carry such as .whl/, never part of the package)
        yield rel.as_posix(), ast.parse(path.read_text(), str(path))


def _callee(call: ast.Call) -> str:
    fn = call.func
    return fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""


def _qualified(call: ast.Call) -> str:
    """"bytes.fromhex" for a call of an attribute of a name, else ""."""
    fn = call.func
    return f"{fn.value.id}.{fn.attr}" if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""


def _is_frozen_type(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        if isinstance(dec, ast.Call) and _callee(dec) == "dataclass":
            if any(k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value for k in dec.keywords):
                return True
    bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in cls.bases}
    return bool(bases & {"NamedTuple", "Enum", "IntEnum", "StrEnum", "Exception"})


def _is_stateless_class(cls: ast.ClassDef) -> bool:
    """No `__init__`, no class-level assignment, no `self.x = ...`: instances carry nothing (a sentinel)."""
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef) and node.name in {"__init__", "__new__", "__setattr__"}:
            return False
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            return False
    return True


def _class_factories(tree: ast.Module) -> set[str]:
    """Module-level functions that make a class (annotated `-> type`, or defining one): a definition, not state."""
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and ((isinstance(f.returns, ast.Name) and f.returns.id == "type")
                 or (isinstance(f.returns, ast.Constant) and f.returns.value == "type")
                 or any(isinstance(n, ast.ClassDef) for n in ast.walk(f)))}


def _module_bindings(body: list[ast.stmt]) -> Iterator[tuple[str, int, ast.expr]]:
    """(name, line, value) of every module-level binding, inside module-level if/try blocks too."""
    for node in body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        yield name.id, node.lineno, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            yield node.target.id, node.lineno, node.value
        elif isinstance(node, ast.If | ast.Try):
            yield from _module_bindings(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                yield from _module_bindings(handler.body)


def _changed(target: ast.expr) -> str | None:
    """The name whose object `target[...]...` or `module.NAME` changes, stripped of subscripts."""
    while isinstance(target, ast.Subscript):
        target = target.value
    return target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None


def _mutated(trees: list[tuple[str, ast.Module]]) -> set[str]:
    """Names that some module changes: item assignment or deletion, augmented assignment, a mutating method, global."""
    found: set[str | None] = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.update(node.names)
            elif isinstance(node, ast.AugAssign):
                found.add(_changed(node.target))
            elif isinstance(node, ast.Assign | ast.Delete | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                found.update(_changed(t.value) for t in targets if isinstance(t, ast.Subscript))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                found.add(_changed(node.func.value))
    return {n for n in found if n}


def _binding_problem(name: str, value: ast.expr, mutated: set[str], immutable: set[str]) -> str | None:
    table = isinstance(value, ast.Call) and _callee(value) in TABLE_CALLS
    if table or isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp):
        if table:
            empty = not (value.args or value.keywords)
        else:
            empty = isinstance(value, ast.Dict | ast.List | ast.Set) and not (getattr(value, "keys", None)
                                                                              or getattr(value, "elts", None))
        dunder = name.startswith("__") and name.endswith("__")
        if not (name.isupper() or dunder):
            return "a mutable display bound to a lower-case name (a constant table is UPPER_CASE)"
        if empty:
            return "an empty mutable display (a cache or registry, not a table)"
        if name in mutated:
            return "a table that code of the package changes"
        return None
    if isinstance(value, ast.Call) and not {_callee(value), _qualified(value)} & immutable:
        return f"the result of {_callee(value) or 'a call'}() (not known to be immutable)"
    return None


def _registration(node: ast.AST) -> str:
    """"module.function" when `node` calls one of REGISTRATIONS, else ""."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
        if (node.func.value.id, node.func.attr) in REGISTRATIONS:
            return f"{node.func.value.id}.{node.func.attr}"
    return ""


def findings(trees: list[tuple[str, ast.Module]]) -> list[Finding]:
    """What the rule refuses in `trees` ((module path, AST) pairs), less ALLOWED."""
    immutable = IMMUTABLE_CALLS | {c.name for _, t in trees for c in ast.walk(t) if isinstance(c, ast.ClassDef)
                                   and (_is_frozen_type(c) or _is_stateless_class(c))}
    mutated = _mutated(trees)
    out: list[Finding] = []
    for module, tree in trees:
        for name, line, value in _module_bindings(tree.body):
            problem = _binding_problem(name, value, mutated, immutable | _class_factories(tree))
            if problem:
                out.append(Finding(module, line, name, problem))
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                out.append(Finding(module, node.lineno, ",".join(node.names), "a global statement"))
            if _registration(node):
                out.append(Finding(module, node.lineno, _registration(node), "a process-wide registration"))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    called = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                    if called in CACHES:
                        out.append(Finding(module, node.lineno, node.name, f"a functools {called}"))
    return [f for f in out if (f.module, f.name) not in ALLOWED]


def test_library_code_keeps_no_module_level_mutable_state() -> None:
    found = findings(list(library_modules()))
    assert not found, "module-level mutable state (tests/test_no_globals.py says the rule):\n" + "\n".join(
        map(str, found))


SAMPLE = """
import functools
import mimetypes
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

COLOR_TYPES = {1: 0, 3: 2}
__all__ = ["encode"]
NAMES = dict(a=1)
GROWN = ["a"]
_pool: ThreadPoolExecutor | None = None
_REFUSALS: dict = {}
_seen = {"a": 1}
CACHE = {}
POOL = ThreadPoolExecutor(2)
LOOKUP = dict()


@dataclass(frozen=True)
class Spec:
    size: int


class _Unset:
    pass


KLEIN = Spec(4)
UNSET = _Unset()


def _threads() -> ThreadPoolExecutor:
    global _pool
    mimetypes.add_type("text/javascript", ".mjs")
    GROWN.append("b")
    return _pool


@functools.lru_cache(maxsize=8)
def _takes(cls: type) -> bool:
    return True


class Catalog:
    @functools.cache
    def info(self) -> int:
        return 1
"""


def test_the_rule_refuses_each_kind_of_module_state_and_lets_constants_be() -> None:
    found = {(f.name, f.what.split(" (")[0]) for f in findings([("sample.py", ast.parse(SAMPLE))])}
    assert found == {
        ("GROWN", "a table that code of the package changes"),
        ("_REFUSALS", "an empty mutable display"),
        ("_seen", "a mutable display bound to a lower-case name"),
        ("CACHE", "an empty mutable display"),
        ("POOL", "the result of ThreadPoolExecutor()"),
        ("LOOKUP", "an empty mutable display"),
        ("_pool", "a global statement"),
        ("_takes", "a functools lru_cache"),
        ("info", "a functools cache"),
        ("mimetypes.add_type", "a process-wide registration"),
    }
