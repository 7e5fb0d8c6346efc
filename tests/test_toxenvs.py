"""scripts/toxenvs.py, run as the Makefile runs it: with its link folder first on PATH."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_second_run_keeps_every_link_pointing_at_an_interpreter(tmp_path):
    """The second ``make test`` in a checkout found each interpreter through the link the
    first had made (PATH starts with the link folder) and replaced the link with a link to
    itself: tox then found no Python 3.11 or 3.12."""
    (tmp_path / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "toxenvs.py", tmp_path / "scripts" / "toxenvs.py")
    links = tmp_path / ".runtime" / "pythons"
    env = {**os.environ, "PATH": f"{links}{os.pathsep}{os.environ['PATH']}"}
    runs = [subprocess.run([sys.executable, str(tmp_path / "scripts" / "toxenvs.py"), "default"],
                           env=env, capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout and runs[1].stdout.strip(), runs[1].stderr
    made = sorted(links.iterdir())
    assert made
    for link in made:
        target = Path(os.readlink(link))
        assert target.parent != links, f"{link} -> {target}"
        assert subprocess.run([str(link), "-c", "pass"], timeout=30).returncode == 0
