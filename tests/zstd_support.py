"""zstd test helpers: an entry as another host writes it (for hosts without zstd), the
engines installed here, and a frame's dictionary id read from the bytes themselves."""
from __future__ import annotations

from django_kvcache.codec import FLAG_PICKLE
from django_kvcache.zstd import (
    FLAG_ZSTD,
    Engine,
    StandardLibrary,
    Zstandard,
    standard_library_engine,
)

#: pickle.dumps("django-kvcache " * 20) as zstd level 3 wrote it (a frame any host can
#: hold, zstd installed or not).
ZSTD_ENTRY = (b'(\xb5/\xfd`>\x00-\x01\x00\xe0\x80\x05\x953\x01\x00X,\x01\x00\x00'
              b'django-kvcache \x94.\x02\x004d*&\x80"')
ZSTD_ENTRY_VALUE = "django-kvcache " * 20
ZSTD_ENTRY_FLAGS = FLAG_PICKLE | FLAG_ZSTD


def previous_engine() -> StandardLibrary | None:
    """The engine earlier releases wrote with: the standard library's zstd (3.14+) or
    backports.zstd; None if neither is installed."""
    return standard_library_engine()


def _engines() -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    try:
        import zstandard

        engines["zstandard"] = Zstandard(zstandard)
    except ImportError:
        pass
    previous = previous_engine()
    if previous is not None:
        engines["compression.zstd"] = previous
    return engines


#: Every zstd engine installed here, by name.
ENGINES = _engines()


def frame_dictionary_id(frame: bytes) -> int:
    """The Dictionary_ID field of a zstd frame header (RFC 8878, 3.1.1.1), read without
    any zstd library: 0 when the frame names no dictionary."""
    assert frame[:4] == b"\x28\xb5\x2f\xfd", "not a zstd frame"
    descriptor = frame[4]
    single_segment = descriptor >> 5 & 1
    id_size = (0, 1, 2, 4)[descriptor & 3]
    start = 5 + (0 if single_segment else 1)  # the window descriptor is absent in one case
    return int.from_bytes(frame[start:start + id_size], "little")
