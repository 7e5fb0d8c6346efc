"""``.. kvcache-benchmark:: PATH``: the tables of a benchmark run, from the JSON it wrote.

The benchmark (``manage.py kvcache_benchmark``) writes ``benchmark-MIX.json`` with every
figure, the command, the machine and the value mix. This directive renders a run's tables
with the benchmark's own text report (``kvcache_bench.report``, which needs nothing but
the standard library), so no figure on the benchmarks page is copied by hand::

    .. kvcache-benchmark:: _static/benchmarks/2026-11-25/benchmark-realistic.json
       :scenarios: ops, storage

PATH is relative to the page; ``:scenarios:`` picks the run's scenarios (default: all of
them, in the run's order; ``values`` is the value mix as generated). A paragraph before the tables says when and where it ran, on
which values, with which command, and the load average at its start.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark_app"))
from kvcache_bench import report  # noqa: E402  (the benchmark's text report)


def describe(results: dict[str, Any]) -> str:
    """When, where, on what and how a run was made, in one paragraph."""
    machine = results["machine"]
    load = machine.get("load_average_at_start")
    parts = [f"Run of {machine['date_utc'].replace('T', ' ').replace('+00:00', ' UTC')} on "
             f"{report.header(machine)}"]
    if load:
        parts.append(f"load average {load[0]:g} at its start")
    parts.append(results["values"]["label"])
    return "; ".join(parts) + "."


def scenario_text(results: dict[str, Any], name: str) -> str:
    """A scenario's tables as the command prints them; ``values``: the run's value mix."""
    if name == "values":
        return report.values_text(results["values"])
    scenario, mix = results["scenarios"][name], results["values"]["name"]
    if name == "ops":
        return report.ops_text(scenario, results.get("reference"), mix)
    if name in report.MIX_TEXT:
        return report.TEXT[name](scenario, mix)
    return report.TEXT[name](scenario)


class BenchmarkRun(SphinxDirective):
    required_arguments = 1
    option_spec = {"scenarios": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        relative, path = self.env.relfn2path(self.arguments[0], self.env.docname)
        self.env.note_dependency(relative)
        try:
            results = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise self.error(f"cannot read benchmark results {self.arguments[0]}: {exc}")
        names = list(results["scenarios"])
        if "scenarios" in self.options:
            wanted = [name.strip() for name in self.options["scenarios"].split(",")]
            missing = [name for name in wanted if name not in [*names, "values"]]
            if missing:
                raise self.error(f"{self.arguments[0]} has no scenario {', '.join(missing)} "
                                 f"(it has {', '.join(names)})")
            names = wanted
        said = nodes.paragraph()
        said += nodes.Text(describe(results) + " Command: ")
        said += nodes.literal(text=results.get("command", "(not recorded)"))
        output: list[nodes.Node] = [said]
        for name in names:
            text = scenario_text(results, name)
            block = nodes.literal_block(text, text)
            block["language"] = "text"
            output.append(block)
        return output


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("kvcache-benchmark", BenchmarkRun)
    return {"version": "1", "parallel_read_safe": True}
