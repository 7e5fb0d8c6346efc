"""``manage.py kvcache_benchmark``: django-kvcache's backends against DatabaseCache and the rest.

In a site with ``kvcache_bench`` in INSTALLED_APPS (and the ``bench`` extra installed),
``--caches ALIAS[,ALIAS...]`` measures those caches of CACHES on the site's own servers,
beside Django's DatabaseCache and PyMemcacheCache (``kvcache_bench.caches``). In the
project's benchmark settings (``make bench``) it measures every cache it knows on the
servers ``scripts/services.py`` starts.

The work happens in ``kvcache_bench.run``; this only reads options and writes outputs.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from kvcache_bench import report
from kvcache_bench.caches import is_site_run
from kvcache_bench.context import Parameters
from kvcache_bench.data import DEFAULT_MIX, MIXES
from kvcache_bench.run import (
    MIX_SCENARIOS,
    ON_REQUEST_SCENARIOS,
    SCENARIOS,
    SITE_SCENARIOS,
    benchmark,
)

#: What the command needs beyond Django: the ``bench`` extra (the packages by name, for a
#: checkout, where the extra cannot be installed by its name from PyPI).
REQUIRED = {"tqdm": "tqdm", "matplotlib": "matplotlib"}


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def _numbers(value: str) -> tuple[int, ...]:
    return tuple(int(number) for number in _names(value))


class Command(BaseCommand):
    help = "Benchmark django-kvcache's backends against DatabaseCache and the alternatives."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--scenario", type=_names, action="extend",
                            help=f"comma-separated, from {', '.join(SCENARIOS)} ('default': "
                                 f"all of them, the default), or {', '.join(ON_REQUEST_SCENARIOS)} "
                                 f"(only when named); on a site's caches from "
                                 f"{', '.join(SITE_SCENARIOS)} (default all)")
        parser.add_argument("--caches", type=_names, action="extend",
                            help="comma-separated aliases of your CACHES (default: every "
                                 "django-kvcache cache); in the project's benchmark, cache "
                                 "names or patterns, e.g. 'db-*,kv-*'")
        parser.add_argument("--extra-cache", action="append", default=[], metavar="NAME=BACKEND[@LOCATION]",
                            help="also benchmark this backend class in the ops scenario")
        parser.add_argument("--values", type=_names, dest="mixes",  # the last one given counts
                            help=f"comma-separated value mixes from {', '.join(MIXES)} (default "
                                 f"{DEFAULT_MIX}); {', '.join(MIX_SCENARIOS)} run once per mix")
        parser.add_argument("--quick", action="store_true",
                            help="small sizes: a site's caches in under a minute, the project's "
                                 "in under two")
        parser.add_argument("--rounds", type=int, help="timed rounds per operation")
        parser.add_argument("--calls", type=int, help="calls per cache, operation and round")
        parser.add_argument("--batch-size", type=int, dest="batch", help="keys per *_many call (20)")
        parser.add_argument("--rows", type=_numbers, help="table sizes, e.g. 1000,10000,100000")
        parser.add_argument("--scale-rows", type=_numbers, dest="scale_rows",
                            help="scale: table sizes (default 100000,1000000; add 10000000 for "
                                 "the 10 M tier, which takes a long fill and several GB)")
        parser.add_argument("--scale-calls", type=int, dest="scale_calls",
                            help="scale: calls per cache, operation and access pattern (1000)")
        parser.add_argument("--scale-buffer-pool", type=float, dest="scale_buffer_pool",
                            metavar="FRACTION",
                            help="scale: the server's InnoDB buffer pool, resized at each size to "
                                 "this fraction of the measured tables' bytes (0.2)")
        parser.add_argument("--nodes", type=_numbers, help="memcached node counts, e.g. 1,2,4,8")
        parser.add_argument("--workers", type=_numbers, help="concurrent workers, e.g. 1,2,4,8")
        parser.add_argument("--iterations", type=int, help="mixed-workload iterations per worker")
        parser.add_argument("--callers", type=_numbers,
                            help="callers at once on one key in stampede, e.g. 8,32,128")
        parser.add_argument("--seed", type=int)
        parser.add_argument("--storage-entries", type=int, dest="storage_entries",
                            help="entries written per cache in the storage scenario (1000)")
        parser.add_argument("--capacity-mb", type=int, dest="capacity_mb",
                            help="memory (-m) of the memcached node capacity fills (32)")
        parser.add_argument("--capacity-fill", type=float, dest="capacity_fill",
                            help="bytes written into that node, as a multiple of its memory (4)")
        parser.add_argument("--server-cpu", type=float, dest="server_cpu", metavar="Q",
                            help="shards: cap each MariaDB server at Q cores (cgroup v1 cpu "
                                 "quota, e.g. 0.12) for the throughput figures")
        parser.add_argument("--client-processes", type=int, dest="client_processes",
                            help="shards throughput: client processes (4)")
        parser.add_argument("--client-threads", type=int, dest="client_threads",
                            help="shards throughput: threads per client process (8)")
        parser.add_argument("--shard-seconds", type=float, dest="shard_seconds",
                            help="shards throughput: seconds counted per figure (4)")
        parser.add_argument("--shard-rounds", type=int, dest="shard_rounds",
                            help="shards throughput: rounds, the figure is their median (3)")
        parser.add_argument("--lock-seconds", type=float, dest="lock_seconds",
                            help="locks: seconds of each contended figure (3)")
        parser.add_argument("--replica-keys", type=int, dest="replica_keys",
                            help="replicas: entries written, read and rewritten (2000)")
        parser.add_argument("--replica-seconds", type=float, dest="replica_seconds",
                            help="replicas: seconds of each outage run, a node killed halfway (6)")
        parser.add_argument("--results", type=Path, default=Path("results"),
                            help="folder for benchmark-MIX.json, benchmark-MIX.csv and the plots "
                                 "(default ./results)")
        parser.add_argument("--json", type=Path,
                            help="JSON path, the mix name added (default RESULTS/benchmark.json)")
        parser.add_argument("--csv", type=Path,
                            help="CSV path, the mix name added (default RESULTS/benchmark.csv)")
        parser.add_argument("--plot", type=Path, help="folder for the PNG plots (default RESULTS)")
        parser.add_argument("--no-progress", action="store_true",
                            help="no progress bar (shown on stderr only when it is a terminal)")

    def handle(self, *args: Any, **options: Any) -> None:
        missing = [package for module, package in REQUIRED.items()
                   if importlib.util.find_spec(module) is None]
        if missing:
            raise CommandError(
                f"kvcache_benchmark needs {', '.join(missing)}: install django-kvcache's "
                f"'bench' extra (pip install 'django-kvcache[bench]'), or from a checkout "
                f"pip install {' '.join(missing)}")
        site = is_site_run(options["caches"])
        # "default" names the default set, so a run can add an on-request scenario to it.
        default = list(SITE_SCENARIOS if site else SCENARIOS)
        named = options["scenario"] or ["default"]
        scenarios = [s for name in named for s in (default if name == "default" else [name])]
        known = SCENARIOS + ON_REQUEST_SCENARIOS
        unknown = sorted(set(scenarios) - set(known))
        if unknown:
            raise CommandError(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(known)}")
        parameters = self.parameters(options, site)
        problem = parameters.problem()
        if problem:
            raise CommandError(problem)
        mixes = list(dict.fromkeys(options["mixes"] or [DEFAULT_MIX]))
        try:
            runs = benchmark(parameters, mixes, [s for s in known if s in scenarios],
                             options["caches"], options["extra_cache"],
                             show_progress=not options["no_progress"], site=site)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        for results in runs:
            results["command"] = " ".join(sys.argv)
            self.write_outputs(results, options)
        failures = [failure for results in runs for failure in results["failures"]]
        if failures:
            raise CommandError("wrong results:\n" + "\n".join(failures))

    @staticmethod
    def parameters(options: dict[str, Any], site: bool = False) -> Parameters:
        parameters = Parameters()
        if options["quick"]:
            parameters = Parameters.site_quick() if site else Parameters.quick()
        overrides = {field.name: options[field.name] for field in dataclasses.fields(Parameters)
                     if options.get(field.name) is not None}
        return dataclasses.replace(parameters, **overrides)

    def write_outputs(self, results: dict[str, Any], options: dict[str, Any]) -> None:
        """The files of one mix, each named after it: benchmark-realistic.json..."""
        folder, mix = options["results"], results["values"]["name"]
        json_path = report.with_mix(options["json"] or folder / "benchmark.json", mix)
        csv_path = report.with_mix(options["csv"] or folder / "benchmark.csv", mix)
        plot_dir = options["plot"] or folder
        report.write_json(json_path, results)
        report.write_csv(csv_path, results)
        from kvcache_bench import plots  # matplotlib is slow to import; only needed here

        written = plots.write_all(results, plot_dir)
        self.stdout.write(report.text(results))
        self.stdout.write(f"wrote {json_path}, {csv_path} and {len(written)} plot(s) in {plot_dir}\n")
