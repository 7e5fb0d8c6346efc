#!/usr/bin/env python3
"""The benchmark project's manage.py: ``python benchmark_app/manage.py kvcache_benchmark``."""
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    # The benchmark project and the repository root (django_kvcache, tests) are importable
    # from wherever the command is started, e.g. `make bench` at the project root.
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmark_app.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
