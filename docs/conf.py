import re
import sys
from pathlib import Path

project = "django-kvcache"
author = "The django-kvcache authors"
copyright = f"2026, {author}"
# The version is defined once, in the package; setup.cfg reads it from there too.
_init = Path(__file__).resolve().parent.parent / "django_kvcache" / "__init__.py"
release = re.search(r'^__version__ = "([^"]+)"', _init.read_text(), re.MULTILINE)[1]
# docs/_ext: the benchmarks page's tables, rendered from the JSON a benchmark run wrote.
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))
extensions = ["kvcache_benchmark"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
