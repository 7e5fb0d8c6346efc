"""The results as a text table (like the seed article's), JSON and CSV."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

OPS_COLUMNS_PER_TABLE = 6
#: The fields that say *what* was measured in each scenario; every other field is a figure.
IDENTITY = {
    "ops": ("cache", "operation"),
    "rows": ("cache", "operation", "rows"),
    "nodes": ("client", "operation", "nodes"),
    "concurrency": ("cache", "mode", "workers"),
}


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


def ops_text(ops: dict[str, Any], reference: str | None) -> str:
    cells: dict[tuple[str, str], str] = {}
    caches: list[str] = []
    for entry in ops["results"]:
        if entry["cache"] not in caches:
            caches.append(entry["cache"])
        ratio = entry.get("ratio")
        cell = micros(entry["median_us"]) + (f" {ratio:.2f}x" if ratio is not None else "")
        cells[entry["cache"], entry["operation"]] = cell + ("" if entry["correct"] else " WRONG")
    operations = ops["operations"]
    parts = [f"ops: median per call, and speed-up over {reference or 'nothing (no DatabaseCache ran)'}"
             " (its median / this median: above 1x is faster)"]
    for start in range(0, len(operations), OPS_COLUMNS_PER_TABLE):
        chunk = operations[start:start + OPS_COLUMNS_PER_TABLE]
        parts.append(table(["cache", *chunk], ([cache, *(cells[cache, op] for op in chunk)] for cache in caches)))
    return "\n\n".join(parts)


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
    return "rows: median per call with the table already holding N rows\n\n" + table(header, lines)


def nodes_text(nodes: dict[str, Any]) -> str:
    counts = nodes["counts"]
    by_key = {(e["client"], e["operation"], e["nodes"]): e for e in nodes["results"]}
    clients = list(dict.fromkeys(e["client"] for e in nodes["results"]))
    lines = [[client, *(micros(by_key[client, op, n]["median_us"]) if (client, op, n) in by_key else "-"
                        for op in ("get", "get_many") for n in counts)] for client in clients]
    header = ["client", *(f"{op}@{n}" for op in ("get", "get_many") for n in counts)]
    return (f"nodes: median per call over N memcached nodes (get_many of {nodes['keys']} keys)\n\n"
            + table(header, lines))


def concurrency_text(concurrency: dict[str, Any]) -> str:
    lines = [[e["cache"], e["mode"], e["workers"], f"{e['ops_per_s']:,.0f}", e["lost_incr"],
              e["extra_add_winners"], e["errors"]] for e in concurrency["results"]]
    header = ["cache", "mode", "workers", "ops/s", "lost incr", "extra add winners", "errors"]
    return "concurrency: mixed workload (get, set, incr, add) per worker\n\n" + table(header, lines)


TEXT = {"ops": ops_text, "rows": rows_text, "nodes": nodes_text, "concurrency": concurrency_text}


def text(results: dict[str, Any]) -> str:
    machine = results["machine"]
    parts = [f"django-kvcache benchmark, {machine['date_utc']}: {machine['cpu']}, "
             f"{machine['cores']} cores, Python {machine['python']}, Django {machine['django']}, "
             f"MariaDB {machine['mariadb']}, memcached {machine['memcached']}"]
    for name, note in results["skipped"].items():
        parts.append(f"skipped {name}: {note}")
    for name, scenario in results["scenarios"].items():
        parts.append(ops_text(scenario, results["reference"]) if name == "ops" else TEXT[name](scenario))
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
    for field, value in results["parameters"].items():
        yield ["parameters", "", "", "", field, value]
    for name, scenario in results["scenarios"].items():
        identity = IDENTITY[name]
        for entry in scenario["results"]:
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
