"""``scale``: what each operation costs as a MySQL cache's table grows (issue 41 §2).

The table is filled to each size of ``--scale-rows`` (100 k and 1 M by default; 10 M on
request) with the ``small`` mix's values (the realistic kinds, each at most 3 KB), on the
MariaDB that ``services.py up`` starts (``default``): its InnoDB buffer pool is stated
beside the tables' bytes, so the fraction of the table it holds is in the results. The
fill is not timed and goes fast: each cache writes a pool of distinct values through its
own API once, and the rows it stored are copied under the other keys with multi-row
INSERTs (what each cache would have stored for that value: same codec, same expiry).

At each size, for our MySQLCache (``kv-mysql-innodb``), and up to ``PEER_MAX_ROWS`` for
Django's DatabaseCache and django-mysql's MySQLCache in tables of their own on the same
server with the same values: ``get`` hit (uniform and Zipf-like keys), ``get`` miss,
``get_many(20)`` (uniform and Zipf-like), ``set`` (overwriting an entry), ``delete``
(the deleted entries written back afterwards, untimed), p50 and p99 of each; our
``set`` with ``CULL_PROBABILITY`` 1.0 (a write-path cull on every write); the bare
primary-key SELECT and the bare 20-key SELECT on our table with the driver the cache
uses; ``cull()`` (what ``kvcache_cull`` runs) over expired rows a tenth of the table;
stored bytes per entry; this process's memory. ``targets`` says which of issue 41's
targets were met at this run's sizes.
"""
from __future__ import annotations

import random
import resource
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from django.db import connections, transaction

from kvcache_bench import data
from kvcache_bench.caches import MAX_ENTRIES, CacheSpec
from kvcache_bench.checks import matches
from kvcache_bench.context import Context
from kvcache_bench.storage import table_usage
from kvcache_bench.timing import rotated, summarize, time_calls

MIX = "small"
#: Caches measured, by benchmark name: ours at every size, the two peers up to PEER_MAX_ROWS.
OURS = "kv-mysql-innodb"
PEERS = ("db-mariadb", "django-mysql")
PEER_MAX_ROWS = 1_000_000
POOL = 256  # distinct values; key ``scale.N`` holds value N % POOL
INSERT_CHUNK = 1000  # rows per multi-row INSERT of the fill
#: DatabaseCache's set counts the table on every write (63 ms a call at 1 M in the issue's
#: baseline): fewer calls of it, so that one size stays within a minute.
SLOW_SET_CALLS = 40
ZIPF_EXPONENT = 1.1
#: Key spreading for the Zipf-like pattern: rank r is key (r * STRIDE) % N, so the hot keys
#: are scattered over the table, not the first rows written (a prime, so coprime to each N,
#: and no near multiple of a power of ten, so consecutive ranks land far apart).
STRIDE = 2_654_435_761
EXPIRED_SHARE = 10  # kvcache_cull runs over expired rows a tenth of the table
#: The IO_TIMEOUT (seconds) of the cache that times the cull: at 10 M entries one of its
#: 10,000-row batches took more than the default 2 s here (2 cores, load average about 4).
CULL_IO_TIMEOUT = 600
ROUNDS = 5  # reads: the bare SELECT and each cache take turns, a fifth of the calls a turn
MIB = 2**20
MIN_BUFFER_POOL = 8 * MIB
TIMEOUT = 6 * 3600  # the fill's entries outlive any run; the tables are dropped at the end
#: The targets of issue 41 §2 at this run's sizes.
GET_VS_BARE, GET_MANY_VS_BARE, WRITE_GROWTH, ZIPF_GET_GROWTH = 1.15, 1.3, 1.2, 1.3
#: kvcache_cull "proportional to the rows it removes": its time per removed row at the
#: largest size within this factor of the smallest size's, either way.
CULL_PER_ROW_SPREAD = 1.5


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    sizes = sorted(p.scale_rows)
    specs = [spec for spec in context.caches if spec.name in (OURS, *PEERS)]
    ours = next((spec for spec in specs if spec.name == OURS), None)
    if ours is None:
        raise RuntimeError(f"the scale scenario measures {OURS}, which is not among the caches")
    # Never a cull over the count: the benchmark's MAX_ENTRIES (10 M) is the 10 M tier's size,
    # and its cull adds a tenth of expired rows (as storage.cull_once sets it).
    context.cache(ours)._max_entries = max(MAX_ENTRIES, 2 * sizes[-1])
    pool = data.make_values(p.seed, POOL, MIX, 0).entries
    filled = dict.fromkeys((spec.name for spec in specs), 0)
    results: list[dict[str, Any]] = []
    culls, usage, memory, pools = [], [], [], []
    server_pool = _buffer_pool(ours)
    try:
        with context.progress("scale", len(sizes) * len(specs)) as bar:
            for size in sizes:
                measured = [spec for spec in specs if spec is ours or size <= PEER_MAX_ROWS]
                tables = 0
                _set_buffer_pool(ours, max(server_pool or 0, _buffer_pool(ours) or 0))  # fill faster
                for spec in measured:
                    started = time.monotonic()
                    _fill(context, spec, pool, filled[spec.name], size)
                    filled[spec.name] = size
                    fill_s = time.monotonic() - started
                    used = table_usage(spec)
                    tables += (used["data_length"] or 0) + (used["index_length"] or 0)
                    usage.append({"cache": spec.name, "rows": size, "fill_s": round(fill_s, 1),
                                  "bytes_per_entry": round(used["column_bytes"] / used["rows"], 1),
                                  "table_bytes_per_entry": _per(used["data_length"], used["index_length"], used["rows"]),
                                  "data_length": used["data_length"], "index_length": used["index_length"]})
                pools.append(_size_buffer_pool(ours, size, tables, p.scale_buffer_pool))
                rng = random.Random(p.seed + size)
                zipf = ZipfKeys(size, ZIPF_EXPONENT)
                patterns = {"uniform": lambda: rng.randrange(size), "zipf": lambda: zipf.draw(rng)}
                results += _reads(context, ours, measured, size, patterns, p.scale_calls, p.batch, pool)
                for spec in measured:
                    results += _writes(context, spec, size, p.scale_calls, pool)
                    bar.update()
                culls.append(_cull(context, ours, size, pool))
                memory.append({"rows": size, **_memory()})
    finally:
        _set_buffer_pool(ours, server_pool)
    return {"sizes": sizes, "values": data.label(data.mix_named(MIX), _mean(pool)),
            "server": "the MariaDB of services.py up (database 'default'), its buffer pool resized",
            "buffer_pool_fraction": p.scale_buffer_pool, "buffer_pools": pools,
            "calls": p.scale_calls, "rounds": ROUNDS,
            "slow_set_calls": SLOW_SET_CALLS, "zipf_exponent": ZIPF_EXPONENT,
            "results": results, "culls": culls, "usage": usage, "memory": memory,
            "targets": targets(results, culls, sizes)}


def _size_buffer_pool(spec: CacheSpec, size: int, tables: int, fraction: float) -> dict[str, Any]:
    """The server's InnoDB buffer pool resized to ``fraction`` of the measured tables' bytes
    (data and indexes, every cache's table at this size together: they share the pool)."""
    wanted = max(MIN_BUFFER_POOL, round(fraction * tables / MIB) * MIB)
    _set_buffer_pool(spec, wanted)
    got = _buffer_pool(spec)
    return {"rows": size, "tables_bytes": tables, "buffer_pool_bytes": got,
            "fraction": round(got / tables, 3) if tables else None}


def _set_buffer_pool(spec: CacheSpec, size: int | None) -> None:
    """``SET GLOBAL innodb_buffer_pool_size`` (dynamic since MariaDB 10.2 and MySQL 5.7),
    returning once the server reports the new size."""
    if size is None or _buffer_pool(spec) == size:
        return
    with connections[spec.database].cursor() as cursor:
        cursor.execute(f"SET GLOBAL innodb_buffer_pool_size = {int(size)}")
    deadline = time.monotonic() + 60
    while _buffer_pool(spec) != size and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # the resize finishes in the background after the variable changes


class ZipfKeys:
    """Key indexes of a table of ``size`` keys drawn Zipf-like: rank r with weight
    1/r**exponent, rank r being key (r * STRIDE) % size."""

    def __init__(self, size: int, exponent: float) -> None:
        import numpy  # matplotlib's dependency (the bench extra): 80 MB at 10 M keys, not 300

        self.size = size
        self.cumulative = numpy.cumsum(1 / numpy.arange(1, size + 1, dtype=float) ** exponent)

    def draw(self, rng: random.Random) -> int:
        rank = int(self.cumulative.searchsorted(rng.random() * self.cumulative[-1]))
        return (rank * STRIDE) % self.size


def key(index: int) -> str:
    return f"scale.{index}"


# --- the fill --------------------------------------------------------------------------------

def _fill(context: Context, spec: CacheSpec, pool: Sequence[Any], start: int, size: int) -> None:
    """Keys ``start`` .. ``size - 1`` written: the pool's rows through the cache's own
    ``set_many``, then copies of them under the other keys (every column as the cache stored
    it, the key column being the cache's ``make_key``) in multi-row INSERTs."""
    if size <= start:
        return
    cache = context.cache(spec)
    first = min(size, max(start, POOL))
    if start < POOL:
        if cache.set_many({key(i): pool[i % POOL] for i in range(start, first)}, timeout=TIMEOUT):
            raise RuntimeError(f"scale: {spec.name} could not write its pool of values")
    if first >= size:
        return
    _copy_rows(spec, cache, range(first, size), key)


def _copy_rows(spec: CacheSpec, cache: Any, indexes: range, name: Callable[[int], str],
               expires: Any = None) -> None:
    """Rows as the cache stored the pool's values, under other keys: for each index, the
    row of pool value ``index % POOL`` with the key column holding ``make_key(name(index))``
    (and ``expires`` instead of the stored expiry, when given), in multi-row INSERTs."""
    columns, templates = _stored_rows(spec, cache)
    at, expiry = columns.index("cache_key"), columns.index("expires")
    connection = connections[spec.database]
    statement = (f"INSERT INTO {connection.ops.quote_name(spec.table)} "
                 f"({', '.join(f'`{column}`' for column in columns)}) "
                 f"VALUES ({', '.join(['%s'] * len(columns))})")
    for chunk in range(0, len(indexes), INSERT_CHUNK):
        rows = []
        for index in indexes[chunk:chunk + INSERT_CHUNK]:
            row = list(templates[index % POOL])
            row[at] = cache.make_key(name(index))
            if expires is not None:
                row[expiry] = expires
            rows.append(row)
        with transaction.atomic(using=spec.database), connection.cursor() as cursor:
            cursor.executemany(statement, rows)  # mysqlclient sends one multi-row INSERT


def _stored_rows(spec: CacheSpec, cache: Any) -> tuple[list[str], list[tuple]]:
    """The table's columns, and the row the cache stored for each pool value (by index)."""
    connection = connections[spec.database]
    stored = [cache.make_key(key(i)) for i in range(POOL)]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {connection.ops.quote_name(spec.table)} WHERE cache_key IN "
                       f"({', '.join(['%s'] * POOL)})", stored)
        columns = [column[0] for column in cursor.description]
        found = {row[columns.index("cache_key")]: row for row in cursor.fetchall()}
    missing = [name for name in stored if name not in found]
    if missing:  # the stored key is not make_key's: copies would be unreadable
        raise RuntimeError(f"scale: {spec.name} stored no row under {missing[0]!r}")
    return columns, [found[name] for name in stored]


# --- the measurements ------------------------------------------------------------------------

def _entry(cache: str, operation: str, pattern: str, size: int, durations: list[int]) -> dict[str, Any]:
    return {"cache": cache, "case": f"{operation}, {pattern}", "operation": operation,
            "pattern": pattern, "rows": size, **summarize(durations)}


def _reads(context: Context, ours: CacheSpec, specs: Sequence[CacheSpec], size: int,
           patterns: dict[str, Callable[[], int]], calls: int, batch: int,
           pool: Sequence[Any]) -> list[dict[str, Any]]:
    """``get`` hit and ``get_many(batch)`` of each cache beside the bare primary-key and
    ``batch``-key SELECT on our table (the driver's own connection, no Django cursor
    wrapper, reading what ``get`` reads), in ROUNDS turns so that all meet the same server
    state; then ``get`` miss."""
    connection = connections[ours.database]
    connection.ensure_connection()
    cursor = connection.connection.cursor()
    made = context.cache(ours).make_key
    table = connection.ops.quote_name(ours.table)
    one = f"SELECT `value`, `flags`, `expires` FROM {table} WHERE `cache_key` = %s"
    many = (f"SELECT `cache_key`, `value`, `flags`, `expires` FROM {table} WHERE `cache_key` IN "
            f"({', '.join(['%s'] * batch)})")

    def select(statement: str, arguments: Any) -> int:
        cursor.execute(statement, arguments)
        return len(cursor.fetchall())

    def check(spec: CacheSpec, operation: str, wrong: int) -> None:
        if wrong:
            context.failures.append(f"scale: {spec.name} {operation} at {size:,} rows: "
                                    f"{wrong} wrong result(s)")

    def get(spec: CacheSpec, indexes: list[int]) -> list[int]:
        timed = time_calls(lambda i: context.cache(spec).get(key(i)), indexes)
        check(spec, "get", sum(not matches(got, pool[i % POOL]) for got, i in zip(timed.results, indexes)))
        return timed.durations

    def get_many(spec: CacheSpec, groups: list[list[int]]) -> list[int]:
        timed = time_calls(lambda group: context.cache(spec).get_many([key(i) for i in group]), groups)
        check(spec, "get_many", sum(not isinstance(got, dict) or not matches(got.get(key(i)), pool[i % POOL])
                                    for got, group in zip(timed.results, groups) for i in group))
        return timed.durations

    def bare_get(_spec: CacheSpec, indexes: list[int]) -> list[int]:
        return time_calls(lambda i: select(one, (made(key(i)),)), indexes).durations

    def bare_get_many(_spec: CacheSpec, groups: list[list[int]]) -> list[int]:
        return time_calls(lambda group: select(many, [made(key(i)) for i in group]), groups).durations

    entries = []
    subjects = [("bare SELECT", ours, bare_get, bare_get_many)] + [
        (spec.name, spec, get, get_many) for spec in specs]
    try:
        for pattern, draw in patterns.items():
            for operation in ("get hit", f"get_many({batch})"):
                durations: dict[str, list[int]] = {name: [] for name, *_ in subjects}
                for round_index in range(ROUNDS):
                    share = calls // ROUNDS + (round_index < calls % ROUNDS)
                    for name, spec, one_key, many_keys in rotated(subjects, round_index):
                        if operation == "get hit":
                            durations[name] += one_key(spec, [draw() for _ in range(share)])
                        else:
                            durations[name] += many_keys(spec, [[draw() for _ in range(batch)]
                                                                for _ in range(share)])
                entries += [_entry(name, operation, pattern, size, durations[name]) for name in durations]
    finally:
        cursor.close()
    rng = random.Random(size)
    for spec in specs:
        absent = [f"scale.absent.{rng.randrange(10**12)}" for _ in range(calls)]
        timed = time_calls(context.cache(spec).get, absent)
        check(spec, "get miss", sum(result is not None for result in timed.results))
        entries.append(_entry(spec.name, "get miss", "uniform", size, timed.durations))
    return entries


def _writes(context: Context, spec: CacheSpec, size: int, calls: int,
            pool: Sequence[Any]) -> list[dict[str, Any]]:
    """``set`` over an entry, ``delete`` (the entries written back afterwards, untimed);
    for ours also ``set`` with a write-path cull on every write (CULL_PROBABILITY 1.0)."""
    cache = context.cache(spec)
    rng = random.Random(size)
    entries = []

    def check(operation: str, wrong: int) -> None:
        if wrong:
            context.failures.append(f"scale: {spec.name} {operation} at {size:,} rows: "
                                    f"{wrong} wrong result(s)")

    writes = [rng.randrange(size) for _ in range(min(calls, SLOW_SET_CALLS) if spec.family == "db" else calls)]
    timed = time_calls(lambda i: cache.set(key(i), pool[i % POOL], timeout=TIMEOUT), writes)
    check("set", sum(isinstance(result, Exception) for result in timed.results))
    entries.append(_entry(spec.name, "set", "uniform", size, timed.durations))
    deleted = list(dict.fromkeys(rng.randrange(size) for _ in range(calls)))
    timed = time_calls(lambda i: cache.delete(key(i)), deleted)
    # django-mysql's delete returns None: only a False (nothing deleted) or an error is wrong.
    check("delete", sum(result is False or isinstance(result, Exception) for result in timed.results))
    entries.append(_entry(spec.name, "delete", "uniform", size, timed.durations))
    cache.set_many({key(i): pool[i % POOL] for i in deleted}, timeout=TIMEOUT)  # untimed
    if spec.name == OURS:
        culling = replace(spec, options={**spec.options, "CULL_PROBABILITY": 1.0,
                                         "MAX_ENTRIES": cache._max_entries}).build()
        try:
            writes = [rng.randrange(size) for _ in range(calls)]
            timed = time_calls(lambda i: culling.set(key(i), pool[i % POOL], timeout=TIMEOUT), writes)
            check("set (culling)", sum(isinstance(result, Exception) for result in timed.results))
            entries.append(_entry(spec.name, "set, cull every write", "uniform", size, timed.durations))
        finally:
            culling.close()
    return entries


def _cull(context: Context, spec: CacheSpec, size: int, pool: Sequence[Any]) -> dict[str, Any]:
    """``cull(fail_open=False)`` (what ``kvcache_cull`` runs) over expired rows a tenth of
    the table: written as rows already expired, beside the table's own, then culled by a
    cache of the same options with CULL_IO_TIMEOUT, so that a batch slower than the
    cache's own IO_TIMEOUT is timed, not cut short (at 10 M entries one took more than the
    default 2 s here, and the cull, failing open, said it had removed nothing). A failure
    is a failure of the run, with the server's error."""
    cache = context.cache(spec)
    expired = size // EXPIRED_SHARE
    # expires 1: a millisecond after the epoch, long expired (our column is in ms).
    _copy_rows(spec, cache, range(expired), lambda index: f"scale.expired.{size}.{index}", expires=1)
    culling = replace(spec, options={**spec.options, "IO_TIMEOUT": CULL_IO_TIMEOUT,
                                     "MAX_ENTRIES": cache._max_entries}).build()
    error = None
    started = time.perf_counter()
    try:
        removed = culling.cull(fail_open=False)
    except Exception as exc:  # noqa: BLE001  (reported as the run's failure)
        removed, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        seconds = time.perf_counter() - started
        culling.close()
    if removed != expired:
        context.failures.append(f"scale: {spec.name} cull at {size:,} rows removed "
                                f"{'no' if removed is None else f'{removed:,}'} rows, not the "
                                f"{expired:,} expired" + (f" ({error})" if error else ""))
    return {"cache": spec.name, "rows": size, "expired": expired, "removed": removed,
            "io_timeout_s": CULL_IO_TIMEOUT, "duration_ms": round(seconds * 1000, 1),
            "us_per_removed_row": round(seconds * 1e6 / removed, 2) if removed else None}


def _memory() -> dict[str, int]:
    """This process's resident memory now and at its peak (kB, /proc/self/status)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                  if ":" in line)
    found = {name: int(status[field].split()[0]) for name, field in
             (("rss_kb", "VmRSS"), ("peak_rss_kb", "VmHWM")) if field in status}
    if "peak_rss_kb" not in found:
        found["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return found


def _buffer_pool(spec: CacheSpec) -> int | None:
    with connections[spec.database].cursor() as cursor:
        cursor.execute("SELECT @@innodb_buffer_pool_size")
        return int(cursor.fetchone()[0])


def _per(data_length: int | None, index_length: int | None, rows: int) -> float | None:
    if data_length is None or not rows:
        return None
    return round((data_length + (index_length or 0)) / rows, 1)


def _mean(values: Sequence[Any]) -> float:
    from kvcache_bench.payloads import payload_size

    return sum(payload_size(value) for value in values) / len(values)


# --- the targets -----------------------------------------------------------------------------

def targets(results: list[dict[str, Any]], culls: list[dict[str, Any]],
            sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Each of issue 41 §2's targets at this run's sizes: the figures, the limit, met or not
    (None when the run cannot say: one size only)."""
    p50 = {(e["cache"], e["operation"], e["pattern"], e["rows"]): e["median_us"] for e in results}
    found = []

    def add(name: str, value: float | None, limit: float, met: bool | None = None) -> None:
        if met is None and value is not None:
            met = value <= limit
        found.append({"target": name, "value": None if value is None else round(value, 3),
                      "limit": limit, "met": met})

    many = next((e["operation"] for e in results if e["operation"].startswith("get_many")), None)
    for size in sizes:
        for pattern in ("uniform", "zipf"):
            for operation, limit in (("get hit", GET_VS_BARE), (many, GET_MANY_VS_BARE)):
                ours = p50.get((OURS, operation, pattern, size))
                bare = p50.get(("bare SELECT", operation, pattern, size))
                add(f"{operation} / bare SELECT, {pattern}, {size:,} rows",
                    ours / bare if ours and bare else None, limit)
    smallest, largest = sizes[0], sizes[-1]
    grows = largest > smallest
    for operation, pattern, limit in (("set", "uniform", WRITE_GROWTH),
                                      ("delete", "uniform", WRITE_GROWTH),
                                      ("set, cull every write", "uniform", WRITE_GROWTH),
                                      ("get hit", "zipf", ZIPF_GET_GROWTH)):
        low, high = p50.get((OURS, operation, pattern, smallest)), p50.get((OURS, operation, pattern, largest))
        add(f"{operation} p50 ({pattern}), {largest:,} / {smallest:,} rows",
            high / low if grows and low and high else None, limit)
    by_size = {cull["rows"]: cull for cull in culls}
    low, high = by_size.get(smallest), by_size.get(largest)
    if grows and low and high and low["us_per_removed_row"] and high["us_per_removed_row"]:
        ratio = high["us_per_removed_row"] / low["us_per_removed_row"]
        add(f"kvcache_cull time per removed row, {largest:,} / {smallest:,} rows", ratio,
            CULL_PER_ROW_SPREAD, 1 / CULL_PER_ROW_SPREAD <= ratio <= CULL_PER_ROW_SPREAD)
    else:
        add("kvcache_cull time per removed row, largest / smallest size", None, CULL_PER_ROW_SPREAD)
    return found
