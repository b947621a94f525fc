"""The page in a real headless Chromium: open the shipped text-to-image workflow, edit it to 64x64 in the
form, queue it, and check the screenshot: the gallery shows the picture and the timeline shows the model
bands, the budget line and the unload mark of a plan that must swap models.

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

import pytest

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
DRIVERS = ("chromedriver", "/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver")
PALETTE = {"#4e79a7": (78, 121, 167), "#f28e2b": (242, 142, 43), "#59a14f": (89, 161, 79)}


def _find(names: tuple[str, ...]) -> str | None:
    for n in names:
        found = shutil.which(n) or (n if os.path.isfile(n) and os.access(n, os.X_OK) else None)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    chrome, driver_path = _find(BROWSERS), _find(DRIVERS)
    if chrome is None or driver_path is None:
        pytest.skip("no headless browser: apt-get install -y chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1200", "--force-device-scale-factor=1", "--hide-scrollbars"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vramgraph.graph.budget import Budget
    from vramgraph.graph.executor import Engine
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ServerThread, make_app

    tmp = tmp_path_factory.mktemp("browser")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    folders = Folders(models=(tmp / "models",), input=tmp / "input", output=tmp / "output", temp=tmp / "temp")
    wf = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    wf["5"]["inputs"].update(width=64, height=64)
    peak = Engine(folders).prepare(wf).plan.peak
    # a budget that holds each model but not all three: the plan must unload the text encoder
    engine = Engine(folders, budget=Budget(int(peak * 0.8), 8 << 30))
    with ServerThread(make_app(engine)) as srv:
        yield srv


def _wait(drv, what: str, script: str, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = drv.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    log = drv.execute_script("return document.getElementById('log').innerText")
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
