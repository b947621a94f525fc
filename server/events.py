"""The one translation of engine events into ComfyUI's per-prompt websocket messages (see queue.py's module doc).

`Translation` is the engine's `events` callback for one run of one prompt or of a batch merged into one graph:
every event becomes each concerned prompt's messages, with that prompt's own node ids, sent to that prompt's
client only. The single-prompt path is a run of one member with its own node ids; a fleet worker runs the same
Worker (fleet_worker.py), so its frontends relay exactly these messages.

Two ways a member ends: `early` (a batch) ends each prompt as soon as its last node has run (history entry,
execution_success, executing None) and a targeted /interrupt stops it at once; otherwise (one prompt) it ends
when the run returns, with the engine's execution_success, and an interrupt is told once the run has ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import messages as msg
from .formats import ProgressState
from .hub import PREVIEW_IMAGE, encode_preview
from .messages import QueueItem

if TYPE_CHECKING:
    from .queue import Worker


@dataclass(eq=False)
class Member:
    """One prompt of a run: its queue item, its node ids in the run's graph, what it has been told."""

    index: int
    item: QueueItem
    rename: dict[str, str]  # its node id -> the run's graph's
    previews: bool
    left: set[str] = field(default_factory=set)  # the run's ids of its planned nodes that have still to run
    messages: list[list] = field(default_factory=list)
    ui: dict[str, dict] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)  # its node ids done, cached or run
    outputs: list[str] = field(default_factory=list)  # its output nodes' ids in the run's graph
    progress: ProgressState = field(init=False)
    done: bool = False
    stopped: bool = False  # interrupted
    stop_node: str | None = None  # where, once stopped (its own id)

    def __post_init__(self) -> None:
        self.progress = ProgressState(self.pid)

    @property
    def pid(self) -> str:
        return self.item.prompt_id

    @property
    def sid(self) -> str | None:
        return self.item.client_id

    def node_type(self, node: str | None) -> str | None:
        return self.item.prompt.get(node, {}).get("class_type") if node else None


def clients(members: list[Member]) -> dict[str | None, Member]:
    """The distinct clients of `members`, each with its first prompt; None (no client id: every client) alone."""
    firsts: dict[str | None, Member] = {}
    for m in members:
        firsts.setdefault(m.sid, m)
    return {None: firsts[None]} if None in firsts else firsts


class Translation:
    """The engine's events of one run as each member's ComfyUI messages (call it as the engine's `events`)."""

    def __init__(self, worker: Worker, prep: Any, members: list[Member], batch_id: str | None = None) -> None:
        self.worker, self.hub, self.prep, self.members, self.batch_id = worker, worker.hub, prep, members, batch_id
        self.early = batch_id is not None
        self.owners: dict[str, list[tuple[Member, str]]] = {}  # run's id -> (prompt, its own id); shared: several
        for m in members:
            for orig, new in m.rename.items():
                self.owners.setdefault(new, []).append((m, orig))
        for out in prep.outputs:  # output nodes are never shared: each is one prompt's
            self.owners[out][0][0].outputs.append(out)
        self.plan_json: dict = prep.plan.to_json() if self.early else {}
        self.plan_messages: dict[str | None, dict] = {}
        self.nodes: list[dict] = []  # a batch's node reports so far
        self.images: list[str] = []
        self.moves = {"load": 0, "unload": 0}
        self.t0 = time.perf_counter()
        self._on = {"plan": self._plan, "execution_cached": self._cached, "executing": self._executing,
                    "progress": self._progress, "cancelled": self._cancelled, "executed": self._executed,
                    "execution_success": self._success, "vg_estimate_exceeded": self._estimate,
                    "vg_replan": self._replan, "vg_step": self._step, "preview": self._preview}

    def __call__(self, kind: str, data: dict) -> None:
        handler = self._on.get(kind)
        if handler is not None:
            handler(data)

    # -- what each member is told
    def send(self, m: Member, kind: str, data: dict, keep: bool = False) -> None:
        tell(self.hub, m, kind, data, keep)

    def own(self, sid: str | None) -> list[str]:
        """The prompts of the run a message to client `sid` may name."""
        return [m.pid for m in self.members if m.sid == sid]

    def about(self, m: Member) -> dict:
        return {"batch": {"id": self.batch_id, "prompt_ids": self.own(m.sid), "index": m.index}, "members": m.rename}

    def report(self, m: Member, result: Any = None) -> dict:
        """A batch member's history report: the whole run's once it has ended, else the run so far."""
        if result is not None:
            return {**result.to_json(), **self.about(m)}
        return {"prompt_id": self.batch_id, "seconds": round(time.perf_counter() - self.t0, 4),
                "loads": self.moves["load"], "unloads": self.moves["unload"], "cached": list(self.prep.cached),
                "images": list(self.images), "nodes": list(self.nodes), "plan": self.plan_json, "partial": True,
                **self.about(m)}

    def finish(self, m: Member) -> None:
        """A batch member whose nodes have all run ends now."""
        self.send(m, "execution_success", msg.success(m.pid), keep=True)
        self.worker.end(m, msg.entry(m.item, m.ui, True, m.messages, self.report(m)))

    def interrupted(self, m: Member, node: str | None) -> None:
        """Member `m` stopped at the run's node `node`: a batch's ends now, a lone prompt's when the run returns."""
        m.stopped, m.stop_node = True, next((o for mm, o in self.owners.get(node or "", ()) if mm is m), None)
        if not self.early:
            return
        self.send(m, "execution_interrupted", msg.interrupted(m.pid, m.stop_node, m.node_type(m.stop_node), m.ran),
                  keep=True)
        self.worker.end(m, msg.entry(m.item, m.ui, False, m.messages,
                                      {"plan": self.plan_json, "executed": list(m.ran), **self.about(m)}))

    def running(self, node: str | None) -> list[tuple[Member, str]]:
        """The prompts still told about the run's node `node`, each with its own id of it."""
        return [(m, orig) for m, orig in self.owners.get(node or "", ()) if not m.done]

    def _settle(self, ms: list[Member]) -> None:
        for m in ms:
            if self.early and not m.left and not m.done:
                self.finish(m)

    # -- the engine's events
    def _plan(self, data: dict) -> None:
        from ..graph.draw.timeline import timeline_data, timeline_svg

        prep, worker = self.prep, self.worker
        self.plan_json = data["plan"]
        names = {str(m.item.extra_data.get("workflow_name") or "") for m in self.members}
        svg = timeline_svg(prep.plan, names.pop() if len(names) == 1 else "", card=worker.engine.budget.card,
                           prompt=prep.prompt)
        timeline = timeline_data(prep.plan)
        for sid, first in clients(self.members).items():  # each client hears of its own prompts only
            body: dict[str, Any] = {"prompt_id": first.pid, "plan": self.plan_json, "timeline": timeline, "svg": svg}
            if self.early:
                body = {"prompt_id": first.pid, "prompt_ids": self.own(sid), "batch": self.batch_id,
                        "members": {m.pid: m.rename for m in self.members if m.sid == sid}, **body}
            self.plan_messages[sid] = body
            self.hub.send_threadsafe("vramgraph.plan", body, sid)
        self._follow(self.members[0], None)

    def _cached(self, data: dict) -> None:
        for m in self.members:
            cached = [orig for new in data.get("nodes", []) for mm, orig in self.owners.get(new, ()) if mm is m]
            m.ran.extend(cached)
            self.send(m, "execution_cached", msg.cached(m.pid, cached), keep=True)  # as ComfyUI: empty too
            for orig in cached:  # as ComfyUI: a cached output node shows its last output again
                ui = self.cached_ui(m.rename[orig])
                if ui is not None:
                    m.ui[orig] = ui
                    self.send(m, "executed", msg.executed(m.pid, orig, ui))
        self._settle(self.members)

    def cached_ui(self, node: str) -> dict | None:
        """The ui the run's cached node `node` returned when it ran: its entry's in the engine's one output cache
        (graph/engine/cache.py), read while the run that reported it cached holds the engine."""
        entry = self.worker.engine.cache.get(self.prep.signatures[node])
        return entry.ui if entry is not None else None

    def _executing(self, data: dict) -> None:
        node = data.get("node")
        if node is None:  # the end is announced once the history entry is written
            return
        for m, orig in self.running(node):
            self._follow(m, orig)
            self.send(m, "executing", msg.executing(m.pid, orig))
            self.send(m, "progress_state", m.progress.start(orig))
        self.worker.running_now(next((m.pid for m, _ in self.running(node)), None))

    def _progress(self, data: dict) -> None:
        for m, orig in self.running(data.get("node")):
            self.send(m, "progress", msg.progress(m.pid, orig, data))
            self.send(m, "progress_state", m.progress.update(orig, data["value"], data["max"]))

    def _cancelled(self, data: dict) -> None:  # a targeted /interrupt: those prompts stop, the others go on
        gone = set(data["outputs"])
        for m in self.members:
            if not m.done and not m.stopped and gone & set(m.outputs):
                self.interrupted(m, next((n for n in (data["node"], *data["dropped"])
                                          if any(mm is m for mm, _ in self.owners.get(n or "", ()))), None))
        for m in self.members:  # nodes left out that a prompt listed but did not need
            m.left.difference_update(data["dropped"])
        self._settle(self.members)

    def _executed(self, data: dict) -> None:
        node, output = data["node"], data.get("output")
        if self.early:
            self._note(node, data)
        for m, orig in self.running(node):
            m.ran.append(orig)
            self.send(m, "progress_state", m.progress.finish(orig))
            if output is not None:
                m.ui[orig] = output
                self.send(m, "executed", msg.executed(m.pid, orig, output))
        ms = list(dict.fromkeys(m for m, _ in self.running(node)))
        for m in ms:
            m.left.discard(node)
        self._settle(ms)

    def _note(self, node: str, data: dict) -> None:
        """A batch's report of node `node` that has run, and the images it wrote."""
        prep = self.prep
        variant = prep.plan.variant_of(node)
        self.nodes.append({"node": node, "class_type": prep.prompt[node]["class_type"], "variant": variant,
                           "seconds": data.get("seconds", 0.0), "measured_bytes": data.get("measured_bytes", 0),
                           "predicted_bytes": next(
                               (o.activation for o in prep.costs[node].variants if o.name == variant), 0)})
        folders = self.worker.engine.folders
        self.images.extend(str((folders.output if im.get("type") == "output" else folders.temp)
                               / im.get("subfolder", "") / im["filename"])
                           for im in (data.get("output") or {}).get("images", []))

    def _success(self, data: dict) -> None:
        if self.early:  # a batch's prompts end when their last node has run, or when the run returns
            return
        for m in self.members:
            if not m.done and not m.stopped:  # an interrupted prompt is told once the run has ended
                self.send(m, "execution_success", msg.success(m.pid), keep=True)

    def _fan_out(self, kind: str, data: dict, to: list[Member], node: bool = False) -> None:
        """A vramgraph event to each client of `to`, naming its first prompt (and, in a batch, all of its own)."""
        for sid, first in clients(to).items():
            body = {**data, "prompt_id": first.pid}
            if node:
                body["node"] = next(orig for m, orig in self.running(data.get("node")) if m is first)
            if self.early:
                body["prompt_ids"] = self.own(sid)
            self.hub.send_threadsafe(kind, body, sid)

    def _estimate(self, data: dict) -> None:
        self._fan_out("vramgraph.estimate", data, [m for m, _ in self.running(data.get("node"))], node=True)

    def _replan(self, data: dict) -> None:  # other processes took GPU memory: the rest was planned again
        self._fan_out("vramgraph.replan", data, [m for m in self.members if not m.done])

    def _step(self, data: dict) -> None:
        self.moves[data["kind"]] = self.moves.get(data["kind"], 0) + 1
        self._fan_out("vramgraph.step", data, [m for m in self.members if not m.done])

    def _preview(self, data: dict) -> None:
        wanted = [m for m, _ in self.running(data.get("node")) if m.previews]
        if wanted:
            frame = encode_preview(data["image"])
            for sid in clients(wanted):
                self.hub.send_threadsafe(PREVIEW_IMAGE, frame, sid)

    def _follow(self, m: Member, node: str | None) -> None:
        """What a page that reconnects now is told: member `m`'s plan, and its node running."""
        base = self.plan_messages.get(m.sid) or self.plan_messages.get(None)
        self.worker.client_id, self.worker.last_node = m.sid, node
        self.worker.plan_message = {**base, "prompt_id": m.pid} if base else None


def tell(hub: Any, m: Member, kind: str, data: dict, keep: bool = False) -> None:
    """Send member `m`'s client one message; `keep` it in its history entry's messages too."""
    if keep:
        m.messages.append([kind, data])
    hub.send_threadsafe(kind, data, m.sid)


__all__ = ["Member", "Translation", "clients", "tell"]
