"""The engine's errors: a small hierarchy, each serialising to ComfyUI's {type, message, details, extra_info}.

    VramgraphError            base: type, message, details, extra_info, to_dict()
    ├── WorkflowError         a workflow file that cannot be read or converted
    ├── ValidationFailed      validation rejected the prompt; carries ComfyUI's whole /prompt response
    ├── NodeExecutionError    a node raised while running; to_dict() is ComfyUI's `execution_error` message
    └── InterruptedRun        the user stopped the run

A node whose measured GPU peak passes its plan is no error: the engine reports it (the `vg_estimate_exceeded` event,
graph/engine/executor.py `estimate_exceeded`) and plans the rest again when the device runs short, so no exception
stands for it.

The planner's own `PlanError` (graph/plan/planner.py) lives beside the planner, which imports nothing from here.
"""

from __future__ import annotations

import traceback as tb
from collections.abc import Mapping, Sequence
from typing import Any


class VramgraphError(Exception):
    """Base of the engine's errors. `message` says what went wrong, `details` what to do about it."""

    type: str = "vramgraph_error"

    def __init__(self, message: str, details: str = "", extra_info: Mapping[str, Any] | None = None,
                 type: str | None = None) -> None:
        super().__init__(f"{message}: {details}" if details else message)
        self.message = message
        self.details = details
        self.extra_info = dict(extra_info or {})
        if type is not None:
            self.type = type

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "details": self.details,
                "extra_info": dict(self.extra_info)}


class WorkflowError(VramgraphError):
    """A workflow file that cannot be read: not JSON, neither API nor UI format, a subgraph that cannot expand."""

    type = "invalid_prompt"


class ValidationFailed(VramgraphError):
    """The prompt failed validation; `.response` is exactly ComfyUI's POST /prompt answer (HTTP 400)."""

    type = "prompt_outputs_failed_validation"

    def __init__(self, response: Mapping[str, Any]) -> None:
        error = dict(response.get("error") or {})
        super().__init__(error.get("message", "Prompt outputs failed validation"), error.get("details", ""),
                         error.get("extra_info"), error.get("type", self.type))
        self.response = {"error": error, "node_errors": dict(response.get("node_errors") or {})}

    @property
    def node_errors(self) -> dict[str, Any]:
        return self.response["node_errors"]

    def __str__(self) -> str:
        return summary(self.response)


def _flat(text: Any) -> str:
    return " ".join(str(text).split())


def validation_lines(response: Mapping[str, Any]) -> list[str]:
    """ComfyUI's /prompt error answer as one line per node error ("node 5 (VGEmptyLatent): width: ... [type]"),
    or the top error's message and details when no node has one."""
    lines = []
    for node, entry in (response.get("node_errors") or {}).items():
        for err in entry.get("errors", []):
            where = f"node {node} ({entry.get('class_type', '?')}): "
            lines.append(where + (f"{_flat(err['details'])} [{err.get('type')}]" if err.get("details") else
                                  _flat(err.get("message", ""))))
    if not lines:
        e = response.get("error") or {}
        lines.append(_flat(f"{e.get('message', 'invalid prompt')}: {e.get('details')}" if e.get("details")
                           else e.get("message", "invalid prompt")))
    return lines


def summary(response: Mapping[str, Any], more: str = "") -> str:
    """A refused prompt in one line: its first error (node, input, reason) and how many more there are."""
    lines = validation_lines(response)
    return lines[0] + (f" (and {len(lines) - 1} more{more})" if len(lines) > 1 else "")


def one_line(e: BaseException) -> str:
    """Any error of a run in one line, the same everywhere it is shown: a refused prompt by its first node error,
    a failed node by its id, type and message, our other errors by message and details, anything else as text."""
    if isinstance(e, ValidationFailed):
        return str(e)
    if isinstance(e, NodeExecutionError):
        return _flat(f"node {e.node_id} ({e.class_type}) failed: {e.exception_message}")
    d = e.to_dict() if hasattr(e, "to_dict") else None
    if isinstance(d, dict) and "message" in d:
        return _flat(f"{d['message']}: {d['details']}" if d.get("details") else d["message"])
    return _flat(e)


def _format_value(x: Any) -> Any:
    """ComfyUI's format_value: JSON primitives as they are, anything else (tensors, handles) as short text."""
    if x is None or isinstance(x, bool | int | float | str):
        return x
    text = str(x)
    return text if len(text) <= 200 else text[:197] + "..."


def _type_name(exc_type: type) -> str:
    """ComfyUI's full_type_name: `module.QualName`, bare for builtins."""
    module = exc_type.__module__
    return exc_type.__qualname__ if module == "builtins" else f"{module}.{exc_type.__qualname__}"


class NodeExecutionError(VramgraphError):
    """A node raised while running. `to_dict()` is ComfyUI's `execution_error` websocket/history message."""

    type = "execution_error"

    def __init__(self, node_id: str, class_type: str, exception_message: str, exception_type: str,
                 traceback: Sequence[str] = (), current_inputs: Mapping[str, Any] | None = None,
                 prompt_id: str = "", executed: Sequence[str] = (),
                 current_outputs: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"Node {node_id} ({class_type}) failed: {exception_type}: {exception_message}",
                         "fix the inputs named in the message, or the files it refers to, and queue again",
                         {"node_id": node_id, "class_type": class_type})
        self.node_id = node_id
        self.class_type = class_type
        self.exception_message = exception_message
        self.exception_type = exception_type
        self.traceback = list(traceback)
        self.current_inputs = dict(current_inputs or {})
        self.prompt_id = prompt_id
        self.executed = list(executed)
        self.current_outputs = dict(current_outputs or {})

    @classmethod
    def from_exception(cls, node_id: str, class_type: str, exc: BaseException,
                       inputs: Mapping[str, Any] | None = None, prompt_id: str = "",
                       executed: Sequence[str] = ()) -> NodeExecutionError:
        """Wrap what a node's function raised; inputs are shown as ComfyUI shows them (lists of values)."""
        shown = {k: [_format_value(v)] for k, v in (inputs or {}).items()}
        return cls(node_id, class_type, str(exc), _type_name(type(exc)), tb.format_tb(exc.__traceback__),
                   shown, prompt_id, executed)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "node_id": self.node_id, "node_type": self.class_type,
                "executed": list(self.executed), "exception_message": self.exception_message,
                "exception_type": self.exception_type, "traceback": list(self.traceback),
                "current_inputs": dict(self.current_inputs), "current_outputs": dict(self.current_outputs)}


class InterruptedRun(VramgraphError):
    """The run was stopped (interrupt button, Ctrl-C) before or while `node_id` ran."""

    type = "execution_interrupted"

    def __init__(self, node_id: str | None = None, class_type: str | None = None) -> None:
        where = f" at node {node_id} ({class_type})" if node_id is not None else ""
        super().__init__(f"Run interrupted{where}", "queue the prompt again to finish it; finished nodes are cached",
                         {"node_id": node_id, "class_type": class_type})
        self.node_id = node_id
        self.class_type = class_type


__all__ = ["InterruptedRun", "NodeExecutionError", "ValidationFailed", "VramgraphError",
           "WorkflowError"]
