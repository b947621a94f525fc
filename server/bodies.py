"""What the server reads from requests, checked before any handler uses it, and its 4xx answers.

Every refusal has ComfyUI's error shape, `{"error": {type, message, details, extra_info}, "node_errors": {}}`.
JSON bodies are parsed strictly: no NaN or Infinity constants and no number that overflows to one (1e999; they
would make /queue, /history and /api/jobs invalid JSON for every browser), at most MAX_DEPTH levels of nesting,
at most MAX_JSON_BYTES.
Identifiers a client chooses (client_id, clientId) are short printable strings; a prompt_id is a UUID or a short
name of safe characters (ids.py), as it names a folder in a fleet's output.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .ids import BadId, check_prompt_id

MAX_JSON_BYTES = 64 * 2**20  # a prompt with embedded UI workflow is a few MiB at most
MAX_DEPTH = 128  # nesting levels of a JSON body (a UI workflow with subgraphs needs ~20)
MAX_ID = 256  # characters of a client or prompt id


class BadRequest(Exception):
    """A request refused before it reaches a handler's work: HTTP `status` with ComfyUI's error shape."""

    def __init__(self, message: str, details: str = "", type_: str = "invalid_request", status: int = 400) -> None:
        super().__init__(message)
        self.message, self.details, self.type, self.status = message, details or message, type_, status

    def response(self) -> web.Response:
        return json_error(self.status, self.message, self.type, details=self.details)


def json_error(status: int, message: str, type_: str = "invalid_request", details: str | None = None,
               **extra: Any) -> web.Response:
    """ComfyUI's error body with HTTP `status`."""
    error = {"type": type_, "message": message, "details": message if details is None else details,
             "extra_info": extra}
    return web.json_response({"error": error, "node_errors": {}}, status=status)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent, refused when it overflows to an infinity (1e999)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is too large for a number (it would be an infinity)")
    return value


def _depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json(raw: bytes | str) -> Any:
    """A JSON document parsed strictly (see the module doc); BadRequest when it is not one."""
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise BadRequest("the body is nested too deeply", f"JSON bodies may nest at most {MAX_DEPTH} levels",
                         "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise BadRequest("the body is not valid JSON", f"{type(e).__name__}: {e}", "invalid_json") from None
    if _depth(value) > MAX_DEPTH:
        raise BadRequest("the body is nested too deeply", f"JSON bodies may nest at most {MAX_DEPTH} levels",
                         "invalid_json")
    return value


async def read_json(request: web.Request, default: Any = None) -> Any:
    """The request's JSON body (see parse_json); `default` when it has none."""
    if request.content_length is not None and request.content_length > MAX_JSON_BYTES:
        raise BadRequest("the body is too large", f"JSON bodies are at most {MAX_JSON_BYTES // 2**20} MiB",
                         "invalid_json", status=413)
    raw = await request.read()
    if not raw.strip():
        return default
    if len(raw) > MAX_JSON_BYTES:
        raise BadRequest("the body is too large", f"JSON bodies are at most {MAX_JSON_BYTES // 2**20} MiB",
                         "invalid_json", status=413)
    return parse_json(raw)


async def read_object(request: web.Request) -> dict:
    """The request's JSON body, which must be an object (no body: an empty one)."""
    body = await read_json(request, {})
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", f"got a JSON {_kind(body)}")
    return body


def _kind(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def sane_id(value: Any, what: str) -> str:
    """`value` as a client or prompt id: a string of 1..MAX_ID printable characters."""
    if not isinstance(value, str):
        raise BadRequest(f"{what} must be a string", f"{what}: got a JSON {_kind(value)}; send a string id")
    if not 0 < len(value) <= MAX_ID or not value.isprintable():
        raise BadRequest(f"{what} is not a valid id",
                         f"{what} must be 1 to {MAX_ID} printable characters (no control characters)")
    return value


def finite_number(value: Any, what: str) -> float:
    """A JSON number (or its decimal spelling, as ComfyUI's float() takes it) that is finite."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise BadRequest(f"{what} must be a number", f"{what}: got a JSON {_kind(value)}")
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise BadRequest(f"{what} must be a number", f"{what}: cannot read a number from the string") from None
    if not math.isfinite(number):
        raise BadRequest(f"{what} must be a finite number", f"{what}: NaN and infinities are refused")
    return number


def id_list(value: Any, what: str) -> list[str]:
    """A list of prompt ids (as /queue and /history take them for "delete")."""
    if not isinstance(value, list):
        raise BadRequest(f"{what} must be a list of prompt ids", f"{what}: got a JSON {_kind(value)}")
    return [sane_id(v, f"{what}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class PromptRequest:
    """The checked fields of a POST /prompt body."""

    prompt: Any
    number: float | None  # None: the next number (front: the next negative one)
    front: bool
    prompt_id: str | None
    extra: dict
    targets: list[str] | None  # partial_execution_targets


def prompt_request(body: Any) -> PromptRequest:
    """The fields of a POST /prompt body, each of the type ComfyUI expects (BadRequest otherwise)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", f"got a JSON {_kind(body)}", "invalid_prompt")
    if "prompt" not in body:
        raise BadRequest("No prompt provided", "No prompt provided", "no_prompt")
    number = finite_number(body["number"], "number") if body.get("number") is not None else None
    extra = body.get("extra_data")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise BadRequest("extra_data must be an object", f"extra_data: got a JSON {_kind(extra)}")
    extra = dict(extra)
    if "client_id" in body:
        extra["client_id"] = body["client_id"]
    if extra.get("client_id") is not None:
        sane_id(extra["client_id"], "client_id")
    if extra.get("extra_pnginfo") is not None and not isinstance(extra["extra_pnginfo"], dict):
        raise BadRequest("extra_data.extra_pnginfo must be an object",
                         f"extra_pnginfo: got a JSON {_kind(extra['extra_pnginfo'])}")
    pid = body.get("prompt_id")
    if pid is not None:  # ComfyUI: a new id when none is given
        try:
            pid = check_prompt_id(pid)
        except BadId as e:
            raise BadRequest("prompt_id is not a valid id", str(e), "invalid_prompt_id") from None
    targets = body.get("partial_execution_targets")
    if targets is not None:
        if not isinstance(targets, list) or not all(isinstance(t, str | int) and not isinstance(t, bool)
                                                    for t in targets):
            raise BadRequest("partial_execution_targets must be a list of node ids",
                             f"partial_execution_targets: got {_kind(targets)}; send e.g. [\"9\"]")
        targets = [str(t) for t in targets]
    return PromptRequest(body["prompt"], number, bool(body.get("front")),
                         pid, extra, targets)


@web.middleware
async def refusals(request: web.Request, handler: Any) -> web.StreamResponse:
    """A BadRequest raised by a handler answers as its 4xx."""
    try:
        return await handler(request)
    except BadRequest as e:
        return e.response()


__all__ = ["MAX_DEPTH", "MAX_ID", "MAX_JSON_BYTES", "BadRequest", "PromptRequest", "finite_number", "id_list",
           "json_error", "parse_json", "prompt_request", "read_json", "read_object", "refusals", "sane_id"]
