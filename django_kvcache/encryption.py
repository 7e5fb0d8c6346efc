"""Encrypted cache entries: AES-256-GCM over what the codec stores (``ENCRYPTION_KEYS``).

The codec serializes and compresses a value as it always does; with
``OPTIONS["ENCRYPTION_KEYS"]`` it then seals those bytes::

    stored bytes  nonce (12 random bytes) + AES-256-GCM ciphertext + tag (16 bytes)
    stored flags  FLAG_ENCRYPTED | key id << 16 | the payload's own flags

so an entry costs 28 bytes more than without encryption, and the key id (16 bits derived
from the key, never the key) rides in the flags: a reader picks the key without trying
each, and ``kvcache_rotate_key`` finds the rows written with an older key by their
``flags`` column alone. The associated data binds each ciphertext to where it belongs:
the cache's *scope* (a MySQLCache's table, or memcached), the entry's flags and its
stored key. A ciphertext copied under another key, into another table or backend, or
with its flags edited (another serializer, another compression) fails authentication
and is never deserialized.

Keys: the first of ``ENCRYPTION_KEYS`` encrypts, every one decrypts, so a key rotates
without a flush (prepend the new key, re-encrypt or let entries expire, drop the old one).
A key is text (``str``: derived with HKDF-SHA256, never used raw) or exactly 32 random
bytes. Nothing here logs or repeats a key: messages name keys by position and key id.

``cryptography`` (the ``encrypt`` extra) is imported only by a cache that has keys.
"""
from __future__ import annotations

import functools
import hmac
import os
from typing import Any, Mapping, Sequence

from django.core.exceptions import ImproperlyConfigured

#: The flag bit of an encrypted entry (beside the codec's own: 1024 is zstd).
FLAG_ENCRYPTED = 1 << 11
#: The key id's place in the flags: bits 16 to 31, free in every client's flag layout.
KEY_ID_SHIFT = 16
KEY_ID_MASK = 0xFFFF << KEY_ID_SHIFT
NONCE_BYTES = 12
#: The bytes memcached's incr lets a value start with and still read it as a number
#: (strtoull's white space, sign and digits: "7\n…" counts as 7). A nonce never starts
#: with one, so incr on an encrypted text raises TypeError on memcached, as on MySQL
#: (with any first byte, about one encrypted value in 870 read as a number: incr replaced
#: the entry with it and returned it). The first byte keeps 238 of its 256 values (95.9
#: random bits of the 96).
NUMBER_START = frozenset(b" \t\n\v\f\r+-0123456789")
TAG_BYTES = 16
#: What encryption adds to each stored value.
OVERHEAD = NONCE_BYTES + TAG_BYTES
#: Values up to this size are sliced (copied) to be decrypted, larger ones viewed.
COPY_LIMIT = 16 * 1024
#: AES-256: a key given as bytes is exactly this long.
KEY_BYTES = 32
#: A key given as text shorter than this, or with fewer distinct characters than
#: MIN_DISTINCT, is refused by the ``kvcache.E011`` check: ``secrets.token_urlsafe(32)``
#: gives 43 characters.
MIN_TEXT_LENGTH = 32
MIN_DISTINCT = 10
#: HKDF's fixed salt and context for keys given as text (RFC 5869: a salt is optional for
#: input that is already a secret; the info string separates this use from any other).
HKDF_SALT = b"django-kvcache"
HKDF_INFO = b"django-kvcache ENCRYPTION_KEYS AES-256-GCM v1"
#: Versions the associated data: a future layout cannot be confused with this one.
ASSOCIATED_DATA_HEAD = b"django-kvcache/1"
INSTALL_HINT = "install the cryptography package (pip install 'django-kvcache[encrypt]')"
OPTION = "OPTIONS['ENCRYPTION_KEYS']"


def new_nonce() -> bytes:
    """A random nonce, fresh per value (never repeats under one key), whose first byte is
    not in NUMBER_START."""
    while True:
        nonce = os.urandom(NONCE_BYTES)
        if nonce[0] not in NUMBER_START:
            return nonce


class NotOpened(ValueError):
    """An entry this cache's keys cannot open. ``reason`` names the kind and the key id,
    for the rate-limited log of unreadable entries."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def key_id_text(key_id: int) -> str:
    """How messages, the docs and ``kvcache_rotate_key`` write a key id: ``3fa2``."""
    return f"{key_id:04x}"


def key_id_of(flags: int) -> int:
    return (flags & KEY_ID_MASK) >> KEY_ID_SHIFT


def configured_keys(options: Mapping[str, Any]) -> list[str | bytes] | None:
    """OPTIONS['ENCRYPTION_KEYS'] checked for shape (never echoing a key); None when
    encryption is off (absent, or None)."""
    keys = options.get("ENCRYPTION_KEYS")
    if keys is None:
        return None
    if not isinstance(keys, (list, tuple)):
        raise ImproperlyConfigured(
            f"{OPTION} must be a list of keys (the first encrypts, every one decrypts), "
            f"got a {type(keys).__name__}"
        )
    if not keys:
        raise ImproperlyConfigured(
            f"{OPTION} is empty: give at least one key, or None to store entries unencrypted"
        )
    for index, key in enumerate(keys):
        if isinstance(key, str):
            if not key:
                raise ImproperlyConfigured(f"{OPTION}[{index}] is an empty string")
        elif isinstance(key, (bytes, bytearray)):
            if len(key) != KEY_BYTES:
                raise ImproperlyConfigured(
                    f"{OPTION}[{index}] is {len(key)} bytes: a key given as bytes must be "
                    f"exactly {KEY_BYTES} random bytes (give text to have it derived)"
                )
        else:
            raise ImproperlyConfigured(
                f"{OPTION}[{index}] must be a str or {KEY_BYTES} bytes, got a "
                f"{type(key).__name__}"
            )
    return [bytes(key) if isinstance(key, bytearray) else key for key in keys]


def weak_key(key: Any) -> str | None:
    """Why ``key`` is too weak to encrypt with (for the ``kvcache.E011`` check), or None.
    Never repeats the key."""
    if isinstance(key, str):
        if len(key) < MIN_TEXT_LENGTH:
            return f"is {len(key)} characters long, fewer than {MIN_TEXT_LENGTH}"
        if len(set(key)) < MIN_DISTINCT:
            return f"uses only {len(set(key))} distinct characters"
    elif isinstance(key, (bytes, bytearray)) and len(set(key)) < MIN_DISTINCT:
        return f"uses only {len(set(key))} distinct byte values: not random bytes"
    return None


def require_cryptography() -> Any:
    """The ``cryptography`` AEAD module, or ImproperlyConfigured saying how to get it."""
    try:
        from cryptography.hazmat.primitives.ciphers import aead
    except ImportError as exc:
        raise ImproperlyConfigured(f"{OPTION} needs cryptography: {INSTALL_HINT}") from exc
    return aead


@functools.lru_cache(maxsize=64)
def _cipher(key: str | bytes) -> tuple[int, Any]:
    """``(key id, AESGCM)`` of one configured key. Cached process-wide: Django builds a
    cache instance per thread and per ASGI request, and HKDF would run for each."""
    aead = require_cryptography()
    if isinstance(key, str):
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        material = HKDF(
            algorithm=hashes.SHA256(), length=KEY_BYTES, salt=HKDF_SALT, info=HKDF_INFO
        ).derive(key.encode())
    else:
        material = key
    key_id = int.from_bytes(hmac.digest(material, b"django-kvcache key id", "sha256")[:2], "big")
    return key_id, aead.AESGCM(material)


def key_ids(options: Mapping[str, Any]) -> list[int]:
    """The key ids of a cache's ENCRYPTION_KEYS, in order (empty when it has none)."""
    keys = configured_keys(options)
    return [] if keys is None else [_cipher(key)[0] for key in keys]


class Encryption:
    """Seals and opens a cache's stored bytes under its ENCRYPTION_KEYS (module docstring).

    ``scope`` names where the cache's entries live ("mysql table kvcache", "memcached"):
    it is part of every entry's associated data.
    """

    def __init__(self, keys: Sequence[str | bytes], scope: str) -> None:
        ciphers = [_cipher(key) for key in keys]
        self.by_id: dict[int, Any] = {}
        for index, (key_id, cipher) in enumerate(ciphers):
            if key_id in self.by_id:
                first = [i for i, (other, _) in enumerate(ciphers) if other == key_id][0]
                raise ImproperlyConfigured(
                    f"{OPTION}[{index}] has the key id of {OPTION}[{first}] "
                    f"({key_id_text(key_id)}): the same key twice, or a 1 in 65,536 "
                    "coincidence; generate another key"
                )
            self.by_id[key_id] = cipher
        from cryptography.exceptions import InvalidTag

        #: What decrypting an entry that is not authentic raises (ValueError: too short
        #: to hold a nonce). Kept here: an import per read costs a third of a decrypt.
        self.not_authentic = (InvalidTag, ValueError)
        self.writer_id, self.writer = ciphers[0]
        self.key_ids = [key_id for key_id, _ in ciphers]
        self.writer_flags = FLAG_ENCRYPTED | self.writer_id << KEY_ID_SHIFT
        scope_bytes = scope.encode()
        self.head = ASSOCIATED_DATA_HEAD + len(scope_bytes).to_bytes(2, "big") + scope_bytes

    @classmethod
    def from_options(cls, options: Mapping[str, Any], scope: str) -> Encryption | None:
        keys = configured_keys(options)
        return None if keys is None else cls(keys, scope)

    def associated_data(self, flags: int, key: str) -> bytes:
        """What a ciphertext is bound to: the scope, the stored flags and the stored key
        (last, so no two (flags, key) pairs give the same bytes)."""
        return self.head + flags.to_bytes(4, "big") + key.encode("utf-8", "surrogatepass")

    def seal(self, data: bytes, flags: int, key: str) -> tuple[bytes, int]:
        """The payload ``data`` (with its codec ``flags``) as stored under ``key``."""
        flags |= self.writer_flags
        nonce = new_nonce()
        return nonce + self.writer.encrypt(nonce, data, self.associated_data(flags, key)), flags

    def open(self, data: bytes, flags: int, key: str) -> tuple[bytes, int]:
        """The payload and its codec flags of an entry stored under ``key``; raises
        ``NotOpened`` for anything that is not this cache's, as written."""
        key_id = (flags & KEY_ID_MASK) >> KEY_ID_SHIFT
        cipher = self.by_id.get(key_id)
        if cipher is None:
            raise NotOpened(
                f"encrypted with key id {key_id_text(key_id)}, which is not in "
                f"ENCRYPTION_KEYS (key ids {', '.join(map(key_id_text, self.key_ids))})",
                # Not the id itself: a forged entry chooses it, and each reason is an
                # episode of the log of its own (an authentic one's id is configured).
                "unknown key id",
            )
        # A slice copies the bytes: cheaper than a memoryview for small values (1.0
        # against 1.3 µs at 1.5 KB), far dearer for large ones (1.1 ms against 0.1 at 1 MB).
        body = data[NONCE_BYTES:] if len(data) <= COPY_LIMIT else memoryview(data)[NONCE_BYTES:]
        try:
            payload = cipher.decrypt(data[:NONCE_BYTES], body, self.associated_data(flags, key))
        except self.not_authentic:
            raise NotOpened(
                f"failed authentication under key id {key_id_text(key_id)}: altered, "
                "copied from another key, cache or table, or not written by this cache",
                f"not authentic, key id {key_id_text(key_id)}",
            ) from None
        return payload, flags & ~(FLAG_ENCRYPTED | KEY_ID_MASK)

    def resealed(self, data: bytes, flags: int, key: str) -> tuple[bytes, int] | None:
        """An encrypted entry sealed again with the first key; None when it already is.
        Raises ``NotOpened`` as :meth:`open`."""
        if flags & KEY_ID_MASK == self.writer_flags & KEY_ID_MASK:
            return None
        payload, payload_flags = self.open(data, flags, key)
        return self.seal(payload, payload_flags, key)
