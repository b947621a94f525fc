"""ComfyUI's websocket and history messages, each body built in one place, and the queue's named item.

Every `execution_*`, `executing`, `executed` and `progress` body the server, the batch path and the fleet send is
made here, so the single-prompt path, a batch and a fleet worker (or frontend) cannot drift apart. `QueueItem` is
a queue entry as ComfyUI lists it in /queue and /history: `[number, prompt_id, prompt, extra_data, outputs]`; it
is a named tuple, so it still serialises as that list.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple


class QueueItem(NamedTuple):
    """A queue entry: its number (order), prompt id, API prompt, extra_data and output nodes to run (None: all)."""

    number: float
    prompt_id: str
    prompt: dict
    extra_data: dict
    outputs: list | None = None

    @classmethod
    def of(cls, item: Sequence) -> QueueItem:
        """`item` (a QueueItem, or a list or tuple as /history lists it) as a QueueItem."""
        return item if isinstance(item, QueueItem) else cls(*item[:5])

    @property
    def client_id(self) -> str | None:
        return self.extra_data.get("client_id")

    @property
    def targets(self) -> list[str] | None:
        """The output nodes it runs (POST /prompt's partial_execution_targets), or None for every valid one."""
        return [str(o) for o in self.outputs] if self.outputs else None


def now_ms() -> int:
    return int(time.time() * 1000)


def start(pid: str) -> dict:
    return {"prompt_id": pid, "timestamp": now_ms()}


def success(pid: str) -> dict:
    return {"prompt_id": pid, "timestamp": now_ms()}


def cached(pid: str, nodes: list[str]) -> dict:
    return {"prompt_id": pid, "nodes": nodes, "timestamp": now_ms()}


def executing(pid: str, node: str | None) -> dict:
    """A node starts (`node` None: the prompt is over, sent after its history entry)."""
    return {"node": node, "prompt_id": pid} if node is None else {"node": node, "display_node": node,
                                                                   "prompt_id": pid}


def executed(pid: str, node: str, output: dict) -> dict:
    return {"node": node, "display_node": node, "output": output, "prompt_id": pid}


def progress(pid: str, node: str, data: dict) -> dict:
    """The engine's progress event `data` (value, max) for `node` of prompt `pid`."""
    return {**data, "node": node, "prompt_id": pid}


def interrupted(pid: str, node: str | None, node_type: str | None, executed_nodes: Iterable[str]) -> dict:
    return {"prompt_id": pid, "node_id": node, "node_type": node_type, "executed": list(executed_nodes),
            "timestamp": now_ms()}


def error(pid: str, message: str, kind: str, *, node: str = "", node_type: str = "",
          executed_nodes: Iterable[str] = ()) -> dict:
    """An execution_error that no node's run produced (a refusal, a plan that failed, the worker itself)."""
    return {"prompt_id": pid, "node_id": node, "node_type": node_type, "executed": list(executed_nodes),
            "exception_message": message, "exception_type": kind, "traceback": [], "current_inputs": {},
            "current_outputs": {}, "timestamp": now_ms()}


def node_error(e: Any) -> dict:
    """The execution_error of a node that raised (graph.workflow.errors.NodeExecutionError)."""
    return {**e.to_dict(), "timestamp": now_ms()}


def entry(item: QueueItem, ui: dict, ok: bool, messages: list, report: dict) -> dict:
    """A ComfyUI /history entry."""
    item = QueueItem.of(item)
    return {"prompt": list(item), "outputs": ui,
            "status": {"status_str": "success" if ok else "error", "completed": ok, "messages": messages},
            "meta": {n: {"node_id": n, "display_node": n, "parent_node": None, "real_node_id": n} for n in ui},
            "vramgraph": report}


def failed_entry(item: QueueItem, body: dict, report: dict) -> dict:
    """The /history entry of a prompt that ended with the execution_error `body` before any node ran."""
    return entry(item, {}, False, [["execution_error", body]], report)


__all__ = ["QueueItem", "cached", "entry", "error", "executed", "executing", "failed_entry", "interrupted",
           "node_error", "now_ms", "progress", "start", "success"]
