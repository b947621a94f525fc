"""`vramgraph worker --broker amqp://… --models DIR [--vram …]`: runs prompts that frontends published (broker.py).

The worker is the single-machine server's Worker (queue.py: batches planned as one graph, per-prompt events,
targeted interrupts) fed from the broker instead of POST /prompt, with a hub that sends each event to its
prompt's frontend through the broker (`RelayHub`) and a queue that sends each finished prompt's history entry
back and only then acknowledges its message (`FleetQueue`).

Model-aware consumption (`choose`): when its engine is idle the worker looks at the length of every set's queue
and takes, in this order,
1. the sets it holds (every model of the set resident on its GPU), the one it used last first;
2. a set no live worker holds: at once if it holds nothing itself, else once that queue has waited `grace`
   seconds (a cold worker gets the chance first);
3. a set other workers hold, only when its backlog is over two full batches per holder, or once that queue has
   waited `steal_after` seconds (their backlog would take longer than one load of the set here).
It takes up to `max_batch` prompts of the chosen set at once, and the Worker plans them as one run (one load of
each model for all of them). Every worker tells the others what it holds in a heartbeat on the fleet exchange.
A prompt "ran resident" when its set was held by its worker when it took it; results say so, and the frontend's
GET /vramgraph/fleet sums them with each worker's model loads.

Nothing lost: messages are acknowledged after their result is confirmed by the broker (see broker.py); if the
connection goes, the running batch is interrupted and its results dropped (the broker hands the prompts to
another worker), and the worker reconnects with backoff. Output files go to `<output>/<prompt_id>/…` (each
output node's filename_prefix is put under the prompt id, and that folder is emptied before a run), so a
prompt that runs again writes the same files once. PreviewImage's temp files are not keyed (they are temporary).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import heapq
import json
import logging
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from . import broker
from .hub import PREVIEW_IMAGE
from .queue import MAX_BATCH, Item, PromptQueue, Worker

log = logging.getLogger("vramgraph.worker")
HEARTBEAT = 0.5  # seconds between a worker's heartbeats; a worker silent for 4 of them is taken as gone
POLL = 0.1  # seconds between looks at the queues while idle
GRACE = 1.0  # see the module doc
STEAL_AFTER = 30.0
STEAL_BATCHES = 2  # another worker's set is also taken when over this many full batches per holder wait
CATALOG_EVERY = 5.0  # seconds between re-reading the catalog of sets


@dataclass
class Delivery:
    """A prompt taken from the broker and not yet acknowledged."""

    message: Any
    reply_to: str
    attempt: str
    generation: int  # the connection it came on
    set: str
    resident: bool


def keyed_outputs(prompt: dict, pid: str, nodes: dict) -> dict:
    """`prompt` with every output node's filename_prefix under a subfolder named by the prompt id."""
    prompt = copy.deepcopy(prompt)
    for spec in prompt.values():
        cls = nodes.get(spec.get("class_type")) if isinstance(spec, dict) else None
        inputs = spec.get("inputs", {}) if cls is not None else {}
        if getattr(cls, "OUTPUT_NODE", False) and isinstance(inputs.get("filename_prefix"), str):
            inputs["filename_prefix"] = f"{pid}/{inputs['filename_prefix']}"
    return prompt


def choose(counts: dict[str, int], holds: list[str], others: dict[str, int], waiting: dict[str, float], now: float,
           grace: float = GRACE, steal_after: float = STEAL_AFTER, batch: int = MAX_BATCH) -> str | None:
    """The set whose prompts to take next (see the module doc), or None to wait. `counts`: prompts waiting per set;
    `holds`: the sets this worker holds, last used first; `others`: how many live peers hold each set; `waiting`:
    since when each set's queue has not been empty."""
    for key in holds:
        if counts.get(key):
            return key
    unheld = [k for k, n in counts.items() if n and not others.get(k) and k not in holds]
    if unheld:
        key = max(unheld, key=lambda k: (counts[k], -waiting.get(k, now)))
        if not holds or now - waiting.get(key, now) >= grace:
            return key
    foreign = [k for k, n in counts.items() if n and others.get(k) and k not in holds]
    if foreign:  # the longest backlog per holder; taken when it is over STEAL_BATCHES batches each, or old
        key = max(foreign, key=lambda k: (counts[k] / others[k], -waiting.get(k, now)))
        if counts[key] > STEAL_BATCHES * batch * others[key] or now - waiting.get(key, now) >= steal_after:
            return key
    return None


class FleetQueue(PromptQueue):
    """The worker's local queue: what the worker took from the broker; finished prompts go back to their frontend."""

    def __init__(self, fleet: FleetWorker) -> None:
        super().__init__(max_history=64)
        self.fleet = fleet

    def put_many(self, items: list[Item]) -> None:
        """Queue a batch at once, so the Worker thread takes it whole (queue.py batches what is pending)."""
        with self._cond:
            for item in items:
                heapq.heappush(self._pending, (item[0], next(self._seq), item))
            self._cond.notify_all()

    def done(self, prompt_id: str, entry: dict) -> None:
        super().done(prompt_id, entry)
        self.fleet.threadsafe(self.fleet.finished, prompt_id, entry)

    def update_history(self, prompt_id: str, key: str, value: Any) -> None:
        super().update_history(prompt_id, key, value)
        if key == "vramgraph":
            self.fleet.threadsafe(self.fleet.updated, prompt_id, value)


class RelayHub:
    """What the Worker sends its clients, sent instead to each prompt's frontend through the broker."""

    def __init__(self, fleet: FleetWorker) -> None:
        self.fleet = fleet

    def send_threadsafe(self, kind: str | int, data: Any, sid: str | None = None) -> None:
        self.fleet.threadsafe(self.fleet.relay, kind, data, sid)


class FleetWorker:
    def __init__(self, engine: Any, url: str, *, ident: str | None = None, max_batch: int = MAX_BATCH,
                 grace: float = GRACE, steal_after: float = STEAL_AFTER) -> None:
        self.engine, self.url = engine, broker.check_url(url)
        self.ident = ident or broker.frontend_id()
        self.max_batch, self.grace, self.steal_after = max_batch, grace, steal_after
        self.queue = FleetQueue(self)
        self.worker = Worker(engine, self.queue, RelayHub(self), previews=False, batch=True,  # type: ignore[arg-type]
                             max_batch=max_batch)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.channel: Any = None
        self.generation = 0
        self.sets: dict[str, list[str]] = {}
        self.deliveries: dict[str, Delivery] = {}
        self.routes: dict[str, tuple[str, str, int]] = {}  # prompt id -> (frontend queue, attempt, generation)
        self.about: dict[str, dict] = {}  # prompt id -> its result's "fleet" report, until the batch's report
        self.by_sid: dict[str | None, set[str]] = {}  # client id -> prompt ids taken (for preview frames)
        self.peers: dict[str, tuple[set[str], float]] = {}
        self.last_used: dict[str, float] = {}
        self.waiting: dict[str, float] = {}
        self.deleted: set[str] = set()
        self.busy: str | None = None
        self.taken = self.resident = 0
        self._outbox: asyncio.Queue | None = None
        self._replies: set[str] = set()  # frontend queues declared on this connection

    # -- called from the Worker thread
    def threadsafe(self, fn: Any, *args: Any) -> None:
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(fn, *args)

    # -- on the event loop
    def loads(self) -> int:
        return sum(1 for e in self.engine.ledger.events if e.kind == "load")

    def holds(self) -> list[str]:
        """The known sets whose models are all on this worker's GPU now, the one used last first."""
        on = {broker.portable(k) for k in self.engine.ledger.on_gpu}
        held = [k for k, models in self.sets.items() if models and set(models) <= on]
        return sorted(held, key=lambda k: -self.last_used.get(k, 0.0))

    def _send(self, kind: str, reply_to: str, body: bytes, generation: int, *, persistent: bool = False,
              headers: dict | None = None, ack: Any = None) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait((kind, reply_to, body, generation, persistent, headers or {}, ack))

    def relay(self, kind: str | int, data: Any, sid: str | None) -> None:
        if kind == "status":  # the frontend tells its clients its own queue's status
            return
        pid = data.get("prompt_id") if isinstance(data, dict) else None
        pids = [pid] if pid in self.routes else sorted(self.by_sid.get(sid, ()))
        sent: set[str] = set()
        for p in pids:
            reply_to, attempt, gen = self.routes[p]
            if reply_to in sent:
                continue
            sent.add(reply_to)
            if kind == PREVIEW_IMAGE:
                self._send("preview", reply_to, bytes(data), gen,
                           headers={"sid": sid or "", "pid": p, "attempt": attempt})
            else:
                self._send("event", reply_to, json.dumps({"kind": kind, "data": data, "sid": sid,
                                                          "attempt": attempt}, default=str).encode(), gen)

    def finished(self, pid: str, entry: dict) -> None:
        d = self.deliveries.pop(pid, None)
        if d is None:  # its connection went: the broker hands the prompt to another worker
            return
        self.about[pid] = {"worker": self.ident, "set": d.set, "resident": d.resident, "attempt": d.attempt}
        entry = {**entry, "vramgraph": {**entry.get("vramgraph", {}), "fleet": self.about[pid]}}
        body = {"prompt_id": pid, "attempt": d.attempt, "worker": self.ident, "resident": d.resident,
                "set": d.set, "loads": self.loads(), "entry": entry}
        self._send("result", d.reply_to, json.dumps(body, default=str).encode(), d.generation, persistent=True,
                   ack=d.message)

    def updated(self, pid: str, report: dict) -> None:
        if pid in self.routes:
            reply_to, attempt, gen = self.routes[pid]
            report = {**report, "fleet": self.about.pop(pid, {})}
            self._send("update", reply_to, json.dumps({"prompt_id": pid, "attempt": attempt, "report": report},
                                                      default=str).encode(), gen, persistent=True)

    async def _publisher(self, channel: Any, generation: int) -> None:
        """Sends the outbox in order on this connection; a result's message is acknowledged once it is confirmed."""
        aio_pika = broker.amqp()
        assert self._outbox is not None
        while True:
            kind, reply_to, body, gen, persistent, headers, ack = await self._outbox.get()
            if gen != generation:
                continue  # from a connection that went: its prompts are redelivered
            if reply_to not in self._replies:
                await channel.declare_queue(reply_to, durable=True)  # results wait there for their frontend
                self._replies.add(reply_to)
            await channel.default_exchange.publish(aio_pika.Message(
                body, headers={"vg": kind, **headers}, delivery_mode=aio_pika.DeliveryMode.PERSISTENT if persistent
                else aio_pika.DeliveryMode.NOT_PERSISTENT), reply_to)
            if ack is not None:
                await ack.ack()

    async def _news(self, message: Any) -> None:
        try:
            d = broker.json_body(message)
        except ValueError:
            return
        t = d.get("type")
        if t == "sets":
            self.sets.update({str(k): list(v) for k, v in d.get("sets", {}).items()})
        elif t == "worker" and d.get("id") != self.ident:
            self.peers[str(d["id"])] = (set(d.get("holds", [])) | ({d["busy"]} if d.get("busy") else set()),
                                        time.monotonic())
        elif t == "interrupt":
            pid = d.get("prompt_id")
            if pid is None:
                if any(x.reply_to == broker.FRONTEND_QUEUE + str(d.get("frontend")) for x in self.deliveries.values()):
                    self.worker.interrupt(None)
            elif pid in self.deliveries:
                self.worker.interrupt(pid)
        elif t == "free":
            for flag in ("unload_models", "free_memory"):
                if d.get(flag):
                    self.queue.set_flag(flag, True)
        elif t == "delete":
            self.deleted.update(str(p) for p in d.get("prompt_ids", []))

    async def _heartbeat(self, exchange: Any) -> None:
        aio_pika = broker.amqp()
        while True:
            await exchange.publish(aio_pika.Message(json.dumps({
                "type": "worker", "id": self.ident, "holds": self.holds(), "busy": self.busy,
                "loads": self.loads(), "taken": self.taken, "resident": self.resident}).encode()), "")
            await asyncio.sleep(HEARTBEAT)

    async def _take(self, channel: Any, key: str, queues: dict[str, Any], held: list[str]) -> None:
        """Up to max_batch prompts of set `key`, handed to the Worker thread as one batch."""
        items = []
        while len(items) < self.max_batch:
            m = await queues[key].get(no_ack=False, fail=False)
            if m is None:
                break
            try:
                d = broker.json_body(m)
                pid = str(d["prompt_id"])
                item = (d["number"], pid, keyed_outputs(d["prompt"], pid, self.engine.nodes), d["extra_data"],
                        d["outputs"])
            except (ValueError, KeyError, TypeError) as e:
                log.error("a message in %s is not a prompt (%s); dropped", broker.SET_QUEUE + key, e)
                await m.reject(requeue=False)
                continue
            if pid in self.deleted or "/" in pid or pid in (".", ".."):
                await m.ack()
                continue
            folder = self.engine.folders.output / pid
            if folder.exists():  # an earlier attempt's files (a worker that was killed): written again from scratch
                await asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, folder, True)
            attempt = f"{self.ident}:{uuid.uuid4().hex[:8]}"
            resident = key in held
            self.deliveries[pid] = Delivery(m, m.reply_to or "", attempt, self.generation, key, resident)
            self.routes[pid] = (m.reply_to or "", attempt, self.generation)
            self.by_sid.setdefault(d["extra_data"].get("client_id"), set()).add(pid)
            self.taken += 1
            self.resident += resident
            items.append(item)
        if len(self.routes) > 10000:  # forget the oldest routes (prompts long done)
            for p in list(self.routes)[:5000]:
                self.routes.pop(p, None)
            self.by_sid = {s: {p for p in ps if p in self.routes} for s, ps in self.by_sid.items()}
        if items:
            self.busy, self.last_used[key] = key, time.time()
            log.info("taking %d prompt(s) of set %s (%s)", len(items), key, "held" if key in held else "not held")
            self.queue.put_many(items)

    async def _serve(self, conn: Any, closed: asyncio.Event) -> None:
        channel = await conn.channel(publisher_confirms=True)
        fleet = await broker.fleet_exchange(channel)
        news = await channel.declare_queue("", exclusive=True, auto_delete=True)
        await news.bind(fleet)
        await news.consume(self._news, no_ack=True)
        self.generation += 1
        generation = self.generation
        self._outbox, self._replies = asyncio.Queue(), set()
        tasks = [asyncio.create_task(self._publisher(channel, generation)),
                 asyncio.create_task(self._heartbeat(fleet))]
        queues: dict[str, Any] = {}
        catalog_at = 0.0
        self.channel = channel
        log.info("worker %s connected to the broker %s", self.ident, broker._safe(self.url))
        try:
            while not closed.is_set():
                for t in tasks:
                    if t.done():
                        t.result()  # a failed publisher or heartbeat: reconnect
                now = time.monotonic()
                if now - catalog_at > CATALOG_EVERY:
                    self.sets.update(await broker.read_catalog(channel))
                    catalog_at = now
                if self.queue.remaining():
                    await asyncio.sleep(POLL / 2)
                    continue
                self.busy = None
                counts = {}
                for key in list(self.sets):
                    if key not in queues:
                        queues[key] = await broker.declare_prompts(channel, key)
                    counts[key] = (await queues[key].declare()).message_count
                    if counts[key]:
                        self.waiting.setdefault(key, now)
                    else:
                        self.waiting.pop(key, None)
                alive = now - 4 * HEARTBEAT
                others: dict[str, int] = {}
                for h, t in self.peers.values():
                    for k in h if t > alive else ():
                        others[k] = others.get(k, 0) + 1
                held = self.holds()
                key = choose(counts, held, others, self.waiting, now, self.grace, self.steal_after, self.max_batch)
                if key is None:
                    await asyncio.sleep(POLL)
                    continue
                await self._take(channel, key, queues, held)
        finally:
            for t in tasks:
                t.cancel()
            self.channel = None
            self.generation += 1  # whatever is still in the outbox is not sent on another connection
            if self.deliveries:  # unacknowledged: the broker redelivers them; stop running them here
                log.warning("lost the broker while running %d prompt(s): stopping them (they are redelivered)",
                            len(self.deliveries))
                self.deliveries.clear()
                self.queue.wipe()
                self.worker.interrupt(None)

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.worker.start()
        delay = broker.BACKOFF[0]
        try:
            while True:
                try:
                    conn = await broker.connect(self.url)
                except Exception as e:
                    log.warning("broker %s unreachable (%s); retrying in %.1f s", broker._safe(self.url), e, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, broker.BACKOFF[1])
                    continue
                delay = broker.BACKOFF[0]
                closed = asyncio.Event()
                conn.close_callbacks.add(lambda *_, done=closed: done.set())
                try:
                    await self._serve(conn, closed)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.warning("broker %s: %s: %s; reconnecting", broker._safe(self.url), type(e).__name__, e)
                    await asyncio.sleep(delay)
                finally:
                    with contextlib.suppress(Exception):
                        await conn.close()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)


def run_in_thread(worker: FleetWorker) -> threading.Thread:
    """`serve --broker … --work`: the fleet worker beside the frontend, on an event loop of its own."""
    thread = threading.Thread(target=lambda: asyncio.run(worker.run()), name="vramgraph-fleet-worker", daemon=True)
    thread.start()
    return thread


def work(args: argparse.Namespace) -> int:
    """`vramgraph worker`: the engine from the command line's options, consuming until Ctrl-C."""
    from ..graph.engine.runtime import engine_from

    broker.amqp()
    broker.check_url(args.broker)
    if args.max_batch < 1 or not args.steal_after >= 0 or not args.grace >= 0:
        raise ValueError(f"--max-batch {args.max_batch} --steal-after {args.steal_after} --grace {args.grace}: give a "
                         "batch of at least 1 prompt and waits of 0 seconds or more")
    engine = engine_from(args)
    for folder in (engine.folders.input, engine.folders.output, engine.folders.temp):
        folder.mkdir(parents=True, exist_ok=True)
    engine.warm_up()
    fleet = FleetWorker(engine, args.broker, ident=args.id, max_batch=args.max_batch, steal_after=args.steal_after,
                        grace=args.grace)
    log.info("vramgraph worker %s (device %s, budget %.2f GiB), output %s", fleet.ident, engine.device,
             engine.budget.gpu / 2**30, engine.folders.output)
    try:
        asyncio.run(fleet.run())
    except KeyboardInterrupt:
        log.info("stopped")
    return 0


__all__ = ["FleetWorker", "choose", "keyed_outputs", "work"]
