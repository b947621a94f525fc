"""A fleet on a real RabbitMQ: one `vramgraph serve --broker` frontend and two `vramgraph worker` processes over
tiny models, 40 prompts over two model sets (consumed model-aware), a worker killed mid-run (nothing lost, nothing
twice), every client's events in order, and the broker going away and coming back.

The broker is Debian's rabbitmq-server (`.ci/run` installs it), started here on free loopback ports with its own
node name and data folder; without it these tests are skipped, saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from rabbit import Rabbit
from serving import serve_process

try:
    import aio_pika  # noqa: F401
    NO_CLIENT = None
except ImportError:
    NO_CLIENT = "the fleet needs the AMQP client aio-pika (pip install -e '.[broker]')"

ROOT = Path(__file__).resolve().parents[1]
SETS = {"A": "flux-2-klein-4b.safetensors", "B": "flux-2-klein-4b-alt.safetensors"}  # two model sets, by transformer
TIMEOUT = 150
# one thread per process: three engines share the test machine's cores
SECRET = "fleet-test-secret-0123456789"  # signs the fleet's broker messages (server/signing.py)
ENV = {**{k: v for k, v in os.environ.items() if k not in ("VRAMGRAPH_CONFIG", "VRAMGRAPH_MODELS")},
       "OMP_NUM_THREADS": "1", "VRAMGRAPH_BROKER_SECRET": SECRET}


@pytest.fixture(scope="module")
def rabbit(tmp_path_factory):
    r = Rabbit(tmp_path_factory.mktemp("rabbit"))
    r.start(wait=False)  # it boots while the test starts its processes
    yield r
    r.kill()


@pytest.fixture(scope="module")
def fleet_folder(tmp_path_factory):
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models

    folder = tmp_path_factory.mktemp("fleet")
    write_tiny_models(folder / "models", names={**SHIPPED_NAMES, "transformer": list(SETS.values())})
    for d in ("input", "output"):
        (folder / d).mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def start_worker(folder: Path, url: str, ident: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vramgraph", "worker", "--broker", url, "--id", ident, "--grace", "5",
           "--models", str(folder / "models"), "--input", str(folder / "input"), "--output", str(folder / "output"),
           "--config", str(folder / "config.json"), "--device", "cpu"]
    with open(folder / f"{ident}.log", "wb") as log:
        return subprocess.Popen(cmd, cwd=folder, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def prompt(which: str, seed: int) -> dict:
    p = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    p["1"]["inputs"]["file"] = SETS[which]
    p["5"]["inputs"].update(width=32, height=32)
    p["6"]["inputs"].update(steps=1, seed=seed)  # one text for all: a batch encodes it once
    return p


class Clients:
    """Websocket clients of the frontend, each collecting its messages (JSON) in order, on a thread of their own."""

    def __init__(self, url: str, ids: list[str]) -> None:
        self.url, self.ids = url.replace("http://", "ws://"), ids
        self.messages: dict[str, list[dict]] = {i: [] for i in ids}
        self.frames: dict[str, int] = dict.fromkeys(ids, 0)
        self.on_message = None  # called with (client, message) from the clients' thread
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the websockets did not connect"

    async def _main(self) -> None:
        import aiohttp

        self._stop = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            sockets = [await session.ws_connect(f"{self.url}/ws?clientId={i}") for i in self.ids]
            self._ready.set()

            async def read(client: str, ws) -> None:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        m = json.loads(msg.data)
                        self.messages[client].append(m)
                        if self.on_message is not None:
                            self.on_message(client, m)
                    elif msg.type == aiohttp.WSMsgType.BINARY:
                        self.frames[client] += 1

            tasks = [asyncio.create_task(read(c, ws)) for c, ws in zip(self.ids, sockets, strict=True)]
            await self._stop.wait()
            for ws in sockets:
                await ws.close()
            for t in tasks:
                t.cancel()

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def submit(url: str, which: str, seed: int, client: str) -> str:
    """POST /prompt; client c2 asks for step previews (ComfyUI's extra_data.preview_method), c1 for none."""
    extra = {"preview_method": "auto" if client == "c2" else "none"}
    r = requests.post(url + "/prompt", json={"prompt": prompt(which, seed), "client_id": client, "extra_data": extra},
                      timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["prompt_id"]


def wait_done(url: str, pids: list[str], timeout: float = TIMEOUT) -> dict:
    end = time.monotonic() + timeout
    while True:
        history = requests.get(url + "/history", timeout=30).json()
        if all(p in history for p in pids):
            return {p: history[p] for p in pids}
        if time.monotonic() > end:
            missing = [p for p in pids if p not in history]
            raise AssertionError(f"{len(missing)} of {len(pids)} prompts did not finish")
        time.sleep(0.2)


def fleet(url: str) -> dict:
    return requests.get(url + "/vramgraph/fleet", timeout=30).json()


def wait_for(what: str, check, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def closed(messages: list[dict], pid: str, timeout: float = 30.0) -> list[dict]:
    """`messages` once they hold `pid`'s closing `executing` (node None): the history can show a prompt done a
    moment before the websocket relay delivers its last event."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(m["type"] == "executing" and isinstance(m["data"], dict) and m["data"].get("prompt_id") == pid
               and m["data"].get("node") is None for m in list(messages)):
            break
        time.sleep(0.05)
    return list(messages)


def check_order(messages: list[dict], pid: str, once: bool) -> None:
    """One prompt's events as its client saw them: ComfyUI's order, from its last start to its end, nothing after."""
    seq = [m for m in messages if m["type"] != "status" and isinstance(m["data"], dict)
           and (m["data"].get("prompt_id") == pid or pid in m["data"].get("prompt_ids", ()))]  # a batch's plan: all
    kinds = [m["type"] for m in seq]
    starts = [i for i, k in enumerate(kinds) if k == "execution_start"]
    assert starts, f"{pid}: no execution_start"
    if once:
        assert len(starts) == 1, f"{pid} started {len(starts)} times"
    last = seq[starts[-1]:]
    kinds = [m["type"] for m in last]
    assert kinds[-2:] == ["execution_success", "executing"] and last[-1]["data"]["node"] is None, kinds[-4:]
    assert "vramgraph.plan" in kinds and kinds.index("vramgraph.plan") < kinds.index("executed")
    assert kinds.index("executed") < kinds.index("execution_success")
    steps = [m["data"]["value"] for m in last if m["type"] == "progress" and m["data"]["node"] == "6"]
    assert steps == sorted(steps) and steps, f"{pid}: sampler progress {steps}"


def images_of(folder: Path, pid: str) -> list[Path]:
    return sorted((folder / "output" / pid).rglob("*.png"))


# ------------------------------------------------------------------------------------------ pure parts


def test_choose_prefers_held_sets_then_unheld_then_backlogs():
    from vramgraph.server.fleet_worker import choose

    now = 100.0
    # its own sets first, the one used last first, even when others wait longer
    assert choose({"a": 1, "b": 9, "c": 5}, ["c", "a"], {"b": 1}, {"a": 0, "b": 0, "c": 99}, now) == "c"
    # holding nothing: a set nobody holds at once (the longest queue), never one a peer holds
    assert choose({"b": 9, "d": 2, "e": 3}, [], {"b": 1}, {"b": 0, "d": 99, "e": 99}, now) == "e"
    # holding something: an unheld set only after the grace
    assert choose({"d": 2}, ["a"], {}, {"d": 99.5}, now, grace=1.0) is None
    assert choose({"d": 2}, ["a"], {}, {"d": 98.0}, now, grace=1.0) == "d"
    # a peer's set: only when its backlog is over two batches per holder, or it has waited steal_after
    assert choose({"b": 32}, ["a"], {"b": 1}, {"b": 99}, now, batch=16) is None
    assert choose({"b": 33}, ["a"], {"b": 1}, {"b": 99}, now, batch=16) == "b"
    assert choose({"b": 33}, ["a"], {"b": 2}, {"b": 99}, now, batch=16) is None
    assert choose({"b": 1}, ["a"], {"b": 1}, {"b": 60}, now, steal_after=30) == "b"
    assert choose({}, ["a"], {}, {}, now) is None


def test_output_files_are_keyed_on_the_prompt_id():
    from vramgraph.nodes import ENGINE_NODES
    from vramgraph.server.fleet_worker import keyed_outputs

    p = prompt("A", 1)
    keyed = keyed_outputs(p, "pid-1", ENGINE_NODES)
    assert keyed["8"]["inputs"]["filename_prefix"] == "pid-1/" + p["8"]["inputs"]["filename_prefix"]
    assert {k: v for k, v in keyed.items() if k != "8"} == {k: v for k, v in p.items() if k != "8"}
    assert p["8"]["inputs"]["filename_prefix"] == "vramgraph/text_to_image", "the prompt given is left alone"


def test_model_sets_are_named_by_kind_and_file():
    from vramgraph.server.broker import portable, set_key

    assert portable("transformer:/a/b/flux-2-klein-4b.safetensors:bf16") == "transformer:flux-2-klein-4b.safetensors"
    assert set_key(["vae:x", "transformer:y"]) == set_key(["transformer:y", "vae:x"]) != set_key(["transformer:y"])


def test_fleet_simulation_model_aware_loads_less():
    """bench/fleet_sim.py on a small fleet: the same prompts, fewer model loads and no longer total time."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import fleet_sim
    finally:
        sys.path.remove(str(ROOT / "bench"))
    c = fleet_sim.costs()
    sets = fleet_sim.model_sets(c)
    arrivals = fleet_sim.workload(sets, 400, None, seed=3)
    runs = {p: fleet_sim.simulate(p, sets, arrivals, 8, c["set_9b_gib"], c) for p in ("first_come", "model_aware")}
    assert runs["model_aware"]["model_loads"] < runs["first_come"]["model_loads"] / 3
    assert runs["model_aware"]["total_s"] < runs["first_come"]["total_s"]
    assert runs["model_aware"]["resident_share"] > runs["first_come"]["resident_share"]


@pytest.mark.parametrize("argv, says", [
    (["worker", "--broker", "http://127.0.0.1:1/"], "give an AMQP URL"),
    (["worker", "--broker", "amqp://127.0.0.1:1/", "--max-batch", "0"], "--max-batch 0"),
    (["worker", "--broker", "amqp://127.0.0.1:1/", "--grace", "-1"], "waits of 0 seconds or more"),
    (["serve", "--broker", "localhost:5672"], "give an AMQP URL"),
    (["serve", "--work"], "give --broker"),
])
@pytest.mark.skipif(NO_CLIENT is not None, reason=str(NO_CLIENT))
def test_bad_fleet_options_are_refused_before_anything_loads(argv, says, capsys):
    from vramgraph.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------------ a real fleet


# slow: a broker, a frontend and two workers through 58 prompts (about 40 s on 2 cores); .ci/run runs it
@pytest.mark.slow
@pytest.mark.skipif(NO_CLIENT is not None, reason=str(NO_CLIENT))
def test_fleet_model_aware_nothing_lost_and_broker_down(rabbit, fleet_folder):
    folder = fleet_folder
    workers = {w: start_worker(folder, rabbit.url, w) for w in ("w1", "w2")}
    try:
        with serve_process(folder, "--broker", rabbit.url, "--frontend-id", "fe", env=ENV) as (url, _, _log):
            rabbit.wait()
            wait_for("two live workers", lambda: len(fleet(url)["alive"]) == 2, 120)
            clients = Clients(url, ["c1", "c2"])
            try:
                _fleet(url, folder, rabbit, workers, clients)
            finally:
                clients.close()
    finally:
        for p in workers.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()


def _fleet(url: str, folder: Path, rabbit: Rabbit, workers: dict, clients: Clients) -> None:
    t0 = time.monotonic()
    # warm-up: one prompt of each set; the second goes to the worker that holds nothing (the other waits --grace)
    first = wait_done(url, [submit(url, "A", 0, "c1")])
    second = wait_done(url, [submit(url, "B", 0, "c1")])
    holder = {w: next(iter(h.values()))["vramgraph"]["fleet"]["worker"] for w, h in (("A", first), ("B", second))}
    assert holder["A"] != holder["B"], f"both sets went to one worker: {holder}"

    # 40 prompts over the two sets, interleaved, from two clients: each runs where its set is resident
    order = [("A" if i % 2 == 0 else "B", "c1" if i % 4 < 2 else "c2") for i in range(40)]
    pids = [submit(url, which, 100 + i, client) for i, (which, client) in enumerate(order)]
    history = wait_done(url, pids)
    about = {p: history[p]["vramgraph"]["fleet"] for p in pids}
    resident = sum(a["resident"] for a in about.values()) / len(pids)
    report = fleet(url)
    print("fleet after 40 prompts:", json.dumps(report["workers"]), f"resident share {resident:.2f}")
    print(f"40 prompts done at {time.monotonic() - t0:.1f} s")
    assert resident >= 0.9, f"only {resident:.0%} of the prompts ran where their models were resident: {about}"
    assert all(a["worker"] == holder[w] for a, (w, _) in zip(about.values(), order, strict=True) if a["resident"])
    for p, (_, client) in zip(pids, order, strict=True):
        assert history[p]["status"]["status_str"] == "success"
        check_order(closed(clients.messages[client], p), p, once=True)
        other = "c2" if client == "c1" else "c1"
        assert not any(m["data"].get("prompt_id") == p for m in clients.messages[other] if isinstance(m["data"], dict))
        assert len(images_of(folder, p)) == 1
    assert clients.frames["c2"] >= 20 and clients.frames["c1"] == 0, clients.frames  # previews to who asked
    image = history[pids[0]]["outputs"]["8"]["images"][0]
    view = requests.get(url + "/view", params=image, timeout=30)
    assert view.status_code == 200 and view.content[:8] == b"\x89PNG\r\n\x1a\n"

    # a worker killed mid-run (SIGKILL while it samples a prompt of its set): its prompts run again on the other
    victim, survivor = holder["B"], holder["A"]
    killed = threading.Event()
    phase2: set[str] = set()

    def kill_on_progress(client: str, m: dict) -> None:
        pid = m["data"].get("prompt_id") if isinstance(m["data"], dict) else None
        if m["type"] == "progress" and pid in phase2 and pid in b_pids and not killed.is_set():
            killed.set()
            workers[victim].kill()

    clients.on_message = kill_on_progress
    order2 = [("A" if i % 2 == 0 else "B", "c1" if i % 4 < 2 else "c2") for i in range(12)]
    b_pids: set[str] = set()
    pids2 = []
    for i, (which, client) in enumerate(order2):
        pid = submit(url, which, 500 + i, client)
        pids2.append(pid)
        phase2.add(pid)
        if which == "B":
            b_pids.add(pid)
    history2 = wait_done(url, pids2)
    print(f"kill phase done at {time.monotonic() - t0:.1f} s")
    assert killed.is_set(), "the victim was never seen running"
    assert workers[victim].wait(10) == -signal.SIGKILL
    for p, (_, client) in zip(pids2, order2, strict=True):
        assert history2[p]["status"]["status_str"] == "success", history2[p]["status"]
        check_order(closed(clients.messages[client], p), p, once=False)
        assert len(images_of(folder, p)) == 1, f"{p}: {images_of(folder, p)}"
    assert not list((folder / "output").rglob("*.part")), "a half-written image is left"
    rerun = [p for p in b_pids if history2[p]["vramgraph"]["fleet"]["worker"] == survivor]
    assert rerun, "no prompt of the killed worker ran again on the survivor"
    assert len(requests.get(url + "/history", timeout=30).json()) == 2 + 40 + 12

    # the broker goes away: prompts the broker confirmed are kept; new ones are refused 503 in ComfyUI's shape;
    # the frontend and the worker reconnect by themselves and everything finishes
    kept = [submit(url, "A", 900 + i, "c1") for i in range(4)]
    rabbit.kill()

    def refused() -> bool:
        r = requests.post(url + "/prompt", json={"prompt": prompt("A", 1), "client_id": "c1"}, timeout=60)
        if r.status_code == 200:
            return False
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["node_errors"] == {} and body["error"]["type"] == "broker_unavailable"
        assert {"message", "details", "extra_info"} <= set(body["error"])
        return True

    wait_for("503 while the broker is down", refused, 30)
    assert not fleet(url)["connected"]
    rabbit.start()
    wait_for("the frontend to reconnect", lambda: fleet(url)["connected"], 60)
    after = submit(url, "A", 999, "c2")
    done = wait_done(url, [*kept, after])
    assert all(h["status"]["status_str"] == "success" for h in done.values())
    assert all(len(images_of(folder, p)) == 1 for p in done)
    print(f"broker phase done at {time.monotonic() - t0:.1f} s")
    print("fleet at the end:", json.dumps(fleet(url)["workers"]))
