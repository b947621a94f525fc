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
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from . import broker
from . import messages as msg
from .fleet_files import can_run, held_files, write_handshake
from .hub import PREVIEW_IMAGE
from .ids import BadId, NotOurs, check_prompt_id, claim, unsafe_prefix
from .messages import QueueItem
from .queue import MAX_BATCH, Item, PromptQueue, Worker
from .signing import Signer, redact

log = logging.getLogger("vramgraph.worker")
HEARTBEAT = 0.5  # seconds between a worker's heartbeats; a worker silent for 4 of them is taken as gone
POLL = 0.1  # seconds between looks at the queues while idle
GRACE = 1.0  # see the module doc
STEAL_AFTER = 30.0
STEAL_BATCHES = 2  # another worker's set is also taken when over this many full batches per holder wait
CATALOG_EVERY = 5.0  # seconds between re-reading the catalog of sets
FILES_EVERY = 30.0  # seconds between looks at which model files this worker holds


@dataclass
class Delivery:
    """A prompt taken from the broker and not yet acknowledged."""

    message: Any
    reply_to: str
    attempt: str
    generation: int  # the connection it came on
    set: str
    resident: bool


def tries(message: Any) -> int:
    """How many times the broker delivered `message` before (its quorum queue's x-delivery-count)."""
    n = (message.headers or {}).get("x-delivery-count")
    return n if isinstance(n, int) and n >= 0 else int(bool(message.redelivered))


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
    def __init__(self, engine: Any, url: str, *, signer: Signer, ident: str | None = None,
                 max_batch: int = MAX_BATCH, grace: float = GRACE, steal_after: float = STEAL_AFTER) -> None:
        self.engine, self.url, self.signer = engine, broker.check_url(url), signer
        self.ident = ident or broker.frontend_id()
        self.token = write_handshake(engine.folders.output, self.ident)  # ValueError for an id unfit as a file name
        self.files: set[str] = set()  # the model files this worker holds (fleet_files.held_files)
        self.files_at = -FILES_EVERY
        self.solo: list[Any] = []  # redelivered prompts taken while filling a batch: each runs alone next
        self.dropped = 0  # unsigned or altered messages
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
    def text(self, value: Any) -> str:
        """`value` as text with the broker's password hidden (for logs)."""
        return redact(str(value), broker.password(self.url))

    def loads(self) -> int:
        return self.engine.ledger.events.count("load")

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
        assert self._outbox is not None
        while True:
            kind, reply_to, body, gen, persistent, headers, ack = await self._outbox.get()
            if gen != generation:
                continue  # from a connection that went: its prompts are redelivered
            if reply_to not in self._replies:
                await channel.declare_queue(reply_to, durable=True)  # results wait there for their frontend
                self._replies.add(reply_to)
            await broker.publish(channel, self.signer, reply_to, body, headers={"vg": kind, **headers},
                                 persistent=persistent)
            if ack is not None:
                await ack.ack()

    def _signed(self, message: Any, where: str) -> bool:
        if self.signer.valid(message):
            return True
        self.dropped += 1
        log.warning("dropped an unsigned or altered message from %s (routing key %r)", where,
                    str(message.routing_key)[:80])
        return False

    async def _news(self, message: Any) -> None:
        if not self._signed(message, broker.FLEET):
            return
        try:
            d = broker.json_body(message)
        except ValueError:
            return
        t = d.get("type")
        if t == "sets" and isinstance(d.get("sets"), dict):
            self.sets.update({str(k): [str(m) for m in v] for k, v in d["sets"].items() if isinstance(v, list)})
        elif t == "worker" and d.get("id") != self.ident:
            self.peers[str(d["id"])] = (set(d.get("holds", [])) | ({d["busy"]} if d.get("busy") else set()),
                                        time.monotonic())
        elif t == "interrupt":  # always of one prompt: a frontend names the one it saw running
            pid = d.get("prompt_id")
            if isinstance(pid, str) and pid in self.deliveries:
                self.worker.interrupt(pid)
        elif t == "free":
            for flag in ("unload_models", "free_memory"):
                if d.get(flag):
                    self.queue.set_flag(flag, True)
        elif t == "delete" and isinstance(d.get("prompt_ids"), list):
            self.deleted.update(str(p) for p in d["prompt_ids"])

    def runnable(self) -> list[str]:
        """The known sets whose model files this worker holds (it takes prompts of these only)."""
        return sorted(k for k, models in self.sets.items() if can_run(models, self.files))

    async def _heartbeat(self, channel: Any, exchange: Any) -> None:
        while True:
            body = json.dumps({"type": "worker", "id": self.ident, "holds": self.holds(), "busy": self.busy,
                               "loads": self.loads(), "taken": self.taken, "resident": self.resident,
                               "can": self.runnable(), "token": self.token}).encode()
            await broker.publish(channel, self.signer, "", body, exchange=exchange)
            await asyncio.sleep(HEARTBEAT)

    async def _take(self, key: str | None, queues: dict[str, Any], held: list[str]) -> None:
        """Up to max_batch prompts of set `key`, handed to the Worker thread as one batch. A prompt delivered before
        (its worker stopped while running it) runs alone: first, a redelivered one kept from an earlier take."""
        messages: list[tuple[str, Any]] = []
        if self.solo:
            messages.append(self.solo.pop(0))
        elif key is not None:
            while len(messages) < self.max_batch:
                m = await queues[key].get(no_ack=False, fail=False)
                if m is None:
                    break
                if tries(m):  # alone: now when it comes first, else next
                    (self.solo if messages else messages).append((key, m))
                    break
                messages.append((key, m))
        items = []
        for k, m in messages:
            item = await self._admit(m, k, held)
            if item is not None:
                items.append(item)
        if len(self.routes) > 10000:  # forget the oldest routes (prompts long done)
            for p in list(self.routes)[:5000]:
                self.routes.pop(p, None)
            self.by_sid = {s: {p for p in ps if p in self.routes} for s, ps in self.by_sid.items()}
        if items:
            k = messages[0][0]
            self.busy, self.last_used[k] = k, time.time()
            log.info("taking %d prompt(s) of set %s (%s)", len(items), k, "held" if k in held else "not held")
            self.queue.put_many(items)

    async def _admit(self, m: Any, key: str, held: list[str]) -> Item | None:
        """A message of set `key` as a queue item, once it is checked and its output folder claimed; None when it is
        dropped (unsigned, altered, not a prompt: dead-lettered; deleted: acknowledged) or refused (told its client)."""
        if not self._signed(m, broker.SET_QUEUE + key):
            await m.reject(requeue=False)
            return None
        try:
            d = broker.json_body(m)
            pid = check_prompt_id(d["prompt_id"])
            if not isinstance(d["prompt"], dict) or not isinstance(d["extra_data"], dict):
                raise TypeError("prompt and extra_data must be objects")
            item = QueueItem(d["number"], pid, keyed_outputs(d["prompt"], pid, self.engine.nodes), d["extra_data"],
                             d["outputs"])
            reply_to = str(m.reply_to or "")
            if not reply_to.startswith(broker.FRONTEND_QUEUE):
                raise ValueError(f"reply_to {reply_to[:80]!r} is not a frontend's queue")
            unsafe = unsafe_prefix(d["prompt"], self.engine.nodes)
        except (ValueError, KeyError, TypeError) as e:  # BadId is a ValueError
            log.error("a message in %s is not a prompt (%s); dead-lettered", broker.SET_QUEUE + key, e)
            await m.reject(requeue=False)
            return None
        if pid in self.deleted:
            await m.ack()
            return None
        attempt = f"{self.ident}:{uuid.uuid4().hex[:8]}"
        if unsafe:
            self._refuse(m, item._replace(prompt=d["prompt"]), reply_to, attempt, unsafe)
            return None
        try:  # an earlier attempt's files (a worker that was killed) go; a folder we did not make is left alone
            await asyncio.get_running_loop().run_in_executor(None, claim, self.engine.folders.output, pid)
        except (NotOurs, BadId, OSError) as e:
            self._refuse(m, item._replace(prompt=d["prompt"]), reply_to, attempt, str(e))
            return None
        resident = key in held
        self.deliveries[pid] = Delivery(m, reply_to, attempt, self.generation, key, resident)
        self.routes[pid] = (reply_to, attempt, self.generation)
        sid = d["extra_data"].get("client_id")
        self.by_sid.setdefault(sid, set()).add(pid)
        self.taken += 1
        self.resident += resident
        n = tries(m)
        if n:  # its client hears why it starts again before its second execution_start
            why = (f"prompt {pid} runs again, alone (try {n + 1} of at most {broker.TRIES}): the worker running it "
                   "stopped before it finished")
            log.warning("%s", why)
            self._send("event", reply_to, json.dumps({"kind": "vramgraph.retry", "sid": sid, "attempt": attempt,
                                                      "data": {"prompt_id": pid, "try": n + 1, "tries": broker.TRIES,
                                                               "message": why}}).encode(), self.generation)
        return item

    def _refuse(self, m: Any, item: Item, reply_to: str, attempt: str, why: str) -> None:
        """End prompt `item` with an error its client sees (execution_error, a /history entry); the message is
        acknowledged once the broker has the result."""
        pid = item.prompt_id
        log.warning("prompt %s refused: %s", pid, why)
        error = msg.error(pid, why, "PromptRefused")
        self._send("event", reply_to, json.dumps({"kind": "execution_error", "data": error, "sid": item.client_id,
                                                  "attempt": attempt}).encode(), self.generation)
        body = {"prompt_id": pid, "attempt": attempt, "worker": self.ident, "resident": False, "set": "",
                "loads": self.loads(), "entry": msg.failed_entry(item, error, {})}
        self._send("result", reply_to, json.dumps(body, default=str).encode(), self.generation, persistent=True,
                   ack=m)

    async def _serve(self, conn: Any, closed: asyncio.Event) -> None:
        channel = await conn.channel(publisher_confirms=True)
        fleet = await broker.fleet_exchange(channel)
        await broker.declare_dead(channel)
        news = await channel.declare_queue("", exclusive=True, auto_delete=True)
        await news.bind(fleet)
        await news.consume(self._news, no_ack=True)
        self.generation += 1
        generation = self.generation
        self._outbox, self._replies = asyncio.Queue(), set()
        tasks = [asyncio.create_task(self._publisher(channel, generation)),
                 asyncio.create_task(self._heartbeat(channel, fleet))]
        queues: dict[str, Any] = {}
        catalog_at = 0.0
        self.channel = channel
        log.info("worker %s connected to the broker %s", self.ident, self.text(self.url))
        try:
            while not closed.is_set():
                for t in tasks:
                    if t.done():
                        t.result()  # a failed publisher or heartbeat: reconnect
                now = time.monotonic()
                if now - catalog_at > CATALOG_EVERY:
                    self.sets.update(await broker.read_catalog(channel, self.signer))
                    catalog_at = now
                if now - self.files_at > FILES_EVERY:
                    self.files = await asyncio.get_running_loop().run_in_executor(None, held_files, self.engine.folders)
                    self.files_at = now
                if self.queue.remaining():
                    await asyncio.sleep(POLL / 2)
                    continue
                self.busy = None
                if self.solo:
                    await self._take(None, queues, self.holds())
                    continue
                counts = {}
                for key in self.runnable():  # sets whose files it lacks wait for a worker that has them
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
                await self._take(key, queues, held)
        finally:
            for t in tasks:
                t.cancel()
            self.channel = None
            self.generation += 1  # whatever is still in the outbox is not sent on another connection
            self.solo.clear()  # unacknowledged on the connection that went: redelivered
            if self.deliveries:  # unacknowledged: the broker redelivers them; stop running them here
                log.warning("lost the broker while running %d prompt(s): stopping them (they are redelivered)",
                            len(self.deliveries))
                self.deliveries.clear()
                self.queue.wipe()
                self.worker.interrupt_all()

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.worker.start()
        delay = broker.BACKOFF[0]
        try:
            while True:
                try:
                    conn = await broker.connect(self.url)
                except Exception as e:
                    log.warning("broker %s unreachable (%s); retrying in %.1f s", self.text(self.url), self.text(e),
                                delay)
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
                    log.warning("broker %s: %s: %s; reconnecting", self.text(self.url), type(e).__name__, self.text(e))
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
    from .signing import signer

    broker.amqp()
    broker.check_url(args.broker)
    if args.max_batch < 1 or not args.steal_after >= 0 or not args.grace >= 0:
        raise ValueError(f"--max-batch {args.max_batch} --steal-after {args.steal_after} --grace {args.grace}: give a "
                         "batch of at least 1 prompt and waits of 0 seconds or more")
    if args.id is not None:
        check_prompt_id(args.id, "--id")  # a file name in the shared output folder (its handshake)
    keys = signer(getattr(args, "broker_secret_file", None))
    engine = engine_from(args)
    for folder in (engine.folders.input, engine.folders.output, engine.folders.temp):
        folder.mkdir(parents=True, exist_ok=True)
    engine.warm_up()
    fleet = FleetWorker(engine, args.broker, signer=keys, ident=args.id, max_batch=args.max_batch,
                        steal_after=args.steal_after, grace=args.grace)
    log.info("vramgraph worker %s (device %s, budget %.2f GiB), output %s", fleet.ident, engine.device,
             engine.budget.gpu / 2**30, engine.folders.output)
    try:
        asyncio.run(fleet.run())
    except KeyboardInterrupt:
        log.info("stopped")
    return 0


__all__ = ["FleetWorker", "choose", "keyed_outputs", "tries", "work"]
