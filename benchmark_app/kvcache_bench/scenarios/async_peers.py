"""The async scenario's peer: emcache's own benchmark, our side through Django's cache API.

emcache's README measures TASKS asyncio tasks doing as many ``set`` calls as they can
for SECONDS, then as many ``get`` calls, on 1, 2, 4 and 8 memcached nodes, with and
without its autobatching. The same here, one event loop per client and round, 64-byte
values (emcache stores bytes; ours pickles them, as Django does), plus ``get_many`` of 20
keys:

* ``emcache`` and ``emcache autobatching``: emcache's client with MAX_CONNECTIONS
  connections per node (its README's setting);
* ``kv-memcached`` (default OPTIONS: AUTOBATCH on) and ``kv-memcached no autobatch``:
  our MemcachedCache's ``aset``/``aget``/``aget_many``.

Each figure is the median of ROUNDS rounds in which the clients take turns (a change in
the machine's load hits all alike): calls per second, and the process's CPU time per
call (client and event loop; the memcached servers run in processes of their own).
``ratios`` sets ours against emcache at the targets: ``get`` (default OPTIONS) ≥ 1.0×
emcache and ≥ 0.8× emcache autobatching, ``set`` ≥ 0.9× emcache, ``get_many`` ≥ 1.0×
emcache's.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

TASKS = 32
SECONDS = 1.5
ROUNDS = 3
MAX_CONNECTIONS = 32
VALUE = b"v" * 64
KEYS = 1000
BATCH = 20
EMCACHE, EMCACHE_BATCHING = "emcache", "emcache autobatching"
OURS, OURS_UNBATCHED = "kv-memcached", "kv-memcached no autobatch"
#: (ours, operation, peer, least ratio of calls per second).
TARGETS = (
    (OURS, "get", EMCACHE, 1.0),
    (OURS, "get", EMCACHE_BATCHING, 0.8),
    (OURS, "set", EMCACHE, 0.9),
    (OURS, f"get_many({BATCH})", EMCACHE, 1.0),
)

Call = Callable[[int], Awaitable[Any]]


def available() -> str | None:
    """Why the peer cannot run here, or None."""
    try:
        import emcache  # noqa: F401
    except ImportError:
        return "emcache is not installed (pip install emcache, or the bench extra)"
    return None


def measure(addresses: list[str], counts: list[int], token: str,
            seconds: float = SECONDS, rounds: int = ROUNDS) -> dict[str, Any]:
    """Every client on the first ``n`` of ``addresses`` for each ``n`` in ``counts``."""
    results = []
    for count in counts:
        nodes = addresses[:count]
        measured: dict[tuple[str, str], list[dict[str, Any]]] = {}
        clients = [EMCACHE, EMCACHE_BATCHING, OURS, OURS_UNBATCHED]
        for round_ in range(rounds):
            turn = clients[round_ % len(clients):] + clients[:round_ % len(clients)]
            for client in turn:
                for entry in asyncio.run(_one_round(client, nodes, token, seconds)):
                    measured.setdefault((client, entry["operation"]), []).append(entry)
        for (client, operation), entries in measured.items():
            entries.sort(key=lambda entry: entry["ops_per_s"])
            median = entries[len(entries) // 2]
            results.append({"client": client, "nodes": count, "operation": operation,
                            "ops_per_s": median["ops_per_s"], "cpu_us": median["cpu_us"],
                            "rounds_ops_per_s": [e["ops_per_s"] for e in entries]})
    return {"tasks": TASKS, "seconds": seconds, "rounds": rounds, "value_bytes": len(VALUE),
            "counts": counts, "results": results, "ratios": ratios(results)}


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rate = {(e["client"], e["operation"], e["nodes"]): e["ops_per_s"] for e in results}
    found = []
    for ours, operation, peer, target in TARGETS:
        for count in sorted({e["nodes"] for e in results}):
            mine, theirs = rate.get((ours, operation, count)), rate.get((peer, operation, count))
            if mine and theirs:
                ratio = round(mine / theirs, 2)
                found.append({"operation": operation, "nodes": count, "versus": peer,
                              "ratio": ratio, "target": target, "met": ratio >= target})
    return found


async def _one_round(client: str, nodes: list[str], token: str,
                     seconds: float) -> list[dict[str, Any]]:
    keys = [f"kvb-{token}-peer-{i}" for i in range(KEYS)]
    if client.startswith("emcache"):
        import emcache

        addresses = [emcache.MemcachedHostAddress(*_host_port(node)) for node in nodes]
        emc = await emcache.create_client(addresses, max_connections=MAX_CONNECTIONS,
                                          autobatching=client == EMCACHE_BATCHING)
        raw = [key.encode() for key in keys]
        batches = [raw[i:i + BATCH] for i in range(0, KEYS, BATCH)]
        operations: dict[str, Call] = {
            "set": lambda i: emc.set(raw[i % KEYS], VALUE),
            "get": lambda i: emc.get(raw[i % KEYS]),
            f"get_many({BATCH})": lambda i: emc.get_many(batches[i % len(batches)]),
        }
        close: Callable[[], Awaitable[Any]] = emc.close

        async def clean(key: bytes) -> None:
            try:
                await emc.delete(key)
            except emcache.NotFoundCommandError:  # a short round set fewer keys than KEYS
                pass
    else:
        from django_kvcache.backends.memcached import MemcachedCache

        options = {"AUTOBATCH": False} if client == OURS_UNBATCHED else {}
        cache = MemcachedCache(nodes, {"OPTIONS": options})
        batches = [keys[i:i + BATCH] for i in range(0, KEYS, BATCH)]
        operations = {
            "set": lambda i: cache.aset(keys[i % KEYS], VALUE),
            "get": lambda i: cache.aget(keys[i % KEYS]),
            f"get_many({BATCH})": lambda i: cache.aget_many(batches[i % len(batches)]),
        }

        async def close() -> None:
            await cache.adelete_many(keys)

        clean = None
    try:
        found = []
        for operation, call in operations.items():  # sets first: the gets then hit
            await _drive(call, 0.1)  # warm: connections open
            calls, wall, cpu = await _drive(call, seconds)
            found.append({"operation": operation, "ops_per_s": round(calls / wall, 1),
                          "cpu_us": round(cpu / calls * 1e6, 2)})
        return found
    finally:
        if clean is not None:
            for key in keys:
                await clean(key.encode())
        await close()


async def _drive(call: Call, seconds: float) -> tuple[int, float, float]:
    """TASKS tasks calling ``call`` until ``seconds`` are up: calls made, wall time, CPU."""
    done = 0
    stop = time.perf_counter() + seconds

    async def task(offset: int) -> None:
        nonlocal done
        i = offset
        while time.perf_counter() < stop:
            await call(i)
            i += TASKS
            done += 1

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(task(t) for t in range(TASKS)))
    return done, time.perf_counter() - started, time.process_time() - cpu


def _host_port(node: str) -> tuple[str, int]:
    host, port = node.rsplit(":", 1)
    return host, int(port)
