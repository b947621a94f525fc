"""A real `python -m vramgraph serve` process for the tests that talk to one (importable as `serving`)."""

from __future__ import annotations

import os
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
