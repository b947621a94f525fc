"""A real `python -m vramgraph serve` process for the tests that talk to one, and the headless browser for those that
look at a page (importable as `serving`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(folder: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180
                  ) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """`vramgraph serve` on a free loopback port over the tiny models in `folder/models` (input, output and config
    in `folder` too), started and listening; yields (url, process, log file) and stops it afterwards."""
    import requests

    port = free_port()
    (folder / "config.json").write_text("{}")
    log = folder / "serve.log"
    env = {**{k: v for k, v in os.environ.items() if k not in ("VRAMGRAPH_CONFIG", "VRAMGRAPH_MODELS")}, **(env or {})}
    cmd = [sys.executable, "-m", "vramgraph", "serve", "--host", "127.0.0.1", "--port", str(port), "--models",
           str(folder / "models"), "--input", str(folder / "input"), "--output", str(folder / "output"),
           "--config", str(folder / "config.json"), "--device", "cpu", *args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vramgraph serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > end:
                raise AssertionError(f"vramgraph serve did not listen within {timeout} s:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(url + "/system_stats", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.2)
        yield url, proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
DRIVERS = ("chromedriver", "/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver")


def _find(names: tuple[str, ...]) -> str | None:
    for n in names:
        found = shutil.which(n) or (n if os.path.isfile(n) and os.access(n, os.X_OK) else None)
        if found:
            return found
    return None


def headless_chrome(width: int, height: int, *args: str, capabilities: dict | None = None):
    """Debian's headless Chromium through selenium at `width` x `height` (more flags in `args`); the test is skipped
    where selenium, Chromium or its driver is missing (VRAMGRAPH_NO_SKIPS makes that a failure on CI)."""
    import pytest

    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    chrome, driver_path = _find(BROWSERS), _find(DRIVERS)
    if chrome is None or driver_path is None:
        pytest.skip("no headless browser: apt-get install -y chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--force-device-scale-factor=1", *args):
        opts.add_argument(arg)
    for name, value in (capabilities or {}).items():
        opts.set_capability(name, value)
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    drv.set_page_load_timeout(60)
    return drv
