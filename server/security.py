"""What keeps the local server safe beside a browser: origin checks, safe file serving, image-only uploads.

By default (ComfyUI's origin-only middleware, made stricter in two places), a request is refused 403 when
- its `Origin` names another host (or port) than its `Host` header: a page of another site driving the API.
  ComfyUI does this only for a loopback Host; we do it for every Host, and refuse `Origin: null` (a
  sandboxed frame or a file:// page) too, which ComfyUI lets through;
- it arrived on a loopback address but its `Host` is not localhost, a loopback address or this machine's
  name: DNS rebinding, a foreign name that resolves to 127.0.0.1 (ComfyUI resolves the name and so lets it in);
- it is state-changing (any method but GET, HEAD, OPTIONS) or a websocket upgrade and the browser marks it
  `Sec-Fetch-Site: cross-site`.
`--enable-cors-header [ORIGIN]` replaces all this, as in ComfyUI, by answering every request with
`Access-Control-Allow-Origin: ORIGIN` (default `*`) and answering OPTIONS preflights.

/view serves only known image types inline; anything else (HTML, XHTML, JavaScript, CSS, SVG, text, ...)
is an attachment, the active types as application/octet-stream, always with `X-Content-Type-Options:
nosniff`, so a file written into input/ or output/ never runs as a page of the API's origin.
Uploads are accepted when their content opens as an image of an allowed format (PIL), whatever the name says, and
of at most the configured number of pixels (measured before decoding: an image bomb is refused, not survived).
They never write through or over a link already in input/ (another name is used) and never replace a file in
output/ (`overwrite` is honoured in input/ and temp/ only).
"""

from __future__ import annotations

import ipaddress
import logging
import mimetypes
import os
import re
import socket
import struct
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from ..nodes.images import MAX_IMAGE_PIXELS, ImageTooLarge, open_image
from .bodies import json_error

log = logging.getLogger("vramgraph.server")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
INLINE_TYPES = frozenset({"image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp", "image/x-ms-bmp",
                          "image/tiff", "image/avif"})  # raster images: a browser never runs them
ACTIVE_TYPES = frozenset({"text/html", "application/xhtml+xml", "text/javascript", "application/javascript",
                          "text/css", "image/svg+xml", "application/xml", "text/xml", "application/ecmascript",
                          "text/ecmascript", "application/wasm", "text/html-sandboxed"})
UPLOAD_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "MPO"})  # PIL format names
MAX_NAME_TRIES = 10000  # "name (i).png" tried at most, for an upload whose name is taken


# ------------------------------------------------------------------------------------------ origins


def _host_port(netloc: str) -> tuple[str | None, int | None]:
    """(hostname, port) of a Host header or an Origin's netloc, lower-cased; (None, None) when unreadable."""
    try:
        parts = urllib.parse.urlsplit("//" + netloc)
        return parts.hostname, parts.port
    except ValueError:  # a port that is not a number, a bad IPv6 literal
        return None, None


def _origin_host_port(origin: str) -> tuple[str | None, int | None]:
    """(hostname, port) of an Origin header; (None, None) for "null" or anything unreadable."""
    origin = origin.strip().lower()
    try:
        netloc = urllib.parse.urlsplit(origin).netloc if origin != "null" else ""
    except ValueError:
        return None, None
    return _host_port(netloc) if netloc else (None, None)


def loopback_name(host: str | None) -> bool:
    """A name a loopback connection may give as its Host: a loopback or unspecified address (0.0.0.0), the
    name localhost, or this machine's own name. Never resolved: a name resolving to 127.0.0.1 is how DNS
    rebinding works."""
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost") or host == socket.gethostname().lower():
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def _arrived_on_loopback(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not sock or not isinstance(sock, tuple):
        return False
    try:
        return ipaddress.ip_address(sock[0]).is_loopback
    except ValueError:
        return False


def _refuse(why: str, details: str) -> web.Response:
    log.warning("refused a request: %s", why)
    return json_error(403, why, "forbidden", details=details)


def origin_problem(request: web.Request) -> tuple[str, str] | None:
    """(message, details) of why this request is refused by the default policy (module doc), or None."""
    headers = request.headers
    host = headers.get("Host")
    if host is not None and _arrived_on_loopback(request):
        name, _ = _host_port(host.lower())
        if not loopback_name(name):
            return ("the Host header is not this machine",
                    "the server listens on a loopback address and answers only Host localhost or a loopback "
                    "address (a foreign name here is DNS rebinding); open it as http://127.0.0.1:<port>, or start "
                    "it with --enable-cors-header to allow other origins")
    upgrade = headers.get("Upgrade", "").lower() == "websocket"
    if headers.get("Sec-Fetch-Site", "").lower() == "cross-site" and (request.method not in SAFE_METHODS or upgrade):
        return ("cross-site request refused",
                "a page of another site may not change this server's state or open its websocket; start the "
                "server with --enable-cors-header to allow it")
    origin = headers.get("Origin")
    if origin is None or host is None:
        return None
    o_host, o_port = _origin_host_port(origin)
    h_host, h_port = _host_port(host.lower())
    if o_host is None or h_host is None:
        return ("the request's Origin is not this server",
                f"Origin {origin[:100]!r} is not a site this server can compare with its Host; start the server "
                "with --enable-cors-header to allow other origins")
    # as ComfyUI: a port given on one side only is not compared (browsers differ in writing default ports)
    same = o_host.strip("[]") == h_host.strip("[]") and (o_port is None or h_port is None or o_port == h_port)
    if not same:
        return ("the request's Origin is not this server",
                f"Origin host {o_host}{':' + str(o_port) if o_port else ''} differs from Host "
                f"{h_host}{':' + str(h_port) if h_port else ''}: a page of another site may not use this API; "
                "start the server with --enable-cors-header [ORIGIN] to allow it")
    return None


@web.middleware
async def origin_only(request: web.Request, handler: Any) -> web.StreamResponse:
    """The default policy of the module doc."""
    problem = origin_problem(request)
    if problem is not None:
        return _refuse(*problem)
    if request.method == "OPTIONS":
        return web.Response()
    return await handler(request)


def cors(allowed_origin: str) -> Any:
    """ComfyUI's --enable-cors-header middleware: every answer allows `allowed_origin`; preflights succeed."""

    @web.middleware
    async def cors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        response = web.Response() if request.method == "OPTIONS" else await handler(request)
        response.headers["Access-Control-Allow-Origin"] = allowed_origin
        response.headers["Access-Control-Allow-Methods"] = "POST, GET, DELETE, PUT, OPTIONS, PATCH"
        response.headers["Access-Control-Allow-Headers"] = "Content-Type, Authorization"
        response.headers["Access-Control-Allow-Credentials"] = "true"
        return response

    return cors_middleware


def middlewares(cors_origin: str | None) -> list[Any]:
    """The origin policy for make_app: ComfyUI's CORS opt-out when `cors_origin` is given, else origin_only."""
    return [cors(cors_origin)] if cors_origin else [origin_only]


# ------------------------------------------------------------------------------------------ files


def _disposition(kind: str, name: str) -> str:
    """A Content-Disposition naming `name` safely: ASCII fallback quoted, the exact name RFC 5987-encoded."""
    plain = re.sub(r'[^\x20-\x7e]|["\\]', "_", name)
    value = f'{kind}; filename="{plain}"'
    if plain != name:
        value += f"; filename*=UTF-8''{urllib.parse.quote(name, safe='')}"
    return value


def view_headers(name: str) -> tuple[str, dict[str, str]]:
    """(content type, headers) /view answers `name` with: inline for known images only (module doc)."""
    guessed = (mimetypes.guess_type(name)[0] or "application/octet-stream").lower()
    headers = {"X-Content-Type-Options": "nosniff"}
    if guessed in INLINE_TYPES:
        headers["Content-Disposition"] = _disposition("inline", name)
        return guessed, headers
    headers["Content-Disposition"] = _disposition("attachment", name)
    headers["Content-Security-Policy"] = "sandbox"
    active = guessed in ACTIVE_TYPES or guessed.startswith("text/") or "script" in guessed or "xml" in guessed
    return ("application/octet-stream" if active else guessed), headers


def uploaded_image_format(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> str | None:
    """The PIL format of `data` when it is a whole image of an allowed format (UPLOAD_FORMATS), else None. An image
    of more than `max_pixels` pixels raises ImageTooLarge, before any pixel is decoded (nodes/images.py)."""
    try:
        with open_image(data, max_pixels, "the uploaded image") as im:
            fmt = im.format
            im.verify()
    except ImageTooLarge:
        raise
    except (OSError, ValueError, SyntaxError, EOFError, TypeError, IndexError, KeyError, ZeroDivisionError,
            MemoryError, struct.error):  # what PIL raises on hostile files (a bomb's DecompressionBombError too)
        return None
    return fmt if fmt in UPLOAD_FORMATS else None


def _holds(path: Path, data: bytes) -> bool:
    """Whether the regular file at `path` (never through a link) holds exactly `data`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return os.fstat(f.fileno()).st_size == len(data) and f.read() == data


def save_upload(folder: Path, name: str, data: bytes, overwrite: bool, reuse: bool = True) -> Path:
    """Write `data` as `folder/name` and return where it went. A link there is never followed nor replaced, nor
    anything but a regular file: the next free name `stem (i).ext` is used instead, as for a taken name without
    `overwrite`; with `reuse`, a file that already holds `data` is kept as it is. Written to a temporary name and
    renamed."""
    stem, suffix = os.path.splitext(name)
    for i in range(MAX_NAME_TRIES):
        path = folder / (name if i == 0 else f"{stem} ({i}){suffix}")
        if path.is_symlink() or (path.exists() and not path.is_file()):
            continue
        if not path.exists() or overwrite or (reuse and _holds(path, data)):
            break
    else:
        raise OSError(f"no free name for {name!r} after {MAX_NAME_TRIES} tries")
    if reuse and path.is_file() and not path.is_symlink() and _holds(path, data):
        return path
    part = folder / f".{uuid.uuid4().hex}.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if path.is_symlink():  # appeared meanwhile: left alone
            raise OSError(f"{name!r} became a link while it was written")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path


__all__ = ["ACTIVE_TYPES", "INLINE_TYPES", "UPLOAD_FORMATS", "cors", "loopback_name", "middlewares",
           "origin_only", "origin_problem", "save_upload", "uploaded_image_format", "view_headers"]
