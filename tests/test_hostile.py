"""A real `vramgraph serve` process on tiny models, tried as an attacker would from a browser and beyond.

Every hostile case gets its 4xx in ComfyUI's error shape (or its file as a harmless attachment), and the
server is alive after each. Then a property-based fuzz (hypothesis) of every route: random JSON and bytes
bodies and query strings never get a 5xx and never stop the server. The fuzz is derandomized (the same
examples every run); VRAMGRAPH_FUZZ_EXAMPLES=500 runs more per route.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from serving import serve_process

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 180
TIMEOUT = 60
FUZZ_EXAMPLES = int(os.environ.get("VRAMGRAPH_FUZZ_EXAMPLES", "40"))


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen
    input: Path
    output: Path
    log: Path

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.tail()}"
        r = requests.get(self.url + "/system_stats", timeout=TIMEOUT)
        assert r.status_code == 200, r.status_code

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models

    tmp = tmp_path_factory.mktemp("hostile")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    inp, out = tmp / "input", tmp / "output"
    inp.mkdir()
    out.mkdir()
    with serve_process(tmp, timeout=START_TIMEOUT) as (url, proc, log):
        yield Server(url, int(url.rsplit(":", 1)[1]), proc, inp, out, log)


def text_to_image(size: int = 64, steps: int = 2, prefix: str = "hostile") -> dict:
    prompt = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompt["5"]["inputs"].update(width=size, height=size)
    prompt["6"]["inputs"]["steps"] = steps
    prompt["8"]["inputs"]["filename_prefix"] = prefix
    return prompt


def png_bytes(size: int = 8, color: tuple[int, int, int] = (1, 2, 3)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def assert_error_shape(r: requests.Response) -> None:
    """ComfyUI's error body: {"error": {type, message, details, extra_info}, "node_errors": {...}}."""
    body = r.json()
    assert set(body) == {"error", "node_errors"}, body
    assert set(body["error"]) == {"type", "message", "details", "extra_info"}, body
    assert isinstance(body["node_errors"], dict)


def wait_history(url: str, pid: str) -> dict:
    end = time.monotonic() + TIMEOUT * 2
    while time.monotonic() < end:
        h = requests.get(f"{url}/history/{pid}", timeout=TIMEOUT).json()
        if h:
            return h[pid]
        time.sleep(0.1)
    raise AssertionError(f"prompt {pid} did not finish")


# ------------------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One hostile request and the answer it must get (`check` looks further at the response)."""

    name: str
    method: str
    path: str
    status: tuple[int, ...]
    kwargs: dict = field(default_factory=dict)
    check: Callable[[requests.Response], None] | None = None
    shape: bool = True  # the answer has ComfyUI's error shape
    setup: Callable[[Server], None] | None = None


def _raw(body: str | bytes) -> dict:
    return {"data": body, "headers": {"Content-Type": "application/json"}}


def _prompt(**fields: Any) -> dict:
    return {"json": {"prompt": text_to_image(), **fields}}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _write(name: str, data: bytes, where: str = "input") -> Callable[[Server], None]:
    def setup(srv: Server) -> None:
        (srv.input if where == "input" else srv.output).joinpath(name).write_bytes(data)

    return setup


def _attachment(r: requests.Response) -> None:
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert r.headers["Content-Disposition"].startswith("attachment;"), r.headers["Content-Disposition"]
    assert r.headers["Content-Type"].split(";")[0] in ("application/octet-stream",), r.headers["Content-Type"]


def _inline_image(r: requests.Response) -> None:
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert r.headers["Content-Type"] == "image/png" and r.headers["Content-Disposition"].startswith("inline;")


def _upload(name: str, data: bytes, mime: str = "image/png", **fields: str) -> dict:
    return {"files": {"image": (name, data, mime)}, "data": fields}


def _form(filename: bytes, data: bytes) -> dict:
    """A multipart body written by hand, with the file name's bytes as they are (requests would escape some)."""
    body = (b'--zz\r\nContent-Disposition: form-data; name="image"; filename="' + filename
            + b'"\r\nContent-Type: image/png\r\n\r\n' + data + b"\r\n--zz--\r\n")
    return {"data": body, "headers": {"Content-Type": "multipart/form-data; boundary=zz"}}


HTML = b"<html><body><script>fetch('/prompt', {method: 'POST'})</script></body></html>"
SVG = b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'
JS = b"fetch('/interrupt', {method: 'POST'})"
EVIL = "http://evil.example"

CASES = [
    # origins: a page of another site, DNS rebinding, cross-site fetches
    Case("foreign Origin on POST /prompt", "POST", "/prompt", (403,), {**_prompt(), "headers": {"Origin": EVIL}}),
    Case("foreign Origin on GET /history", "GET", "/history", (403,), {"headers": {"Origin": EVIL}}),
    Case("foreign Origin on POST /interrupt", "POST", "/interrupt", (403,), {"headers": {"Origin": EVIL}}),
    Case("foreign Origin on POST /queue", "POST", "/queue", (403,), {"json": {"clear": True},
                                                                     "headers": {"Origin": EVIL}}),
    Case("Origin null (sandboxed frame)", "POST", "/prompt", (403,), {**_prompt(), "headers": {"Origin": "null"}}),
    Case("Origin of another local port", "POST", "/free", (403,), {"json": {}, "headers": {
        "Origin": "http://127.0.0.1:1"}}),
    Case("Origin localhost vs Host 127.0.0.1", "POST", "/interrupt", (403,), {"headers": {
        "Origin": "http://localhost"}}),
    Case("unreadable Origin", "GET", "/queue", (403,), {"headers": {"Origin": "http://[::1"}}),
    Case("foreign Host (DNS rebinding)", "GET", "/system_stats", (403,), {"headers": {"Host": "evil.example"}}),
    Case("foreign Host and matching Origin", "POST", "/prompt", (403,), {**_prompt(), "headers": {
        "Host": "evil.example:8188", "Origin": "http://evil.example:8188"}}),
    Case("rebinding name that resolves to loopback", "GET", "/history", (403,), {"headers": {
        "Host": "127.0.0.1.nip.io"}}),
    Case("unreadable Host", "GET", "/queue", (403,), {"headers": {"Host": "127.0.0.1:notaport"}}),
    Case("cross-site POST /prompt", "POST", "/prompt", (403,), {**_prompt(), "headers": {
        "Sec-Fetch-Site": "cross-site"}}),
    Case("cross-site POST /interrupt", "POST", "/interrupt", (403,), {"headers": {"Sec-Fetch-Site": "cross-site"}}),
    Case("cross-site POST /upload/image", "POST", "/upload/image", (403,), {
        **_upload("x.png", png_bytes()), "headers": {"Sec-Fetch-Site": "cross-site"}}),
    Case("cross-site POST /history clear", "POST", "/history", (403,), {"json": {"clear": True}, "headers": {
        "Sec-Fetch-Site": "cross-site"}}),
    # POST /prompt bodies
    Case("body not JSON", "POST", "/prompt", (400,), _raw("{")),
    Case("body invalid UTF-8", "POST", "/prompt", (400,), _raw(b'{"prompt": "\xff\xfe"}')),
    Case("body a JSON array", "POST", "/prompt", (400,), {"json": [1, 2]}),
    Case("body empty", "POST", "/prompt", (400,), _raw("")),
    Case("no prompt", "POST", "/prompt", (400,), {"json": {"client_id": "a"}}),
    Case("number NaN", "POST", "/prompt", (400,), _raw(
        '{"prompt": ' + json.dumps(text_to_image()) + ', "number": NaN}')),
    Case("number Infinity", "POST", "/prompt", (400,), _raw('{"prompt": {}, "number": -Infinity}')),
    Case("number a word", "POST", "/prompt", (400,), _prompt(number="soon")),
    Case("number a list", "POST", "/prompt", (400,), _prompt(number=[1])),
    Case("number true", "POST", "/prompt", (400,), _prompt(number=True)),
    Case("number 1e999 as text", "POST", "/prompt", (400,), _prompt(number="1e999")),
    Case("extra_data a list", "POST", "/prompt", (400,), _prompt(extra_data=[["client_id", "x"]])),
    Case("extra_data a string", "POST", "/prompt", (400,), _prompt(extra_data="ab")),
    Case("extra_pnginfo a list", "POST", "/prompt", (400,), _prompt(extra_data={"extra_pnginfo": [1]})),
    Case("client_id a list", "POST", "/prompt", (400,), _prompt(client_id=["a", "b"])),
    Case("client_id an object", "POST", "/prompt", (400,), _prompt(client_id={"a": 1})),
    Case("client_id a number", "POST", "/prompt", (400,), _prompt(client_id=5)),
    Case("client_id in extra_data a list", "POST", "/prompt", (400,), _prompt(extra_data={"client_id": [1]})),
    Case("client_id too long", "POST", "/prompt", (400,), _prompt(client_id="c" * 5000)),
    Case("client_id with a newline", "POST", "/prompt", (400,), _prompt(client_id="a\nb")),
    Case("partial_execution_targets a string", "POST", "/prompt", (400,), _prompt(partial_execution_targets="8")),
    Case("partial_execution_targets an object", "POST", "/prompt", (400,),
         _prompt(partial_execution_targets={"8": 1})),
    Case("partial_execution_targets a number", "POST", "/prompt", (400,), _prompt(partial_execution_targets=8)),
    Case("partial_execution_targets of lists", "POST", "/prompt", (400,), _prompt(partial_execution_targets=[[8]])),
    Case("prompt_id a list", "POST", "/prompt", (400,), _prompt(prompt_id=["x"])),
    Case("prompt_id with a NUL", "POST", "/prompt", (400,), _prompt(prompt_id="a\x00b")),
    Case("deep nesting, body", "POST", "/prompt", (400,), _raw(_nested(100_000))),
    Case("deep nesting, input value", "POST", "/prompt", (400,), _raw(
        '{"prompt": {"1": {"class_type": "VGEmptyLatent", "inputs": {"width": ' + _nested(5000) + '}}}}')),
    Case("prompt a string", "POST", "/prompt", (400,), {"json": {"prompt": "x"}}),
    Case("prompt with no outputs", "POST", "/prompt", (400,), {"json": {"prompt": {}}}),
    Case("class_type with a NUL", "POST", "/prompt", (400,), {"json": {"prompt": {
        "1": {"class_type": "VGSave\x00Image", "inputs": {}}}}}),
    Case("NaN in an input", "POST", "/prompt", (400,), _raw(json.dumps({"prompt": text_to_image()}).replace(
        '"guidance": 1.0', '"guidance": NaN'))),
    Case("infinite float input as text", "POST", "/prompt", (400,), {"json": {"prompt": {
        **text_to_image(), "6": {**text_to_image()["6"], "inputs": {**text_to_image()["6"]["inputs"],
                                                                     "guidance": "inf"}}}}}),
    Case("an int of 5000 digits", "POST", "/prompt", (400,), _raw(json.dumps({"prompt": text_to_image()}).replace(
        '"seed": 42', '"seed": ' + "9" * 5000))),
    Case("a link to a node id with a NUL", "POST", "/prompt", (400,), {"json": {"prompt": {
        **text_to_image(), "7": {"class_type": "VGVAEDecode", "inputs": {"samples": ["6\x00", 0],
                                                                          "vae": ["3", 0]}}}}}),
    # /queue, /history, /interrupt, /free bodies
    Case("/queue body an array", "POST", "/queue", (400,), {"json": []}),
    Case("/queue delete a string", "POST", "/queue", (400,), {"json": {"delete": "abc"}}),
    Case("/queue delete of lists", "POST", "/queue", (400,), {"json": {"delete": [[1]]}}),
    Case("/queue delete an object", "POST", "/queue", (400,), {"json": {"delete": {"a": 1}}}),
    Case("/queue body not JSON", "POST", "/queue", (400,), _raw("clear")),
    Case("/history body an array", "POST", "/history", (400,), {"json": []}),
    Case("/history delete a number", "POST", "/history", (400,), {"json": {"delete": 5}}),
    Case("/history body a string", "POST", "/history", (400,), {"json": "clear"}),
    Case("/history max_items not ASCII digits", "GET", "/history?max_items=%C2%B2", (200,), shape=False),
    Case("/history max_items huge", "GET", "/history?max_items=" + "9" * 30, (200,), shape=False),
    Case("/interrupt prompt_id a list", "POST", "/interrupt", (400,), {"json": {"prompt_id": [1]}}),
    Case("/interrupt body not JSON", "POST", "/interrupt", (400,), _raw("{")),
    Case("/free body an array", "POST", "/free", (400,), {"json": [True]}),
    # /view
    Case("/view filename with a NUL", "GET", "/view?filename=a%00.png", (400,)),
    Case("/view subfolder with a NUL", "GET", "/view?filename=a.png&subfolder=x%00", (400, 403)),
    Case("/view unknown type", "GET", "/view?filename=a.png&type=models", (400,)),
    Case("/view out of its folder", "GET", "/view?filename=passwd&subfolder=../../../../etc", (403,)),
    Case("/view preview of a non-image", "GET", "/view?filename=notes.png&type=input&preview=webp;50", (400,),
         setup=_write("notes.png", b"root:x:0:0:root:/root:/bin/bash\n")),
    Case("/view preview quality=99999", "GET", "/view?filename=ok.png&type=input&preview=webp;99999", (400,),
         setup=_write("ok.png", png_bytes())),
    Case("/view preview quality=0", "GET", "/view?filename=ok.png&type=input&preview=jpeg;0", (400,),
         setup=_write("ok.png", png_bytes())),
    Case("/view HTML is an attachment", "GET", "/view?filename=x.html&type=input", (200,), check=_attachment,
         shape=False, setup=_write("x.html", HTML)),
    Case("/view XHTML is an attachment", "GET", "/view?filename=x.xhtml&type=input", (200,), check=_attachment,
         shape=False, setup=_write("x.xhtml", HTML)),
    Case("/view JS is an attachment", "GET", "/view?filename=x.js&type=input", (200,), check=_attachment,
         shape=False, setup=_write("x.js", JS)),
    Case("/view CSS is an attachment", "GET", "/view?filename=x.css&type=input", (200,), check=_attachment,
         shape=False, setup=_write("x.css", b"body{}")),
    Case("/view SVG is an attachment", "GET", "/view?filename=x.svg&type=input", (200,), check=_attachment,
         shape=False, setup=_write("x.svg", SVG)),
    Case("/view unknown type is an attachment", "GET", "/view?filename=x.bin&type=input", (200,), check=_attachment,
         shape=False, setup=_write("x.bin", HTML)),
    Case("/view PNG inline, nosniff", "GET", "/view?filename=ok.png", (200,), check=_inline_image, shape=False,
         setup=_write("ok.png", png_bytes(), "output")),
    # /upload/image
    Case("upload x.html", "POST", "/upload/image", (400,), _upload("x.html", HTML, "text/html")),
    Case("upload x.js", "POST", "/upload/image", (400,), _upload("x.js", JS, "text/javascript")),
    Case("upload x.svg", "POST", "/upload/image", (400,), _upload("x.svg", SVG, "image/svg+xml")),
    Case("upload HTML named x.png", "POST", "/upload/image", (400,), _upload("x.png", HTML)),
    Case("upload a PNG named x.html", "POST", "/upload/image", (400,), _upload("x.html", png_bytes())),
    Case("upload a truncated PNG", "POST", "/upload/image", (400,), _upload("cut.png", png_bytes(64)[:60])),
    Case("upload a name with a control character", "POST", "/upload/image", (400,), _form(b"a\x01b.png", png_bytes())),
    Case("upload a name with a NUL", "POST", "/upload/image", (400,), _form(b"a\x00b.png", png_bytes())),
    Case("upload a JSON body", "POST", "/upload/image", (400,), {"json": {"image": "x.png"}}),
    Case("upload a broken form", "POST", "/upload/image", (400,), {
        "data": b"--zz\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n\r\nxx",
        "headers": {"Content-Type": "multipart/form-data; boundary=zz"}}),
    Case("upload subfolder with a NUL", "POST", "/upload/image", (400,),
         _upload("a.png", png_bytes(), subfolder="x\x00y")),
    # our routes
    Case("/vramgraph/plan not JSON", "POST", "/vramgraph/plan", (400,), _raw("{")),
    Case("/vramgraph/plan prompt a string", "POST", "/vramgraph/plan", (400,), {"json": {"prompt": "x"}}),
    Case("/vramgraph/plan NaN", "POST", "/vramgraph/plan", (400,), _raw('{"prompt": {"1": NaN}}')),
    Case("/vramgraph/convert an array", "POST", "/vramgraph/convert", (400,), {"json": []}),
    Case("/vramgraph/convert nodes a string", "POST", "/vramgraph/convert", (400,), {"json": {"workflow": {
        "nodes": "x", "links": 5}}}),
    Case("/vramgraph/ui node not an object", "POST", "/vramgraph/ui", (400,), {"json": {"prompt": {"1": 5}}}),
    Case("/vramgraph/workflows out of its folder", "GET", "/vramgraph/workflows/..%2F..%2Fpyproject", (404,),
         shape=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request(server: Server, case: Case) -> None:
    if case.setup is not None:
        case.setup(server)
    kwargs = {"timeout": TIMEOUT, **case.kwargs}
    r = requests.request(case.method, server.url + case.path, **kwargs)
    assert r.status_code in case.status, (r.status_code, r.text[:500])
    if case.shape:
        assert_error_shape(r)
    if case.check is not None:
        case.check(r)
    server.alive()


def test_enough_hostile_cases() -> None:
    assert len(CASES) >= 60


def test_same_origin_is_served(server: Server) -> None:
    """What a page served by this server itself sends is answered as before."""
    for origin in (server.url, f"http://localhost:{server.port}"):
        host = origin.removeprefix("http://")
        r = requests.get(server.url + "/queue", headers={"Origin": origin, "Host": host,
                                                         "Sec-Fetch-Site": "same-origin"}, timeout=TIMEOUT)
        assert r.status_code == 200, (origin, r.status_code)
    r = requests.post(server.url + "/interrupt", headers={"Origin": server.url, "Sec-Fetch-Site": "same-origin"},
                      timeout=TIMEOUT)
    assert r.status_code == 200


def test_prompts_a_client_sends(server: Server) -> None:
    """A duplicate prompt_id is refused; an undeclared input is ignored; /queue and /history stay strict JSON."""
    pid = f"dup-{uuid.uuid4()}"
    prompt = text_to_image(prefix="dup")
    prompt["5"]["inputs"]["not_an_input"] = [1, 2, 3]  # ComfyUI ignores it; so do we
    r = requests.post(server.url + "/prompt", json={"prompt": prompt, "prompt_id": pid, "number": 1e300},
                      timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_id"] == pid
    again = requests.post(server.url + "/prompt", json={"prompt": text_to_image(), "prompt_id": pid}, timeout=TIMEOUT)
    assert again.status_code == 400 and again.json()["error"]["type"] == "duplicate_prompt_id"
    assert_error_shape(again)
    entry = wait_history(server.url, pid)
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert "not_an_input" not in json.dumps(entry["outputs"])
    after = requests.post(server.url + "/prompt", json={"prompt": text_to_image(), "prompt_id": pid}, timeout=TIMEOUT)
    assert after.status_code == 400, "an id in the history is taken too"
    def refuse(constant: str) -> None:
        raise AssertionError(f"invalid JSON: {constant}")

    for path in ("/queue", "/history"):
        json.loads(requests.get(server.url + path, timeout=TIMEOUT).text, parse_constant=refuse)
    server.alive()


def test_uploaded_image_is_served_as_an_image(server: Server) -> None:
    """A real image is still accepted and served back inline; its name decides nothing about its content."""
    data = png_bytes(16, (9, 8, 7))
    r = requests.post(server.url + "/upload/image", files={"image": ("up.png", data, "image/png")}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["name"] == "up.png"
    v = requests.get(server.url + "/view", params={"filename": "up.png", "type": "input"}, timeout=TIMEOUT)
    assert v.status_code == 200 and v.content == data
    _inline_image(v)
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, format="JPEG")
    r = requests.post(server.url + "/upload/image", files={"image": ("photo.png", jpeg.getvalue(), "image/png")},
                      timeout=TIMEOUT)
    assert r.status_code == 200, "a JPEG under a .png name is still an image"
    server.alive()


# ------------------------------------------------------------------------------------------ websockets


def _ws_url(server: Server, sid: str | None = None) -> str:
    return server.url.replace("http", "ws") + "/ws" + (f"?clientId={sid}" if sid is not None else "")


async def _ws_status(server: Server, headers: dict[str, str], sid: str | None = None) -> int:
    """The HTTP status a websocket upgrade gets (101: open)."""
    async with aiohttp.ClientSession() as s:
        try:
            async with s.ws_connect(_ws_url(server, sid), headers=headers) as ws:
                await ws.receive_json(timeout=TIMEOUT)
                return 101
        except aiohttp.WSServerHandshakeError as e:
            return e.status


@pytest.mark.parametrize(("headers", "sid", "status"), [
    ({"Origin": EVIL}, None, 403),
    ({"Sec-Fetch-Site": "cross-site"}, None, 403),
    ({"Host": "evil.example"}, None, 403),
    ({"Origin": "null"}, None, 403),
    ({}, "x" * 1000, 400),
    ({}, "a%0Ab", 400),
    ({}, None, 101),
], ids=["foreign-origin", "cross-site", "foreign-host", "origin-null", "long-client-id", "control-client-id",
        "same-origin-opens"])
def test_websocket_upgrade(server: Server, headers: dict, sid: str | None, status: int) -> None:
    assert asyncio.run(_ws_status(server, headers, sid)) == status
    server.alive()


def test_oversized_frame_is_refused(server: Server) -> None:
    """A frame just over the 4 MiB cap closes that connection (1009); the server and other clients go on."""

    async def go() -> tuple[int | None, Any]:
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(_ws_url(server, "big"), compress=0) as ws, \
                    s.ws_connect(_ws_url(server, "bystander")) as other:
                await ws.receive_json(timeout=TIMEOUT)
                await other.receive_json(timeout=TIMEOUT)
                try:
                    await ws.send_bytes(b"\0" * (4 * 2**20 + 1))
                except ConnectionError:  # the server closed while the frame was still going out
                    code: int | str | None = ws.close_code if ws.close_code is not None else "closed mid-frame"
                else:
                    msg = await ws.receive(timeout=TIMEOUT)  # a server that took the frame would wait here
                    while msg.type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                                           aiohttp.WSMsgType.ERROR):
                        msg = await ws.receive(timeout=TIMEOUT)
                    code = ws.close_code
                r = await asyncio.to_thread(requests.post, server.url + "/queue", json={}, timeout=TIMEOUT)
                assert r.status_code == 200  # a status message to every client
                return code, await other.receive_json(timeout=TIMEOUT)

    code, status = asyncio.run(go())
    assert code in (1009, "closed mid-frame"), code  # 1009: message too big
    assert status["type"] == "status"
    server.alive()


def _stalled_client(server: Server, sid: str) -> socket.socket:
    """A websocket client that completes its handshake and then never reads (a tiny receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall((f"GET /ws?clientId={sid} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\n"
                  "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _big_ids(prompt: dict, width: int) -> dict:
    """The prompt with every node id `width` characters long (so its events are large)."""
    new = {k: f"{k}-" + "n" * width for k in prompt}
    out = {}
    for k, node in prompt.items():
        inputs = {n: [new[v[0]], v[1]] if isinstance(v, list) else v for n, v in node["inputs"].items()}
        out[new[k]] = {**node, "inputs": inputs}
    return out


def test_a_stalled_client_does_not_block_others(server: Server) -> None:
    """Client A stops reading while megabytes of its events pile up; client B still gets all of its events,
    in order, and A is dropped."""
    stalled = _stalled_client(server, "stalled")
    try:
        for i in range(6):
            r = requests.post(server.url + "/prompt", json={"prompt": _big_ids(text_to_image(prefix=f"st{i}"), 100_000),
                                                            "client_id": "stalled"}, timeout=TIMEOUT)
            assert r.status_code == 200, r.text[:300]

        async def other() -> list[str]:
            # no cap here: a batch's plan message names all its prompts' (long) node ids
            async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server, "reader"), max_msg_size=0) as ws:
                pid = (await asyncio.to_thread(requests.post, server.url + "/prompt", json={
                    "prompt": text_to_image(prefix="reader"), "client_id": "reader"}, timeout=TIMEOUT)).json()[
                    "prompt_id"]
                seen: list[str] = []
                while True:
                    msg = await ws.receive(timeout=TIMEOUT * 3)
                    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        raise AssertionError(f"the reading client was disconnected ({ws.close_code})")
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        continue
                    m = json.loads(msg.data)
                    if m["data"].get("prompt_id") == pid:
                        seen.append(m["type"] + ("" if m["type"] != "executing" else f":{m['data']['node']}"))
                        if m["type"] == "executing" and m["data"]["node"] is None:
                            return seen

        seen = asyncio.run(other())
        assert seen[0] == "execution_start" and "execution_success" in seen and seen[-1] == "executing:None", seen
        assert seen.index("executing:8") < seen.index("execution_success"), seen
        end = time.monotonic() + TIMEOUT
        while "websocket client stalled dropped" not in server.tail() and time.monotonic() < end:
            time.sleep(0.2)
        assert "websocket client stalled dropped" in server.log.read_text(errors="replace"), server.tail()
    finally:
        stalled.close()
    server.alive()


# ------------------------------------------------------------------------------------------ fuzz

def _text(n: int) -> st.SearchStrategy:
    """Strings a client can send (no lone surrogates)."""
    return st.text(st.characters(codec="utf-8"), max_size=n)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | _text(20), lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(_text(12), kids, max_size=4), max_leaves=20)
KEYS = {"/prompt": ["prompt", "number", "front", "client_id", "prompt_id", "extra_data", "partial_execution_targets"],
        "/queue": ["clear", "delete"], "/history": ["clear", "delete"], "/interrupt": ["prompt_id"],
        "/free": ["unload_models", "free_memory"], "/vramgraph/plan": ["prompt"], "/vramgraph/convert": ["workflow"],
        "/vramgraph/ui": ["prompt", "workflow"]}
FUZZ = settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _bodies(path: str) -> st.SearchStrategy:
    """Objects with the route's own keys (and others) holding any JSON, any JSON, or any bytes."""
    keyed = st.dictionaries(st.sampled_from(KEYS[path]) | _text(8), JSON, max_size=5)
    return st.one_of(keyed.map(lambda b: ("json", b)), JSON.map(lambda b: ("json", b)),
                     st.binary(max_size=200).map(lambda b: ("data", b)))


def _post(server: Server, path: str, body: tuple[str, Any]) -> requests.Response:
    how, value = body
    if how == "json":
        return requests.post(server.url + path, data=json.dumps(value), headers={"Content-Type": "application/json"},
                             timeout=TIMEOUT)
    return requests.post(server.url + path, data=value, headers={"Content-Type": "application/json"}, timeout=TIMEOUT)


@pytest.mark.parametrize("path", list(KEYS))
def test_fuzz_json_routes(server: Server, path: str) -> None:
    @FUZZ
    @given(body=_bodies(path))
    def one(body: tuple[str, Any]) -> None:
        r = _post(server, path, body)
        assert r.status_code < 500, (body, r.status_code, r.text[:300])
        assert server.proc.poll() is None, server.tail()

    one()
    requests.post(server.url + "/queue", json={"clear": True}, timeout=TIMEOUT)
    requests.post(server.url + "/interrupt", timeout=TIMEOUT)
    server.alive()


QUERY = st.dictionaries(st.sampled_from(["filename", "subfolder", "type", "preview", "channel", "max_items"])
                        | _text(6), _text(24), max_size=5)


@pytest.mark.parametrize("path", ["/view", "/history", "/queue", "/object_info/VGSampler", "/vramgraph/workflows",
                                  "/prompt"])
def test_fuzz_query_strings(server: Server, path: str) -> None:
    _write("fuzz.png", png_bytes())(server)
    _write("fuzz.txt", b"text")(server)

    @FUZZ
    @given(query=QUERY, name=st.sampled_from(["fuzz.png", "fuzz.txt", "missing.png", None]))
    def one(query: dict, name: str | None) -> None:
        if name is not None and path == "/view":
            query = {**query, "filename": name, "type": "input"}
        r = requests.get(server.url + path, params=query, timeout=TIMEOUT)
        assert r.status_code < 500, (query, r.status_code, r.text[:300])
        assert server.proc.poll() is None, server.tail()

    one()
    server.alive()


def test_fuzz_uploads(server: Server) -> None:
    real = png_bytes()

    @FUZZ
    @given(name=_text(20) | st.sampled_from(["a.png", "b.html", "c.svg", "../d.png", ".."]),
           data=st.binary(max_size=300) | st.just(real) | st.binary(max_size=40).map(lambda b: real[:50] + b),
           fields=st.dictionaries(st.sampled_from(["type", "subfolder", "overwrite"]) | _text(5),
                                  _text(12), max_size=3))
    def one(name: str, data: bytes, fields: dict) -> None:
        try:
            r = requests.post(server.url + "/upload/image", files={"image": (name, data, "image/png")}, data=fields,
                              timeout=TIMEOUT)
        except ValueError:  # requests itself refuses to write some names into a form
            return
        assert r.status_code < 500, (name, fields, r.status_code, r.text[:300])
        assert server.proc.poll() is None, server.tail()

    one()
    server.alive()
