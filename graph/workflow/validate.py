"""Validation of API-format prompts, answering with ComfyUI's error JSON.

Follows ComfyUI's `execution.validate_prompt` / `validate_inputs`: only the output nodes
(`OUTPUT_NODE = True`) and what they depend on are checked; an output is dropped when it or anything
upstream has an error, and the prompt fails only when no output is left. The response has ComfyUI's
POST /prompt shape, `{"error": {...}, "node_errors": {id: {"errors", "dependent_outputs", "class_type"}}}`,
and, as in ComfyUI, `node_errors` lists only nodes with errors of their own; a node downstream of a bad
one is not listed, the outputs it costs are in the bad node's `dependent_outputs`.

Where ComfyUI has no check (it would raise and report an exception), we report:
- a link to a node that is not in the prompt, or to an output index the source does not have, or an index
  that is not an int: `bad_linked_input` (message says which); node ids given as ints are accepted;
- a cycle: `dependency_cycle` ("Dependency cycle detected") on every node of it, found with networkx
  (ComfyUI finds it only when executing);
- a node that is not an object, or whose `inputs` is not an object: `invalid_prompt`, as for a missing
  `class_type`;
- a workflow for a model we do not run (FLUX.3 klein, Stable Diffusion, Z-Image, Wan, an API node, ...):
  `unsupported_model`, "this workflow uses MODEL, which vramgraph does not run", from the evidence in the
  graph (graph/workflow/families.py), before any missing node type is reported.
Literal conversion is ComfyUI's (`int(v)`, `float(v)`), with two deliberate differences: STRING accepts
only strings (ComfyUI would `str()` anything) and BOOLEAN only true/false, 0/1 or "true"/"false"
(ComfyUI's `bool("false")` is True), FLOAT refuses NaN and infinities, and an INT that is not a multiple of
its input's `step` (a size of 1000 where the step is 16) is refused with the two nearest multiples, where ComfyUI's
node would silently floor it. Defaults are not applied here;
`inputs_with_defaults` does that for the executor. An input the node does not declare is ignored, as
ComfyUI ignores it, with a warning in the log; it is not in the validated prompt.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from ...nodes.files import IMAGE_EXTENSIONS, MODEL_EXTENSIONS
from ...nodes.modelpaths import not_listed
from ...nodes.types import ANY, BOOLEAN, FLOAT, INT, PRIMITIVES, STRING, compatible, is_link, is_mapping
from .errors import ValidationFailed
from .families import unsupported_model

log = logging.getLogger("vramgraph.validate")
COMBO = "COMBO"
LIST_SHOWN = 20  # combo lists longer than this are summarised, as ComfyUI does ("list of length N")
WANTED = {INT: "a whole number", FLOAT: "a number", STRING: "text (a JSON string)", BOOLEAN: "true or false"}


@dataclass(frozen=True)
class Validation:
    ok: bool
    error: dict | None  # the top-level error; None when at least one output is valid
    node_errors: dict  # node id -> {"errors", "dependent_outputs", "class_type"} (may be set when ok)
    outputs: tuple[str, ...]  # the output node ids to execute
    dag: nx.DiGraph  # nodes the valid outputs need; edges source -> consumer; attrs "class_type", "links"
    prompt: dict = field(default_factory=dict)  # those nodes with literals converted and links as [str, int]

    def response(self) -> dict:
        """ComfyUI's POST /prompt answer on failure (HTTP 400); `error` is None on success."""
        return {"error": copy.deepcopy(self.error), "node_errors": copy.deepcopy(self.node_errors)}

    def check(self) -> Validation:
        """Self when valid; raise `ValidationFailed` carrying the response otherwise."""
        if not self.ok:
            raise ValidationFailed(self.response())
        return self


# ------------------------------------------------------------------------------------------- helpers


def input_types(cls: type, folders: Any = None) -> dict:
    """`cls.INPUT_TYPES`, passing `folders` when it takes them (ours do; ComfyUI's own classes do not)."""
    fn = cls.INPUT_TYPES
    return fn(folders=folders) if _takes_folders(cls) else fn()


def _takes_folders(cls: type) -> bool:
    """Whether `cls.INPUT_TYPES` takes `folders`: read from its code object's argument names (attribute reads, nothing
    kept: inspect.signature, asked for every node of every prompt, cost a tenth of validating a 64-prompt queue);
    inspect.signature only for what has no plain code object (a wrapped or built-in callable)."""
    fn = cls.INPUT_TYPES
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is not None and not hasattr(fn, "__wrapped__"):
        return "folders" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    try:
        return "folders" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _spec(spec: Any) -> tuple[Any, dict]:
    """(type, options) of an INPUT_TYPES entry: (TYPE,), (TYPE, {...}) or ([choices], {...})."""
    if isinstance(spec, list | tuple) and spec:
        opts = spec[1] if len(spec) > 1 and isinstance(spec[1], Mapping) else {}
        return spec[0], dict(opts)
    return spec, {}


def _declared(types: Mapping[str, Any]) -> list[tuple[str, str, Any, dict]]:
    """(name, "required"|"optional", type, options) in declaration order; hidden inputs are never checked."""
    return [(name, cat, *_spec(spec)) for cat in ("required", "optional")
            for name, spec in (types.get(cat) or {}).items()]


def inputs_with_defaults(class_type_cls: type, inputs: Mapping[str, Any], folders: Any = None) -> dict:
    """`inputs` plus the declared default of every absent widget input that has one (for the executor)."""
    return _with_defaults(inputs, _defaults(class_type_cls, folders))


def _defaults(cls: type, folders: Any) -> list[tuple[str, Any]]:
    """(name, default) of each declared input with a default, in declaration order."""
    return [(name, opts["default"]) for name, _cat, _typ, opts in _declared(input_types(cls, folders))
            if "default" in opts]


def _with_defaults(inputs: Mapping[str, Any], defaults: list[tuple[str, Any]]) -> dict:
    out = dict(inputs)
    for name, default in defaults:
        if name not in out:
            out[name] = copy.deepcopy(default)
    return out


class Defaults:
    """`inputs_with_defaults(cls, inputs, folders)` for the nodes of one prompt, reading each class's INPUT_TYPES once
    (a queue of 64 prompts asks the same few classes hundreds of times, and a loader's INPUT_TYPES lists a folder).
    Made per prompt: a folder's files change between prompts."""

    def __init__(self, folders: Any = None) -> None:
        self.folders = folders
        self._of: dict[type, list[tuple[str, Any]]] = {}

    def __call__(self, cls: type, inputs: Mapping[str, Any]) -> dict:
        if cls not in self._of:
            self._of[cls] = _defaults(cls, self.folders)
        return _with_defaults(inputs, self._of[cls])


def _jsonable(x: Any) -> Any:
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set | frozenset):
        return [_jsonable(v) for v in x]
    return repr(x)


def _err(type_: str, message: str, details: str, **extra: Any) -> dict:
    return {"type": type_, "message": message, "details": details, "extra_info": _jsonable(extra)}


def _type_name(t: Any) -> str:
    return "COMBO" if isinstance(t, list | tuple) else str(t)


def _short_list(choices: Sequence[Any]) -> str:
    if not choices:
        return "[] (the list is empty)"
    if len(choices) <= LIST_SHOWN:
        return str(list(choices))
    return f"{list(choices[:LIST_SHOWN])} ... (list of length {len(choices)})"


def _choices(input_type: Any, opts: dict) -> list | None:
    """The choices of a COMBO input (a list type, or "COMBO" with "options"), else None."""
    if isinstance(input_type, list | tuple):
        return list(input_type)
    return list(opts.get("options") or []) if input_type == COMBO else None


def _file_hint(val: Any) -> str:
    if isinstance(val, str) and val.lower().endswith(MODEL_EXTENSIONS + IMAGE_EXTENSIONS):
        return ", or put the file in the folder this list comes from (models/<folder>/ or input/)"
    return ""


def _convert(input_type: Any, val: Any) -> Any:
    if input_type == INT:
        return int(val)
    if input_type == FLOAT:
        v = float(val)
        if not math.isfinite(v):
            raise ValueError(f"{v} is not a finite number")
        return v
    if input_type == STRING:
        if not isinstance(val, str):
            raise TypeError(f"expected text, got {type(val).__name__}")
        return val
    if input_type == BOOLEAN:
        if isinstance(val, bool):
            return val
        if isinstance(val, int) and val in (0, 1):
            return bool(val)
        if isinstance(val, str) and val.strip().lower() in ("true", "false"):
            return val.strip().lower() == "true"
        raise ValueError(f"expected true or false, got {val!r}")
    if isinstance(input_type, str) and input_type not in (COMBO, ANY):
        raise TypeError(f"a {input_type} input takes a link [source node id, output index], not a value")
    return val


def _link(val: list) -> tuple[str, int] | None:
    """(source id, output index) of a well-formed link (`is_link`, after an int node id is read as its str), else
    None."""
    if len(val) == 2 and type(val[0]) is str and type(val[1]) is int:  # the usual link, at a glance
        return val[0], val[1]
    if len(val) == 2 and isinstance(val[0], int) and not isinstance(val[0], bool):
        val = [str(val[0]), val[1]]
    return (val[0], val[1]) if is_link(val) else None


# ---------------------------------------------------------------------------------------- top level


def _check_top(prompt: Any, nodes: Mapping[str, type]) -> dict | None:
    """ComfyUI's first pass: every node an object with a known class_type (the first failure is returned)."""
    if not isinstance(prompt, Mapping):
        return _err("invalid_prompt", "Cannot execute because the prompt is not an object of node id -> node.",
                    f"got {type(prompt).__name__}; send the API format: "
                    '{"<id>": {"class_type": ..., "inputs": {...}}}')
    for x, node in prompt.items():
        if not is_mapping(node):
            return _err("invalid_prompt", "Cannot execute because a node is not an object.",
                        f"Node ID '#{x}': got {type(node).__name__}; a node is "
                        '{"class_type": ..., "inputs": {...}}', node_id=str(x))
        class_type = node.get("class_type")
        if not isinstance(class_type, str):
            return _err("invalid_prompt", "Cannot execute because a node is missing the class_type property.",
                        f"Node ID '#{x}'", node_id=str(x))
        if class_type not in nodes:
            lower = {n.lower(): n for n in nodes}  # a typo ("KSamplr", "unetloader"), not another node
            close = [lower[c] for c in difflib.get_close_matches(class_type.lower(), list(lower), n=1, cutoff=0.85)]
            return _err("missing_node_type", f"Node '{class_type}' not found. The custom node may not be installed.",
                        f"Node ID '#{x}'" + (f"; did you mean '{close[0]}'?" if close else ""), node_id=str(x),
                        class_type=class_type)
        if not is_mapping(node.get("inputs", {})):
            return _err("invalid_prompt", "Cannot execute because a node's inputs are not an object.",
                        f"Node ID '#{x}': 'inputs' is a {type(node['inputs']).__name__}; give "
                        "an object of input name -> value or [source id, output index]",
                        node_id=str(x), class_type=class_type)
    return None


# ---------------------------------------------------------------------------------------- one node


def _check_linked(x: str, val: list, input_type: Any, info: tuple, prompt: Mapping, nodes: Mapping[str, type],
                  memo: _Memo) -> tuple[dict | None, tuple[str, int] | None]:
    """An input given as a link: (error, None) or (None, (source, index))."""
    link = _link(val)
    if link is None:
        return _err("bad_linked_input", "Bad linked input, must be a length-2 list of [string, int]",
                    f"{x}: got {val!r}; a link is [source node id, output index], e.g. [\"4\", 0]",
                    input_name=x, input_config=info, received_value=val), None
    src, slot = link
    if src not in prompt:
        return _err("bad_linked_input", "Bad linked input, the linked node does not exist",
                    f"{x}: links to node '{src}', which is not in the prompt; connect it to an existing node",
                    input_name=x, input_config=info, received_value=val, linked_node=val), None
    src_class = prompt[src]["class_type"]
    fits = (src_class, slot, input_type) if isinstance(input_type, str) else None
    if fits in memo.links:  # a queue's twins link the same output types into the same inputs: checked once
        return None, (src, slot)
    returns = tuple(getattr(nodes[src_class], "RETURN_TYPES", ()))
    if not 0 <= slot < len(returns):
        return _err("bad_linked_input", "Bad linked input, the output index is out of range",
                    f"{x}: node {src} ({src_class}) has {len(returns)} output(s) {list(returns)}, "
                    f"so index {slot} does not exist; link one of 0..{len(returns) - 1}",
                    input_name=x, input_config=info, received_value=val, linked_node=val), None
    received = returns[slot]
    if not compatible(received, input_type):
        return _err("return_type_mismatch", "Return type mismatch between linked nodes",
                    f"{x}, received_type({_type_name(received)}) mismatch input_type({_type_name(input_type)}); "
                    f"node {src} ({src_class}) output {slot} is {_type_name(received)}, connect a "
                    f"{_type_name(input_type)} output instead",
                    input_name=x, input_config=info, received_type=received, linked_node=val), None
    if fits is not None:
        memo.links.add(fits)
    return None, (src, slot)


def _allowed(lo: Any, hi: Any) -> str:
    return f"allowed {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"


def _check_literal(x: str, val: Any, input_type: Any, opts: dict, info: tuple) -> tuple[dict | None, Any]:
    """An input given as a value: (error, None) or (None, converted value)."""
    try:
        val = _convert(input_type, val)
    except (TypeError, ValueError, OverflowError) as ex:
        hint = f"; give {WANTED[input_type]}" if input_type in WANTED else ""
        return _err("invalid_input_type", f"Failed to convert an input value to a {input_type} value",
                    f"{x}, {val}, {ex}{hint}", input_name=x, input_config=info, received_value=val,
                    exception_message=str(ex)), None
    lo, hi = opts.get("min"), opts.get("max")
    try:
        if lo is not None and val < lo:
            return _err("value_smaller_than_min", f"Value {val} smaller than min of {lo}",
                        f"{x}: {_allowed(lo, hi)}; set {x} to at least {lo}", input_name=x, input_config=info,
                        received_value=val), None
        if hi is not None and val > hi:
            return _err("value_bigger_than_max", f"Value {val} bigger than max of {hi}",
                        f"{x}: {_allowed(lo, hi)}; set {x} to at most {hi}", input_name=x, input_config=info,
                        received_value=val), None
    except TypeError as ex:  # a value of a type that does not compare with its bounds
        return _err("invalid_input_type", f"Failed to convert an input value to a {input_type} value",
                    f"{x}, {val}, {ex}", input_name=x, input_config=info, received_value=val,
                    exception_message=str(ex)), None
    step = opts.get("step")
    if input_type == INT and type(step) is int and step > 1 and val % step:  # not floored behind the user's back
        below = val // step * step
        return _err("value_not_a_multiple", f"Value {val} is not a multiple of {step}",
                    f"{x}: must be a multiple of {step}; use {below} or {below + step}", input_name=x,
                    input_config=info, received_value=val), None
    combo = _choices(input_type, opts)
    if combo is not None and val not in combo:
        return _err("value_not_in_list", "Value not in list",
                    f"{x}: '{val}' not in {_short_list(combo)}; choose one of these values" + _file_hint(val),
                    input_name=x, input_config=info if len(combo) <= LIST_SHOWN else None, received_value=val), None
    return None, val


@dataclass
class _Memo:
    """What one validation learns once and every node reuses: a queue of 64 prompts has 64 twins of most nodes, with
    the same class, the same links' types and mostly the same literals. Only what passed is remembered: an error is
    worked out again for each node, as it names the node."""

    folders: Any
    specs: dict[str, dict] = field(default_factory=dict)  # class_type -> its INPUT_TYPES
    declared: dict[str, tuple[list, set]] = field(default_factory=dict)  # class_type -> (_declared rows, their names)
    literals: dict[tuple, Any] = field(default_factory=dict)  # (class_type, input, type, value) -> the value converted
    links: set[tuple] = field(default_factory=set)  # (source class, output index, input type) of links that fit

    def declared_of(self, class_type: str, nodes: Mapping[str, type]) -> tuple[list, set]:
        """The class's declared inputs (name, category, type, options, (type, options)) and their names."""
        got = self.declared.get(class_type)
        if got is None:
            if class_type not in self.specs:
                self.specs[class_type] = input_types(nodes[class_type], self.folders)
            rows = [(x, cat, t, opts, (t, opts)) for x, cat, t, opts in _declared(self.specs[class_type])]
            got = self.declared[class_type] = rows, {x for x, *_ in rows}
        return got


# literal values a queue's twins share, remembered by (type, value): a float is not (0.0 == -0.0 would mix them up)
_SHARED_LITERALS = (str, int, bool)


def _check_node(node_id: str, prompt: Mapping, nodes: Mapping[str, type],
                memo: _Memo) -> tuple[list[dict], list[tuple[str, str, int]], dict]:
    """ComfyUI's validate_inputs for one node without recursion: (errors, good links, converted inputs)."""
    class_type = prompt[node_id]["class_type"]
    inputs = dict(prompt[node_id].get("inputs") or {})
    try:
        declared, names = memo.declared_of(class_type, nodes)
    except Exception as ex:  # a node class whose INPUT_TYPES raises: ComfyUI reports the exception
        return [_err("exception_during_validation", "Exception when validating node",
                     f"{class_type}.INPUT_TYPES raised {type(ex).__name__}: {ex}; fix or reinstall the node",
                     exception_message=str(ex), exception_type=type(ex).__name__)], [], inputs
    errors: list[dict] = []
    links: list[tuple[str, str, int]] = []
    for x in [k for k in inputs if k not in names]:  # as ComfyUI: an input the node does not declare is ignored
        log.warning("node %s (%s): input %r is not one of its inputs (%s); ignored", node_id, class_type,
                    str(x)[:80], ", ".join(sorted(names)) or "it has none")
        del inputs[x]
    for x, category, input_type, opts, info in declared:
        if x not in inputs:
            if category == "required":
                widget = input_type in (*PRIMITIVES, COMBO) or isinstance(input_type, list | tuple)
                what = "give it a value" if widget else f"connect a {_type_name(input_type)} output to it"
                errors.append(_err("required_input_missing", "Required input is missing", f"{x}: {what}",
                                   input_name=x))
            continue
        val = inputs[x]
        key = (class_type, x, type(val), val) if type(val) in _SHARED_LITERALS else None
        if key is not None:  # a str, int or bool: no wrapped value, no link (and no ABC's slow isinstance to say so)
            if key in memo.literals:
                inputs[x] = memo.literals[key]
                continue
        elif type(val) is not list and is_mapping(val) and "__value__" in val:  # a list widget value, wrapped
            val = val["__value__"]
        elif isinstance(val, list):
            error, link = _check_linked(x, val, input_type, info, prompt, nodes, memo)
            if error is not None:
                errors.append(error)
            else:
                links.append((x, *link))
                inputs[x] = list(link)
            continue
        error, converted = _check_literal(x, val, input_type, opts, info)
        if error is not None:
            more = not_listed(memo.folders, nodes[class_type], x, val) if error["type"] == "value_not_in_list" \
                else None
            if more:  # a model file: where it was looked for, the closest name, how to get it
                error["details"] = f"{x}: '{val}' not in {_short_list(_choices(input_type, opts) or [])}; {more}"
            errors.append(error)
        else:
            inputs[x] = converted
            if key is not None:
                memo.literals[key] = converted
    if not errors:
        errors = _custom_validation(nodes[class_type], inputs, memo.folders)
    return errors, links, inputs


def _custom_validation(cls: type, inputs: Mapping[str, Any], folders: Any = None) -> list[dict]:
    """ComfyUI's VALIDATE_INPUTS: called with the literal inputs it names; anything but True is an error
    (`custom_validation_failed`, details "input - message") on each of those inputs. Two additions of ours, for our
    nodes: a hook with a `folders` parameter gets the folders files are resolved in (our loaders read the file's
    header: a quantisation we do not run is refused here), and one that returns {input: message} puts the errors on
    those inputs only (ComfyUI would report such a value as one message on every input)."""
    fn = getattr(cls, "VALIDATE_INPUTS", None)
    if fn is None:
        return []
    params = inspect.signature(fn).parameters
    wanted = [p for p in params if p in inputs and not is_link(inputs[p])]
    given = {p: inputs[p] for p in wanted}
    try:
        ret = fn(**given, **({"folders": folders} if "folders" in params and "folders" not in given else {}))
    except Exception as ex:  # as ComfyUI: the validator's exception is the node's validation error
        return [_err("exception_during_inner_validation", "Exception when validating inner node",
                     f"{cls.__name__}.VALIDATE_INPUTS raised {type(ex).__name__}: {ex}",
                     exception_message=str(ex), exception_type=type(ex).__name__)]
    if ret is True:
        return []
    if isinstance(ret, Mapping) and ret and set(ret) <= set(given):
        return [_err("custom_validation_failed", "Custom validation failed for node", f"{x} - {m}", input_name=x)
                for x, m in ret.items()]
    return [_err("custom_validation_failed", "Custom validation failed for node",
                 f"{x}" + ("" if ret is False else f" - {ret}"), input_name=x) for x in given]


def _cycle_errors(g: nx.DiGraph) -> dict[str, dict]:
    """A dependency_cycle error for every node on a cycle, naming the inputs that close it."""
    found: dict[str, dict] = {}
    for scc in nx.strongly_connected_components(g):
        node = next(iter(scc))
        if len(scc) == 1 and not g.has_edge(node, node):
            continue
        sub = g.subgraph(scc)
        ring = [u for u, _v in nx.find_cycle(sub, source=min(scc))]
        path = " -> ".join([*ring, ring[0]])
        for n in scc:
            names = sorted(name for src in sub.predecessors(n) for _slot, name in g.edges[src, n]["links"])
            found[n] = _err("dependency_cycle", "Dependency cycle detected",
                            f"{', '.join(names)}: nodes {', '.join(sorted(scc))} depend on each other ({path}, "
                            "source -> consumer); remove one of these links", input_name=names[0],
                            cycle=sorted(scc))
    return found


# -------------------------------------------------------------------------------------------- prompt


def _as_checked(prompt: Mapping, visits: Mapping[str, list], edge_links: Mapping[tuple[str, str], list]) -> nx.DiGraph:
    """The checked nodes and their good links as a graph, built in the order they were checked."""
    g = nx.DiGraph()
    for nid, links in visits.items():
        g.add_node(nid, class_type=prompt[nid]["class_type"])
        for _name, src, _slot in links:
            if not g.has_edge(src, nid):
                g.add_edge(src, nid, links=edge_links[src, nid])
    return g


def _as_copied(prompt: Mapping, visits: Mapping[str, list], edge_links: Mapping[tuple[str, str], list]) -> nx.DiGraph:
    """`_as_checked(...).copy()`, built at once (a graph costs as much to copy as to build): the same nodes in the same
    order (a node comes when it is checked or first linked to), each node's consumers in the order its edges were
    found and, as networkx copies a graph, its producers in node order."""
    order: dict[str, None] = {}
    for nid, links in visits.items():
        order.setdefault(nid)
        for _name, src, _slot in links:
            order.setdefault(src)
    consumers: dict[str, list[str]] = {n: [] for n in order}
    for src, nid in edge_links:
        consumers[src].append(nid)
    dag = nx.DiGraph()
    for n in order:
        dag.add_node(n, class_type=prompt[n]["class_type"])
    dag.add_edges_from((u, v, {"links": edge_links[u, v]}) for u in order for v in consumers[u])
    return dag


def _failed(error: dict, node_errors: dict | None = None) -> Validation:
    return Validation(False, error, node_errors or {}, (), nx.DiGraph())


def validate(prompt: dict, nodes: Mapping[str, type], folders: Any = None,
             outputs: Sequence[str] | None = None) -> Validation:
    """Validate an API-format prompt against `nodes` (class_type -> class); `outputs` limits the outputs
    run (ComfyUI's partial execution). File lists of COMBO inputs come from `folders`."""
    top = _check_top(prompt, nodes)
    found = unsupported_model(prompt, nodes, folders) if isinstance(prompt, Mapping) else None
    if found is not None:  # a workflow for another model: say so, rather than blame a custom node (families.py)
        return _failed(_err("unsupported_model", found.message, found.details, node_id=found.node,
                            class_type=found.class_type, family=found.family))
    if top is not None:
        return _failed(top)
    prompt = {str(x): node for x, node in prompt.items()}
    chosen = None if outputs is None else {str(o) for o in outputs}
    wanted = [x for x, node in prompt.items() if getattr(nodes[node["class_type"]], "OUTPUT_NODE", False) is True
              and (chosen is None or x in chosen)]
    if not wanted:
        out_types = sorted(c for c, cls in nodes.items() if getattr(cls, "OUTPUT_NODE", False) is True)
        return _failed(_err("prompt_no_outputs", "Prompt has no outputs",
                            f"add an output node ({', '.join(out_types[:6])}) or select outputs that are in the "
                            "prompt"))

    memo = _Memo(folders)
    errors: dict[str, list[dict]] = {}
    converted: dict[str, dict] = {}
    visits: dict[str, list[tuple[str, str, int]]] = {}  # node -> its good links, in the order the nodes were checked
    edge_links: dict[tuple[str, str], list] = {}  # (source, consumer) -> the edge's "links", edges in order found
    stack = list(reversed(wanted))
    while stack:  # ComfyUI's recursion over good links, made iterative (a cycle cannot loop it)
        nid = stack.pop()
        if nid in errors:
            continue
        errors[nid], visits[nid], converted[nid] = _check_node(nid, prompt, nodes, memo)
        for name, src, slot in visits[nid]:
            edge_links.setdefault((src, nid), []).append((slot, name))
            stack.append(src)

    if not any(errors.values()):  # every node checked is upstream of an output: the dag is all of them, unless a cycle
        dag = _as_copied(prompt, visits, edge_links)
        if nx.is_directed_acyclic_graph(dag):
            validated = {n: {**{k: v for k, v in prompt[n].items() if k != "inputs"}, "inputs": converted[n]}
                         for n in prompt if n in dag}
            return Validation(True, None, {}, tuple(wanted), dag, validated)
    g = _as_checked(prompt, visits, edge_links)
    for n, e in _cycle_errors(g).items():
        errors[n].append(e)

    bad = {n for n, e in errors.items() if e}
    invalid = bad.union(*(nx.descendants(g, n) for n in bad))
    needs = {o: nx.ancestors(g, o) | {o} for o in wanted}
    good = tuple(o for o in wanted if o not in invalid)
    node_errors = {n: {"errors": errors[n], "dependent_outputs": [o for o in wanted if n in needs[o]],
                       "class_type": prompt[n]["class_type"]} for n in prompt if n in bad}
    dag = g.subgraph(set().union(*(needs[o] for o in good))).copy()
    validated = {n: {**{k: v for k, v in prompt[n].items() if k != "inputs"}, "inputs": converted[n]}
                 for n in prompt if n in dag}
    if good:
        return Validation(True, None, node_errors, good, dag, validated)
    lines = [f"Node {n} ({e['class_type']}) - {r['message']}: {r['details']}"
             for n, e in node_errors.items() for r in e["errors"]]
    return _failed(_err("prompt_outputs_failed_validation", "Prompt outputs failed validation", "\n".join(lines)),
                   node_errors)


__all__ = ["Defaults", "Validation", "input_types", "inputs_with_defaults", "validate"]
