"""ComfyUI's official front end (comfyui-frontend-package) on our server, in a real headless Chromium.

One browser session walks what a ComfyUI user does, each step with a deadline and a screenshot written under the
test's tmp dir (VRAMGRAPH_SCREENSHOTS=DIR keeps them elsewhere):
1. the UI loads on a fresh user folder; the first-run template browser opens;
2. the FLUX.2 [klein] 4B text-to-image template opens from it (its size and steps then set small, as a user would);
3. our plan panel (the "VRAM plan" button) shows the plan of the canvas before anything is queued;
4. Run: the image is shown on the canvas and the panel follows the run live;
5. a setting changed and the workflow saved under a name survive a reload, and the first-run dialog is not back;
6. the Model Library lists the demo models;
7. a job cancelled from the queue panel stops.
Through all of it no request fails and the console shows no error (the user folder starts with the front end's
check for new ComfyUI releases turned off, as an offline user would: CI has no internet).

Needs Debian's chromium and chromium-driver, selenium and comfyui-frontend-package (test extras); skipped with the
reason when one is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import requests
from serving import headless_chrome

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_TITLE = "FLUX.2 [Klein] 4B: Text to Image"
OFFLINE = {"Comfy.Notification.ShowVersionUpdates": False}  # no release check against api.comfy.org



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("comfyui_frontend_package") is None:
        pytest.skip("the ComfyUI front end is not installed: pip install 'vramgraph[frontend]'")
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders
    from vramgraph.server.app import ServerThread, make_app
    from vramgraph.server.frontend import front_end_root

    tmp = tmp_path_factory.mktemp("frontend")
    write_tiny_models(tmp / "models", names=SHIPPED_NAMES)
    folders = Folders(models=(tmp / "models",), input=tmp / "input", output=tmp / "output", temp=tmp / "temp")
    for d in (folders.input, folders.output, folders.temp):
        d.mkdir(parents=True)
    (tmp / "user" / "default").mkdir(parents=True)
    (tmp / "user" / "default" / "comfy.settings.json").write_text(json.dumps(OFFLINE))
    app = make_app(Engine(folders), front_end=front_end_root("comfyui"), user_dir=tmp / "user")
    with ServerThread(app) as srv:
        srv.tmp = tmp
        yield srv


@pytest.fixture(scope="module")
def browser():
    drv = headless_chrome(1500, 1000, capabilities={"goog:loggingPrefs": {"browser": "ALL", "performance": "ALL"}})
    yield drv
    drv.quit()


class Session:
    """The browser on the server: waits with deadlines, screenshots, and every request and console line seen."""

    def __init__(self, drv, url: str, shots: Path) -> None:
        self.drv, self.url, self.shots = drv, url, shots
        self.requests: dict[str, dict] = {}
        self.console: list[dict] = []
        self.step = 0

    def collect(self) -> None:
        for entry in self.drv.get_log("performance"):
            m = json.loads(entry["message"])["message"]
            p = m.get("params", {})
            if m["method"] == "Network.requestWillBeSent":
                self.requests.setdefault(p["requestId"], {}).update(method=p["request"]["method"],
                                                                    url=p["request"]["url"])
            elif m["method"] == "Network.responseReceived":
                self.requests.setdefault(p["requestId"], {}).update(status=p["response"]["status"],
                                                                    url=p["response"]["url"])
            elif m["method"] == "Network.loadingFailed" and not p.get("canceled"):
                self.requests.setdefault(p["requestId"], {})["failed"] = p.get("errorText")
        self.console += self.drv.get_log("browser")

    def failures(self) -> list[str]:
        self.collect()
        bad = []
        for r in self.requests.values():
            url = r.get("url", "")
            if url.startswith(("data:", "blob:")):
                continue
            status, failed = r.get("status"), r.get("failed")
            # a response the page stopped reading (navigation, a body never read) is aborted, not failed
            if (status is not None and status >= 400) or (failed and not (status and failed == "net::ERR_ABORTED")):
                bad.append(f"{r.get('method')} {url} -> {status} {failed or ''}")
        return bad

    def errors(self) -> list[str]:
        self.collect()
        return [e["message"] for e in self.console if e["level"] == "SEVERE"]

    def js(self, script: str, *args):
        return self.drv.execute_script(script, *args)

    def wait(self, what: str, script: str, timeout: float = 60.0, *args):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = self.js(script, *args)
            if value:
                return value
            time.sleep(0.25)
        self.shot(f"timeout-{what.replace(' ', '_')[:40]}")
        raise AssertionError(f"timed out waiting for {what}; failed requests: {self.failures()}; console errors: "
                             f"{self.errors()}")

    def shot(self, name: str) -> Path:
        self.step += 1
        path = self.shots / f"{self.step:02d}-{name}.png"
        self.drv.save_screenshot(str(path))
        return path

    def click_text(self, selector: str, text: str) -> None:
        """Click the first element matching `selector` whose text contains `text` (fails when none)."""
        found = self.js("""const [sel, text] = arguments;
            const el = [...document.querySelectorAll(sel)].find((e) => e.textContent.includes(text)
                && e.getClientRects().length);
            if (el) el.scrollIntoView({block: 'center'}); return el || null;""", selector, text)
        assert found is not None, f"no {selector} with the text {text!r}"
        found.click()  # a real click (mouse events), as the tree of the Model Library needs


@pytest.fixture(scope="module")
def session(browser, server, tmp_path_factory):
    shots = Path(os.environ.get("VRAMGRAPH_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    out = Session(browser, server.url, shots)
    out.server = server
    return out


CARD = "[data-testid='template-workflow-image_flux2_klein_text_to_image']"
SAVE_NODE = 9  # the template's SaveImage behind its (unbypassed) 4B subgraph, 75
SMALL = """const n = app.graph.getNodeById(75);
    for (const w of n.widgets) if (w.name === 'value' || w.name === 'value_1') w.value = 64;
    for (const id of [68, 69]) n.subgraph.getNodeById(id).widgets[0].value = 64;
    n.subgraph.getNodeById(62).widgets.find((w) => w.name === 'steps').value = 2;
    app.graph.setDirtyCanvas(true, true);"""


def _load(s: Session, first_run: bool) -> None:
    s.wait("the app", "return !!(window.app && app.graph && document.querySelector('[data-testid=queue-button]'))")
    s.wait("our extension's button", "return [...document.querySelectorAll('button')]"
           ".some((b) => b.textContent === 'VRAM plan')")
    dialog = "return [...document.querySelectorAll('[role=dialog]')].some((d) => d.textContent.includes('Templates'))"
    if first_run:
        s.wait("the first-run template browser", dialog)
    else:
        time.sleep(1.0)  # the first-run dialog would have opened by now
        assert not s.js(dialog), "the first-run dialog opened again: the setting it wrote was not kept"


def _open_template(s: Session) -> None:
    s.drv.switch_to.active_element.send_keys("Klein 4B")  # the browser's search box has the focus
    s.wait("the klein text-to-image card", f"return !!document.querySelector(\"{CARD}\")")
    s.js(f"document.querySelector(\"{CARD}\").click()")
    s.wait("the template on the canvas", "return !!(app.graph.getNodeById(75) && app.graph.getNodeById(75).subgraph)")
    assert s.js("return app.graph.getNodeById(75).title") == "Text to Image (FLUX.2 Klein 4B)"
    s.js(SMALL)  # as a user edits the Width, Height and steps widgets: a small, quick image


def _run(s: Session) -> None:
    s.click_text("button", "VRAM plan")
    s.wait("the plan preview", "return !!document.querySelector('#vramgraph-plan-panel svg .title') && "
           "document.querySelector('#vramgraph-plan-panel .vg-kind').textContent === '(preview)'")
    summary = s.js("return document.querySelector('#vramgraph-plan-panel .vg-summary').textContent")
    assert "3 loads" in summary and "not planned" not in summary, summary
    s.shot("plan-preview")
    s.js("document.querySelector('[data-testid=queue-button]').click()")
    s.wait("the image on the canvas", f"const n = app.graph.getNodeById({SAVE_NODE}); "
           "return !!(n && n.imgs && n.imgs.length && n.imgs[0].complete && n.imgs[0].naturalWidth === 64)", 180)
    s.wait("the panel at the run's end", "return document.querySelector('#vramgraph-plan-panel .vg-kind')"
           ".textContent.startsWith('(done')")
    assert s.js("return document.querySelectorAll('#vramgraph-plan-panel svg .pending, "
                "#vramgraph-plan-panel svg .current').length") == 0
    s.shot("ran")


def _save_and_reload(s: Session, user: Path) -> None:
    """A setting set and the workflow saved as "klein small" are on disk, and still there after a reload."""
    s.js("app.extensionManager.setting.set('Comfy.ConfirmClear', false)")
    s.js("app.extensionManager.command.execute('Comfy.SaveWorkflow')")
    s.wait("the save dialog", "return [...document.querySelectorAll('[role=dialog]')]"
           ".some((d) => d.textContent.includes('Save workflow') && d.querySelector('input'))")
    s.js("const i = [...document.querySelectorAll('[role=dialog] input')].pop(); i.focus(); i.select();")
    s.drv.switch_to.active_element.send_keys("klein small", Keys.ENTER)
    saved = user / "default" / "workflows" / "klein small.json"
    end = time.monotonic() + 30
    while not saved.is_file() and time.monotonic() < end:
        time.sleep(0.2)
    assert saved.is_file(), sorted(p.name for p in (user / "default" / "workflows").iterdir())
    assert json.loads((user / "default" / "comfy.settings.json").read_text())["Comfy.ConfirmClear"] is False
    s.shot("saved")
    s.drv.refresh()
    _load(s, first_run=False)
    assert s.js("return app.extensionManager.setting.get('Comfy.ConfirmClear')") is False
    s.js("document.querySelector('[data-testid=workflows-tab-button]').click()")
    s.wait("the saved workflow in the Workflows panel", "return [...document.querySelectorAll('span, div')]"
           ".some((e) => e.children.length === 0 && e.textContent.trim() === 'klein small')")
    s.shot("workflows-after-reload")


def _model_library(s: Session) -> None:
    """The Model Library's folders, opened: every demo model is listed (from /api/experiment/models)."""
    s.js("document.querySelector('[data-testid=model-library-tab-button]').click()")
    leaf = "[...document.querySelectorAll('span, div')].filter((e) => e.children.length === 0)" \
           ".map((e) => e.textContent.trim())"
    s.wait("the model folders", f"return {leaf}.includes('diffusion_models')")
    for folder in ("diffusion_models", "text_encoders", "vae"):
        s.click_text("span", folder)
        time.sleep(0.3)
    s.wait("the demo models", f"const t = {leaf}; return ['flux-2-klein-4b', 'flux-2-klein-base-4b', 'qwen_3_4b', "
           "'flux2-vae'].every((m) => t.some((x) => x.startsWith(m)))", 30)
    s.shot("model-library")


def _cancel_from_the_queue_panel(s: Session) -> None:
    """A long job (400 steps) queued for this page; its cancel button in the queue panel stops it."""
    wf = json.loads((ROOT / "workflows" / "text_to_image.json").read_text())
    wf["5"]["inputs"].update(width=64, height=64)
    wf["6"]["inputs"]["steps"] = 400
    cid = s.js("return window.comfyAPI.api.api.clientId")
    pid = requests.post(s.url + "/api/prompt", json={"prompt": wf, "client_id": cid}, timeout=30).json()["prompt_id"]
    s.wait("the job to run", "return document.querySelector('[data-testid=queue-overlay-toggle]').textContent"
           ".includes('1 active')")
    s.wait("the panel to follow the job", "const k = document.querySelector('#vramgraph-plan-panel .vg-kind'); "
           f"return k && k.textContent === '(live: {pid[:8]})'")
    s.click_text("#vramgraph-plan-panel button", "\u00d7")  # closed: it covers the queue panel
    s.js("document.querySelector('[data-testid=queue-overlay-toggle]').click()")
    row = s.wait("the job's row in the queue panel", f"return document.querySelector('[data-job-id=\"{pid}\"]')")
    ActionChains(s.drv).move_to_element(row).perform()  # its buttons show on hover
    time.sleep(0.7)
    s.shot("queue-panel")
    cancel = s.js(f"return document.querySelector('[data-job-id=\"{pid}\"] button[data-variant=destructive]')")
    assert cancel is not None, "the running job's row has no cancel button"
    cancel.click()
    s.wait("the job to stop", f"return fetch('/api/jobs/{pid}').then((r) => r.json()).then((j) => j.status)"
           ".then((st) => st === 'cancelled' || st === 'failed' ? st : null)", 60)
    job = requests.get(f"{s.url}/api/jobs/{pid}", timeout=30).json()
    assert job["status"] == "cancelled", job
    messages = [m[0] for m in job["execution_status"]["messages"]]
    assert "execution_interrupted" in messages and "execution_success" not in messages, messages
    s.collect()
    asked = [r["url"] for r in s.requests.values() if r.get("method") == "POST" and (
        pid in r.get("url", "") or r.get("url", "").endswith(("/interrupt", "/jobs/cancel")))]
    assert asked == [f"{s.url}/api/jobs/{pid}/cancel"], asked  # the front end's cancel of one job
    s.wait("the queue panel to show no running job", "return document.querySelector('[data-testid=queue-overlay-"
           "toggle]').textContent.includes('0 active')")
    s.shot("cancelled")


def test_comfyui_front_end_end_to_end(session, server):
    s = session
    s.drv.get(s.url + "/")
    _load(s, first_run=True)
    s.shot("first-run-templates")
    _open_template(s)
    s.shot("template")
    _run(s)
    _save_and_reload(s, server.tmp / "user")
    _model_library(s)
    _cancel_from_the_queue_panel(s)
    assert s.failures() == []
    assert s.errors() == []
