"""PNG charts of a run's results (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib import ticker  # noqa: E402

from kvcache_bench.data import FILLER_LABEL, FIXED_LABEL  # noqa: E402

#: Colour-blind-safe colours: Okabe & Ito's eight (yellow last: faint on white), then
#: those of Paul Tol's "muted" scheme that differ from them. Every series of a plot gets a
#: colour of its own and a marker too, so that no reader has to tell hues apart alone.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000",
           "#882255", "#44AA99", "#999933", "#332288", "#AA4499", "#DDCC77", "#F0E442")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p", "d", "8")
#: Reference lines (a bare client's floor), not series.
REFERENCE = "#808080"


@dataclass(frozen=True)
class Style:
    color: str
    marker: str
    linestyle: str  # kvcache's own backends solid, every other dashed

    def line(self) -> dict[str, str]:
        return {"color": self.color, "marker": self.marker, "linestyle": self.linestyle}


class Styles:
    """One colour and marker per cache (or client) for a whole run: a cache keeps its
    style from plot to plot, and no two caches of one plot share one. Colours are dealt
    out in the order the run first names the caches, each the first one that no cache
    drawn beside it in some plot has (a greedy colouring: a run of more caches than
    colours still gives every plot distinct ones, as long as no plot has more)."""

    def __init__(self, groups: Iterable[Iterable[str]]) -> None:
        groups = [list(dict.fromkeys(group)) for group in groups]
        neighbours: dict[str, set[str]] = {}
        for group in groups:
            for name in group:
                neighbours.setdefault(name, set()).update(group)
        self.index: dict[str, int] = {}
        for name in neighbours:  # in order of first appearance
            taken = {self.index[other] for other in neighbours[name] if other in self.index}
            self.index[name] = next(i for i in range(len(neighbours) + 1) if i not in taken)

    @classmethod
    def for_results(cls, results: dict[str, Any]) -> Styles:
        """The caches and clients of every scenario (and scenario part: the async
        scenario's emcache benchmark), each one's drawn together."""
        scenarios = list(results["scenarios"].values())
        scenarios += [scenario[part] for scenario in list(scenarios)
                      for (_, part) in PART_WRITERS if isinstance(scenario.get(part), dict)]
        return cls(
            [entry.get("cache") or entry.get("client") for entry in scenario["results"]
             if entry.get("cache") or entry.get("client")]
            for scenario in scenarios
        )

    def of(self, names: Iterable[str]) -> dict[str, Style]:
        names = list(dict.fromkeys(names))
        if any(name not in self.index for name in names):  # not a cache of the run
            return Styles([names]).of(names)
        return {name: Style(PALETTE[self.index[name] % len(PALETTE)],
                            MARKERS[self.index[name] % len(MARKERS)],
                            "-" if name.startswith("kv-") else "--")
                for name in names}

    def colors(self, names: list[str]) -> list[str]:
        styles = self.of(names)
        return [styles[name].color for name in names]


def _human(value: float, _position: Any = None) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def _log_axis(axes: Any, which: str) -> None:
    """Log scale labelled 1, 2, 5, 10, 20, 50... in plain numbers (k for thousands)."""
    getattr(axes, f"set_{which}scale")("log")
    axis = getattr(axes, f"{which}axis")
    axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(_human))
    axis.set_minor_formatter(ticker.NullFormatter())


def write_all(results: dict[str, Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    styles = Styles.for_results(results)
    figures = [(name, scenario, WRITERS[name]) for name, scenario in results["scenarios"].items()]
    figures += [(f"{name}-{part}", results["scenarios"][name][part], writer)
                for (name, part), writer in PART_WRITERS.items()
                if (results["scenarios"].get(name) or {}).get(part)]
    written = []
    for name, scenario, writer in figures:
        if scenario["results"]:
            path = folder / f"benchmark-{results['values']['name']}-{name}.png"
            figure = writer(scenario, results, styles)
            figure.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(figure)
            written.append(path)
    return written


def _title(figure: Any, text: str, results: dict[str, Any], values: str | None = None) -> None:
    """The figure's title, the machine, and the values it used: the mix's, unless
    ``values`` says the scenario used others."""
    machine = results["machine"]
    values = values or textwrap.fill(results["values"]["label"], 110)
    figure.suptitle(f"{text}\n{values}\n{machine['cpu']}, {machine['cores']} cores, {machine['date_utc']}",
                    fontsize=10)


def ops_bars(ops: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """One horizontal bar chart per operation: median per call, p95 as the whisker."""
    operations = ops["operations"]
    caches = list(dict.fromkeys(e["cache"] for e in ops["results"]))
    by_key = {(e["cache"], e["operation"]): e for e in ops["results"]}
    columns = 3
    rows = math.ceil(len(operations) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(15, 2.2 + 0.28 * len(caches) * rows),
                                squeeze=False, layout="constrained")
    colors = styles.colors(caches)
    for axis, operation in zip(axes.flat, operations):
        entries = [by_key[cache, operation] for cache in caches]
        medians = [e["median_us"] for e in entries]
        whiskers = [max(e["p95_us"] - e["median_us"], 0) for e in entries]
        axis.barh(caches, medians, xerr=[[0] * len(entries), whiskers], color=colors,
                  error_kw={"elinewidth": 0.8, "capsize": 2})
        axis.barh(caches, [e.get("cpu_us") or 0 for e in entries], height=0.3, color="black", alpha=0.45,
                  edgecolor="white", linewidth=0.8)
        _log_axis(axis, "x")
        axis.invert_yaxis()
        axis.set_title(operation, fontsize=9)
        axis.tick_params(labelsize=7)
        axis.set_xlabel("µs per call (median, whisker p95; thin dark bar: client CPU)", fontsize=7)
    for axis in list(axes.flat)[len(operations):]:
        axis.axis("off")
    _title(figure, "ops: time per call (lower is better, log scale)", results)
    return figure


def _line_chart(axis: Any, xs: list[int], series: dict[str, list[float | None]], xlabel: str,
                ylabel: str, title: str, styles: Styles) -> None:
    style = styles.of(series)
    for label, ys in series.items():
        points = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if points:
            axis.plot(*zip(*points), label=label, **style[label].line())
    axis.set_xscale("log", base=2 if max(xs) <= 64 else 10)
    _log_axis(axis, "y")
    axis.set_xticks(xs, [_human(x) for x in xs])
    axis.xaxis.set_minor_formatter(ticker.NullFormatter())
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize=10)
    axis.grid(True, which="both", alpha=0.3)


def _series(entries: list[dict[str, Any]], subject: str, setting: str, xs: list[int],
            metric: str, **match: Any) -> dict[str, list[float | None]]:
    """For each subject (cache or client), its ``metric`` at each ``setting`` value in ``xs``,
    among the entries whose fields equal ``match``; None where nothing was measured."""
    chosen = [e for e in entries if all(e.get(field) == value for field, value in match.items())]
    values = {(e[subject], e[setting]): e.get(metric) for e in chosen}
    names = dict.fromkeys(e[subject] for e in entries)
    return {name: [values.get((name, x)) for x in xs] for name in names}


def _figure_legend(figure: Any, axis: Any) -> None:
    """One legend for every axes of the figure (they show the same series), on its right,
    where it covers no line."""
    handles, labels = axis.get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="outside right upper")


def rows_scaling(rows: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    sizes = rows["sizes"]
    figure, axes = plt.subplots(1, 3, figsize=(17, 5), layout="constrained")
    for axis, operation in zip(axes, ("set", "get")):
        series = _series(rows["results"], "cache", "rows", sizes, "median_us", operation=operation)
        _line_chart(axis, sizes, series, "rows in the table", "µs per call (median)", operation,
                    styles)
    culls = _series(rows["results"], "cache", "rows", [sizes[-1]], "duration_ms", operation="cull")
    caches = list(culls)
    culls = [culls[cache][0] for cache in caches]
    _figure_legend(figure, axes[0])
    axes[2].barh(caches, [c or 0 for c in culls], color=styles.colors(caches))
    axes[2].invert_yaxis()
    axes[2].set_xlabel("ms")
    axes[2].set_title(f"one cull() of a {sizes[-1]:,}-row table", fontsize=10)
    _title(figure, "rows: cost per call as the table grows", results, values=FILLER_LABEL)
    return figure


def scale_curves(scale: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """One panel per operation and access pattern: p50 against table size, a line per cache
    (the bare SELECT beside our reads)."""
    sizes = scale["sizes"]
    panels = list(dict.fromkeys((e["operation"], e["pattern"]) for e in scale["results"]))
    columns = 4
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(20, 4.2 * rows), layout="constrained",
                                squeeze=False)
    for axis, (operation, pattern) in zip(axes.flat, panels):
        series = _series(scale["results"], "cache", "rows", sizes, "median_us",
                         operation=operation, pattern=pattern)
        series = {name: ys for name, ys in series.items() if any(y is not None for y in ys)}
        _line_chart(axis, sizes, series, "entries in the table", "µs per call (p50)",
                    f"{operation} ({pattern})", styles)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    _figure_legend(figure, axes.flat[0])
    _title(figure, "scale: cost per call against table size", results, values=scale["values"])
    return figure


def nodes_scaling(nodes: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    counts = nodes["counts"]
    figure, axes = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    for axis, operation in zip(axes, ("get", "get_many")):
        series = _series(nodes["results"], "client", "nodes", counts, "median_us", operation=operation)
        single = set(nodes.get("single_node", ()))
        floors = {client: series.pop(client)[0] for client in list(series)
                  if client in single or client.startswith("bare")}
        _line_chart(axis, counts, series, "memcached nodes", "µs per call (median)",
                    operation if operation == "get" else f"get_many of {nodes['keys']} keys",
                    styles)
        for client, floor in floors.items():
            if floor is not None:
                axis.axhline(floor, linestyle=":", color=REFERENCE, label=f"{client} (1 node)")
        axis.legend(fontsize=8)
    _title(figure, "nodes: memcached clients as the node count grows", results, values=FILLER_LABEL)
    return figure


def async_throughput(scenario: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """Calls per second against the coroutine count, per operation, on the most nodes
    (RedisCache, one server whatever the count, beside them)."""
    entries = [e for e in scenario["results"]
               if e["nodes"] == max(scenario["counts"]) or e["client"] == "redis"]
    operations = list(dict.fromkeys(e["operation"] for e in entries))
    coroutines = scenario["coroutines"]
    figure, axes = plt.subplots(1, len(operations), figsize=(6 * len(operations), 5),
                                layout="constrained", squeeze=False)
    for axis, operation in zip(axes[0], operations):
        series = _series(entries, "client", "coroutines", coroutines, "ops_per_s",
                         operation=operation)
        one_server = "; redis: its one server" if "redis" in series else ""
        _line_chart(axis, coroutines, series, "concurrent coroutines", "calls per second",
                    f"{operation} on {max(scenario['counts'])} node(s){one_server}", styles)
    _figure_legend(figure, axes[0][0])
    _title(figure, "async: throughput of concurrent coroutines (higher is better)", results,
           values=FILLER_LABEL)
    return figure


def emcache_throughput(peers: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """emcache's benchmark: calls per second against the node count, per operation."""
    counts = peers["counts"]
    operations = list(dict.fromkeys(e["operation"] for e in peers["results"]))
    figure, axes = plt.subplots(1, len(operations), figsize=(6 * len(operations), 5),
                                layout="constrained", squeeze=False)
    for axis, operation in zip(axes[0], operations):
        series = _series(peers["results"], "client", "nodes", counts, "ops_per_s",
                         operation=operation)
        _line_chart(axis, counts, series, "memcached nodes", "calls per second", operation,
                    styles)
    _figure_legend(figure, axes[0][0])
    _title(figure, f"async: emcache's benchmark, {peers['tasks']} tasks (higher is better)",
           results, values=f"{peers['value_bytes']}-byte values")
    return figure


def concurrency_lines(concurrency: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    entries = concurrency["results"]
    workers = sorted({e["workers"] for e in entries})
    figure, axes = plt.subplots(1, 2, figsize=(15, 5.5), layout="constrained")
    for axis, mode in zip(axes, ("threads", "processes")):
        series = _series(entries, "cache", "workers", workers, "ops_per_s", mode=mode)
        _line_chart(axis, workers, series, f"{mode}", "operations per second", mode, styles)
    _figure_legend(figure, axes[1])
    _title(figure, "concurrency: mixed workload throughput (higher is better)", results, values=FIXED_LABEL)
    return figure


def shards_scaling(shards: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    counts = shards["counts"]
    entries = shards["results"]
    figure, axes = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained")
    latency = _series([e for e in entries if "median_us" in e], "operation", "shards", counts,
                      "median_us")
    style = Styles([latency]).of(latency)  # operations, not caches: this plot's own
    for operation, ys in latency.items():  # one round trip solid, the comparisons dashed
        points = [(x, y) for x, y in zip(counts, ys) if y is not None]
        axes[0].plot(*zip(*points), label=operation, color=style[operation].color,
                     marker=style[operation].marker,
                     linestyle="-" if operation in ("get_many", "set_many") else "--")
    axes[0].set_xticks(counts)
    axes[0].set_xlabel("MySQL shards")
    axes[0].set_ylabel("µs per call (median)")
    axes[0].set_ylim(bottom=0)
    axes[0].grid(True, alpha=0.3)
    axes[0].set_title(f"latency, servers uncapped: *_many of {shards['keys']} keys", fontsize=10)
    axes[0].legend(fontsize=8)
    rates = [e for e in entries if "ops_per_s" in e]
    axis = axes[1]
    throughput = list(dict.fromkeys(e["operation"] for e in rates))
    style = Styles([throughput]).of(throughput)
    for operation in style:
        points = sorted((e["shards"], e) for e in rates if e["operation"] == operation)
        xs = [n for n, _ in points]
        ys = [e["ops_per_s"] for _, e in points]
        low = [y - min(e["rounds_ops_per_s"]) for y, (_, e) in zip(ys, points)]
        high = [max(e["rounds_ops_per_s"]) - y for y, (_, e) in zip(ys, points)]
        color = style[operation].color
        axis.errorbar(xs, ys, yerr=[low, high], marker=style[operation].marker, capsize=3,
                      color=color, label=operation.removeprefix("throughput "))
        if not ys[0]:  # nothing done on one shard in the time given: no ratio to show
            continue
        for x, y in list(zip(xs, ys))[1:]:
            axis.annotate(f"{y / ys[0]:.2f}x", (x, y), textcoords="offset points",
                          xytext=(6, -10), fontsize=8, color=color)
        axis.plot(xs, [ys[0] * x / xs[0] for x in xs], linestyle=":", linewidth=0.8,
                  color=color)  # linear scaling, for reference
    axis.set_xticks(counts)
    axis.set_xlabel("MySQL shards (dotted: linear scaling)")
    axis.set_ylabel("calls per second (median of rounds; bars: min-max)")
    axis.set_ylim(bottom=0)
    axis.yaxis.set_major_formatter(ticker.FuncFormatter(_human))
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    cap = (f"each server on one core, capped at {shards['server_cpu']:g}"
           if shards.get("server_cpu") else "servers uncapped")
    axis.set_title(f"throughput, {shards['client_processes']} processes x "
                   f"{shards['client_threads']} threads, {cap}", fontsize=10)
    _title(figure, "shards: MySQLCache over N MariaDB servers", results, values=FILLER_LABEL)
    return figure


def _bars(entries: list[dict[str, Any]], subject: str, metric: str, xlabel: str, text: str,
          results: dict[str, Any], styles: Styles) -> Any:
    names = [e[subject] for e in entries]
    figure, axis = plt.subplots(figsize=(10, 2.4 + 0.35 * len(names)), layout="constrained")
    axis.barh(names, [e[metric] for e in entries], color=styles.colors(names))
    for index, entry in enumerate(entries):
        label = f" {entry[metric]:,.0f}" + (f"  ({entry['vs_peer']:.2f}x {entry['peer']})" if entry["peer"] else "")
        axis.text(entry[metric], index, label, va="center", fontsize=8)
    axis.invert_yaxis()
    axis.margins(x=0.3)
    axis.set_xlabel(xlabel)
    _title(figure, text, results)
    return figure


def storage_bars(storage: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    return _bars(storage["results"], "cache", "bytes_per_entry", "bytes per entry",
                 f"storage: bytes kept per entry ({storage['entries']:,} entries; lower is better)",
                 results, styles)


def capacity_bars(capacity: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    return _bars(capacity["results"], "client", "kept", "entries still readable",
                 f"capacity: entries kept by a {capacity['memory_mb']} MiB memcached node after "
                 f"{capacity['written']:,} writes (higher is better)", results, styles)


#: A codec setting's name: the compressor, then " from <COMPRESS_MIN_LENGTH>", then how.
CODEC_SETTING = re.compile(r"^(?P<compressor>.*?) from (?P<threshold>\d+)(?P<how>.*)$")


def codec_styles(settings: list[str]) -> dict[str, Style]:
    """Colour for the compressor, marker for the threshold: the settings' labels would
    collide on the points (many sit close together), so a legend names them."""
    def split(setting: str) -> tuple[str, str]:
        match = CODEC_SETTING.match(setting)
        if match is None:
            return setting, ""
        return match["compressor"] + match["how"], match["threshold"]

    parts = {setting: split(setting) for setting in settings}
    families = list(dict.fromkeys(compressor for compressor, _ in parts.values()))
    compressors = Styles([families]).of(families)
    thresholds = {t: MARKERS[i] for i, t in enumerate(
        sorted({t for _, t in parts.values()}, key=lambda t: int(t) if t else -1))}
    return {setting: Style(compressors[compressor].color, thresholds[threshold], "none")
            for setting, (compressor, threshold) in parts.items()}


def codec_tradeoff(codec: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """Bytes stored against CPU per value, encode and decode side by side."""
    figure, axes = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained", sharey=True)
    style = codec_styles([entry["setting"] for entry in codec["results"]])
    for axis, metric, label in ((axes[0], "encode_us", "encode"), (axes[1], "decode_us", "decode")):
        for entry in codec["results"]:
            axis.plot(entry[metric], entry["vs_payload"], label=entry["setting"], markersize=7,
                      **style[entry["setting"]].line())
        axis.set_xlabel(f"{label}: CPU µs per value")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("bytes stored / serialized payload")
    figure.legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc="outside right upper",
                  title="colour: compressor, marker: from N bytes", title_fontsize=7)
    _title(figure, "codec: what compression costs and saves per value (no server; lower left "
           "is better)", results)
    return figure


def encryption_ratios(scenario: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """Encrypted over plain, wall time and CPU, per backend and operation (1 is free)."""
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained", sharey=True)
    operations = scenario["operations"]
    caches = list(dict.fromkeys(e["cache"] for e in scenario["results"]))
    width = 0.8 / max(len(caches), 1)
    colors = styles.of(caches)
    for axis, metric, label in ((axes[0], "time_ratio", "wall time"), (axes[1], "cpu_ratio", "CPU")):
        for index, cache in enumerate(caches):
            ratios = {e["operation"]: e[metric] for e in scenario["results"] if e["cache"] == cache}
            axis.bar([n + index * width for n in range(len(operations))],
                     [ratios.get(op, 0) for op in operations], width, label=cache,
                     color=colors[cache].color)
        axis.axhline(1.0, color=REFERENCE, linewidth=0.8)
        axis.axhline(scenario["target_time_ratio"], color=REFERENCE, linewidth=0.8, linestyle="--")
        axis.set_xticks([n + width * (len(caches) - 1) / 2 for n in range(len(operations))],
                        operations)
        axis.set_xlabel(f"{label}: encrypted / plain")
    axes[0].set_ylabel("ratio (1 = no cost; dashed: the time target)")
    _figure_legend(figure, axes[1])
    _title(figure, "encryption: ENCRYPTION_KEYS against the same cache without (lower is "
           "better)", results)
    return figure


def stampede_counts(stampede: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """Computations per herd, by cache and number of callers (log scale: 1 is the goal).
    Many caches give the very same counts: each is drawn a little to the side of the
    callers it was measured at, so that every one shows."""
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained", sharey=True)
    for axis, state in zip(axes, ("cold", "expired")):  # "fresh" computes nothing
        entries = [e for e in stampede["results"] if e["state"] == state]
        xs = stampede["callers"]
        caches = list(dict.fromkeys(e["cache"] for e in entries))
        style = styles.of(caches)
        for index, cache in enumerate(caches):
            counts = {e["callers"]: e["computations"] for e in entries if e["cache"] == cache}
            side = 1 + 0.03 * (index - (len(caches) - 1) / 2)  # on a log axis: a fixed gap
            axis.plot([x * side for x in xs], [counts.get(x) for x in xs], label=cache,
                      **style[cache].line())
        _log_axis(axis, "x")
        _log_axis(axis, "y")
        axis.set_xlabel(f"callers at once ({state} key)")
    axes[0].set_ylabel("computations of the value")
    _figure_legend(figure, axes[1])
    _title(figure, f"stampede: how often a {stampede['compute_ms']} ms value is computed when N "
           "callers miss it at once (1 is the goal)", results, values="one small string value")
    return figure


def locks_bars(locks: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """Uncontended acquire + release time, and contended grants per second, per subject."""
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for axis, mode, metric, label in (
        (axes[0], "uncontended", "median_us", "µs per acquire + release (median)"),
        (axes[1], "contended", "grants_per_s", f"grants per second, {locks['workers']} threads"),
    ):
        entries = [e for e in locks["results"] if e["mode"] == mode]
        names = [f"{e['cache']}\n{e['method']}" for e in entries]
        axis.barh(names, [e[metric] for e in entries],
                  color=styles.colors([e["cache"] for e in entries]))
        axis.invert_yaxis()
        axis.set_xlabel(label)
        axis.tick_params(axis="y", labelsize=7)
    _title(figure, f"locks: our lock() beside the add + delete recipe (contended: each grant "
           f"held {locks['hold_ms']:g} ms)", results, values="no values: lock names only")
    return figure


def replicas_bars(scenario: dict[str, Any], results: dict[str, Any], styles: Styles) -> Any:
    """Median time per call and the hit ratio after a node was killed, per REPLICAS."""
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    latency = [e for e in scenario["results"] if e["part"] == "latency"]
    axes[0].barh([f"{e['operation']}\nREPLICAS {e['replicas']}" for e in latency],
                 [e["median_us"] for e in latency])
    axes[0].invert_yaxis()
    axes[0].set_xlabel("µs per call (median), every node up")
    outage = [e for e in scenario["results"] if e["part"] == "outage"]
    axes[1].bar([f"REPLICAS {e['replicas']}" for e in outage],
                [100 * (e["hit_ratio_after_kill"] or 0) for e in outage])
    axes[1].set_ylabel("% of gets that hit after one node was killed")
    axes[1].set_ylim(0, 100)
    _title(figure, f"replicas: MemcachedCache on {scenario['nodes']} nodes, one killed", results)
    return figure


#: Each scenario's plot: ``writer(scenario, results, styles) -> Figure``.
WRITERS: dict[str, Callable[[dict[str, Any], dict[str, Any], Styles], Any]] = {
    "ops": ops_bars, "rows": rows_scaling, "nodes": nodes_scaling,
    "concurrency": concurrency_lines, "storage": storage_bars, "capacity": capacity_bars,
    "codec": codec_tradeoff, "shards": shards_scaling, "async": async_throughput,
    "stampede": stampede_counts, "encryption": encryption_ratios, "locks": locks_bars,
    "replicas": replicas_bars, "scale": scale_curves,
}
#: Figures of a part of a scenario: (scenario, part) -> its writer.
PART_WRITERS: dict[tuple[str, str], Callable[[dict[str, Any], dict[str, Any], Styles], Any]] = {
    ("async", "emcache"): emcache_throughput,
}
