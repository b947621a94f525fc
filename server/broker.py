"""Beyond one machine: frontends publish prompts to RabbitMQ, workers (fleet_worker.py) consume them model-aware.

    vramgraph serve --broker amqp://guest:guest@host:5672/ [--vram 24GiB]       # a frontend
    vramgraph worker --broker amqp://guest:guest@host:5672/ --models DIR [--vram 80GiB]

A frontend is the single-machine server (app.py) with its engine thread replaced by a `Frontend`: POST /prompt
validates the prompt and plans it for the frontend's card (`--vram`, the reference card: a prompt no worker of
that size could run is refused at once, as on one machine), then publishes it. Clients see ComfyUI's API
unchanged: /history, /view, /queue and the websocket events (progress, previews, plan) arrive as on one machine.

Topology (all names under "vramgraph."):
- `prompts`, a durable direct exchange; one durable queue per **model set** (`set.<key>`, routing key `<key>`):
  the set is the model files a prompt's plan loads, by kind and file name (`model_set`), so any machine with
  those files in its models folder can run it. Messages are persistent and published with confirms.
- `catalog`, a durable queue of the sets ever published (one message each), so a worker that starts later, or
  after every frontend went away, still finds every set queue; `fleet`, a fanout exchange of transient news:
  new sets, each worker's heartbeat (the sets it holds), and /interrupt, /free, /queue deletions for workers.
- `frontend.<id>`, one durable queue per frontend: the events of its prompts (in order) and their results.

Where images go (the choice): **a shared output folder**. Workers write into the frontend's input/output/temp
folders (the same paths, or one network mount), so /view serves what a worker wrote. A worker acknowledges a
prompt only after its images are written (each PNG written to a temporary name and renamed, never half-written)
and its result (the /history entry) is confirmed by the broker into the frontend's queue; a worker killed
before that leaves the prompt unacknowledged, and the broker hands it to another worker. File names are keyed on
the prompt id (a subfolder `<prompt_id>/` of the output folder, emptied before each attempt), so a prompt that
runs twice writes the same files once; a result that arrives twice is kept once (the frontend keeps the first).

Broker down: POST /prompt answers 503 in ComfyUI's error shape (nothing is accepted that is not stored by the
broker); the frontend and the workers reconnect with exponential backoff (0.5 s doubling to 10 s). Results
wait in the frontend's durable queue while it is away.

aio-pika (the optional extra `broker`) is imported only here and in fleet_worker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from .bodies import json_error
from .hub import PREVIEW_IMAGE, Hub
from .queue import Item, PromptQueue
from .routes import Routes, _duplicate

log = logging.getLogger("vramgraph.broker")
PROMPTS = "vramgraph.prompts"
FLEET = "vramgraph.fleet"
CATALOG = "vramgraph.catalog"
SET_QUEUE = "vramgraph.set."
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
        raise ValueError(f"--broker {url!r}: give an AMQP URL, e.g. amqp://guest:guest@127.0.0.1:5672/")
    return url


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
    """The prompts exchange and the durable queue of set `key`, bound; returns the queue."""
    aio_pika = amqp()
    exchange = await channel.declare_exchange(PROMPTS, aio_pika.ExchangeType.DIRECT, durable=True)
    queue = await channel.declare_queue(SET_QUEUE + key, durable=True)
    await queue.bind(exchange, key)
    return queue


async def fleet_exchange(channel: Any) -> Any:
    return await channel.declare_exchange(FLEET, amqp().ExchangeType.FANOUT)


async def read_catalog(channel: Any) -> dict[str, list[str]]:
    """Every set in the catalog queue (read, then returned to it untouched)."""
    queue = await channel.declare_queue(CATALOG, durable=True)
    found, held = {}, []
    while True:
        m = await queue.get(no_ack=False, fail=False)
        if m is None:
            break
        held.append(m)
        with contextlib.suppress(ValueError, KeyError, TypeError):
            d = json.loads(m.body)
            found[str(d["set"])] = [str(x) for x in d["models"]]
    for m in held:
        await m.nack(requeue=True)
    return found


def json_body(message: Any) -> dict:
    return json.loads(message.body.decode())


class Frontend:
    """A frontend's link to the broker; it stands where a single-machine server has its Worker (routes ask it for
    status, interrupts and the running prompt's plan), and relays what workers send back to the hub and queue."""

    def __init__(self, url: str, queue: PromptQueue, hub: Hub, ident: str | None = None) -> None:
        self.url, self.queue, self.hub = check_url(url), queue, hub
        self.ident = ident or frontend_id()
        self.reply_to = FRONTEND_QUEUE + self.ident
        self.channel: Any = None
        self.sets: dict[str, list[str]] = {}  # set key -> models, published by this frontend
        self._catalogued: set[str] = set()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.client_id: str | None = None  # the prompt last seen running, for pages that reconnect (routes.py)
        self.last_node: str | None = None
        self.plan_message: dict | None = None
        self.attempts: dict[str, str] = {}  # prompt id -> the attempt whose result was kept
        self.stats: dict[str, Any] = {"workers": {}, "results": 0, "resident": 0, "duplicates": 0}
        self.peers: dict[str, dict] = {}  # worker id -> its last heartbeat

    # -- what routes.py asks of a worker
    def status(self) -> dict:
        return {"exec_info": {"queue_remaining": self.queue.remaining()}}

    def interrupt(self, prompt_id: str | None = None) -> bool:
        self._control({"type": "interrupt", "prompt_id": prompt_id, "frontend": self.ident})
        return True

    def free(self, flags: dict) -> None:
        self._control({"type": "free", **flags})

    def delete(self, prompt_ids: list[str]) -> None:
        self._control({"type": "delete", "prompt_ids": prompt_ids})

    # -- lifetime
    async def start(self) -> None:
        amqp()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vramgraph-frontend")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        delay = BACKOFF[0]
        while not self._stopping:
            try:
                conn = await connect(self.url)
            except Exception as e:  # refused, DNS, auth: try again later
                log.warning("broker %s unreachable (%s); retrying in %.1f s", _safe(self.url), e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF[1])
                continue
            delay = BACKOFF[0]
            closed = asyncio.Event()

            def lost(*_: Any, done: asyncio.Event = closed) -> None:
                self.channel = None  # at once: POST /prompt answers 503 from now on
                done.set()

            conn.close_callbacks.add(lost)
            try:
                channel = await conn.channel(publisher_confirms=True)
                replies = await channel.declare_queue(self.reply_to, durable=True)
                await fleet_exchange(channel)
                for key in self.sets:  # the queues of sets published before the broker went away
                    await declare_prompts(channel, key)
                self._catalogued = set(await read_catalog(channel))
                await replies.consume(self._reply)
                news = await channel.declare_queue("", exclusive=True, auto_delete=True)
                await news.bind(FLEET)
                await news.consume(self._news, no_ack=True)
                self.channel = channel
                log.info("frontend %s connected to the broker %s", self.ident, _safe(self.url))
                while not closed.is_set():
                    await asyncio.wait_for(self._announce(), PUBLISH_TIMEOUT)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(closed.wait(), ANNOUNCE_EVERY)
                log.warning("lost the broker %s; reconnecting", _safe(self.url))
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await conn.close()
                raise
            except Exception as e:
                log.warning("broker %s: %s: %s; reconnecting", _safe(self.url), type(e).__name__, e)
                await asyncio.sleep(delay)
            finally:
                self.channel = None
                with contextlib.suppress(Exception):
                    await conn.close()

    async def _announce(self) -> None:
        if self.sets and self.channel is not None:
            exchange = await fleet_exchange(self.channel)
            await exchange.publish(amqp().Message(json.dumps({"type": "sets", "sets": self.sets}).encode()), "")

    def _control(self, body: dict) -> None:
        async def send() -> None:
            if self.channel is None:
                log.warning("broker unreachable: %s not sent to the workers", body["type"])
                return
            exchange = await fleet_exchange(self.channel)
            await exchange.publish(amqp().Message(json.dumps(body).encode()), "")

        asyncio.get_running_loop().create_task(send())

    # -- publishing
    async def publish(self, item: Item, models: tuple[str, ...]) -> None:
        """Store the prompt in the broker (persistent, confirmed) under its set's routing key; BrokerDown if not."""
        aio_pika = amqp()
        channel = self.channel
        if channel is None:
            raise BrokerDown("not connected")
        key = set_key(models)
        number, pid, prompt, extra, outputs = item[:5]
        body = {"number": number, "prompt_id": pid, "prompt": prompt, "extra_data": extra, "outputs": outputs,
                "set": key, "models": list(models), "frontend": self.ident}

        async def send() -> None:
            if key not in self.sets:
                await declare_prompts(channel, key)
                self.sets[key] = list(models)
            if key not in self._catalogued:
                await channel.default_exchange.publish(aio_pika.Message(
                    json.dumps({"set": key, "models": list(models)}).encode(),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT), CATALOG)
                self._catalogued.add(key)
                await self._announce()
            exchange = await channel.get_exchange(PROMPTS, ensure=False)
            await exchange.publish(aio_pika.Message(
                json.dumps(body).encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=pid,
                reply_to=self.reply_to, timestamp=time.time(), content_type="application/json"), key)

        try:
            await asyncio.wait_for(send(), PUBLISH_TIMEOUT)
        except asyncio.TimeoutError:
            raise BrokerDown(f"the broker did not confirm within {PUBLISH_TIMEOUT:g} s") from None
        except Exception as e:
            if isinstance(e, BrokerDown):
                raise
            raise BrokerDown(f"{type(e).__name__}: {e}") from e

    # -- what comes back
    async def _news(self, message: Any) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            d = json_body(message)
            if d.get("type") == "worker":
                self.peers[str(d["id"])] = {**{k: d.get(k) for k in ("holds", "busy", "loads", "taken", "resident")},
                                            "seen": time.monotonic()}

    async def _reply(self, message: Any) -> None:
        kind = message.headers.get("vg") if message.headers else None
        try:
            if kind == "preview":
                sid = message.headers.get("sid") or None
                if self._current(message.headers.get("pid"), message.headers.get("attempt")):
                    self.hub.send(PREVIEW_IMAGE, bytes(message.body), sid if isinstance(sid, str) else None)
            elif kind == "event":
                self._event(json_body(message))
            elif kind == "result":
                self._result(json_body(message))
            elif kind == "update":
                d = json_body(message)
                if self.attempts.get(d["prompt_id"]) == d["attempt"]:
                    self.queue.update_history(d["prompt_id"], "vramgraph", d["report"])
        except Exception:  # one bad message must not stop the relay
            log.exception("a message from a worker could not be relayed")
        await message.ack()

    def _current(self, pid: Any, attempt: Any) -> bool:
        """Whether events of `attempt` of prompt `pid` still go to clients: not once another attempt finished it."""
        done = self.attempts.get(str(pid)) if pid else None
        return done is None or done == attempt

    def _event(self, d: dict) -> None:
        kind, data, sid = d["kind"], d["data"], d.get("sid")
        pid = data.get("prompt_id") if isinstance(data, dict) else None
        if not self._current(pid, d.get("attempt")):
            return
        if kind == "execution_start" and pid:
            self._running(pid)
        elif kind == "vramgraph.plan":
            self.client_id, self.plan_message, self.last_node = sid, data, None
        elif kind == "executing" and isinstance(data, dict):
            if data.get("node") is None and self.plan_message and pid in (self.plan_message.get("prompt_ids") or
                                                                          [self.plan_message.get("prompt_id")]):
                self.client_id, self.plan_message, self.last_node = None, None, None
            elif data.get("node") is not None:
                self.client_id, self.last_node = sid, data["node"]
        self.hub.send(kind, data, sid)

    def _running(self, pid: str) -> None:
        _, pending = self.queue.current()
        item = next((i for i in pending if i[1] == pid), None)
        if item is not None and self.queue.delete(pid):
            self.queue.running[pid] = item

    def _result(self, d: dict) -> None:
        pid, attempt = d["prompt_id"], d["attempt"]
        if pid in self.attempts:  # a redelivered prompt that finished twice: the first result stays
            self.stats["duplicates"] += 1
            log.info("prompt %s: a second result (attempt %s) ignored", pid, attempt)
            return
        self.attempts[pid] = attempt
        entry = d["entry"]
        self.queue.delete(pid)
        self.queue.done(pid, entry)
        w = self.stats["workers"].setdefault(d["worker"], {"prompts": 0, "resident": 0, "loads": 0})
        w["prompts"] += 1
        w["resident"] += bool(d.get("resident"))
        w["loads"] = max(w["loads"], int(d.get("loads", 0)))
        self.stats["results"] += 1
        self.stats["resident"] += bool(d.get("resident"))
        self.hub.send("status", {"status": self.status()})

    def report(self) -> dict:
        n = self.stats["results"]
        return {"frontend": self.ident, "connected": self.channel is not None, "results": n,
                "resident_share": round(self.stats["resident"] / n, 4) if n else None,
                "duplicates": self.stats["duplicates"], "workers": self.stats["workers"],
                "sets": {k: v for k, v in self.sets.items()},
                "alive": {w: {k: v for k, v in p.items() if k != "seen"} for w, p in self.peers.items()
                          if time.monotonic() - p["seen"] < 2.0}}


def _safe(url: str) -> str:
    """The URL without its password, for logs."""
    head, sep, tail = url.partition("@")
    return url if not sep else head.split("://")[0] + "://…@" + tail


class FrontendRoutes(Routes):
    """The routes of a frontend: as on one machine, but POST /prompt plans for the reference card and publishes,
    and /interrupt, /free and /queue deletions are passed to the workers."""

    worker: Frontend

    def table(self) -> list:
        return [*super().table(), ("GET", "/vramgraph/fleet", self.fleet)]

    async def post_prompt(self, request: web.Request) -> web.Response:
        from ..graph.plan.planner import PlanError
        from ..graph.workflow.errors import ValidationFailed

        admitted = await self.admit(request)
        if isinstance(admitted, web.Response):
            return admitted
        req, number, pid, check = admitted
        prompt, loop = req.prompt, asyncio.get_running_loop()

        def plan() -> Any:
            with self._plan_lock:
                return self.planner.prepare(prompt, outputs=list(check.outputs))

        try:  # planned for the reference card: a prompt that cannot fit is refused here, as on one machine
            prep = await loop.run_in_executor(None, plan)
        except ValidationFailed as e:
            return web.json_response(e.response, status=400)
        except PlanError as e:
            return web.json_response({"error": e.to_dict(), "node_errors": {}}, status=400)
        req.extra["create_time"] = int(time.time() * 1000)
        item = (number, pid, req.prompt, req.extra, list(check.outputs))
        if not self.queue.put_new(item):  # listed as pending before the broker has it: a fast result finds it
            return _duplicate(pid)
        try:
            await self.worker.publish(item, model_set(prep))
        except BrokerDown as e:
            self.queue.delete(pid)
            log.warning("prompt %s refused: the broker is unreachable (%s)", pid, e)
            return json_error(503, "the prompt queue's broker is unreachable; nothing was queued", "broker_unavailable",
                              details=f"{e}; the server reconnects by itself: send the prompt again shortly "
                                      f"(broker {_safe(self.worker.url)})")
        self.hub.send("status", {"status": self.worker.status()})
        return web.json_response({"prompt_id": pid, "number": number, "node_errors": check.node_errors})

    async def post_queue(self, request: web.Request) -> web.Response:
        _, pending = self.queue.current()
        response = await super().post_queue(request)
        _, left = self.queue.current()
        gone = sorted({i[1] for i in pending} - {i[1] for i in left})
        if gone:
            self.worker.delete(gone)
        return response

    async def free(self, request: web.Request) -> web.Response:
        from .bodies import read_object

        body = await read_object(request)
        self.worker.free({f: bool(body.get(f)) for f in ("unload_models", "free_memory")})
        return web.Response(status=200)

    async def fleet(self, request: web.Request) -> web.Response:
        return web.json_response(self.worker.report())


__all__ = ["BrokerDown", "Frontend", "FrontendRoutes", "model_set", "portable", "set_key"]
