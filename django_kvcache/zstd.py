"""zstd compression of cache values, optionally with trained dictionaries.

``compression.zstd`` is in the standard library from Python 3.14; before that the
``backports.zstd`` package (``pip install "django-kvcache[zstd]"``) has the same API.

A compressor is kept per thread and setting and reused: creating one costs more than
compressing a 1 KB value (a one-shot ``zstd.compress`` is 3-4x slower at that size).
Decompression has no such reuse in this API: every value gets a new decompression
context, ~8 µs on a VM, most of it the CPUID instructions zstd runs to pick its code
path (each one traps to the hypervisor). So zstd reads values under ~3 KB a few µs
slower than zlib and larger ones faster, and writes every size 2-4x faster.

A dictionary trained on the site's own values (``manage.py kvcache_train_dictionary``)
makes small values compress much better. zstd writes the dictionary's id into every
frame, so each value names the dictionary it needs: list old dictionaries after the
current one in ``COMPRESS_DICTIONARY`` and entries written with them stay readable; an
entry whose dictionary is not listed is a logged miss, never a wrong value.
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Mapping

from django.core.exceptions import ImproperlyConfigured

#: The flag bit of zstd-compressed values. No other memcached client reads it, so none
#: can mistake such a value for plain pickle.
FLAG_ZSTD = 1 << 10
DEFAULT_LEVEL = 3
#: 16 KB: the size where the gain on 0.5-4 KB values levels off.
DEFAULT_DICTIONARY_SIZE = 16 * 1024


@functools.cache
def zstd_module() -> ModuleType | None:
    """The zstd API of the standard library (3.14+) or of backports.zstd; None if neither.

    Cached: a failed import searches sys.path again on every call (~35 µs), and every
    cache instance asks (Django builds one per thread and per ASGI request)."""
    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        try:
            from backports import zstd  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    return zstd


def require_zstd(what: str) -> ModuleType:
    zstd = zstd_module()
    if zstd is None:
        raise ImproperlyConfigured(
            f"{what} needs zstd: Python 3.14 or later, or the backports.zstd package "
            "(pip install 'django-kvcache[zstd]')"
        )
    return zstd


def dictionary_paths(value: Any) -> list[str]:
    """OPTIONS['COMPRESS_DICTIONARY']: one path, or a list whose first entry is written."""
    paths = [value] if isinstance(value, (str, Path)) else value
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, Path)) for p in paths):
        raise ImproperlyConfigured(
            "OPTIONS['COMPRESS_DICTIONARY'] must be a file path or a list of file paths, "
            f"got {value!r}"
        )
    return [str(path) for path in paths]


def load_dictionaries(paths: list[str]) -> list[Any]:
    zstd = require_zstd("OPTIONS['COMPRESS_DICTIONARY']")
    dictionaries = []
    for path in paths:
        try:
            stat = Path(path).stat()
            version = (stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)
            dictionaries.append(_loaded_dictionary(path, version))
        except (OSError, zstd.ZstdError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"OPTIONS['COMPRESS_DICTIONARY']: cannot load {path!r}: {exc}"
            ) from exc
    return dictionaries


@functools.lru_cache(maxsize=64)
def _loaded_dictionary(path: str, version: tuple[int, ...]) -> Any:
    """One ZstdDict per file version: Django builds a cache instance per thread and per
    async context (each ASGI request), and each would otherwise read the file again and
    give the compressor cache below a new key. ``version`` (inode, mtime, ctime, size)
    changes when the file is replaced or rewritten, even within one mtime tick."""
    zstd = require_zstd("OPTIONS['COMPRESS_DICTIONARY']")
    return zstd.ZstdDict(Path(path).read_bytes())


#: Per thread, the compressors by (level, dictionary): creating one costs ~11 µs here
#: (a one-shot ``zstd.compress`` is 3-4x a reused compressor at 1 KB), too much to pay
#: in every cache instance, and there is one per ASGI request.
_compressors = threading.local()
#: A process uses one or two settings; more means dictionaries being replaced, and the
#: old entries would keep their dictionaries alive for the thread's life.
MAX_THREAD_COMPRESSORS = 8


def thread_compressor(zstd: ModuleType, level: int, dictionary: Any) -> Any:
    by_setting = getattr(_compressors, "by_setting", None)
    if by_setting is None:
        by_setting = _compressors.by_setting = {}
    # The entry keeps its dictionary alive, so no other dictionary can take its id.
    entry = by_setting.get((level, id(dictionary)))
    if entry is None:
        if len(by_setting) >= MAX_THREAD_COMPRESSORS:
            by_setting.clear()
        entry = by_setting[level, id(dictionary)] = (
            dictionary, zstd.ZstdCompressor(level, zstd_dict=dictionary))
    return entry[1]


class ZstdCompressor:
    """``COMPRESSOR: "django_kvcache.zstd.ZstdCompressor"``; COMPRESS_LEVEL default 3."""

    flag = FLAG_ZSTD
    #: zstd gives up on 1.5 KB of random bytes in ~5 µs, less than the codec's sample
    #: check costs on every compressible value, so the codec does not screen for it.
    screens_random = False

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        options = options or {}
        self.zstd = zstd = require_zstd("django_kvcache.zstd.ZstdCompressor")
        low, high = zstd.CompressionParameter.compression_level.bounds()
        self.level = options.get("COMPRESS_LEVEL", DEFAULT_LEVEL)
        if type(self.level) is not int or not low <= self.level <= high:
            raise ImproperlyConfigured(
                f"OPTIONS['COMPRESS_LEVEL'] must be an integer from {low} to {high} for zstd, "
                f"got {self.level!r}"
            )
        paths = dictionary_paths(options.get("COMPRESS_DICTIONARY", []))
        dictionaries = load_dictionaries(paths) if paths else []
        #: Every listed dictionary by id, for reading; the first one is used for writing.
        self.dictionaries = {dictionary.dict_id: dictionary for dictionary in dictionaries}
        self.dictionary = dictionaries[0] if dictionaries else None

    def compress(self, data: bytes) -> bytes:
        compressor = thread_compressor(self.zstd, self.level, self.dictionary)
        return compressor.compress(data, self.zstd.ZstdCompressor.FLUSH_FRAME)

    def decompress(self, data: bytes) -> bytes:
        return decompress(self.zstd, data, self.dictionaries)


def decompress(zstd: ModuleType, data: bytes, dictionaries: Mapping[int, Any]) -> bytes:
    """One zstd frame, with the dictionary its header names (if any)."""
    dictionary_id = zstd.get_frame_info(data).dictionary_id
    if not dictionary_id:
        return zstd.decompress(data)
    dictionary = dictionaries.get(dictionary_id)
    if dictionary is None:
        raise ValueError(
            f"written with zstd dictionary {dictionary_id}, which is not in "
            "OPTIONS['COMPRESS_DICTIONARY']"
        )
    return zstd.decompress(data, zstd_dict=dictionary)


def plain_decompressor() -> Any:
    """For a cache not configured with zstd: reads zstd values that need no dictionary."""
    zstd = zstd_module()
    if zstd is None:
        return None
    return lambda data: decompress(zstd, data, {})


def train_dictionary(samples: Iterable[bytes], size: int = DEFAULT_DICTIONARY_SIZE) -> bytes:
    """A dictionary of at most ``size`` bytes trained on serialized (uncompressed) values."""
    zstd = require_zstd("Training a dictionary")
    samples = [bytes(sample) for sample in samples if sample]
    if len(samples) < 10:
        raise ValueError(f"need at least 10 non-empty samples to train a dictionary, got {len(samples)}")
    return zstd.train_dict(samples, size).dict_content
