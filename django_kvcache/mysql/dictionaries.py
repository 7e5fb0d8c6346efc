"""``COMPRESS_DICTIONARY: "auto"``: zstd dictionaries kept in the MySQLCache's own database.

A small table beside the cache table, ``<table>_dictionaries`` (:func:`dictionary_table`),
holds one row per dictionary id, on every shard: ``kvcache_createtable`` creates it for
a cache configured with ``"auto"``, and ``kvcache_train_dictionary ALIAS --install``
trains a dictionary from live entries and stores it on every shard (:meth:`install`).

In each process one :class:`TableDictionaries` serves every instance of the cache (Django
builds one per thread and per ASGI request):

* Reading: a frame names its dictionary's id. An id met for the first time is loaded
  with one ``SELECT`` (each shard's primary in turn, until one has it) and kept for the
  process's life; it is never fetched again. An id no shard has is a ``MissingDictionary``
  (the backend logs a miss, never returns a wrong value), and is not asked for again
  for ``MISSING_RETRY`` seconds.
* Writing: new values are compressed with the newest installed dictionary (the highest
  ``installed`` time). Which one that is, is checked at most every ``CHECK_INTERVAL``
  seconds, by the first write after the interval: one small query per minute and
  process, never one per write. A check that fails (server down, no table) keeps the
  dictionary in use, logged at most once per episode.

With ``ENCRYPTION_KEYS`` the dictionaries are sealed in the table too (a dictionary is
made of the site's own values), and a row this cache cannot authenticate is never used:
whoever can write the table could otherwise choose bytes of what an authentic entry
decompresses to. A cache without keys cannot use a sealed dictionary.

Queries run on the cache's own blocking connections (:mod:`~django_kvcache.mysql.blocking`),
never Django's. Inside a running event loop they block it for one primary-key
``SELECT`` (once per dictionary id and process, and once per check).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

from django.db import DatabaseError

from django_kvcache import forks
from django_kvcache.encryption import Encryption, NotOpened
from django_kvcache.failure_log import FailureLog
from django_kvcache.forks import Registry
from django_kvcache.mysql.blocking import query
from django_kvcache.mysql.config import check_table, router_model
from django_kvcache.mysql.sql import now_ms, quote_name, side_table
from django_kvcache.mysql.shards import Shard, make_shards
from django_kvcache.zstd import Dictionary, MissingDictionary, require_zstd

logger = logging.getLogger(__name__)
#: Failed lookups and checks, per table: one line per episode, then a summary a minute.
failures = FailureLog(logger, "zstd dictionary table")

#: Seconds between two checks for a newer dictionary, per process and table.
CHECK_INTERVAL = 60.0
#: Seconds before an id that no shard had is looked up again.
MISSING_RETRY = 60.0
#: Ids remembered as missing; a flood of entries naming unknown ids cannot grow it past this.
MAX_MISSING = 1024
SUFFIX = "_dictionaries"
#: The head of a sealed dictionary row: then the flags (4 bytes) and the sealed content.
SEALED = b"kvcache-sealed-dictionary:"


def dictionary_table(table: str) -> str:
    """The dictionary table of cache table ``table``: ``<table>_dictionaries``, or for a
    name too long for that, its head and a digest of the whole (64 characters at most)."""
    return side_table(table, SUFFIX)


def create_table_sql(table: str, quote_name: Callable[[str], str]) -> str:
    """The dictionary table of cache table ``table`` (InnoDB whatever the cache's ENGINE:
    a MEMORY table holds no BLOB, and Galera replicates only InnoDB)."""
    return (
        f"CREATE TABLE IF NOT EXISTS {quote_name(dictionary_table(table))} (\n"
        "    `dictionary_id` INT UNSIGNED NOT NULL,\n"
        "    `content` MEDIUMBLOB NOT NULL,\n"
        "    `installed` BIGINT NOT NULL,\n"
        "    PRIMARY KEY (`dictionary_id`)\n"
        ") ENGINE=InnoDB"
    )


def drop_table_sql(table: str, quote_name: Callable[[str], str]) -> str:
    return f"DROP TABLE IF EXISTS {quote_name(dictionary_table(table))}"


def uses_stored_dictionaries(options: Mapping[str, Any]) -> bool:
    """Whether a cache with these OPTIONS keeps its dictionaries in its database."""
    return options.get("COMPRESS_DICTIONARY") == "auto"


class DictionaryConflict(ValueError):
    """Another dictionary with the same id is installed already (ids are random 32-bit
    numbers: train again)."""


class TableDictionaries:
    """The dictionaries of one cache table, for every cache instance of this process."""

    def __init__(
        self, table: str, shards: list[Shard], encryption: Encryption | None = None
    ) -> None:
        self.table = table
        self.shards = shards
        #: Seals the rows this process installs and opens the ones it loads (ENCRYPTION_KEYS).
        self.encryption = encryption
        self.lock = threading.Lock()  # one lookup or check at a time
        self.by_id: dict[int, Dictionary] = {}
        self.missing: dict[int, float] = {}  # id -> monotonic time it was not found
        self.newest: Dictionary | None = None
        self.checked = -float("inf")  # monotonic time of the last check for a newer one
        forks.register(self)

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork

    # --- the DictionarySource of the cache's ZstdCompressor ----------------------------

    def for_writing(self) -> Dictionary | None:
        """The newest installed dictionary, as of the last check (at most CHECK_INTERVAL
        seconds ago). The first write of a process waits for the first check."""
        if time.monotonic() - self.checked >= CHECK_INTERVAL:
            self._check_newest()
        return self.newest

    def find(self, dictionary_id: int) -> Dictionary:
        dictionary = self.by_id.get(dictionary_id)
        if dictionary is None:
            dictionary = self._load(dictionary_id)
        return dictionary

    # --- loading -----------------------------------------------------------------------

    def _load(self, dictionary_id: int) -> Dictionary:
        with self.lock:
            dictionary = self.by_id.get(dictionary_id)  # loaded while this thread waited
            if dictionary is not None:
                return dictionary
            missed = self.missing.get(dictionary_id)
            if missed is None or time.monotonic() - missed >= MISSING_RETRY:
                dictionary = self._fetch(dictionary_id)
            if dictionary is None:
                if len(self.missing) >= MAX_MISSING:
                    self.missing.clear()
                self.missing.setdefault(dictionary_id, time.monotonic())
                raise MissingDictionary(
                    f"written with zstd dictionary {dictionary_id}, which is in no shard's "
                    f"table {dictionary_table(self.table)!r} (removed, or the table is "
                    f"missing); looked up again after {MISSING_RETRY:.0f} s"
                )
            self.missing.pop(dictionary_id, None)
            self.by_id[dictionary_id] = dictionary
            return dictionary

    def _fetch(self, dictionary_id: int) -> Dictionary | None:
        """The dictionary from the first shard that has it; None if none has (or none
        answers: logged)."""
        statement = f"SELECT `content` FROM {self._quoted()} WHERE `dictionary_id` = %s"
        for alias in self._primaries():
            try:
                rows = query(alias, statement, (dictionary_id,))
            except DatabaseError as exc:
                failures.failed(self.table, f"loading dictionary {dictionary_id} from {alias!r}: {exc}")
                continue
            if rows:
                return self._dictionary(bytes(rows[0][0]), dictionary_id, alias)
        return None

    def _dictionary(self, row: bytes, dictionary_id: int, alias: str) -> Dictionary | None:
        try:
            dictionary = Dictionary(self._opened(row, dictionary_id))
            require_zstd("OPTIONS['COMPRESS_DICTIONARY']").prepare(dictionary)
        except Exception as exc:  # the engines raise their own error classes
            failures.failed(self.table, f"dictionary {dictionary_id} in {alias!r} is unusable: {exc}")
            return None
        if dictionary.id != dictionary_id:
            failures.failed(
                self.table, f"the row of dictionary {dictionary_id} in {alias!r} holds "
                f"dictionary {dictionary.id}"
            )
            return None
        return dictionary

    def _sealed(self, content: bytes, dictionary_id: int) -> bytes:
        """A dictionary as its row holds it: sealed under this table and its id when the
        cache has ENCRYPTION_KEYS, else as it is."""
        if self.encryption is None:
            return content
        data, flags = self.encryption.seal(content, 0, str(dictionary_id))
        return SEALED + flags.to_bytes(4, "big") + data

    def _opened(self, row: bytes, dictionary_id: int) -> bytes:
        """A row's dictionary; ValueError for one this cache must not use."""
        if not row.startswith(SEALED):
            if self.encryption is not None:
                raise ValueError(
                    "stored unencrypted, and this cache has ENCRYPTION_KEYS: not used (install "
                    "it again with kvcache_train_dictionary --install)"
                )
            return row
        if self.encryption is None:
            raise ValueError("encrypted, and this cache has no ENCRYPTION_KEYS")
        flags = int.from_bytes(row[len(SEALED):len(SEALED) + 4], "big")
        try:
            content, _ = self.encryption.open(row[len(SEALED) + 4:], flags, str(dictionary_id))
        except NotOpened as exc:
            raise ValueError(str(exc)) from None
        return content

    # --- the newest dictionary -----------------------------------------------------------

    def _check_newest(self) -> None:
        if not self.lock.acquire(blocking=self.newest is None and self.checked < 0):
            return  # another thread is checking: keep writing with the current one
        try:
            if time.monotonic() - self.checked < CHECK_INTERVAL:
                return  # checked while this thread waited
            self.checked = time.monotonic()
            newest_id = self._newest_id()
        finally:
            self.lock.release()
        if newest_id is not None:
            try:
                self.newest = self.find(newest_id) if newest_id else None
            except MissingDictionary as exc:  # removed between the two queries
                failures.failed(self.table, exc)

    def _newest_id(self) -> int | None:
        """The id of the newest installed dictionary (0: none installed) on the first
        shard that answers; None when none does."""
        statement = (
            f"SELECT `dictionary_id` FROM {self._quoted()} "
            "ORDER BY `installed` DESC, `dictionary_id` DESC LIMIT 1"
        )
        for alias in self._primaries():
            try:
                rows = query(alias, statement, ())
            except DatabaseError as exc:
                failures.failed(self.table, f"checking for a newer dictionary in {alias!r}: {exc}")
                continue
            return int(rows[0][0]) if rows else 0
        return None

    # --- installing ------------------------------------------------------------------------

    def install(self, content: bytes) -> Dictionary:
        """Store the dictionary on every shard as the newest (creating the table where it
        is missing); this process writes with it at once, the others from their next check. Installing a dictionary again makes it
        the newest again. Raises ``DictionaryConflict`` if a shard holds another
        dictionary with its id, and the first DatabaseError of a shard (after trying
        every shard): install again once it answers."""
        dictionary = Dictionary(content)
        require_zstd("Installing a dictionary").prepare(dictionary)
        table = self._quoted()
        aliases = self._primaries()
        error: DatabaseError | None = None
        latest = 0  # newer than every row, even one installed within the same millisecond
        for alias in aliases:
            try:
                create = create_table_sql(self.table, quote_name)
                query(alias, create, None)  # run without parameters: no % doubling
                latest = max(latest, query(alias, f"SELECT MAX(`installed`) FROM {table}", ())[0][0] or 0)
            except DatabaseError as exc:
                error = error or exc
        installed = max(now_ms(), latest + 1)
        for alias in aliases:
            try:
                rows = query(alias, f"SELECT `content` FROM {table} WHERE `dictionary_id` = %s",
                             (dictionary.id,))
                if rows and self._held(bytes(rows[0][0]), dictionary) != dictionary.content:
                    raise DictionaryConflict(
                        f"database {alias!r} holds another dictionary with id {dictionary.id}: "
                        "train a new one"
                    )
                row = self._sealed(dictionary.content, dictionary.id)
                query(  # the same dictionary again: sealed anew (or unsealed) as this cache is
                    alias,
                    f"INSERT INTO {table} (`dictionary_id`, `content`, `installed`) "
                    "VALUES (%s, %s, %s) ON DUPLICATE KEY UPDATE `content` = %s, `installed` = %s",
                    (dictionary.id, row, installed, row, installed),
                )
            except DatabaseError as exc:
                error = error or exc
        if error is not None:
            raise error
        with self.lock:
            self.by_id[dictionary.id] = dictionary
            self.missing.pop(dictionary.id, None)
            self.newest = dictionary
            self.checked = time.monotonic()
        return dictionary

    def _held(self, row: bytes, dictionary: Dictionary) -> bytes | None:
        """The dictionary a row holds, sealed or not (None: one this cache cannot open)."""
        if not row.startswith(SEALED):
            return row
        try:
            return self._opened(row, dictionary.id)
        except ValueError:
            return None

    # --- helpers ---------------------------------------------------------------------------

    def _primaries(self) -> list[str]:
        return [shard.primary() for shard in self.shards]

    def _quoted(self) -> str:
        # Statements with parameters are %-formatted by the driver: double a % in the name.
        return quote_name(dictionary_table(self.table)).replace("%", "%%")


#: (table, DATABASE, DATABASES, encryption key ids) -> the table's dictionaries, process-wide.
_tables: Registry[tuple[Any, ...], TableDictionaries] = Registry()


def table_dictionaries(location: str, options: Mapping[str, Any]) -> TableDictionaries:
    """The dictionaries of the cache table ``location`` on the databases OPTIONS name:
    one object per process, shared by every cache instance (and by ``--install``)."""
    table = check_table(location)
    databases = options.get("DATABASES")
    encryption = Encryption.from_options(options, f"mysql table {table} dictionaries")
    key = (table, options.get("DATABASE"), None if databases is None else tuple(databases),
           () if encryption is None else tuple(encryption.key_ids))
    return _tables.get(
        key,
        lambda: TableDictionaries(table, make_shards(options, router_model(table))[0], encryption),
    )
