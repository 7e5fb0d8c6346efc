"""``manage.py kvcache_stats [alias ...] [--json] [--no-server]``: the health of the caches.

For each kvcache cache, per memcached node or MySQL shard: what the servers themselves
say, then the ``metrics()`` counters of this process (``django_kvcache.stats``). A
server that cannot be asked is shown, not fatal: its cell says why in a word (refused,
timeout, no stats: a proxy such as twemproxy) and a note under the table says more.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_kvcache import stats
from django_kvcache.management.commands._errors import failing

PROCESS_NOTE = (
    "this process's counters (metrics()): mostly 0 in a fresh manage.py; the Prometheus "
    "collector reads them in the web processes"
)


class Command(BaseCommand):
    help = (
        "Show each kvcache cache's counters per memcached node or MySQL shard (hits, "
        "misses, hit ratio, bytes, failures, outdated keys, pools) and the servers' own "
        "figures."
    )
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "aliases", nargs="*", metavar="alias",
            help="Cache aliases (default: every kvcache cache in CACHES).",
        )
        parser.add_argument("--json", action="store_true", help="One JSON document.")
        parser.add_argument(
            "--no-server", action="store_true",
            help="Only this process's counters: do not ask the servers.",
        )

    def handle(self, *args: Any, aliases: list[str], json: bool, no_server: bool,
               verbosity: int, **options: Any) -> None:
        selected = self.selected(aliases)
        if not selected and not json:
            if verbosity >= 1:
                listed = ", ".join(repr(alias) for alias in settings.CACHES) or "none"
                self.stdout.write(f"no django-kvcache cache in CACHES (no BACKEND of {listed} "
                                  "is a django_kvcache backend or a subclass): nothing to show.")
            return
        report = {}
        for alias in selected:
            with failing(alias):
                figures = stats.process_figures(alias)
                servers = {} if no_server else stats.server_figures(alias)
            report[alias] = (figures, servers)
        if json:
            self.stdout.write(self.as_json(report))
        else:
            self.stdout.write("\n\n".join(self.as_text(*entry) for entry in report.values()))

    @staticmethod
    def selected(aliases: list[str]) -> list[str]:
        known = stats.kvcache_aliases()
        for alias in aliases:
            if alias not in settings.CACHES:
                raise CommandError(f"No cache named {alias!r} in CACHES")
            if alias not in known:
                raise CommandError(f"Cache {alias!r} is not a django-kvcache cache")
        return aliases or known

    @staticmethod
    def as_json(report: dict[str, Any]) -> str:
        document = {
            alias: {
                "backend": figures.backend,
                "process": {
                    "cache": with_ratio(figures.figures),
                    **{
                        f"{place.kind}s": {p.name: with_ratio(p.figures) for p in figures.places
                                           if p.kind == place.kind}
                        for place in figures.places
                    },
                },
                "server": servers,
            }
            for alias, (figures, servers) in report.items()
        }
        return json.dumps(document, indent=2, sort_keys=False)

    @staticmethod
    def as_text(figures: stats.CacheFigures, servers: dict[str, dict[str, Any]]) -> str:
        """The servers' figures first (what every client did), then this process's
        counters (mostly zero in a fresh ``manage.py``: rows that are zero everywhere
        are left out); long text — why a server could not be asked — in numbered notes
        under its table, never in a cell."""
        counts = Counter(place_kind(place.kind, figures) for place in figures.places)
        places = ", ".join(f"{n} {kind}{'s' * (n != 1)}"
                           for kind, n in (counts or Counter({"node": 0})).items())
        lines = [f"{figures.alias} ({figures.backend}, {places})"]
        if servers:
            lines += server_table(servers)
        lines += process_table(figures)
        return "\n".join(lines) + "\n"


#: How a server's cell reads when it could not be asked (``problem`` of its answer).
PROBLEMS = {"refused": "refused", "timeout": "timeout", "unsupported": "no stats",
            "marked down": "down", "failed": "failed"}


def server_table(servers: dict[str, dict[str, Any]]) -> list[str]:
    """The servers' own figures, one column each; a server that could not be asked says
    why in a word (refused, timeout, no stats: a proxy) and a note under the table."""
    lines = ["  the servers' own figures (every client's traffic)"]
    notes: list[str] = []
    answers: list[str] = []
    for values in servers.values():
        if "error" not in values:
            answers.append("ok")
            continue
        notes.append(values["error"])
        answers.append(f"{PROBLEMS.get(values.get('problem', ''), 'error')} [{len(notes)}]")
    names = list(dict.fromkeys(name for values in servers.values() for name in values
                               if name not in ("error", "problem")))
    rows = [["answer", *answers]] if notes else []
    rows += [[name, *(cell(values.get(name)) for values in servers.values())] for name in names]
    lines.append(table(["", *servers], rows))
    lines += [f"  [{number}] {note}" for number, note in enumerate(notes, 1)]
    return lines


def process_table(figures: stats.CacheFigures) -> list[str]:
    """This process's counters (``metrics()``) per node or shard, without the rows that
    are zero (or empty) on every one of them."""
    lines = [f"  {PROCESS_NOTE}"]
    if figures.figures:  # of the cache as a whole (MySQL's table)
        ratio = stats.hit_ratio(figures.figures)
        lines.append("  " + ", ".join(
            [f"{name} {value}" for name, value in figures.figures.items()]
            + ([] if ratio is None else [f"hit ratio {percent(ratio)}"])))
    names = list(dict.fromkeys(name for place in figures.places for name in place.figures))
    rows: list[list[str]] = []
    quiet = 0
    for name in names:
        values = [place.figures.get(name) for place in figures.places]
        if not any(values):
            quiet += 1
            continue
        rows.append([name, *(cell(value) for value in values)])
        if name == "misses":
            ratios = [stats.hit_ratio(place.figures) for place in figures.places]
            rows.append(["hit ratio", *(percent(r) for r in ratios)])
    if rows:
        lines.append(table(["", *(place.name for place in figures.places)], rows))
    if quiet:
        kinds = "/".join(sorted({place_kind(p.kind, figures) for p in figures.places}))
        lines.append(f"  {'the other' if rows else 'all'} {quiet} counters are 0 on every "
                     f"{kinds or 'node'} (--json lists them)")
    return lines


def place_kind(kind: str, figures: stats.CacheFigures) -> str:
    """What a place is called: a MySQL cache on one database has a server, not a shard."""
    shards = sum(place.kind == "shard" for place in figures.places)
    return "server" if kind == "shard" and shards == 1 else kind


def with_ratio(figures: dict[str, Any]) -> dict[str, Any]:
    ratio = stats.hit_ratio(figures)
    return figures if ratio is None else {**figures, "hit_ratio": round(ratio, 4)}


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return " ".join(str(value).split())


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1%}"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  " + "  ".join(
            text.ljust(width) if index == 0 else text.rjust(width)
            for index, (text, width) in enumerate(zip(row, widths))
        ).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)
