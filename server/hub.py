"""The websockets by client id, each with its own bounded queue of outgoing messages; ComfyUI's preview frames.

Clients are isolated from each other: every client has one sender task that takes its messages in order
from a queue of at most SEND_QUEUE messages (SEND_QUEUE_BYTES bytes), and each send may take at most
SEND_TIMEOUT seconds. A client whose queue overflows, whose send times out (it stopped reading) or fails
is dropped (its connection aborted); no other client waits for it. Incoming frames are capped at
MAX_INCOMING bytes (aiohttp's default); a larger one closes that connection (1009, message too big).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import struct
from dataclasses import dataclass, field
from pathlib import PureWindowsPath
from typing import Any

from aiohttp import web

log = logging.getLogger("vramgraph.server")
PREVIEW_IMAGE = 1  # ComfyUI's binary event type; then 4 bytes of image format (1 JPEG, 2 PNG), then the image
IMAGE_FORMATS = {"JPEG": 1, "PNG": 2}
SEND_QUEUE = 4096  # messages waiting for one client at most
SEND_QUEUE_BYTES = 64 * 2**20  # and their bytes
SEND_TIMEOUT = 10.0  # seconds one message may take to leave; a client that stops reading is then dropped
MAX_INCOMING = 4 * 2**20  # bytes of one incoming websocket message (aiohttp's default)
OURS = "vramgraph."  # the prefix of our own events, ComfyUI's custom-node convention ("<pack>.<event>")
MAX_SUBSCRIBERS = 10000  # client ids remembered as subscribed to our events (the oldest are forgotten)
SVG_MODEL = re.compile(r'data-model="([^"]*)"')
MODEL_KEY = re.compile(r"^([a-z_]+):(.*[/\\].*):([a-z0-9_]+)$")  # nodes/catalog.py: "<kind>:<file path>:<dtype>"


def without_paths(data: Any) -> Any:
    """`data` with every model key ("<kind>:<path of its file>:<dtype>", as dict key or string) written with the
    file's name alone: the server's folders are not the business of its clients."""
    if isinstance(data, dict):
        return {without_paths(k): without_paths(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [without_paths(v) for v in data]
    if isinstance(data, str) and (m := MODEL_KEY.match(data)):
        return f"{m[1]}:{PureWindowsPath(m[2]).name}:{m[3]}"  # either separator, as Windows reads paths
    if isinstance(data, str) and 'data-model="' in data:  # the plan's SVG names each band's model
        return SVG_MODEL.sub(lambda m: f'data-model="{without_paths(m[1])}"', data)
    return data


def encode_preview(image: Any, fmt: str = "PNG", max_size: int | None = None) -> bytes:
    """A PIL image as ComfyUI's binary preview frame: event type 1, image format (1 JPEG, 2 PNG), the image."""
    from PIL import ImageOps

    if max_size is not None:
        image = ImageOps.contain(image, (max_size, max_size))
    buf = io.BytesIO()
    buf.write(struct.pack(">II", PREVIEW_IMAGE, IMAGE_FORMATS[fmt]))
    image.convert("RGB").save(buf, format=fmt, quality=95, compress_level=1)
    return buf.getvalue()


def dumps(obj: Any) -> str:
    """JSON a browser can parse: NaN and infinities (never sent by clients, see bodies.py) written as null."""
    try:
        return json.dumps(obj, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), default=str, allow_nan=False)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if x == x and x not in (float("inf"), float("-inf")) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _remember(ids: dict[str, None], sid: str) -> None:
    ids.pop(sid, None)
    ids[sid] = None
    while len(ids) > MAX_SUBSCRIBERS:
        del ids[next(iter(ids))]


@dataclass(eq=False)
class _Client:
    """One websocket and what waits to be sent to it."""

    sid: str
    ws: web.WebSocketResponse
    transport: Any  # the connection, aborted when the client is dropped
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    queued_bytes: int = 0
    task: asyncio.Task | None = None


class Hub:
    """The websockets by client id, each with its own sender (see the module doc).

    Our own events (OURS) go to a client unless it announced itself as ComfyUI's front end (its first message is
    the `feature_flags` one) and has not subscribed (POST /vramgraph/events, which our panel does): a page that
    knows nothing of them is not sent them. They never carry the server's file paths (`without_paths`).
    """

    def __init__(self, queue_size: int = SEND_QUEUE, queue_bytes: int = SEND_QUEUE_BYTES,
                 timeout: float = SEND_TIMEOUT) -> None:
        self.clients: dict[str, _Client] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue_size, self.queue_bytes, self.timeout = queue_size, queue_bytes, timeout
        self.front_ends: dict[str, None] = {}  # client ids that announced ComfyUI's front end, oldest first
        self.subscribed: dict[str, None] = {}  # client ids subscribed to our events, oldest first

    def announce(self, sid: str) -> None:
        """Client `sid` is ComfyUI's front end: our events only once it subscribes (remembered across its
        reconnections, MAX_SUBSCRIBERS ids at most)."""
        _remember(self.front_ends, sid)

    def subscribe(self, sid: str) -> None:
        """Client `sid` wants our events (remembered as announce does)."""
        _remember(self.subscribed, sid)

    def wants(self, sid: str, kind: str | int) -> bool:
        return not (isinstance(kind, str) and kind.startswith(OURS)) or sid not in self.front_ends \
            or sid in self.subscribed

    @property
    def sockets(self) -> dict[str, web.WebSocketResponse]:
        """The connected websockets by client id (a copy)."""
        return {sid: c.ws for sid, c in self.clients.items()}

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        clients, self.clients = list(self.clients.values()), {}
        for c in clients:
            if c.task is not None:
                c.task.cancel()
        for c in clients:
            try:
                await asyncio.wait_for(c.ws.close(), 1.0)
            except (asyncio.TimeoutError, ConnectionError, RuntimeError):
                self._abort(c)

    def attach(self, sid: str, ws: web.WebSocketResponse, transport: Any = None) -> None:
        """Send `sid`'s messages to `ws` from now on (a client reconnecting with its id replaces its old socket)."""
        old = self.clients.pop(sid, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        client = _Client(sid, ws, transport)
        client.task = asyncio.get_running_loop().create_task(self._sender(client), name=f"ws-send-{sid[:16]}")
        self.clients[sid] = client

    def detach(self, sid: str, ws: web.WebSocketResponse) -> None:
        """`ws` has closed: stop sending to it (unless `sid` has connected again since)."""
        client = self.clients.get(sid)
        if client is not None and client.ws is ws:
            del self.clients[sid]
            if client.task is not None:
                client.task.cancel()

    def send(self, kind: str | int, data: Any, sid: str | None = None) -> None:
        """Queue a message from the event loop's thread (sid None: every client); never waits."""
        targets = list(self.clients.values()) if sid is None else [self.clients[sid]] if sid in self.clients else []
        targets = [c for c in targets if self.wants(c.sid, kind)]
        if not targets:
            return
        if isinstance(kind, str) and kind.startswith(OURS):
            data = without_paths(data)
        frame: bytes | str = bytes(data) if isinstance(data, bytes | bytearray) else dumps({"type": kind, "data": data})
        size = len(frame)
        for c in targets:
            if c.queue.qsize() >= self.queue_size or c.queued_bytes + size > self.queue_bytes:
                self._drop(c, f"{c.queue.qsize()} messages ({c.queued_bytes} bytes) waiting")
                continue
            c.queued_bytes += size
            c.queue.put_nowait(frame)

    def send_threadsafe(self, kind: str | int, data: Any, sid: str | None = None) -> None:
        """Queue a message from any thread (the worker's)."""
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.send, kind, data, sid)
            except RuntimeError:  # the loop closed meanwhile (shutdown)
                pass

    async def _sender(self, c: _Client) -> None:
        while True:
            frame = await c.queue.get()
            c.queued_bytes -= len(frame)
            try:
                if isinstance(frame, bytes):
                    await asyncio.wait_for(c.ws.send_bytes(frame), self.timeout)
                else:
                    await asyncio.wait_for(c.ws.send_str(frame), self.timeout)
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                self._drop(c, f"a message took over {self.timeout:g} s to leave (the client stopped reading)")
                return
            except (ConnectionError, RuntimeError) as e:
                self._drop(c, f"sending failed ({type(e).__name__}: {e})")
                return

    def _drop(self, c: _Client, why: str) -> None:
        """Stop serving client `c` at once: it is forgotten and its connection aborted."""
        log.warning("websocket client %s dropped: %s", c.sid[:64], why)
        if self.clients.get(c.sid) is c:
            del self.clients[c.sid]
        if c.task is not None and c.task is not asyncio.current_task():
            c.task.cancel()
        self._abort(c)

    @staticmethod
    def _abort(c: _Client) -> None:
        if c.transport is not None:
            c.transport.abort()
