"""A load run against a real `vramgraph serve` process (loopback, a free port, temporary folders, tiny models).

8 clients, each on its own websocket with its own clientId, queue 25 text-to-image prompts each (64x64, one
step) while the server works; some of their pending prompts are deleted from /queue, some running ones are
interrupted by id. Then: no prompt lost, none run twice, each prompt's events in ComfyUI's order and only on its
own client's socket, every interrupted prompt one that was asked to stop (and it alone: the prompts batched with
it finish), every deleted prompt never run, and /history and the saved PNGs agree with the events.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from serving import serve_process

ROOT = Path(__file__).resolve().parents[1]
CLIENTS, PER_CLIENT = 8, 25
DELETE_EVERY, INTERRUPT_EVERY = 6, 7  # prompt i of a client is deleted when i % 6 == 5, interrupted when i % 7 == 3
START_TIMEOUT, RUN_TIMEOUT = 120, 600  # bounds, not expectations: the run takes well under a minute alone
ENDS = ("execution_success", "execution_interrupted", "execution_error")


def _prompt(client: int, i: int) -> dict:
    prompt = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompt["4"]["inputs"]["text"] = "a load test"  # one encode, shared in each batch and cached across them
    prompt["5"]["inputs"].update(width=64, height=64)
    prompt["6"]["inputs"].update(steps=1, seed=client * 100 + i)
    prompt["8"]["inputs"]["filename_prefix"] = f"load/c{client}_p{i}"
    return prompt


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`python -m vramgraph serve` on a free loopback port over tiny models, stopped at the end."""
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models

    tmp = tmp_path_factory.mktemp("load")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    # one compute thread: on 2 shared cores more threads only wait for each other (16 tiny 64x64 images: 3.5 s with
    # one thread, 40 s with two, measured beside other jobs)
    with serve_process(tmp, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, timeout=START_TIMEOUT) as (url, _, _):
        yield url, tmp


async def _client(url: str, c: int, all_pids: set[str]) -> dict[str, Any]:
    """One client: its websocket, its 25 prompts, its deletes and interrupts; everything it saw."""
    import aiohttp

    sid = f"load-client-{c}"
    seen: dict[str, list[dict]] = {}
    stray: list[dict] = []
    deleted, kept_running, targeted = set(), set(), set()
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId={sid}") as ws:
        first = await ws.receive_json(timeout=30)
        assert first["type"] == "status" and first["data"]["sid"] == sid
        mine: list[str] = []
        waiting: set[str] = set()
        for i in range(PER_CLIENT):
            pid = f"load-{c}-{i}"
            async with s.post(url + "/prompt", json={"prompt": _prompt(c, i), "client_id": sid,
                                                     "prompt_id": pid}) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["prompt_id"] == pid
            mine.append(pid)
            all_pids.add(pid)
            if i % INTERRUPT_EVERY == 3:
                targeted.add(pid)
            if i % DELETE_EVERY == 5:
                async with s.post(url + "/queue", json={"delete": [pid]}) as r:
                    assert r.status == 200
                # deleted unless the worker had taken it already: a taken prompt is running or in the history
                async with s.get(url + "/queue") as r:
                    q = await r.json()
                listed = {e[1] for e in q["queue_running"] + q["queue_pending"]}
                async with s.get(f"{url}/history/{pid}") as r:
                    done = pid in await r.json()
                (kept_running if pid in listed or done else deleted).add(pid)
                assert pid not in {e[1] for e in q["queue_pending"]}, "a deleted prompt stays pending"
            if pid not in deleted:
                waiting.add(pid)
            await asyncio.sleep(0)
        while waiting:
            m = await ws.receive(timeout=RUN_TIMEOUT)
            if m.type != aiohttp.WSMsgType.TEXT:
                continue
            msg = json.loads(m.data)
            pid = msg["data"].get("prompt_id") if isinstance(msg["data"], dict) else None
            if pid is None or msg["type"] == "vramgraph.plan":  # a batch's plan names its first prompt here
                continue
            if pid not in mine:
                stray.append(msg)
                continue
            seen.setdefault(pid, []).append(msg)
            if msg["type"] == "execution_start" and pid in targeted:
                async with s.post(url + "/interrupt", json={"prompt_id": pid}) as r:
                    assert r.status == 200
            if msg["type"] == "executing" and msg["data"]["node"] is None:
                waiting.discard(pid)
    return {"mine": mine, "seen": seen, "stray": stray, "deleted": deleted, "kept": kept_running,
            "targeted": targeted}


async def _run(url: str) -> list[dict[str, Any]]:
    all_pids: set[str] = set()
    return await asyncio.wait_for(asyncio.gather(*(_client(url, c, all_pids) for c in range(CLIENTS))),
                                  RUN_TIMEOUT)


@pytest.mark.slow  # 8 clients and 25 prompts on one server, end to end (about 20 s of CPU): `pytest -m slow`
def test_load_8_clients_25_prompts_with_deletes_and_interrupts(serve):
    import requests

    url, tmp = serve
    t0 = time.monotonic()
    results = asyncio.run(_run(url))
    seconds = time.monotonic() - t0
    history = requests.get(url + "/history", timeout=60).json()
    assert requests.get(url + "/queue", timeout=10).json() == {"queue_running": [], "queue_pending": []}
    outcomes = {"execution_success": 0, "execution_interrupted": 0}
    for res in results:
        assert not res["stray"], "a client got events of another client's prompt"
        for pid in res["deleted"]:
            assert pid not in res["seen"] and pid not in history, f"deleted {pid} ran"
        for pid in res["mine"]:
            if pid in res["deleted"]:
                continue
            seq = res["seen"].get(pid, [])
            kinds = [m["type"] for m in seq]
            assert kinds, f"{pid} lost"
            assert kinds[0] == "execution_start" and kinds.count("execution_start") == 1, (pid, kinds)
            assert kinds[1] == "execution_cached", (pid, kinds)
            assert seq[-1]["type"] == "executing" and seq[-1]["data"]["node"] is None, (pid, kinds)
            assert sum(k in ENDS for k in kinds) == 1 and kinds[-2] in ENDS, (pid, kinds)
            assert sum(1 for m in seq if m["type"] == "executing" and m["data"]["node"] is None) == 1, (pid, kinds)
            end = kinds[-2]
            assert end != "execution_error", (pid, seq[-2]["data"])
            if end == "execution_interrupted":
                assert pid in res["targeted"], f"{pid} was interrupted without being asked"
            else:
                executed = [m["data"]["node"] for m in seq if m["type"] == "executed"]
                assert executed == ["8"], (pid, kinds)
            outcomes[end] += 1
            entry = history[pid]
            assert entry["status"]["status_str"] == ("success" if end == "execution_success" else "error")
            assert entry["status"]["messages"][-1][0] == end and entry["prompt"][1] == pid
            images = entry["outputs"].get("8", {}).get("images", [])
            assert len(images) == (end == "execution_success")
            for im in images:
                assert (tmp / "output" / im["subfolder"] / im["filename"]).is_file()
                assert im["filename"].startswith(f"c{pid.split('-')[1]}_p{pid.split('-')[2]}_")
    ran = sum(outcomes.values())
    total = CLIENTS * PER_CLIENT
    deleted = sum(len(r["deleted"]) for r in results)
    assert ran + deleted == total, "every prompt ran once or was deleted"
    assert len(history) == ran
    pngs = list((tmp / "output" / "load").glob("*.png"))
    assert len(pngs) == outcomes["execution_success"], "one image per finished prompt, none twice"
    assert outcomes["execution_interrupted"] >= 1 and deleted >= 1
    assert not list((tmp / "output").rglob("*.part"))
    print(f"\nload: {total} prompts from {CLIENTS} clients in {seconds:.1f} s: {outcomes['execution_success']} done, "
          f"{outcomes['execution_interrupted']} interrupted, {deleted} deleted, "
          f"{sum(len(r['kept']) for r in results)} deletes too late")
