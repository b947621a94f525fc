"""The server's queue, its websockets and its one worker thread (see app.py).

`PromptQueue` is ComfyUI's queue (pending items ordered by number, the running one, the history);
`Hub` holds the websockets, each with its own ordered outgoing queue on the event loop; `Worker` is the
only thread that calls the engine: its runs' events become ComfyUI's websocket messages and history entries
(events.py, messages.py).

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
prompt alone gets `execution_interrupted`. /interrupt without an id stops the prompt that is running, as
ComfyUI does: in a batch, the one whose node runs now (the first of those sharing it); the batch's others go on.
Prompts not yet taken stay in the queue, where /queue can delete them. Batch messages (`vramgraph.plan`, steps,
estimates) and reports name only the receiving client's prompts.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import uuid
from collections import OrderedDict
from typing import Any, NamedTuple

from . import messages as msg
from .events import Member, Translation, tell
from .hub import Hub
from .messages import QueueItem

log = logging.getLogger("vramgraph.server")
MAX_HISTORY = 1000
MAX_HISTORY_BYTES = 256 * 2**20  # the history's entries as JSON, at most; the oldest go first
MAX_BATCH = 16  # prompts planned together at most


Item = QueueItem  # a queue entry as ComfyUI lists it (messages.py)


class _Pending(NamedTuple):
    """A pending item in the heap: ordered by its number, then by when it was queued."""

    number: float
    seq: int
    item: QueueItem


class PromptQueue:
    """ComfyUI's prompt queue: pending items ordered by number, the running one, the history. Thread-safe."""

    def __init__(self, max_history: int = MAX_HISTORY, max_history_bytes: int = MAX_HISTORY_BYTES) -> None:
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._seq = itertools.count()
        self.running: dict[str, Item] = {}
        self.history: OrderedDict[str, dict] = OrderedDict()
        self.flags: dict[str, bool] = {}
        self.max_history, self.max_history_bytes = max_history, max_history_bytes
        self._sizes: dict[str, int] = {}  # prompt id -> its history entry's JSON size
        self._history_bytes = 0

    def put(self, item: Item) -> None:
        item = QueueItem.of(item)
        with self._cond:
            heapq.heappush(self._pending, _Pending(item.number, next(self._seq), item))
            self._cond.notify_all()

    def put_many(self, items: list[Item]) -> None:
        """Queue several at once, so the Worker thread takes them together (it batches what is pending)."""
        with self._cond:
            for item in map(QueueItem.of, items):
                heapq.heappush(self._pending, _Pending(item.number, next(self._seq), item))
            self._cond.notify_all()

    def put_new(self, item: Item) -> bool:
        """Queue `item` unless its prompt id is already pending, running or in the history (then False)."""
        with self._cond:
            if self._known(QueueItem.of(item).prompt_id):
                return False
            self.put(item)
            return True

    def known(self, prompt_id: str) -> bool:
        with self._cond:
            return self._known(prompt_id)

    def _known(self, prompt_id: str) -> bool:
        return prompt_id in self.running or prompt_id in self.history or any(e.item.prompt_id == prompt_id
                                                                             for e in self._pending)

    def get(self, timeout: float) -> Item | None:
        """The next item (now running), or None after `timeout` seconds or when woken by a flag."""
        with self._cond:
            if not self._pending:
                self._cond.wait(timeout)
            if not self._pending:
                return None
            item = heapq.heappop(self._pending).item
            self.running[item.prompt_id] = item
            return item

    def take(self, limit: int) -> list[Item]:
        """Up to `limit` more pending items at once, in queue order (now running); never waits."""
        with self._cond:
            items: list[Item] = []
            while self._pending and len(items) < limit:
                item = heapq.heappop(self._pending).item
                self.running[item.prompt_id] = item
                items.append(item)
            return items

    def done(self, prompt_id: str, entry: dict) -> None:
        """Store the history entry, then mark the prompt finished (clients read history once the queue is empty)."""
        size = _json_size(entry)
        with self._cond:
            self._store(prompt_id, entry, size)
            self.running.pop(prompt_id, None)
        log.info("%s", done_line(prompt_id, entry))

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
            return list(self.running.values()), [e.item for e in sorted(self._pending)]

    def wipe(self) -> None:
        with self._cond:
            self._pending.clear()

    def delete(self, prompt_id: str) -> bool:
        with self._cond:
            kept = [e for e in self._pending if e.item.prompt_id != prompt_id]
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
        self._lock = threading.Lock()  # guards the three below: /interrupt's thread against the worker's
        self._stopping: set[str] = set()  # taken prompts asked to stop (a targeted /interrupt)
        self._targets: dict[str, tuple[str, ...]] = {}  # running prompt -> its output nodes in the running graph
        self._cancel: Any = None  # the running graph's graph.engine.executor.Cancel
        self._now: str | None = None  # the prompt of the batch whose node runs now (/interrupt without an id)

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

    def interrupt_all(self) -> None:
        """Stop every prompt the worker is running (shutting down, a fleet worker that lost its broker)."""
        self.engine.interrupt()

    def interrupt(self, prompt_id: str | None = None) -> bool:
        """/interrupt: with a running prompt's id, stop that prompt alone; without, the prompt that is running (in a
        batch, the one whose node runs now; the others go on), as ComfyUI does (see the module doc). False when
        nothing stops (that prompt is pending, finished or unknown)."""
        if prompt_id is None:
            with self._lock:
                live = [p for p in self._targets if p in self.queue.running]
                prompt_id = (self._now if self._now in live else live[0]) if len(live) > 1 else None
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

    def running_now(self, pid: str | None) -> None:
        """The prompt of the running graph whose node runs now (None: unchanged): /interrupt without an id stops it."""
        if pid is not None:
            with self._lock:
                self._now = pid

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
                self._cancel, self._targets, self._now = None, {}, None
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
                    log.exception("prompt(s) %s: unexpected failure", ", ".join(i.prompt_id for i in items))
                finally:
                    self._settle(items)
                    self._untrack()
                    with self._lock:
                        self._stopping.difference_update(i.prompt_id for i in items)
            flags = self.queue.take_flags()
            if flags.get("unload_models") or flags.get("free_memory"):
                self.engine.free(bool(flags.get("unload_models")), bool(flags.get("free_memory")))

    def execute(self, item: Item) -> None:
        """Run one prompt alone, its events told to its client (events.Translation)."""
        from ..graph.engine.executor import Cancel
        from ..graph.workflow.errors import InterruptedRun

        item = QueueItem.of(item)
        m = Member(0, item, {}, self._wants_previews(item.extra_data))
        self.client_id, self.last_node = m.sid, None
        tell(self.hub, m, "execution_start", msg.start(m.pid), keep=True)
        self.engine.previews = m.previews
        result, run = None, None
        try:
            prep = self.engine.prepare(item.prompt, outputs=item.targets)
            m.rename = {n: n for n in prep.prompt}
            run = Translation(self, prep, [m])
            cancel = Cancel()
            self._track(cancel, {m.pid: prep.outputs})
            result = self.engine.run(prep, extra_pnginfo=item.extra_data.get("extra_pnginfo"), prompt_id=m.pid,
                                     events=run, cancel=cancel)
            if m.stopped:  # its /interrupt: told once the run has ended
                result = None
                tell(self.hub, m, "execution_interrupted", msg.interrupted(m.pid, m.stop_node,
                                                                           m.node_type(m.stop_node), m.ran), keep=True)
        except Exception as e:
            stopped = isinstance(e, InterruptedRun)  # /interrupt without an id
            tell(self.hub, m, "execution_interrupted" if stopped else "execution_error", self._failure(m, e),
                 keep=True)
        report = result.to_json() if result is not None else {"plan": run.plan_json if run else {}, "executed": m.ran}
        entry = msg.entry(item, m.ui, result is not None, m.messages, report)
        self.client_id, self.last_node, self.plan_message = None, None, None
        self.end(m, entry)

    def _failure(self, m: Member, e: Exception) -> dict:
        """The execution_error (or _interrupted) body for `e`, raised by prompt `m`'s run."""
        from ..graph.plan.planner import PlanError
        from ..graph.workflow.errors import InterruptedRun, NodeExecutionError, ValidationFailed

        if isinstance(e, InterruptedRun):
            return msg.interrupted(m.pid, e.node_id, e.class_type, m.ran)
        if isinstance(e, NodeExecutionError):
            e.prompt_id, e.executed = m.pid, list(m.ran)
            return msg.node_error(e)
        if isinstance(e, PlanError | ValidationFailed):
            info = e.to_dict()
            node = info.get("extra_info", {}).get("node_id") or next(iter(getattr(e, "node_errors", {}) or {}), "")
            return msg.error(m.pid, f"{info['message']}: {info['details']}", type(e).__name__, node=node,
                             node_type=m.item.prompt.get(node, {}).get("class_type", ""), executed_nodes=m.ran)
        log.exception("prompt %s failed", m.pid)
        return msg.error(m.pid, str(e), type(e).__name__, node=self.last_node or "", executed_nodes=m.ran)

    def _wants_previews(self, extra: dict) -> bool:
        method = extra.get("preview_method")
        return self.previews if method is None else str(method).lower() != "none"

    def end(self, m: Member, entry: dict) -> None:
        """A prompt is over: its history entry, the queue's status, then the end of its execution."""
        m.done = True
        self._untrack(m.pid)
        self.queue.done(m.pid, entry)
        self.hub.send_threadsafe("status", {"status": self.status()})
        self.hub.send_threadsafe("executing", msg.executing(m.pid, None), m.sid)

    def execute_batch(self, items: list[Item]) -> None:
        """Run several queued prompts as one merged graph, each reported to its client as if it ran alone."""
        from ..graph.engine.executor import Cancel
        from ..graph.workflow.errors import InterruptedRun

        items = [QueueItem.of(i) for i in items]
        try:
            prep, merged = self.engine.prepare_queue([i.prompt for i in items],
                                                     [i.extra_data.get("extra_pnginfo") for i in items],
                                                     [i.targets for i in items])
        except Exception as e:  # PlanError, ValidationFailed, ...: alone, each prompt reports its own error
            log.warning("%d prompts not planned together (%s: %s); running them one by one", len(items),
                        type(e).__name__, e)
            for item in items:
                self.execute(item)
            return
        batch_id = uuid.uuid4().hex
        planned = set(prep.plan.order)
        members = [Member(k, item, dict(rename), self._wants_previews(item.extra_data),
                          {n for n in rename.values() if n in planned})
                   for k, (item, rename) in enumerate(zip(items, merged.members, strict=True))]
        run = Translation(self, prep, members, batch_id)
        cancel = Cancel()
        self._track(cancel, {m.pid: tuple(m.outputs) for m in members})
        for m in members:
            tell(self.hub, m, "execution_start", msg.start(m.pid), keep=True)
        self.engine.previews = any(m.previews for m in members)
        try:
            result = self.engine.run(prep, prompt_id=batch_id, events=run, cancel=cancel)
        except InterruptedRun as e:  # /interrupt without an id: every prompt not complete stops
            for m in members:
                if not m.done:
                    run.interrupted(m, e.node_id)
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
                    run.finish(m)
            for m in members:  # the whole run's report, now that it has ended
                if not m.stopped:
                    self.queue.update_history(m.pid, "vramgraph", run.report(m, result))
        finally:
            self.client_id, self.last_node, self.plan_message = None, None, None

    def _settle(self, items: list[Item]) -> None:
        """Any taken prompt left running by a failure of the worker itself ends with an error."""
        running = self.queue.running
        for item in items:
            item = QueueItem.of(item)
            if item.prompt_id in running:
                m = Member(0, item, {}, False)
                tell(self.hub, m, "execution_error", msg.error(m.pid, "the server's worker failed; see its log",
                                                               "RuntimeError"), keep=True)
                self.end(m, msg.entry(item, {}, False, m.messages, {}))


def done_line(prompt_id: str, entry: dict) -> str:
    """The log line of a finished prompt, as ComfyUI's "Prompt executed in N seconds" with more said: its id, its
    seconds (first to last message), its outputs (node: how many images), or why it failed or stopped."""
    messages = [m for m in entry.get("status", {}).get("messages", []) if isinstance(m, list | tuple) and len(m) == 2]
    stamps = [m[1].get("timestamp") for m in messages if isinstance(m[1], dict) and m[1].get("timestamp")]
    seconds = (max(stamps) - min(stamps)) / 1000 if stamps else 0.0
    kinds = {m[0]: m[1] for m in messages}
    if "execution_error" in kinds:
        e = kinds["execution_error"]
        node = f"node {e.get('node_id')} ({e.get('node_type')}) " if e.get("node_id") else ""
        why = " ".join(str(e.get("exception_message", "")).split())
        return f"prompt {prompt_id} failed after {seconds:.2f} s: {node}{why}"
    if "execution_interrupted" in kinds:
        return f"prompt {prompt_id} interrupted after {seconds:.2f} s"
    outs = ", ".join(f"{n}: {len(ui.get('images', []))} image(s)" if ui.get("images") else n
                     for n, ui in (entry.get("outputs") or {}).items())
    return f"prompt {prompt_id} executed in {seconds:.2f} s; outputs {outs or 'none'}"


__all__ = ["MAX_BATCH", "PromptQueue", "Worker"]
