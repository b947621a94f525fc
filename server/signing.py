"""Broker messages are signed, and the broker's password is never shown.

Every message a frontend or a worker publishes carries `vg-sig`, an HMAC-SHA256 (hex) of the message's routing key,
its headers (but those the broker adds, `x-…`) and its body, under a secret all machines of the fleet share. A
message without it, or whose body, headers or routing key were changed, is dropped and logged by whoever receives
it (prompts, results, events, heartbeats, interrupts, catalog entries). Anyone who can publish to the broker (its
default `guest` user is an administrator) can therefore no longer make a worker run, delete or write anything, nor a
frontend record a result.

The secret comes from the environment variable VRAMGRAPH_BROKER_SECRET, or from a file named by
`--broker-secret-file PATH` (its first line; never on the command line itself, where /system_stats and `ps` show
it); at least MIN_SECRET characters. A frontend or worker without one refuses to start, saying so.

Secrets in text: `redact` replaces the password of any URL (`amqp://user:***@host`) and the secret itself;
`redact_argv` does it for a command line (as /system_stats shows it).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("vramgraph.broker")
SECRET_ENV = "VRAMGRAPH_BROKER_SECRET"
SIG = "vg-sig"
MIN_SECRET = 16
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:)(?P<pw>[^@\s]*)(?P<at>@)")


@dataclass(frozen=True, repr=False)
class Signer:
    """Signs and checks broker messages with the fleet's shared secret (module doc)."""

    key: bytes

    def __repr__(self) -> str:
        return "Signer(key=***)"

    def mac(self, routing_key: str, headers: Mapping[str, Any], body: bytes) -> str:
        fields = {k: v for k, v in headers.items() if k != SIG and not k.startswith("x-")}  # x-: the broker's
        head = json.dumps([routing_key, fields], sort_keys=True, separators=(",", ":"), default=str).encode()
        return hmac.new(self.key, b"vramgraph/1\0" + head + b"\0" + bytes(body), hashlib.sha256).hexdigest()

    def headers(self, routing_key: str, body: bytes, headers: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """`headers` with the signature added, for a message of `body` published under `routing_key`."""
        h = dict(headers or {})
        h[SIG] = self.mac(routing_key, h, body)
        return h

    def valid(self, message: Any) -> bool:
        """Whether an incoming aio-pika message carries a correct signature for its routing key, headers and body."""
        headers = dict(message.headers or {})
        sig = headers.get(SIG)
        if isinstance(sig, bytes):
            sig = sig.decode("ascii", "replace")
        if not isinstance(sig, str):
            return False
        headers = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in headers.items()}
        return hmac.compare_digest(sig, self.mac(str(message.routing_key or ""), headers, bytes(message.body)))


def read_secret(secret_file: str | None = None) -> str:
    """The shared secret (module doc); ValueError saying how to give one."""
    if secret_file:
        try:
            secret = Path(secret_file).expanduser().read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"--broker-secret-file {secret_file}: cannot read a secret from it "
                             f"({type(e).__name__}); write one line of at least {MIN_SECRET} characters") from None
    else:
        secret = os.environ.get(SECRET_ENV, "").strip()
    if len(secret) < MIN_SECRET:
        raise ValueError(f"--broker needs a shared secret of at least {MIN_SECRET} characters to sign its messages: "
                         f"set {SECRET_ENV} (the same on every frontend and worker) or give --broker-secret-file PATH")
    return secret


def signer(secret_file: str | None = None) -> Signer:
    return Signer(read_secret(secret_file).encode())


def redact(text: str, *secrets: str) -> str:
    """`text` with every URL's password and each of `secrets` replaced by ***."""
    text = _URL_PASSWORD.sub(lambda m: m["head"] + "***" + m["at"], str(text))
    for s in secrets:
        if s:
            text = text.replace(s, "***")
            quoted = urllib.parse.quote(s, safe="")
            if quoted != s:
                text = text.replace(quoted, "***")
    return text


def redact_argv(argv: list[str]) -> list[str]:
    """A command line as it may be shown: URL passwords hidden, and the value after a --*secret*/--*password* flag."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        sensitive = flag.startswith("--") and any(w in flag.lower() for w in ("secret", "password", "token"))
        if sensitive and not flag.endswith("-file"):
            out.append(f"{flag}=***" if eq else arg)
            hide_next = not eq
            continue
        out.append(redact(arg))
    return out


def default_user_warning(url: str) -> str | None:
    """A warning when `url` logs in as RabbitMQ's default `guest` user on a broker that is not on loopback."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "localhost"
        user = urllib.parse.unquote(parts.username) if parts.username is not None else "guest"
    except ValueError:
        return None
    if user != "guest":
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"the broker at {host} is used as its default user 'guest', an administrator whose password everyone "
            "knows: create a user of its own for the fleet (rabbitmqctl add_user; set_permissions on its vhost) and "
            "put it in --broker")


__all__ = ["MIN_SECRET", "SECRET_ENV", "SIG", "Signer", "default_user_warning", "read_secret", "redact",
           "redact_argv", "signer"]
