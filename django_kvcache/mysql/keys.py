"""Cache keys as stored in the ``cache_key`` column, and ``LIKE`` patterns over them.

The column holds 250 characters (``VARCHAR(250)`` in utf8mb4 is 1000 bytes, the largest
index key MyISAM accepts). Longer keys are stored in a digest form of exactly 250
characters: a readable head, a marker and the SHA-256 of the whole key. A key that is
exactly 250 characters long and has the marker in the digest position is digested too,
so a stored digest form can never be the verbatim form of another key.
"""
from __future__ import annotations

import hashlib

MAX_KEY_LENGTH = 250
DIGEST_MARKER = "#sha256:"
DIGEST_HEAD_LENGTH = MAX_KEY_LENGTH - len(DIGEST_MARKER) - 64
LIKE_ESCAPE = "!"  # a plain character: no backslash rules to remember in either server


def stored_key(key: str) -> str:
    """The column value for ``key`` (a full cache key, as ``make_key`` returns it)."""
    if len(key) < MAX_KEY_LENGTH or (
        len(key) == MAX_KEY_LENGTH
        and key[DIGEST_HEAD_LENGTH : DIGEST_HEAD_LENGTH + len(DIGEST_MARKER)] != DIGEST_MARKER
    ):
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return key[:DIGEST_HEAD_LENGTH] + DIGEST_MARKER + digest


def like_prefix(prefix: str) -> str:
    """A ``LIKE … ESCAPE '!'`` pattern matching every string that starts with ``prefix``."""
    escaped = (
        prefix.replace(LIKE_ESCAPE, LIKE_ESCAPE * 2)
        .replace("%", LIKE_ESCAPE + "%")
        .replace("_", LIKE_ESCAPE + "_")
    )
    return escaped + "%"
