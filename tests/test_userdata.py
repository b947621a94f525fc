"""Settings and user files kept under --user-dir (server/userdata.py), and the bad writes refused.

A real server on loopback (no worker: nothing here queues a prompt) over a user folder in a tmp dir. Settings and a
saved workflow survive a new app on the same folder; every bad write (traversal, absolute paths, links, oversized
bodies, invalid JSON, a foreign origin) is refused 4xx and leaves the tree outside the user folder as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import requests
from vramgraph.server import userdata


@pytest.fixture
def app_on(tmp_path):
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ServerThread, make_app

    folders = Folders(models=(tmp_path / "models",), input=tmp_path / "input", output=tmp_path / "output",
                      temp=tmp_path / "temp")
    engine = Engine(folders, allow_builtin=True)

    def start(user: Path | None) -> ServerThread:
        return ServerThread(make_app(engine, start_worker=False, user_dir=user)).start()

    return start


def tree(root: Path) -> dict[str, bytes | str]:
    """Every file (its bytes) and link (its target) under `root`."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[p.relative_to(root).as_posix()] = os.readlink(p)
        elif p.is_file():
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def test_settings_and_workflows_are_kept_across_restarts(app_on, tmp_path):
    user = tmp_path / "user"
    srv = app_on(user)
    try:
        url = srv.url + "/api"
        assert requests.get(url + "/settings", timeout=10).json() == {}
        assert requests.post(url + "/settings/Comfy.TutorialCompleted", json=True, timeout=10).status_code == 200
        assert requests.post(url + "/settings", json={"Comfy.Locale": "fr", "Comfy.Zoom": 1.5},
                             timeout=10).status_code == 200
        wf = {"nodes": [{"id": 1, "type": "SaveImage"}], "links": [], "version": 0.4}
        r = requests.post(url + "/userdata/workflows%2Fmy%20flow.json?overwrite=false&full_info=true",
                          data=json.dumps(wf), timeout=10)
        assert r.status_code == 200 and r.json()["path"] == "workflows/my flow.json", r.text
        assert set(r.json()) == {"path", "size", "modified", "created"}
        again = requests.post(url + "/userdata/workflows%2Fmy%20flow.json?overwrite=false", data="{}", timeout=10)
        assert again.status_code == 409  # as ComfyUI: overwrite=false and the file exists
        assert requests.get(url + "/userdata", params={"dir": "workflows", "recurse": "true"},
                            timeout=10).json() == ["my flow.json"]
        v2 = requests.get(url + "/v2/userdata", timeout=10).json()
        assert [e["path"] for e in v2 if e["type"] == "directory"] == ["subgraphs", "workflows"]
        assert {"name": "my flow.json", "path": "workflows/my flow.json", "type": "file"}.items() <= \
            next(e for e in v2 if e["type"] == "file" and e["name"] == "my flow.json").items()
    finally:
        srv.stop()
    srv = app_on(user)  # a new server on the same folder: all of it is still there
    try:
        url = srv.url + "/api"
        assert requests.get(url + "/settings", timeout=10).json() == {
            "Comfy.TutorialCompleted": True, "Comfy.Locale": "fr", "Comfy.Zoom": 1.5}
        assert requests.get(url + "/settings/Comfy.Locale", timeout=10).json() == "fr"
        r = requests.get(url + "/userdata/workflows%2Fmy%20flow.json", timeout=10)
        assert r.json() == wf and r.headers["Content-Disposition"].startswith("attachment")
        moved = requests.post(url + "/userdata/workflows%2Fmy%20flow.json/move/workflows%2Frenamed.json", timeout=10)
        assert moved.status_code == 200 and moved.json() == "workflows/renamed.json"
        assert requests.delete(url + "/userdata/workflows%2Frenamed.json", timeout=10).status_code == 204
        assert requests.get(url + "/userdata", params={"dir": "workflows"}, timeout=10).json() == []
    finally:
        srv.stop()
    assert json.loads((user / "default" / "comfy.settings.json").read_text())["Comfy.Zoom"] == 1.5
    assert not [p for p in user.rglob("*") if ".part" in p.name]  # no temporary file left behind


def test_the_front_ends_start_files_answer_without_a_file(app_on, tmp_path):
    srv = app_on(tmp_path / "user")
    try:
        css = requests.get(srv.url + "/api/userdata/user.css", timeout=10)
        assert css.status_code == 200 and css.text == "" and css.headers["Content-Type"].startswith("text/css")
        assert requests.get(srv.url + "/api/userdata/comfy.templates.json", timeout=10).json() == []
        assert requests.get(srv.url + "/api/userdata/other.json", timeout=10).status_code == 404
        (tmp_path / "user" / "default" / "user.css").write_text("body { color: red }")
        css = requests.get(srv.url + "/api/userdata/user.css", timeout=10)
        assert css.text == "body { color: red }" and css.headers["Content-Disposition"] == "inline"
    finally:
        srv.stop()


def test_bad_writes_are_refused_and_nothing_is_written_outside(app_on, tmp_path, monkeypatch):
    user = tmp_path / "user"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.json").write_text('{"keep": true}')
    (user / "default").mkdir(parents=True)
    (user / "default" / "escape").symlink_to(outside, target_is_directory=True)  # a folder link leading out
    (user / "default" / "linked.json").symlink_to(outside / "victim.json")  # a file link leading out
    monkeypatch.setattr(userdata, "MAX_FILE_BYTES", 4096)
    before = tree(tmp_path)
    srv = app_on(user)
    try:
        url = srv.url + "/api"
        cases = {
            "traversal": ("POST", "/userdata/..%2F..%2Foutside%2Fnew.json", "{}", {}),
            "traversal inside": ("POST", "/userdata/workflows%2F..%2F..%2Fx.json", "{}", {}),
            "absolute": ("POST", "/userdata/%2Ftmp%2Fx.json", "{}", {}),
            "backslash": ("POST", "/userdata/..%5C..%5Cx.json", "{}", {}),
            "control character": ("POST", "/userdata/a%0Ab.json", "{}", {}),
            "folder link": ("POST", "/userdata/escape%2Fnew.json", "{}", {}),
            "file link": ("POST", "/userdata/linked.json", "{}", {}),
            "move onto a link": ("POST", "/userdata/comfy.templates.json/move/linked.json", "", {}),
            "delete through a link": ("DELETE", "/userdata/escape%2Fvictim.json", "", {}),
            "oversized": ("POST", "/userdata/workflows%2Fbig.json", "[" + "0," * 4000 + "0]", {}),
            "oversized, no length": ("POST", "/userdata/workflows%2Fbig.txt", iter([b"x" * 3000, b"y" * 3000]), {}),
            "invalid JSON file": ("POST", "/userdata/workflows%2Fbad.json", "{not json", {}),
            "NaN in a JSON file": ("POST", "/userdata/workflows%2Fnan.json", '{"a": NaN}', {}),
            "invalid settings": ("POST", "/settings", "{not json", {}),
            "settings not an object": ("POST", "/settings", "[1, 2]", {}),
            "oversized setting": ("POST", "/settings/Big", json.dumps("x" * 5000), {}),
            "foreign origin": ("POST", "/userdata/workflows%2Fx.json", "{}", {"Origin": "http://evil.example"}),
            "foreign origin, settings": ("POST", "/settings/Comfy.Locale", '"xx"', {"Origin": "http://evil.example"}),
            "cross-site": ("DELETE", "/userdata/comfy.settings.json", "", {"Sec-Fetch-Site": "cross-site"}),
        }
        for name, (method, path, body, headers) in cases.items():
            r = requests.request(method, url + path, data=body, headers=headers, timeout=10)
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
            if r.headers.get("Content-Type", "").startswith("application/json"):
                error = r.json()["error"]
                assert {"type", "message", "details", "extra_info"} <= set(error), (name, error)
        r = requests.post(url + "/userdata/escape%2Fnew.json", data="{}", timeout=10)
        assert r.status_code == 403 and "link" in r.json()["error"]["message"]
        r = requests.post(url + "/userdata/workflows%2Fbig.json", data="[" + "0," * 4000 + "0]", timeout=10)
        assert r.status_code == 413 and "MiB" in r.json()["error"]["details"]
        assert requests.get(url + "/settings", timeout=10).json() == {}
    finally:
        srv.stop()
    after = tree(tmp_path)
    made = {k for k in after if k not in before}
    assert made <= {"user/default/workflows", "user/default/subgraphs"}, made  # folders only: no file was written
    assert after == {k: v for k, v in before.items()}, "a refused write changed a file"


def test_paths_are_cleaned_as_comfyui_reads_them():
    assert userdata.clean_relative("workflows%2Fa%20b.json") == "workflows/a b.json"
    assert userdata.clean_relative("workflows/sub/c.json") == "workflows/sub/c.json"
    for bad in ("", "/etc/passwd", "a/../../b", "a//b", "./a", "C:x.json", "a\\b", "a\x00b", "x" * 300):
        with pytest.raises(userdata.UserPathError):
            userdata.clean_relative(bad)
