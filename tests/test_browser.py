"""The page in a real headless Chromium: open the shipped text-to-image workflow, edit it to 64x64 in the
form, queue it, and check the screenshot: the gallery shows the picture and the timeline shows the model
bands, the budget line and the unload mark of a plan that must swap models. Then open a queue of eight prompts
and check its dense plan picture: a non-blank screenshot, no two labels overlapping, none outside the SVG, and
the same drawing as `vramgraph plan --svg` makes for that workflow.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package (a test extra); skipped with
the reason when they are absent. Set VRAMGRAPH_SCREENSHOT=path.png to keep the screenshot.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest
from serving import headless_chrome

ROOT = Path(__file__).resolve().parents[1]
PALETTE = {"#4e79a7": (78, 121, 167), "#f28e2b": (242, 142, 43), "#59a14f": (89, 161, 79)}



@pytest.fixture(scope="module")
def browser():
    drv = headless_chrome(1500, 1200, "--hide-scrollbars")
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vramgraph.graph.engine.budget import budget_for
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ServerThread, make_app

    tmp = tmp_path_factory.mktemp("browser")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    folders = Folders(models=(tmp / "models",), input=tmp / "input", output=tmp / "output", temp=tmp / "temp")
    wf = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    wf["5"]["inputs"].update(width=64, height=64)
    peak = Engine(folders).prepare(wf).plan.peak
    # a budget that holds each model but not all three: the plan must unload the text encoder; made as
    # `--vram CARD --reserve 0 --host 8GiB` makes it on the CPU, so that the CLI can plan with the same budget
    engine = Engine(folders, budget=budget_for("cpu", vram=int(peak * 0.8), reserve=0, host="8GiB"))
    with ServerThread(make_app(engine)) as srv:
        srv.models, srv.budget = tmp / "models", engine.budget
        yield srv


def _wait(drv, what: str, script: str, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = drv.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    log = drv.execute_script("const l = document.getElementById('log'); return l ? l.innerText : ''")
    raise AssertionError(f"timed out waiting for {what}; page log:\n{log}")


def _set_number(drv, name: str, value: int) -> None:
    drv.execute_script(
        "const el = document.querySelector(`[name='${arguments[0]}']`); el.value = arguments[1];"
        "el.dispatchEvent(new Event('change'));", name, str(value))


def _crop(shot, rect: dict):
    x, y, w, h = (round(rect[k]) for k in ("x", "y", "width", "height"))
    return shot.crop((x, y, x + w, y + h)).convert("RGB")


def _near(px: tuple[int, int, int], colour: tuple[int, int, int], tol: int = 12) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(px, colour, strict=True))


def test_page_runs_a_workflow_and_shows_the_plan(browser, server, tmp_path):
    from PIL import Image

    drv = browser
    drv.get(server.url + "/")
    _wait(drv, "the page to start", "return document.body.dataset.ready === '1'", 30)
    drv.find_element("id", "open-file").send_keys(str(ROOT / "workflows" / "text_to_image.json"))
    _wait(drv, "the node forms", "return document.querySelectorAll('#nodes .card').length === 8")
    assert drv.execute_script("return document.querySelectorAll('#graph g.node').length") == 8
    assert drv.execute_script("return document.querySelectorAll('#graph path.link').length") == 7
    _set_number(drv, "5.width", 64)
    _set_number(drv, "5.height", 64)
    _set_number(drv, "6.steps", 2)
    _wait(drv, "the plan preview", "return document.querySelectorAll('#timeline g.band rect').length > 0 && "
          "document.getElementById('plan-kind').textContent.includes('preview')")

    drv.find_element("id", "queue").click()
    _wait(drv, "the picture in the gallery",
          "const i = document.querySelector('#gallery img'); return i && i.complete && i.naturalWidth === 64")
    _wait(drv, "the run to finish", "return document.getElementById('bar-text').textContent.startsWith('done')")
    assert "live" in drv.execute_script("return document.getElementById('plan-kind').textContent")
    bands = drv.execute_script("return document.querySelectorAll('#timeline g.band').length")
    assert bands == 3, bands
    assert drv.execute_script("return document.querySelectorAll('#timeline g.mark.unload').length") >= 1
    assert drv.execute_script("return document.querySelectorAll('#timeline line.budget').length") == 1
    done = drv.execute_script("return document.querySelectorAll('#graph g.node.done').length")
    assert done == 8, done
    assert drv.execute_script("const p = document.getElementById('preview'); return !p.hidden && p.naturalWidth > 0"), \
        "the step preview frames reached the page"
    width = drv.execute_script("return document.getElementById('bar-all').style.width")
    assert width == "100%", width
    # the live picture is the server's drawing of the queued prompt, titled with the workflow's name; at the end
    # no step is running and none is pending
    assert drv.execute_script("return document.querySelector('#timeline .title').textContent") \
        .startswith("text_to_image · ")
    assert drv.execute_script("return document.querySelectorAll('#timeline .current, #timeline .pending').length") == 0

    drv.execute_script("document.getElementById('timeline').scrollIntoView({block: 'start'})")
    time.sleep(0.3)
    shot = Image.open(io.BytesIO(drv.get_screenshot_as_png())).convert("RGB")
    if os.environ.get("VRAMGRAPH_SCREENSHOT"):
        shot.save(os.environ["VRAMGRAPH_SCREENSHOT"])
    rect = "const r = document.getElementById(arguments[0]).getBoundingClientRect(); " \
           "return {x: r.x, y: r.y, width: r.width, height: r.height};"
    timeline = _crop(shot, drv.execute_script(rect, "timeline"))
    pixels = list(timeline.getdata())
    for name, colour in PALETTE.items():  # every model's band is visible in its colour
        count = sum(1 for p in pixels if _near(p, colour))
        assert count > 60, f"timeline: {count} pixels of band colour {name}"
    dark = sum(1 for p in pixels if max(p) < 60)
    assert dark > 100, f"timeline: no budget line or axes ({dark} dark pixels)"

    img_rect = drv.execute_script("const r = document.querySelector('#gallery img').getBoundingClientRect(); "
                                  "return {x: r.x, y: r.y, width: r.width, height: r.height};")
    picture = _crop(shot, img_rect)
    colours = picture.getcolors(maxcolors=1 << 16) or []
    assert len(colours) > 50, f"the gallery shows {len(colours)} colours: no picture"
    background = max(colours)[0] / (picture.width * picture.height)
    assert background < 0.5, f"the gallery picture is {background:.0%} one colour"


# ------------------------------------------------------------------------------------------- a dense plan

TEXT_BOXES = """
const svg = document.querySelector(arguments[0]), frame = svg.getBoundingClientRect();
const boxes = [...svg.querySelectorAll('text')].map((t) => {
  const r = t.getBoundingClientRect();
  return {text: t.textContent, x0: r.left, y0: r.top, x1: r.right, y1: r.bottom};
});
const overlaps = [], outside = [];
boxes.forEach((a, i) => {
  if (a.x0 < frame.left - 0.5 || a.y0 < frame.top - 0.5 || a.x1 > frame.right + 0.5 || a.y1 > frame.bottom + 0.5)
    outside.push(a.text);
  for (const b of boxes.slice(i + 1))
    if (a.x0 < b.x1 - 0.5 && b.x0 < a.x1 - 0.5 && a.y0 < b.y1 - 0.5 && b.y0 < a.y1 - 0.5)
      overlaps.push([a.text, b.text]);
});
return {count: boxes.length, overlaps, outside, texts: boxes.map((b) => b.text),
        ids: [...svg.querySelectorAll('[id]')].map((e) => e.id),
        width: frame.width, height: frame.height, viewBox: svg.getAttribute('viewBox')};
"""


def _queue_of_eight(path: Path) -> None:
    """Eight text-to-image prompts (64x64, own seeds and texts) merged into one workflow, as the server queues them."""
    from vramgraph.graph.workflow.queue import merge

    wf = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompts = []
    for i in range(8):
        p = json.loads(json.dumps(wf))
        p["5"]["inputs"].update(width=64, height=64)
        p["6"]["inputs"].update(seed=i, steps=2)
        p["4"]["inputs"]["text"] = f"prompt number {i}"
        prompts.append(p)
    path.write_text(json.dumps(merge(prompts, frozenset({"VGSaveImage"})).prompt))


def test_dense_plan_picture_is_readable_and_the_cli_drawing(browser, server, tmp_path):
    from PIL import Image
    from vramgraph.cli import main

    drv = browser
    path = tmp_path / "queue_of_8.json"
    _queue_of_eight(path)
    drv.get(server.url + "/")
    _wait(drv, "the page to start", "return document.body.dataset.ready === '1'", 30)
    drv.find_element("id", "open-file").send_keys(str(path))
    _wait(drv, "the queue's plan preview", "const t = document.querySelector('#timeline .title'); "
          "return t && t.textContent.startsWith('queue_of_8') && "
          "document.getElementById('plan-kind').textContent.includes('preview')")
    steps = drv.execute_script("return document.querySelectorAll('#timeline text.step').length")
    assert steps >= 40, f"a dense plan: {steps} steps"
    assert drv.execute_script("return document.querySelectorAll('#timeline g.lane').length") == 3
    assert drv.execute_script("return document.querySelector('#timeline .title').textContent") == \
        f"queue_of_8 · {server.budget.card / 2**20:.2f}".rstrip("0").rstrip(".") + " MiB card · 8 images, 64×64"

    # the whole picture in the window, then its screenshot
    width, height = drv.execute_script("const s = document.getElementById('timeline'); return [s.width.baseVal.value, "
                                       "s.height.baseVal.value]")
    drv.set_window_size(max(1500, int(width) + 160), 1200)
    try:
        drv.execute_script("document.getElementById('timeline').scrollIntoView({block: 'start'})")
        assert drv.execute_script("const w = document.getElementById('timeline-wrap'); "
                                  "return w.scrollWidth <= w.clientWidth"), "the picture is wider than its panel"
        shot = tmp_path / "dense_plan.png"
        drv.find_element("id", "timeline").screenshot(str(shot))
        got = drv.execute_script(TEXT_BOXES, "#timeline")
    finally:
        drv.set_window_size(1500, 1200)
    if os.environ.get("VRAMGRAPH_SCREENSHOT"):
        shutil.copy(shot, Path(os.environ["VRAMGRAPH_SCREENSHOT"]).with_suffix(".dense.png"))
    image = Image.open(shot).convert("RGB")
    assert abs(image.width - width) <= 2 and abs(image.height - height) <= 2, (image.size, width, height)
    colours = image.getcolors(maxcolors=1 << 16) or []
    assert len(colours) > 30 and max(colours)[0] / (image.width * image.height) < 0.9, "a blank picture"
    pixels = list(image.getdata())
    for name, colour in PALETTE.items():
        assert sum(1 for p in pixels if _near(p, colour)) > 200, f"no {name} lane or band in the screenshot"

    # every label measured by the browser: none overlaps another, none leaves the SVG
    assert got["count"] > steps + 10
    assert got["overlaps"] == [], got["overlaps"][:10]
    assert got["outside"] == [], got["outside"][:10]
    assert got["viewBox"] == f"0 0 {int(width)} {int(height)}"

    # the same drawing as the CLI's --svg for the same workflow, budget and models
    svg = tmp_path / "cli.svg"
    assert main(["plan", str(path), "--models", str(server.models), "--device", "cpu", "--dtype", "fp32",
                 "--vram", f"{server.budget.card}B", "--reserve", "0B", "--host", "8GiB", "--svg", str(svg)]) == 0
    root = ElementTree.fromstring(svg.read_text(encoding="utf-8"))
    assert got["texts"] == ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert got["ids"] == [e.get("id") for e in root.iter() if e.get("id")]
    assert got["viewBox"] == root.get("viewBox")


# ------------------------------------------------------------------------------------------- the ComfyUI panel

STUB_APP = """export const app = {
  registerExtension(ext) { ext.setup(); },
  async graphToPrompt() { return { output: (await (await fetch("/prompt.json")).json()) }; },
};"""
STUB_API = """export const api = {
  addEventListener() {},
  fetchApi(path, init) { return fetch("/plan.json"); },
};"""


def test_comfyui_panel_shows_the_same_drawing(browser, server, tmp_path):
    """The pack's front-end extension in a page that stands in for ComfyUI's (its app.js and api.js replaced by
    stubs; the plan is the pack's route's answer, saved): the "VRAM plan" button shows the route's SVG."""
    import functools
    import http.server
    import threading

    import requests

    prompt = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    prompt["5"]["inputs"].update(width=64, height=64)
    body = requests.post(server.url + "/vramgraph/plan", json={"prompt": prompt}, timeout=60).json()
    site = tmp_path / "site"
    (site / "scripts").mkdir(parents=True)
    (site / "scripts" / "app.js").write_text(STUB_APP)
    (site / "scripts" / "api.js").write_text(STUB_API)
    shutil.copytree(ROOT / "web", site / "extensions" / "vramgraph")
    assert body["unplanned"] == []  # inside ComfyUI, the nodes planned by stand-ins (test_comfy_pack) are named:
    body["unplanned"] = [{"node": "12", "class_type": "ImageScaleBy", "note": "ComfyUI's own node"}]
    (site / "plan.json").write_text(json.dumps(body))
    (site / "prompt.json").write_text(json.dumps(prompt))
    (site / "index.html").write_text('<!doctype html><meta charset="utf-8"><body>'
                                     '<script type="module" src="/extensions/vramgraph/vramgraph_panel.js"></script>')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        drv = browser
        drv.get(f"http://127.0.0.1:{httpd.server_port}/index.html")
        _wait(drv, "the VRAM plan button", "return [...document.querySelectorAll('button')]"
              ".some((b) => b.textContent === 'VRAM plan')", 30)
        drv.execute_script("[...document.querySelectorAll('button')].find((b) => b.textContent === 'VRAM plan')"
                           ".click()")
        _wait(drv, "the panel's picture", "return document.querySelector('#vramgraph-plan-panel svg .title') !== null",
              30)
        got = drv.execute_script(TEXT_BOXES, "#vramgraph-plan-panel svg")
        summary = drv.execute_script("return document.querySelector('#vramgraph-plan-panel .vg-summary').textContent")
    finally:
        httpd.shutdown()
        httpd.server_close()
    root = ElementTree.fromstring(body["svg"])
    assert got["texts"] == ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert got["ids"] == [e.get("id") for e in root.iter() if e.get("id")]
    assert got["overlaps"] == [] and got["outside"] == []
    assert summary.endswith("not planned (ComfyUI runs them, their GPU memory is not counted): 12 ImageScaleBy")
