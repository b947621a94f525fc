"""The routes ComfyUI's front end calls on `vramgraph serve --front-end comfyui`, without a browser (the browser's
walk is tests/test_comfyui_frontend.py): the static front end and our page, /extensions, templates, the Model
Library, i18n and blueprints, /internal, /system_stats' versions, job cancel, and our websocket events: sent to a
ComfyUI front end only once it subscribes, and never with the server's paths.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import aiohttp
import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
frontend_installed = importlib.util.find_spec("comfyui_frontend_package") is not None
templates_installed = importlib.util.find_spec("comfyui_workflow_templates_json") is not None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vramgraph.graph.engine.budget import budget_for
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ServerThread, make_app
    from vramgraph.server.frontend import front_end_root

    tmp = tmp_path_factory.mktemp("frontend-routes")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    (tmp / "models" / "vae" / "flux2-vae.png").write_bytes(_png())  # a picture beside a model: its preview
    folders = Folders(models=(tmp / "models",), input=tmp / "input", output=tmp / "output", temp=tmp / "temp")
    for d in (folders.input, folders.output, folders.temp):
        d.mkdir(parents=True)
    (folders.input / "a.png").write_bytes(_png())
    root = front_end_root("comfyui") if frontend_installed else None
    engine = Engine(folders, budget=budget_for("cpu", vram="8GiB", reserve=0, host="8GiB"))
    with ServerThread(make_app(engine, front_end=root, user_dir=tmp / "user")) as srv:
        srv.tmp = tmp
        yield srv


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


def get(srv, path: str, **params) -> requests.Response:
    return requests.get(srv.url + path, params=params, timeout=30)


@pytest.mark.skipif(not frontend_installed, reason="pip install 'vramgraph[frontend]'")
def test_the_front_end_and_our_page_are_served(server):
    page = get(server, "/")
    assert page.status_code == 200 and "ComfyUI" in page.text and page.headers["Cache-Control"] == "no-cache"
    ours = get(server, "/vramgraph/")
    assert ours.status_code == 200 and "<title>vramgraph</title>" in ours.text
    assert get(server, "/user.css").text == ""
    assert get(server, "/scripts/app.js").status_code == 200  # the shim our panel imports
    assert get(server, "/../../etc/passwd").status_code in (400, 403, 404)
    extensions = get(server, "/api/extensions").json()
    assert extensions[-1] == "/extensions/vramgraph/vramgraph_panel.js"
    assert all(e.startswith("/extensions/") and e.endswith(".js") for e in extensions)
    assert all(get(server, e).status_code == 200 for e in extensions[:3] + extensions[-1:])
    assert get(server, "/extensions/vramgraph/timeline.mjs").headers["Content-Type"].endswith("javascript")
    stats = get(server, "/system_stats").json()["system"]
    assert stats["required_frontend_version"] == "1.58.1"
    if templates_installed:
        assert stats["installed_templates_version"] == stats["required_templates_version"] is not None


def test_our_page_stays_the_default(tmp_path):
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ServerThread, make_app

    folders = Folders(models=(tmp_path,), input=tmp_path / "i", output=tmp_path / "o", temp=tmp_path / "t")
    with ServerThread(make_app(Engine(folders, allow_builtin=True), start_worker=False)) as srv:
        assert "<title>vramgraph</title>" in get(srv, "/").text
        assert get(srv, "/api/extensions").json() == ["/extensions/vramgraph/vramgraph_panel.js"]
        assert get(srv, "/assets/index.js").status_code == 404


def test_a_missing_front_end_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    from vramgraph.server import frontend

    monkeypatch.setattr(frontend.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(frontend.FrontEndMissing, match=r"pip install 'vramgraph\[frontend\]'") as e:
        frontend.front_end_root("comfyui")
    assert "\n" not in str(e.value)
    with pytest.raises(frontend.FrontEndMissing, match=r"no index\.html"):
        frontend.front_end_root(str(tmp_path))
    assert frontend.front_end_root("vramgraph") is None and frontend.front_end_root(None) is None


def test_serve_refuses_a_missing_front_end_before_loading_models(tmp_path, capsys):
    from vramgraph.__main__ import main

    code = main(["serve", "--front-end", str(tmp_path / "nowhere"), "--models", str(tmp_path), "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "has no index.html" in err, err


@pytest.mark.skipif(not templates_installed, reason="pip install comfyui-workflow-templates-json")
def test_templates(server):
    index = get(server, "/templates/index.json").json()
    names = {t["name"] for c in index for t in c["templates"]}
    assert "image_flux2_klein_text_to_image" in names
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    shipped = Path(next(iter(spec.submodule_search_locations))) / "templates" / "image_flux2_klein_text_to_image.json"
    assert get(server, "/templates/image_flux2_klein_text_to_image.json").json() == json.loads(shipped.read_text())
    thumb = get(server, "/templates/image_flux2_klein_text_to_image-1.webp")
    assert thumb.status_code == 200 and thumb.headers["Content-Type"] == "image/png"  # no media package: the tile
    for bad in ("/templates/nope.json", "/templates/nope-1.webp", "/templates/..%2F..%2Fsecret.json"):
        assert get(server, bad).status_code in (400, 404), bad
    assert get(server, "/api/workflow_templates").json() == {
        "vramgraph": sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))}
    ui = get(server, "/api/workflow_templates/vramgraph/text_to_image.json").json()
    assert {n["type"] for n in ui["nodes"]} >= {"VGSampler", "VGSaveImage"} and ui["links"]
    converted = requests.post(server.url + "/vramgraph/convert", json={"workflow": ui}, timeout=30).json()
    assert converted["prompt"].keys() == json.loads((ROOT / "workflows" / "text_to_image.json").read_text()).keys()
    assert get(server, "/api/workflow_templates/other/text_to_image.json").status_code == 404
    assert get(server, "/api/workflow_templates/vramgraph/..%2Fpyproject.json").status_code == 404


def test_model_library(server):
    folders = get(server, "/api/experiment/models").json()
    assert {"name": "diffusion_models", "folders": ["diffusion_models"]} in folders
    assert all(not any("/" in f for f in entry["folders"]) for entry in folders), "no server paths"
    models = get(server, "/api/experiment/models/diffusion_models").json()
    assert sorted(m["name"] for m in models) == ["flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"]
    assert all(m["pathIndex"] == 0 and m["size"] > 0 for m in models)
    assert get(server, "/api/experiment/models/nope").status_code == 404
    preview = get(server, "/api/experiment/models/preview/vae/0/flux2-vae.webp")
    beside = (server.tmp / "models" / "vae" / "flux2-vae.png").read_bytes()
    assert preview.status_code == 200 and preview.content == beside
    tile = get(server, "/api/experiment/models/preview/diffusion_models/0/flux-2-klein-4b.webp")
    assert tile.status_code == 200 and tile.headers["Content-Type"] == "image/png"
    for bad in ("diffusion_models/0/nope.webp", "diffusion_models/5/flux-2-klein-4b.webp",
                "diffusion_models/0/..%2F..%2Fvae%2Fflux2-vae.webp", "nope/0/x.webp"):
        assert get(server, f"/api/experiment/models/preview/{bad}").status_code == 404, bad


def test_what_the_front_end_asks_at_its_start(server):
    assert get(server, "/api/i18n").json() == {}
    assert get(server, "/api/global_subgraphs").json() == {}
    assert get(server, "/api/global_subgraphs/x").status_code == 404
    assert get(server, "/api/node_replacements").json() == {}
    assert get(server, "/internal/files/input").json() == ["a.png"]
    assert get(server, "/internal/files/models").status_code == 400
    refused = get(server, "/internal/folder_paths")
    assert refused.status_code == 403 and str(server.tmp) not in refused.text
    logs = get(server, "/internal/logs/raw").json()
    assert set(logs) == {"entries", "size"} and all(set(e) == {"t", "m"} for e in logs["entries"])
    bad = requests.patch(server.url + "/internal/logs/subscribe", json={"clientId": 3}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "clientId must be a string"


def _prompt(steps: int = 1) -> dict:
    wf = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    wf["5"]["inputs"].update(width=64, height=64)
    wf["6"]["inputs"]["steps"] = steps
    return wf


async def _run(url: str, clients: dict[str, bool], subscribe: set[str]) -> dict[str, list[dict]]:
    """Connect each client (True: it announces ComfyUI's front end first), subscribe some, queue one prompt for each
    and collect each one's messages until its prompt ends."""
    out: dict[str, list[dict]] = {}
    async with aiohttp.ClientSession() as http:
        sockets = {}
        for cid, front_end in clients.items():
            ws = await http.ws_connect(f"{url}/ws?clientId={cid}")
            if front_end:
                await ws.send_str(json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}}))
            sockets[cid] = ws
        await asyncio.sleep(0.3)
        for cid in subscribe:
            async with http.post(url + "/vramgraph/events", json={"clientId": cid}) as r:
                assert r.status == 200
        for cid, ws in sockets.items():
            async with http.post(url + "/prompt", json={"prompt": _prompt(), "client_id": cid}) as r:
                pid = (await r.json())["prompt_id"]
            msgs = out.setdefault(cid, [])
            while True:
                m = await asyncio.wait_for(ws.receive(), 120)
                if m.type != aiohttp.WSMsgType.TEXT:
                    continue
                msgs.append(json.loads(m.data))
                last = msgs[-1]
                if last["type"] in ("execution_success", "execution_error") and last["data"]["prompt_id"] == pid:
                    break
            await ws.close()
    return out


def test_our_events_go_to_pages_that_know_them_and_carry_no_paths(server):
    msgs = asyncio.run(_run(server.url, {"plain": False, "front-end": True, "front-end-panel": True},
                            {"front-end-panel"}))
    kinds = {cid: [m["type"] for m in ms] for cid, ms in msgs.items()}
    assert "vramgraph.plan" in kinds["plain"] and "vramgraph.plan" in kinds["front-end-panel"]
    assert not [k for k in kinds["front-end"] if k.startswith("vramgraph.")], kinds["front-end"]
    assert "executed" in kinds["front-end"]  # ComfyUI's own events as ever
    text = json.dumps(msgs)
    assert str(server.tmp) not in text and "/models/" not in text
    plan = next(m["data"] for m in msgs["front-end-panel"] if m["type"] == "vramgraph.plan")
    assert {k.split(":")[1] for k in plan["plan"]["models"]} == {  # kind:file name:dtype
        "flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"}
    answer = requests.post(server.url + "/vramgraph/plan", json={"prompt": _prompt()}, timeout=60)
    at = answer.text.find(str(server.tmp))
    assert answer.status_code == 200 and at < 0, answer.text[max(at - 300, 0):at + 100]
    assert 'data-model="vae:flux2-vae.safetensors:' in answer.json()["svg"]


def test_without_paths():
    from vramgraph.server.hub import without_paths

    data = {"transformer:/srv/m/diffusion_models/a b.safetensors:bf16": {"label": "transformer"},
            "steps": [{"model": "vae:C:\\models\\vae\\v.safetensors:fp32"}, "note: keep me"],
            "svg": '<g data-model="text_encoder:/x/y/q.safetensors:bf16">'}
    assert without_paths(data) == {"transformer:a b.safetensors:bf16": {"label": "transformer"},
                                   "steps": [{"model": "vae:v.safetensors:fp32"}, "note: keep me"],
                                   "svg": '<g data-model="text_encoder:q.safetensors:bf16">'}


def test_jobs_are_cancelled_pending_and_running(server):
    from vramgraph.server.app import ROUTES

    routes = server.app[ROUTES]
    long = requests.post(server.url + "/prompt", json={"prompt": _prompt(steps=400)}, timeout=30).json()["prompt_id"]
    waiting = requests.post(server.url + "/prompt", json={"prompt": _prompt(steps=2)}, timeout=30).json()["prompt_id"]
    while not routes.queue.current()[0]:
        asyncio.run(asyncio.sleep(0.05))
    r = requests.post(f"{server.url}/api/jobs/cancel", json={"job_ids": [waiting, "nope"]}, timeout=30)
    assert r.json() == {"cancelled": [waiting], "finished": [], "not_found": ["nope"]}
    assert requests.post(f"{server.url}/api/jobs/{long}/cancel", timeout=30).json() == {"id": long,
                                                                                         "status": "cancelled"}
    deadline = 120
    while get(server, f"/api/jobs/{long}").json().get("status") in ("in_progress", "pending") and deadline > 0:
        asyncio.run(asyncio.sleep(0.1))
        deadline -= 0.1
    assert get(server, f"/api/jobs/{long}").json()["status"] == "cancelled"
    assert get(server, f"/api/jobs/{waiting}").status_code == 404  # it left the queue without running
    assert requests.post(f"{server.url}/api/jobs/{long}/cancel", timeout=30).status_code == 409
    assert requests.post(f"{server.url}/api/jobs/nope/cancel", timeout=30).status_code == 404
    assert requests.post(f"{server.url}/api/jobs/cancel", json={"job_ids": "x"}, timeout=30).status_code == 400


@pytest.mark.skipif(not frontend_installed, reason="pip install 'vramgraph[frontend]'")
def test_serve_front_end_comfyui_keeps_user_data_in_dot_user(tmp_path):
    """The real command: `vramgraph serve --front-end comfyui` in a folder; settings land in ./user."""
    from serving import serve_process
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models

    write_tiny_models(tmp_path / "models", names=SHIPPED_NAMES)
    with serve_process(tmp_path, "--front-end", "comfyui") as (url, _proc, log):
        assert "ComfyUI" in requests.get(url + "/", timeout=30).text
        assert "<title>vramgraph</title>" in requests.get(url + "/vramgraph/", timeout=30).text
        assert requests.post(url + "/api/settings/Comfy.Locale", json="en", timeout=30).status_code == 200
        assert "front end:" in log.read_text()
    assert json.loads((tmp_path / "user" / "default" / "comfy.settings.json").read_text()) == {"Comfy.Locale": "en"}


def test_the_config_keys_pick_the_front_end_and_user_folder(tmp_path):
    import argparse

    from vramgraph.server.app import _front_end_and_user_dir

    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<!doctype html>")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"front_end": str(site), "user_dir": str(tmp_path / "u")}))
    args = argparse.Namespace(config=str(config), front_end=None, user_dir=None)
    assert _front_end_and_user_dir(args) == (site.resolve(), tmp_path / "u")
    args = argparse.Namespace(config=str(config), front_end="vramgraph", user_dir=str(tmp_path / "v"))
    assert _front_end_and_user_dir(args) == (None, tmp_path / "v")  # the options win over the config
    config.write_text(json.dumps({"front_end": 3}))
    with pytest.raises(ValueError, match="config front_end"):
        _front_end_and_user_dir(argparse.Namespace(config=str(config), front_end=None, user_dir=None))
