"""A fleet's frontend (`vramgraph serve --broker …`): the single-machine server with its engine thread replaced by a
`Frontend` that publishes prompts to the broker and relays what workers send back (see broker.py for the topology).

Everything it publishes is signed and everything it takes in is checked (signing.py); prompt ids are checked
(ids.py) and a prompt whose id names a folder in output/ that vramgraph did not make is refused. A prompt that was
dead-lettered (its workers stopped `broker.TRIES` times while running it) ends as an error in /history and an
`execution_error` to its client, naming the reason. A prompt's ending event (execution_success, _error,
_interrupted) is passed to its client only with the result it belongs to, so a prompt whose worker died after
finishing it but before its result reached the broker is not told "success" twice. /interrupt without an id stops
only the prompt this frontend last saw running, as ComfyUI does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from aiohttp import web

from . import broker
from . import messages as msg
from .bodies import json_error
from .fleet_files import handshake_problem, missing_outputs
from .hub import PREVIEW_IMAGE, Hub
from .ids import taken_by_others, unsafe_prefix
from .messages import QueueItem
from .queue import Item, PromptQueue
from .routes import Routes, _duplicate
from .signing import Signer, redact

log = logging.getLogger("vramgraph.broker")
ALIVE = 2.0  # seconds since its last heartbeat a worker counts as alive
TERMINAL = frozenset({"execution_success", "execution_error", "execution_interrupted"})


class Frontend:
    """A frontend's link to the broker; it stands where a single-machine server has its Worker (routes ask it for
    status, interrupts and the running prompt's plan), and relays what workers send back to the hub and queue."""

    def __init__(self, url: str, queue: PromptQueue, hub: Hub, ident: str | None = None, *, signer: Signer,
                 folders: Any = None) -> None:
        self.url, self.queue, self.hub, self.signer = broker.check_url(url), queue, hub, signer
        self.folders = folders
        self.ident = ident or broker.frontend_id()
        self.reply_to = broker.FRONTEND_QUEUE + self.ident
        self.channel: Any = None
        self.sets: dict[str, list[str]] = {}  # set key -> models, published by this frontend
        self._catalogued: set[str] = set()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.client_id: str | None = None  # the prompt last seen running, for pages that reconnect (routes.py)
        self.last_node: str | None = None
        self.plan_message: dict | None = None
        self.running_pid: str | None = None  # the prompt whose node ran last: /interrupt without an id stops it
        self.attempts: dict[str, str] = {}  # prompt id -> the attempt whose result was kept
        self.stats: dict[str, Any] = {"workers": {}, "results": 0, "resident": 0, "duplicates": 0, "dead": 0,
                                      "dropped": 0, "missing_images": 0}
        self.peers: dict[str, dict] = {}  # worker id -> its last heartbeat
        self.unshared: dict[str, str] = {}  # worker id -> why its output folder is not ours
        self.checked: dict[str, str] = {}  # worker id -> the handshake token found in our output folder
        self.held: dict[str, dict[Any, list]] = {}  # prompt id -> attempt -> its ending events, until its result

    def text(self, value: Any) -> str:
        """`value` as text with the broker's password hidden (for logs and answers)."""
        return redact(str(value), broker.password(self.url))

    # -- what routes.py asks of a worker
    def status(self) -> dict:
        return {"exec_info": {"queue_remaining": self.queue.remaining()}}

    def interrupt(self, prompt_id: str | None = None) -> bool:
        pid = prompt_id or self.running_pid  # ComfyUI: without an id, the running prompt (not the batch)
        if pid is None or (prompt_id is None and pid not in self.queue.running):
            return False
        self._control({"type": "interrupt", "prompt_id": pid, "frontend": self.ident})
        return True

    def free(self, flags: dict) -> None:
        self._control({"type": "free", **flags})

    def delete(self, prompt_ids: list[str]) -> None:
        self._control({"type": "delete", "prompt_ids": prompt_ids})

    # -- lifetime
    async def start(self) -> None:
        broker.amqp()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vramgraph-frontend")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def handshake(self, wait: float) -> str | None:
        """Wait up to `wait` seconds for a worker's heartbeat and check its handshake file (fleet_files.py): None
        when it passed, or when no worker came (said in the log); ValueError saying what to fix when it failed."""
        end = time.monotonic() + wait
        while time.monotonic() < end and not self.peers:
            await asyncio.sleep(0.1)
        if not self.peers:
            log.warning("no fleet worker seen within %.0f s; each worker's output folder is checked as it comes",
                        wait)
            return None
        worker, beat = next(iter(self.peers.items()))
        problem = handshake_problem(self.folders.output, worker, beat.get("token"))
        if problem:
            raise ValueError(f"refusing to start: {problem}")
        return worker

    async def _run(self) -> None:
        delay = broker.BACKOFF[0]
        while not self._stopping:
            try:
                conn = await broker.connect(self.url)
            except Exception as e:  # refused, DNS, auth: try again later
                log.warning("broker %s unreachable (%s); retrying in %.1f s", self.text(self.url), self.text(e), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, broker.BACKOFF[1])
                continue
            delay = broker.BACKOFF[0]
            closed = asyncio.Event()

            def lost(*_: Any, done: asyncio.Event = closed) -> None:
                self.channel = None  # at once: POST /prompt answers 503 from now on
                done.set()

            conn.close_callbacks.add(lost)
            try:
                await self._serve(conn, closed)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await conn.close()
                raise
            except Exception as e:
                log.warning("broker %s: %s: %s; reconnecting", self.text(self.url), type(e).__name__, self.text(e))
                await asyncio.sleep(delay)
            finally:
                self.channel = None
                with contextlib.suppress(Exception):
                    await conn.close()

    async def _serve(self, conn: Any, closed: asyncio.Event) -> None:
        channel = await conn.channel(publisher_confirms=True)
        replies = await channel.declare_queue(self.reply_to, durable=True)
        await broker.fleet_exchange(channel)
        dead = await broker.declare_dead(channel)
        for key in self.sets:  # the queues of sets published before the broker went away
            await broker.declare_prompts(channel, key)
        self._catalogued = set(await broker.read_catalog(channel, self.signer))
        self.channel = channel
        await replies.consume(self._reply)
        await dead.consume(self._dead)
        news = await channel.declare_queue("", exclusive=True, auto_delete=True)
        await news.bind(broker.FLEET)
        await news.consume(self._news, no_ack=True)
        log.info("frontend %s connected to the broker %s", self.ident, self.text(self.url))
        while not closed.is_set():
            await asyncio.wait_for(self._announce(), broker.PUBLISH_TIMEOUT)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(closed.wait(), broker.ANNOUNCE_EVERY)
        log.warning("lost the broker %s; reconnecting", self.text(self.url))

    async def _announce(self) -> None:
        if self.sets and self.channel is not None:
            exchange = await broker.fleet_exchange(self.channel)
            body = json.dumps({"type": "sets", "sets": self.sets}).encode()
            await broker.publish(self.channel, self.signer, "", body, exchange=exchange)

    def _control(self, body: dict) -> None:
        async def send() -> None:
            if self.channel is None:
                log.warning("broker unreachable: %s not sent to the workers", body["type"])
                return
            exchange = await broker.fleet_exchange(self.channel)
            await broker.publish(self.channel, self.signer, "", json.dumps(body).encode(), exchange=exchange)

        asyncio.get_running_loop().create_task(send())

    # -- publishing
    async def publish(self, item: Item, models: tuple[str, ...]) -> None:
        """Store the prompt in the broker (persistent, confirmed) under its set's routing key; BrokerDown if not."""
        channel = self.channel
        if channel is None:
            raise broker.BrokerDown("not connected")
        key = broker.set_key(models)
        pid = item.prompt_id
        body = {"number": item.number, "prompt_id": pid, "prompt": item.prompt, "extra_data": item.extra_data,
                "outputs": item.outputs, "set": key, "models": list(models), "frontend": self.ident}

        async def send() -> None:
            if key not in self.sets:
                await broker.declare_prompts(channel, key)
                self.sets[key] = list(models)
            if key not in self._catalogued:
                await broker.publish(channel, self.signer, broker.CATALOG,
                                     json.dumps({"set": key, "models": list(models)}).encode(), persistent=True)
                self._catalogued.add(key)
                await self._announce()
            exchange = await channel.get_exchange(broker.PROMPTS, ensure=False)
            await broker.publish(channel, self.signer, key, json.dumps(body).encode(), exchange=exchange,
                                 headers={"vg": "prompt"}, persistent=True, message_id=pid, reply_to=self.reply_to,
                                 timestamp=time.time(), content_type="application/json")

        try:
            await asyncio.wait_for(send(), broker.PUBLISH_TIMEOUT)
        except asyncio.TimeoutError:
            raise broker.BrokerDown(f"the broker did not confirm within {broker.PUBLISH_TIMEOUT:g} s") from None
        except Exception as e:
            if isinstance(e, broker.BrokerDown):
                raise
            raise broker.BrokerDown(f"{type(e).__name__}: {self.text(e)}") from e

    # -- what comes back
    def _signed(self, message: Any, where: str) -> bool:
        if self.signer.valid(message):
            return True
        self.stats["dropped"] += 1
        log.warning("dropped an unsigned or altered message from %s (routing key %r)", where,
                    str(message.routing_key)[:80])
        return False

    async def _news(self, message: Any) -> None:
        if not self._signed(message, broker.FLEET):
            return
        with contextlib.suppress(ValueError, KeyError, TypeError):
            d = broker.json_body(message)
            if d.get("type") == "worker":
                wid = str(d["id"])
                self.peers[wid] = {**{k: d.get(k) for k in ("holds", "busy", "loads", "taken", "resident", "can",
                                                            "token")}, "seen": time.monotonic()}
                self._check_worker(wid, d.get("token"))

    def _check_worker(self, wid: str, token: Any) -> None:
        """Read a worker's handshake file once per token (fleet_files.py); a worker that fails is listed."""
        if self.folders is None or wid in self.unshared or self.checked.get(wid) == token:
            return
        problem = handshake_problem(self.folders.output, wid, token)
        if problem:
            self.unshared[wid] = problem
            log.warning("%s", problem)
        else:
            self.checked[wid] = token

    async def _reply(self, message: Any) -> None:
        if not self._signed(message, self.reply_to):
            await message.ack()
            return
        kind = message.headers.get("vg") if message.headers else None
        try:
            if kind == "preview":
                sid = message.headers.get("sid") or None
                if self._current(message.headers.get("pid"), message.headers.get("attempt")):
                    self.hub.send(PREVIEW_IMAGE, bytes(message.body), sid if isinstance(sid, str) else None)
            elif kind == "event":
                self._event(broker.json_body(message))
            elif kind == "result":
                self._result(broker.json_body(message))
            elif kind == "dead":
                self._dead_letter(broker.json_body(message))
            elif kind == "update":
                d = broker.json_body(message)
                if self.attempts.get(d["prompt_id"]) == d["attempt"]:
                    self.queue.update_history(d["prompt_id"], "vramgraph", d["report"])
        except Exception:  # one bad message must not stop the relay
            log.exception("a message from a worker could not be relayed")
        await message.ack()

    async def _dead(self, message: Any) -> None:
        """A dead-lettered prompt (any frontend's): its own frontend is told, through its queue (kind "dead"). The
        prompt itself stays in the kept queue `vramgraph.dead`, whatever happens here."""
        note = self._dead_note(message) if self._signed(message, broker.DEAD_NOTIFY) else None
        reply_to = str(message.reply_to or "")
        if note is not None and reply_to.startswith(broker.FRONTEND_QUEUE) and self.channel is not None:
            try:
                await broker.publish(self.channel, self.signer, reply_to, json.dumps(note).encode(),
                                     headers={"vg": "dead"}, persistent=True)
            except Exception as e:  # the broker went: another frontend (or this one, back) tells it
                log.warning("could not pass on dead-lettered prompt %s (%s)", note["prompt_id"], self.text(e))
                await message.nack(requeue=True)
                return
        await message.ack()

    def _dead_note(self, message: Any) -> dict | None:
        """What a prompt's frontend is told of its dead-lettered message, or None when it cannot be read."""
        try:
            headers = message.headers or {}
            reason = str(headers.get("x-first-death-reason") or "rejected")
            d = broker.json_body(message)
            pid = str(d["prompt_id"])
            deaths = headers.get("x-death") or [{}]
            tries = broker.TRIES if reason == "delivery_limit" else int(deaths[0].get("count", 1))
            extra = d.get("extra_data") if isinstance(d.get("extra_data"), dict) else {}
            return {"prompt_id": pid, "reason": reason, "tries": tries, "sid": extra.get("client_id"),
                    "item": [d.get("number"), pid, d.get("prompt"), extra, d.get("outputs")]}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("a dead-lettered message could not be read (%s); it stays in %s", e, broker.DEAD)
            return None

    def _dead_letter(self, d: dict) -> None:
        pid = str(d["prompt_id"])
        if pid in self.attempts:  # it did finish once: that result stands
            return
        self.attempts[pid] = "dead"
        self.held.pop(pid, None)
        self.stats["dead"] += 1
        why = (f"prompt {pid} was set aside after {d['tries']} tries: each time, the worker running it stopped "
               "before it finished (killed, e.g. out of memory, or lost); it is kept in the broker's "
               f"{broker.DEAD} queue" if d["reason"] == "delivery_limit" else
               f"prompt {pid} was refused by a worker ({d['reason']}); it is kept in the broker's {broker.DEAD} queue")
        log.warning("%s", why)
        error = msg.error(pid, why, "PromptDeadLettered")
        item = next((i for i in [*self.queue.current()[0], *self.queue.current()[1]] if i.prompt_id == pid), None)
        item = item or QueueItem.of(d["item"])
        self.queue.delete(pid)
        self.queue.done(pid, msg.failed_entry(item, error, {"dead_letter": {
            "reason": d["reason"], "tries": d["tries"]}}))
        self.hub.send("execution_error", error, d.get("sid"))
        self.hub.send("status", {"status": self.status()})

    def _current(self, pid: Any, attempt: Any) -> bool:
        """Whether events of `attempt` of prompt `pid` still go to clients: not once another attempt finished it."""
        done = self.attempts.get(str(pid)) if pid else None
        return done is None or done == attempt

    def _event(self, d: dict) -> None:
        kind, data, sid = d["kind"], d["data"], d.get("sid")
        pid = data.get("prompt_id") if isinstance(data, dict) else None
        if not self._current(pid, d.get("attempt")):
            return
        if kind in TERMINAL and pid and pid not in self.attempts:  # told once its result is kept (exactly once)
            self.held.setdefault(pid, {}).setdefault(d.get("attempt"), []).append((kind, data, sid))
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
                self.client_id, self.last_node, self.running_pid = sid, data["node"], pid
        self.hub.send(kind, data, sid)

    def _running(self, pid: str) -> None:
        _, pending = self.queue.current()
        item = next((i for i in pending if i.prompt_id == pid), None)
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
        missing = missing_outputs(entry, self.folders) if self.folders is not None else []
        if missing:  # the worker wrote them where this frontend cannot see: said, not silently "success"
            self.stats["missing_images"] += len(missing)
            why = (f"worker {d['worker']} reported {len(missing)} image(s) this frontend cannot find in its output "
                   f"folder ({', '.join(missing[:3])}): the output folder is not shared")
            log.warning("prompt %s: %s", pid, why)
            status = entry.get("status", {})
            warning = ["vramgraph.warning", {"prompt_id": pid, "message": why}]
            entry = {**entry, "status": {**status, "messages": [*status.get("messages", []), warning]}}
            extra = QueueItem.of(entry["prompt"]).extra_data if len(entry.get("prompt") or ()) >= 4 else None
            self.hub.send("vramgraph.warning", {"prompt_id": pid, "message": why},
                          extra.get("client_id") if isinstance(extra, dict) else None)
        self.queue.delete(pid)
        self.queue.done(pid, entry)
        for kind, data, sid in self.held.pop(pid, {}).get(attempt, []):  # other attempts' endings are dropped
            self.hub.send(kind, data, sid)
        if self.running_pid == pid:
            self.running_pid = None
        w = self.stats["workers"].setdefault(d["worker"], {"prompts": 0, "resident": 0, "loads": 0})
        w["prompts"] += 1
        w["resident"] += bool(d.get("resident"))
        w["loads"] = max(w["loads"], int(d.get("loads", 0)))
        self.stats["results"] += 1
        self.stats["resident"] += bool(d.get("resident"))
        self.hub.send("status", {"status": self.status()})

    def report(self) -> dict:
        n = self.stats["results"]
        now = time.monotonic()
        alive = {w: p for w, p in self.peers.items() if now - p["seen"] < ALIVE}
        served = {k for p in alive.values() for k in (p.get("can") or [])}
        return {"frontend": self.ident, "connected": self.channel is not None, "results": n,
                "resident_share": round(self.stats["resident"] / n, 4) if n else None,
                "duplicates": self.stats["duplicates"], "dead_lettered": self.stats["dead"], "tries": broker.TRIES,
                "dropped_unsigned": self.stats["dropped"], "missing_images": self.stats["missing_images"],
                "workers": self.stats["workers"], "sets": dict(self.sets),
                "no_worker": sorted(k for k in self.sets if k not in served), "unshared": dict(self.unshared),
                "alive": {w: {k: v for k, v in p.items() if k not in ("seen", "token")}
                          for w, p in alive.items()}}


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
        unsafe = unsafe_prefix(req.prompt, self.engine.nodes) if isinstance(req.prompt, dict) else None
        if unsafe:  # a fleet keeps each prompt's images in its own folder
            return json_error(400, "filename_prefix leads out of the prompt's output folder", "invalid_prompt",
                              details=unsafe)
        if taken_by_others(self.engine.folders.output, pid):
            return json_error(400, "prompt_id names a folder in the output folder that vramgraph did not make",
                              "invalid_prompt_id", details=f"output/{pid} exists and is not a prompt's folder; it "
                              "is left alone: send another prompt_id, or none (the server then makes one)")
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
        item = QueueItem(number, pid, req.prompt, req.extra, list(check.outputs))
        if not self.queue.put_new(item):  # listed as pending before the broker has it: a fast result finds it
            return _duplicate(pid)
        try:
            await self.worker.publish(item, broker.model_set(prep))
        except broker.BrokerDown as e:
            self.queue.delete(pid)
            log.warning("prompt %s refused: the broker is unreachable (%s)", pid, e)
            return json_error(503, "the prompt queue's broker is unreachable; nothing was queued", "broker_unavailable",
                              details=f"{e}; the server reconnects by itself: send the prompt again shortly")
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


__all__ = ["Frontend", "FrontendRoutes"]
