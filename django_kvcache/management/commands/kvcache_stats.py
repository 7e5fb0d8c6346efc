"""``manage.py kvcache_stats [alias ...] [--json] [--no-server]``: the health of the caches.

For each kvcache cache, per memcached node or MySQL shard: the ``metrics()`` counters
of this process, then what the servers themselves say (``django_kvcache.stats``).
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
    "counters of this process (metrics()): mostly 0 in a fresh manage.py; the Prometheus "
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
               **options: Any) -> None:
        selected = self.selected(aliases)
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
        counts = Counter(place.kind for place in figures.places) or Counter({"node": 0})
        places = ", ".join(f"{n} {kind}{'s' * (n != 1)}" for kind, n in counts.items())
        lines = [f"{figures.alias} ({figures.backend}, {places})"]
        if figures.figures:
            ratio = stats.hit_ratio(figures.figures)
            lines.append("  " + ", ".join(
                [f"{name} {value}" for name, value in figures.figures.items()]
                + ([] if ratio is None else [f"hit ratio {percent(ratio)}"])))
        lines.append(f"  {PROCESS_NOTE}")
        columns = [place.name for place in figures.places]
        rows: list[list[str]] = []
        names = list(dict.fromkeys(name for place in figures.places for name in place.figures))
        for name in names:
            if name == "misses":
                rows.append([name, *(cell(place.figures.get(name)) for place in figures.places)])
                ratios = [stats.hit_ratio(place.figures) for place in figures.places]
                rows.append(["hit ratio", *(percent(r) for r in ratios)])
                continue
            rows.append([name, *(cell(place.figures.get(name)) for place in figures.places)])
        lines.append(table(["", *columns], rows))
        if servers:
            lines.append("  the servers' own figures")
            server_names = list(dict.fromkeys(
                name for values in servers.values() for name in values))
            lines.append(table(["", *servers], [
                [name, *(cell(values.get(name)) for values in servers.values())]
                for name in server_names
            ]))
        return "\n".join(lines) + "\n"


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
