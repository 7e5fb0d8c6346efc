"""zstd compression of cache values, optionally with trained dictionaries.

Two engines write and read the same zstd frames and dictionaries, so an entry written
through one reads through the other:

* ``zstandard`` (python-zstandard), which the ``mysql``, ``memcached`` and ``zstd`` extras
  install, and which is used wherever it is importable. Its compression *and*
  decompression contexts are reusable: each thread keeps one per level and dictionary.
* the standard library's ``compression.zstd`` (Python 3.14+), or the ``backports.zstd``
  package with the same API, used where zstandard is missing. It reuses compressors but
  builds a new decompression context for every value, ~7 µs more per read on this
  project's machine (docs/codec.rst, "The zstd engine"), so it is a fallback: a process
  with it reads and writes every zstd entry, a little slower.

A dictionary trained on the site's own values (``manage.py kvcache_train_dictionary``)
makes small values compress much better. zstd writes the dictionary's id into every
frame, so each value names the dictionary it needs: ``COMPRESS_DICTIONARY`` lists files
(the first one writes, all of them read), or is ``"auto"`` on a MySQLCache, whose
dictionaries live in its database (``django_kvcache.mysql.dictionaries``). An entry whose
dictionary is not found is a logged miss, never a wrong value.
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Hashable, Iterable, Mapping, Protocol

from django.core.exceptions import ImproperlyConfigured

#: The flag bit of zstd-compressed values. No other memcached client reads it, so none
#: can mistake such a value for plain pickle.
FLAG_ZSTD = 1 << 10
DEFAULT_LEVEL = 3
#: libzstd's level range (ZSTD_minCLevel() to ZSTD_maxCLevel()), the same in both engines.
LEVELS = range(-(1 << 17), 23)
#: 64 KB: on the benchmark's mixes, 16 KB -> 64 KB takes 2.5 % more bytes off (0.55 ->
#: 0.54x django-mysql's bytes realistic, 0.67 -> 0.66x heavy), 64 -> 110 KB under 1 %.
DEFAULT_DICTIONARY_SIZE = 64 * 1024
#: ``COMPRESS_DICTIONARY`` value of a cache that keeps its dictionaries itself (MySQLCache).
AUTO = "auto"
#: The magic number that starts a zstd dictionary; its id follows (little-endian).
DICTIONARY_MAGIC = b"\x37\xa4\x30\xec"
#: What zstd must be for, in the messages of a process without it.
INSTALL_HINT = (
    "install the zstandard package (pip install zstandard; the extras "
    "django-kvcache[zstd], [mysql] and [memcached] bring it too)"
)


class DamagedFrame(ValueError):
    """A stored zstd frame this cache cannot read, in words of our own: they name a
    dictionary id or the kind of damage, never the stored bytes, so a log may carry them."""


class MissingDictionary(DamagedFrame):
    """A zstd frame names a dictionary this cache does not have."""


class Dictionary:
    """A trained zstd dictionary: its id and content, and what each engine prepared from it.

    Compared by identity: caches of compression contexts hold it as their key, so while
    a context lives its dictionary does too and no other dictionary can take its id.
    """

    __slots__ = ("id", "content", "prepared", "__weakref__")

    def __init__(self, content: bytes) -> None:
        self.content = bytes(content)
        self.id = dictionary_id(self.content)
        if not self.id:
            raise ValueError("not a zstd dictionary (no dictionary header and id)")
        #: The engines' own objects made from it, built at first use (see ``Engine``).
        self.prepared: dict[Hashable, Any] = {}

    def __repr__(self) -> str:
        return f"<zstd Dictionary {self.id}, {len(self.content)} bytes>"


def dictionary_id(content: bytes) -> int:
    """The id in a dictionary's header (zstd's dictionary format); 0 for raw content."""
    if len(content) < 8 or content[:4] != DICTIONARY_MAGIC:
        return 0
    return int.from_bytes(content[4:8], "little")


class DictionarySource(Protocol):
    """Where a ZstdCompressor finds its dictionaries: files, or a cache's own table."""

    def for_writing(self) -> Dictionary | None:
        """The dictionary new values are written with (None: none)."""

    def find(self, dictionary_id: int) -> Dictionary:
        """The dictionary a frame names; raises ``MissingDictionary`` if there is none."""


def no_dictionary(dictionary_id: int) -> Dictionary:
    """``find`` of a cache configured without dictionaries."""
    raise MissingDictionary(
        f"written with zstd dictionary {dictionary_id}; this cache has no COMPRESS_DICTIONARY"
    )


class ThreadContexts(threading.local):
    """One thread's zstd contexts, by setting; none is safe to share between threads."""

    def __init__(self) -> None:
        self.compressors: dict[tuple[int, Dictionary | None], Any] = {}
        self.decompressors: dict[Dictionary | None, Any] = {}


#: A process uses one or two settings; more means dictionaries being replaced, and the
#: old ones would be kept alive by their contexts for the thread's life.
MAX_THREAD_CONTEXTS = 8


def reused(contexts: dict[Any, Any], setting: Any, make: Callable[[], Any]) -> Any:
    """The context of ``setting`` from ``contexts``, made at its first use; past
    MAX_THREAD_CONTEXTS settings every one is dropped and rebuilt when used again."""
    context = contexts.get(setting)
    if context is None:
        if len(contexts) >= MAX_THREAD_CONTEXTS:
            contexts.clear()
        context = contexts[setting] = make()
    return context


class Engine:
    """A zstd implementation: compresses and decompresses single frames, trains dictionaries.

    Creating a compression context costs more than compressing a 1 KB value with it, so
    each thread keeps its contexts by setting, shared by every cache instance (Django
    builds one per thread and per ASGI request).
    """

    name: str

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.contexts = ThreadContexts()

    def compress(self, data: bytes, level: int, dictionary: Dictionary | None) -> bytes:
        compressor = self.contexts.compressors.get((level, dictionary))
        if compressor is None:
            compressor = reused(
                self.contexts.compressors, (level, dictionary),
                lambda: self.new_compressor(level, dictionary),
            )
        return self.compress_with(compressor, data)

    def decompress(self, data: bytes, find: Callable[[int], Dictionary]) -> bytes:
        """One frame, with the dictionary its header names (``find`` gives it)."""
        raise NotImplementedError

    def prepare(self, dictionary: Dictionary) -> None:
        """Check the dictionary's content by preparing it for decompression."""
        self.prepared(dictionary, "decompress")

    def prepared(self, dictionary: Dictionary, use: Hashable) -> Any:
        key = (self.name, use)
        found = dictionary.prepared.get(key)
        if found is None:  # two threads may both build it: the same object, either kept
            found = dictionary.prepared[key] = self.make_prepared(dictionary, use)
        return found

    def new_compressor(self, level: int, dictionary: Dictionary | None) -> Any:
        raise NotImplementedError

    def compress_with(self, compressor: Any, data: bytes) -> bytes:
        raise NotImplementedError

    def make_prepared(self, dictionary: Dictionary, use: Hashable) -> Any:
        raise NotImplementedError

    def train(self, samples: list[bytes], size: int) -> bytes:
        raise NotImplementedError


class Zstandard(Engine):
    """python-zstandard: reused compressors and decompressors, prepared dictionaries."""

    name = "zstandard"
    #: Frames claiming more than this are decompressed as a stream: a one-shot call
    #: allocates the size the (possibly corrupt) header claims before reading anything.
    ONE_SHOT_LIMIT = 64 * 1024 * 1024

    def new_compressor(self, level: int, dictionary: Dictionary | None) -> Any:
        prepared = None if dictionary is None else self.prepared(dictionary, level)
        return self.module.ZstdCompressor(level=level, dict_data=prepared)

    def compress_with(self, compressor: Any, data: bytes) -> bytes:
        return compressor.compress(data)  # type: ignore[no-any-return]

    def make_prepared(self, dictionary: Dictionary, use: Hashable) -> Any:
        prepared = self.module.ZstdCompressionDict(dictionary.content)
        if use == "decompress":  # its digested form is built by the first decompressor
            self.module.ZstdDecompressor(dict_data=prepared).decompressobj()
        else:  # a level: the digested form for compressing at it, built once
            prepared.precompute_compress(level=use)
        return prepared

    def decompress(self, data: bytes, find: Callable[[int], Dictionary]) -> bytes:
        frame = self.module.get_frame_parameters(data)
        dictionary = find(frame.dict_id) if frame.dict_id else None
        decompressor = self.contexts.decompressors.get(dictionary)
        if decompressor is None:
            decompressor = reused(
                self.contexts.decompressors, dictionary,
                lambda: self.module.ZstdDecompressor(
                    dict_data=None if dictionary is None
                    else self.prepared(dictionary, "decompress")),
            )
        if frame.content_size <= self.ONE_SHOT_LIMIT:  # CONTENTSIZE_UNKNOWN/ERROR are huge
            return decompressor.decompress(data, allow_extra_data=False)  # type: ignore[no-any-return]
        stream = decompressor.decompressobj()
        output = stream.decompress(data)
        if not stream.eof or stream.unused_data:
            raise DamagedFrame("zstd frame truncated or followed by other bytes")
        return output  # type: ignore[no-any-return]

    def train(self, samples: list[bytes], size: int) -> bytes:
        return self.module.train_dictionary(size, samples).as_bytes()  # type: ignore[no-any-return]


class StandardLibrary(Engine):
    """``compression.zstd`` / ``backports.zstd``: reused compressors; its decompression
    builds a context per value (the API has no reusable one-shot decompressor)."""

    name = "compression.zstd"

    def new_compressor(self, level: int, dictionary: Dictionary | None) -> Any:
        prepared = None if dictionary is None else self.prepared(dictionary, "dict")
        return self.module.ZstdCompressor(level, zstd_dict=prepared)

    def compress_with(self, compressor: Any, data: bytes) -> bytes:
        return compressor.compress(data, self.module.ZstdCompressor.FLUSH_FRAME)  # type: ignore[no-any-return]

    def prepare(self, dictionary: Dictionary) -> None:
        # ZstdDict digests its content at first use: use it once, so a damaged one fails here.
        prepared = self.prepared(dictionary, "dict")
        self.module.decompress(self.module.compress(b"check", zstd_dict=prepared), zstd_dict=prepared)

    def make_prepared(self, dictionary: Dictionary, use: Hashable) -> Any:
        return self.module.ZstdDict(dictionary.content)

    def decompress(self, data: bytes, find: Callable[[int], Dictionary]) -> bytes:
        dictionary_id = self.module.get_frame_info(data).dictionary_id
        if not dictionary_id:
            return self.module.decompress(data)  # type: ignore[no-any-return]
        prepared = self.prepared(find(dictionary_id), "dict")
        return self.module.decompress(data, zstd_dict=prepared)  # type: ignore[no-any-return]

    def train(self, samples: list[bytes], size: int) -> bytes:
        return self.module.train_dict(samples, size).dict_content  # type: ignore[no-any-return]


@functools.cache
def zstd_engine() -> Engine | None:
    """zstandard where installed, else the standard library's zstd (3.14+) or
    backports.zstd; None if there is none.

    Cached: a failed import searches sys.path again on every call (~35 µs), and every
    cache instance asks (Django builds one per thread and per ASGI request)."""
    try:
        import zstandard

        return Zstandard(zstandard)
    except ImportError:
        return standard_library_engine()


@functools.cache
def standard_library_engine() -> StandardLibrary | None:
    """The fallback engine: ``compression.zstd`` (3.14+) or backports.zstd; None if neither."""
    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        try:
            from backports import zstd  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    return StandardLibrary(zstd)


def require_zstd(what: str) -> Engine:
    engine = zstd_engine()
    if engine is None:
        raise ImproperlyConfigured(f"{what} needs zstd: {INSTALL_HINT}")
    return engine


def dictionary_paths(value: Any) -> list[str]:
    """OPTIONS['COMPRESS_DICTIONARY']: one path, or a list whose first entry is written."""
    paths = [value] if isinstance(value, (str, Path)) else value
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, Path)) for p in paths):
        raise ImproperlyConfigured(
            "OPTIONS['COMPRESS_DICTIONARY'] must be a file path, a list of file paths, or "
            f"'auto' (MySQLCache), got {value!r}"
        )
    return [str(path) for path in paths]


class FileDictionaries:
    """COMPRESS_DICTIONARY as files: the first one writes, every one reads."""

    def __init__(self, engine: Engine, paths: list[str]) -> None:
        self.dictionaries = [load_dictionary(engine, path) for path in paths]
        self.by_id = {dictionary.id: dictionary for dictionary in self.dictionaries}

    def for_writing(self) -> Dictionary | None:
        return self.dictionaries[0]

    def find(self, dictionary_id: int) -> Dictionary:
        dictionary = self.by_id.get(dictionary_id)
        if dictionary is None:
            raise MissingDictionary(
                f"written with zstd dictionary {dictionary_id}, which is not in "
                "OPTIONS['COMPRESS_DICTIONARY']"
            )
        return dictionary


def load_dictionary(engine: Engine, path: str) -> Dictionary:
    try:
        stat = Path(path).stat()
        version = (stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)
        return _loaded_dictionary(engine, path, version)
    except Exception as exc:  # unreadable, or no dictionary: the engines raise their own
        raise ImproperlyConfigured(
            f"OPTIONS['COMPRESS_DICTIONARY']: cannot load {path!r}: {exc}"
        ) from exc


@functools.lru_cache(maxsize=64)
def _loaded_dictionary(engine: Engine, path: str, version: tuple[int, ...]) -> Dictionary:
    """One Dictionary per file version: Django builds a cache instance per thread and per
    async context (each ASGI request), and each would otherwise read the file again and
    give the context caches a new key. ``version`` (inode, mtime, ctime, size) changes
    when the file is replaced or rewritten, even within one mtime tick."""
    dictionary = Dictionary(Path(path).read_bytes())
    engine.prepare(dictionary)
    return dictionary


def check_level(level: Any) -> int:
    if type(level) is not int or level not in LEVELS:
        raise ImproperlyConfigured(
            f"OPTIONS['COMPRESS_LEVEL'] must be an integer from {LEVELS.start} to "
            f"{LEVELS.stop - 1} for zstd, got {level!r}"
        )
    return level


class ZstdCompressor:
    """``COMPRESSOR: "django_kvcache.zstd.ZstdCompressor"``; COMPRESS_LEVEL default 3.

    ``stored_dictionaries`` is the source of ``COMPRESS_DICTIONARY: "auto"``, given by a
    backend that keeps dictionaries itself (MySQLCache).
    """

    flag = FLAG_ZSTD
    #: zstd gives up on 1.5 KB of random bytes in ~5 µs, less than the codec's sample
    #: check costs on every compressible value, so the codec does not screen for it.
    screens_random = False

    def __init__(
        self,
        options: Mapping[str, Any] | None = None,
        stored_dictionaries: DictionarySource | None = None,
    ) -> None:
        options = options or {}
        self.engine = require_zstd("django_kvcache.zstd.ZstdCompressor")
        self.level = check_level(options.get("COMPRESS_LEVEL", DEFAULT_LEVEL))
        setting = options.get("COMPRESS_DICTIONARY")
        #: Where dictionaries come from; None when the cache uses none.
        self.dictionaries: DictionarySource | None = None
        if setting == AUTO:
            if stored_dictionaries is None:
                raise ImproperlyConfigured(
                    "OPTIONS['COMPRESS_DICTIONARY'] = 'auto' keeps dictionaries in a "
                    "MySQLCache's database; this cache takes file paths"
                )
            self.dictionaries = stored_dictionaries
        elif setting:
            self.dictionaries = FileDictionaries(self.engine, dictionary_paths(setting))
        self.find = no_dictionary if self.dictionaries is None else self.dictionaries.find

    def compress(self, data: bytes) -> bytes:
        dictionary = None if self.dictionaries is None else self.dictionaries.for_writing()
        return self.engine.compress(data, self.level, dictionary)

    def decompress(self, data: bytes) -> bytes:
        return self.engine.decompress(data, self.find)


def plain_decompressor() -> Callable[[bytes], bytes] | None:
    """For a cache not configured with zstd: reads zstd values that need no dictionary."""
    engine = zstd_engine()
    if engine is None:
        return None
    return functools.partial(engine.decompress, find=no_dictionary)


def train_dictionary(samples: Iterable[bytes], size: int = DEFAULT_DICTIONARY_SIZE) -> bytes:
    """A dictionary of at most ``size`` bytes trained on serialized (uncompressed) values."""
    engine = require_zstd("Training a dictionary")
    samples = [bytes(sample) for sample in samples if sample]
    if len(samples) < 10:
        raise ValueError(f"need at least 10 non-empty samples to train a dictionary, got {len(samples)}")
    try:
        return engine.train(samples, size)
    except Exception as exc:  # each engine has its own error class for "cannot train"
        raise ValueError(f"zstd could not train a dictionary: {exc}") from exc
