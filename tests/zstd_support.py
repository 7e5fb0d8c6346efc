"""A zstd entry as another host writes it, for tests of hosts without zstd."""
from __future__ import annotations

from django_kvcache.codec import FLAG_PICKLE
from django_kvcache.zstd import FLAG_ZSTD

#: pickle.dumps("django-kvcache " * 20) as zstd level 3 wrote it (a frame any host can
#: hold, zstd installed or not).
ZSTD_ENTRY = (b'(\xb5/\xfd`>\x00-\x01\x00\xe0\x80\x05\x953\x01\x00X,\x01\x00\x00'
              b'django-kvcache \x94.\x02\x004d*&\x80"')
ZSTD_ENTRY_VALUE = "django-kvcache " * 20
ZSTD_ENTRY_FLAGS = FLAG_PICKLE | FLAG_ZSTD
