"""ComfyUI API parity beyond the core routes (server/compat.py and the events): /features and the websocket's
feature_flags answer, /models, /view_metadata, /api/jobs, /upload/mask, reading settings and user data,
partial_execution_targets, progress_state, execution_cached, and exception_message without a type prefix.

A real server on loopback over tiny models and real files; test nodes that count (with progress) or fail.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch
from helpers import save
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from vramgraph.nodes import ENGINE_NODES
from vramgraph.nodes.types import INT, Cost

TIMEOUT = 120


class CountNode:
    """An output node that counts to `steps`, reporting progress, and shows the count (test only)."""

    CATEGORY = "test"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls, folders: Any = None) -> dict:
        return {"required": {"steps": (INT, {"default": 3, "min": 1, "max": 100000})}, "hidden": {"vg": "VG_CONTEXT"}}

    @classmethod
    def vg_estimate(cls, env: Any, steps: int) -> Cost:
        return Cost(())

    def run(self, steps: int, vg: Any = None) -> dict:
        for i in range(steps):
            vg.progress(i + 1, steps)
            if steps > 10:
                time.sleep(0.02)
        return {"ui": {"text": [str(steps)]}}


NODES = {**ENGINE_NODES, "CountNode": CountNode}


def count(*steps: int) -> dict:
    return {str(i + 1): {"class_type": "CountNode", "inputs": {"steps": n}} for i, n in enumerate(steps)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders

    tmp = tmp_path_factory.mktemp("compat")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    save({"w": torch.zeros(2)}, tmp / "models" / "vae" / "with_meta.safetensors",
         metadata={"modelspec.title": "a tiny vae", "format": "pt"})
    (tmp / "models" / "vae" / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    f = Folders(models=(tmp / "models",), input=tmp / "input", output=tmp / "output", temp=tmp / "temp")
    for d in (f.input, f.output, f.temp):
        d.mkdir(parents=True)
    user = tmp / "user" / "default"
    (user / "workflows" / "sub").mkdir(parents=True)
    (user / "comfy.settings.json").write_text(json.dumps({"Comfy.ColorPalette": "dark", "Comfy.Zoom": 2}))
    (user / "workflows" / "a.json").write_text('{"nodes": []}')
    (user / "workflows" / "sub" / "b.json").write_text('{"nodes": [1]}')
    (tmp / "secret.txt").write_text("not for the web")
    (user / "workflows" / "out.json").symlink_to(tmp / "secret.txt")
    return f


@pytest.fixture(scope="module")
def server(folders):
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ServerThread, make_app

    with ServerThread(make_app(Engine(folders, nodes=NODES), user_dir=folders.input.parent / "user")) as srv:
        yield srv


def post(url: str, path: str, body: Any) -> requests.Response:
    return requests.post(url + path, json=body, timeout=TIMEOUT)


def get(url: str, path: str, **params: Any) -> requests.Response:
    return requests.get(url + path, params=params, timeout=TIMEOUT)


def wait_history(url: str, pid: str) -> dict:
    end = time.monotonic() + TIMEOUT
    while time.monotonic() < end:
        h = get(url, f"/history/{pid}").json()
        if h:
            return h[pid]
        time.sleep(0.05)
    raise AssertionError(f"prompt {pid} did not finish")


async def _events(url: str, body: dict, first: dict | None = None) -> tuple[list[dict], dict]:
    """The messages one client gets for one prompt, up to its `executing` None; `first` is sent on connecting."""
    import aiohttp

    client = body["client_id"]
    msgs: list[dict] = []
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId={client}") as ws:
        msgs.append(await ws.receive_json(timeout=10))
        if first is not None:
            await ws.send_str(json.dumps(first))
            msgs.append(await ws.receive_json(timeout=10))
        async with s.post(url + "/prompt", json=body) as r:
            answer = await r.json()
        while True:
            msg = await ws.receive_json(timeout=TIMEOUT)
            msgs.append(msg)
            if msg["type"] == "executing" and msg["data"]["node"] is None and \
                    msg["data"]["prompt_id"] == answer["prompt_id"]:
                return msgs, answer


# ------------------------------------------------------------------------------------------ features


def test_features_and_the_feature_flags_answer(server):
    features = get(server.url, "/features").json()
    assert features == get(server.url, "/api/features").json()
    assert features["supports_preview_metadata"] is False and features["max_upload_size"] == 256 * 2**20
    assert features["vramgraph"]["targeted_interrupt"] is True
    hello = {"type": "feature_flags", "data": {"supports_preview_metadata": True}}
    msgs, _ = asyncio.run(_events(server.url, {"prompt": count(1), "client_id": "flags"}, first=hello))
    assert msgs[0]["type"] == "status" and msgs[1] == {"type": "feature_flags", "data": features}
    assert sum(m["type"] == "feature_flags" for m in msgs) == 1


# ------------------------------------------------------------------------------------------ models


def test_models_and_their_files(server):
    assert get(server.url, "/models").json() == ["diffusion_models", "text_encoders", "vae", "loras"]
    vae = get(server.url, "/models/vae").json()
    assert vae == ["broken.safetensors", "flux2-vae.safetensors", "with_meta.safetensors"]
    assert get(server.url, "/api/models/diffusion_models").json() == get(server.url, "/models/unet").json() == \
        ["flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"]
    assert get(server.url, "/models/clip").json() == ["qwen_3_4b.safetensors"]
    assert get(server.url, "/models/checkpoints_nope").status_code == 404


def test_view_metadata(server):
    r = get(server.url, "/view_metadata/vae", filename="with_meta.safetensors")
    assert r.status_code == 200 and r.json() == {"modelspec.title": "a tiny vae", "format": "pt"}
    assert get(server.url, "/view_metadata/vae", filename="flux2-vae.safetensors").json() == {}  # none in the file
    for folder, name in [("vae", "broken.safetensors"), ("vae", "nope.safetensors"),
                         ("vae", "../../secret.txt"), ("input", "x.safetensors"), ("vae", "../../models/x.safetensors"),
                         ("vae", "with_meta.ckpt"), ("nope", "with_meta.safetensors")]:
        r = get(server.url, f"/view_metadata/{folder}", filename=name)
        assert r.status_code == 404 and b"not for the web" not in r.content, (folder, name)
    assert get(server.url, "/view_metadata/vae").status_code == 404


# ------------------------------------------------------------------------------------------ settings, user data


def test_settings_and_user_data_are_read(server, folders):
    """Reading as ComfyUI answers (writes: tests/test_userdata.py)."""
    url = server.url
    assert get(url, "/settings").json() == {"Comfy.ColorPalette": "dark", "Comfy.Zoom": 2}
    assert get(url, "/api/settings/Comfy.Zoom").json() == 2
    assert get(url, "/settings/Comfy.Nope").json() is None
    assert get(url, "/users").json() == {"storage": "server", "migrated": True}
    assert get(url, "/userdata", dir="workflows").json() == ["a.json"]
    assert get(url, "/userdata", dir="workflows", recurse="true").json() == ["a.json", "sub/b.json"]
    assert get(url, "/userdata", dir="workflows", recurse="true", split="true").json() == \
        [["a.json", "a.json"], ["sub/b.json", "sub", "b.json"]]
    full = get(url, "/userdata", dir="workflows", recurse="true", full_info="true").json()
    assert [f["path"] for f in full] == ["a.json", "sub/b.json"] and full[0]["size"] == len('{"nodes": []}')
    assert set(full[0]) == {"path", "size", "modified", "created"}
    r = requests.get(url + "/userdata/workflows%2Fsub%2Fb.json", timeout=10)
    assert r.status_code == 200 and r.json() == {"nodes": [1]} and r.headers["X-Content-Type-Options"] == "nosniff"
    assert get(url, "/userdata").status_code == 400
    assert get(url, "/userdata", dir="nope").status_code == 404
    for bad in ("..%2F..%2Fsecret.txt", "workflows%2Fout.json", "%2Fetc%2Fpasswd", "workflows%2Fnope.json"):
        r = requests.get(f"{url}/userdata/{bad}", timeout=10)
        assert r.status_code in (403, 404) and b"not for the web" not in r.content, bad
    assert get(url, "/userdata", dir="../..").status_code == 403
    assert (folders.input.parent / "user" / "default" / "workflows" / "a.json").read_text() == '{"nodes": []}'


def test_no_user_folder_means_no_settings(folders):
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ServerThread, make_app

    with ServerThread(make_app(Engine(folders, nodes=NODES), start_worker=False)) as srv:
        assert get(srv.url, "/settings").json() == {}
        assert get(srv.url, "/userdata", dir="workflows").status_code == 404
        assert get(srv.url, "/userdata/comfy.settings.json").status_code == 404
        for method, path in [("POST", "/settings"), ("POST", "/settings/Comfy.Zoom"), ("POST", "/userdata/x.json"),
                             ("DELETE", "/userdata/workflows%2Fa.json"), ("POST", "/userdata/a.json/move/b.json"),
                             ("POST", "/users"), ("POST", "/api/settings")]:
            r = requests.request(method, srv.url + path, json={"Comfy.Zoom": 3}, timeout=10)
            assert r.status_code == 405 and r.headers["Allow"] == "GET", (method, path)
            assert r.json()["error"]["type"] == "read_only" and "--user-dir" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------ /upload/mask


def _png(image: Image.Image, **text: str) -> bytes:
    buf = io.BytesIO()
    info = PngInfo()
    for k, v in text.items():
        info.add_text(k, v)
    image.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def test_upload_mask(server, folders):
    url = server.url
    rng = np.random.default_rng(1)
    original = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8))
    (folders.input / "clip").mkdir()
    (folders.input / "clip" / "photo.png").write_bytes(_png(original, prompt='{"1": 2}'))
    alpha = rng.integers(0, 256, (12, 16), dtype=np.uint8)
    mask = Image.fromarray(np.dstack([np.zeros((12, 16, 3), np.uint8), alpha]), "RGBA")

    def upload(ref: Any, data: bytes = _png(mask), name: str = "masked.png", **fields: str) -> requests.Response:
        ref = ref if isinstance(ref, str) else json.dumps(ref)
        return requests.post(url + "/upload/mask", files={"image": (name, data, "image/png")},
                             data={"original_ref": ref, **fields}, timeout=10)

    ref = {"filename": "photo.png", "subfolder": "clip", "type": "input"}
    r = upload(ref)
    assert r.status_code == 200 and r.json() == {"name": "masked.png", "subfolder": "", "type": "input"}
    with Image.open(folders.input / "masked.png") as im:
        assert im.mode == "RGBA" and im.text["prompt"] == '{"1": 2}'
        out = np.asarray(im)
    assert (out[..., 3] == alpha).all() and (out[..., :3] == np.asarray(original)).all()
    assert upload(ref).json()["name"] == "masked (1).png", "an existing file is kept"
    assert upload(ref, overwrite="true").json()["name"] == "masked.png"
    assert upload({"filename": "photo.png [input]", "subfolder": "clip"}, subfolder="m", type="temp").json() == \
        {"name": "masked.png", "subfolder": "m", "type": "temp"}
    assert (folders.temp / "m" / "masked.png").is_file()
    bad = [(ref, dict(name="../evil.png")), (ref, dict(name="evil.html")), (ref, dict(type="models")),
           (ref, dict(subfolder="../..")), ("not json", {}), ({"filename": "../secret.txt"}, {}),
           ({"filename": "photo.png", "subfolder": "../.."}, {}), ({"filename": "photo.png", "type": "models"}, {}),
           ({"filename": "/etc/passwd", "type": "input"}, {}), ([1, 2], {})]
    for r_ref, fields in bad:
        name = fields.pop("name", "masked2.png")
        r = upload(r_ref, name=name, **fields)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", (r_ref, name, fields)
    assert upload({"filename": "gone.png", "subfolder": "clip", "type": "input"}).status_code == 404
    assert upload(ref, data=b"<html>not an image</html>").status_code == 400
    assert upload(ref, data=_png(Image.new("RGBA", (5, 5)))).status_code == 400, "sizes differ"
    assert not (folders.input.parent / "evil.png").exists() and not list(folders.input.rglob("*.part"))


# ------------------------------------------------------------------------------------------ events


def test_progress_state_and_execution_cached(server):
    body = {"prompt": count(3), "client_id": "progress"}
    msgs, answer = asyncio.run(_events(server.url, body))
    pid = answer["prompt_id"]
    kinds = [m["type"] for m in msgs]
    assert kinds.index("execution_start") < kinds.index("execution_cached") < kinds.index("executing")
    assert [m["data"]["nodes"] for m in msgs if m["type"] == "execution_cached"] == [[]], "sent, and empty"
    states = [m["data"] for m in msgs if m["type"] == "progress_state"]
    assert all(s["prompt_id"] == pid and list(s["nodes"]) == ["1"] for s in states)
    node = [s["nodes"]["1"] for s in states]
    assert [(n["state"], n["value"], n["max"]) for n in node] == \
        [("running", 0.0, 1.0), ("running", 1, 3), ("running", 2, 3), ("running", 3, 3), ("finished", 3, 3)]
    assert set(node[0]) == {"value", "max", "state", "node_id", "prompt_id", "display_node_id", "parent_node_id",
                            "real_node_id"} and node[0]["display_node_id"] == node[0]["real_node_id"] == "1"
    assert kinds.index("progress_state") > kinds.index("executing")
    msgs, _ = asyncio.run(_events(server.url, body))  # again: cached, listed
    assert [m["data"]["nodes"] for m in msgs if m["type"] == "execution_cached"] == [["1"]]


def text_to_image(size: int = 64, steps: int = 1) -> dict:
    prompt = json.loads((Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json").read_text())
    prompt["5"]["inputs"].update(width=size, height=size)
    prompt["6"]["inputs"]["steps"] = steps
    return prompt


def test_exception_message_has_no_type_prefix(server):
    prompt = text_to_image()
    prompt["3"]["inputs"]["file"] = "broken.safetensors"
    r = post(server.url, "/prompt", {"prompt": prompt})
    assert r.status_code == 200, r.text
    entry = wait_history(server.url, r.json()["prompt_id"])
    kind, data = entry["status"]["messages"][-1]
    assert kind == "execution_error" and data["node_id"] == "3"
    assert data["exception_type"] == "vramgraph.models.headers.CheckpointError"
    assert "not a safetensors file" in data["exception_message"]
    assert not data["exception_message"].startswith("CheckpointError")


# ------------------------------------------------------------------------------------------ partial execution


def test_partial_execution_targets_run_only_those_outputs(folders):
    """One prompt alone and two planned as one batch: each runs only its partial_execution_targets."""
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    app = make_app(Engine(folders, nodes=NODES), start_worker=False)
    with ServerThread(app) as srv:
        bodies = [{"prompt": count(4, 5, 6), "partial_execution_targets": targets, "prompt_id": f"partial-{i}"}
                  for i, targets in enumerate([["2"], ["1", "3"]])]
        for b in bodies:
            r = post(srv.url, "/prompt", b)
            assert r.status_code == 200, r.text
        pending = get(srv.url, "/queue").json()["queue_pending"]
        assert [e[4] for e in pending] == [["2"], ["1", "3"]]
        app[ROUTES].worker.start()
        batch = [wait_history(srv.url, b["prompt_id"]) for b in bodies]
        r = post(srv.url, "/prompt", {"prompt": count(7, 8), "partial_execution_targets": ["2"], "prompt_id": "one"})
        alone = wait_history(srv.url, r.json()["prompt_id"])
        r = post(srv.url, "/prompt", {"prompt": count(1), "partial_execution_targets": ["9"]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "prompt_no_outputs"
    assert batch[0]["vramgraph"]["batch"]["prompt_ids"] == ["partial-0", "partial-1"], "planned as one batch"
    assert batch[0]["outputs"] == {"2": {"text": ["5"]}}
    assert batch[1]["outputs"] == {"1": {"text": ["4"]}, "3": {"text": ["6"]}}
    assert alone["outputs"] == {"2": {"text": ["8"]}} and "batch" not in alone["vramgraph"]
    assert [n["node"] for n in alone["vramgraph"]["nodes"]] == ["2"], "node 1 never ran"


# ------------------------------------------------------------------------------------------ /api/jobs


def test_jobs(folders):
    """Pending, running, completed, failed and cancelled prompts in ComfyUI's /api/jobs shape."""
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.server.app import ROUTES, ServerThread, make_app

    app = make_app(Engine(folders, nodes=NODES), start_worker=False, batch=False)
    with ServerThread(app) as srv:
        url = srv.url
        image = text_to_image()
        bad = text_to_image()
        bad["3"]["inputs"]["file"] = "broken.safetensors"
        pids = []
        for i, prompt in enumerate([image, bad, count(100000)]):
            body = {"prompt": prompt, "prompt_id": f"job-{i}",
                    "extra_data": {"extra_pnginfo": {"workflow": {"id": f"wf-{i % 2}"}}}}
            pids.append(post(url, "/prompt", body).json()["prompt_id"])
            time.sleep(0.002)  # distinct create times
        listing = get(url, "/api/jobs").json()
        assert [j["id"] for j in listing["jobs"]] == pids[::-1], "newest first"
        assert {j["status"] for j in listing["jobs"]} == {"pending"}
        assert listing["pagination"] == {"offset": 0, "limit": None, "total": 3, "has_more": False}
        job = listing["jobs"][-1]
        assert set(job) == {"id", "status", "priority", "create_time", "outputs_count", "previewable_outputs_count",
                            "workflow_id"} and job["workflow_id"] == "wf-0"
        assert get(url, "/jobs/job-1").json()["workflow"]["prompt"]["3"]["inputs"]["file"] == "broken.safetensors"
        app[ROUTES].worker.start()
        wait_history(url, "job-1")
        end = time.monotonic() + TIMEOUT
        while get(url, "/api/jobs", status="in_progress").json()["pagination"]["total"] != 1:
            assert time.monotonic() < end
            time.sleep(0.02)
        assert get(url, "/api/jobs", status="in_progress").json()["jobs"][0]["id"] == "job-2"
        assert post(url, "/interrupt", {"prompt_id": "job-2"}).status_code == 200
        wait_history(url, "job-2")
        jobs = {j["id"]: j for j in get(url, "/api/jobs").json()["jobs"]}
        assert [jobs[p]["status"] for p in pids] == ["completed", "failed", "cancelled"]
        done = jobs["job-0"]
        assert done["outputs_count"] == done["previewable_outputs_count"] == 1
        assert done["preview_output"]["nodeId"] == "8" and done["preview_output"]["mediaType"] == "images"
        assert done["preview_output"]["type"] == "output" and done["preview_output"]["filename"].endswith(".png")
        assert done["execution_end_time"] >= done["execution_start_time"]
        assert jobs["job-1"]["execution_error"]["node_id"] == "3"
        assert [j["id"] for j in get(url, "/api/jobs", status="failed,cancelled", sort_order="asc").json()["jobs"]] \
            == ["job-1", "job-2"]
        assert [j["id"] for j in get(url, "/api/jobs", workflow_id="wf-1").json()["jobs"]] == ["job-1"]
        page = get(url, "/api/jobs", limit="1", offset="1").json()
        assert [j["id"] for j in page["jobs"]] == ["job-1"] and page["pagination"]["has_more"] is True
        full = get(url, "/api/jobs/job-0").json()
        assert list(full["outputs"]) == ["8"] and full["execution_status"]["status_str"] == "success"
        assert full["workflow"]["extra_data"]["extra_pnginfo"]["workflow"]["id"] == "wf-0"
        assert get(url, "/api/jobs/nope").status_code == 404
        for params in ({"status": "bogus"}, {"sort_by": "size"}, {"sort_order": "up"}, {"limit": "0"},
                       {"limit": "x"}, {"offset": "y"}):
            r = get(url, "/api/jobs", **params)
            assert r.status_code == 400 and "error" in r.json(), params
