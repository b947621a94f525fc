"""The server's queue, its websockets and its one worker thread (see server.py).

`PromptQueue` is ComfyUI's queue (pending items ordered by number, the running one, the history);
`Hub` holds the websockets and one ordered outgoing message queue on the event loop; `Worker` is the
only thread that calls the engine: it runs one prompt at a time and turns the engine's events into
ComfyUI's websocket messages and history entries.
"""

from __future__ import annotations

import asyncio
import heapq
import io
import itertools
import json
import logging
import struct
import threading
import time
from collections import OrderedDict
from typing import Any

from aiohttp import web

log = logging.getLogger("vramgraph.server")
MAX_HISTORY = 1000
PREVIEW_IMAGE = 1  # ComfyUI's binary event type; then 4 bytes of image format (1 JPEG, 2 PNG), then the image
IMAGE_FORMATS = {"JPEG": 1, "PNG": 2}
Item = tuple  # (number, prompt_id, prompt, extra_data, outputs_to_execute): a queue entry as ComfyUI lists it


def _now_ms() -> int:
    return int(time.time() * 1000)


class PromptQueue:
    """ComfyUI's prompt queue: pending items ordered by number, the running one, the history. Thread-safe."""

    def __init__(self, max_history: int = MAX_HISTORY) -> None:
        self._cond = threading.Condition()
        self._pending: list[tuple[float, int, Item]] = []
        self._seq = itertools.count()
        self.running: dict[str, Item] = {}
        self.history: OrderedDict[str, dict] = OrderedDict()
        self.flags: dict[str, bool] = {}
        self.max_history = max_history

    def put(self, item: Item) -> None:
        with self._cond:
            heapq.heappush(self._pending, (item[0], next(self._seq), item))
            self._cond.notify_all()

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

    def done(self, prompt_id: str, entry: dict) -> None:
        """Store the history entry, then mark the prompt finished (clients read history once the queue is empty)."""
        with self._cond:
            self.history[prompt_id] = entry
            while len(self.history) > self.max_history:
                self.history.popitem(last=False)
            self.running.pop(prompt_id, None)

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
            else:
                self.history.pop(prompt_id, None)


def encode_preview(image: Any, fmt: str = "PNG", max_size: int | None = None) -> bytes:
    """A PIL image as ComfyUI's binary preview frame: event type 1, image format (1 JPEG, 2 PNG), the image."""
    from PIL import ImageOps

    if max_size is not None:
        image = ImageOps.contain(image, (max_size, max_size))
    buf = io.BytesIO()
    buf.write(struct.pack(">II", PREVIEW_IMAGE, IMAGE_FORMATS[fmt]))
    image.convert("RGB").save(buf, format=fmt, quality=95, compress_level=1)
    return buf.getvalue()


class Hub:
    """The websockets by client id, and the one ordered queue of outgoing messages."""

    def __init__(self) -> None:
        self.sockets: dict[str, web.WebSocketResponse] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.messages: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.messages = asyncio.Queue()
        self._task = self.loop.create_task(self._publish())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for ws in list(self.sockets.values()):
            await ws.close()

    def send(self, kind: str | int, data: Any, sid: str | None = None) -> None:
        """Queue a message from the event loop's thread (sid None: every client)."""
        if self.messages is not None:
            self.messages.put_nowait((kind, data, sid))

    def send_threadsafe(self, kind: str | int, data: Any, sid: str | None = None) -> None:
        """Queue a message from any thread (the worker's)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.send, kind, data, sid)

    async def _publish(self) -> None:
        assert self.messages is not None
        while True:
            kind, data, sid = await self.messages.get()
            targets = list(self.sockets.values()) if sid is None else \
                [self.sockets[sid]] if sid in self.sockets else []
            for ws in targets:
                try:
                    if isinstance(data, bytes | bytearray):
                        await ws.send_bytes(bytes(data))
                    else:
                        await ws.send_str(json.dumps({"type": kind, "data": data}, default=str))
                except (ConnectionError, RuntimeError) as e:
                    log.warning("websocket send failed: %s", e)


class Worker:
    """The one thread that owns the engine: takes prompts off the queue, runs them, reports events."""

    def __init__(self, engine: Any, queue: PromptQueue, hub: Hub, previews: bool = False) -> None:
        self.engine, self.queue, self.hub, self.previews = engine, queue, hub, previews
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.client_id: str | None = None  # the running prompt's client
        self.last_node: str | None = None
        self.plan_message: dict | None = None  # the running prompt's vramgraph.plan data, for reconnecting pages
        self.ui_cache: dict[str, dict] = {}  # node signature -> its ui, re-sent when the engine reports it cached

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

    def _loop(self) -> None:
        while not self._stop.is_set():
            item = self.queue.get(timeout=1.0)
            if item is not None:
                try:
                    self.execute(item)
                except Exception:  # the worker must survive anything a prompt does
                    log.exception("prompt %s: unexpected failure", item[1])
            flags = self.queue.take_flags()
            if flags.get("unload_models") or flags.get("free_memory"):
                self.engine.free(bool(flags.get("unload_models")), bool(flags.get("free_memory")))

    def execute(self, item: Item) -> None:
        from .graph.errors import InterruptedRun, NodeExecutionError, ValidationFailed
        from .graph.planner import PlanError
        from .graph.timeline import timeline_data

        number, pid, prompt, extra, outputs = item[:5]
        sid = extra.get("client_id")
        self.client_id, self.last_node = sid, None
        messages: list[list] = []
        ui: dict[str, dict] = {}
        ran: list[str] = []
        plan: dict = {}

        def emit(kind: str, data: dict, keep: bool = False) -> None:
            if keep:
                messages.append([kind, data])
            self.hub.send_threadsafe(kind, data, sid)

        def events(kind: str, data: dict) -> None:
            data = {**data, "prompt_id": data.get("prompt_id") or pid}
            if kind in ("execution_cached", "execution_success"):
                ran.extend(data.get("nodes", []) if kind == "execution_cached" else [])
                emit(kind, {**data, "timestamp": _now_ms()}, keep=True)
                for node in data.get("nodes", []) if kind == "execution_cached" else []:
                    cached = self.ui_cache.get(prep.signatures.get(node, ""))
                    if cached is not None:  # as ComfyUI: a cached output node shows its last output again
                        ui[node] = cached
                        emit("executed", {"node": node, "display_node": node, "output": cached, "prompt_id": pid})
            elif kind == "plan":
                self.plan_message = {"prompt_id": pid, "plan": data["plan"], "timeline": timeline_data(prep.plan)}
                plan.update(data["plan"])
                emit("vramgraph.plan", self.plan_message)
            elif kind == "executing":
                if data.get("node") is not None:  # the end is announced once the history is written
                    self.last_node = data["node"]
                    emit(kind, {**data, "display_node": data.get("display_node") or data["node"]})
            elif kind == "progress":
                emit(kind, data)
            elif kind == "executed":
                ran.append(data["node"])
                if data.get("output") is not None:
                    ui[data["node"]] = data["output"]
                    if len(self.ui_cache) > MAX_HISTORY:
                        self.ui_cache.clear()
                    self.ui_cache[prep.signatures[data["node"]]] = data["output"]
                    emit(kind, {"node": data["node"], "display_node": data["node"], "output": data["output"],
                                "prompt_id": pid})
            elif kind == "vg_step":
                emit("vramgraph.step", data)
            elif kind == "preview":
                self.hub.send_threadsafe(PREVIEW_IMAGE, encode_preview(data["image"]), sid)

        emit("execution_start", {"prompt_id": pid, "timestamp": _now_ms()}, keep=True)
        method = extra.get("preview_method")
        self.engine.previews = self.previews if method is None else str(method).lower() != "none"
        result = None
        try:
            prep = self.engine.prepare(prompt)
            result = self.engine.run(prep, extra_pnginfo=extra.get("extra_pnginfo"), prompt_id=pid, events=events)
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
        entry = {"prompt": [number, pid, prompt, extra, outputs], "outputs": ui,
                 "status": {"status_str": "success" if ok else "error", "completed": ok, "messages": messages},
                 "meta": {n: {"node_id": n, "display_node": n, "parent_node": None, "real_node_id": n} for n in ui},
                 "vramgraph": result.to_json() if ok else {"plan": plan, "executed": ran}}
        self.queue.done(pid, entry)
        self.client_id, self.last_node, self.plan_message = None, None, None
        self.hub.send_threadsafe("status", {"status": self.status()})
        self.hub.send_threadsafe("executing", {"node": None, "prompt_id": pid}, sid)


__all__ = ["IMAGE_FORMATS", "PREVIEW_IMAGE", "Hub", "PromptQueue", "Worker", "encode_preview"]
