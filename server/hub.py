"""The websockets by client id and the one ordered queue of outgoing messages; ComfyUI's preview frames."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import struct
from typing import Any

from aiohttp import web

log = logging.getLogger("vramgraph.server")
PREVIEW_IMAGE = 1  # ComfyUI's binary event type; then 4 bytes of image format (1 JPEG, 2 PNG), then the image
IMAGE_FORMATS = {"JPEG": 1, "PNG": 2}


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
