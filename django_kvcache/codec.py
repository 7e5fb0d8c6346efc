"""Cache values to and from ``(bytes, flags)``, shared by every kvcache backend.

The flag bits are the ones pymemcache's serde, pylibmc and python-memcached use, so a
value written by one of those clients is readable here and the other way round::

    0   raw bytes           (read only: we never write it)
    1   pickle              (``PickleSerializer``)
    2   int, decimal text   (written for ``int`` in the signed 64-bit range)
    4   long, decimal text  (read only)
    8   zlib-compressed, OR-ed with the type bit
    16  UTF-8 text          (read only)

A serializer or compressor of our own that others cannot read takes a bit above these
(``JSONSerializer`` uses 256, ``SignedPickleSerializer`` 512, zstd compression 1024,
encryption 2048 with the key id in bits 16-31: ``django_kvcache.encryption``) so no
client ever misreads it as plain pickle. Every codec reads values compressed with
zlib or zstd (when a zstd engine is installed), whatever it writes, so switching
COMPRESSOR never makes existing entries unreadable.

Integers are stored as plain decimal text so servers can ``incr`` them in place, also
in a cache with ENCRYPTION_KEYS: everything else is serialized, compressed, then
encrypted, and such a cache reads nothing unencrypted but those integers.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import math
import pickle
import zlib
from typing import Any, Callable, Mapping, Protocol

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_kvcache.encryption import FLAG_ENCRYPTED, Encryption, NotOpened, key_id_of, key_id_text
from django_kvcache.options import NotANumber, integer, read_number
from django_kvcache.savings import Savings, shared_savings
from django_kvcache.zstd import (
    AUTO,
    FLAG_ZSTD,
    DamagedFrame,
    INSTALL_HINT,
    LEVELS,
    DictionarySource,
    ZstdCompressor,
    plain_decompressor,
    require_zstd,
    zstd_engine,
)

logger = logging.getLogger(__name__)

FLAG_BYTES = 0
FLAG_PICKLE = 1 << 0
FLAG_INTEGER = 1 << 1
FLAG_LONG = 1 << 2
FLAG_ZLIB = 1 << 3
FLAG_TEXT = 1 << 4
FLAG_JSON = 1 << 8
FLAG_SIGNED_PICKLE = 1 << 9

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

DEFAULT_SERIALIZER = "django_kvcache.codec.PickleSerializer"
ZLIB_COMPRESSOR = "django_kvcache.codec.ZlibCompressor"
ZSTD_COMPRESSOR = "django_kvcache.zstd.ZstdCompressor"
DEFAULT_COMPRESS_MIN_LENGTH = 400  # below this, compression rarely saves enough to pay for itself
#: The share of a payload compression must take off for the value to be stored compressed
#: (docs/codec.rst, "Values compression does not pay for"), where memory is what a cache
#: lacks (memcached): on the benchmark's mixes everything but random bytes saves more (the
#: least, alphanumeric strings, 19 %), and a node kept as many entries as with any saving
#: kept. A backend whose bytes are cheaper sets its own (MySQLCache: a quarter).
DEFAULT_COMPRESS_MIN_SAVING = 0.1
DEFAULT_COMPRESS_LEVEL = 1  # zlib's fastest; most of the saving on typical HTML/JSON payloads


def default_compressor_path() -> str:
    """The COMPRESSOR of a cache whose OPTIONS name none: zstd where it is installed.

    On the benchmark's realistic values zstd level 3 (zstandard engine) compresses 3-4x
    faster than zlib level 1 to slightly fewer bytes, and reads them faster too
    (docs/codec.rst, "Choosing compression"). The backends' extras (``mysql``,
    ``memcached``) bring zstandard; Python 3.14's ``compression.zstd`` or backports.zstd
    serve where it is missing. Without any, zlib, with one logged warning and the
    ``kvcache.W002`` check saying what that costs.
    """
    if zstd_engine() is not None:
        return ZSTD_COMPRESSOR
    _warn_zlib_fallback()
    return ZLIB_COMPRESSOR


def zlib_fallback_options(options: Mapping[str, Any]) -> Mapping[str, Any]:
    """OPTIONS for zlib where zstd, the default, is missing. A COMPRESS_LEVEL without a
    COMPRESSOR is a zstd level (fast levels below 1, up to 22): clamped into zlib's 1-9,
    the same settings start on every host instead of failing where zstd is missing."""
    level = options.get("COMPRESS_LEVEL")
    if type(level) is not int or level not in LEVELS:
        return options  # absent, or wrong for both: ZlibCompressor says so
    return {**options, "COMPRESS_LEVEL": min(max(level, 1), 9)}


@functools.cache
def _warn_zlib_fallback() -> None:
    # Once per process: system checks run only under manage.py, not in a WSGI worker.
    logger.warning(
        "django-kvcache compresses with zlib: its default, zstd, is not installed "
        f"({INSTALL_HINT}). Entries written with zstd read as misses here. Set "
        "OPTIONS['COMPRESSOR'] to 'django_kvcache.codec.ZlibCompressor' to choose zlib "
        "and silence this."
    )


class CorruptValue(ValueError):
    """Stored bytes or flags that this codec cannot turn back into a value.

    ``reason`` names the kind of damage in a few words ("zstd not installed", "unknown
    flags", the decoder's error class), so that a log rate-limited per kind still shows
    the first entry of every kind.
    """

    def __init__(self, message: str, reason: str = "unreadable") -> None:
        super().__init__(message)
        self.reason = reason


class Serializer(Protocol):
    flag: int

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class Compressor(Protocol):
    flag: int

    def compress(self, data: bytes) -> bytes: ...

    def decompress(self, data: bytes) -> bytes: ...


class PickleSerializer:
    """Any picklable value. Only safe when nobody untrusted can write to the cache."""

    flag = FLAG_PICKLE

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.protocol = pickle.HIGHEST_PROTOCOL

    def dumps(self, value: Any) -> bytes:
        return pickle.dumps(value, self.protocol)

    #: pickle's own (no call of ours in between: every read of a pickled value).
    loads = staticmethod(pickle.loads)


class JSONSerializer:
    """JSON values only (dict, list, str, int, float, bool, None); never executes code.

    Tuples come back as lists and dict keys as strings, as with any JSON store.
    """

    flag = FLAG_JSON

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)

    def dumps(self, value: Any) -> bytes:
        return self.encoder.encode(value).encode()

    def loads(self, data: bytes) -> Any:
        return json.loads(data)


class SignedPickleSerializer(PickleSerializer):
    """Pickle with an HMAC-SHA256 signature checked before anything is unpickled.

    Whoever can write to a shared cache can run code in every process that unpickles
    from it; with a signature, only holders of the key can. The key is
    ``OPTIONS["SIGNING_KEY"]``, else ``SECRET_KEY`` (and ``SECRET_KEY_FALLBACKS`` are
    accepted when reading, so a key rotation does not empty the cache). An unsigned or
    tampered entry raises, which the backends report as a logged miss.
    """

    flag = FLAG_SIGNED_PICKLE
    salt = b"django_kvcache.codec.SignedPickleSerializer"
    digest_size = hashlib.sha256().digest_size

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        secrets = self._secrets(options or {})
        # Derive per-purpose keys once, so a leaked cache key is not the SECRET_KEY.
        self.keys = [hashlib.sha256(self.salt + secret).digest() for secret in secrets]

    @staticmethod
    def _secrets(options: Mapping[str, Any]) -> list[bytes]:
        if "SIGNING_KEY" in options:
            secrets = [options["SIGNING_KEY"]]
        else:
            from django.conf import settings

            secrets = [settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", [])]
        if not secrets[0] or not all(isinstance(s, (str, bytes)) for s in secrets):
            raise ImproperlyConfigured(
                "SignedPickleSerializer needs OPTIONS['SIGNING_KEY'] or SECRET_KEY "
                "(a non-empty str or bytes)"
            )
        return [s.encode() if isinstance(s, str) else s for s in secrets]

    def dumps(self, value: Any) -> bytes:
        data = super().dumps(value)
        return hmac.digest(self.keys[0], data, "sha256") + data

    def loads(self, data: bytes) -> Any:
        signature, payload = data[: self.digest_size], data[self.digest_size :]
        for key in self.keys:
            if hmac.compare_digest(signature, hmac.digest(key, payload, "sha256")):
                return super().loads(payload)
        raise CorruptValue("bad signature: entry not written with this cache's key",
                           "bad signature")


class ZlibCompressor:
    flag = FLAG_ZLIB
    #: zlib spends ~50 µs failing to shrink 1.5 KB of random bytes, ~8x the sample check
    #: (``looks_compressible``), so the codec screens payloads before calling it.
    screens_random = True

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        level = (options or {}).get("COMPRESS_LEVEL", DEFAULT_COMPRESS_LEVEL)
        if type(level) is not int or not -1 <= level <= 9:
            raise ImproperlyConfigured(
                f"OPTIONS['COMPRESS_LEVEL'] must be an integer from -1 to 9 for zlib, got {level!r}"
            )
        self.level = level

    def compress(self, data: bytes) -> bytes:
        # One-shot: measured 5-8 % cheaper than a compressobj sized to the data (cheaper
        # on another machine, not on this one) and no object per call.
        return zlib.compress(data, self.level)

    def decompress(self, data: bytes) -> bytes:
        return zlib.decompress(data)


#: How much of a payload ``looks_compressible`` inspects.
SAMPLE_SIZE = 256


def looks_compressible(data: bytes) -> bool:
    """False when a sample of ``data`` has as many distinct bytes as random data would.

    Random or already-compressed bytes (images, archives, tokens) come out of zlib no
    smaller, and trying costs ~10x more than this check; a sample of typical cache
    payloads (pickled text, dicts, HTML, JSON) uses far fewer distinct byte values.
    """
    sample = data[:SAMPLE_SIZE]
    # n random bytes hold 256 * (1 - e^(-n/256)) distinct values on average.
    random_distinct = 256 * (1 - math.exp(-len(sample) / 256))
    return len(set(sample)) < 0.85 * random_distinct


def min_saving_option(options: Mapping[str, Any], default: float) -> float:
    """``OPTIONS['COMPRESS_MIN_SAVING']``: a share of the bytes, from 0 (any saving) to below 1."""
    value = options.get("COMPRESS_MIN_SAVING", default)
    try:
        share = read_number(value, whole=False)
    except NotANumber:
        share = None
    if share is None or not 0 <= share < 1:
        raise ImproperlyConfigured(
            "OPTIONS['COMPRESS_MIN_SAVING'] must be a number from 0 (keep any saving) to "
            f"below 1 (the share of a value's bytes compression must take off), got {value!r}"
        )
    return share


def _import_class(options: Mapping[str, Any], option: str, default: str | None) -> Any:
    path = options.get(option, default)
    if path is None:
        return None
    if not isinstance(path, str):
        raise ImproperlyConfigured(f"OPTIONS[{option!r}] must be a dotted path, got {path!r}")
    try:
        return import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"OPTIONS[{option!r}]: cannot import {path!r}: {exc}") from exc


#: Builds the source of ``COMPRESS_DICTIONARY: "auto"`` from a cache's (checked) OPTIONS.
StoredDictionaries = Callable[[Mapping[str, Any]], DictionarySource]


class Codec:
    """Turns values into ``(bytes, flags)`` and back.

    ``encode`` never fails on a picklable value; ``decode`` raises ``CorruptValue`` for
    anything it cannot read, which the backends report as a logged miss.
    """

    def __init__(
        self,
        serializer: Serializer,
        compressor: Compressor | None = None,
        compress_min_length: int = DEFAULT_COMPRESS_MIN_LENGTH,
        encryption: Encryption | None = None,
        min_saving: float = DEFAULT_COMPRESS_MIN_SAVING,
        savings: Savings | None = None,
    ) -> None:
        self.serializer = serializer
        #: Seals what would be stored (ENCRYPTION_KEYS); None: entries are stored as is.
        self.encryption = encryption
        self.compressor = compressor
        self.compress_min_length = compress_min_length
        #: Compressed forms are kept when they take at least this share of the bytes off.
        self.min_saving = min_saving
        #: What compression saved per kind of value: which kinds are worth trying.
        self.savings = savings if savings is not None else Savings(min_saving)
        # A compressor that fails fast on random bytes (zstd) is not worth screening for.
        self.screens_random = getattr(compressor, "screens_random", True)
        # Entries written with another compressor (or before compression was turned off)
        # must still read back: every compressor we know decodes, by its flag bit.
        self.decompressors: dict[int, Callable[[bytes], bytes]] = {FLAG_ZLIB: zlib.decompress}
        plain_zstd = plain_decompressor()
        if plain_zstd is not None:
            self.decompressors[FLAG_ZSTD] = plain_zstd
        if compressor is not None:
            self.decompressors[compressor.flag] = compressor.decompress
        self.compressed_mask = 0
        for flag in self.decompressors:
            self.compressed_mask |= flag

    @classmethod
    def from_options(
        cls,
        options: Mapping[str, Any],
        default_min_length: int = DEFAULT_COMPRESS_MIN_LENGTH,
        default_compressor: str | None = None,
        stored_dictionaries: StoredDictionaries | None = None,
        encryption_scope: str = "",
        default_min_saving: float = DEFAULT_COMPRESS_MIN_SAVING,
    ) -> Codec:
        """Build from a cache's OPTIONS: SERIALIZER, COMPRESSOR (None = off),
        COMPRESS_MIN_LENGTH, COMPRESS_MIN_SAVING, COMPRESS_LEVEL, COMPRESS_DICTIONARY and
        ENCRYPTION_KEYS.
        ``default_min_length``, ``default_min_saving`` and ``default_compressor`` apply
        when the option is absent: each backend's own (``default_compressor_path()`` when
        not given).
        ``stored_dictionaries`` is given by a backend that keeps its dictionaries itself
        (``COMPRESS_DICTIONARY: "auto"``); ``encryption_scope`` names where the cache's
        entries live (its table), bound into every encrypted entry."""
        encryption = Encryption.from_options(options, encryption_scope)
        min_length = integer(options, "COMPRESS_MIN_LENGTH", default_min_length, 0)
        min_saving = min_saving_option(options, default_min_saving)
        dictionary_setting = options.get("COMPRESS_DICTIONARY")
        if dictionary_setting:
            require_zstd("OPTIONS['COMPRESS_DICTIONARY']")
        if default_compressor is None and "COMPRESSOR" not in options:
            default_compressor = default_compressor_path()  # only then: it may warn
            if default_compressor == ZLIB_COMPRESSOR:
                options = zlib_fallback_options(options)
        compressor_class = _import_class(options, "COMPRESSOR", default_compressor)
        uses_dictionaries = isinstance(compressor_class, type) and issubclass(
            compressor_class, ZstdCompressor)
        if dictionary_setting and not uses_dictionaries:
            raise ImproperlyConfigured(
                "OPTIONS['COMPRESS_DICTIONARY'] needs a compressor that uses dictionaries: "
                "set OPTIONS['COMPRESSOR'] to 'django_kvcache.zstd.ZstdCompressor'"
            )
        if dictionary_setting == AUTO and stored_dictionaries is not None:
            compressor = compressor_class(options, stored_dictionaries(options))
        elif compressor_class is not None:
            compressor = compressor_class(options)
        else:
            compressor = None
        serializer_class = _import_class(options, "SERIALIZER", DEFAULT_SERIALIZER)
        if serializer_class is None:  # unlike COMPRESSOR, there is no "off"
            raise ImproperlyConfigured("OPTIONS['SERIALIZER'] must be a dotted path, got None")
        # Every cache instance of these settings learns into one record (Django builds
        # one instance per thread and per ASGI request).
        setting = (serializer_class, compressor_class, options.get("COMPRESS_LEVEL"),
                   repr(dictionary_setting))
        return cls(
            serializer=serializer_class(options),
            compressor=compressor,
            compress_min_length=min_length,
            encryption=encryption,
            min_saving=min_saving,
            savings=shared_savings(setting, min_saving),
        )

    def encode(self, value: Any, key: str | None = None) -> tuple[bytes, int]:
        """``value`` as stored under ``key`` (the stored key: with ENCRYPTION_KEYS the
        entry is bound to it, and ``key`` is required)."""
        data, flags, _ = self.encode_measured(value, key)
        return data, flags

    def encode_measured(self, value: Any, key: str | None = None) -> tuple[bytes, int, int]:
        """``encode`` plus the number of bytes compression saved (0 when uncompressed)."""
        # `type(...) is int` keeps bools (an int subclass) and int subclasses pickled.
        if type(value) is int and INT64_MIN <= value <= INT64_MAX:
            return b"%d" % value, FLAG_INTEGER, 0  # plain, encrypted or not: incr needs it
        data, flags, saved = self.payload(value)
        if self.encryption is None:
            return data, flags, saved
        if key is None:
            raise TypeError("an encrypting codec binds each entry to its key: pass the stored key")
        data, flags = self.encryption.seal(data, flags, key)
        return data, flags, saved

    def payload(self, value: Any) -> tuple[bytes, int, int]:
        """``value`` serialized, and compressed where that pays: bytes, flags, bytes saved.

        Compressed only when that takes at least ``min_saving`` of the bytes off; the
        kinds of value (type, size class) that do not save that much on average are not
        even tried but for a sample (``django_kvcache.savings``)."""
        data = self.serializer.dumps(value)
        flags = self.serializer.flag
        size = len(data)
        if self.compressor is None or size < self.compress_min_length:
            return data, flags, 0
        kind = (type(value), size.bit_length())
        if not self.savings.worth_trying(kind):
            return data, flags, 0
        if self.screens_random and not looks_compressible(data):
            self.savings.record(kind, 0.0)
            return data, flags, 0
        compressed = self.compressor.compress(data)
        saved = size - len(compressed)
        self.savings.record(kind, saved / size)
        if saved > 0 and saved >= size * self.min_saving:
            return compressed, flags | self.compressor.flag, saved
        return data, flags, 0

    def opened(self, data: bytes, flags: int, key: str | None = None) -> tuple[bytes, int]:
        """A stored entry's payload and flags, without its encryption; the payload of an
        entry that needs none is itself. Raises ``CorruptValue`` for an entry that fails
        authentication, is encrypted with no key here, or (with ENCRYPTION_KEYS) is
        stored unencrypted — integers apart."""
        if self.encryption is None:
            if flags & FLAG_ENCRYPTED:
                key_id = key_id_text(key_id_of(flags))
                raise CorruptValue(  # the reason without the id, which a forger chooses
                    f"encrypted (key id {key_id}), and this cache has no ENCRYPTION_KEYS",
                    "encrypted",
                )
            return data, flags
        if flags & FLAG_ENCRYPTED:
            if key is None:
                raise TypeError("an encrypting codec binds each entry to its key: pass the stored key")
            try:
                return self.encryption.open(data, flags, key)
            except NotOpened as exc:
                raise CorruptValue(str(exc), exc.reason) from None
        if flags == FLAG_INTEGER or flags == FLAG_LONG:
            return data, flags
        raise CorruptValue(
            "stored unencrypted in a cache with ENCRYPTION_KEYS (written before they were "
            "set, by a cache without them, or forged): not deserialized",
            "not encrypted",
        )

    def decompressed(self, data: bytes, flags: int) -> tuple[bytes, int]:
        """A stored entry's serialized bytes and flags, without its compression."""
        compressed = flags & self.compressed_mask
        if not compressed:
            return data, flags
        # A KeyError (two compression bits at once) is a corrupt entry like any other.
        return self.decompressors[compressed](data), flags ^ compressed

    def decode(self, data: bytes, flags: int, key: str | None = None) -> Any:
        """The value of an entry stored under ``key`` (needed with ENCRYPTION_KEYS)."""
        if flags & FLAG_ENCRYPTED or self.encryption is not None:
            data, flags = self.opened(data, flags, key)  # before anything reads the bytes
        try:
            if flags == FLAG_INTEGER or flags == FLAG_LONG:
                return int(data)
            if flags & self.compressed_mask:
                data, flags = self.decompressed(data, flags)
            if flags == self.serializer.flag:
                return self.serializer.loads(data)
            if flags == FLAG_BYTES:
                return bytes(data)
            if flags == FLAG_TEXT:
                return bytes(data).decode()
        except CorruptValue:
            raise  # a serializer's own words (a bad signature)
        except DamagedFrame as exc:  # our zstd layer's words: a dictionary id, the damage
            failed, words = _error_name(exc), f"{_error_name(exc)}: {exc}"
        except Exception as exc:
            failed = words = _error_name(exc)
        else:
            failed = words = None
        if failed is not None:
            # Another decoder's error is named by its class only, and raised outside the
            # handler so nothing chains it: the messages of int(), bytes.decode() and some
            # decoders quote the stored bytes, and this error ends in a log line.
            raise CorruptValue(f"cannot decode {len(data)} bytes with flags {flags}: {words}",
                               failed)
        if flags & FLAG_ZSTD and FLAG_ZSTD not in self.decompressors:
            raise CorruptValue(
                f"compressed with zstd, which is not installed here ({INSTALL_HINT})",
                "zstd not installed",
            )
        raise CorruptValue(
            f"unknown flags {flags} for serializer {type(self.serializer).__name__}",
            "unknown flags",
        )


def _error_name(exc: Exception) -> str:
    """``ValueError``, ``zlib.error``, ``_pickle.UnpicklingError``: which decoder failed."""
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"
