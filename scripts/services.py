#!/usr/bin/env python3
"""Throwaway MariaDB and memcached servers for django-kvcache's tests and benchmark.

    python3 scripts/services.py deps   # install what is missing (Debian/Ubuntu, as root)
    python3 scripts/services.py up     # start (or reuse) the servers, print their env vars
    python3 scripts/services.py env    # print the env vars for running servers
    python3 scripts/services.py down   # stop only what `up` started (by pid file)

Everything lives under ``.runtime/`` in the project (git-ignored): data directory,
sockets, logs, pid files and ``services.env``. Servers listen on loopback only, on
non-default ports, so a MariaDB on 3306 or a memcached on 11211 is never touched.

Settings (environment variables, all optional):
    KVCACHE_MYSQL_PORT        MariaDB port (default 23306)
    KVCACHE_MYSQL_SHARD_PORTS ports of the extra MariaDB servers for the shard tests,
                              comma-separated (default: the next two ports, 23307,23308;
                              empty: none)
    KVCACHE_MEMCACHED_PORT    first memcached port (default 21211)
    KVCACHE_MEMCACHED_NODES   number of memcached processes (default 4)
    KVCACHE_RUNTIME_DIR       where state lives (default <project>/.runtime)

Only the standard library is used: this runs before any virtualenv exists.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
#: InnoDB buffer pool of the main server, and of each (small, short-lived) shard server.
BUFFER_POOL = "256M"
SHARD_BUFFER_POOL = "64M"
MEMCACHED_PORT = int(os.environ.get("KVCACHE_MEMCACHED_PORT", "21211"))
MEMCACHED_NODES = int(os.environ.get("KVCACHE_MEMCACHED_NODES", "4"))
START_TIMEOUT = 60.0

# Debian package -> a file it installs that we need.
SYSTEM_PACKAGES = {
    "mariadb-server": "mariadbd",
    "memcached": "memcached",
    "libmariadb-dev": "mariadb_config",  # headers for building mysqlclient
    "pkg-config": "pkg-config",
    "build-essential": "gcc",  # mysqlclient compiles on install
}
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def log(message: str) -> None:
    print(f"services: {message}", file=sys.stderr, flush=True)


def which(program: str) -> str | None:
    """shutil.which that also looks in sbin directories (mariadbd lives in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS])
    return shutil.which(program, path=path)


# --- installing ---------------------------------------------------------------------------


def missing_packages() -> list[str]:
    return [pkg for pkg, program in SYSTEM_PACKAGES.items() if not which(program)]


def install_deps() -> None:
    missing = missing_packages()
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
    still_missing = missing_packages()
    if still_missing:
        sys.exit(f"services: apt-get did not provide: {' '.join(still_missing)}")


# --- process bookkeeping ----------------------------------------------------------------


def pid_file(name: str) -> Path:
    return RUNTIME / f"{name}.pid"


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


def wait_until(check, what: str, pid: int, log_name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if check():
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
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
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        log(f"stopped {name} (pid {pid})")
    pid_file(name).unlink(missing_ok=True)


# --- MariaDB ------------------------------------------------------------------------------


def socket_path(name: str) -> Path:
    path = RUNTIME / f"{name}.sock"
    if len(str(path)) < 100:  # unix socket paths are limited to ~107 bytes
        RUNTIME.mkdir(parents=True, exist_ok=True)  # tests may start a server before `up`
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
    datadir: Path, port: int, name: str, buffer_pool: str = BUFFER_POOL
) -> list[str]:
    """Command line of one loopback MariaDB, initialising `datadir` on first use.

    Also used by the tests for a second server they may restart.
    """
    user_args = ["--user=root"] if os.geteuid() == 0 else []
    # A temporary directory of its own: servers set up at the same time in a shared /tmp
    # have collided on their temporary tables' file names.
    tmpdir = datadir.parent / f"{name}-tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    if not (datadir / "mysql").is_dir():
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
        f"--bind-address={HOST}", f"--socket={socket_path(name)}",
        f"--init-file={init_sql}", "--skip-name-resolve", "--skip-log-bin",
        "--character-set-server=utf8mb4", "--collation-server=utf8mb4_general_ci",
        "--max-connections=500", f"--innodb-buffer-pool-size={buffer_pool}",
        # A throwaway server: durability is not worth an fsync per commit.
        "--innodb-flush-log-at-trx-commit=2", "--sync-binlog=0",
        *user_args,
    ]


def mariadb_up() -> None:
    """The main server, then the shard servers: all spawned before waiting for any."""
    servers = [("mariadb", MYSQL_PORT, BUFFER_POOL, "KVCACHE_MYSQL_PORT")] + [
        (f"mariadb-{port}", port, SHARD_BUFFER_POOL, "KVCACHE_MYSQL_SHARD_PORTS")
        for port in MYSQL_SHARD_PORTS
    ]
    started = []
    for name, port, buffer_pool, env_var in servers:
        if running_pid(name) and mysql_answers(port):
            log(f"MariaDB already running on {HOST}:{port}")
            continue
        stop(name)
        ensure_port_free(port, "MariaDB", env_var)
        argv = mariadb_argv(RUNTIME / f"{name}-data", port, name, buffer_pool)
        started.append((name, port, spawn(name, argv)))
    for name, port, pid in started:
        wait_until(lambda: mysql_answers(port), f"MariaDB on {HOST}:{port}", pid, name)
        log(f"MariaDB started on {HOST}:{port} (pid {pid})")


# --- memcached ----------------------------------------------------------------------------


def memcached_answers(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1) as sock:
            sock.sendall(b"version\r\n")
            return sock.recv(64).startswith(b"VERSION")
    except OSError:
        return False


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
        port = MEMCACHED_PORT + index
        name = f"memcached-{port}"
        if running_pid(name) and memcached_answers(port):
            log(f"memcached already running on {HOST}:{port}")
            continue
        stop(name)
        ensure_port_free(port, "memcached", "KVCACHE_MEMCACHED_PORT")
        pid = spawn(name, memcached_argv(port))
        wait_until(lambda: memcached_answers(port), f"memcached on {HOST}:{port}", pid, name)
        log(f"memcached started on {HOST}:{port} (pid {pid})")


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
        "KVCACHE_MEMCACHED": nodes,
    }


def print_env() -> None:
    text = "".join(f"export {name}={value}\n" for name, value in environment().items())
    (RUNTIME / "services.env").write_text(text)
    sys.stdout.write(text)


def cmd_up() -> None:
    install_deps()
    RUNTIME.mkdir(parents=True, exist_ok=True)
    mariadb_up()
    memcached_up()
    print_env()


def cmd_down() -> None:
    if not RUNTIME.is_dir():
        return
    for path in sorted(RUNTIME.glob("*.pid")):
        stop(path.stem)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["deps", "up", "down", "env"])
    command = parser.parse_args(argv).command
    if command == "deps":
        install_deps()
    elif command == "up":
        cmd_up()
    elif command == "down":
        cmd_down()
    else:
        RUNTIME.mkdir(parents=True, exist_ok=True)
        print_env()


if __name__ == "__main__":
    main()
