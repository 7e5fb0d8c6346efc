"""The benchmark's plots, drawn from the results of real runs (the JSON in docs/_static),
read back through matplotlib's artists: every series of a plot has a colour of its own
from a colour-blind-safe palette and a marker, a cache keeps its colour from plot to plot,
and no two text labels of a plot overlap."""
from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmark_app"))

from kvcache_bench import plots  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

STATIC = ROOT / "docs" / "_static" / "benchmarks"
RESULTS = {
    name: json.loads((STATIC / folder / f"benchmark-{run}.json").read_text())
    for name, folder, run in (("realistic", "2026-11-25", "realistic"),
                              ("async", "2026-11-25", "async"),
                              ("encryption", "2026-11-27-encryption", "realistic"))
}
FIGURES = [(run, scenario) for run, results in RESULTS.items() for scenario in results["scenarios"]]


def figure_of(run: str, scenario: str) -> Any:
    results = RESULTS[run]
    styles = plots.Styles.for_results(results)
    return plots.WRITERS[scenario](results["scenarios"][scenario], results, styles)


def series(axis: Any) -> list[tuple[str, str, str]]:
    """(label, colour, marker) of each labelled line, scatter and group of bars of
    ``axis`` (bars have no marker: "bar")."""
    found = []
    for container in axis.containers:
        label = container.get_label()
        if label and not label.startswith("_") and getattr(container, "patches", None):
            found.append((label, to_hex(container.patches[0].get_facecolor()), "bar"))
    for line in axis.get_lines():
        if not line.get_label().startswith("_"):
            found.append((line.get_label(), to_hex(line.get_color()), str(line.get_marker())))
    for collection in axis.collections:
        label = collection.get_label()
        if label and not label.startswith("_") and len(collection.get_facecolors()):
            marker = getattr(collection, "kvcache_marker", "?")
            found.append((label, to_hex(collection.get_facecolors()[0]), marker))
    return found


@pytest.mark.parametrize("run, scenario", FIGURES)
def test_every_series_of_a_plot_has_a_colour_and_marker_of_its_own(run, scenario):
    figure = figure_of(run, scenario)
    for axis in figure.axes:
        drawn = series(axis)
        styles = [(colour, marker) for _, colour, marker in drawn]
        assert len(set(styles)) == len(styles), (axis.get_title(), drawn)
        if scenario != "codec":  # there: colour the compressor, marker the threshold
            colours = [colour for _, colour, _ in drawn]
            assert len(set(colours)) == len(colours), (axis.get_title(), drawn)
        assert all(colour.upper() in plots.PALETTE or colour == "#808080"
                   for _, colour, _ in drawn), drawn
    plots.plt.close(figure)


def test_a_cache_keeps_its_colour_across_plots():
    """Lines, and the bars of the bar charts (named by their axis's tick labels)."""
    colours: dict[str, set[str]] = {}
    for scenario in RESULTS["realistic"]["scenarios"]:
        if scenario in ("codec", "shards"):
            continue  # settings and operations, not caches
        figure = figure_of("realistic", scenario)
        for axis in figure.axes:
            for label, colour, _ in series(axis):
                colours.setdefault(label, set()).add(colour)
            names = [tick.get_text() for tick in axis.get_yticklabels()]
            bars = [patch for patch in axis.patches if patch.get_height() > 0.5]
            if bars and len(bars) % len(names or [0]) == 0:
                for name, bar in zip(names, bars):  # the first bar of each name: the median
                    colours.setdefault(name, set()).add(to_hex(bar.get_facecolor()))
        plots.plt.close(figure)
    assert len(colours) > 10 and all(len(found) == 1 for found in colours.values()), colours


@pytest.mark.parametrize("run, scenario", FIGURES)
def test_no_two_labels_of_a_plot_overlap(run, scenario):
    figure = figure_of(run, scenario)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    for axis in figure.axes:
        texts = [t for t in axis.texts if t.get_text().strip() and t.get_visible()]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
        overlapping = [(a, b) for (a, box_a), (b, box_b) in combinations(boxes, 2)
                       if box_a.overlaps(box_b)]
        assert not overlapping, (axis.get_title(), overlapping[:5])
    plots.plt.close(figure)


def test_shards_plot_draws_a_run_whose_one_shard_did_nothing():
    """A short run on a loaded machine measured 0 calls/s on one shard: the plot drew the
    ratios to it and failed the run with ZeroDivisionError."""
    results = json.loads(json.dumps(RESULTS["realistic"]))
    for entry in results["scenarios"]["shards"]["results"]:
        if entry.get("shards") == 1 and "ops_per_s" in entry:
            entry["ops_per_s"] = 0.0
            entry["rounds_ops_per_s"] = [0.0]
    styles = plots.Styles.for_results(results)
    figure = plots.WRITERS["shards"](results["scenarios"]["shards"], results, styles)
    assert figure.axes


def with_redis(run: str) -> dict[str, Any]:
    """A stored run with Django's RedisCache beside the others, as runs have it since it
    became a peer: in ops a row like PyMemcacheCache's, in async a client on its one
    server (``nodes`` 1) whatever the node count."""
    results = json.loads(json.dumps(RESULTS[run]))
    scenarios = results["scenarios"]
    if "ops" in scenarios:
        ops = scenarios["ops"]["results"]
        ops += [{**entry, "cache": "redis"} for entry in ops if entry["cache"] == "pymemcache-1"]
    if "async" in scenarios:
        entries = scenarios["async"]["results"]
        entries += [{**entry, "client": "redis", "ops_per_s": entry["ops_per_s"] / 3}
                    for entry in entries if entry["client"] == "pymemcache" and entry["nodes"] == 1]
    return results


@pytest.mark.parametrize("run, scenario", [("realistic", "ops"), ("async", "async")])
def test_redis_gets_a_colour_and_marker_of_its_own(run, scenario):
    results = with_redis(run)
    styles = plots.Styles.for_results(results)
    figure = plots.WRITERS[scenario](results["scenarios"][scenario], results, styles)
    for axis in figure.axes:
        drawn = series(axis)
        if scenario == "async":  # lines: redis among them, on the most nodes' plot too
            assert "redis" in [label for label, _, _ in drawn], drawn
            styles_drawn = [(colour, marker) for _, colour, marker in drawn]
            assert len(set(styles_drawn)) == len(styles_drawn), drawn
            assert len({colour for _, colour, _ in drawn}) == len(drawn), drawn
        else:  # bars: one colour per cache, redis's its own
            names = [tick.get_text() for tick in axis.get_yticklabels()]
            if "redis" not in names:
                continue
            bars = [to_hex(patch.get_facecolor()) for patch in axis.patches[:len(names)]]
            assert len(set(bars)) == len(names), dict(zip(names, bars))
    plots.plt.close(figure)
