"""A fleet under attack and failure, on a real RabbitMQ: 60 prompts from 3 clients over 2 workers, with a poison
prompt (its worker dies by SIGKILL each time it samples it: tests/fleet_poison.py) and a worker killed by SIGKILL
in the middle. A supervisor thread restarts workers that die, as systemd would.

Checked: every non-poison prompt finishes exactly once (one history entry, one execution_success at its client,
one image); the poison is dead-lettered after broker.TRIES deliveries and its client gets an execution_error naming
why; redelivered prompts were announced (vramgraph.retry) before they started again; forged broker messages (unsigned,
wrongly signed, altered) are dropped; a prompt id naming a folder that is not ours is refused and that folder, the
input and the models folders do not change; a prompt of a model set no worker holds waits and the fleet status says
so; no answer and no log line holds the broker's password or the fleet secret. The figures go to docs/fleet.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
from fleet_poison import POISON_SEED
from rabbit import Rabbit
from serving import serve_process
from test_fleet import ENV, NO_CLIENT, ROOT, SECRET, Clients, fleet, prompt, wait_done, wait_for

PASSWORD = "brokerPw-7f3k2Zq9"  # the broker user's password: it must never show
WORKERS = ("w1", "w2")
CLIENTS = ("c1", "c2", "c3")
N = 60
TIMEOUT = 240
RESTARTS = 10  # worker restarts the supervisor makes at most
NOBODY = "flux-2-klein-4b-nobody.safetensors"  # a transformer only the frontend has: its prompts wait


class Supervisor:
    """Starts the workers (over `models`, sharing input and output) and restarts any that dies, recording its exit."""

    def __init__(self, folder: Path, url: str) -> None:
        self.folder, self.url = folder, url
        self.procs: dict[str, subprocess.Popen] = {}
        self.exits: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        for w in WORKERS:
            self.procs[w] = self._start(w)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _start(self, ident: str) -> subprocess.Popen:
        f = self.folder
        cmd = [sys.executable, str(ROOT / "tests" / "fleet_poison.py"), "worker", "--broker", self.url, "--id", ident,
               "--grace", "0", "--models", str(f / "wmodels"), "--input", str(f / "input"), "--output",
               str(f / "output"), "--config", str(f / "config.json"), "--device", "cpu"]
        with open(f / f"{ident}.log", "ab") as log:
            return subprocess.Popen(cmd, cwd=f, env=ENV, stdout=log, stderr=subprocess.STDOUT)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                for w, p in self.procs.items():
                    if p.poll() is not None and len(self.exits) < RESTARTS:
                        self.exits.append((w, p.returncode))
                        self.procs[w] = self._start(w)

    def kill(self, ident: str) -> None:
        with self._lock:
            self.procs[ident].send_signal(signal.SIGKILL)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def tree(*roots: Path) -> dict[str, str]:
    """Every file under `roots`, by path, with a hash of its content."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for r in roots for p in sorted(r.rglob("*"))
            if p.is_file()}


def forge(url: str, key: str) -> None:
    """Three forged prompts for set `key`, straight into the broker: unsigned, signed with another secret, and
    signed with the right one but altered after signing. Each would empty `portraits/` were it run."""
    import aio_pika
    from vramgraph.server import broker
    from vramgraph.server.signing import Signer

    async def main() -> None:
        conn = await aio_pika.connect(url)
        channel = await conn.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(broker.PROMPTS)
        for i, signer in enumerate((None, Signer(b"not-the-fleet-secret-000"), Signer(SECRET.encode()))):
            body = json.dumps({"number": 1, "prompt_id": "portraits", "prompt": prompt("A", i), "extra_data": {},
                               "outputs": ["8"], "set": key}).encode()
            headers = signer.headers(key, body, {"vg": "prompt"}) if signer else {"vg": "prompt"}
            if i == 2:
                body = body.replace(b'"portraits"', b'"portrait5"')
            await exchange.publish(aio_pika.Message(body, headers=headers, reply_to=broker.FRONTEND_QUEUE + "fe"), key)
        await conn.close()

    asyncio.run(main())


def dead_count(url: str) -> int:
    import aio_pika
    from vramgraph.server import broker

    async def main() -> int:
        conn = await aio_pika.connect(url)
        channel = await conn.channel()
        queue = await channel.declare_queue(broker.DEAD, passive=True)
        n = queue.declaration_result.message_count
        await conn.close()
        return n

    return asyncio.run(main())


def unshared_frontend(folder: Path, url: str) -> subprocess.CompletedProcess:
    """A second frontend whose output folder is not the workers': it must refuse to start (handshake)."""
    (folder / "elsewhere").mkdir()
    cmd = [sys.executable, "-m", "vramgraph", "serve", "--port", "0", "--broker", url, "--frontend-id", "fe2",
           "--models", str(folder / "models"), "--input", str(folder / "input"), "--output", str(folder / "elsewhere"),
           "--config", str(folder / "config.json"), "--device", "cpu", "--handshake-wait", "30"]
    return subprocess.run(cmd, cwd=folder, env=ENV, capture_output=True, text=True, timeout=180)


@pytest.fixture()
def chaos_folder(tmp_path):
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models

    write_tiny_models(tmp_path / "models", names={**SHIPPED_NAMES, "transformer": [
        "flux-2-klein-4b.safetensors", NOBODY]})
    write_tiny_models(tmp_path / "wmodels", names=SHIPPED_NAMES)  # the workers lack the "nobody" transformer
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "keep.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (tmp_path / "output" / "portraits").mkdir(parents=True)
    (tmp_path / "output" / "portraits" / "mine.txt").write_text("a user's folder, not vramgraph's")
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


# slow: a broker, a frontend and two restarted workers through over 60 prompts (about 45 s on 2 cores); .ci/run runs it
@pytest.mark.slow
@pytest.mark.skipif(NO_CLIENT is not None, reason=str(NO_CLIENT))
def test_fleet_chaos(chaos_folder):
    folder = chaos_folder
    (folder / "rabbit").mkdir()
    rabbit = Rabbit(folder / "rabbit", user="fleet", password=PASSWORD)
    rabbit.start()
    before = tree(folder / "input", folder / "models", folder / "wmodels", folder / "output" / "portraits")
    workers = Supervisor(folder, rabbit.url)
    try:
        with serve_process(folder, "--broker", rabbit.url, "--frontend-id", "fe", env=ENV) as (url, _, log):
            wait_for("two live workers", lambda: len(fleet(url)["alive"]) == 2, 120)
            clients = Clients(url, list(CLIENTS))
            try:
                figures = _chaos(url, folder, rabbit, workers, clients)
            finally:
                clients.close()
            refused = unshared_frontend(folder, rabbit.url)
            logs = [log.read_text(errors="replace")]
    finally:
        workers.stop()
        rabbit.kill()
    logs += [(folder / f"{w}.log").read_text(errors="replace") for w in WORKERS] + [refused.stdout + refused.stderr]
    assert tree(folder / "input", folder / "models", folder / "wmodels", folder / "output" / "portraits") == before
    for text in logs:
        assert PASSWORD not in text and SECRET not in text, "a secret in a log"
    assert sum(t.count("dropped an unsigned or altered message") for t in logs) >= 3, "forged prompts not dropped"
    assert refused.returncode == 2 and "refusing to start" in refused.stderr and "cannot see" in refused.stderr, \
        refused.stderr[-2000:]
    poison_deaths = [e for e in workers.exits if e[1] == -signal.SIGKILL]
    figures["worker_deaths"] = len(poison_deaths)
    assert len(poison_deaths) == figures["poison_tries"] + 1, workers.exits  # the poison's, and the one we killed
    (folder / "figures.json").write_text(json.dumps(figures, indent=1))
    print("chaos figures:", json.dumps(figures))


def _chaos(url: str, folder: Path, rabbit: Rabbit, workers: Supervisor, clients: Clients) -> dict:
    from vramgraph.server.broker import TRIES

    t0 = time.monotonic()
    successes = Counter()
    clients.on_message = lambda c, m: successes.update([m["data"]["prompt_id"]]) if m["type"] == \
        "execution_success" else None

    # a prompt_id naming a folder that is not ours: refused at once, the folder untouched
    r = requests.post(url + "/prompt", json={"prompt": prompt("A", 1), "prompt_id": "portraits"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_prompt_id", r.text

    def submit(seed: int, client: str, transformer: str | None = None) -> str:
        p = prompt("A", seed)
        p["1"]["inputs"]["file"] = transformer or p["1"]["inputs"]["file"]
        r = requests.post(url + "/prompt", json={"prompt": p, "client_id": client}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["prompt_id"]

    pids, owner = [], {}
    poison = None
    for i in range(N):
        client = CLIENTS[i % 3]
        if i == 3:
            poison = submit(POISON_SEED, client)
            owner[poison] = client
        pid = submit(1000 + i, client)
        pids.append(pid)
        owner[pid] = client
    waiting = submit(7, "c3", transformer=NOBODY)
    key = next(k for k, models in fleet(url)["sets"].items() if "transformer:flux-2-klein-4b.safetensors" in models)
    forge(rabbit.url, key)

    # a worker killed by SIGKILL in the middle, while it runs prompts
    wait_for("20 prompts done", lambda: sum(successes.values()) >= 20, TIMEOUT)
    busy = None

    def some_busy() -> bool:
        nonlocal busy
        busy = next((w for w, p in fleet(url)["alive"].items() if p.get("busy")), None)
        return busy is not None

    wait_for("a busy worker", some_busy, 60)
    killed_at = sum(successes.values())
    workers.kill(busy)
    history = wait_done(url, [*pids, poison], TIMEOUT)
    seconds = time.monotonic() - t0

    for p in pids:
        h = history[p]
        assert h["status"]["status_str"] == "success", (p, h["status"])
        assert successes[p] == 1, f"{p} finished {successes[p]} times at its client"
        assert len(list((folder / "output" / p).rglob("*.png"))) == 1
        mine = [m for m in clients.messages[owner[p]]
                if isinstance(m["data"], dict) and m["data"].get("prompt_id") == p]
        starts = [i for i, m in enumerate(mine) if m["type"] == "execution_start"]
        retries = [i for i, m in enumerate(mine) if m["type"] == "vramgraph.retry"]
        assert len(retries) >= len(starts) - 1, f"{p} started again without a notice"
        for other in CLIENTS:
            if other != owner[p]:
                assert not any(p in json.dumps(m["data"]) for m in clients.messages[other]), f"{p} told to {other}"
    dead = history[poison]
    assert dead["status"]["status_str"] == "error"
    kind, error = dead["status"]["messages"][-1]
    assert kind == "execution_error" and error["exception_type"] == "PromptDeadLettered", dead["status"]
    assert f"after {TRIES} tries" in error["exception_message"]
    assert any(m["type"] == "execution_error" and m["data"].get("prompt_id") == poison
               for m in clients.messages[owner[poison]]), "the poison's client was not told"
    poison_retries = [m["data"]["try"] for m in clients.messages[owner[poison]]
                      if m["type"] == "vramgraph.retry" and m["data"].get("prompt_id") == poison]
    assert poison_retries == list(range(2, TRIES + 1)), poison_retries
    assert not list((folder / "output").rglob("*.part")), "a half-written image is left"

    wait_for("both workers back", lambda: len(fleet(url)["alive"]) == 2, 120)
    report = fleet(url)
    nobody = next(k for k, m in report["sets"].items() if f"transformer:{NOBODY}" in m)
    assert report["no_worker"] == [nobody], report
    assert waiting not in requests.get(url + "/history", timeout=30).json(), "a prompt no worker can run ran"
    assert report["dead_lettered"] == 1 and report["unshared"] == {}
    assert dead_count(rabbit.url) >= 1 + 3, "the poison and the forged prompts are kept in vramgraph.dead"
    for path in ("/system_stats", "/vramgraph/fleet", "/history", "/queue", "/api/jobs", "/prompt"):
        text = requests.get(url + path, timeout=30).text
        assert PASSWORD not in text and SECRET not in text, f"a secret in {path}"
    assert "***" in json.dumps(requests.get(url + "/system_stats", timeout=30).json()["system"]["argv"])
    retried = sum(1 for p in pids for m in clients.messages[owner[p]]
                  if m["type"] == "vramgraph.retry" and m["data"].get("prompt_id") == p)
    return {"prompts": N, "clients": len(CLIENTS), "workers": len(WORKERS), "seconds": round(seconds, 1),
            "killed_after_successes": killed_at, "poison_tries": TRIES, "retried_prompts": retried,
            "duplicates_ignored": report["duplicates"], "forged_dropped": 3,
            "resident_share": report["resident_share"], "results": report["results"]}

