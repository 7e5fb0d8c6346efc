"""Servers the benchmark starts itself, beside the shared ones of ``services.py up``.

``scripts/services.py up`` runs 4 memcached nodes by default; the 8-node caches need 4
more, which the benchmark starts on free loopback ports with the same command line as the
shared ones, and stops when it ends. The storage and capacity scenarios start a node of
their own per cache (``dedicated_node``), so nothing else writes where they count bytes.

The shards scenario starts MariaDB servers of its own (``mariadb_servers``), alike in
everything, each of which it can put in a cgroup v1 cpu group with a fixed quota
(:class:`CpuGroup`): a server limited to a fraction of a core stands in for a host of its
own, which brings its own CPU, while the client runs beside them unconstrained.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from django.conf import settings

SERVICES_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "services.py"


def services() -> dict[str, Any]:
    """The helpers of scripts/services.py (run as a module, not as ``__main__``)."""
    return runpy.run_path(str(SERVICES_SCRIPT), run_name="kvcache_services")


def answers(address: str, probe: bytes, reply: bytes) -> bool:
    """Whether a server listens on ``address`` (host:port) and answers ``probe`` with ``reply``."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1) as sock:
            sock.sendall(probe)
            return sock.recv(64).startswith(reply)
    except (OSError, ValueError):
        return False


def memcached_answers(address: str) -> bool:
    return answers(address, b"version\r\n", b"VERSION")


def redis_answers(address: str) -> bool:
    return answers(address, b"PING\r\n", b"+PONG")


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


class OwnNodes:
    """Memcached processes only the caller uses, which it may kill and start again on the
    same port (the replicas scenario's outage)."""

    def __init__(self, count: int) -> None:
        self.helpers = services()
        self.host = self.helpers["HOST"]
        self.ports = [_free_port(self.host) for _ in range(count)]
        self.processes: list[subprocess.Popen | None] = [None] * count

    @property
    def addresses(self) -> list[str]:
        return [f"{self.host}:{port}" for port in self.ports]

    def start(self, index: int) -> None:
        argv = list(self.helpers["memcached_argv"](self.ports[index]))
        self.processes[index] = _launch(argv, self.addresses[index])

    def kill(self, index: int) -> None:
        process = self.processes[index]
        if process is not None:
            process.kill()
            process.wait(timeout=10)
            self.processes[index] = None

    def restart(self) -> None:
        """Every node killed and started again, empty."""
        for index in range(len(self.ports)):
            self.kill(index)
            self.start(index)

    def flush(self) -> None:
        for address in self.addresses:
            ask(address, b"flush_all\r\nstats\r\n")

    def stop(self) -> None:
        for index in range(len(self.ports)):
            self.kill(index)


@contextlib.contextmanager
def own_nodes(count: int) -> Iterator[OwnNodes]:
    """``count`` fresh memcached nodes, stopped on exit. RuntimeError if one cannot start."""
    try:
        nodes = OwnNodes(count)
    except (OSError, SystemExit) as exc:
        raise RuntimeError(f"could not start memcached nodes: {exc}") from exc
    try:
        for index in range(count):
            nodes.start(index)
        yield nodes
    finally:
        nodes.stop()


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
    address = f"{host}:{port}"
    return address, _launch(argv, address)


def _launch(argv: list[str], address: str) -> subprocess.Popen:
    """Start memcached with ``argv`` and return once it answers on ``address``."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not memcached_answers(address):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"memcached on {address} did not start")
        time.sleep(0.02)
    return process


# --- MariaDB servers of the benchmark's own, optionally CPU-capped ----------------------------

#: The cgroup v1 cpu controller (as root: writable).
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
#: The quota's period. A capped server is also held on one core (``pin``): a host with a
#: single slow core. Tried on the development machine (while other work ran): with a
#: 100 ms period a throttled server holds every client thread that asks it for up to
#: 88 ms, so with 3 shards most threads wait on the throttled ones and the servers whose
#: quota is fresh go short of work (half their periods unused); without the pinning a
#: 10 ms period cost a server 30-60 % of its calls per CPU-second (its threads contend on
#: two cores at once). Pinned, with 10 ms periods, one server served as many calls per
#: CPU-second as with 100 ms, and three were kept busier.
CFS_PERIOD_US = 10_000
#: CPU weight of a capped server's group (the root's is 1024): while the client keeps
#: every core busy a server still gets its quota, as a host of its own would.
SERVER_SHARES = 10_240


def cpu_caps_unavailable() -> str | None:
    """Why servers cannot be given a CPU quota here; None when they can."""
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU} (cgroup v2 only?)"
    if not os.access(CGROUP_CPU, os.W_OK):
        return f"the cgroup v1 cpu controller at {CGROUP_CPU} is not writable (not root?)"
    return None


class CpuGroup:
    """A cgroup v1 cpu group: the processes put in it use at most ``cpus`` cores."""

    def __init__(self, name: str, cpus: float | None) -> None:
        self.path = CGROUP_CPU / name
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (self.path / "cpu.shares").write_text(str(SERVER_SHARES))
        self.limit(cpus)

    def limit(self, cpus: float | None) -> None:
        """A quota of ``cpus`` cores; None lifts it."""
        quota = -1 if cpus is None else max(1000, round(cpus * CFS_PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, pid: int) -> None:
        """``pid`` and all its threads (cgroup.procs moves the whole process)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def stat(self) -> dict[str, int]:
        """cpu.stat: periods, throttled periods, throttled_time (ns)."""
        lines = (self.path / "cpu.stat").read_text().split("\n")
        return {name: int(value) for name, value in (line.split() for line in lines if line)}

    def remove(self) -> None:
        """Back to the root group, every process; then the group goes."""
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
        self.path.rmdir()


def pin(pid: int, cores: list[int]) -> None:
    """Every thread of ``pid`` on ``cores``; the threads it starts later inherit it."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cores)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class MariaDBServers:
    """The benchmark's own servers: their ports and processes, and their CPU groups when
    capped (else ``note`` says why not)."""

    host: str
    ports: list[int]
    processes: list[subprocess.Popen]
    groups: list[CpuGroup] = field(default_factory=list)
    note: str | None = None

    def limit(self, cpus: float | None) -> None:
        """A quota of ``cpus`` cores for each server, each held on one core (server N on
        core N modulo the cores), as on a host with a single slow core; None: no quota,
        every core."""
        cores = sorted(os.sched_getaffinity(0))
        for index, (group, process) in enumerate(zip(self.groups, self.processes)):
            group.limit(cpus)
            pin(process.pid, cores if cpus is None else [cores[index % len(cores)]])

    def cpu_seconds(self) -> list[float]:
        return [process_cpu_seconds(process.pid) for process in self.processes]

    def periods(self) -> list[tuple[int, int]]:
        """Per capped server: quota periods it ran in, and those its quota cut short."""
        return [(stat["nr_periods"], stat["nr_throttled"])
                for stat in (group.stat() for group in self.groups)]


@contextlib.contextmanager
def mariadb_servers(count: int, token: str, cpu_groups: bool) -> Iterator[MariaDBServers]:
    """``count`` MariaDB servers alike in everything (the command line of the shard
    servers of ``services.py``, data directories kept in ``.runtime/bench-mariadb-N-data``
    for the next run), on free loopback ports; each in a CPU group of its own (no quota
    until ``limit``) when ``cpu_groups`` and the controller allows. Stopped on exit.
    """
    helpers = services()
    host, runtime = helpers["HOST"], helpers["RUNTIME"]
    servers = MariaDBServers(host, [], [])
    try:
        for index in range(count):
            name = f"bench-mariadb-{index}"
            port = _free_port(host)
            argv = helpers["mariadb_argv"](runtime / f"{name}-data", port, name,
                                           helpers["SHARD_BUFFER_POOL"])
            with open(runtime / f"{name}.log", "ab") as log:
                servers.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            servers.ports.append(port)
        for port, process in zip(servers.ports, servers.processes):
            deadline = time.monotonic() + 120
            while not helpers["mysql_answers"](port):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the benchmark's MariaDB on {host}:{port} did not start")
                time.sleep(0.05)
        if cpu_groups:
            servers.note = cpu_caps_unavailable()
            if servers.note is None:
                for index, process in enumerate(servers.processes):
                    group = CpuGroup(f"kvcache-bench-{token}-{index}", cpus=None)
                    servers.groups.append(group)
                    group.add(process.pid)
        yield servers
    finally:
        for group in servers.groups:
            group.remove()
        for process in servers.processes:
            process.terminate()
        for process in servers.processes:
            process.wait(timeout=120)  # InnoDB's shutdown: longer than memcached's


def machine_busy_seconds() -> float:
    """CPU time every core of the machine has spent busy so far (all processes, /proc/stat),
    to tell what other work ran beside a measurement."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
