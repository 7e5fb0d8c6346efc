#!/usr/bin/env python3
"""Throwaway MariaDB, memcached and Redis servers for django-kvcache's tests and benchmark.

    python3 scripts/services.py deps   # install what is missing (Debian/Ubuntu, as root)
    python3 scripts/services.py up     # start (or reuse) the servers, print their env vars
    python3 scripts/services.py env    # print the env vars for running servers
    python3 scripts/services.py down   # stop only what `up` started (by pid file)
    python3 scripts/services.py galera up|env|down|clean   # a 3-node MariaDB Galera cluster

Everything lives under ``.runtime/`` in the project (git-ignored): data directory,
sockets, logs, pid files and ``services.env``. Servers listen on loopback only, on
non-default ports, so a MariaDB on 3306 or a memcached on 11211 is never touched.

Settings (environment variables, all optional):
    KVCACHE_MYSQL_PORT        MariaDB port (default 23306)
    KVCACHE_MYSQL_SHARD_PORTS ports of the extra MariaDB servers for the shard tests,
                              comma-separated (default: the next two ports, 23307,23308;
                              empty: none)
    KVCACHE_MYSQL_REPLICA_PORT port of a real replica of the first shard server (binlog,
                              GTID, its own process), for the replica tests (default: the
                              main port + 3, 23309; empty: none)
    KVCACHE_MEMCACHED_PORT    first memcached port (default 21211)
    KVCACHE_MEMCACHED_NODES   number of memcached processes (default 4)
    KVCACHE_TWEMPROXY_PORT    port of a twemproxy (nutcracker) in front of memcached processes
                              of its own (default 21300); they listen on the next ports
                              (21301-21303), its stats on the one after (21304). Empty: none
    KVCACHE_TWEMPROXY_NODES   number of memcached processes behind it (default 3)
    KVCACHE_REDIS_PORT        port of a Redis (redis-server) for the benchmark's Django
                              RedisCache peer (default 21379; empty: none). No data is
                              saved to disk; the system's Redis on 6379 is never touched
    KVCACHE_GALERA_PORT       first port of the Galera cluster (default 23410): node N listens
                              for clients on PORT + 4N and uses the next three ports for
                              group communication, IST and SST (23410-23421 for 3 nodes)
    KVCACHE_RUNTIME_DIR       where state lives (default <project>/.runtime)
    KVCACHE_GALERA_DIR        where the Galera nodes keep their data when started as root
                              (they run as the mysql user, who may not enter the checkout:
                              default /var/tmp/kvcache-galera-<a digest of the runtime dir>)

Only the standard library is used: this runs before any virtualenv exists. SQL is sent with
the ``mariadb`` command-line client.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

PROJECT = Path(__file__).resolve().parent.parent
RUNTIME = Path(os.environ.get("KVCACHE_RUNTIME_DIR", PROJECT / ".runtime"))
HOST = "127.0.0.1"
MYSQL_PORT = int(os.environ.get("KVCACHE_MYSQL_PORT", "23306"))
MYSQL_USER = "kvcache"
MYSQL_DATABASE = "kvcache"
MYSQL_SHARD_PORTS = [
    int(port)
    for port in os.environ.get(
        "KVCACHE_MYSQL_SHARD_PORTS", f"{MYSQL_PORT + 1},{MYSQL_PORT + 2}"
    ).split(",")
    if port.strip()
]
#: The real replica: of the first shard server, so "shard2" of the tests has it.
_replica_port = os.environ.get("KVCACHE_MYSQL_REPLICA_PORT", str(MYSQL_PORT + 3)).strip()
MYSQL_REPLICA_PORT = int(_replica_port) if _replica_port and MYSQL_SHARD_PORTS else None
REPLICA_OF = MYSQL_SHARD_PORTS[0] if MYSQL_SHARD_PORTS else None
#: InnoDB buffer pool of the main server, and of each (small, short-lived) shard server.
BUFFER_POOL = "256M"
SHARD_BUFFER_POOL = "64M"
MEMCACHED_PORT = int(os.environ.get("KVCACHE_MEMCACHED_PORT", "21211"))
MEMCACHED_NODES = int(os.environ.get("KVCACHE_MEMCACHED_NODES", "4"))
_twemproxy_port = os.environ.get("KVCACHE_TWEMPROXY_PORT", "21300").strip()
#: twemproxy: the address clients use; its memcached servers on the next ports.
TWEMPROXY_PORT = int(_twemproxy_port) if _twemproxy_port else None
TWEMPROXY_NODES = int(os.environ.get("KVCACHE_TWEMPROXY_NODES", "3"))
_redis_port = os.environ.get("KVCACHE_REDIS_PORT", "21379").strip()
#: The benchmark's Redis (Django's RedisCache is a peer of the memcached backend).
REDIS_PORT = int(_redis_port) if _redis_port else None
START_TIMEOUT = 60.0
GALERA_PORT = int(os.environ.get("KVCACHE_GALERA_PORT", "23410"))
GALERA_SIZE = 3
GALERA_PROVIDER = "/usr/lib/galera/libgalera_smm.so"
#: Galera nodes' pid files start so; a plain `down` leaves them to `galera down`.
GALERA_PREFIX = "galera-"

# Debian package -> a file it installs that we need.
SYSTEM_PACKAGES = {
    "mariadb-server": "mariadbd",
    "memcached": "memcached",
    "libmariadb-dev": "mariadb_config",  # headers for building mysqlclient
    "pkg-config": "pkg-config",
    "build-essential": "gcc",  # mysqlclient compiles on install
    "mariadb-client": "mariadb-dump",  # the replica is seeded with a dump
    "nutcracker": "nutcracker",  # twemproxy, the proxy large sites put in front of memcached
    "redis-server": "redis-server",  # the benchmark's RedisCache peer
}
# What `galera up` needs on top.
GALERA_PACKAGES = {"galera-4": GALERA_PROVIDER, "rsync": "rsync"}
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def log(message: str) -> None:
    print(f"services: {message}", file=sys.stderr, flush=True)


def which(program: str) -> str | None:
    """shutil.which that also looks in sbin directories (mariadbd lives in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS])
    return shutil.which(program, path=path)


# --- installing ---------------------------------------------------------------------------


def missing_packages(packages: dict[str, str]) -> list[str]:
    return [
        pkg for pkg, program in packages.items()
        if not (os.path.exists(program) if program.startswith("/") else which(program))
    ]


def install_deps(packages: dict[str, str] = SYSTEM_PACKAGES) -> None:
    missing = missing_packages(packages)
    if not missing:
        return
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        sys.exit(
            "services: missing programs; please install these packages (or their equivalents "
            f"for your system): {' '.join(missing)}"
        )
    log(f"installing {' '.join(missing)} with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Debian starts a package's system service on install unless policy-rc.d forbids it.
    # We only want the binaries, so forbid starting anything while we install.
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        subprocess.run([apt, "update"], check=True, env=env)
        subprocess.run(
            [apt, "install", "-y", "--no-install-recommends", *missing], check=True, env=env
        )
    finally:
        if added_policy:
            policy.unlink()
    still_missing = missing_packages(packages)
    if still_missing:
        sys.exit(f"services: apt-get did not provide: {' '.join(still_missing)}")


# --- process bookkeeping ----------------------------------------------------------------


def pid_file(name: str) -> Path:
    return RUNTIME / f"{name}.pid"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a child of ours that exited is reaped, not taken for alive)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child: started by an earlier `up`
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def running_pid(name: str) -> int | None:
    """The pid recorded for `name` if that process is still alive."""
    try:
        pid = int(pid_file(name).read_text().strip())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None
    return pid


def port_answers(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def spawn(name: str, argv: list[str]) -> int:
    log_path = RUNTIME / f"{name}.log"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the shell that ran `up`
        )
    pid_file(name).write_text(str(process.pid))
    return process.pid


def wait_until(check, what: str, pid: int, log_name: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if not alive(pid):
            break
        time.sleep(0.1)
    tail = (RUNTIME / f"{log_name}.log").read_text(errors="replace")[-2000:]
    sys.exit(f"services: {what} did not start; end of its log:\n{tail}")


def ensure_port_free(port: int, what: str, env_var: str) -> None:
    if port_answers(port):
        sys.exit(
            f"services: port {port} for {what} is taken by a process we did not start; "
            f"choose another with {env_var}=..."
        )


def stop(name: str) -> None:
    pid = running_pid(name)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not alive(pid):
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        log(f"stopped {name} (pid {pid})")
    pid_file(name).unlink(missing_ok=True)


# --- MariaDB ------------------------------------------------------------------------------


def socket_path(name: str, directory: Path = RUNTIME) -> Path:
    path = directory / f"{name}.sock"
    if len(str(path)) < 100:  # unix socket paths are limited to ~107 bytes
        directory.mkdir(parents=True, exist_ok=True)  # tests may start a server before `up`
        return path
    return Path(tempfile.gettempdir()) / f"kvcache-{name}.sock"


def mysql_answers(port: int = MYSQL_PORT) -> bool:
    """True once the server accepts TCP and has sent its handshake packet."""
    try:
        with socket.create_connection((HOST, port), timeout=1) as sock:
            return len(sock.recv(4)) == 4
    except OSError:
        return False


def mariadb_argv(
    datadir: Path,
    port: int,
    name: str,
    buffer_pool: str = BUFFER_POOL,
    options: list[str] | tuple[str, ...] = (),
    initialise: bool = True,
    system_user: bool = False,
) -> list[str]:
    """Command line of one loopback MariaDB, initialising `datadir` on first use.

    ``options`` are added to the command line (one with ``--log-bin`` replaces the
    default ``--skip-log-bin``); with ``initialise`` false an empty `datadir` stays empty
    (a Galera node that joins gets its data from a donor). With ``system_user``, a
    server started by root runs as the ``mysql`` user, as packaged servers do (the rsync
    daemon of a Galera state transfer started by root drops to ``nobody``, who could not
    write the data directory); its temporary directory then holds its socket. Also used
    by the tests for servers of their own.
    """
    user = "mysql" if system_user else "root"
    user_args = [f"--user={user}"] if os.geteuid() == 0 else []
    # A temporary directory of its own: servers set up at the same time in a shared /tmp
    # have collided on their temporary tables' file names.
    tmpdir = datadir.parent / f"{name}-tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    datadir.mkdir(parents=True, exist_ok=True)
    if user_args and system_user:
        subprocess.run(["chown", "-R", f"{user}:", str(datadir), str(tmpdir)], check=True)
    sock = socket_path("mariadb", tmpdir) if system_user else socket_path(name)
    if initialise and not (datadir / "mysql").is_dir():
        log(f"initialising a MariaDB data directory in {datadir}")
        shutil.rmtree(datadir, ignore_errors=True)
        install_db = which("mariadb-install-db") or which("mysql_install_db")
        if install_db is None:
            sys.exit("services: mariadb-install-db not found; install mariadb-server")
        subprocess.run(
            [install_db, "--no-defaults", f"--datadir={datadir}", f"--tmpdir={tmpdir}",
             "--skip-test-db",
             "--auth-root-authentication-method=normal", *user_args],
            check=True, stdout=subprocess.DEVNULL,
        )
    # Runs at every start, so it is idempotent: a password-less user for tests on loopback.
    init_sql = datadir.parent / f"{name}-init.sql"
    init_sql.write_text(
        f"CREATE USER IF NOT EXISTS '{MYSQL_USER}'@'%';\n"
        f"CREATE USER IF NOT EXISTS '{MYSQL_USER}'@'localhost';\n"
        f"GRANT ALL PRIVILEGES ON *.* TO '{MYSQL_USER}'@'%' WITH GRANT OPTION;\n"
        f"GRANT ALL PRIVILEGES ON *.* TO '{MYSQL_USER}'@'localhost' WITH GRANT OPTION;\n"
        f"CREATE DATABASE IF NOT EXISTS `{MYSQL_DATABASE}` CHARACTER SET utf8mb4;\n"
    )
    mariadbd = which("mariadbd") or which("mysqld")
    if mariadbd is None:
        sys.exit("services: mariadbd not found; install mariadb-server")
    return [
        mariadbd, "--no-defaults", f"--datadir={datadir}", f"--tmpdir={tmpdir}", f"--port={port}",
        f"--bind-address={HOST}", f"--socket={sock}",
        f"--init-file={init_sql}", "--skip-name-resolve",
        *([] if any(o.startswith("--log-bin") for o in options) else ["--skip-log-bin"]),
        "--character-set-server=utf8mb4", "--collation-server=utf8mb4_general_ci",
        "--max-connections=500", f"--innodb-buffer-pool-size={buffer_pool}",
        # A throwaway server: durability is not worth an fsync per commit.
        "--innodb-flush-log-at-trx-commit=2", "--sync-binlog=0",
        *options,
        *user_args,
    ]


def mariadb_up() -> None:
    """The main server, the shard servers and the replica: all spawned before waiting for
    any; then the replica is made to follow its primary."""
    servers = [("mariadb", MYSQL_PORT, BUFFER_POOL, "KVCACHE_MYSQL_PORT", ())] + [
        (f"mariadb-{port}", port, SHARD_BUFFER_POOL, "KVCACHE_MYSQL_SHARD_PORTS",
         primary_options(port) if port == REPLICA_OF and MYSQL_REPLICA_PORT else ())
        for port in MYSQL_SHARD_PORTS
    ]
    if MYSQL_REPLICA_PORT is not None:
        servers.append((REPLICA_NAME, MYSQL_REPLICA_PORT, SHARD_BUFFER_POOL,
                        "KVCACHE_MYSQL_REPLICA_PORT", replica_options(MYSQL_REPLICA_PORT)))
    started = []
    for name, port, buffer_pool, env_var, options in servers:
        if running_pid(name) and mysql_answers(port):
            log(f"MariaDB already running on {HOST}:{port}")
            continue
        stop(name)
        ensure_port_free(port, "MariaDB", env_var)
        argv = mariadb_argv(RUNTIME / f"{name}-data", port, name, buffer_pool, options)
        started.append((name, port, spawn(name, argv)))
    for name, port, pid in started:
        wait_until(lambda: mysql_answers(port), f"MariaDB on {HOST}:{port}", pid, name)
        log(f"MariaDB started on {HOST}:{port} (pid {pid})")
    if MYSQL_REPLICA_PORT is not None:
        replica_up()


def sql(port: int, statement: str, timeout: float = 120) -> list[dict[str, str]]:
    """The rows of ``statement`` (or of the last of several) on the loopback server at
    ``port``, sent with the ``mariadb`` client; values as text, NULL as ``"NULL"``."""
    client = which("mariadb") or which("mysql")
    if client is None:
        sys.exit("services: the mariadb client is missing; install mariadb-client")
    result = subprocess.run(
        [client, "--no-defaults", "--protocol=TCP", f"--host={HOST}", f"--port={port}",
         f"--user={MYSQL_USER}", "--batch", "-e", statement],
        capture_output=True, text=True, timeout=timeout,
    )
    if result.returncode != 0:
        raise RuntimeError(f"MariaDB on {HOST}:{port}: {result.stderr.strip()}")
    lines = result.stdout.splitlines()
    if not lines:
        return []
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"))) for line in lines[1:]]


# --- the replica ------------------------------------------------------------------------

REPLICA_NAME = f"mariadb-replica-{MYSQL_REPLICA_PORT}"
#: How long the replica may take to follow its primary once started.
REPLICA_CATCH_UP = 60


def primary_options(port: int) -> list[str]:
    """A server replicas can follow: a row-based binary log (MariaDB's GTIDs come with it)."""
    return [f"--log-bin=mariadb-{port}-bin", f"--server-id={port}", "--binlog-format=ROW",
            "--max-binlog-size=64M", "--binlog-expire-logs-seconds=86400"]


def replica_options(port: int) -> list[str]:
    # --skip-slave-start: `up` checks the replica's state before it follows again.
    return [f"--server-id={port}", f"--relay-log=replica-{port}-relay", "--skip-slave-start"]


def replica_status(port: int) -> dict[str, str] | None:
    """SHOW SLAVE STATUS of the server at ``port``; None where it replicates nothing."""
    rows = sql(port, "SHOW SLAVE STATUS")
    return rows[0] if rows else None


def follow(replica: int, primary: int) -> None:
    """Point the replica at the primary from the replica's own GTID position (slave_pos)."""
    sql(replica, "STOP SLAVE; CHANGE MASTER TO "
        f"MASTER_HOST='{HOST}', MASTER_PORT={primary}, MASTER_USER='{MYSQL_USER}', "
        "MASTER_PASSWORD='', MASTER_USE_GTID=slave_pos, MASTER_DELAY=0, "
        "MASTER_CONNECT_RETRY=1; START SLAVE")


def seed_replica(replica: int, primary: int) -> None:
    """Copy the primary's databases into a new replica with the GTID position they were
    dumped at (``mariadb-dump --gtid --master-data``), so it follows from there."""
    system = {"information_schema", "performance_schema", "mysql", "sys"}
    databases = [row["Database"] for row in sql(primary, "SHOW DATABASES")
                 if row["Database"] not in system]
    dump = which("mariadb-dump") or which("mysqldump")
    client = which("mariadb") or which("mysql")
    if dump is None or client is None:
        sys.exit("services: mariadb-dump is missing; install mariadb-client")
    connect = ["--no-defaults", "--protocol=TCP", f"--host={HOST}", f"--user={MYSQL_USER}"]
    dumper = subprocess.Popen(
        [dump, *connect, f"--port={primary}", "--single-transaction", "--gtid",
         "--master-data=1", "--databases", *databases],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    loaded = subprocess.run([client, *connect, f"--port={replica}"], stdin=dumper.stdout,
                            capture_output=True, text=True)
    dumper.stdout.close()  # type: ignore[union-attr]
    dump_errors = dumper.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
    if dumper.wait() != 0 or loaded.returncode != 0:
        sys.exit(f"services: seeding the replica failed: {dump_errors} {loaded.stderr}")


def replication_problem(replica: int, primary: int, timeout: float) -> str | None:
    """None once the replica runs both threads and has applied what the primary had
    written when asked; else what is wrong (its last error, or a timeout)."""
    position = sql(primary, "SELECT @@gtid_binlog_pos AS pos")[0]["pos"]
    deadline = time.monotonic() + timeout
    while True:
        status = replica_status(replica)
        if status is None:
            return "it replicates nothing"
        for thread in ("IO", "SQL"):
            # 2003, 2013: the primary is (re)starting, the IO thread retries every second.
            if status[f"Last_{thread}_Errno"] not in ("0", "2003", "2013"):
                return f"{thread} thread error {status[f'Last_{thread}_Error']}"
        running = status["Slave_IO_Running"] == "Yes" and status["Slave_SQL_Running"] == "Yes"
        if running and sql(replica, f"SELECT MASTER_GTID_WAIT('{position}', 1) AS w")[0]["w"] == "0":
            return None
        if time.monotonic() > deadline:
            return (f"not caught up after {timeout:.0f} s (IO {status['Slave_IO_Running']}, "
                    f"SQL {status['Slave_SQL_Running']})")
        time.sleep(0.2)


def start_replica(port: int) -> int:
    argv = mariadb_argv(RUNTIME / f"{REPLICA_NAME}-data", port, REPLICA_NAME,
                        SHARD_BUFFER_POOL, replica_options(port))
    pid = spawn(REPLICA_NAME, argv)
    wait_until(lambda: mysql_answers(port), f"MariaDB on {HOST}:{port}", pid, REPLICA_NAME)
    return pid


def replica_up() -> None:
    """Make the replica follow the first shard server: a new one is seeded from it; one
    that followed it before resumes where it stopped (undelayed); one that cannot (another
    primary, an error, the primary's data gone) is rebuilt from scratch."""
    replica, primary = MYSQL_REPLICA_PORT, REPLICA_OF
    assert replica is not None and primary is not None
    status = replica_status(replica)
    if status is not None and status["Master_Port"] != str(primary):
        problem: str | None = f"it followed port {status['Master_Port']}"
    else:
        if status is None:
            seed_replica(replica, primary)
        follow(replica, primary)  # also undoes a delay a test left; resumes from slave_pos
        problem = replication_problem(replica, primary, REPLICA_CATCH_UP)
    if problem is not None:
        log(f"the replica on {HOST}:{replica} does not follow {HOST}:{primary} ({problem}): "
            "rebuilding it")
        stop(REPLICA_NAME)
        shutil.rmtree(RUNTIME / f"{REPLICA_NAME}-data", ignore_errors=True)
        start_replica(replica)
        seed_replica(replica, primary)
        follow(replica, primary)
        problem = replication_problem(replica, primary, REPLICA_CATCH_UP)
        if problem is not None:
            sys.exit(f"services: the replica on {HOST}:{replica} does not follow: {problem}")
    log(f"MariaDB on {HOST}:{replica} replicates {HOST}:{primary}")


# --- memcached ----------------------------------------------------------------------------


def answers(port: int, probe: bytes, reply: bytes) -> bool:
    """Whether a server listens on ``port`` and answers ``probe`` with ``reply``."""
    try:
        with socket.create_connection((HOST, port), timeout=1) as sock:
            sock.sendall(probe)
            return sock.recv(64).startswith(reply)
    except OSError:
        return False


def memcached_answers(port: int) -> bool:
    return answers(port, b"version\r\n", b"VERSION")


def memcached_argv(port: int) -> list[str]:
    """Command line of one loopback memcached; also used by the tests' extra nodes."""
    program = which("memcached")
    if program is None:
        sys.exit("services: memcached not found; install memcached")
    user_args = ["-u", "root"] if os.geteuid() == 0 else []
    return [program, "-l", HOST, "-p", str(port), "-U", "0", "-m", "64", "-c", "1024",
            "-t", "2", *user_args]


def memcached_up() -> None:
    for index in range(MEMCACHED_NODES):
        memcached_start(MEMCACHED_PORT + index, "KVCACHE_MEMCACHED_PORT")


def memcached_start(port: int, env_var: str) -> None:
    """One memcached on ``port``, unless ours already runs there."""
    start_once("memcached", port, env_var, memcached_argv, memcached_answers)


def start_once(
    what: str, port: int, env_var: str, argv: Callable[[int], list[str]],
    answering: Callable[[int], bool],
) -> None:
    """The server ``what`` (named so in its pid and log files) on ``port``, unless ours
    already runs there; ``argv`` gives its command line, ``answering`` says it is up."""
    name = f"{what}-{port}"
    if running_pid(name) and answering(port):
        log(f"{what} already running on {HOST}:{port}")
        return
    stop(name)
    ensure_port_free(port, what, env_var)
    pid = spawn(name, argv(port))
    wait_until(lambda: answering(port), f"{what} on {HOST}:{port}", pid, name)
    log(f"{what} started on {HOST}:{port} (pid {pid})")


# --- twemproxy ---------------------------------------------------------------------------


def twemproxy_server_ports(port: int, nodes: int = TWEMPROXY_NODES) -> list[int]:
    """The ports of the memcached processes behind the twemproxy on ``port``."""
    return [port + 1 + index for index in range(nodes)]


def twemproxy_argv(
    port: int, servers: list[str], directory: Path, name: str, stats_port: int | None = None
) -> list[str]:
    """Command line of a twemproxy (nutcracker) on loopback ``port`` in front of
    ``servers`` (``host:port``), its configuration written to ``directory``; its stats
    listen on ``stats_port`` (default: the port after the highest of the others). Also
    used by the tests' own proxies.

    One pool, as sites run it: ketama over fnv1a_64, hosts never ejected (a stopped server's
    keys are answered ``SERVER_ERROR``, the others' are served), a 1 s timeout."""
    program = which("nutcracker")
    if program is None:
        sys.exit("services: nutcracker not found; install nutcracker (twemproxy)")
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / f"{name}.yml"
    config.write_text(
        "kvcache:\n"
        f"  listen: {HOST}:{port}\n"
        "  hash: fnv1a_64\n"
        "  distribution: ketama\n"
        "  timeout: 1000\n"
        "  auto_eject_hosts: false\n"
        "  servers:\n"
        + "".join(f"   - {server}:1\n" for server in servers)
    )
    if stats_port is None:
        stats_port = max([port, *(int(s.rsplit(":", 1)[1]) for s in servers)]) + 1
    return [program, "-c", str(config), "-s", str(stats_port), "-a", HOST,
            "-o", str(directory / f"{name}.log")]


def twemproxy_up() -> None:
    """The memcached processes behind the proxy, then the proxy."""
    if TWEMPROXY_PORT is None:
        return
    servers = twemproxy_server_ports(TWEMPROXY_PORT)
    for port in servers:
        memcached_start(port, "KVCACHE_TWEMPROXY_PORT")
    name = f"twemproxy-{TWEMPROXY_PORT}"
    if running_pid(name) and memcached_answers(TWEMPROXY_PORT):
        log(f"twemproxy already running on {HOST}:{TWEMPROXY_PORT}")
        return
    stop(name)
    ensure_port_free(TWEMPROXY_PORT, "twemproxy", "KVCACHE_TWEMPROXY_PORT")
    argv = twemproxy_argv(TWEMPROXY_PORT, [f"{HOST}:{port}" for port in servers], RUNTIME, name)
    pid = spawn(name, argv)
    wait_until(lambda: memcached_answers(TWEMPROXY_PORT), f"twemproxy on {HOST}:{TWEMPROXY_PORT}",
               pid, name)
    log(f"twemproxy started on {HOST}:{TWEMPROXY_PORT} (pid {pid}) in front of "
        f"{HOST}:{servers[0]}-{servers[-1]}")


# --- Redis --------------------------------------------------------------------------------


def redis_answers(port: int) -> bool:
    return answers(port, b"PING\r\n", b"+PONG")


def redis_argv(port: int) -> list[str]:
    """Command line of one loopback Redis that keeps nothing on disk (no RDB snapshot, no
    append-only file), in the foreground: ``spawn`` logs its output and keeps its pid."""
    program = which("redis-server")
    if program is None:
        sys.exit("services: redis-server not found; install redis-server")
    return [program, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--dir", str(RUNTIME), "--logfile", ""]


def redis_up() -> None:
    if REDIS_PORT is not None:
        start_once("redis", REDIS_PORT, "KVCACHE_REDIS_PORT", redis_argv, redis_answers)


# --- Galera -------------------------------------------------------------------------------

#: SST copies a whole data directory: slower than a plain start on a busy machine.
GALERA_START_TIMEOUT = 240.0


def galera_dir() -> Path:
    """Where the Galera nodes keep their data directories, temporary directories and init
    files. Started by root they run as the ``mysql`` user (see ``mariadb_argv``), who cannot
    enter a checkout in a home directory or in a ``mktemp -d`` (mode 700): then a directory
    outside it, named after RUNTIME so that two clones never share one, which
    ``.runtime/galera`` links to. Otherwise RUNTIME itself."""
    if os.geteuid() != 0:
        return RUNTIME
    digest = hashlib.sha256(str(RUNTIME.resolve()).encode()).hexdigest()[:12]
    directory = Path(os.environ.get("KVCACHE_GALERA_DIR") or f"/var/tmp/kvcache-galera-{digest}")
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)  # the mysql user passes through to its own directories
    link = RUNTIME / "galera"
    if not (link.is_symlink() and link.resolve() == directory.resolve()):
        RUNTIME.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(directory)
    return directory


def galera_ports(index: int) -> tuple[int, int, int, int]:
    """Node ``index``'s ports: clients, group communication, IST and SST."""
    base = GALERA_PORT + 4 * index
    return base, base + 1, base + 2, base + 3


def galera_name(index: int) -> str:
    return f"{GALERA_PREFIX}{index}"


def galera_argv(index: int, members: int, datadir: Path, bootstrap: bool) -> list[str]:
    """Command line of Galera node ``index`` of a cluster of ``members`` nodes on loopback.

    The node that ``bootstrap``s starts a new cluster (initialising an empty data
    directory); the others join it and receive its data by rsync (SST), or only the
    writesets they missed (IST). Also used by the tests for a node they may kill.
    """
    client, group, ist, sst = galera_ports(index)
    cluster = ",".join(f"{HOST}:{galera_ports(node)[1]}" for node in range(members))
    options = [
        "--wsrep-on=ON", f"--wsrep-provider={GALERA_PROVIDER}",
        f"--wsrep-cluster-name=kvcache-{GALERA_PORT}", f"--wsrep-node-name=node{index}",
        f"--wsrep-cluster-address=gcomm://{cluster}", f"--wsrep-node-address={HOST}:{group}",
        f"--wsrep-provider-options=gmcast.listen_addr=tcp://{HOST}:{group};"
        f"ist.recv_addr={HOST}:{ist};gcache.size=64M",
        "--wsrep-sst-method=rsync", f"--wsrep-sst-receive-address={HOST}:{sst}",
        # What Galera requires: row events, interleaved auto-increment locks, InnoDB.
        "--binlog-format=ROW", "--innodb-autoinc-lock-mode=2", "--default-storage-engine=InnoDB",
        *(["--wsrep-new-cluster"] if bootstrap else []),
    ]
    return mariadb_argv(datadir, client, galera_name(index), SHARD_BUFFER_POOL, options,
                        initialise=bootstrap, system_user=True)


def galera_state(port: int) -> str | None:
    """The node's wsrep_local_state_comment ("Synced" when it serves), None if unreachable."""
    try:
        rows = sql(port, "SHOW STATUS LIKE 'wsrep_local_state_comment'", timeout=10)
    except (RuntimeError, subprocess.TimeoutExpired):
        return None
    return rows[0]["Value"] if rows else None


def wait_synced(index: int, pid: int) -> None:
    """Until node ``index`` is Synced; exits with the end of its log if it stops first."""
    port = galera_ports(index)[0]
    wait_until(lambda: mysql_answers(port) and galera_state(port) == "Synced",
               f"Galera node {index} on {HOST}:{port}", pid, galera_name(index),
               GALERA_START_TIMEOUT)


def bootstrap_node() -> int:
    """The node whose data the cluster restarts from: the one ``grastate.dat`` says was
    stopped last (safe_to_bootstrap: 1). Without one (a crash, or no data yet) the
    cluster starts afresh: it is a throwaway."""
    for index in range(GALERA_SIZE):
        state = galera_dir() / f"{galera_name(index)}-data" / "grastate.dat"
        if state.exists() and "safe_to_bootstrap: 1" in state.read_text():
            return index
    for index in range(GALERA_SIZE):
        shutil.rmtree(galera_dir() / f"{galera_name(index)}-data", ignore_errors=True)
    return 0


def galera_start(index: int, bootstrap: bool) -> None:
    name, port = galera_name(index), galera_ports(index)[0]
    stop(name)
    for other in galera_ports(index):
        ensure_port_free(other, f"Galera node {index}", "KVCACHE_GALERA_PORT")
    argv = galera_argv(index, GALERA_SIZE, galera_dir() / f"{name}-data", bootstrap)
    started = time.monotonic()
    pid = spawn(name, argv)
    wait_synced(index, pid)
    how = "bootstrapped the cluster" if bootstrap else "joined"
    log(f"Galera node {index} {how} on {HOST}:{port} in {time.monotonic() - started:.1f} s "
        f"(pid {pid})")


def galera_up() -> None:
    """The 3 nodes, one after another: a joiner's state transfer keeps its donor busy."""
    install_deps()
    install_deps(GALERA_PACKAGES)
    RUNTIME.mkdir(parents=True, exist_ok=True)
    nodes = range(GALERA_SIZE)
    synced = [i for i in nodes
              if running_pid(galera_name(i)) and galera_state(galera_ports(i)[0]) == "Synced"]
    for index in synced:
        log(f"Galera node {index} already running on {HOST}:{galera_ports(index)[0]}")
    if not synced:
        for index in nodes:  # stale pid files of nodes that died with the cluster
            stop(galera_name(index))
        first = bootstrap_node()
        galera_start(first, bootstrap=True)
        synced = [first]
    for index in nodes:
        if index not in synced:
            galera_start(index, bootstrap=False)


def galera_down() -> None:
    """The nodes one at a time, the first last: it restarts the cluster next time."""
    for index in reversed(range(GALERA_SIZE)):
        stop(galera_name(index))


def galera_clean() -> None:
    """The nodes stopped and their data removed (``make clean``)."""
    galera_down()
    directory = galera_dir()
    if directory != RUNTIME:
        shutil.rmtree(directory, ignore_errors=True)
        (RUNTIME / "galera").unlink(missing_ok=True)
        return
    for path in RUNTIME.glob(f"{GALERA_PREFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def galera_environment() -> dict[str, str]:
    nodes = ",".join(f"{HOST}:{galera_ports(i)[0]}" for i in range(GALERA_SIZE))
    return {"KVCACHE_GALERA": nodes, "KVCACHE_GALERA_PORT": str(GALERA_PORT)}


# --- commands -----------------------------------------------------------------------------


def environment() -> dict[str, str]:
    nodes = ",".join(f"{HOST}:{MEMCACHED_PORT + i}" for i in range(MEMCACHED_NODES))
    return {
        "KVCACHE_MYSQL_HOST": HOST,
        "KVCACHE_MYSQL_PORT": str(MYSQL_PORT),
        "KVCACHE_MYSQL_USER": MYSQL_USER,
        "KVCACHE_MYSQL_PASSWORD": "",
        "KVCACHE_MYSQL_DATABASE": MYSQL_DATABASE,
        "KVCACHE_MYSQL_SHARD_PORTS": ",".join(map(str, MYSQL_SHARD_PORTS)),
        "KVCACHE_MYSQL_REPLICA_PORT": str(MYSQL_REPLICA_PORT or ""),
        "KVCACHE_MEMCACHED": nodes,
        **twemproxy_environment(),
        "KVCACHE_REDIS": f"{HOST}:{REDIS_PORT}" if REDIS_PORT is not None else "",
    }


def twemproxy_environment() -> dict[str, str]:
    """The proxy's address, and its servers' (the tests empty them directly: twemproxy
    forwards no ``flush_all``)."""
    if TWEMPROXY_PORT is None:
        return {"KVCACHE_TWEMPROXY": ""}
    servers = ",".join(f"{HOST}:{port}" for port in twemproxy_server_ports(TWEMPROXY_PORT))
    return {"KVCACHE_TWEMPROXY": f"{HOST}:{TWEMPROXY_PORT}",
            "KVCACHE_TWEMPROXY_SERVERS": servers}


def print_env(variables: dict[str, str], file_name: str = "services.env") -> None:
    text = "".join(f"export {name}={value}\n" for name, value in variables.items())
    (RUNTIME / file_name).write_text(text)
    sys.stdout.write(text)


def cmd_up() -> None:
    install_deps()
    RUNTIME.mkdir(parents=True, exist_ok=True)
    mariadb_up()
    memcached_up()
    twemproxy_up()
    redis_up()
    print_env(environment())


def cmd_down() -> None:
    """Everything `up` started; a Galera cluster is left to `galera down`."""
    if not RUNTIME.is_dir():
        return
    for path in sorted(RUNTIME.glob("*.pid")):
        if not path.stem.startswith(GALERA_PREFIX):
            stop(path.stem)


def cmd_galera(action: str | None) -> None:
    if action == "down":
        if RUNTIME.is_dir():
            galera_down()
        return
    if action == "clean":
        if RUNTIME.is_dir():
            galera_clean()
        return
    if action == "up":
        galera_up()
    RUNTIME.mkdir(parents=True, exist_ok=True)
    print_env(galera_environment(), "galera.env")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["deps", "up", "down", "env", "galera"])
    parser.add_argument("action", nargs="?", choices=["up", "down", "env", "clean"],
                        help="with 'galera': start, print the env vars of, or stop the "
                        "cluster, or stop it and remove its data")
    arguments = parser.parse_args(argv)
    command = arguments.command
    if (command == "galera") != (arguments.action is not None):
        parser.error("an action (up, env, down, clean) goes with 'galera', and only with it")
    if command == "deps":
        install_deps()
    elif command == "up":
        cmd_up()
    elif command == "down":
        cmd_down()
    elif command == "galera":
        cmd_galera(arguments.action)
    else:
        RUNTIME.mkdir(parents=True, exist_ok=True)
        print_env(environment())


if __name__ == "__main__":
    main()
