"""The local server against ComfyUI's API: an unchanged client library from PyPI, the websocket events,
the queue, history, files (never outside their folders), object_info, and our plan routes.

Runs on the CPU with tiny random-weight models under the shipped workflows' file names.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from PIL import Image
from vramgraph.nodes import ENGINE_NODES
from vramgraph.nodes.types import INT, Cost

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120


class TestSlow:
    """An output node that counts slowly and reports progress (test only)."""

    CATEGORY = "test"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"steps": (INT, {"default": 5, "min": 1, "max": 1000})}, "hidden": {"vg": "VG_CONTEXT"}}

    @classmethod
    def vg_estimate(cls, env: Any, steps: int) -> Cost:
        return Cost(())

    def run(self, steps: int, vg: Any = None) -> dict:
        for i in range(steps):
            time.sleep(0.05)
            vg.progress(i + 1, steps)
        return {"ui": {"text": [str(steps)]}}


class TestBoom(TestSlow):
    def run(self, steps: int, vg: Any = None) -> dict:
        raise RuntimeError(f"boom after {steps}")


class TestHold:
    """Passes its images on after reporting progress `steps` times, 0.02 s apart (test only): a prompt that is
    certainly still running when a test sees its first progress report."""

    CATEGORY = "test"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"images": ("IMAGE",), "steps": (INT, {"default": 5, "min": 1, "max": 100000})},
                "hidden": {"vg": "VG_CONTEXT"}}

    @classmethod
    def vg_estimate(cls, env: Any, images: Any, steps: int) -> Cost:
        return Cost((images,))

    def run(self, images: Any, steps: int, vg: Any = None) -> tuple:
        for i in range(steps):
            vg.progress(i + 1, steps)
            time.sleep(0.02)
        return (images,)


NODES = {**ENGINE_NODES, "TestSlow": TestSlow, "TestBoom": TestBoom, "TestHold": TestHold}


def text_to_image(size: int = 64, steps: int = 2) -> dict:
    prompt = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompt["5"]["inputs"].update(width=size, height=size)
    prompt["6"]["inputs"]["steps"] = steps
    return prompt


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders

    tmp = tmp_path_factory.mktemp("server")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    f = Folders(models=(tmp / "models",), input=tmp / "input", output=tmp / "output", temp=tmp / "temp")
    for d in (f.input, f.output, f.temp):
        d.mkdir(parents=True)
    (tmp / "secret.txt").write_text("not for the web")
    return f


@pytest.fixture(scope="module")
def server(folders):
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ServerThread, make_app

    with ServerThread(make_app(Engine(folders, nodes=NODES))) as srv:
        yield srv


def wait_history(url: str, pid: str, whole_run: bool = False) -> dict:
    """The prompt's history entry once it has one; with `whole_run`, once its report is the whole batch's (a batch
    member's entry first holds the run so far, marked "partial", and the batch's end replaces it)."""
    end = time.monotonic() + TIMEOUT
    while time.monotonic() < end:
        h = requests.get(f"{url}/history/{pid}", timeout=10).json()
        if h and not (whole_run and "partial" in h[pid].get("vramgraph", {})):
            return h[pid]
        time.sleep(0.1)
    raise AssertionError(f"prompt {pid} did not finish" + (" its whole run" if whole_run else ""))


def post(url: str, path: str, body: Any) -> requests.Response:
    return requests.post(url + path, json=body, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------ a real client


def test_comfyui_client_library_gets_the_image(server):
    """comfy-api-simplified, unchanged: queue the workflow, wait on /ws, read /history, fetch /view."""
    if os.environ.get("CI"):  # CI installs the test extras: a missing client is a failure there
        import comfy_api_simplified as client
    else:
        client = pytest.importorskip("comfy_api_simplified", reason="pip install comfy-api-simplified (test extra)")
    ComfyApiWrapper, ComfyWorkflowWrapper = client.ComfyApiWrapper, client.ComfyWorkflowWrapper

    api = ComfyApiWrapper(server.url)
    wf = ComfyWorkflowWrapper(text_to_image())
    wf.set_node_param("Sampler", "seed", 7)
    images = api.queue_and_wait_images(wf, "Save")
    assert len(images) == 1
    (name, data), = images.items()
    assert name.startswith("text_to_image_") and name.endswith(".png")
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == (64, 64)
        assert im.text["prompt"] and json.loads(im.text["prompt"])["6"]["inputs"]["seed"] == 7
        assert len(im.convert("RGB").getcolors(1 << 16)) > 50
    # the same workflow again: every node cached, and the client still gets the image (ComfyUI re-sends it)
    assert api.queue_and_wait_images(wf, "Save") == images
    assert api.get_queue() == {"queue_running": [], "queue_pending": []}
    assert "devices" in api.get_system_stats()
    assert api.get_object_info("VGSampler")["VGSampler"]["category"] == "vramgraph"


# ------------------------------------------------------------------------------------------ websocket


async def _run_ws(url: str, body: dict, until: str = "executing_none") -> tuple[list, list[bytes], dict]:
    import aiohttp

    client = body["client_id"]
    msgs: list = []
    frames: list[bytes] = []
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId={client}") as ws:
        first = await ws.receive_json(timeout=10)
        async with s.post(url + "/prompt", json=body) as r:
            answer = await r.json()
        pid = answer["prompt_id"]
        msgs.append(first)
        while True:
            m = await ws.receive(timeout=TIMEOUT)
            if m.type == aiohttp.WSMsgType.BINARY:
                frames.append(m.data)
                continue
            msg = json.loads(m.data)
            msgs.append(msg)
            if msg["type"] == "executing" and msg["data"]["node"] is None and msg["data"]["prompt_id"] == pid:
                return msgs, frames, answer


def test_websocket_events_in_comfyui_order(server):
    body = {"prompt": text_to_image(), "client_id": "events-test", "extra_data": {"preview_method": "auto"}}
    msgs, frames, answer = asyncio.run(_run_ws(server.url, body))
    pid = answer["prompt_id"]
    assert len(frames) == 2, "one preview frame per sampling step"
    for frame in frames:  # ComfyUI's binary preview: event 1, format 2 (PNG), the PNG
        assert struct.unpack(">II", frame[:8]) == (1, 2)
        with Image.open(io.BytesIO(frame[8:])) as im:
            assert im.format == "PNG" and im.size == (8, 8)
    assert msgs[0]["type"] == "status" and msgs[0]["data"]["sid"] == "events-test"
    kinds = [m["type"] for m in msgs]
    for kind in ("execution_start", "vramgraph.plan", "executing", "progress", "executed", "execution_success"):
        assert kind in kinds, kind
    assert kinds.index("execution_start") < kinds.index("vramgraph.plan") < kinds.index("executing") \
        < kinds.index("execution_success")
    assert all(m["data"].get("prompt_id") == pid for m in msgs if m["type"] not in ("status",))
    plan = next(m["data"] for m in msgs if m["type"] == "vramgraph.plan")
    assert plan["timeline"]["budget"] > 0 and len(plan["timeline"]["steps"]) == len(plan["plan"]["steps"])
    assert plan["svg"].count('class="step"') == len(plan["plan"]["steps"])  # the picture, drawn by the server
    steps = [m["data"] for m in msgs if m["type"] == "vramgraph.step"]  # none when an earlier test left them loaded
    assert all(d["kind"] in ("load", "unload") and plan["plan"]["steps"][d["step"]]["kind"] == d["kind"]
               for d in steps)
    executed = [m["data"] for m in msgs if m["type"] == "executed"]
    assert [d["node"] for d in executed] == ["8"] and executed[0]["output"]["images"][0]["type"] == "output"
    progress = [m["data"] for m in msgs if m["type"] == "progress"]
    assert progress[-1] == {"node": "6", "value": 2, "max": 2, "prompt_id": pid}
    # the end is announced after the history is written, and status shows the queue empty
    end = kinds.index("execution_success")
    assert any(m["type"] == "status" and m["data"]["status"]["exec_info"]["queue_remaining"] == 0
               for m in msgs[end:])
    assert requests.get(f"{server.url}/history/{pid}", timeout=10).json()[pid]["status"]["completed"]


def test_second_run_is_cached(server):
    body = {"prompt": {"1": {"class_type": "TestSlow", "inputs": {"steps": 3}}}, "client_id": "cache-test"}
    msgs, _, _ = asyncio.run(_run_ws(server.url, body))
    assert [m["data"]["value"] for m in msgs if m["type"] == "progress"] == [1, 2, 3]
    # the same prompt again: every node cached, nothing executed
    msgs, frames, _ = asyncio.run(_run_ws(server.url, body))
    cached = [m["data"]["nodes"] for m in msgs if m["type"] == "execution_cached"]
    assert cached == [["1"]] and not frames
    assert [m["data"]["output"] for m in msgs if m["type"] == "executed"] == [{"text": ["3"]}]


# ------------------------------------------------------------------------------------------ /prompt


def test_validation_errors_as_comfyui_returns_them(server):
    bad = text_to_image()
    bad["6"]["inputs"]["steps"] = "many"
    bad["4"]["inputs"]["text_encoder"] = ["99", 0]
    r = post(server.url, "/prompt", {"prompt": bad})
    assert r.status_code == 400
    body = r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert set(body["node_errors"]) == {"4", "6"}
    assert body["node_errors"]["6"]["errors"][0]["type"] == "invalid_input_type"
    assert body["node_errors"]["6"]["dependent_outputs"] == ["8"]
    assert body["node_errors"]["6"]["class_type"] == "VGSampler"
    r = post(server.url, "/prompt", {"prompt": {"1": {"class_type": "NoSuchNode", "inputs": {}}}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "missing_node_type"
    r = post(server.url, "/prompt", {"client_id": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "no_prompt"
    assert requests.get(server.url + "/prompt", timeout=10).json() == {"exec_info": {"queue_remaining": 0}}


def test_execution_error_reaches_history(server):
    r = post(server.url, "/prompt", {"prompt": {"5": {"class_type": "TestBoom", "inputs": {"steps": 2}}},
                                     "prompt_id": "boom-1"})
    assert r.status_code == 200 and r.json()["prompt_id"] == "boom-1"
    entry = wait_history(server.url, "boom-1")
    assert entry["status"]["status_str"] == "error" and entry["status"]["completed"] is False
    kind, data = entry["status"]["messages"][-1]
    assert kind == "execution_error"
    assert data["node_id"] == "5" and data["node_type"] == "TestBoom" and "boom after 2" in data["exception_message"]
    assert data["prompt_id"] == "boom-1" and data["exception_type"] == "RuntimeError"


def test_history_entry_shape(server):
    r = post(server.url, "/prompt", {"prompt": text_to_image(), "client_id": "h",
                                     "extra_data": {"extra_pnginfo": {"workflow": {"nodes": []}}}})
    pid, number = r.json()["prompt_id"], r.json()["number"]
    entry = wait_history(server.url, pid)
    assert entry["prompt"][:2] == [number, pid] and entry["prompt"][4] == ["8"]
    assert entry["prompt"][3]["client_id"] == "h"
    assert list(entry["outputs"]) == ["8"]
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    assert entry["status"]["messages"][0][0] == "execution_start"
    assert entry["status"]["messages"][-1][0] == "execution_success"
    assert entry["meta"]["8"]["node_id"] == "8"
    report = entry["vramgraph"]
    assert report["plan"]["steps"] and {n["node"] for n in report["nodes"]} >= {"6", "7"}
    assert all({"predicted_bytes", "measured_bytes", "seconds"} <= set(n) for n in report["nodes"])
    everything = requests.get(server.url + "/history", timeout=10).json()
    assert pid in everything
    assert len(requests.get(server.url + "/history?max_items=1", timeout=10).json()) == 1
    image = entry["outputs"]["8"]["images"][0]
    with Image.open(io.BytesIO(requests.get(server.url + "/view", params=image, timeout=10).content)) as im:
        assert im.size == (64, 64)
    assert requests.post(server.url + "/history", json={"delete": [pid]}, timeout=10).status_code == 200
    assert requests.get(f"{server.url}/history/{pid}", timeout=10).json() == {}


def test_queue_listing_ordering_delete_clear_and_interrupt(server):
    url = server.url
    slow = {"1": {"class_type": "TestSlow", "inputs": {"steps": 200}}}
    running = post(url, "/prompt", {"prompt": slow, "prompt_id": "q-run"}).json()
    end = time.monotonic() + TIMEOUT
    while not requests.get(url + "/queue", timeout=10).json()["queue_running"] and time.monotonic() < end:
        time.sleep(0.05)
    ids = [post(url, "/prompt", {"prompt": {"1": {"class_type": "TestSlow", "inputs": {"steps": 1 + i}}},
                                 "prompt_id": f"q-{i}"}).json()["prompt_id"] for i in range(3)]
    front = post(url, "/prompt", {"prompt": {"1": {"class_type": "TestSlow", "inputs": {"steps": 9}}},
                                  "front": True, "prompt_id": "q-front"}).json()
    q = requests.get(url + "/queue", timeout=10).json()
    assert [e[1] for e in q["queue_running"]] == [running["prompt_id"]]
    assert [e[1] for e in q["queue_pending"]] == ["q-front", *ids]
    assert front["number"] < 0 and len(q["queue_pending"][0]) == 5
    assert requests.get(url + "/prompt", timeout=10).json()["exec_info"]["queue_remaining"] == 5
    assert requests.post(url + "/queue", json={"delete": ["q-1"]}, timeout=10).status_code == 200
    assert [e[1] for e in requests.get(url + "/queue", timeout=10).json()["queue_pending"]] == ["q-front", "q-0",
                                                                                                 "q-2"]
    requests.post(url + "/queue", json={"clear": True}, timeout=10)
    assert requests.get(url + "/queue", timeout=10).json()["queue_pending"] == []
    assert requests.post(url + "/interrupt", json={"prompt_id": "someone-else"}, timeout=10).status_code == 200
    time.sleep(0.2)
    assert requests.get(url + "/queue", timeout=10).json()["queue_running"], "another prompt's id stops nothing"
    assert requests.post(url + "/interrupt", timeout=10).status_code == 200
    entry = wait_history(url, "q-run")
    assert entry["status"]["status_str"] == "error"
    kind, data = entry["status"]["messages"][-1]
    assert kind == "execution_interrupted" and data["node_id"] == "1" and data["node_type"] == "TestSlow"


# ------------------------------------------------------------------------------------------ files


def test_view_never_leaves_its_folders(server, folders):
    url = server.url
    (folders.output / "sub").mkdir(exist_ok=True)
    Image.new("RGB", (4, 4), (0, 255, 0)).save(folders.output / "sub" / "ok.png")
    (folders.temp / "t.png").write_bytes((folders.output / "sub" / "ok.png").read_bytes())
    (folders.output / "link.txt").symlink_to(folders.output.parent / "secret.txt")
    assert requests.get(url + "/view", params={"filename": "ok.png", "subfolder": "sub"}, timeout=10).status_code == 200
    assert requests.get(url + "/view", params={"filename": "t.png", "type": "temp"}, timeout=10).status_code == 200
    r = requests.get(url + "/view", params={"filename": "ok.png", "subfolder": "sub", "preview": "webp;50"},
                     timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"] == "image/webp"
    attempts = [
        {"filename": "../secret.txt"}, {"filename": "secret.txt", "subfolder": ".."},
        {"filename": "secret.txt", "subfolder": "../"}, {"filename": "passwd", "subfolder": "/etc"},
        {"filename": "/etc/passwd"}, {"filename": "..", "subfolder": ""}, {"filename": "secret.txt", "type": "models"},
        {"filename": "ok.png", "subfolder": "sub/../../"}, {"filename": "link.txt"},
        {"filename": "secret.txt", "subfolder": "%2e%2e"}, {"filename": "..\\secret.txt"},
        {"filename": "secret.txt", "type": "../"}, {"filename": ""},
    ]
    for params in attempts:
        r = requests.get(url + "/view", params=params, timeout=10)
        assert r.status_code in (400, 403, 404), (params, r.status_code)
        assert b"not for the web" not in r.content
    raw = requests.get(url + "/view?filename=secret.txt&subfolder=..%2F", timeout=10)
    assert raw.status_code in (400, 403, 404)
    for path in ("/view/../secret.txt", "/web/../secret.txt", "/web/%2e%2e/secret.txt", "/web/..%2Fserver.py"):
        r = requests.get(url + path, timeout=10)
        assert r.status_code in (400, 403, 404) and b"not for the web" not in r.content, path
    assert requests.get(url + "/no/such/route", timeout=10).status_code == 404


def test_upload_image(server, folders):
    url = server.url
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buf, format="PNG")
    data = buf.getvalue()

    def upload(name: str, payload: bytes = data, **fields: str) -> requests.Response:
        return requests.post(url + "/upload/image", files={"image": (name, payload, "image/png")}, data=fields,
                             timeout=10)

    r = upload("ref.png")
    assert r.status_code == 200 and r.json() == {"name": "ref.png", "subfolder": "", "type": "input"}
    assert (folders.input / "ref.png").read_bytes() == data
    assert upload("ref.png").json()["name"] == "ref.png", "the same image again is not copied"
    other = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 0, 0)).save(other, format="PNG")
    assert upload("ref.png", other.getvalue()).json()["name"] == "ref (1).png"
    assert upload("ref.png", other.getvalue(), overwrite="true").json()["name"] == "ref.png"
    assert upload("x.png", subfolder="refs", type="temp").json() == {"name": "x.png", "subfolder": "refs",
                                                                     "type": "temp"}
    assert (folders.temp / "refs" / "x.png").is_file()
    for bad in (dict(name="../evil.png"), dict(name="ok.png", subfolder="../.."), dict(name="ok.png", type="models"),
                dict(name="ok.png", subfolder="/tmp")):
        name = bad.pop("name")
        assert upload(name, **bad).status_code == 400, (name, bad)
    assert not (folders.input.parent / "evil.png").exists()
    # an uploaded image validates as a LoadImage choice at once
    info = requests.get(url + "/object_info/LoadImage", timeout=10).json()["LoadImage"]
    assert "ref.png" in info["input"]["required"]["image"][0]


# ------------------------------------------------------------------------------------------ info routes


def test_object_info_shape(server):
    info = requests.get(server.url + "/object_info", timeout=30).json()
    assert set(NODES) <= set(info)
    s = info["VGSampler"]
    assert set(s) >= {"input", "input_order", "output", "output_is_list", "output_name", "name", "display_name",
                      "description", "python_module", "category", "output_node"}
    assert s["input_order"]["required"] == ["model", "positive", "latent", "seed", "steps", "guidance"]
    assert s["input"]["required"]["steps"][0] == "INT" and s["output"] == ["LATENT"]
    assert s["display_name"] == "Sampler (vramgraph)" and s["category"] == "vramgraph"
    assert info["SaveImage"]["output_node"] is True and info["SaveImage"]["python_module"] == "nodes"
    assert "flux-2-klein-4b.safetensors" in info["UNETLoader"]["input"]["required"]["unet_name"][0]
    assert info["SamplerCustomAdvanced"]["output_name"] == ["output", "denoised_output"]
    assert requests.get(server.url + "/api/object_info/KSampler", timeout=10).json()["KSampler"]["name"] == "KSampler"
    assert requests.get(server.url + "/object_info/Nope", timeout=10).json() == {}


def test_system_stats_and_free(server):
    stats = requests.get(server.url + "/system_stats", timeout=10).json()
    assert set(stats["system"]) >= {"os", "ram_total", "ram_free", "python_version", "pytorch_version"}
    (dev,) = stats["devices"]
    assert set(dev) == {"name", "type", "index", "vram_total", "vram_free", "torch_vram_total", "torch_vram_free"}
    assert stats["vramgraph"]["budget"]["gpu"] > 0
    assert post(server.url, "/free", {"unload_models": True, "free_memory": True}).status_code == 200


def test_plan_convert_and_ui_routes(server):
    prompt = text_to_image()
    r = post(server.url, "/vramgraph/plan", {"prompt": prompt, "name": "text_to_image.json"})
    assert r.status_code == 200
    body = r.json()
    assert body["svg"].startswith("<svg") and ">text_to_image · " in body["svg"]  # the same drawing as plan --svg
    assert body["timeline"]["budget"] == body["plan"]["budget"]["gpu"]
    assert {m["label"] for m in body["timeline"]["models"].values()} == {"transformer", "text encoder", "vae"}
    assert "loads" in body["table"]
    # plans need no weights: a missing file is planned with the built-in klein sizes (9B: 33.8 GiB in fp32)
    big = text_to_image(1024)
    big["1"]["inputs"]["file"] = "flux-2-klein-9b.safetensors"
    r = post(server.url, "/vramgraph/plan", {"prompt": big})
    if r.status_code == 200:
        assert max(m["nbytes"] for m in r.json()["timeline"]["models"].values()) > 30 * 2**30
    else:
        assert r.status_code == 400 and r.json()["error"]["type"] == "vram_plan_infeasible"
        assert r.json()["error"]["extra_info"]["node_id"] == "6"
    r = post(server.url, "/vramgraph/plan", {"nothing": 1})
    assert r.status_code == 400

    # API -> UI -> API gives the prompt back
    ui = post(server.url, "/vramgraph/ui", {"prompt": prompt}).json()
    assert len(ui["nodes"]) == 8 and len(ui["links"]) == 7
    back = post(server.url, "/vramgraph/convert", {"workflow": ui}).json()
    assert back["workflow"] == ui
    assert {k: v["inputs"] for k, v in back["prompt"].items()} == {k: v["inputs"] for k, v in prompt.items()}
    # a UI file keeps its layout and takes the edited widget values
    prompt["6"]["inputs"]["seed"] = 1234
    edited = post(server.url, "/vramgraph/ui", {"prompt": prompt, "workflow": ui}).json()
    sampler = next(n for n in edited["nodes"] if n["id"] == 6)
    assert sampler["widgets_values"][0] == 1234 and sampler["widgets_values"][1] == "fixed"
    assert sampler["pos"] == next(n for n in ui["nodes"] if n["id"] == 6)["pos"]
    # UI files from ComfyUI convert (reroutes, primitives, notes vanish)
    data = json.loads((ROOT / "tests" / "data" / "ui" / "reroute_primitive_note.json").read_text())
    conv = post(server.url, "/vramgraph/convert", {"workflow": data}).json()
    assert conv["prompt"]["6"]["inputs"]["width"] == 768 and "10" not in conv["prompt"]
    assert post(server.url, "/vramgraph/convert", {"workflow": {"x": 1}}).status_code == 400
    names = requests.get(server.url + "/vramgraph/workflows", timeout=10).json()
    assert "text_to_image" in names
    shipped = requests.get(server.url + "/vramgraph/workflows/text_to_image", timeout=10).json()
    assert shipped["6"]["class_type"] == "VGSampler"
    assert requests.get(server.url + "/vramgraph/workflows/..%2Fpyproject", timeout=10).status_code == 404


def test_page_and_scripts_are_served(server):
    r = requests.get(server.url + "/", timeout=10)
    assert r.status_code == 200 and '<script type="module" src="/web/app.mjs">' in r.text
    for name in ("app.mjs", "graph.mjs", "timeline.mjs"):
        r = requests.get(f"{server.url}/web/{name}", timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].split(";")[0] == "text/javascript", name
    assert requests.get(server.url + "/web/style.css", timeout=10).status_code == 200


def test_origin_checks_by_default_and_the_cors_opt_out(server, folders):
    """By default a page of another site is refused; --enable-cors-header [ORIGIN] answers it as ComfyUI does."""
    from vramgraph.cli.main import _parser
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ServerThread, make_app

    foreign = {"Origin": "http://app.example"}
    assert requests.get(server.url + "/queue", headers=foreign, timeout=10).status_code == 403
    assert requests.options(server.url + "/prompt", headers=foreign, timeout=10).status_code == 403
    assert requests.get(server.url + "/queue", headers={"Origin": server.url}, timeout=10).status_code == 200
    assert _parser().parse_args(["serve", "--enable-cors-header"]).enable_cors_header == "*"
    assert _parser().parse_args(["serve", "--enable-cors-header", "http://app.example"]).enable_cors_header == \
        "http://app.example"
    assert _parser().parse_args(["serve"]).enable_cors_header is None
    app = make_app(Engine(folders, nodes=NODES), start_worker=False, cors="http://app.example")
    with ServerThread(app) as srv:
        r = requests.get(srv.url + "/queue", headers=foreign, timeout=10)
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "http://app.example"
        pre = requests.options(srv.url + "/prompt", headers={**foreign, "Access-Control-Request-Method": "POST"},
                               timeout=10)
        assert pre.status_code == 200 and "POST" in pre.headers["Access-Control-Allow-Methods"]
        assert "Content-Type" in pre.headers["Access-Control-Allow-Headers"]
        r = requests.post(srv.url + "/prompt", json={"prompt": {}}, headers={**foreign, "Host": "evil.example"},
                          timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "prompt_no_outputs", "checks opted out"


def test_a_client_whose_queue_overflows_is_dropped_alone(folders):
    """Messages for one client beyond its queue's bound drop that client; another client's messages still arrive."""
    import aiohttp
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    app = make_app(Engine(folders, nodes=NODES), start_worker=False)
    hub = app[ROUTES].hub
    hub.queue_size = 4

    async def go(url: str) -> tuple[list, list, set]:
        async with aiohttp.ClientSession() as s, s.ws_connect(url + "/ws?clientId=flood") as flood, \
                s.ws_connect(url + "/ws?clientId=calm") as calm:
            assert (await flood.receive_json(timeout=10))["type"] == "status"
            assert (await calm.receive_json(timeout=10))["type"] == "status"

            def burst() -> None:  # one turn of the event loop: the flood client's sender cannot keep up
                for i in range(10):
                    hub.send("flood", {"i": i}, "flood")
                hub.send("calm", {"i": 0}, "calm")

            hub.loop.call_soon_threadsafe(burst)
            got = [await calm.receive_json(timeout=10)]
            flooded = []
            while (msg := await flood.receive(timeout=10)).type == aiohttp.WSMsgType.TEXT:
                flooded.append(json.loads(msg.data)["data"]["i"])
            return got, flooded, set(hub.sockets)

    with ServerThread(app) as srv:
        got, flooded, connected = asyncio.run(go(srv.url))
    assert got == [{"type": "calm", "data": {"i": 0}}]
    assert flooded == [], "the fifth message dropped the client at once: its connection aborted, nothing more sent"
    assert connected == {"calm"}


def test_history_is_bounded_in_entries_and_bytes():
    from vramgraph.server.queue import PromptQueue

    q = PromptQueue(max_history=3, max_history_bytes=10_000)
    for i in range(5):
        q.done(f"p{i}", {"outputs": {}, "n": i})
    assert list(q.history) == ["p2", "p3", "p4"]
    q.done("big", {"blob": "x" * 9_950})  # 9962 bytes: with p4 (23) still within 10_000, not with p3 too
    assert list(q.history) == ["p4", "big"], "the oldest go while the entries pass the byte bound"
    q.done("huge", {"blob": "x" * 50_000})
    assert list(q.history) == ["huge"], "the newest entry stays, even alone over the bound"
    q.update_history("huge", "blob", "small")
    q.done("p5", {"n": 5})
    assert list(q.history) == ["huge", "p5"]
    q.delete_history("huge")
    q.delete_history()
    assert q.history == {} and q._history_bytes == 0


# ------------------------------------------------------------------------------------------ batches


def tight_engine(folders: Any) -> Any:
    """An engine whose budget holds the text encoder or the transformer, never both (a 12 GiB card's case)."""
    from vramgraph.graph.engine.budget import Budget
    from vramgraph.graph.engine.executor import Engine

    probe = Engine(folders, nodes=NODES)
    prep = probe.prepare(text_to_image())
    sizes = {e.info.label: e.info.nbytes for e in probe.ledger.entries.values()}
    act = max(o.activation for c in prep.costs.values() for o in c.variants if o.name == "gpu")  # resident runs
    gpu = max(sizes["text encoder"], sizes["transformer"]) + sizes["vae"] + act + 2**20
    assert sizes["text encoder"] + sizes["transformer"] > gpu  # never both, not even without an activation
    return Engine(folders, nodes=NODES, budget=Budget(gpu=gpu, host=8 * 2**30))


def batch_prompts(tag: str) -> list[dict]:
    prompts = []
    for i, (text, seed) in enumerate([("a red fox in the snow", 1), ("a blue boat", 2), ("a green hill", 3)]):
        p = text_to_image()
        p["4"]["inputs"]["text"] = text
        p["6"]["inputs"]["seed"] = seed
        p["8"]["inputs"]["filename_prefix"] = f"batch/{tag}_{i}"
        prompts.append(p)
    return prompts


async def _run_queued(url: str, bodies: list[dict], start: Any) -> tuple[dict[str, list], dict[str, list], list[str]]:
    """Connect every body's client, queue the bodies (worker paused), call `start`, collect each client's
    messages and binary frames until every prompt has ended."""
    import aiohttp

    clients = list(dict.fromkeys(b["client_id"] for b in bodies))
    msgs: dict[str, list] = {c: [] for c in clients}
    frames: dict[str, list] = {c: [] for c in clients}
    async with aiohttp.ClientSession() as s:
        sockets = {c: await s.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId={c}") for c in clients}
        for ws in sockets.values():
            await ws.receive_json(timeout=10)
        pids = []
        for b in bodies:
            async with s.post(url + "/prompt", json=b) as r:
                assert r.status == 200, await r.text()
                pids.append((await r.json())["prompt_id"])
        start()
        waiting = {c: {p for p, b in zip(pids, bodies, strict=True) if b["client_id"] == c} for c in clients}

        async def collect(c: str) -> None:
            while waiting[c]:
                m = await sockets[c].receive(timeout=TIMEOUT)
                if m.type == aiohttp.WSMsgType.BINARY:
                    frames[c].append(m.data)
                    continue
                msg = json.loads(m.data)
                msgs[c].append(msg)
                if msg["type"] == "executing" and msg["data"]["node"] is None:
                    waiting[c].discard(msg["data"]["prompt_id"])

        await asyncio.gather(*(collect(c) for c in clients))
        for ws in sockets.values():
            await ws.close()
    return msgs, frames, pids


def _pixels(folders: Any, image: dict) -> Any:
    import numpy as np

    root = folders.output if image["type"] == "output" else folders.temp
    return np.asarray(Image.open(root / image["subfolder"] / image["filename"]))


def _loads(engine: Any) -> list[str]:
    return [e.model for e in engine.ledger.events if e.kind == "load"]


def test_queued_prompts_run_as_one_batch(folders):
    """Three prompts waiting when the worker starts: one merged plan, each model loaded once, and every client
    sees ComfyUI's events for its own prompts with their own node ids, each ending as soon as its image exists."""
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    engine = tight_engine(folders)
    app = make_app(engine, start_worker=False)
    bodies = [{"prompt": p, "client_id": "batch-a" if i != 1 else "batch-b",
               "extra_data": {"preview_method": "auto" if i == 1 else "none"}}
              for i, p in enumerate(batch_prompts("together"))]
    with ServerThread(app) as srv:
        msgs, frames, pids = asyncio.run(_run_queued(srv.url, bodies, app[ROUTES].worker.start))
        history = {pid: wait_history(srv.url, pid, whole_run=True) for pid in pids}
        assert requests.get(srv.url + "/queue", timeout=10).json() == {"queue_running": [], "queue_pending": []}
        loads = _loads(engine)
        # again, behind the first prompt run alone (so its nodes, loaders included, are the ones cached): the
        # first prompt ends at once from the cache with its image re-sent, the others reuse the cached loaders
        engine._lock.acquire()  # the worker waits in the engine with the first prompt until the others are queued
        try:
            blocker = post(srv.url, "/prompt", {"prompt": bodies[0]["prompt"], "client_id": "blocker"}).json()
            end = time.monotonic() + TIMEOUT
            while [e[1] for e in requests.get(srv.url + "/queue", timeout=10).json()["queue_running"]] != \
                    [blocker["prompt_id"]]:
                assert time.monotonic() < end
                time.sleep(0.02)
        except BaseException:
            engine._lock.release()
            raise
        again, _, again_pids = asyncio.run(_run_queued(srv.url, bodies, engine._lock.release))
        assert wait_history(srv.url, blocker["prompt_id"])["status"]["status_str"] == "success"
        again_history = {pid: wait_history(srv.url, pid) for pid in again_pids}
    assert [m["data"]["prompt_ids"] for m in again["batch-a"] if m["type"] == "vramgraph.plan"] == \
        [[again_pids[0], again_pids[2]]], "one batch; a client hears of its own prompts only"
    for i, pid in enumerate(again_pids):
        seq = [m for c in again.values() for m in c if m["type"] != "status" and m["data"].get("prompt_id") == pid]
        cached = [m["data"]["nodes"] for m in seq if m["type"] == "execution_cached"]
        ran = [m["data"]["node"] for m in seq if m["type"] == "executing" and m["data"]["node"] is not None]
        assert sorted(cached[0]) == ([str(n) for n in range(1, 9)] if i == 0 else ["1", "2", "3", "5"])
        assert sorted(ran) == ([] if i == 0 else ["4", "6", "7", "8"])
        assert [m["type"] for m in seq][-2:] == ["execution_success", "executing"]
        assert again_history[pid]["status"]["status_str"] == "success"
        assert (_pixels(folders, again_history[pid]["outputs"]["8"]["images"][0]) ==
                _pixels(folders, history[pids[i]]["outputs"]["8"]["images"][0])).all()
    a = [m for m in again["batch-a"] if m["type"] != "status"]
    assert a.index(next(m for m in a if m["type"] == "executing" and m["data"]["node"] is None)) < \
        a.index(next(m for m in a if m["type"] == "executing" and m["data"]["node"] is not None)), \
        "the cached prompt ends before any node runs"

    assert len(loads) == len(set(loads)) == 3, "each model loaded once for the three images"
    mine = {"batch-a": [pids[0], pids[2]], "batch-b": [pids[1]]}
    for client, own in mine.items():
        plans = [m["data"] for m in msgs[client] if m["type"] == "vramgraph.plan"]
        assert len(plans) == 1 and plans[0]["prompt_ids"] == own, "one merged plan, naming the client's prompts"
        assert sorted(plans[0]["members"]) == sorted(own)
        assert {m["data"]["prompt_id"] for m in msgs[client] if m["type"] not in ("status",)} <= set(own)
        for pid in own:
            seq = [m for m in msgs[client] if m["type"] != "status" and m["data"].get("prompt_id") == pid]
            kinds = [m["type"] for m in seq]
            assert kinds[0] == "execution_start" and kinds[-2:] == ["execution_success", "executing"]
            assert seq[-1]["data"]["node"] is None
            nodes = [m["data"]["node"] for m in seq[:-1] if m["type"] == "executing"]
            assert sorted(nodes) == [str(n) for n in range(1, 9)], "its own ids, shared loaders included"
            assert all(m["data"]["display_node"] == m["data"]["node"] for m in seq[:-1] if m["type"] == "executing")
            executed = [m["data"] for m in seq if m["type"] == "executed"]
            assert [d["node"] for d in executed] == ["8"]
            assert executed[0]["output"] == history[pid]["outputs"]["8"]
            assert kinds.index("executed") < kinds.index("execution_success")
            assert [m["data"]["node"] for m in seq if m["type"] == "progress"] == ["6", "6"]
    # a prompt ends as soon as its image is saved, not when the batch ends
    a = msgs["batch-a"]
    first_end = next(i for i, m in enumerate(a) if m["type"] == "executing" and m["data"]["node"] is None)
    assert a[first_end]["data"]["prompt_id"] == pids[0]
    assert any(m["type"] == "executing" and m["data"]["prompt_id"] == pids[2] and m["data"]["node"] == "7"
               for m in a[first_end:])
    # previews only to the client that asked for them
    assert len(frames["batch-b"]) == 2 and not frames["batch-a"]
    for i, pid in enumerate(pids):
        entry = history[pid]
        assert entry["status"]["status_str"] == "success" and entry["prompt"][1] == pid
        assert list(entry["outputs"]) == ["8"] and entry["meta"]["8"]["node_id"] == "8"
        assert entry["status"]["messages"][0][0] == "execution_start"
        assert entry["status"]["messages"][-1][0] == "execution_success"
        report = entry["vramgraph"]
        assert report["batch"]["prompt_ids"] == (mine["batch-b"] if i == 1 else mine["batch-a"])
        assert report["batch"]["index"] == i
        assert report["members"]["8"] == f"q{i}:8" and report["members"]["1"] == "q0:1"
        assert report["loads"] == 3 and report["plan"]["steps"] and "partial" not in report

    # the same prompts one at a time on a fresh server: the same images, bit for bit, and the models swap
    alone = tight_engine(folders)
    encodes = []
    with ServerThread(make_app(alone, batch=False)) as srv:
        for i, body in enumerate(bodies):
            body = {**body, "prompt": batch_prompts("alone")[i], "extra_data": {}}
            pid = post(srv.url, "/prompt", body).json()["prompt_id"]
            entry = wait_history(srv.url, pid)
            assert "batch" not in entry["vramgraph"]
            encodes += [s["variant"] for s in entry["vramgraph"]["plan"]["steps"]
                        if s["kind"] == "run" and body["prompt"][s["node"]]["class_type"] == "VGTextEncode"]
            ours = history[pids[i]]["outputs"]["8"]["images"][0]
            theirs = entry["outputs"]["8"]["images"][0]
            assert ours["filename"] != theirs["filename"]
            assert (_pixels(folders, ours) == _pixels(folders, theirs)).all()
    # one at a time the encoder and the transformer cannot both stay: after the first prompt (a load of each model)
    # every text encode streams the encoder beside the resident transformer rather than swapping them
    assert encodes == ["gpu", "stream", "stream"]
    assert [m.split(":")[0] for m in _loads(alone)] == ["text_encoder", "transformer", "vae"]


def test_a_failing_prompt_in_a_batch(folders, monkeypatch):
    """The decode of one prompt fails: the prompt completed before it stays successful, the others run again
    alone, so the failing one reports its error with its own node id and the last one still succeeds."""
    import vramgraph.nodes.ops as ops
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    decode = ops.vae_decode

    def wide_fails(vae: Any, samples: Any, variant: str = "gpu", between: Any = None) -> Any:
        if samples.shape[-1] > samples.shape[-2]:
            raise RuntimeError("no wide images today")
        return decode(vae, samples, variant, between)

    monkeypatch.setattr(ops, "vae_decode", wide_fails)
    prompts = batch_prompts("failing")
    prompts[1]["5"]["inputs"]["width"] = 96
    engine = tight_engine(folders)
    app = make_app(engine, start_worker=False)
    bodies = [{"prompt": p, "client_id": "fail-a"} for p in prompts]
    with ServerThread(app) as srv:
        msgs, _, pids = asyncio.run(_run_queued(srv.url, bodies, app[ROUTES].worker.start))
        history = {pid: wait_history(srv.url, pid) for pid in pids}
    plans = [m["data"] for m in msgs["fail-a"] if m["type"] == "vramgraph.plan"]
    assert plans[0]["prompt_ids"] == pids and [p["prompt_id"] for p in plans[1:]] == pids[1:], "then one by one"
    first, failed, last = (history[p] for p in pids)
    assert first["status"]["status_str"] == "success" and first["vramgraph"]["batch"]["index"] == 0
    assert last["status"]["status_str"] == "success" and "batch" not in last["vramgraph"], "ran again alone"
    assert list(first["outputs"]) == list(last["outputs"]) == ["8"]
    assert failed["status"]["status_str"] == "error" and failed["outputs"] == {}
    kind, data = failed["status"]["messages"][-1]
    assert kind == "execution_error" and data["prompt_id"] == pids[1]
    assert data["node_id"] == "7" and data["node_type"] == "VGVAEDecode"
    assert "no wide images today" in data["exception_message"]
    errors = [m["data"] for m in msgs["fail-a"] if m["type"] == "execution_error"]
    assert [(d["prompt_id"], d["node_id"]) for d in errors] == [(pids[1], "7")]
    ends = [m["data"]["prompt_id"] for m in msgs["fail-a"] if m["type"] == "executing" and m["data"]["node"] is None]
    assert ends == pids


async def _interrupt_when(url: str, client: str, bodies: list[dict], start: Any, when: tuple[str, str],
                          interrupt: dict | None) -> tuple[list[str], dict[str, list[dict]]]:
    """Queue `bodies` for `client` (worker paused), call `start`, collect each prompt's messages on the client's
    websocket, and POST /interrupt with `interrupt` at the first progress report of `when` (prompt id, node)."""
    import aiohttp

    async with aiohttp.ClientSession() as s, s.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId={client}") as ws:
        await ws.receive_json(timeout=10)
        pids = []
        for b in bodies:
            async with s.post(url + "/prompt", json={**b, "client_id": client}) as r:
                pids.append((await r.json())["prompt_id"])
        start()
        seqs: dict[str, list[dict]] = {p: [] for p in pids}
        sent, left = False, set(pids)
        while left:
            m = json.loads((await ws.receive(timeout=TIMEOUT)).data)
            pid = m["data"].get("prompt_id")
            if pid not in seqs:
                continue
            seqs[pid].append(m)
            if m["type"] == "progress" and (pid, m["data"]["node"]) == when and not sent:
                sent = True
                async with s.post(url + "/interrupt", json=interrupt) as r:
                    assert r.status == 200
            if m["type"] == "executing" and m["data"]["node"] is None:
                left.discard(pid)
    return pids, seqs


def test_interrupting_one_prompt_of_a_batch(folders):
    """/interrupt with the middle prompt's id, sent while that prompt runs: it alone is interrupted; the prompts
    before and after it in the same batch finish."""
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    app = make_app(tight_engine(folders), start_worker=False)
    bodies = [{"prompt": {"1": {"class_type": "TestSlow", "inputs": {"steps": n}}}, "prompt_id": f"one-{i}"}
              for i, n in enumerate((3, 1000, 4))]
    with ServerThread(app) as srv:
        pids, seqs = asyncio.run(_interrupt_when(srv.url, "one", bodies, app[ROUTES].worker.start, ("one-1", "1"),
                                                 {"prompt_id": "one-1"}))
        entries = [wait_history(srv.url, pid) for pid in pids]
    assert [e["status"]["status_str"] for e in entries] == ["success", "error", "success"]
    assert [e["outputs"] for e in entries] == [{"1": {"text": ["3"]}}, {}, {"1": {"text": ["4"]}}]
    assert entries[0]["vramgraph"]["batch"]["prompt_ids"] == pids, "one batch"
    kind, data = entries[1]["status"]["messages"][-1]
    assert kind == "execution_interrupted" and data["node_id"] == "1" and data["node_type"] == "TestSlow"
    for pid, seq in seqs.items():
        kinds = [m["type"] for m in seq]
        assert kinds[0] == "execution_start" and kinds[-1] == "executing"
        assert kinds[-2] == ("execution_interrupted" if pid == "one-1" else "execution_success"), pid
        assert kinds.count("execution_interrupted") == (pid == "one-1")
    assert max(m["data"]["value"] for m in seqs["one-1"] if m["type"] == "progress") < 100, "stopped at once"


def test_interrupting_one_image_of_a_batch(folders):
    """Three images planned as one batch (shared loaders); the middle one is interrupted while it runs (its image
    held by a TestHold node before its save). The other two are saved, pixel for pixel the images of their prompts
    run alone, and only the middle prompt reports execution_interrupted."""
    import numpy as np
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    prompts = batch_prompts("held")
    prompts[1]["9"] = {"class_type": "TestHold", "inputs": {"images": ["7", 0], "steps": 5000}}
    prompts[1]["8"]["inputs"]["images"] = ["9", 0]
    engine = tight_engine(folders)
    app = make_app(engine, start_worker=False)
    with ServerThread(app) as srv:
        bodies = [{"prompt": p, "prompt_id": f"held-{i}"} for i, p in enumerate(prompts)]
        pids, seqs = asyncio.run(_interrupt_when(srv.url, "held", bodies, app[ROUTES].worker.start, ("held-1", "9"),
                                                 {"prompt_id": "held-1"}))
        entries = [wait_history(srv.url, pid) for pid in pids]
    assert [e["status"]["status_str"] for e in entries] == ["success", "error", "success"]
    assert entries[0]["vramgraph"]["batch"]["prompt_ids"] == pids and entries[0]["vramgraph"]["loads"] == 3
    kind, data = entries[1]["status"]["messages"][-1]
    assert kind == "execution_interrupted" and (data["node_id"], data["node_type"]) == ("9", "TestHold")
    assert entries[1]["outputs"] == {} and not list(folders.output.glob("batch/held_1*"))
    assert sorted(data["executed"]) == [str(n) for n in range(1, 8)], "all but the hold and the save"
    for pid, seq in seqs.items():
        ends = [m["type"] for m in seq if m["type"] in ("execution_success", "execution_interrupted")]
        assert ends == (["execution_interrupted"] if pid == "held-1" else ["execution_success"]), pid
        assert [m["data"]["nodes"] for m in seq if m["type"] == "execution_cached"] == [[]], "sent, empty"
    alone = Engine(folders, nodes=NODES)
    for i in (0, 2):
        theirs = alone.run(batch_prompts("held_alone")[i]).images[0]
        assert np.array_equal(_pixels(folders, entries[i]["outputs"]["8"]["images"][0]),
                              np.asarray(Image.open(theirs)))


def test_interrupting_a_batch(folders):
    """/interrupt without a prompt id stops the prompt that is running, as ComfyUI does: in a batch, the one whose
    node runs now; the batch's other prompts (queued by other users too) go on and finish."""
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    app = make_app(tight_engine(folders), start_worker=False)
    with ServerThread(app) as srv:
        pids = [post(srv.url, "/prompt", {"prompt": {"1": {"class_type": "TestSlow", "inputs": {"steps": n}}},
                                          "prompt_id": f"slow-{i}"}).json()["prompt_id"]
                for i, n in enumerate((1000, 3, 4))]
        app[ROUTES].worker.start()
        end = time.monotonic() + TIMEOUT
        while app[ROUTES].worker.last_node is None:  # the batch's first node is running
            assert time.monotonic() < end
            time.sleep(0.02)
        assert [e[1] for e in requests.get(srv.url + "/queue", timeout=10).json()["queue_running"]] == pids
        assert requests.post(srv.url + "/interrupt", json={}, timeout=10).status_code == 200
        entries = [wait_history(srv.url, pid) for pid in pids]
    assert [e["status"]["status_str"] for e in entries] == ["error", "success", "success"]
    kind, data = entries[0]["status"]["messages"][-1]
    assert kind == "execution_interrupted" and data["prompt_id"] == pids[0] and data["node_id"] == "1"
    assert [e["outputs"] for e in entries[1:]] == [{"1": {"text": ["3"]}}, {"1": {"text": ["4"]}}]
    assert entries[1]["vramgraph"]["batch"]["prompt_ids"] == pids, "one batch"
