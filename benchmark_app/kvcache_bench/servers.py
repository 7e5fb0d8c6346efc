"""Memcached nodes for the benchmark: the shared ones plus extra processes it starts itself.

``scripts/services.py up`` runs 4 nodes by default; the 8-node caches need 4 more, which
the benchmark starts on free loopback ports with the same command line as the shared
ones, and stops when it ends. The storage and capacity scenarios start a node of their
own per cache (``dedicated_node``), so nothing else writes where they count bytes.
"""
from __future__ import annotations

import contextlib
import runpy
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from django.conf import settings

SERVICES_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "services.py"


def services() -> dict[str, Any]:
    """The helpers of scripts/services.py (run as a module, not as ``__main__``)."""
    return runpy.run_path(str(SERVICES_SCRIPT), run_name="kvcache_services")


def memcached_answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1) as sock:
            sock.sendall(b"version\r\n")
            return sock.recv(64).startswith(b"VERSION")
    except OSError:
        return False


def shared_nodes() -> list[str]:
    """The configured nodes that answer right now."""
    return [node for node in settings.MEMCACHED_NODES if memcached_answers(node)]


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def memcached_cluster(size: int) -> Iterator[tuple[list[str], str | None]]:
    """Up to ``size`` node addresses: the shared nodes first, then extra started ones.

    Yields ``(addresses, note)``; ``note`` says why fewer nodes than asked are available.
    The extra processes are stopped on exit, whatever happens inside.
    """
    nodes = shared_nodes()[:size]
    processes: list[subprocess.Popen] = []
    note = None
    try:
        if len(nodes) < size:
            try:
                helpers = services()
                for _ in range(size - len(nodes)):
                    address, process = _start_node(helpers)
                    processes.append(process)
                    nodes.append(address)
            except (OSError, RuntimeError, SystemExit) as exc:
                note = f"could not start extra memcached nodes: {exc}"
        yield nodes, note
    finally:
        _stop(processes)


@contextlib.contextmanager
def dedicated_node(memory_mb: int) -> Iterator[str]:
    """A fresh memcached node of ``memory_mb`` MiB (``-m``) that only the caller uses.

    Raises RuntimeError when it cannot be started.
    """
    try:
        address, process = _start_node(services(), memory_mb)
    except (OSError, SystemExit) as exc:
        raise RuntimeError(f"could not start a memcached node: {exc}") from exc
    try:
        yield address
    finally:
        _stop([process])


def ask(address: str, command: bytes) -> str:
    """A memcached text command's reply, up to its ``END`` line."""
    host, port = address.rsplit(":", 1)
    reply = b""
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(command)
        while not reply.endswith(b"END\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"memcached on {address} closed the connection: {command!r}")
            reply += chunk
    return reply.decode()


def node_stats(address: str) -> dict[str, int]:
    """The node's numeric ``stats`` (``bytes``, ``curr_items``, ``evictions``...)."""
    reply = ask(address, b"stats\r\n")
    stats = {}
    for line in reply.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "STAT" and parts[2].isdigit():
            stats[parts[1]] = int(parts[2])
    return stats


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(timeout=10)


def _start_node(helpers: dict[str, Any], memory_mb: int | None = None) -> tuple[str, subprocess.Popen]:
    host = helpers["HOST"]
    port = _free_port(host)
    argv = list(helpers["memcached_argv"](port))
    if memory_mb is not None:  # same command line as the shared nodes but for its memory
        argv[argv.index("-m") + 1] = str(memory_mb)
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"{host}:{port}"
    deadline = time.monotonic() + 10
    while not memcached_answers(address):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"memcached on {address} did not start")
        time.sleep(0.02)
    return address, process
