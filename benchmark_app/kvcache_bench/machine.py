"""The machine and software a run measured, stored next to its figures."""
from __future__ import annotations

import datetime
import os
import platform
import socket
import sqlite3
from importlib import metadata
from typing import Any, Iterable

import django
from django.db import connections

PACKAGES = ("django-kvcache", "pymemcache", "mysqlclient", "django-mysql", "mmh3")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def mariadb_version(databases: Iterable[str]) -> str | None:
    """The server version of the first MySQL/MariaDB database among ``databases``."""
    for alias in databases:
        if connections[alias].vendor != "mysql":
            continue
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT VERSION()")
                return cursor.fetchone()[0]
        except Exception:  # no server: the description says so
            return None
    return None


def memcached_version(address: str) -> str | None:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1) as sock:
            sock.sendall(b"version\r\n")
            reply = sock.recv(64).decode(errors="replace").split()
    except OSError:
        return None
    return reply[1] if len(reply) > 1 and reply[0] == "VERSION" else None


def describe(memcached_nodes: list[str], databases: Iterable[str] = ()) -> dict[str, Any]:
    """The machine, and the servers of what is measured: the database servers of the
    table caches (``databases``, their aliases) and memcached; None where nothing of
    that kind is measured."""
    databases = list(dict.fromkeys(databases))
    sqlite = any(connections[alias].vendor == "sqlite" for alias in databases)
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_at_start": [round(load, 2) for load in os.getloadavg()],
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "django": django.get_version(),
        "packages": {name: package_version(name) for name in PACKAGES},
        "mariadb": mariadb_version(databases),
        "sqlite": sqlite3.sqlite_version if sqlite else None,
        "memcached": memcached_version(memcached_nodes[0]) if memcached_nodes else None,
        "memcached_nodes": len(memcached_nodes),
    }
