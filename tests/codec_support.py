"""Values and entries for the tests of what the codec stores: token-like strings that
compression does not shrink enough to store compressed, and entries written by main's
code before that rule."""
from __future__ import annotations

import asyncio
import base64
import random
import string

from django_kvcache.codec import FLAG_PICKLE, FLAG_ZLIB
from django_kvcache.zstd import FLAG_ZSTD


def alphanumeric(size: int, seed: int = 1) -> str:
    """A token-like string: zstd takes about a fifth off, under COMPRESS_MIN_SAVING."""
    return "".join(random.Random(seed).choices(string.ascii_letters + string.digits, k=size))


#: Entries as main's code wrote them (f3b3e2f, before values were kept plain when
#: compression saves less than COMPRESS_MIN_SAVING): alphanumeric(600, 40) compressed by
#: zstd (15 % smaller) and by zlib (18 %). Today's code stores that value as it is.
MAIN_TOKEN_ZSTD = base64.b64decode(
    "KLUv/WBqARUQAFamfiYgRaYHAUgm0FoRFEHRWNtCHWylqobJKfjV9AbRKnsBCAEIK+eBD3YAcwBzANbXardwFjJE"
    "tUi7hi68EmgThpeVS+4V8xIuO1qxQ6Sewmd5e5wiY+BrGz2xyhPd4KKF5kw5oaAgChNdyXH4FEd+VYzFZQYldJSa"
    "zDr3R6E4ENiip+q1R1Im4GQ2XqMNhG1TCQlJwxcaRphAAwMEnA8QCCgAYECdc04BrYow+31dSJ6gjfdDjH+B7gSC"
    "pG3h/OznKjMnCJ8I8bSxRqkSudZkPW7nDbsvSK2EGc9Nr7jRuAfd2Djd/gqy2UYixq7GnqSjSGI15akEMZ/j9VQR"
    "gmXIZ/QdZvqseK+G5TtF2Qjm0L+ZgWkELklBHyKC5e6HtzrilfgMDY2vNfD85pa9MEcYiOS9VQprir1WkW61FjPX"
    "3H1YUpPtBKcHa0uVEPE4jlHPmlOyS5Nz0QARYwn0HPtDI7dYjm8h9moSJTlZk6Z4LC5dikXPFEZdrsND0sIKWYf1"
    "ZhWbnGh3UNIxBQEIvGzhE9/vSke2NZ2zvql6/HIIx2w4aI44MbWQTpynYytsxLRpnh7AB8fJqs+U7rDD8zGcpcp+"
    "G92/TM/eacgYDklNu4BKt3IwCDWGMVIEpSe0pU0kwtyLDIIOq8arTf7swc5Hnq7pe/6QCv7Ky9VIAQACKAI="
)
MAIN_TOKEN_ZLIB = base64.b64decode(
    "eAEdxkeum0AAANAoUq4TUQyYJaYz9OaBTQQMMHRswJTVP0Ry30R5q/f148+v79/+g/BfRCp/cy7+UI+cbmxL5DoT"
    "c42SUjVFrNHUdmsq8vQoIGCCyqwJsb6zG/PWDFgW7QGDOuxz6XZ7wKHl3G6LUQ+nS5DWGcZs0RIrXE5XUAvCmiWb"
    "yRlQ7EENdCPPua438jDeTMnr8orhX+FknvqNYlJpSJ3mRE82s2k6xPrH2EeAGyvEpVCxSyZpglG2oHhMkWousiSZ"
    "cnRNqMwq31nS+fSHa/E7IfC4yxi2iD1qr3ohO8bhJuiKvkn0IM2fAYpF8uhBowXncrbuOpBkb3evs8yS/dNRsGJm"
    "dDr5OItjACFSCFklwq6lFs3ZdUIXZ3cgI8JgJpZ20Gs0ZKgLo6foSlX3nLGIK+Z1JijF0yYEkbKu7C4FsKltSmkW"
    "3F3XBaXHVK+WoKStT03ycYZgbqzVW01Jm+3ROwZtj2TyTcJjd/zmbFPPPD9x3l40JpGOCWTXaUEmpLkZdXJoZAIQ"
    "bra2SvgjAmdla9Cbn6LovOwmqxRPN3tEP9TyzXr5/V77g3qzFbXi307cRgCxO0af3aYH57hwRFihqQI8AZ5/Hncz"
    "8nwls12fUMDFV4x68SQ0nzEo8yeDBU1J9ABxvkPI27kXibvsv3/+BZACzys="
)
MAIN_ENTRIES = [(MAIN_TOKEN_ZSTD, FLAG_PICKLE | FLAG_ZSTD), (MAIN_TOKEN_ZLIB, FLAG_PICKLE | FLAG_ZLIB)]
#: The value of MAIN_ENTRIES.
MAIN_TOKEN = alphanumeric(600, 40)


def html(rows: int = 100) -> str:
    """Rendered-template-like text: compression takes most of it off."""
    return "".join(f"<li class='item' data-id='{row}'>entry {row}</li>\n" for row in range(rows))


def assert_read_back(cache, values: dict) -> None:
    """Each of ``values`` read back by every read of both APIs (``get_many`` with a
    missing key among them)."""
    assert {key: cache.get(key) for key in values} == values
    assert cache.get_many([*values, "never-set"]) == values
    assert asyncio.run(cache.aget_many(list(values))) == values
    assert {key: asyncio.run(cache.aget(key)) for key in values} == values
