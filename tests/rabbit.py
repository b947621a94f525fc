"""A RabbitMQ node of the tests' own, on free loopback ports (tests/test_fleet.py, tests/test_fleet_chaos.py).

The broker is Debian's rabbitmq-server (`.ci/run` installs it), started with its own node name, data folder and
config; without it the tests that need it are skipped, saying so.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from serving import free_port


def _rabbit_binary() -> str | None:
    # the script under /usr/lib runs the broker as the calling user; /usr/sbin's wrapper would switch to `rabbitmq`
    lib = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
    return str(lib) if lib.is_file() else shutil.which("rabbitmq-server")


class Rabbit:
    """A RabbitMQ node of our own on loopback (node name, ports, data and logs under `folder`)."""

    def __init__(self, folder: Path, user: str = "guest", password: str = "guest") -> None:
        binary = _rabbit_binary()
        if binary is None:
            pytest.skip("rabbitmq-server is not installed (apt-get install rabbitmq-server; .ci/run does)")
        self.binary, self.folder, self.port = binary, folder, free_port()
        self.url = f"amqp://{user}:{password}@127.0.0.1:{self.port}/"
        (folder / "plugins").write_text("[].")
        if user != "guest":  # the node's first user (its default is guest/guest)
            (folder / "rabbitmq.conf").write_text(f"default_user = {user}\ndefault_pass = {password}\n")
        self.env = {**os.environ, "HOME": str(folder), "RABBITMQ_NODENAME": f"vgtest{self.port}@localhost",
                    "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_NODE_PORT": str(self.port),
                    "RABBITMQ_DIST_PORT": str(free_port()), "RABBITMQ_MNESIA_BASE": str(folder / "mnesia"),
                    "RABBITMQ_LOG_BASE": str(folder / "log"), "RABBITMQ_ENABLED_PLUGINS_FILE": str(folder / "plugins"),
                    "RABBITMQ_CONFIG_FILE": str(folder / "rabbitmq"), "RABBITMQ_CONF_ENV_FILE": str(folder / "env"),
                    "RABBITMQ_ADVANCED_CONFIG_FILE": str(folder / "advanced.config"),
                    "RABBITMQ_PID_FILE": str(folder / "pid"), "RABBITMQ_LOGS": "-",
                    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}"}
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> None:
        with open(self.folder / "rabbit.log", "ab") as log:
            self.proc = subprocess.Popen([self.binary], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        if wait:
            self.wait()

    def wait(self, timeout: float = 90) -> None:
        assert self.proc is not None
        end = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > end:
                log = (self.folder / "rabbit.log").read_text()[-3000:]
                raise AssertionError(f"rabbitmq-server did not start:\n{log}")
            time.sleep(0.3)

    def _answers(self) -> bool:
        import aio_pika

        async def probe() -> None:
            conn = await aio_pika.connect(self.url, timeout=2)
            await conn.close()

        try:
            asyncio.run(probe())
            return True
        except Exception:
            return False

    def kill(self) -> None:
        """The broker goes away at once (SIGKILL to its process group: the node and its helpers)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None
