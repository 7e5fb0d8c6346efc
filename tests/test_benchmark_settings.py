"""The project's benchmark settings: each run keeps DatabaseCache's SQLite database in a
file of its own (runs at the same time on one machine shared one and lost entries),
which the processes it spawns share and which is gone when it exits."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = """
import json, os, sqlite3, subprocess, sys
from benchmark_app import settings
sqlite3.connect(settings.SQLITE_PATH).execute("CREATE TABLE t (x)")
child = subprocess.run([sys.executable, "-c",
    "from benchmark_app import settings; print(settings.SQLITE_PATH)"],
    capture_output=True, text=True, check=True)
print(json.dumps({"path": settings.SQLITE_PATH, "child": child.stdout.strip(),
                  "exists": os.path.exists(settings.SQLITE_PATH)}))
"""


def run(env_extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "KVCACHE_BENCH_SQLITE"}
    env.update(env_extra or {}, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmark_app")]))
    result = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True,
                            env=env, check=True, timeout=60)
    return json.loads(result.stdout)


def test_each_run_has_a_sqlite_file_of_its_own_removed_when_it_exits():
    first, second = run(), run()
    assert first["path"] != second["path"]
    for seen in (first, second):
        assert seen["exists"] and seen["child"] == seen["path"]  # its processes share it
        assert not Path(seen["path"]).exists()  # removed when the run exited


def test_a_file_named_by_the_user_is_used_and_kept(tmp_path):
    mine = str(tmp_path / "mine.sqlite3")
    seen = run({"KVCACHE_BENCH_SQLITE": mine})
    assert seen["path"] == seen["child"] == mine
    assert Path(mine).exists()
