"""Extra servers that a test starts, kills and restarts (for fault tests).

The shared servers from `scripts/services.py up` must never be killed by a test; a test
that needs to break a memcached node or restart MariaDB starts its own here.
"""
from __future__ import annotations

import atexit
import contextlib
import shutil
import importlib.util
import os
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
    """A free loopback port this process has not handed out before: the backends keep
    per-address state for the process (pools, counters, health, outdated keys), so a
    server of one test on a port an earlier test's server used would inherit it."""
    while True:
        with socket.socket() as sock:
            sock.bind((services.HOST, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


_handed_out: set[int] = set()


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


def connections_held(address: str) -> int:
    """This process's open TCP connections to `address`, as the kernel has them.

    Counted on this side, not from the server's `curr_connections`: memcached drops a
    closed connection from its count only when a worker thread next reads it, so its count
    lags a close by a moment, and it also counts other processes' connections and the
    start-up probe's. A socket this process closed is gone from /proc/self/fd at once."""
    host, port = address.rsplit(":", 1)
    wanted = f"{socket.inet_aton(host)[::-1].hex().upper()}:{int(port):04X}"
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # an fd closed while we look
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    count = 0
    with open("/proc/self/net/tcp") as table:
        next(table)  # the header
        for line in table:
            fields = line.split()
            # remote address, state (0A is LISTEN), inode
            if fields[2] == wanted and fields[3] != "0A" and fields[9] in inodes:
                count += 1
    return count


@contextlib.contextmanager
def memcached_node(port: int | None = None) -> Iterator[MemcachedNode]:
    node = MemcachedNode(port)
    node.start()
    try:
        yield node
    finally:
        node.kill()


class Twemproxy:
    """A twemproxy (nutcracker) of a test's own, in front of memcached processes of its
    own that the test may stop: the proxy sites run, configured by ``services.py``."""

    def __init__(self, servers: int = 3) -> None:
        self.servers = [MemcachedNode() for _ in range(servers)]
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="kvcache-twemproxy-"))
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{services.HOST}:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        for server in self.servers:
            server.start()
        argv = services.twemproxy_argv(
            self.port, [server.address for server in self.servers], self.workdir,
            "twemproxy", stats_port=free_port(),
        )
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not services.memcached_answers(self.port):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"twemproxy on {self.address} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None
        for server in self.servers:
            server.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def connection_settings(port: int, database: str = services.MYSQL_DATABASE) -> dict:
    """Connection parameters of a loopback server of ours, in Django's DATABASES form."""
    return {
        "ENGINE": "django.db.backends.mysql",
        "HOST": services.HOST,
        "PORT": str(port),
        "USER": services.MYSQL_USER,
        "PASSWORD": "",
        "NAME": database,
        "OPTIONS": {"charset": "utf8mb4"},
    }


_template_datadir: Path | None = None


def fresh_datadir(datadir: Path) -> None:
    """Fill the missing ``datadir`` with a copy of a data directory initialised once per
    test process: ``mariadb-install-db`` takes about 2 s, the copy a tenth of that, and a
    fault test starts a server of its own each time."""
    global _template_datadir
    if _template_datadir is None:
        workdir = Path(tempfile.mkdtemp(prefix="kvcache-mariadb-template-"))
        atexit.register(shutil.rmtree, workdir, ignore_errors=True)
        services.mariadb_argv(workdir / "data", free_port(), "template")  # initialises it
        _template_datadir = workdir / "data"
    shutil.copytree(_template_datadir, datadir)


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
        return connection_settings(self.port)

    def start(self, timeout: float = 60.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        if not (self.workdir / "data").exists():
            fresh_datadir(self.workdir / "data")
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

    def crash(self) -> None:
        """Kill the server at once (SIGKILL): every socket, listening ones included, closes
        in the same instant, so no connection made after its clients see theirs close
        can reach it (a clean stop closes them one after another)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=60)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class Replica:
    """The real replica `scripts/services.py up` starts (the "shard2_replica" alias):
    MariaDB replication (binlog, GTID) from the first shard server.

    Tests may delay it (``MASTER_DELAY``) or stop its SQL thread; each context manager
    puts it back and waits until it has caught up, so the next test finds it current.
    """

    def __init__(self, port: int, primary_port: int) -> None:
        self.port = port
        self.primary_port = primary_port

    def query(self, statement: str, port: int | None = None) -> list[dict]:
        """Rows of ``statement`` on the replica (or on ``port``), as dicts."""
        import MySQLdb
        from MySQLdb.cursors import DictCursor

        connection = MySQLdb.connect(host=services.HOST, port=port or self.port,
                                     user=services.MYSQL_USER, passwd="", connect_timeout=10)
        try:
            cursor = connection.cursor(DictCursor)
            cursor.execute(statement)
            return list(cursor.fetchall()) if cursor.description else []
        finally:
            connection.close()

    def status(self) -> dict:
        (status,) = self.query("SHOW SLAVE STATUS")
        return status

    def caught_up(self, timeout: float = 60.0) -> None:
        """Wait until the replica has applied everything its primary has written so far."""
        (row,) = self.query("SELECT @@gtid_binlog_pos AS pos", port=self.primary_port)
        (waited,) = self.query(f"SELECT MASTER_GTID_WAIT('{row['pos']}', {timeout}) AS w")
        if waited["w"] != 0:
            status = self.status()
            raise AssertionError(
                f"the replica on port {self.port} did not catch up in {timeout} s: IO "
                f"{status['Slave_IO_Running']}, SQL {status['Slave_SQL_Running']}, "
                f"{status['Last_Error'] or 'no error'}"
            )

    def set_delay(self, seconds: int, timeout: float = 30.0) -> None:
        """Held back ``seconds`` from now on; returns once both threads run again."""
        # MariaDB changes MASTER_DELAY only while both replication threads are stopped.
        self.query("STOP SLAVE")
        self.query(f"CHANGE MASTER TO MASTER_DELAY={int(seconds)}")
        self.query("START SLAVE")
        deadline = time.monotonic() + timeout
        while (status := self.status())["Slave_IO_Running"] != "Yes" or \
                status["Slave_SQL_Running"] != "Yes":
            if time.monotonic() > deadline:
                raise AssertionError(f"the replica did not restart: {status['Last_Error']}")
            time.sleep(0.02)

    @contextlib.contextmanager
    def delayed(self, seconds: int) -> Iterator["Replica"]:
        """Each event is applied ``seconds`` after it was written on the primary (MariaDB
        times events in whole seconds: between ``seconds - 1`` and ``seconds`` later).

        Returns once a write made after the restart has been applied: the events a
        restart replays carry older times (the binlog's own), and until a newer event is
        applied MariaDB counts Seconds_Behind_Master from them while the next one waits
        out its delay (seen: 174 s behind with a delay of 4)."""
        self.set_delay(seconds)
        self.query(f"CREATE DATABASE IF NOT EXISTS `{services.MYSQL_DATABASE}`",
                   port=self.primary_port)  # a no-op that replicates
        self.caught_up(timeout=seconds + 60.0)
        try:
            yield self
        finally:
            self.set_delay(0)
            self.caught_up()

    @contextlib.contextmanager
    def sql_thread_stopped(self) -> Iterator["Replica"]:
        """Events arrive (IO thread) but none is applied until the block ends."""
        self.query("STOP SLAVE SQL_THREAD")
        try:
            yield self
        finally:
            self.query("START SLAVE SQL_THREAD")
            self.caught_up()


def configured_replica() -> Replica | None:
    """The real replica the settings name, or None where a mirror stands in for it."""
    from django.conf import settings

    if not settings.MYSQL_REPLICA_PORT or not settings.MYSQL_SHARD_PORTS:
        return None
    return Replica(int(settings.MYSQL_REPLICA_PORT), int(settings.MYSQL_SHARD_PORTS[0]))


def replica_caught_up() -> None:
    """Wait until the real replica has what its primary has (at once with a mirror):
    for tests that read through the replica what they just wrote or created."""
    replica = configured_replica()
    if replica is not None:
        replica.caught_up()


class GaleraNode:
    """A node of a test's own that joins the running Galera cluster (`services.py galera
    up`): it receives the cluster's data by rsync (SST), and the test may kill it."""

    def __init__(self, index: int = services.GALERA_SIZE) -> None:
        self.index = index
        self.port = services.galera_ports(index)[0]
        self.datadir = services.galera_dir() / f"{services.galera_name(index)}-data"
        self.tmpdir = services.galera_dir() / f"{services.galera_name(index)}-tmp"
        self.log = services.RUNTIME / f"{services.galera_name(index)}.log"
        self.process: subprocess.Popen | None = None

    def connection_settings(self, database: str) -> dict:
        return connection_settings(self.port, database)

    def start(self, timeout: float = 180.0) -> None:
        self.remove_data()
        argv = services.galera_argv(self.index, self.index + 1, self.datadir, bootstrap=False)
        with open(self.log, "wb") as log_file:
            self.process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while services.galera_state(self.port) != "Synced":
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.kill()
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"Galera node {self.index} did not join:\n{tail}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: the node vanishes from the cluster mid-conversation, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.process = None

    def remove_data(self) -> None:
        shutil.rmtree(self.datadir, ignore_errors=True)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        (services.galera_dir() / f"{services.galera_name(self.index)}-init.sql").unlink(
            missing_ok=True)


def missing_servers(groups: list[str]) -> list[str]:
    """What is wrong with each server group of ``groups`` (``mysql``, ``shards``,
    ``replica``, ``memcached``, ``galera``) as the test settings name them; [] when all
    answer."""
    from django.conf import settings

    mysql_ports = {
        "mysql": [settings.MYSQL["PORT"]],
        "shards": settings.MYSQL_SHARD_PORTS if len(settings.MYSQL_SHARD_PORTS) >= 2 else [],
        "replica": [settings.MYSQL_REPLICA_PORT] if settings.MYSQL_REPLICA_PORT else [],
        "galera": [node.rsplit(":", 1)[1] for node in settings.GALERA_NODES],
    }
    problems = []
    for group in groups:
        if group == "memcached":
            down = [node for node in settings.MEMCACHED_NODES
                    if not services.port_answers(int(node.rsplit(":", 1)[1]))]
            if down or not settings.MEMCACHED_NODES:
                problems.append(f"memcached: {', '.join(down) or 'no KVCACHE_MEMCACHED'}")
            continue
        if group not in mysql_ports:
            problems.append(f"{group}: no such server group")
            continue
        ports = [int(port) for port in mysql_ports[group]]
        if not ports:
            problems.append(f"{group}: not configured (see scripts/services.py)")
        elif group == "galera":
            states = {port: services.galera_state(port) for port in ports}
            problems += [f"galera: node on port {port} is {state or 'unreachable'}"
                         for port, state in states.items() if state != "Synced"]
        else:
            problems += [f"{group}: nothing answers on port {port}"
                         for port in ports if not services.mysql_answers(port)]
    return problems
