"""What the benchmark prints, where it cannot flood a log or claim what it did not measure:
progress bars only on a terminal, a header naming only the servers measured, and no table
for a scenario with nothing to measure (no server needed)."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmark_app"))
from kvcache_bench import report  # noqa: E402  (the benchmark's package)
from kvcache_bench.context import Context, Parameters  # noqa: E402

pytestmark = pytest.mark.once

MACHINE = {"cpu": "AMD EPYC", "cores": 2, "python": "CPython 3.11.7", "django": "5.2.19",
           "date_utc": "2026-11-29T02:30:37+00:00", "sqlite": None, "memcached_nodes": 2}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def context(show_progress: bool = True) -> Context:
    return Context("token", Parameters.quick(), [], None, [], show_progress)


def test_no_progress_bar_when_stderr_is_not_a_terminal(monkeypatch):
    """``make bench > log`` (or cron, or CI): a bar's redraws would be thousands of lines."""
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    with context().progress("ops", 100) as bar:
        shown = not bar.disable  # (closing a bar disables it)
        for _ in range(100):
            bar.update()
    assert not shown and log.getvalue() == ""


def test_a_progress_bar_on_a_terminal_unless_asked_not_to(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with context().progress("ops", 10) as shown, context(False).progress("ops", 10) as hidden:
        states = (shown.disable, hidden.disable)  # (closing a bar disables it)
        shown.update()
    assert states == (False, True) and "ops" in terminal.getvalue()


@pytest.mark.parametrize("servers, named, absent", [
    ({"mariadb": None, "memcached": "1.6.18"}, ["memcached 1.6.18"], ["MariaDB", "MySQL", "SQLite"]),
    ({"mariadb": "10.11.19-MariaDB", "memcached": None}, ["MariaDB 10.11.19-MariaDB"],
     ["memcached", "None"]),
    ({"mariadb": "8.0.36", "memcached": None}, ["MySQL 8.0.36"], ["MariaDB", "None"]),
])
def test_the_header_names_only_the_servers_measured(servers, named, absent):
    """A memcached-only site's run said "MariaDB None"."""
    header = report.header({**MACHINE, **servers})
    assert header.startswith("AMD EPYC, 2 cores, Python CPython 3.11.7, Django 5.2.19")
    assert all(part in header for part in named)
    assert not any(part in header for part in absent)


def test_ops_without_a_database_cache_claims_no_speed_up():
    ops = {"operations": ["get hit"], "results": [
        {"cache": "default", "operation": "get hit", "median_us": 50.0, "cpu_us": 40.0,
         "ratio": None, "correct": True}]}
    text = report.ops_text(ops, None, "realistic")
    assert text.startswith("ops, realistic values: median per call\n")
    assert "speed-up" not in text and "nothing" not in text


def test_the_title_names_the_value_mix_only_when_a_scenario_used_it():
    """A run of filler-only scenarios (async, nodes, rows...) was titled with the realistic
    mix's label, as if its figures were of those values."""
    ops = {"operations": ["get hit"], "results": [
        {"cache": "default", "operation": "get hit", "median_us": 50.0, "cpu_us": 40.0,
         "ratio": None, "correct": True}]}
    results = {"machine": {**MACHINE, "mariadb": None, "memcached": "1.6.18"},
               "values": {"name": "realistic", "label": "realistic values (mean 3.4 KB)"},
               "reference": None, "skipped": {"async": "no emcache"}, "scenarios": {},
               "notes": [], "failures": []}
    assert "realistic values" not in report.text(results)
    with_ops = report.text({**results, "scenarios": {"ops": ops}})
    assert with_ops.splitlines()[1] == "realistic values (mean 3.4 KB)"
