"""`vramgraph fetch` against a local server that plays the Hugging Face Hub ($HF_ENDPOINT) and a plain web server,
on a free loopback port: never the internet. The files served are the tiny random-weight models, so what is
fetched then validates; the workflows are the shipped ones and ComfyUI's own klein templates (whose
`properties.models` embed the URLs)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_cli import template
from vramgraph.cli import main
from vramgraph.nodes.sources import builtin, hub_file

T2I = Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Hub:
    """What the fake Hub serves: (repo, path) -> bytes, gated repos, cuts (a GET of that path sends at most this many
    bytes, then drops the connection, `cut_times` times), and every request seen as (method, path, Range)."""

    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    plain: dict[str, bytes] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)
    cut: int | None = None
    cut_times: int = 0
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _find(self) -> tuple[bytes | None, dict[str, str]]:
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", self.path)
            if m:
                repo, _, path = m.groups()
                if repo in hub.gated:
                    return None, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted."}
                data = hub.files.get((repo, path))
                if data is None:
                    return None, {"X-Error-Code": "EntryNotFound"}
                return data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            data = hub.plain.get(self.path)
            return data, {}

        def _answer(self, body: bool) -> None:
            hub.seen.append((self.command, self.path, self.headers.get("Range")))
            data, headers = self._find()
            if data is None:
                gated = headers.get("X-Error-Code") == "GatedRepo"
                self.send_response(403 if gated else 404)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                start = int(rng[6:].split("-")[0])
            self.send_response(206 if start else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            chunk = data[start:]
            if hub.cut is not None and hub.cut_times > 0:
                hub.cut_times -= 1
                self.wfile.write(chunk[:hub.cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(chunk)

        def do_HEAD(self) -> None:
            self._answer(False)

        def do_GET(self) -> None:
            self._answer(True)

    return Handler


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    state = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def serve_builtin(hub: Hub, name: str, data: bytes) -> None:
    h = hub_file(builtin(name).url)
    hub.files[(h.repo, h.path)] = data


def tiny_bytes(tiny_models: Path) -> dict[str, bytes]:
    where = {"flux-2-klein-4b.safetensors": "diffusion_models", "qwen_3_4b.safetensors": "text_encoders",
             "flux2-vae.safetensors": "vae"}
    return {name: (tiny_models / folder / name).read_bytes() for name, folder in where.items()}


def test_fetch_a_shipped_workflow_then_it_validates(hub: Hub, tiny_models: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    files = tiny_bytes(tiny_models)
    for name, data in files.items():
        serve_builtin(hub, name, data)
    models = tmp_path / "ComfyUI" / "models"  # a fresh ComfyUI: main.py, custom_nodes/, an empty models/
    models.mkdir(parents=True)
    (tmp_path / "ComfyUI" / "custom_nodes").mkdir()
    (tmp_path / "ComfyUI" / "main.py").write_text("")
    assert main(["fetch", str(T2I), "--models", str(models), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"flux2-vae.safetensors  {len(files['flux2-vae.safetensors']) / 2**20:.1f} MiB  -> " \
           f"{models / 'vae' / 'flux2-vae.safetensors'}" in out
    assert not any(p.is_file() for p in models.rglob("*"))  # a dry run fetches nothing
    assert main(["fetch", str(T2I), "--models", str(tmp_path / "ComfyUI")]) == 0, capsys.readouterr().err
    assert (models / "diffusion_models" / "flux-2-klein-4b.safetensors").read_bytes() == \
        files["flux-2-klein-4b.safetensors"]
    assert (models / "text_encoders" / "qwen_3_4b.safetensors").read_bytes() == files["qwen_3_4b.safetensors"]
    assert not list(models.rglob(".vramgraph-fetch"))  # the staging folders are gone
    assert main(["validate", str(T2I), "--models", str(models)]) == 0
    gets = len([s for s in hub.seen if s[0] == "GET"])
    assert main(["fetch", str(T2I), "--models", str(models)]) == 0  # all present: nothing is downloaded again
    assert len([s for s in hub.seen if s[0] == "GET"]) == gets


def _with_hash(workflow: dict, name: str, sha: str) -> dict:
    out = copy.deepcopy(workflow)
    subs = (out.get("definitions") or {}).get("subgraphs") or []
    for node in out["nodes"] + [n for s in subs for n in s["nodes"]]:
        for m in (node.get("properties") or {}).get("models") or []:
            if m["name"] == name:
                m.update(hash=sha, hash_type="SHA256")
    return out


def test_fetch_a_comfyui_template_from_its_embedded_urls_and_check_the_hash(hub: Hub, tiny_models: Path,
                                                                            tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """The 4B distilled edit template embeds qwen_3_4b from Comfy-Org/z_image_turbo (the built-in list has it from
    Comfy-Org/flux2-klein): the workflow's own URL is used. A hash the file does not match removes it."""
    path = template("image_flux2_klein_image_edit_4b_distilled.json")
    wf = json.loads(path.read_text())
    files = tiny_bytes(tiny_models)
    hub.files[("black-forest-labs/FLUX.2-klein-4b-fp8", "flux-2-klein-4b-fp8.safetensors")] = \
        files["flux-2-klein-4b.safetensors"]
    hub.files[("Comfy-Org/z_image_turbo", "split_files/text_encoders/qwen_3_4b.safetensors")] = \
        files["qwen_3_4b.safetensors"]
    serve_builtin(hub, "flux2-vae.safetensors", files["flux2-vae.safetensors"])
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_with_hash(wf, "flux2-vae.safetensors",
                                          hashlib.sha256(files["flux2-vae.safetensors"]).hexdigest())))
    models = tmp_path / "models"
    assert main(["fetch", str(good), "--models", str(models)]) == 0, capsys.readouterr().err
    assert (models / "text_encoders" / "qwen_3_4b.safetensors").is_file()
    assert (models / "diffusion_models" / "flux-2-klein-4b-fp8.safetensors").is_file()
    assert any("z_image_turbo" in s[1] for s in hub.seen)
    (models / "vae" / "flux2-vae.safetensors").unlink()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with_hash(wf, "flux2-vae.safetensors", "0" * 64)))
    assert main(["fetch", str(bad), "--models", str(models)]) == 2
    err = capsys.readouterr().err
    assert f"is not the expected {'0' * 64}; the download was removed" in err
    assert not (models / "vae" / "flux2-vae.safetensors").exists()


def test_a_gated_file_says_what_the_license_page_needs_and_the_token(hub: Hub, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    hub.gated.add("black-forest-labs/FLUX.2-klein-9b-fp8")
    assert main(["fetch", "--model", "flux-2-klein-9b-fp8.safetensors", "--models", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "the repository is gated (FLUX Non-Commercial License)" in err
    assert "https://huggingface.co/black-forest-labs/FLUX.2-klein-9b-fp8" in err and "HF_TOKEN=<token>" in err
    assert not (tmp_path / "diffusion_models" / "flux-2-klein-9b-fp8.safetensors").exists()
    assert main(["fetch", "--model", "flux-2-klein-9b.safetensors", "--models", str(tmp_path)]) == 2
    assert "not in the built-in list; did you mean" in capsys.readouterr().err


def test_an_interrupted_download_resumes(hub: Hub, tiny_models: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub path: connections dropped mid-file, the download goes on from where it stopped (Range requests;
    huggingface_hub writes 10 MiB chunks, made 64 KiB here for a file of a few MiB). A plain URL: a part left by an
    earlier run is continued, not started over."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    data = tiny_bytes(tiny_models)["flux2-vae.safetensors"]
    serve_builtin(hub, "flux2-vae.safetensors", data)
    cut = (len(data) // 3) >> 16 << 16  # whole chunks
    hub.cut, hub.cut_times = cut, 2
    assert main(["fetch", "--model", "flux2-vae.safetensors", "--models", str(tmp_path)]) == 0
    assert (tmp_path / "vae" / "flux2-vae.safetensors").read_bytes() == data
    assert [r for m, p, r in hub.seen if m == "GET" and r] == [f"bytes={cut}-", f"bytes={2 * cut}-"]

    hub.plain["/files/my-vae.safetensors"] = data
    wf = {"nodes": [{"id": 1, "type": "VAELoader", "widgets_values": ["my-vae.safetensors"], "inputs": [],
                     "outputs": [{"name": "VAE", "type": "VAE", "links": []}],
                     "properties": {"models": [{"name": "my-vae.safetensors", "directory": "vae",
                                                "url": f"{hub.url}/files/my-vae.safetensors"}]}}],
          "links": [], "version": 0.4}
    (tmp_path / "wf.json").write_text(json.dumps(wf))
    part = tmp_path / "vae" / "my-vae.safetensors.part"
    part.write_bytes(data[:1000])
    assert main(["fetch", str(tmp_path / "wf.json"), "--models", str(tmp_path)]) == 0
    assert (tmp_path / "vae" / "my-vae.safetensors").read_bytes() == data and not part.exists()
    assert hub.seen[-1] == ("GET", "/files/my-vae.safetensors", "bytes=1000-")


def test_fetch_what_a_pngs_workflow_needs(hub: Hub, tiny_models: Path, tmp_path: Path) -> None:
    """A PNG saved by ComfyUI carries its UI workflow, `properties.models` included: fetch reads it from there."""
    from PIL import Image, PngImagePlugin

    data = tiny_bytes(tiny_models)["flux2-vae.safetensors"]
    hub.files[("someone/vae-repo", "flux2-vae.safetensors")] = data
    wf = {"nodes": [{"id": 3, "type": "VAELoader", "widgets_values": ["flux2-vae.safetensors"], "inputs": [],
                     "outputs": [{"name": "VAE", "type": "VAE", "links": []}],
                     "properties": {"models": [{"name": "flux2-vae.safetensors", "directory": "vae",
                                                "url": "https://huggingface.co/someone/vae-repo/resolve/main/"
                                                       "flux2-vae.safetensors"}]}}],
          "links": [], "version": 0.4}
    info = PngImagePlugin.PngInfo()
    info.add_text("workflow", json.dumps(wf))
    Image.new("RGB", (8, 8)).save(tmp_path / "made.png", pnginfo=info)
    assert main(["fetch", str(tmp_path / "made.png"), "--models", str(tmp_path / "models")]) == 0
    assert (tmp_path / "models" / "vae" / "flux2-vae.safetensors").read_bytes() == data
    assert any(p.startswith("/someone/vae-repo/") for _, p, _ in hub.seen)
