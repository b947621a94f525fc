"""Beyond one machine: frontends (fleet_frontend.py) publish prompts to RabbitMQ, workers (fleet_worker.py) run them.

    VRAMGRAPH_BROKER_SECRET=… vramgraph serve --broker amqp://fleet:PASSWORD@host:5672/ [--vram 24GiB]   # a frontend
    VRAMGRAPH_BROKER_SECRET=… vramgraph worker --broker amqp://fleet:PASSWORD@host:5672/ --models DIR

A frontend is the single-machine server (app.py) with its engine thread replaced by a `Frontend`: POST /prompt
validates the prompt and plans it for the frontend's card (`--vram`, the reference card: a prompt no worker of
that size could run is refused at once, as on one machine), then publishes it. Clients see ComfyUI's API
unchanged: /history, /view, /queue and the websocket events (progress, previews, plan) arrive as on one machine.
Every message is signed with the fleet's shared secret and checked by whoever receives it (signing.py).

Topology (all names under "vramgraph."):
- `prompts`, a durable direct exchange; one **quorum** queue per model set (`q.<key>`, routing key `<key>`): the
  set is the model files a prompt's plan loads, by kind and file name (`model_set`), so any machine with those
  files in its models folder can run it. Messages are persistent and published with confirms. Each queue has a
  delivery limit: a prompt delivered TRIES times without being acknowledged (each time its worker was killed or
  lost the broker while running it) is dead-lettered to `dead`, never handed out again.
- `dead`, a fanout exchange bound to the durable queue `dead` (dead-lettered prompts, kept for operators, at most
  DEAD_KEPT) and to `dead.notify`, which frontends consume to tell each prompt's own frontend (and so its client).
- `catalog`, a durable queue of the sets ever published (one message each), so a worker that starts later, or
  after every frontend went away, still finds every set queue; `fleet`, a fanout exchange of transient news:
  new sets, each worker's heartbeat (the sets it holds and can run), and /interrupt, /free, /queue deletions.
- `frontend.<id>`, one durable queue per frontend: the events of its prompts (in order) and their results.

Where images go (the choice): **a shared output folder**. Workers write into the frontend's input/output/temp
folders (the same paths, or one network mount; checked by a handshake file, fleet_files.py), so /view serves what
a worker wrote. A worker acknowledges a prompt only after its images are written (each PNG written to a temporary
name and renamed, never half-written) and its result (the /history entry) is confirmed by the broker into the
frontend's queue; a worker killed before that leaves the prompt unacknowledged, and the broker hands it to
another worker, which runs it alone (a prompt that comes back is never batched with others) after telling its
client (`vramgraph.retry`). File names are keyed on the prompt id (a folder `<prompt_id>/` of the output folder
that vramgraph made and marked, emptied before each attempt; ids.py), so a prompt that runs twice writes the same
files once; a result that arrives twice is kept once (the frontend keeps the first).

Broker down: POST /prompt answers 503 in ComfyUI's error shape (nothing is accepted that is not stored by the
broker); the frontend and the workers reconnect with exponential backoff (0.5 s doubling to 10 s). Results
wait in the frontend's durable queue while it is away. The broker's password never appears in a log line or an
answer.

aio-pika (the optional extra `broker`) is imported only here, in fleet_frontend.py and in fleet_worker.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import urllib.parse
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .bodies import BadRequest, parse_json
from .signing import Signer, default_user_warning, redact

log = logging.getLogger("vramgraph.broker")
PROMPTS = "vramgraph.prompts"
FLEET = "vramgraph.fleet"
CATALOG = "vramgraph.catalog"
SET_QUEUE = "vramgraph.q."  # quorum queues (an earlier version's classic "vramgraph.set.*" queues are not used)
DEAD = "vramgraph.dead"  # fanout exchange of dead-lettered prompts, and the durable queue that keeps them
DEAD_NOTIFY = "vramgraph.dead.notify"  # the same, for frontends: each tells the prompt's frontend
DEAD_KEPT = 10000  # dead-lettered prompts kept in vramgraph.dead at most (the oldest go first)
TRIES = 3  # deliveries of one prompt at most (its queue's x-delivery-limit is TRIES - 1), then it is dead-lettered
FRONTEND_QUEUE = "vramgraph.frontend."
BACKOFF = (0.5, 10.0)  # first and longest wait between reconnection attempts, seconds
PUBLISH_TIMEOUT = 10.0  # seconds a publish may wait for the broker's confirm before POST /prompt answers 503
ANNOUNCE_EVERY = 2.0  # seconds between a frontend's announcements of its sets


class BrokerDown(RuntimeError):
    """The broker cannot take a message now (unreachable, or it did not confirm in time)."""


def amqp() -> Any:
    """The aio_pika module, or a ValueError that says how to install it."""
    try:
        import aio_pika
    except ImportError:
        raise ValueError("--broker needs the AMQP client aio-pika: pip install 'vramgraph[broker]' "
                         "(or pip install aio-pika)") from None
    # each failed attempt to reach the broker is logged here once, with the wait before the next one
    logging.getLogger("aiormq.connection").setLevel(logging.CRITICAL)
    return aio_pika


def check_url(url: str) -> str:
    if not url.startswith(("amqp://", "amqps://")):
        raise ValueError(f"--broker {redact(url)!r}: give an AMQP URL, e.g. amqp://user:password@127.0.0.1:5672/")
    warning = default_user_warning(url)
    if warning:
        log.warning("%s", warning)
    return url


def password(url: str) -> str:
    """The password in an AMQP URL ("" when none), to be kept out of every text shown."""
    try:
        return urllib.parse.urlsplit(url).password or ""
    except ValueError:
        return ""


def portable(key: str) -> str:
    """An engine model key ("transformer:/models/x.safetensors:bf16") as every machine names it: kind and file."""
    kind, _, rest = key.partition(":")
    path = rest.rsplit(":", 1)[0] if rest.count(":") >= 1 else rest
    return f"{kind}:{Path(path).name}"


def model_set(prep: Any) -> tuple[str, ...]:
    """The models a prepared prompt's loaders give, as portable names (sorted): the prompt's model set."""
    from ..nodes.types import ModelInfo

    return tuple(sorted({portable(o.key) for c in prep.costs.values() for o in c.outputs if isinstance(o, ModelInfo)}))


def set_key(models: Iterable[str]) -> str:
    """The routing key (and queue name suffix) of a model set: a short hash of its sorted names."""
    return hashlib.sha256("\n".join(sorted(models)).encode()).hexdigest()[:16]


def frontend_id(port: int | None = None) -> str:
    return f"{socket.gethostname()}-{port if port is not None else uuid.uuid4().hex[:8]}"


async def connect(url: str) -> Any:
    return await amqp().connect(url, timeout=5)


async def declare_prompts(channel: Any, key: str) -> Any:
    """The prompts exchange and the quorum queue of set `key` (delivery limit, dead-lettered to DEAD), bound."""
    aio_pika = amqp()
    exchange = await channel.declare_exchange(PROMPTS, aio_pika.ExchangeType.DIRECT, durable=True)
    queue = await channel.declare_queue(SET_QUEUE + key, durable=True, arguments={
        "x-queue-type": "quorum", "x-delivery-limit": TRIES - 1, "x-dead-letter-exchange": DEAD})
    await queue.bind(exchange, key)
    return queue


async def declare_dead(channel: Any) -> Any:
    """The dead-letter exchange, its kept queue and the frontends' notice queue (returned)."""
    aio_pika = amqp()
    exchange = await channel.declare_exchange(DEAD, aio_pika.ExchangeType.FANOUT, durable=True)
    kept = await channel.declare_queue(DEAD, durable=True, arguments={"x-max-length": DEAD_KEPT})
    await kept.bind(exchange)
    notify = await channel.declare_queue(DEAD_NOTIFY, durable=True)
    await notify.bind(exchange)
    return notify


async def fleet_exchange(channel: Any) -> Any:
    return await channel.declare_exchange(FLEET, amqp().ExchangeType.FANOUT)


async def read_catalog(channel: Any, signer: Signer) -> dict[str, list[str]]:
    """Every set in the catalog queue (read, then returned to it untouched); unsigned entries are removed."""
    queue = await channel.declare_queue(CATALOG, durable=True)
    found, held = {}, []
    while True:
        m = await queue.get(no_ack=False, fail=False)
        if m is None:
            break
        if not signer.valid(m):
            log.warning("an unsigned or altered message in %s: removed", CATALOG)
            await m.reject(requeue=False)
            continue
        held.append(m)
        with contextlib.suppress(ValueError, KeyError, TypeError):
            d = json_body(m)
            found[str(d["set"])] = [str(x) for x in d["models"]]
    for m in held:
        await m.nack(requeue=True)
    return found


def json_body(message: Any) -> dict:
    """A message's JSON object body, parsed strictly (no NaN or infinities); ValueError otherwise."""
    try:
        d = parse_json(bytes(message.body))
    except BadRequest as e:
        raise ValueError(e.details) from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    return d


async def publish(channel: Any, signer: Signer, routing_key: str, body: bytes, *, exchange: Any = None,
                  headers: dict | None = None, persistent: bool = False, **props: Any) -> None:
    """`body` published signed under `routing_key` (to the default exchange unless `exchange` is given)."""
    aio_pika = amqp()
    mode = aio_pika.DeliveryMode.PERSISTENT if persistent else aio_pika.DeliveryMode.NOT_PERSISTENT
    message = aio_pika.Message(body, headers=signer.headers(routing_key, body, headers), delivery_mode=mode, **props)
    await (exchange or channel.default_exchange).publish(message, routing_key)


__all__ = ["CATALOG", "DEAD", "FLEET", "PROMPTS", "SET_QUEUE", "TRIES", "BrokerDown", "declare_dead",
           "declare_prompts", "json_body", "model_set", "portable", "publish", "read_catalog", "set_key"]
