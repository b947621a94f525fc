"""The server's queue, its websockets and its one worker thread (see app.py).

`PromptQueue` is ComfyUI's queue (pending items ordered by number, the running one, the history);
`Hub` holds the websockets, each with its own ordered outgoing queue on the event loop; `Worker` is the
only thread that calls the engine: it turns the engine's events into ComfyUI's websocket messages and
history entries.

Batches: when the worker takes a prompt and more are already pending, it takes those too (up to
`max_batch`, in queue order) and runs them as one merged graph (graph/workflow/queue.py), so N images share one
load of each model. Every client still sees ComfyUI's per-prompt events with its own node ids, and a
prompt finishes (history entry, execution_success, executing None) as soon as its last node has run.
If a node of the batch fails, the prompts not yet complete run again one by one, so each error is
reported as it would be alone.

Interrupts: /interrupt with a running prompt's id stops that prompt alone. The worker asks the engine to
give up that prompt's output nodes (graph.engine.executor.Cancel): the nodes only they need leave the rest of the
plan (the one running stops at its next progress report), the nodes other prompts need too (loaders, a
shared encode) run on, and every other prompt of the batch finishes with the image it would have had. That
prompt alone gets `execution_interrupted`. /interrupt without an id stops what is running, every incomplete
prompt of the batch, as ComfyUI does. Prompts not yet taken stay in the queue, where /queue can delete them.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .formats import ProgressState
from .hub import PREVIEW_IMAGE, Hub, encode_preview

log = logging.getLogger("vramgraph.server")
MAX_HISTORY = 1000
MAX_HISTORY_BYTES = 256 * 2**20  # the history's entries as JSON, at most; the oldest go first
MAX_BATCH = 16  # prompts planned together at most


Item = tuple  # (number, prompt_id, prompt, extra_data, outputs_to_execute): a queue entry as ComfyUI lists it


def _now_ms() -> int:
    return int(time.time() * 1000)


class PromptQueue:
    """ComfyUI's prompt queue: pending items ordered by number, the running one, the history. Thread-safe."""

    def __init__(self, max_history: int = MAX_HISTORY, max_history_bytes: int = MAX_HISTORY_BYTES) -> None:
        self._cond = threading.Condition()
        self._pending: list[tuple[float, int, Item]] = []
        self._seq = itertools.count()
        self.running: dict[str, Item] = {}
        self.history: OrderedDict[str, dict] = OrderedDict()
        self.flags: dict[str, bool] = {}
        self.max_history, self.max_history_bytes = max_history, max_history_bytes
        self._sizes: dict[str, int] = {}  # prompt id -> its history entry's JSON size
        self._history_bytes = 0

    def put(self, item: Item) -> None:
        with self._cond:
            heapq.heappush(self._pending, (item[0], next(self._seq), item))
            self._cond.notify_all()

    def put_new(self, item: Item) -> bool:
        """Queue `item` unless its prompt id is already pending, running or in the history (then False)."""
        with self._cond:
            if self._known(item[1]):
                return False
            self.put(item)
            return True

    def known(self, prompt_id: str) -> bool:
        with self._cond:
            return self._known(prompt_id)

    def _known(self, prompt_id: str) -> bool:
        return prompt_id in self.running or prompt_id in self.history or any(e[2][1] == prompt_id
                                                                             for e in self._pending)

    def get(self, timeout: float) -> Item | None:
        """The next item (now running), or None after `timeout` seconds or when woken by a flag."""
        with self._cond:
            if not self._pending:
                self._cond.wait(timeout)
            if not self._pending:
                return None
            item = heapq.heappop(self._pending)[2]
            self.running[item[1]] = item
            return item

    def take(self, limit: int) -> list[Item]:
        """Up to `limit` more pending items at once, in queue order (now running); never waits."""
        with self._cond:
            items: list[Item] = []
            while self._pending and len(items) < limit:
                item = heapq.heappop(self._pending)[2]
                self.running[item[1]] = item
                items.append(item)
            return items

    def done(self, prompt_id: str, entry: dict) -> None:
        """Store the history entry, then mark the prompt finished (clients read history once the queue is empty)."""
        size = _json_size(entry)
        with self._cond:
            self._store(prompt_id, entry, size)
            self.running.pop(prompt_id, None)

    def _store(self, prompt_id: str, entry: dict, size: int) -> None:
        """Keep `entry`; the oldest entries go while there are over max_history or over max_history_bytes."""
        self._history_bytes += size - self._sizes.get(prompt_id, 0)
        self.history[prompt_id], self._sizes[prompt_id] = entry, size
        while len(self.history) > self.max_history or (self._history_bytes > self.max_history_bytes
                                                       and len(self.history) > 1):
            old, _ = self.history.popitem(last=False)
            self._history_bytes -= self._sizes.pop(old, 0)

    def update_history(self, prompt_id: str, key: str, value: Any) -> None:
        """Replace one field of a written history entry (a batch's full report, once the batch has ended)."""
        with self._cond:
            entry = self.history.get(prompt_id)
        if entry is None:
            return
        entry = {**entry, key: value}
        size = _json_size(entry)
        with self._cond:
            if prompt_id in self.history:
                self._store(prompt_id, entry, size)

    def set_flag(self, name: str, value: bool) -> None:
        with self._cond:
            self.flags[name] = value
            self._cond.notify_all()

    def take_flags(self) -> dict[str, bool]:
        with self._cond:
            flags, self.flags = self.flags, {}
            return flags

    def remaining(self) -> int:
        with self._cond:
            return len(self._pending) + len(self.running)

    def current(self) -> tuple[list[Item], list[Item]]:
        with self._cond:
            return list(self.running.values()), [e[2] for e in sorted(self._pending)]

    def wipe(self) -> None:
        with self._cond:
            self._pending.clear()

    def delete(self, prompt_id: str) -> bool:
        with self._cond:
            kept = [e for e in self._pending if e[2][1] != prompt_id]
            found = len(kept) != len(self._pending)
            self._pending = kept
            heapq.heapify(self._pending)
            return found

    def get_history(self, prompt_id: str | None = None, max_items: int | None = None) -> dict:
        with self._cond:
            if prompt_id is not None:
                return {prompt_id: self.history[prompt_id]} if prompt_id in self.history else {}
            items = list(self.history.items())
            return dict(items[-max_items:] if max_items else items)

    def delete_history(self, prompt_id: str | None = None) -> None:
        with self._cond:
            if prompt_id is None:
                self.history.clear()
                self._sizes.clear()
                self._history_bytes = 0
            else:
                self.history.pop(prompt_id, None)
                self._history_bytes -= self._sizes.pop(prompt_id, 0)


def _json_size(entry: dict) -> int:
    """The bytes of `entry` as /history sends it."""
    return len(json.dumps(entry, default=str))


class Worker:
    """The one thread that owns the engine: takes prompts off the queue, runs them, reports events."""

    def __init__(self, engine: Any, queue: PromptQueue, hub: Hub, previews: bool = False, batch: bool = True,
                 max_batch: int = MAX_BATCH) -> None:
        self.engine, self.queue, self.hub, self.previews = engine, queue, hub, previews
        self.batch, self.max_batch = batch, max_batch  # plan the prompts pending together (see the module doc)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.client_id: str | None = None  # the running prompt's client
        self.last_node: str | None = None
        self.plan_message: dict | None = None  # the running prompt's vramgraph.plan data, for reconnecting pages
        self.ui_cache: dict[str, dict] = {}  # node signature -> its ui, re-sent when the engine reports it cached
        self._lock = threading.Lock()  # guards the three below: /interrupt's thread against the worker's
        self._stopping: set[str] = set()  # taken prompts asked to stop (a targeted /interrupt)
        self._targets: dict[str, tuple[str, ...]] = {}  # running prompt -> its output nodes in the running graph
        self._cancel: Any = None  # the running graph's graph.engine.executor.Cancel

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="vramgraph-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.engine.interrupt()
        self.queue.set_flag("stop", True)
        if self._thread is not None:
            self._thread.join(timeout)

    def status(self) -> dict:
        return {"exec_info": {"queue_remaining": self.queue.remaining()}}

    def interrupt(self, prompt_id: str | None = None) -> bool:
        """/interrupt: without an id, stop what is running; with a running prompt's id, stop that prompt alone
        (see the module doc). False when that prompt is not running (pending, finished, unknown: nothing stops)."""
        if prompt_id is None:
            self.engine.interrupt()
            return True
        with self._lock:
            if prompt_id not in self.queue.running:
                return False
            self._stopping.add(prompt_id)
            if prompt_id in self._targets and self._cancel is not None:
                self._cancel.outputs(self._targets[prompt_id])
        return True

    def _track(self, cancel: Any, targets: dict[str, tuple[str, ...]]) -> None:
        """The graph about to run: its Cancel and each prompt's outputs in it; stops asked for already apply."""
        with self._lock:
            self._cancel, self._targets = cancel, dict(targets)
            for pid in self._stopping & set(targets):
                cancel.outputs(targets[pid])

    def _untrack(self, pid: str | None = None) -> None:
        """One prompt of the running graph is over (or, with None, the whole graph)."""
        with self._lock:
            if pid is None:
                self._cancel, self._targets = None, {}
            else:
                self._targets.pop(pid, None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            item = self.queue.get(timeout=1.0)
            if item is not None:
                items = [item, *(self.queue.take(self.max_batch - 1) if self.batch and self.max_batch > 1 else [])]
                try:
                    if len(items) == 1:
                        self.execute(item)
                    else:
                        self.execute_batch(items)
                except Exception:  # the worker must survive anything a prompt does
                    log.exception("prompt(s) %s: unexpected failure", ", ".join(i[1] for i in items))
                finally:
                    self._settle(items)
                    self._untrack()
                    with self._lock:
                        self._stopping.difference_update(i[1] for i in items)
            flags = self.queue.take_flags()
            if flags.get("unload_models") or flags.get("free_memory"):
                self.engine.free(bool(flags.get("unload_models")), bool(flags.get("free_memory")))

    def execute(self, item: Item) -> None:
        from ..graph.draw.timeline import timeline_data, timeline_svg
        from ..graph.engine.executor import Cancel
        from ..graph.plan.planner import PlanError
        from ..graph.workflow.errors import InterruptedRun, NodeExecutionError, ValidationFailed

        pid, prompt, extra = item[1:4]
        sid = extra.get("client_id")
        self.client_id, self.last_node = sid, None
        messages: list[list] = []
        ui: dict[str, dict] = {}
        ran: list[str] = []
        plan: dict = {}
        cancel, stopped = Cancel(), {}
        progress = ProgressState(pid)

        def emit(kind: str, data: dict, keep: bool = False) -> None:
            if keep:
                messages.append([kind, data])
            self.hub.send_threadsafe(kind, data, sid)

        def events(kind: str, data: dict) -> None:
            data = {**data, "prompt_id": data.get("prompt_id") or pid}
            if kind == "execution_success" and stopped:  # interrupted: told once the run has ended
                return
            if kind in ("execution_cached", "execution_success"):
                ran.extend(data.get("nodes", []) if kind == "execution_cached" else [])
                emit(kind, {**data, "timestamp": _now_ms()}, keep=True)
                for node in data.get("nodes", []) if kind == "execution_cached" else []:
                    cached = self.ui_cache.get(prep.signatures.get(node, ""))
                    if cached is not None:  # as ComfyUI: a cached output node shows its last output again
                        ui[node] = cached
                        emit("executed", {"node": node, "display_node": node, "output": cached, "prompt_id": pid})
            elif kind == "plan":
                svg = timeline_svg(prep.plan, str(extra.get("workflow_name") or ""), card=self.engine.budget.card,
                                   prompt=prep.prompt)
                self.plan_message = {"prompt_id": pid, "plan": data["plan"], "timeline": timeline_data(prep.plan),
                                     "svg": svg}
                plan.update(data["plan"])
                emit("vramgraph.plan", self.plan_message)
            elif kind == "executing":
                if data.get("node") is not None:  # the end is announced once the history is written
                    self.last_node = data["node"]
                    emit(kind, {**data, "display_node": data.get("display_node") or data["node"]})
                    emit("progress_state", progress.start(data["node"]))
            elif kind == "progress":
                emit(kind, data)
                emit("progress_state", progress.update(data["node"], data["value"], data["max"]))
            elif kind == "cancelled":  # this prompt's /interrupt: its outputs (all of them) are given up
                stopped.setdefault("node", next((n for n in (data["node"], *data["dropped"]) if n), None))
            elif kind == "executed":
                ran.append(data["node"])
                emit("progress_state", progress.finish(data["node"]))
                if data.get("output") is not None:
                    ui[data["node"]] = data["output"]
                    if len(self.ui_cache) > MAX_HISTORY:
                        self.ui_cache.clear()
                    self.ui_cache[prep.signatures[data["node"]]] = data["output"]
                    emit(kind, {"node": data["node"], "display_node": data["node"], "output": data["output"],
                                "prompt_id": pid})
            elif kind == "vg_step":
                emit("vramgraph.step", data)
            elif kind == "vg_replan":  # other processes took GPU memory: the rest of the run was planned again
                emit("vramgraph.replan", data)
            elif kind == "vg_estimate_exceeded":
                emit("vramgraph.estimate", data)
            elif kind == "preview":
                self.hub.send_threadsafe(PREVIEW_IMAGE, encode_preview(data["image"]), sid)

        emit("execution_start", {"prompt_id": pid, "timestamp": _now_ms()}, keep=True)
        self.engine.previews = self._wants_previews(extra)
        result = None
        try:
            prep = self.engine.prepare(prompt, outputs=_outputs(item))
            self._track(cancel, {pid: prep.outputs})
            result = self.engine.run(prep, extra_pnginfo=extra.get("extra_pnginfo"), prompt_id=pid, events=events,
                                     cancel=cancel)
            if stopped:
                result, node = None, stopped["node"]
                emit("execution_interrupted", {"prompt_id": pid, "node_id": node, "node_type": prompt.get(
                    node, {}).get("class_type") if node else None, "executed": ran, "timestamp": _now_ms()},
                    keep=True)
        except InterruptedRun as e:
            emit("execution_interrupted", {"prompt_id": pid, "node_id": e.node_id, "node_type": e.class_type,
                                           "executed": ran, "timestamp": _now_ms()}, keep=True)
        except NodeExecutionError as e:
            e.prompt_id, e.executed = pid, list(ran)
            emit("execution_error", {**e.to_dict(), "timestamp": _now_ms()}, keep=True)
        except (PlanError, ValidationFailed) as e:
            info = e.to_dict()
            node = info.get("extra_info", {}).get("node_id") or next(iter(getattr(e, "node_errors", {}) or {}), "")
            emit("execution_error", {"prompt_id": pid, "node_id": node, "node_type": prompt.get(node, {}).get(
                "class_type", ""), "executed": ran, "exception_message": f"{info['message']}: {info['details']}",
                "exception_type": type(e).__name__, "traceback": [], "current_inputs": {}, "current_outputs": {},
                "timestamp": _now_ms()}, keep=True)
        except Exception as e:
            log.exception("prompt %s failed", pid)
            emit("execution_error", {"prompt_id": pid, "node_id": self.last_node or "", "node_type": "",
                                     "executed": ran, "exception_message": str(e), "exception_type": type(e).__name__,
                                     "traceback": [], "current_inputs": {}, "current_outputs": {},
                                     "timestamp": _now_ms()}, keep=True)
        ok = result is not None
        entry = _entry(item, ui, ok, messages, result.to_json() if ok else {"plan": plan, "executed": ran})
        self._untrack(pid)
        self.queue.done(pid, entry)
        self.client_id, self.last_node, self.plan_message = None, None, None
        self.hub.send_threadsafe("status", {"status": self.status()})
        self.hub.send_threadsafe("executing", {"node": None, "prompt_id": pid}, sid)

    def _wants_previews(self, extra: dict) -> bool:
        method = extra.get("preview_method")
        return self.previews if method is None else str(method).lower() != "none"

    def _send(self, m: _Member, kind: str, data: dict, keep: bool = False) -> None:
        if keep:
            m.messages.append([kind, data])
        self.hub.send_threadsafe(kind, data, m.sid)

    def _end(self, m: _Member, entry: dict) -> None:
        """A batch's prompt is over: its history entry, the queue's status, then the end of its execution."""
        m.done = True
        self._untrack(m.pid)
        self.queue.done(m.pid, entry)
        self.hub.send_threadsafe("status", {"status": self.status()})
        self.hub.send_threadsafe("executing", {"node": None, "prompt_id": m.pid}, m.sid)

    def execute_batch(self, items: list[Item]) -> None:
        """Run several queued prompts as one merged graph, each reported to its client as if it ran alone."""
        from ..graph.draw.timeline import timeline_data, timeline_svg
        from ..graph.engine.executor import Cancel
        from ..graph.workflow.errors import InterruptedRun

        try:
            prep, merged = self.engine.prepare_queue([i[2] for i in items], [i[3].get("extra_pnginfo") for i in items],
                                                     [_outputs(i) for i in items])
        except Exception as e:  # PlanError, ValidationFailed, ...: alone, each prompt reports its own error
            log.warning("%d prompts not planned together (%s: %s); running them one by one", len(items),
                        type(e).__name__, e)
            for item in items:
                self.execute(item)
            return
        batch_id, pids = uuid.uuid4().hex, [i[1] for i in items]
        planned = set(prep.plan.order)
        members = [_Member(k, item, dict(rename), self._wants_previews(item[3]), {n for n in rename.values()
                                                                                  if n in planned})
                   for k, (item, rename) in enumerate(zip(items, merged.members, strict=True))]
        owners: dict[str, list[tuple[_Member, str]]] = {}  # merged id -> (prompt, its own id), shared nodes: several
        for m in members:
            for orig, new in m.rename.items():
                owners.setdefault(new, []).append((m, orig))
        for out in prep.outputs:  # output nodes are never shared: each is one prompt's
            owners[out][0][0].outputs.append(out)
        cancel = Cancel()
        self._track(cancel, {m.pid: tuple(m.outputs) for m in members})
        plan_json = prep.plan.to_json()
        plan_messages: dict[str | None, dict] = {}
        nodes: list[dict] = []  # the batch's node reports so far
        images: list[str] = []
        moves = {"load": 0, "unload": 0}
        t0 = time.perf_counter()

        def about(m: _Member) -> dict:
            return {"batch": {"id": batch_id, "prompt_ids": pids, "index": m.index}, "members": m.rename}

        def report(m: _Member, result: Any = None) -> dict:
            if result is not None:
                return {**result.to_json(), **about(m)}
            return {"prompt_id": batch_id, "seconds": round(time.perf_counter() - t0, 4), "loads": moves["load"],
                    "unloads": moves["unload"], "cached": list(prep.cached), "images": list(images),
                    "nodes": list(nodes), "plan": plan_json, "partial": True, **about(m)}

        def finish(m: _Member) -> None:
            self._send(m, "execution_success", {"prompt_id": m.pid, "timestamp": _now_ms()}, keep=True)
            self._end(m, _entry(m.item, m.ui, True, m.messages, report(m)))

        def interrupted(m: _Member, node: str | None) -> None:
            orig = next((o for mm, o in owners.get(node or "", ()) if mm is m), None)
            m.stopped = True
            self._send(m, "execution_interrupted", {
                "prompt_id": m.pid, "node_id": orig, "node_type": m.item[2].get(orig, {}).get("class_type")
                if orig else None, "executed": list(m.ran), "timestamp": _now_ms()}, keep=True)
            self._end(m, _entry(m.item, m.ui, False, m.messages,
                                {"plan": plan_json, "executed": list(m.ran), **about(m)}))

        def running(node: str | None) -> list[tuple[_Member, str]]:  # the prompts still told about `node`
            return [(m, orig) for m, orig in owners.get(node or "", ()) if not m.done]

        def follow(m: _Member, node: str | None) -> None:  # what a page that reconnects now is told
            base = plan_messages.get(m.sid) or plan_messages.get(None)
            self.client_id, self.last_node = m.sid, node
            self.plan_message = {**base, "prompt_id": m.pid} if base else None

        def events(kind: str, data: dict) -> None:
            node = data.get("node")
            if kind == "plan":
                timeline = timeline_data(prep.plan)
                names = {str(i[3].get("workflow_name") or "") for i in items}
                svg = timeline_svg(prep.plan, names.pop() if len(names) == 1 else "", card=self.engine.budget.card,
                                   prompt=prep.prompt)
                for sid, first in _clients(members).items():
                    plan_messages[sid] = {"prompt_id": first.pid, "prompt_ids": pids, "batch": batch_id,
                                          "members": {m.pid: m.rename for m in members}, "plan": plan_json,
                                          "timeline": timeline, "svg": svg}
                    self.hub.send_threadsafe("vramgraph.plan", plan_messages[sid], sid)
                follow(members[0], None)
                for m in members:
                    cached = [orig for orig, new in m.rename.items() if new in prep.cached]
                    m.ran.extend(cached)
                    self._send(m, "execution_cached", {"prompt_id": m.pid, "nodes": cached,  # as ComfyUI: empty too
                                                       "timestamp": _now_ms()}, keep=True)
                    for orig in cached:  # as ComfyUI: a cached output node shows its last output again
                        ui = self.ui_cache.get(prep.signatures.get(m.rename[orig], ""))
                        if ui is not None:
                            m.ui[orig] = ui
                            self._send(m, "executed", {"node": orig, "display_node": orig, "output": ui,
                                                       "prompt_id": m.pid})
                    if not m.left and not m.done:
                        finish(m)
            elif kind == "executing" and node is not None:
                for m, orig in running(node):
                    follow(m, orig)
                    self._send(m, "executing", {"node": orig, "display_node": orig, "prompt_id": m.pid})
                    self._send(m, "progress_state", m.progress.start(orig))
            elif kind == "progress":
                for m, orig in running(node):
                    self._send(m, "progress", {**data, "node": orig, "prompt_id": m.pid})
                    self._send(m, "progress_state", m.progress.update(orig, data["value"], data["max"]))
            elif kind == "cancelled":  # a targeted /interrupt: those prompts stop, the others go on
                gone = set(data["outputs"])
                for m in members:
                    if not m.done and gone & set(m.outputs):
                        interrupted(m, next((n for n in (data["node"], *data["dropped"])
                                             if any(mm is m for mm, _ in owners.get(n or "", ()))), None))
                for m in members:  # nodes left out that a prompt listed but did not need
                    m.left.difference_update(data["dropped"])
                    if not m.left and not m.done:
                        finish(m)
            elif kind == "executed":
                output = data.get("output")
                variant = prep.plan.variant_of(node)
                nodes.append({"node": node, "class_type": prep.prompt[node]["class_type"], "variant": variant,
                              "seconds": data.get("seconds", 0.0), "measured_bytes": data.get("measured_bytes", 0),
                              "predicted_bytes": next(
                                  (o.activation for o in prep.costs[node].variants if o.name == variant), 0)})
                if output is not None:
                    if len(self.ui_cache) > MAX_HISTORY:
                        self.ui_cache.clear()
                    self.ui_cache[prep.signatures[node]] = output
                    folders = self.engine.folders
                    images.extend(str((folders.output if im.get("type") == "output" else folders.temp)
                                      / im.get("subfolder", "") / im["filename"]) for im in output.get("images", []))
                for m, orig in running(node):
                    m.ran.append(orig)
                    self._send(m, "progress_state", m.progress.finish(orig))
                    if output is not None:
                        m.ui[orig] = output
                        self._send(m, "executed", {"node": orig, "display_node": orig, "output": output,
                                                   "prompt_id": m.pid})
                for m in dict.fromkeys(m for m, _ in running(node)):
                    m.left.discard(node)
                    if not m.left and not m.done:
                        finish(m)
            elif kind == "vg_estimate_exceeded":
                for sid, first in _clients([m for m, _ in running(node)]).items():
                    self.hub.send_threadsafe("vramgraph.estimate", {**data, "prompt_id": first.pid, "node": next(
                        orig for m, orig in running(node) if m is first), "prompt_ids": pids}, sid)
            elif kind == "vg_replan":
                for sid, first in _clients([m for m in members if not m.done]).items():
                    self.hub.send_threadsafe("vramgraph.replan", {**data, "prompt_id": first.pid, "prompt_ids": pids},
                                             sid)
            elif kind == "vg_step":
                moves[data["kind"]] = moves.get(data["kind"], 0) + 1
                for sid, first in _clients([m for m in members if not m.done]).items():
                    self.hub.send_threadsafe("vramgraph.step", {**data, "prompt_id": first.pid, "prompt_ids": pids},
                                             sid)
            elif kind == "preview":
                wanted = [m for m, _ in running(node) if m.previews]
                if wanted:
                    frame = encode_preview(data["image"])
                    for sid in _clients(wanted):
                        self.hub.send_threadsafe(PREVIEW_IMAGE, frame, sid)

        for m in members:
            self._send(m, "execution_start", {"prompt_id": m.pid, "timestamp": _now_ms()}, keep=True)
        self.engine.previews = any(m.previews for m in members)
        try:
            result = self.engine.run(prep, prompt_id=batch_id, events=events, cancel=cancel)
        except InterruptedRun as e:  # /interrupt without an id: every prompt not complete stops
            for m in members:
                if not m.done:
                    interrupted(m, e.node_id)
        except Exception as e:  # a node failed: the prompts not complete run alone, each reporting its own error
            left = [m for m in members if not m.done]
            log.warning("batch %s failed (%s: %s); running its %d incomplete prompt(s) one by one", batch_id,
                        type(e).__name__, e, len(left))
            self.client_id, self.last_node, self.plan_message = None, None, None
            for m in left:
                self.execute(m.item)
        else:
            for m in members:
                if not m.done:
                    finish(m)
            for m in members:  # the whole run's report, now that it has ended
                if not m.stopped:
                    self.queue.update_history(m.pid, "vramgraph", report(m, result))
        finally:
            self.client_id, self.last_node, self.plan_message = None, None, None

    def _settle(self, items: list[Item]) -> None:
        """Any taken prompt left running by a failure of the worker itself ends with an error."""
        running = self.queue.running
        for item in items:
            if item[1] in running:
                m = _Member(0, item, {}, False)
                self._send(m, "execution_error", {
                    "prompt_id": m.pid, "node_id": "", "node_type": "", "executed": [],
                    "exception_message": "the server's worker failed; see its log", "exception_type": "RuntimeError",
                    "traceback": [], "current_inputs": {}, "current_outputs": {}, "timestamp": _now_ms()}, keep=True)
                self._end(m, _entry(item, {}, False, m.messages, {}))


@dataclass(eq=False)
class _Member:
    """One prompt of a batch: its queue item, its node ids in the merged graph, what it has been told."""

    index: int
    item: Item
    rename: dict[str, str]  # its node id -> the merged graph's
    previews: bool
    left: set[str] = field(default_factory=set)  # merged ids of its nodes in the plan that have still to run
    messages: list[list] = field(default_factory=list)
    ui: dict[str, dict] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)  # its node ids done, cached or run
    outputs: list[str] = field(default_factory=list)  # its output nodes' merged ids
    progress: ProgressState = field(init=False)
    done: bool = False
    stopped: bool = False  # interrupted

    def __post_init__(self) -> None:
        self.progress = ProgressState(self.pid)

    @property
    def pid(self) -> str:
        return self.item[1]

    @property
    def sid(self) -> str | None:
        return self.item[3].get("client_id")


def _outputs(item: Item) -> list[str] | None:
    """The output nodes a queue item runs (POST /prompt's partial_execution_targets, or every valid one)."""
    return [str(o) for o in item[4]] if len(item) > 4 and item[4] else None


def _clients(members: list[_Member]) -> dict[str | None, _Member]:
    """The distinct clients of `members`, each with its first prompt; None (no client id: every client) alone."""
    firsts: dict[str | None, _Member] = {}
    for m in members:
        firsts.setdefault(m.sid, m)
    return {None: firsts[None]} if None in firsts else firsts


def _entry(item: Item, ui: dict, ok: bool, messages: list, report: dict) -> dict:
    """A ComfyUI /history entry."""
    number, pid, prompt, extra, outputs = item[:5]
    return {"prompt": [number, pid, prompt, extra, outputs], "outputs": ui,
            "status": {"status_str": "success" if ok else "error", "completed": ok, "messages": messages},
            "meta": {n: {"node_id": n, "display_node": n, "parent_node": None, "real_node_id": n} for n in ui},
            "vramgraph": report}


__all__ = ["MAX_BATCH", "PromptQueue", "Worker"]
