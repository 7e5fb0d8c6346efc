"""Multi-key writes: one pipelined request per node, all nodes at once.

``set_many`` and ``delete_many`` (and, with get_or_set's STALE_TIMEOUT, every write of an
entry: its stale copies go with it) are planned here: where the keys go is the replica
policy's (``memcached.replicas``); what a round did is read from the replies — stored,
refused (logged with the caller's key, never raised), failed or not served (a proxy's
``SERVER_ERROR``) — and what it left undone is remembered as missed on its node, so the
node deletes the key before it serves again. Failures are raised, or logged under
IGNORE_EXCEPTIONS, once every node is done (the cache's ``_failed``).

The plans see their cache through :class:`WriteHost`.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, NamedTuple, Protocol

from django_kvcache.memcached import MemcachedError, ServerError, fanout, lease
from django_kvcache.memcached.cluster import Placement
from django_kvcache.memcached.exchange import Transport
from django_kvcache.memcached.node import Node
from django_kvcache.memcached.replicas import Replicas, unserved
from django_kvcache.steps import Plan

logger = logging.getLogger(__name__)


class Written(NamedTuple):
    """What a store round did, by stored key."""

    stored: list[str]
    refused: list[str]  # the value refused by its node (too large, out of memory)
    failed: list[str]  # the node failed, was down, or could not serve the key


class Round(NamedTuple):
    """One round of requests: where its keys went, and each node's batch."""

    placement: Placement
    batches: list[fanout.Batch]


NO_ROUND = Round(Placement({}, [], []), [])


class WriteHost(Protocol):
    """What the write plans need of their cache (``MemcachedCache``)."""

    cache_name: str
    codec: Any

    def expire_time(self, timeout: Any) -> int: ...

    def _failed(self, error: MemcachedError, fallback: Any = None) -> Any: ...

    def _refused_line(self, node: str, key: Any, reason: str) -> None: ...


class Writes:
    """The multi-key write plans of one cache, placed by its replica policy."""

    def __init__(self, host: WriteHost, replicas: Replicas, stale_copies: bool) -> None:
        self.host = host
        self.replicas = replicas
        self.cluster = replicas.cluster
        self.stale_copies = stale_copies

    def store_entries(
        self, name: bytes, key_map: dict[str, Any], data: Mapping[Any, Any], timeout: Any,
        version: int | None, io: Transport,
    ) -> Plan:
        """``set`` (or ``add``) of the entries: one pipelined request per node, all nodes
        at once. With STALE_TIMEOUT, the stale copies ``get_or_set`` keeps of them are
        deleted after them (:meth:`stale_copies_of`), so that none is ever older than
        the last value written. A value a node refused is logged, and after ``set`` its
        older value deleted; failures are raised, or logged under IGNORE_EXCEPTIONS, once
        every node is done, and what they leave behind is remembered as outdated.
        Returns what was stored, what failed and what was refused (stored keys)."""
        placement = self.replicas.place(key_map)
        copies = self.stale_copies_of(placement, key_map, version)
        batches = [
            self._store_batch(name, node, keys, key_map, data, timeout, copies)
            for node, keys in placement.groups.items()
        ]
        yield from self.replicas.write_round(batches, io)
        apart = yield from self.delete_round(copies.apart if copies else [], io)
        written, failed = self.replicas.stored(
            self._written(batches, key_map), key_map, placement, batches)
        self._missed(placement, batches, copies, apart)
        unserved_errors = self.unserved(batches + apart.batches)
        if written.refused and name == b"set":  # a refused value leaves no older one
            yield from self.delete_keys(written.refused, io)
        self.report(placement, batches, apart, unserved_errors)
        return written._replace(failed=failed + written.failed)

    def _store_batch(
        self, name: bytes, node: Node, keys: list[str], key_map: dict[str, Any],
        data: Mapping[Any, Any], timeout: Any, copies: lease.StaleCopies | None,
    ) -> fanout.Batch:
        """``keys``' values encoded, as one node's share of a store; the stale copies
        that ride on the node deleted after them, in the same request."""
        encoded = []
        saved = 0
        encode = self.host.codec.encode_measured
        for key in keys:
            payload, flags, saving = encode(data[key_map[key]], key)
            encoded.append((payload, flags))
            saved += saving
        riding = copies.riding.get(node) if copies else None
        return fanout.store_batch(node, name, keys, encoded, self.host.expire_time(timeout),
                                  saved, riding)

    def _written(self, batches: list[fanout.Batch], key_map: dict[str, Any]) -> Written:
        """What the nodes that answered did with each value: stored, not stored (``add``
        over an entry), refused (each refusal logged with the caller's key), or not
        served (``SERVER_ERROR``: behind a proxy, the key's server is down: failed)."""
        written = Written([], [], [])
        for batch in batches:
            if batch.error is not None:
                continue
            for key, line in zip(batch.keys, batch.result):
                if line == b"STORED":
                    written.stored.append(key)
                elif unserved(line):
                    written.failed.append(key)
                elif line != b"NOT_STORED":
                    written.refused.append(key)
                    reason = line.partition(b" ")[2].decode(errors="replace") or line.decode()
                    self.host._refused_line(batch.node.name, key_map[key], reason)
        return written

    @staticmethod
    def unserved(batches: list[fanout.Batch]) -> list[MemcachedError]:
        """The keys of answered pipelined writes that the server could not serve
        (``SERVER_ERROR`` other than a refused value: behind a proxy, their server is
        down): missed writes, remembered as outdated on their node; a ``ServerError`` per
        node, to report."""
        errors: list[MemcachedError] = []
        for batch in batches:
            if batch.error is not None or not isinstance(batch.result, list):
                continue
            lines = zip([*batch.keys, *batch.side_keys], batch.result)
            missed = [key for key, line in lines if unserved(line)]
            if missed:
                batch.node.outdated.add(missed)
                errors.append(ServerError(
                    batch.node.name, f"SERVER_ERROR for {len(missed)} key(s), remembered as "
                    "missed (a proxy whose server for them is down?)"
                ))
        return errors

    def delete_entries(
        self, key_map: dict[str, Any], version: int | None, io: Transport
    ) -> Plan:
        """``delete``/``delete_many`` with STALE_TIMEOUT: each entry, then the stale copies
        ``get_or_set`` may keep of it (:meth:`stale_copies_of`), which must not outlive
        it. A delete that fails or is skipped is raised or logged like any, and what it
        leaves is remembered as outdated. Returns the stored keys of the entries deleted,
        and of those whose delete failed or was skipped."""
        if not key_map:
            return set(), []
        placement = self.replicas.place(key_map)
        copies = self.stale_copies_of(placement, key_map, version)
        batches = [
            fanout.delete_batch(node, keys, copies.riding.get(node) if copies else None)
            for node, keys in placement.groups.items()
        ]
        yield from self.replicas.write_round(batches, io)
        apart = yield from self.delete_round(copies.apart if copies else [], io)
        deleted = {key for batch in batches if batch.error is None
                   for key, line in zip(batch.keys, batch.result) if line == b"DELETED"}
        failed = self.replicas.write_failed(key_map, placement, batches)
        self._missed(placement, batches, copies, apart)
        self.report(placement, batches, apart, self.unserved(batches + apart.batches))
        return deleted, failed

    def delete_stale_copies(
        self, key_map: dict[str, Any], version: int | None, io: Transport
    ) -> Plan:
        """The stale copies of the entries (not the entries) deleted on every replica."""
        placement = self.replicas.place(key_map)
        copies = self.stale_copies_of(placement, key_map, version)
        assert copies is not None
        batches = [fanout.delete_batch(node, [], copies.riding.get(node))
                   for node in placement.groups]
        yield from self.replicas.write_round(batches, io)
        apart = yield from self.delete_round(copies.apart, io)
        self._missed(placement, batches, copies, apart)
        self.report(placement, batches, apart)

    def stale_copies_of(
        self, placement: Placement, key_map: dict[str, Any], version: int | None
    ) -> lease.StaleCopies | None:
        """With STALE_TIMEOUT, where the stale copies ``get_or_set`` keeps of the placed
        entries are deleted when the entries are written or deleted: the meta store's in
        the entry's own request, after it; the add-based store's (a key of its own) in a
        round after the entries'. Entry first, copy after: a winner of ``get_or_set``
        writes the copy first (``lease``), so no interleaving leaves a copy older than
        the entry's last value, or a deleted value as the copy. None without."""
        if not self.stale_copies:
            return None
        return lease.stale_copies(self.host, placement.groups, placement.stranded, key_map,
                                  version, self.cluster.home)

    def _missed(
        self, placement: Placement, batches: list[fanout.Batch],
        copies: lease.StaleCopies | None, apart: Round,
    ) -> None:
        """What a write round and its copies' round left undone, remembered as outdated:
        the keys of failed batches (their riding copies with them) and skipped keys."""
        if copies is not None:
            placement.stranded.extend(copies.stranded)
        self.cluster.missed_batch_writes(placement, batches, copies.entry_of if copies else None)
        self.cluster.missed_batch_writes(apart.placement, apart.batches)

    def delete_round(self, keys: list[str], io: Transport) -> Plan:
        """One delete request per node, all at once: a :class:`Round`, nothing raised."""
        if not keys:
            return NO_ROUND
        placement = self.replicas.place(keys)
        batches = [fanout.delete_batch(node, keys) for node, keys in placement.groups.items()]
        yield from self.replicas.write_round(batches, io)
        return Round(placement, batches)

    def delete_keys(self, keys: list[str], io: Transport, report: bool = False) -> Plan:
        """One delete request per node. Failures are raised like any call's if ``report``,
        else (a clean-up after refused writes) logged; either way the keys that were not
        deleted are remembered as outdated."""
        placement, batches = yield from self.delete_round(keys, io)
        self.cluster.missed_batch_writes(placement, batches)
        unserved_errors = self.unserved(batches)
        if report:
            self.report(placement, batches, None, unserved_errors)
            return
        errors = (placement.errors + [b.error for b in batches if b.error is not None]
                  + unserved_errors)
        if errors:  # a clean-up delete (set_many): the keys are remembered as outdated
            undeleted = len(placement.stranded) + sum(len(b.keys) for b in batches if b.error)
            logger.warning(
                "Could not delete %d key(s) of %s after a failed write; they are deleted "
                "when their node answers again: %s", undeleted, self.host.cache_name,
                "; ".join(map(str, errors)),
            )

    def report(
        self, placement: Placement, batches: list[fanout.Batch], after: Round | None = None,
        more: list[MemcachedError] | None = None,
    ) -> None:
        """After a multi-key call (and the round ``after`` it): raise (or log) what went
        wrong, once every node is done, and a node that was down once only; ``more``:
        errors found in the replies (keys a proxy could not serve)."""
        errors = placement.errors + self.replicas.batch_errors(batches)
        if after is not None:
            reported = {error.node for error in placement.errors}
            errors += [e for e in after.placement.errors if e.node not in reported]
            errors += self.replicas.batch_errors(after.batches)
        for error in errors + (more or []):
            self.host._failed(error)
