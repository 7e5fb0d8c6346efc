"""The results as a text table (like the seed article's), JSON and CSV."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvcache_bench.data import FILLER_LABEL, FIXED_LABEL

OPS_COLUMNS_PER_TABLE = 6
#: The fields that say *what* was measured in each scenario; every other field is a figure.
IDENTITY = {
    "ops": ("cache", "operation"),
    "rows": ("cache", "operation", "rows"),
    "nodes": ("client", "operation", "nodes"),
    "concurrency": ("cache", "mode", "workers"),
    "storage": ("cache",),
    "capacity": ("client",),
    "codec": ("setting",),
    "stampede": ("cache", "callers", "state"),
    "shards": ("operation", "shards"),
    "async": ("client", "operation", "setting"),
    "encryption": ("cache", "operation"),
    "locks": ("cache", "method", "mode"),
    "replicas": ("replicas", "part", "operation"),
    "scale": ("cache", "case", "rows"),
}


def with_mix(path: Path, mix: str) -> Path:
    """``results/benchmark.json`` -> ``results/benchmark-realistic.json``."""
    return path.with_name(f"{path.stem}-{mix}{path.suffix}")


def micros(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 10_000:
        return f"{value / 1000:.1f}ms"
    return f"{value:.1f}µs" if value < 10 else f"{value:.0f}µs"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [list(map(str, row)) for row in rows]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    line = lambda cells: "  ".join(cell.ljust(width) if index == 0 else cell.rjust(width)
                                   for index, (cell, width) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * width for width in widths]), *map(line, rows)])


def ops_text(ops: dict[str, Any], reference: str | None, mix: str = "") -> str:
    wall: dict[tuple[str, str], str] = {}
    cpu: dict[tuple[str, str], str] = {}
    for entry in ops["results"]:
        ratio = entry.get("ratio")
        cell = micros(entry["median_us"]) + (f" {ratio:.2f}x" if ratio is not None else "")
        wall[entry["cache"], entry["operation"]] = cell + ("" if entry["correct"] else " WRONG")
        cpu[entry["cache"], entry["operation"]] = micros(entry.get("cpu_us"))
    caches = list(dict.fromkeys(entry["cache"] for entry in ops["results"]))
    compared = (f", and speed-up over {reference} (its median / this median: above 1x is "
                "faster)") if reference else ""
    return "\n\n".join([
        f"ops, {mix} values: median per call{compared}",
        *_blocks(ops["operations"], caches, wall),
        f"ops, {mix} values: CPU time of the benchmark process per call (mean; the client's work "
        "only, the servers' CPU is not included)",
        *_blocks(ops["operations"], caches, cpu),
        *_floor_block(ops.get("floor", [])),
        *_versus_block(ops.get("versus", []), mix),
    ])


def _versus_block(versus: list[dict[str, Any]], mix: str) -> list[str]:
    """Ours against its peers: one table per cache of ours, a column per peer."""
    blocks = []
    for ours in dict.fromkeys(e["cache"] for e in versus):
        entries = [e for e in versus if e["cache"] == ours]
        peers = list(dict.fromkeys(e["peer"] for e in entries))
        cells = {(e["operation"], e["peer"]): f"{e['speedup']:.2f}x" for e in entries}
        rows = [[operation, *(cells.get((operation, peer), "-") for peer in peers)]
                for operation in dict.fromkeys(e["operation"] for e in entries)]
        blocks += [f"ops, {mix} values: {ours} against its peers (their median / its median: "
                   "above 1x, ours is faster)", table(["operation", *peers], rows)]
    return blocks


def _floor_block(floor: list[dict[str, Any]]) -> list[str]:
    if not floor:
        return []
    rows = [[e["cache"], e.get("operation", "get hit"), micros(e["interleaved_get_us"]),
             micros(e["interleaved_floor_us"]),
             f"{e['get_over_floor']:.2f}x" if e.get("get_over_floor") else "-", micros(e.get("cpu_us"))]
            for e in floor]
    return ["ops: the floor under a MySQL read: the call and a bare mysqlclient SELECT of the same "
            "rows (primary key; IN of the batch for get_many) on the same connection, call after "
            "call (median per call)",
            table(["cache", "operation", "call", "SELECT", "call / SELECT", "SELECT cpu"], rows)]


def _blocks(operations: Sequence[str], caches: Sequence[str], cells: dict[tuple[str, str], str]) -> list[str]:
    """One table per six operations: a row per cache."""
    return [table(["cache", *chunk], ([cache, *(cells[cache, op] for op in chunk)] for cache in caches))
            for chunk in (operations[start:start + OPS_COLUMNS_PER_TABLE]
                          for start in range(0, len(operations), OPS_COLUMNS_PER_TABLE))]


def rows_text(rows: dict[str, Any]) -> str:
    sizes = rows["sizes"]
    by_key = {(e["cache"], e["operation"], e["rows"]): e for e in rows["results"]}
    caches = list(dict.fromkeys(e["cache"] for e in rows["results"]))
    lines = []
    for cache in caches:
        cells = [micros(by_key[cache, op, size]["median_us"]) if (cache, op, size) in by_key else "-"
                 for op in ("set", "get") for size in sizes]
        cull = by_key.get((cache, "cull", sizes[-1]))
        lines.append([cache, *cells, f"{cull['duration_ms']:.0f}ms" if cull else "-"])
    header = ["cache", *(f"{op}@{size:,}" for op in ("set", "get") for size in sizes),
              f"cull@{sizes[-1]:,}"]
    return f"rows: median per call with the table already holding N rows ({FILLER_LABEL})\n\n" + table(header, lines)


def scale_text(scale: dict[str, Any]) -> str:
    """Cost against table size: p50/p99 per cache, operation and access pattern at each size,
    bytes per entry, the cull, the process's memory, and each target met or not."""
    sizes = scale["sizes"]
    by_key = {(e["cache"], e["operation"], e["pattern"], e["rows"]): e for e in scale["results"]}
    lines = [[cache, operation, pattern,
              *(f"{micros(by_key[cache, operation, pattern, size]['median_us'])} / "
                f"{micros(by_key[cache, operation, pattern, size]['p99_us'])}"
                if (cache, operation, pattern, size) in by_key else "-" for size in sizes)]
             for cache, operation, pattern in dict.fromkeys(
                 (e["cache"], e["operation"], e["pattern"]) for e in scale["results"])]
    parts = [
        f"scale: p50 / p99 per call with the table holding N entries ({scale['values']}; "
        f"{scale['calls']:,} calls per figure, DatabaseCache's set {scale['slow_set_calls']}; "
        f"Zipf exponent {scale['zipf_exponent']}; {scale['server']} to "
        f"{scale['buffer_pool_fraction']:g} of the tables' bytes at each size)",
        table(["cache", "operation", "keys", *(f"{size:,} rows" for size in sizes)], lines),
        table(["cache", "rows", "key+value B/entry", "table B/entry", "fill"],
              [[u["cache"], f"{u['rows']:,}", f"{u['bytes_per_entry']:,.0f}",
                f"{u['table_bytes_per_entry']:,.0f}" if u["table_bytes_per_entry"] else "-",
                f"{u['fill_s']:.0f}s"] for u in scale["usage"]]),
        table(["rows", "tables (all caches)", "InnoDB buffer pool", "pool / tables"],
              [[f"{b['rows']:,}", f"{b['tables_bytes'] / 2**20:,.0f} MiB",
                f"{b['buffer_pool_bytes'] / 2**20:,.0f} MiB",
                f"{b['fraction']:.2f}" if b["fraction"] else "-"] for b in scale["buffer_pools"]]),
        table(["kvcache_cull at", "expired rows", "removed", "time", "per removed row"],
              [[f"{c['rows']:,}", f"{c['expired']:,}", "-" if c["removed"] is None else f"{c['removed']:,}", f"{c['duration_ms']:,.0f}ms",
                micros(c["us_per_removed_row"])] for c in scale["culls"]]),
        table(["process memory at", "RSS", "peak RSS"],
              [[f"{m['rows']:,}", f"{m['rss_kb'] / 1024:,.0f} MiB", f"{m['peak_rss_kb'] / 1024:,.0f} MiB"]
               for m in scale["memory"]]),
        table(["target", "value", "limit", "met"],
              [[t["target"], "-" if t["value"] is None else f"{t['value']:.2f}x", f"{t['limit']}x",
                {True: "yes", False: "NO", None: "not measured"}[t["met"]]] for t in scale["targets"]]),
    ]
    return "\n\n".join(parts)


def nodes_text(nodes: dict[str, Any]) -> str:
    counts = nodes["counts"]
    by_key = {(e["client"], e["operation"], e["nodes"]): e for e in nodes["results"]}
    clients = list(dict.fromkeys(e["client"] for e in nodes["results"]))
    lines = [[client, *(micros(by_key[client, op, n]["median_us"]) if (client, op, n) in by_key else "-"
                        for op in ("get", "get_many") for n in counts)] for client in clients]
    header = ["client", *(f"{op}@{n}" for op in ("get", "get_many") for n in counts)]
    return (f"nodes: median per call over N memcached nodes (get_many of {nodes['keys']} keys; "
            f"{FILLER_LABEL})\n\n" + table(header, lines))


def async_text(scenario: dict[str, Any]) -> str:
    lines = [[e["client"], e["operation"], e["nodes"], e["coroutines"], f"{e['ops_per_s']:,.0f}",
              micros(e["p99_us"])] for e in scenario["results"]]
    header = ["client", "operation", "nodes", "coroutines", "ops/s", "p99"]
    text = f"async: concurrent coroutines on one event loop ({FILLER_LABEL})\n\n" + table(header, lines)
    latency = scenario.get("latency") or []
    if latency:
        rows = [[e["client"], e["nodes"], e["keys"], micros(e["sync"]["median_us"]),
                 micros(e["async"]["median_us"]), f"{e['async_vs_sync_median']:.2f}x"]
                for e in latency]
        text += ("\n\nget_many one call at a time: sync against native aget_many\n\n"
                 + table(["client", "nodes", "keys", "sync median", "async median", "async/sync"], rows))
    versus = scenario.get("versus_redis") or []
    if versus:
        counts = list(dict.fromkeys(e["coroutines"] for e in versus))
        cells = {(e["client"], e["operation"], e["coroutines"]): f"{e['speedup']:.2f}x"
                 for e in versus}
        pairs = dict.fromkeys((e["client"], e["operation"]) for e in versus)
        rows = [[client, operation, *(cells.get((client, operation, n), "-") for n in counts)]
                for client, operation in pairs]
        text += ("\n\none node against Django's RedisCache on one server: calls per second over "
                 "its, by coroutines\n\n" + table(["client", "operation", *map(str, counts)], rows))
    peers = scenario.get("emcache") or {}
    if peers.get("results"):
        text += "\n\n" + emcache_text(peers)
    mysql = scenario.get("mysql") or {}
    if mysql.get("results"):
        lines = [[e["client"], e["operation"], e["coroutines"], f"{e['ops_per_s']:,.0f}",
                  micros(e["cpu_us"]), micros(e["p99_us"])] for e in mysql["results"]]
        text += (f"\n\nasync on MySQL: concurrent coroutines on one event loop (values: "
                 f"{mysql['values']}; CPU time of the process per call)\n\n"
                 + table(["client", "operation", "coroutines", "ops/s", "cpu", "p99"], lines))
        speedups = [[e["operation"], e["coroutines"], e["versus"], f"{e['speedup']:.2f}x"]
                    for e in mysql["speedups"]]
        text += ("\n\nkv-mysql native's throughput over\n\n"
                 + table(["operation", "coroutines", "versus", "speed-up"], speedups))
    return text


def emcache_text(peers: dict[str, Any]) -> str:
    """emcache's benchmark: calls per second (and CPU per call) per client and node count,
    then ours against emcache at the targets."""
    counts = peers["counts"]
    by_key = {(e["client"], e["operation"], e["nodes"]): e for e in peers["results"]}
    rows = []
    for client, operation in dict.fromkeys((e["client"], e["operation"]) for e in peers["results"]):
        cells = []
        for n in counts:
            entry = by_key.get((client, operation, n))
            cells.append(f"{entry['ops_per_s']:,.0f} ({micros(entry['cpu_us'])})" if entry else "-")
        rows.append([client, operation, *cells])
    text = (f"emcache's benchmark: {peers['tasks']} tasks, {peers['value_bytes']}-byte values, "
            f"sets then gets, {peers['seconds']} s per figure, median of {peers['rounds']} "
            "interleaved rounds; calls per second (CPU per call)\n\n"
            + table(["client", "operation", *(f"{n} node(s)" for n in counts)], rows))
    ratio_rows = [[e["operation"], e["nodes"], e["versus"], f"{e['ratio']:.2f}x",
                   f"{e['target']:.1f}x", "met" if e["met"] else "NOT MET"]
                  for e in peers["ratios"]]
    return text + ("\n\nkv-memcached (default OPTIONS) against emcache\n\n"
                   + table(["operation", "nodes", "versus", "ratio", "target", ""], ratio_rows))


def concurrency_text(concurrency: dict[str, Any]) -> str:
    lines = [[e["cache"], e["mode"], e["workers"], f"{e['ops_per_s']:,.0f}", e["lost_incr"],
              e["extra_add_winners"], e["errors"]] for e in concurrency["results"]]
    header = ["cache", "mode", "workers", "ops/s", "lost incr", "extra add winners", "errors"]
    return f"concurrency: mixed workload (get, set, incr, add) per worker ({FIXED_LABEL})\n\n" + table(header, lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def storage_text(storage: dict[str, Any], mix: str = "") -> str:
    lines = [[e["cache"], f"{e['bytes_per_entry']:,.0f}", _ratio(e["vs_payload"]),
              _ratio(e["vs_peer"]) + (f" {e['peer']}" if e["peer"] else ""),
              "-" if e.get("data_length") is None else f"{e['data_length'] / e['entries']:,.0f}"]
             for e in storage["results"]]
    header = ["cache", "bytes/entry", "x payload", "x peer", "table data/entry"]
    return (f"storage, {mix} values: bytes kept per entry after writing {storage['entries']:,} entries "
            f"({storage['payload_bytes'] / storage['entries']:,.0f} B of payload each); tables: "
            "key + value columns, memcached: the node's bytes stat\n\n" + table(header, lines))


def capacity_text(capacity: dict[str, Any], mix: str = "") -> str:
    lines = [[e["client"], f"{e['kept']:,}", f"{e['kept_percent']:.1f}%",
              _ratio(e["vs_peer"]) + (f" {e['peer']}" if e["peer"] else ""), f"{e['evictions']:,}",
              f"{e['refused']:,}"] for e in capacity["results"]]
    header = ["client", "entries kept", "of written", "x peer", "evictions", "refused"]
    return (f"capacity, {mix} values: entries still readable after writing {capacity['written']:,} "
            f"(mean {capacity['mean_value_bytes']:,.0f} B) into a {capacity['memory_mb']} MiB "
            "memcached node\n\n" + table(header, lines))


def codec_text(codec: dict[str, Any], mix: str = "") -> str:
    lines = [[e["setting"] + (f" ({e['default_of']} default)" if e.get("default_of") else ""),
              f"{e['encode_us']:.1f}", f"{e['decode_us']:.1f}",
              f"{e['stored_bytes'] / codec['values']:,.0f}", _ratio(e["vs_payload"])]
             for e in codec["results"]]
    header = ["setting", "encode us", "decode us", "stored B/value", "x payload"]
    return (f"codec, {mix} values: CPU per value (best of {codec['passes']} passes) and bytes "
            f"stored for {codec['values']} values ({codec['payload_bytes'] / codec['values']:,.0f} B "
            "serialized on average), no server\n\n" + table(header, lines))


def encryption_text(scenario: dict[str, Any], mix: str = "") -> str:
    lines = [[e["cache"], e["operation"], micros(e["plain_median_us"]),
              micros(e["encrypted_median_us"]), _ratio(e["time_ratio"]),
              micros(e["plain_cpu_us"]), micros(e["encrypted_cpu_us"]), _ratio(e["cpu_ratio"]),
              f"{e['cpu_added_us']:+.1f}"] for e in scenario["results"]]
    header = ["cache", "operation", "plain", "encrypted", "x time", "plain CPU", "encrypted CPU",
              "x CPU", "CPU added µs"]
    sizes = [[e["cache"], f"{e['plain_bytes_per_entry']:,.1f}",
              f"{e['encrypted_bytes_per_entry']:,.1f}", f"{e['extra_bytes_per_entry']:+.1f}"]
             for e in scenario["bytes"]]
    return (f"encryption, {mix} values: ENCRYPTION_KEYS against the same cache without, median "
            f"wall time and process CPU per call (target: at most "
            f"{scenario['target_time_ratio']:.2f}x the time)\n\n" + table(header, lines)
            + f"\n\nvalue bytes as stored per entry (target: at most "
            f"+{scenario['target_extra_bytes']})\n\n"
            + table(["cache", "plain", "encrypted", "added"], sizes))


def shards_text(shards: dict[str, Any]) -> str:
    counts = shards["counts"]
    latency = [e for e in shards["results"] if "median_us" in e]
    rates = [e for e in shards["results"] if "ops_per_s" in e]
    parts = []
    if latency:
        by_key = {(e["operation"], e["shards"]): e for e in latency}
        operations = list(dict.fromkeys(e["operation"] for e in latency))
        lines = [[operation, *(micros(by_key[operation, n]["median_us"]) if (operation, n) in by_key
                               else "-" for n in counts)] for operation in operations]
        parts.append(f"shards: MySQLCache over N MariaDB servers (uncapped), median per call of "
                     f"{shards['keys']} keys\n\n"
                     + table(["operation", *(f"{n} shard(s)" for n in counts)], lines))
    if rates:
        parts.append(f"{shards_capping(shards)}\n\n" + table(
            ["throughput (calls/s)", *(f"{n} shard(s)" for n in counts),
             f"{counts[-1]}÷{counts[0]}", "target", "spread", "client cores",
             "server µs/call", "throttled", "others' cores"],
            shards_rate_lines(shards, rates)))
    return "\n\n".join(parts)


def shards_capping(shards: dict[str, Any]) -> str:
    cap = (f"each server capped at {shards['server_cpu']:g} of a core (cgroup v1 cpu quota) "
           "on a core of its own"
           if shards.get("server_cpu") else "servers uncapped")
    return (f"shards: throughput of {shards['client_processes']} client processes x "
            f"{shards['client_threads']} threads, {cap}; median of {shards['rounds']} round(s) of "
            f"{shards['window_s']:g} s (in brackets: the lowest and highest ratio of one round; "
            "spread: (max - min) / median; client cores: CPU the client "
            "processes used; server µs/call: the servers' CPU per call; "
            "throttled: the share of the servers' quota periods their quota cut short; others' "
            "cores: what other programs kept busy meanwhile, which the figures compete with)")


def shards_scaling_ratio(shards: dict[str, Any], operation: str) -> float | None:
    """Throughput on the most shards over the throughput on the fewest."""
    counts = shards["counts"]
    by_count = {e["shards"]: e["ops_per_s"] for e in shards["results"]
                if e["operation"] == operation and "ops_per_s" in e}
    low, high = by_count.get(counts[0]), by_count.get(counts[-1])
    return round(high / low, 2) if low and high else None


def rounds_range(ratios: list[float | None] | None) -> str:
    """`` (a-b)``: the lowest and highest of the per-round ratios, when there are several."""
    ratios = [r for r in ratios or [] if r is not None]
    return f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""


def shards_rate_lines(shards: dict[str, Any], rates: list[dict[str, Any]]) -> list[list[str]]:
    counts = shards["counts"]
    lines = []
    for operation in dict.fromkeys(e["operation"] for e in rates):
        entries = {e["shards"]: e for e in rates if e["operation"] == operation}
        ratio = shards_scaling_ratio(shards, operation)
        target = shards["targets"].get(operation.split()[-1].split("(")[0])
        widest = entries.get(counts[-1], {})
        met = "" if ratio is None or target is None else (" met" if ratio >= target else " MISSED")
        lines.append([
            operation.removeprefix("throughput "),
            *(f"{entries[n]['ops_per_s']:,.0f}" if n in entries else "-" for n in counts),
            (f"{ratio:.2f}x" if ratio else "-") + rounds_range(widest.get("rounds_vs_fewest")),
            (f">={target:g}x" + met) if target else "-",
            f"{max(e['spread'] or 0 for e in entries.values()):.0%}",
            " / ".join(f"{entries[n]['client_cores']:.2f}" for n in counts if n in entries),
            " / ".join(f"{entries[n]['server_cpu_us']:.0f}" for n in counts if n in entries),
            " / ".join(f"{entries[n]['throttled']:.0%}" for n in counts if n in entries),
            " / ".join(f"{entries[n]['other_cores']:.2f}" for n in counts if n in entries),
        ])
    return lines


def stampede_text(stampede: dict[str, Any]) -> str:
    lines = [[e["cache"], str(e["callers"]), e["state"], str(e["computations"]),
              micros(e["p50_us"]), micros(e["p99_us"]), micros(e["others_p50_us"]),
              micros(e["others_p99_us"])] for e in stampede["results"]]
    header = ["cache", "callers", "key", "computations", "p50", "p99", "others p50", "others p99"]
    protection = ", ".join(f"{k} {v}" for k, v in stampede["protection"].items())
    return (f"stampede: N callers at once on get_or_set of a present (fresh), missing (cold) or "
            f"just-expired key, "
            f"computing it takes {stampede['compute_ms']} ms; kvcache backends with {protection}"
            "\n\n" + table(header, lines))


def locks_text(locks: dict[str, Any]) -> str:
    alone = [[e["cache"], e["method"], micros(e["median_us"]), micros(e["p99_us"]),
              micros(e["cpu_us"])] for e in locks["results"] if e["mode"] == "uncontended"]
    turns = [[e["cache"], e["method"], f"{e['grants_per_s']:.0f}", f"{e['wait_p50_ms']}ms",
              f"{e['wait_p99_ms']}ms", f"{e['wait_max_ms']}ms",
              f"{e['worker_min_grants']}-{e['worker_max_grants']}"]
             for e in locks["results"] if e["mode"] == "contended"]
    return ("locks, uncontended: one acquire + release (our lock() and alock(), and the "
            "add + delete recipe), median and p99 wall time, CPU per pair\n\n"
            + table(["cache", "method", "median", "p99", "cpu"], alone)
            + f"\n\nlocks, contended: {locks['workers']} threads take turns on one name for "
            f"{locks['seconds']:g} s, holding it {locks['hold_ms']:g} ms; waiters poll at most "
            f"every {locks['poll_s'] * 1000:g} ms\n\n"
            + table(["cache", "method", "grants/s", "wait p50", "wait p99", "longest wait",
                     "grants per worker"], turns))


def replicas_text(scenario: dict[str, Any]) -> str:
    entries = scenario["results"]
    latency = [[str(e["replicas"]), e["operation"], micros(e["median_us"]), micros(e["p99_us"]),
                f"{e['vs_replicas_1']:.2f}x"] for e in entries if e["part"] == "latency"]
    memory = [[str(e["replicas"]), f"{e['bytes']:,}", f"{e['items']:,}"]
              for e in entries if e["part"] == "memory"]
    outage = [[str(e["replicas"]), _percent(e["hit_ratio_before_kill"]),
               _percent(e["hit_ratio_after_kill"]), str(e["gets_after_kill"]),
               str(e["stale_reads"]), str(e["errors"])]
              for e in entries if e["part"] == "outage"]
    return (f"replicas: MemcachedCache on {scenario['nodes']} nodes, REPLICAS 2 beside 1; "
            f"latency with every node up (median, p99, median vs REPLICAS 1)\n\n"
            + table(["replicas", "operation", "median", "p99", "vs 1"], latency)
            + f"\n\nmemory after writing {scenario['keys']} entries\n\n"
            + table(["replicas", "bytes", "items"], memory)
            + f"\n\none node killed halfway through {scenario['seconds']:g} s of "
            f"{scenario['read_share']:.0%} get / set\n\n"
            + table(["replicas", "hits before", "hits after", "gets after", "stale reads",
                     "errors"], outage))


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2%}"


TEXT = {"ops": ops_text, "rows": rows_text, "nodes": nodes_text, "concurrency": concurrency_text,
        "storage": storage_text, "capacity": capacity_text, "codec": codec_text,
        "shards": shards_text, "async": async_text, "stampede": stampede_text,
        "encryption": encryption_text, "locks": locks_text, "replicas": replicas_text,
        "scale": scale_text}
#: The scenarios whose text names the value mix (the others use random filler); the
#: report's title names the mix only when one of them ran.
MIX_TEXT = {"ops", "storage", "capacity", "codec", "encryption"}


def values_text(values: dict[str, Any]) -> str:
    """The mix as generated: each kind's share, sizes, mean and zlib-6 ratio (alone, and
    cut to 1 KB and 4 KB), so a run says how compressible its values were."""
    at = values.get("zlib6_ratio_at", {})
    rows = [[kind["kind"], f"{kind['percent']}%", f"{kind['min_bytes']:,}-{kind['max_bytes']:,}",
             kind.get("sizes", ""), f"{kind['mean_bytes']:,.0f}", f"{kind['zlib6_ratio']:.2f}",
             *(f"{at[kind['kind']][size]:.2f}" if size in at.get(kind["kind"], {}) else "-"
               for size in ("1 KB", "4 KB"))]
            for kind in values["kinds"]]
    header = ["kind", "share", "bytes", "sizes", "mean", "zlib-6", "at 1 KB", "at 4 KB"]
    return (f"{values['label']}: each kind as generated (zlib-6: original / compressed)\n\n"
            + table(header, rows))


#: The servers a run may describe, as the header names them (absent: not measured).
SERVERS = (("mariadb", "MariaDB"), ("sqlite", "SQLite"), ("memcached", "memcached"))


def header(machine: dict[str, Any]) -> str:
    """The machine and the versions of the servers measured (those not measured omitted)."""
    parts = [machine["cpu"], f"{machine['cores']} cores", f"Python {machine['python']}",
             f"Django {machine['django']}"]
    for key, name in SERVERS:
        version = machine.get(key)
        if version:
            if key == "mariadb" and "mariadb" not in version.lower():
                name = "MySQL"  # the key predates MySQL support; VERSION() says which
            parts.append(f"{name} {version}")
    return ", ".join(parts)


def text(results: dict[str, Any]) -> str:
    machine, values = results["machine"], results["values"]
    title = f"django-kvcache benchmark, {machine['date_utc']}: {header(machine)}"
    if MIX_TEXT.intersection(results["scenarios"]):  # the others measure filler
        title += f"\n{values['label']}"
    parts = [title]
    for name, note in results["skipped"].items():
        parts.append(f"skipped {name}: {note}")
    for name, scenario in results["scenarios"].items():
        if name == "ops":
            parts.append(ops_text(scenario, results["reference"], values["name"]))
        elif name in MIX_TEXT:
            parts.append(TEXT[name](scenario, values["name"]))
        else:
            parts.append(TEXT[name](scenario))
    parts.extend(f"NOTE: {note}" for note in results["notes"])
    parts.extend(f"FAILED: {failure}" for failure in results["failures"])
    return "\n\n".join(parts) + "\n"


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def csv_rows(results: dict[str, Any]) -> Iterable[list[Any]]:
    """Long format: scenario, subject, operation, setting, metric, value."""
    for field, value in _flatten(results["machine"]):
        yield ["machine", "", "", "", field, value]
    values = results["values"]
    for field, value in _flatten({k: v for k, v in values.items() if k != "kinds"}):
        yield ["values", "", "", "", field, value]
    for kind in values["kinds"]:
        for field, value in kind.items():
            if field != "kind":
                yield ["values", kind["kind"], "", "", field, value]
    for field, value in results["parameters"].items():
        yield ["parameters", "", "", "", field, value]
    for name, scenario in results["scenarios"].items():
        identity = IDENTITY[name]
        entries = list(scenario["results"]) + list((scenario.get("mysql") or {}).get("results", []))
        for entry in entries:
            subject, operation, setting = [entry.get(key, "") for key in identity] + [""] * (3 - len(identity))
            for metric, value in entry.items():
                if metric not in identity:
                    yield [name, subject, operation, setting, metric, value]


def _flatten(mapping: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def write_csv(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["scenario", "subject", "operation", "setting", "metric", "value"])
        writer.writerows(csv_rows(results))
