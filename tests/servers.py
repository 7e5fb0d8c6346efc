"""Extra servers that a test starts, kills and restarts (for fault tests).

The shared servers from `scripts/services.py up` must never be killed by a test; a test
that needs to break a memcached node or restart MariaDB starts its own here.
"""
from __future__ import annotations

import contextlib
import shutil
import importlib.util
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

_SERVICES_PATH = Path(__file__).resolve().parent.parent / "scripts" / "services.py"
_spec = importlib.util.spec_from_file_location("kvcache_services", _SERVICES_PATH)
services = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(services)  # type: ignore[union-attr]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((services.HOST, 0))
        return sock.getsockname()[1]


class MemcachedNode:
    """One memcached process on a loopback port that stays the same across restarts."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.extra_args = extra_args  # e.g. ("-C",): no CAS
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{services.HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        self.process = subprocess.Popen(
            [*services.memcached_argv(self.port), *self.extra_args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not services.memcached_answers(self.port):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.kill()
                raise RuntimeError(f"memcached on {self.address} did not start")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the node vanishes mid-conversation, as in a crash."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown."""
        self._end(signal.SIGTERM)

    def restart(self) -> None:
        self.kill()
        self.start()

    def _end(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
        self.process = None


@contextlib.contextmanager
def memcached_node(port: int | None = None) -> Iterator[MemcachedNode]:
    node = MemcachedNode(port)
    node.start()
    try:
        yield node
    finally:
        node.kill()


class MariaDBServer:
    """A MariaDB of a test's own, in a temporary data directory, on a fixed free port.

    ``restart()`` keeps the data and the port, as a real server restart does.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="kvcache-mariadb-"))
        self.name = f"mariadb-test-{self.port}"
        self.process: subprocess.Popen | None = None

    def connection_settings(self) -> dict:
        """Connection parameters in Django's DATABASES form."""
        return {
            "ENGINE": "django.db.backends.mysql",
            "HOST": services.HOST,
            "PORT": str(self.port),
            "USER": services.MYSQL_USER,
            "PASSWORD": "",
            "NAME": services.MYSQL_DATABASE,
            "OPTIONS": {"charset": "utf8mb4"},
        }

    def start(self, timeout: float = 60.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        argv = services.mariadb_argv(self.workdir / "data", self.port, self.name)
        with open(self.workdir / "server.log", "ab") as log_file:
            self.process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not services.mysql_answers(self.port):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                log = (self.workdir / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"MariaDB on port {self.port} did not start:\n{log}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
