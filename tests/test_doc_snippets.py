"""Every snippet of README.md and docs/*.rst runs as written.

The snippets are found, not listed: a page's ``.. code-block:: LANG`` directives and its
literal blocks (a paragraph ending with ``::``), README's fenced blocks. So a snippet a new
page or a new paragraph adds is checked the day it is written. What is done with each:

* **Python settings** (a block of imports and assignments that sets an UPPER_CASE name:
  ``CACHES = {...}``, ``INSTALLED_APPS += [...]``) run in a settings module built beside
  them: the names a new ``startproject`` settings.py defines (``INSTALLED_APPS``...), a
  ``DATABASES`` on MySQL (the pages' sites run on it), ``CACHE_DB`` (the cache's database settings, as
  docs/scale-out.rst names them) and the names the page's earlier settings snippets set,
  in page order. Then, in a process of its own, Django is set up with them, every cache of
  ``CACHES`` is built and the cache checks run: an unknown option, a bad value or a check
  error fails the snippet. No server is reached: the hosts of the examples are made up.
* **An OPTIONS fragment** (``"OPTIONS": {"REPLICAS": 2}`` in a ``code-block:: python``)
  replaces the OPTIONS of the page's last ``CACHES["default"]``, and runs as its settings.
* **Python code** (anything else) runs in a site configured on the test servers, with the
  aliases the pages use — ``default`` (a MySQLCache with ENCRYPTION_KEYS), ``db``,
  ``sessions`` (MySQLCaches) and ``mc`` (memcached) — after ``migrate``; ``await`` may be
  used at the top level. The names a snippet leaves to the reader (``build_report``,
  ``render_front_page``, ``import_feed``...) are defined beside it (``STAND_INS``); a model
  class is defined in an app of its own.
* **Shell**: each ``python manage.py …`` command runs in a ``startproject`` site with the
  same settings (as ``manage.py`` runs it, each in a process forked from one in which
  the site is set up) and must exit 0; a crontab line (five schedule fields) runs its
  ``manage.py`` command and must print nothing (cron mails what a job prints). Any other
  command (``pip install``, ``apt-get``, ``make``…) is not run, and its block must be
  marked, right before it, with the reason — ``.. not-run: REASON`` (reStructuredText) or
  ``<!-- not-run: REASON -->`` (Markdown) — which the test checks against the commands:
  ``installs packages`` (every command installs packages), ``the project's own commands``
  (``make``, ``.venv/bin/…``, ``scripts/…``, ``mkdir``/``cp`` of results, run by the
  suite itself), ``takes minutes`` (``kvcache_benchmark``, which the extra-site tox envs
  run with ``--quick``).
* Everything else (output, SQL, YAML, a command's synopsis) is text, not run.

A ``code-block:: python`` that is not Python fails; a literal ``::`` block is Python if it
compiles, shell if its lines are commands, else text.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.rst"))]
#: What the docs run as, and how long a snippet may take.
PYTHON = ("python", "python3")
TIMEOUT = 120
#: A strong key for the site's encrypted "default" cache and CACHE_ENCRYPTION_KEY.
ENCRYPTION_KEY = "snippets-test-key-0123456789-abcdefghij-KLMNOP"

pytestmark = pytest.mark.once

# --- finding the snippets ---------------------------------------------------------------


@dataclass
class Snippet:
    path: Path
    line: int  # where its block starts, 1-based
    language: str  # as written: "python", "sh", "text"... or "auto" (a "::" block)
    text: str
    not_run: str | None = None  # the reason it is marked with

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        """python, sh or text (an "auto" block by its content)."""
        if self.language in ("python", "py", "python3"):
            return "python"
        if self.language in ("sh", "bash", "console", "shell"):
            return "sh"
        if self.language != "auto":
            return "text"
        try:
            compile(self.text, self.where, "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError:
            pass
        else:
            return "python"
        return "sh" if any(looks_like_a_command(line) for line in self.text.splitlines()) else "text"


COMMAND = re.compile(r"^\s*(\$ |(python3?|pip|make|sudo|apt-get|brew|dnf|cd|mkdir|cp|tox)\s"
                     r"|\.venv/|[A-Z][A-Z0-9_]*=)")
NOT_RUN_RST = re.compile(r"^\s*\.\. not-run: (.+)$")
NOT_RUN_MD = re.compile(r"^\s*<!-- not-run: (.+?) -->\s*$")
CODE_BLOCK = re.compile(r"^(\s*)\.\. code-block::\s*(\S+)\s*$")
DIRECTIVE = re.compile(r"^\s*\.\. [\w:-]+::")


def looks_like_a_command(line: str) -> bool:
    return bool(COMMAND.match(line))


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def indented_block(lines: list[str], start: int, indent: int) -> tuple[str, int]:
    """The block of lines from ``start`` indented deeper than ``indent`` (blank lines
    inside it kept), dedented; and the index after it."""
    end = start
    while end < len(lines) and (not lines[end].strip() or indent_of(lines[end]) > indent):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end])).strip("\n"), end


def rst_block(lines: list[str], index: int) -> tuple[str, str, int] | None:
    """The ``code-block`` or ``::`` literal block starting at ``index``: its language,
    text and the index after it."""
    line = lines[index]
    block = CODE_BLOCK.match(line)
    literal = (line.rstrip().endswith("::") and not DIRECTIVE.match(line)
               and not line.lstrip().startswith(".."))
    if not (block or literal):
        return None
    start = index + 1
    if block:  # the directive's options, then its content
        while start < len(lines) and lines[start].strip().startswith(":"):
            start += 1
    text, end = indented_block(lines, start, indent_of(line))
    return (block[2] if block else "auto"), text, end


def md_block(lines: list[str], index: int) -> tuple[str, str, int] | None:
    """The fenced block starting at ``index``: its language, text and the index after it."""
    line = lines[index]
    if not line.startswith("```"):
        return None
    end = index + 1
    while not lines[end].startswith("```"):
        end += 1
    return line[3:].strip() or "text", "\n".join(lines[index + 1:end]), end + 1


@dataclass(frozen=True)
class Markup:
    """How a format writes a code block, the mark of one not run, and a comment."""

    not_run: re.Pattern
    mark: str
    block_at: Any  # (lines, index) -> (language, text, index after) | None
    comment: str | None  # how a line the mark may stand above starts (rst comments)


RST = Markup(NOT_RUN_RST, ".. not-run:", rst_block, "..")
MD = Markup(NOT_RUN_MD, "<!-- not-run: -->", md_block, None)


def file_snippets(path: Path, markup: Markup) -> Iterator[Snippet]:
    lines = path.read_text().splitlines()
    reason = None
    index = 0
    while index < len(lines):
        line = lines[index]
        marked = markup.not_run.match(line)
        found = None if marked else markup.block_at(lines, index)
        if marked:
            reason = marked[1].strip()
        elif found:
            language, text, after = found
            yield Snippet(path, index + 1, language, text, reason)
            reason, index = None, after
            continue
        elif (line.strip() and reason is not None
              and not (markup.comment and line.lstrip().startswith(markup.comment))):
            raise AssertionError(f"{path.name}:{index + 1}: '{markup.mark}' must come right "
                                 "before the block it marks")
        index += 1


def snippets() -> list[Snippet]:
    found: list[Snippet] = []
    for path in SOURCES:
        found += file_snippets(path, MD if path.suffix == ".md" else RST)
    return found


# --- what each python snippet is --------------------------------------------------------


def python_kind(snippet: Snippet) -> str:
    """settings, fragment (an OPTIONS entry) or code; AssertionError if it is no Python."""
    try:
        tree = compile(snippet.text, snippet.where, "exec",
                       ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        try:
            fragment = ast.parse("{" + snippet.text + "}", mode="eval").body
        except SyntaxError:
            raise AssertionError(f"{snippet.where}: not Python: {exc}") from None
        keys = [key.value for key in fragment.keys if isinstance(key, ast.Constant)]
        assert keys == ["OPTIONS"], f"{snippet.where}: a fragment other than OPTIONS: {keys}"
        return "fragment"
    settings_only = all(
        isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AugAssign, ast.AnnAssign))
        or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        for node in tree.body)
    return "settings" if settings_only and assigned_settings(tree) else "code"


def assigned_settings(tree: ast.Module) -> list[str]:
    """The UPPER_CASE names a module assigns (``X = ``, ``X += ``, ``X["k"] = ``)."""
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Name) and target.id.isupper():
                names.append(target.id)
    return names


# --- the runners (each a process of its own) ---------------------------------------------

#: Settings snippets: exec'd in page order with the page's names, each checked in a forked
#: child in which Django is set up with them.
SETTINGS_RUNNER = r'''
import copy, json, os, sys, traceback
from pathlib import Path
import django
jobs = json.loads(sys.stdin.read())
BASE = dict(
    BASE_DIR=Path("/srv/mysite"), SECRET_KEY="snippets", DEBUG=False, ALLOWED_HOSTS=[],
    INSTALLED_APPS=["django.contrib.admin", "django.contrib.auth",
                    "django.contrib.contenttypes", "django.contrib.sessions",
                    "django.contrib.messages", "django.contrib.staticfiles"],
    DATABASES={"default": {"ENGINE": "django.db.backends.mysql", "NAME": "app",
                           "HOST": "db.internal", "OPTIONS": {"charset": "utf8mb4"}}},
    USE_TZ=True, DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    CACHE_DB={"ENGINE": "django.db.backends.mysql", "NAME": "cache", "USER": "cache",
              "OPTIONS": {"charset": "utf8mb4", "connect_timeout": 1}},
)
# What every child would import, imported once before the forks.
import django.core.checks, django.db.backends.mysql.base  # noqa: E401
import django_kvcache.backends.memcached, django_kvcache.backends.mysql, django_kvcache.checks
pages, results = {}, []
for job in jobs:
    names = copy.deepcopy(pages.get(job["page"], BASE))
    try:
        if job["kind"] == "fragment":
            entry = dict((names.get("CACHES") or {}).get("default") or {})
            assert entry, "an OPTIONS fragment needs a CACHES['default'] earlier on its page"
            exec("fragment = {" + job["code"] + "}", {}, scope := {})
            names["CACHES"] = {"default": {**entry, **scope["fragment"]}}
        else:
            exec(compile(job["code"], job["where"], "exec"), names)
    except BaseException:
        results.append(traceback.format_exc(limit=3))
        continue
    configured = {k: v for k, v in names.items() if k.isupper() and k != "CACHE_DB"}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        problem = ""
        try:
            from django.conf import settings
            settings.configure(**configured)
            django.setup()
            from django.core.cache import caches
            from django.core.checks import run_checks
            for alias in settings.CACHES:
                caches[alias]
            serious = [str(m) for m in run_checks(tags=["caches"]) if m.is_serious()]
            if serious:
                problem = "check: " + "; ".join(serious)
            if hasattr(settings, "SESSION_ENGINE"):
                __import__(settings.SESSION_ENGINE)
        except BaseException:
            problem = traceback.format_exc(limit=3)
        os.write(write, problem.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        problem = pipe.read().decode()
    os.waitpid(pid, 0)
    results.append(problem)
    if not problem and job["kind"] == "settings":
        pages[job["page"]] = {**BASE, **{k: v for k, v in names.items() if k.isupper()}}
print(json.dumps(results))
'''

#: Code snippets: in a site on the test servers, after migrate.
CODE_RUNNER = r'''
import ast, asyncio, inspect, json, sys, traceback
import django
from django.conf import settings
config = json.loads(sys.argv[1])
jobs = json.loads(sys.stdin.read())
sys.path.insert(0, config["apps"])
settings.configure(**config["settings"])
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)


class Done:
    """What a stand-in returns: nothing to await, or awaited at once."""
    def __await__(self):
        return iter(())


def stand_in(*args, **kwargs):
    return Done()


async def async_stand_in(*args, **kwargs):
    return {"rendered": True}


class App:
    """A task queue's app: ``@app.task`` leaves the function as it is."""
    def task(self, function=None, **options):
        return function if function is not None else (lambda f: f)


from django.core.cache import cache
STAND_INS = dict(cache=cache, build_report=lambda: {"report": 2026},
                 render_front_page=lambda: "<html>",
                 render_front_page_async=async_stand_in, load_product=async_stand_in,
                 import_feed=stand_in, fetch_items=lambda feed: [], app=App())
results = []
for job in jobs:
    names = {"__name__": "snippets.models", **STAND_INS}
    try:
        code = compile(job["code"], job["where"], "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        outcome = eval(code, names)
        if inspect.iscoroutine(outcome):
            asyncio.run(outcome)
        results.append("")
    except BaseException:
        results.append(traceback.format_exc(limit=4))
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def site_settings(tmp_path_factory: pytest.TempPathFactory,
                  django_db_blocker: Any) -> Iterator[dict[str, Any]]:
    """The settings of the snippets' site: a database of its own on the test server, the
    caches the pages name, an app for models a snippet defines."""
    import MySQLdb

    server = settings.DATABASES["default"]
    name = f"kvcache_snippets_{os.getpid()}"
    connect = dict(host=server["HOST"], port=int(server["PORT"]), user=server["USER"],
                   password=server["PASSWORD"])
    connection = MySQLdb.connect(**connect)
    connection.cursor().execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    apps = tmp_path_factory.mktemp("apps")
    (apps / "snippets").mkdir()
    (apps / "snippets" / "__init__.py").write_text("")
    (apps / "snippets" / "models.py").write_text("")
    mysql = "django_kvcache.backends.mysql.MySQLCache"
    configured = {
        "SECRET_KEY": "snippets", "USE_TZ": True,
        "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
        "INSTALLED_APPS": ["django.contrib.auth", "django.contrib.contenttypes",
                           "django.contrib.sessions", "django_kvcache", "snippets"],
        "DATABASES": {"default": {
            "ENGINE": "django.db.backends.mysql", "NAME": name, "OPTIONS": {"charset": "utf8mb4"},
            **{key: server[key] for key in ("HOST", "PORT", "USER", "PASSWORD")}}},
        "CACHES": {
            "default": {"BACKEND": mysql, "LOCATION": "kvcache_entries",
                        "OPTIONS": {"ENCRYPTION_KEYS": [ENCRYPTION_KEY]}},
            "db": {"BACKEND": mysql, "LOCATION": "kvcache_db"},
            "sessions": {"BACKEND": mysql, "LOCATION": "kvcache_sessions"},
            "mc": {"BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
                   "LOCATION": settings.MEMCACHED_NODES[:2],
                   "KEY_PREFIX": f"snippets{os.getpid()}"},
        },
        "SESSION_ENGINE": "django.contrib.sessions.backends.cache",
        "SESSION_CACHE_ALIAS": "sessions",
    }
    try:
        yield {"settings": configured, "apps": str(apps)}
    finally:
        connection.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
        connection.close()


def environment() -> dict[str, str]:
    env = {**os.environ, "CACHE_ENCRYPTION_KEY": ENCRYPTION_KEY, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmark_app")])
    return env


def run_jobs(runner: str, jobs: list[dict[str, Any]], *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", runner, *args], input=json.dumps(jobs),
                          capture_output=True, text=True, env=environment(), timeout=TIMEOUT,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def job(snippet: Snippet, kind: str) -> dict[str, Any]:
    return {"where": snippet.where, "page": str(snippet.path), "code": snippet.text,
            "kind": kind}


# --- shell ---------------------------------------------------------------------------------

#: Reasons a shell block may be marked with, and what each of its commands must be.
NOT_RUN = {
    "installs packages": re.compile(
        r"^(sudo )?((python3? -m )?pip install|apt-get install|brew install|dnf install|"
        r"yum install) "),
    "the project's own commands": re.compile(
        r"^(([A-Z][A-Z0-9_]*=\S*\s+)*(make|\.venv/bin/\S+|python3 scripts/\S+|tox)\b"
        r"|mkdir docs/|cp results/|docker compose )"),
    "takes minutes": re.compile(r"^python3? manage\.py kvcache_benchmark\b"),
}
CRON = re.compile(r"^\s*(\S+\s+){5}(?P<command>.+)$")
SCHEDULE_FIELD = re.compile(r"^[\d*/,-]+$")


def commands(text: str) -> list[str]:
    """The commands of a shell block: comments dropped, continued lines joined, a quoted
    argument over several lines kept whole."""
    found, pending, continued = [], "", False
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if continued:  # after a backslash: one line
            pending = f"{pending} {line.strip()}"
        else:  # inside an open quote: the newline is the argument's
            pending = f"{pending}\n{line}" if pending else line
        continued = pending.rstrip().endswith("\\")
        if continued:
            pending = pending.rstrip()[:-1].rstrip()
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        found.append(pending.strip().removeprefix("$ "))
        pending = ""
    assert not pending, f"an unfinished command: {pending!r}"
    return found


def cron_command(command: str) -> str | None:
    """The job of a crontab line (five schedule fields, then the command), else None."""
    fields = command.split()
    if len(fields) > 5 and all(SCHEDULE_FIELD.match(field) for field in fields[:5]):
        return command.split(None, 5)[5]
    return None


def check_not_run(snippet: Snippet) -> None:
    """A marked block's reason is one of NOT_RUN's, and says what its commands are."""
    reason = snippet.not_run or ""
    known = next((name for name in NOT_RUN if reason.startswith(name)), None)
    assert known, (f"{snippet.where}: 'not-run: {reason}' is no reason the test knows: "
                   f"{', '.join(NOT_RUN)}")
    for command in commands(snippet.text):
        assert NOT_RUN[known].match(command), (
            f"{snippet.where}: marked '{known}', but runs {command!r}")


def manage_argv(command: str, where: str) -> list[str]:
    """The arguments of ``python manage.py …`` (a cron job's ``cd … &&``, and a
    virtualenv's path to python, dropped)."""
    part = next((piece for piece in command.split("&&") if "manage.py" in piece), "")
    argv = shlex.split(part, comments=True)
    assert argv and Path(argv[0]).name in PYTHON and argv[1] == "manage.py", (
        f"{where}: {command!r} is not a manage.py command: mark its block with "
        "'not-run: <reason>'")
    return argv[2:]


#: ``manage.py`` commands in the site: Django set up once, each command in a forked child
#: (``execute_from_command_line``, as manage.py runs it), its output and exit status kept.
SHELL_RUNNER = r'''
import json, os, sys, tempfile
sys.path.insert(0, os.getcwd())
os.environ["DJANGO_SETTINGS_MODULE"] = "mysite.settings"
import django
django.setup()
from django.core.management import execute_from_command_line
results = []
for argv in json.loads(sys.stdin.read()):
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            code = 0
            try:
                execute_from_command_line(["manage.py", *argv])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        results.append([os.waitstatus_to_exitcode(status), out.read().decode(errors="replace")])
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def shell_site(site_settings: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``startproject`` site with the snippets' settings."""
    folder = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "django", "startproject", "mysite", str(folder)],
                   check=True, env=environment(), timeout=TIMEOUT)
    configured = site_settings["settings"]
    extra = {key: configured[key] for key in ("DATABASES", "CACHES", "SESSION_ENGINE",
                                              "SESSION_CACHE_ALIAS")}
    settings_py = folder / "mysite" / "settings.py"
    settings_py.write_text(
        settings_py.read_text()
        + '\nINSTALLED_APPS += ["django_kvcache", "kvcache_bench"]\n'
        + "".join(f"{key} = {value!r}\n" for key, value in extra.items()))
    return folder


# --- the tests ---------------------------------------------------------------------------


def test_every_page_s_snippets_are_found():
    """The finder sees the blocks of each kind on the pages that have them (a finder that
    found nothing would pass every page)."""
    found = snippets()
    by_kind: dict[str, int] = {}
    for snippet in found:
        by_kind[snippet.kind] = by_kind.get(snippet.kind, 0) + 1
    assert by_kind.get("python", 0) >= 25 and by_kind.get("sh", 0) >= 15, by_kind
    pages = {snippet.path.name for snippet in found if snippet.kind != "text"}
    assert {"README.md", "quickstart.rst", "decisions.rst", "operations.rst",
            "mysql.rst", "memcached.rst"} <= pages


def test_python_settings_snippets_build_their_caches_and_pass_the_checks():
    runnable = [(s, python_kind(s)) for s in snippets() if s.kind == "python"]
    jobs = [job(s, kind) for s, kind in runnable if kind in ("settings", "fragment")]
    assert len(jobs) >= 15
    failures = [f"{j['where']}: {problem}" for j, problem in zip(jobs, run_jobs(
        SETTINGS_RUNNER, jobs)) if problem]
    assert not failures, "\n".join(failures)


def test_python_code_snippets_run_on_the_test_servers(site_settings):
    code = [job(s, "code") for s in snippets() if s.kind == "python" and python_kind(s) == "code"]
    assert len(code) >= 8
    problems = run_jobs(CODE_RUNNER, code, json.dumps(site_settings))
    failures = [f"{j['where']}: {problem}" for j, problem in zip(code, problems) if problem]
    assert not failures, "\n".join(failures)


def test_shell_snippets_run_in_a_site_or_say_why_not(shell_site):
    runs = []  # (where, command, the cron job or None, manage.py's arguments)
    for snippet in (s for s in snippets() if s.kind == "sh"):
        if snippet.not_run is not None:
            check_not_run(snippet)
            continue
        for command in commands(snippet.text):
            cron = cron_command(command)
            runs.append((snippet.where, command, cron, manage_argv(cron or command,
                                                                   snippet.where)))
    assert len(runs) >= 12
    done = subprocess.run([sys.executable, "-c", SHELL_RUNNER], cwd=shell_site,
                          input=json.dumps([argv for *_, argv in runs]), capture_output=True,
                          text=True, env=environment(), timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    failures = []
    for (where, command, cron, _), (status, said) in zip(runs, json.loads(
            done.stdout.splitlines()[-1])):
        if status != 0:
            failures.append(f"{where}: `{command}` failed ({status}): {said.strip()[-1500:]}")
        elif cron is not None and said.strip():  # cron mails whatever a job prints
            failures.append(f"{where}: the cron job `{cron}` printed {said.strip()!r}")
    assert not failures, "\n".join(failures)


# --- the rules fail what they should (the test can fail) -----------------------------------


def snippet_of(text: str, language: str = "sh", not_run: str | None = None) -> Snippet:
    return Snippet(ROOT / "README.md", 1, language, textwrap.dedent(text).strip(), not_run)


def test_an_unmarked_command_that_is_not_manage_py_is_refused():
    with pytest.raises(AssertionError, match="not a manage.py command: mark its block"):
        manage_argv("pip install django-kvcache", "page:1")


@pytest.mark.parametrize("text, reason, wanted", [
    ("pip install x\nmake test", "installs packages", "marked 'installs packages', but runs"),
    ("pip install x", "because", "no reason the test knows"),
    ("python manage.py migrate", "takes minutes", "marked 'takes minutes', but runs"),
])
def test_a_marked_block_must_be_what_its_reason_says(text, reason, wanted):
    with pytest.raises(AssertionError, match=wanted):
        check_not_run(snippet_of(text, not_run=reason))


def test_python_that_is_not_python_is_refused_and_settings_are_told_from_code():
    with pytest.raises(AssertionError, match="not Python"):
        python_kind(snippet_of("CACHES = {", "python"))
    assert python_kind(snippet_of('CACHES = {"default": {}}\nINSTALLED_APPS += ["x"]',
                                  "python")) == "settings"
    assert python_kind(snippet_of('"OPTIONS": {"REPLICAS": 2}', "python")) == "fragment"
    assert python_kind(snippet_of("cache.set('a', 1)", "python")) == "code"


def test_a_broken_settings_snippet_fails_with_the_cache_s_error():
    broken = snippet_of('CACHES = {"default": {"BACKEND": '
                        '"django_kvcache.backends.memcached.MemcachedCache", '
                        '"LOCATION": ["127.0.0.1:1"], "OPTIONS": {"IO_TIMOUT": 1}}}', "python")
    (problem,) = run_jobs(SETTINGS_RUNNER, [job(broken, "settings")])
    assert "IO_TIMOUT (did you mean IO_TIMEOUT?)" in problem


def test_commands_are_split_as_a_shell_reads_them():
    assert commands(textwrap.dedent('''
        # a comment
        python manage.py kvcache_stats --json   # trailing
        KVCACHE_X=1 \\
            .venv/bin/tox -e py311
        python manage.py shell -c "print(
            1)"
    ''')) == ["python manage.py kvcache_stats --json   # trailing",
             "KVCACHE_X=1 .venv/bin/tox -e py311",
             'python manage.py shell -c "print(\n    1)"']
    assert cron_command("*/15 * * * * cd /srv && venv/bin/python manage.py kvcache_cull -v 0") == (
        "cd /srv && venv/bin/python manage.py kvcache_cull -v 0")
    assert cron_command("python manage.py kvcache_cull") is None
