"""Issue #40's findings, tried as an attacker and a careless operator would (CPU; the fleet's real-broker half is
tests/test_fleet_chaos.py): client-named folders, forged broker messages, secrets in answers and logs, image bombs,
and the single server's interrupt, JSON, upload and 500 findings."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from PIL import Image

UUID = "09549d7f-77c1-4933-9f16-ed2439ee4f4a"  # a uuid4 as ComfyUI clients make (fixed: one test list)
HOSTILE_IDS = ["..", ".", "", "../x", "/etc", "/", "a/b", "a\\b", ".hidden", "..\\..\\x", "~root", "x" * 65,
               "x" * 5000, "a\x00b", "a\nb", " lead", "ｐｏｒｔｒａｉｔｓ", "portraits\u200b",
               "pоrtraits",  # a Cyrillic о
               "C:", "a b", "$HOME", "*"]


def bomb_png(side: int = 13000) -> bytes:
    """A PNG of side x side pixels that compresses to a few tens of KB (1-bit pixels, all black)."""
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def png(size: int = 8, color: tuple[int, int, int] = (1, 2, 3)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ names are data


@pytest.mark.parametrize("pid", HOSTILE_IDS, ids=[repr(p)[:24] for p in HOSTILE_IDS])
def test_hostile_prompt_ids_are_refused(pid, tmp_path):
    from vramgraph.server.bodies import BadRequest, prompt_request
    from vramgraph.server.ids import BadId, check_prompt_id, claim

    with pytest.raises(BadId, match="a prompt_id is a UUID"):
        check_prompt_id(pid)
    with pytest.raises(BadRequest) as e:
        prompt_request({"prompt": {}, "prompt_id": pid})
    assert e.value.type == "invalid_prompt_id"
    with pytest.raises(BadId):
        claim(tmp_path / "output", pid)
    assert not (tmp_path / "output").exists() or not any((tmp_path / "output").iterdir())


@pytest.mark.parametrize("pid", [UUID, UUID.upper(), "portraits", "q-1", "job_2.a", "x" * 64])
def test_good_prompt_ids_pass(pid):
    from vramgraph.server.ids import check_prompt_id

    assert check_prompt_id(pid) == pid


def test_only_folders_we_made_are_emptied(tmp_path):
    """The worker's folder per prompt: made with a marker; emptied only when the marker names that prompt."""
    from vramgraph.server.ids import MARKER, NotOurs, claim, is_ours, taken_by_others

    out, outside = tmp_path / "output", tmp_path / "elsewhere"
    out.mkdir()
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    (out / "portraits").mkdir()
    (out / "portraits" / "me.png").write_bytes(b"mine")
    (out / "temp").mkdir()  # the temp folder lives in output/ by default
    (out / "link").symlink_to(outside, target_is_directory=True)
    (out / "broken").symlink_to(tmp_path / "nowhere")
    (out / "afile").write_text("a file")
    (out / "stolen").mkdir()
    (out / "stolen" / MARKER).write_text("someone-else")  # a marker copied from another prompt's folder
    (out / "linked-marker").mkdir()
    (out / "linked-marker" / MARKER).symlink_to(outside / "precious.txt")
    for name in ("portraits", "temp", "link", "broken", "afile", "stolen", "linked-marker"):
        assert taken_by_others(out, name), name
        with pytest.raises(NotOurs, match="left alone"):
            claim(out, name)
    assert (out / "portraits" / "me.png").read_bytes() == b"mine"
    assert (outside / "precious.txt").read_text() == "keep" and (out / "link").is_symlink()
    assert (out / "afile").read_text() == "a file"

    folder = claim(out, "p-1")  # ours: made, then emptied on the next attempt
    assert is_ours(out, "p-1") and not taken_by_others(out, "p-1")
    (folder / "vramgraph_00001_.png").write_bytes(b"first try")
    (folder / "sub").mkdir()
    (folder / "sub" / "escape").symlink_to(outside, target_is_directory=True)
    folder = claim(out, "p-1")
    assert sorted(p.name for p in folder.iterdir()) == [MARKER]
    assert (outside / "precious.txt").read_text() == "keep", "rmtree followed a link"


# ------------------------------------------------------------------------------------------ signed messages


def message(body: bytes, headers: dict, routing_key: str) -> SimpleNamespace:
    return SimpleNamespace(body=body, headers=headers, routing_key=routing_key)


def test_broker_messages_are_signed_and_checked():
    from vramgraph.server.signing import SIG, Signer

    s = Signer(b"fleet-secret-0123456789")
    body = json.dumps({"prompt_id": "p", "prompt": {}}).encode()
    headers = s.headers("setkey", body, {"vg": "prompt", "pid": "p"})
    assert s.valid(message(body, headers, "setkey"))
    assert s.valid(message(body, {**headers, "x-delivery-count": 2, "x-death": [{}]}, "setkey")), "broker headers"
    assert s.valid(message(body, {k: v.encode() if isinstance(v, str) else v for k, v in headers.items()}, "setkey"))
    assert not s.valid(message(body, {"vg": "prompt", "pid": "p"}, "setkey")), "unsigned"
    assert not s.valid(message(body.replace(b'"p"', b'"q"'), headers, "setkey")), "body altered"
    assert not s.valid(message(body, {**headers, "pid": "q"}, "setkey")), "a header altered"
    assert not s.valid(message(body, headers, "another-set")), "moved to another queue"
    assert not s.valid(message(body, {**headers, SIG: 5}, "setkey"))
    assert not Signer(b"another-secret-0123456789").valid(message(body, headers, "setkey")), "another secret"
    assert "fleet-secret" not in repr(s)


def test_secrets_are_required_and_never_shown(tmp_path, monkeypatch):
    from vramgraph.server.signing import SECRET_ENV, default_user_warning, read_secret, redact, redact_argv

    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=SECRET_ENV):
        read_secret()
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret()
    (tmp_path / "s").write_text("from-a-file-0123456789\nignored\n")
    assert read_secret(str(tmp_path / "s")) == "from-a-file-0123456789"
    with pytest.raises(ValueError, match="--broker-secret-file"):
        read_secret(str(tmp_path / "missing"))
    argv = ["vramgraph", "serve", "--broker", "amqp://fleet:pa%40ss@10.1.2.3:5672/vh", "--api-token", "t0k",
            "--broker-secret-file", "/etc/fleet.secret", "--db-password=pw"]
    shown = " ".join(redact_argv(argv))
    assert "pa%40ss" not in shown and "t0k" not in shown and "=pw" not in shown and "/etc/fleet.secret" in shown
    assert "amqp://fleet:***@10.1.2.3:5672/vh" in shown
    assert redact("error at amqp://u:hunter2@h/ (hunter2)", "hunter2") == "error at amqp://u:***@h/ (***)"
    assert "guest" in default_user_warning("amqp://guest:guest@10.0.0.5/")
    assert default_user_warning("amqp://10.0.0.5/") is not None, "no user given: RabbitMQ's guest"
    assert default_user_warning("amqp://guest:guest@127.0.0.1/") is None
    assert default_user_warning("amqp://fleet:pw@10.0.0.5/") is None


def test_system_stats_hides_the_broker_password(monkeypatch):
    import sys

    import torch
    from vramgraph.server.formats import system_stats

    engine = SimpleNamespace(device=torch.device("cpu"), budget=SimpleNamespace(to_json=lambda: {}), dtype="fp32")
    monkeypatch.setattr(sys, "argv", ["vramgraph", "serve", "--broker", "amqp://fleet:S3cr3tPw@h:5672/"])
    stats = json.dumps(system_stats(engine))
    assert "S3cr3tPw" not in stats and "amqp://fleet:***@h:5672/" in stats


def test_fleet_files_handshake_capability_and_missing_images(tmp_path):
    from vramgraph.server.fleet_files import can_run, handshake_problem, held_files, missing_outputs, write_handshake

    shared, other = tmp_path / "shared", tmp_path / "other"
    token = write_handshake(shared, "w1")
    assert handshake_problem(shared, "w1", token) is None
    assert "cannot see" in handshake_problem(other, "w1", token)
    assert "token differs" in handshake_problem(shared, "w1", "f" * 32)
    assert "no usable handshake" in handshake_problem(shared, "../w1", token)
    with pytest.raises(ValueError, match="--id"):
        write_handshake(shared, "../../etc/x")
    (tmp_path / "models" / "diffusion_models").mkdir(parents=True)
    (tmp_path / "models" / "diffusion_models" / "a.safetensors").write_bytes(b"x")
    files = held_files(SimpleNamespace(models=(tmp_path / "models", tmp_path / "none")))
    assert can_run(["transformer:a.safetensors"], files) and not can_run(["transformer:b.safetensors"], files)
    assert not can_run([], files)
    (shared / "p").mkdir()
    (shared / "p" / "x.png").write_bytes(b"x")
    entry = {"outputs": {"8": {"images": [{"filename": "x.png", "subfolder": "p", "type": "output"},
                                          {"filename": "y.png", "subfolder": "p", "type": "output"}]}}}
    assert missing_outputs(entry, SimpleNamespace(output=shared, temp=shared)) == ["p/y.png"]


# ------------------------------------------------------------------------------------------ image bombs


def test_image_bombs_are_refused_before_decoding(tmp_path):
    from vramgraph.nodes.files import Folders
    from vramgraph.nodes.images import MAX_IMAGE_PIXELS, ImageTooLarge, open_image
    from vramgraph.nodes.ops import load_image
    from vramgraph.server.security import uploaded_image_format

    data = bomb_png()
    assert len(data) < 100_000 and 13000 * 13000 > MAX_IMAGE_PIXELS
    (tmp_path / "bomb.png").write_bytes(data)
    with pytest.raises(ImageTooLarge, match="13000x13000"):
        load_image(str(tmp_path / "bomb.png"))
    with pytest.raises(ImageTooLarge, match="max_image_pixels"):
        uploaded_image_format(data)
    with pytest.raises(ImageTooLarge):
        uploaded_image_format(bomb_png(20000))  # over PIL's own limit too: refused the same way
    assert uploaded_image_format(png(), max_pixels=64) == "PNG"
    with pytest.raises(ImageTooLarge):
        uploaded_image_format(png(9), max_pixels=64)
    with open_image(data, 13000 * 13000) as im:  # the cap is the config's: raised, it is read
        assert im.size == (13000, 13000)
    assert Folders().max_image_pixels == MAX_IMAGE_PIXELS
    from vramgraph.graph.workflow.errors import WorkflowError
    from vramgraph.graph.workflow.parse import load_workflow

    with pytest.raises(WorkflowError, match="refused before decoding"):  # a PNG "workflow" that is a bomb
        load_workflow(tmp_path / "bomb.png")


def test_image_cap_comes_from_the_config(tmp_path):
    from vramgraph.graph.engine.runtime import Settings, folders_from

    (tmp_path / "c.json").write_text(json.dumps({"max_image_pixels": 1000}))
    assert folders_from(Settings(config=str(tmp_path / "c.json"))).max_image_pixels == 1000
    (tmp_path / "c.json").write_text(json.dumps({"max_image_pixels": "lots"}))
    with pytest.raises(ValueError, match="max_image_pixels"):
        folders_from(Settings(config=str(tmp_path / "c.json")))


# ------------------------------------------------------------------------------------------ a single server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes import ENGINE_NODES
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    tmp = tmp_path_factory.mktemp("hostile40")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    f = Folders(models=(tmp / "models",), input=tmp / "input", output=tmp / "output", temp=tmp / "temp")
    for d in (f.input, f.output, f.temp, tmp / "outside"):
        d.mkdir(parents=True)
    app = make_app(Engine(f, device="cpu", nodes=ENGINE_NODES), start_worker=False)
    with ServerThread(app) as srv:
        yield SimpleNamespace(url=srv.url, folders=f, tmp=tmp, app=app, worker=app[ROUTES].worker)


def error_type(r: requests.Response) -> str:
    body = r.json()
    assert set(body) == {"error", "node_errors"} and set(body["error"]) == {"type", "message", "details",
                                                                            "extra_info"}, body
    return body["error"]["type"]


@pytest.mark.parametrize("query", ["limit=%C2%B2", "offset=--5", "limit=%EF%BC%91", "offset=%C2%B9", "limit=-1",
                                   "limit=" + "9" * 40, "offset=" + "9" * 40])
def test_jobs_query_strings_answer_400(served, query):
    r = requests.get(f"{served.url}/api/jobs?{query}", timeout=30)
    assert r.status_code == 400, (query, r.status_code, r.text[:200])


def test_mask_uploads_answer_400(served):
    (served.folders.input / "orig.png").write_bytes(png(8))
    (served.folders.input / "bomb.png").write_bytes(bomb_png())
    ref = json.dumps({"filename": "orig.png", "type": "input"})
    broken = requests.post(served.url + "/upload/mask", data=b'--zz\r\nContent-Disposition: form-data; name="image"; '
                           b'filename="m.png"\r\n\r\nxx', headers={"Content-Type": "multipart/form-data; boundary=zz"},
                           timeout=30)
    assert broken.status_code == 400 and error_type(broken) == "invalid_request", broken.text
    for data, original, wanted in ((bomb_png(), "orig.png", "image_too_large"),
                                   (png(8), "bomb.png", "image_too_large"),
                                   (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "orig.png", "invalid_request")):
        r = requests.post(served.url + "/upload/mask", files={"image": ("m.png", data, "image/png")},
                          data={"original_ref": json.dumps({"filename": original, "type": "input"})}, timeout=30)
        assert r.status_code == 400 and error_type(r) == wanted, r.text
    r = requests.post(served.url + "/upload/mask", files={"image": ("m.png", png(8), "image/png")},
                      data={"original_ref": ref.replace("}", ', "x": 1e999}')}, timeout=30)
    assert r.status_code == 400


def test_uploads_never_follow_links_nor_replace_outputs(served):
    outside = served.tmp / "outside" / "target.png"
    outside.write_bytes(b"not to be touched")
    link = served.folders.input / "link.png"
    link.symlink_to(outside)
    r = requests.post(served.url + "/upload/image", files={"image": ("link.png", png(8), "image/png")},
                      data={"overwrite": "true"}, timeout=30)
    assert r.status_code == 200 and r.json()["name"] == "link (1).png", r.text
    assert outside.read_bytes() == b"not to be touched" and link.is_symlink()
    generated = served.folders.output / "gen.png"
    generated.write_bytes(png(8, (9, 9, 9)))
    r = requests.post(served.url + "/upload/image", files={"image": ("gen.png", png(8), "image/png")},
                      data={"overwrite": "true", "type": "output"}, timeout=30)
    assert r.status_code == 200 and r.json()["name"] == "gen (1).png", r.text
    assert generated.read_bytes() == png(8, (9, 9, 9))
    r = requests.post(served.url + "/upload/image", files={"image": ("big.png", bomb_png(), "image/png")}, timeout=30)
    assert r.status_code == 400 and error_type(r) == "image_too_large" and "13000x13000" in r.json()["error"]["details"]
    assert not (served.folders.input / "big.png").exists()
    same = requests.post(served.url + "/upload/image", files={"image": ("fresh.png", png(8), "image/png")},
                         data={"overwrite": "true"}, timeout=30)
    assert same.status_code == 200 and (served.folders.input / "fresh.png").read_bytes() == png(8)


def test_a_bomb_in_input_is_refused_when_planned(served):
    """LoadImage's estimate reads the image's header: the plan (a fleet frontend's POST /prompt, a worker's run,
    /vramgraph/plan) refuses the bomb before any pixel is decoded, naming the node's file and the cap."""
    (served.folders.input / "bomb.png").write_bytes(bomb_png())
    prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": "bomb.png"}},
              "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "b"}}}
    r = requests.post(served.url + "/vramgraph/plan", json={"prompt": prompt}, timeout=60)
    assert r.status_code == 400, r.text
    assert "13000x13000" in r.text and "max_image_pixels" in r.text and "bomb.png" in r.text


def test_non_finite_numbers_are_refused_everywhere(served):
    prompt = json.loads((Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json").read_text())
    body = json.dumps({"prompt": prompt, "extra_data": {"x": 1.5}}).replace("1.5", "1e999")
    r = requests.post(served.url + "/prompt", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and error_type(r) == "invalid_json" and "infinity" in r.text
    for path in ("/vramgraph/plan", "/queue", "/history", "/free", "/interrupt"):
        r = requests.post(served.url + path, data='{"x": [-1E400]}', headers={"Content-Type": "application/json"},
                          timeout=30)
        assert r.status_code == 400, path

    def refuse(constant: str) -> None:
        raise AssertionError(f"invalid JSON: {constant}")

    for path in ("/api/jobs", "/queue", "/history"):
        json.loads(requests.get(served.url + path, timeout=30).text, parse_constant=refuse)


def test_batch_messages_name_only_the_clients_own_prompts(served):
    """Two clients' prompts planned as one batch: each client's messages name its own prompts only."""
    import aiohttp

    base = json.loads((Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json").read_text())
    base["5"]["inputs"].update(width=32, height=32)
    base["6"]["inputs"]["steps"] = 1

    async def main() -> tuple[dict[str, list[str]], dict[str, list[dict]]]:
        async with aiohttp.ClientSession() as s:
            sockets = {c: await s.ws_connect(f"{served.url.replace('http', 'ws')}/ws?clientId={c}") for c in "ab"}
            for ws in sockets.values():
                await ws.receive_json(timeout=30)
            pids: dict[str, list[str]] = {"a": [], "b": []}
            for i in range(4):
                c = "ab"[i % 2]
                async with s.post(served.url + "/prompt", json={"prompt": base, "client_id": c}) as r:
                    pids[c].append((await r.json())["prompt_id"])
            served.worker.start()
            seen: dict[str, list[dict]] = {"a": [], "b": []}
            for c, ws in sockets.items():
                left = set(pids[c])
                while left:
                    m = await ws.receive_json(timeout=120)
                    seen[c].append(m)
                    if m["type"] == "executing" and m["data"]["node"] is None:
                        left.discard(m["data"]["prompt_id"])
            return pids, seen

    pids, seen = asyncio.run(main())
    plans = [m for m in seen["a"] if m["type"] == "vramgraph.plan"]
    assert plans and all(sorted(m["data"]["prompt_ids"]) == sorted(pids["a"]) for m in plans), "one batch, a's own"
    for c, other in (("a", "b"), ("b", "a")):
        text = json.dumps(seen[c])
        assert not any(p in text for p in pids[other]), f"client {c} was told of {other}'s prompts"
    history = requests.get(served.url + "/history", timeout=30).json()
    assert sorted(history[pids["b"][0]]["vramgraph"]["batch"]["prompt_ids"]) == sorted(pids["b"])



# ------------------------------------------------------------------------------------------ a worker's intake


class FakeMessage(SimpleNamespace):
    """What aio-pika's basic.get gives a worker: body, headers, routing key, reply_to, and ack/reject."""

    async def ack(self) -> None:
        self.outcome = "ack"

    async def reject(self, requeue: bool = False) -> None:
        self.outcome = f"reject(requeue={requeue})"


def test_a_worker_checks_every_message_before_it_touches_a_folder(tmp_path):
    """Signed by the fleet or dropped (dead-lettered); a bad id dropped; a folder that is not ours refused with an
    error its client sees; a prompt that comes back announced; nothing outside the prompt's own folder touched."""
    from vramgraph.nodes import ENGINE_NODES
    from vramgraph.nodes.files import Folders
    from vramgraph.server.broker import FRONTEND_QUEUE
    from vramgraph.server.fleet_worker import FleetWorker
    from vramgraph.server.ids import MARKER
    from vramgraph.server.signing import Signer

    out = tmp_path / "output"
    (out / "portraits").mkdir(parents=True)
    (out / "portraits" / "me.png").write_bytes(b"mine")
    engine = SimpleNamespace(folders=Folders(output=out), nodes=ENGINE_NODES,
                             ledger=SimpleNamespace(events=[], on_gpu={}))
    signer = Signer(b"fleet-secret-0123456789")
    fleet = FleetWorker(engine, "amqp://127.0.0.1:1/", signer=signer, ident="w1")
    prompt = json.loads((Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json").read_text())

    def msg(pid: str, key: str = "k", sign: Signer | None = signer, tries: int = 0, reply: str = FRONTEND_QUEUE + "fe",
            prefix: str = "x"):
        p = {**prompt, "8": {**prompt["8"], "inputs": {**prompt["8"]["inputs"], "filename_prefix": prefix}}}
        body = json.dumps({"number": 1, "prompt_id": pid, "prompt": p, "extra_data": {"client_id": "c"},
                           "outputs": ["8"]}).encode()
        headers = sign.headers(key, body, {"vg": "prompt"}) if sign else {"vg": "prompt"}
        return FakeMessage(body=body, headers={**headers, "x-delivery-count": tries}, routing_key=key,
                           reply_to=reply, redelivered=tries > 0, outcome=None)

    async def main() -> dict:
        fleet._outbox = asyncio.Queue()
        results = {}
        for name, m in {"unsigned": msg("p1", sign=None), "wrong secret": msg("p2", sign=Signer(b"x" * 20)),
                        "moved": msg("p3", key="other"), "bad id": msg(".."), "empty id": msg(""),
                        "foreign reply": msg("p4", reply="amq.gen-x"), "not ours": msg("portraits"),
                        "prefix out": msg("p7", prefix="../portraits/x"),
                        "fine": msg("p5"), "again": msg("p6", tries=1)}.items():
            if name == "moved":
                m.routing_key = "k"  # signed for "other", found in "k"
            item = await fleet._admit(m, "k", [])
            results[name] = (item is not None, m.outcome)
        sent = []
        while not fleet._outbox.empty():
            kind, _, body, *_ = fleet._outbox.get_nowait()
            sent.append((kind, json.loads(body)))
        return {"results": results, "sent": sent}

    got = asyncio.run(main())
    dropped = (False, "reject(requeue=False)")
    assert got["results"] == {"unsigned": dropped, "wrong secret": dropped, "moved": dropped, "bad id": dropped,
                              "empty id": dropped, "foreign reply": dropped, "not ours": (False, None),
                              "prefix out": (False, None), "fine": (True, None), "again": (True, None)}
    assert fleet.dropped == 3
    kinds = [(k, b.get("kind") or b["entry"]["status"]["status_str"]) for k, b in got["sent"]]
    assert kinds == [("event", "execution_error"), ("result", "error")] * 2 + [("event", "vramgraph.retry")], kinds
    assert "portraits" in got["sent"][0][1]["data"]["exception_message"]
    assert "filename_prefix" in got["sent"][2][1]["data"]["exception_message"]
    assert got["sent"][4][1]["data"]["try"] == 2
    assert (out / "portraits" / "me.png").read_bytes() == b"mine" and not (out / "portraits" / MARKER).exists()
    assert sorted(p.name for p in out.iterdir()) == [".vramgraph-fleet", "p5", "p6", "portraits"]
