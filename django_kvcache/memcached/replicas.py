"""Where a key is read and written, and who decides: ``REPLICAS`` N, one copy the least.

With ``REPLICAS`` N > 1 a key lives on its first N nodes in rendezvous order (its
replicas, ``Cluster.replica_set``). :class:`Replicas` is the policy over them:

* **read order** — a read asks one replica, a different one at each call (``turns``),
  those that may lack entries (*behind*: down, or failed or found restarted less than
  the cache's default TIMEOUT ago) last; a miss on a replica that is behind, and a
  replica that fails, are asked on.
* **the decider** — what must have one answer (``add``'s winner, the counter's value,
  get_or_set's lease) is decided on the first replica in rendezvous order that is up
  (``Cluster.primary``): the same for every process that sees the same nodes up,
  whatever each remembers of restarts. ``add`` then loses to a live value any other
  replica holds; ``incr`` counts on the first replica that holds the counter.
* **write placement** — every replica that may be tried; one that is skipped, fails or
  whose reply a cancelled call never read has the key marked *missed* there
  (``Node.outdated``): it deletes the key before it serves again, so no replica keeps
  a value its partners do not have.

:class:`OneReplica` is the degenerate case (``REPLICAS`` 1, the default): the key's
node, or with FAILOVER the next one, and a failed write marks the key on its home node
and on the node that failed (``Cluster.missed_write``).

The policy sees its cache through :class:`ReplicaHost`: how failures are reported and
values encoded are the cache's.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, Collection, Iterable, Protocol

from django_kvcache import stampede
from django_kvcache.memcached import (
    MemcachedError,
    NodeBusy,
    NodeDown,
    NodeError,
    PoolExhausted,
    Refused,
    ServerError,
    Unsupported,
    fanout,
    lease,
    wire,
)
from django_kvcache.memcached.cluster import Cluster, Placement, Usable
from django_kvcache.memcached.exchange import (
    ASYNCIO,
    BLOCKING,
    Batch,
    Transport,
    claimed_alone,
    claimed_get,
    fan_out,
    joined_get,
    sent_alone,
)
from django_kvcache.memcached.node import Node
from django_kvcache.memcached.wire import EXPIRED
from django_kvcache.steps import Plan

#: Failures where the node did not answer (IGNORE_EXCEPTIONS turns them into misses).
UNREACHABLE = (NodeError, PoolExhausted)

#: The ``ask`` of :meth:`Replicas.first_holding`: a node, a stored key and the driver,
#: to a plan that answers None when the node lacks the key.
Ask = Callable[[Node, str, Transport], Plan]

logger = logging.getLogger(__name__)


def unserved(line: bytes) -> bool:
    """A reply line that says the server could not serve the command (``SERVER_ERROR``
    other than a refused value: a proxy whose server for the key is down)."""
    return line.startswith(b"SERVER_ERROR") and not wire.refuses_value(line)


def answered_keys(batches: list[fanout.Batch]) -> set[str]:
    """The keys some node answered for (a reply other than a proxy's SERVER_ERROR)."""
    return {key for batch in batches if batch.error is None and isinstance(batch.result, list)
            for key, line in zip(batch.keys, batch.result) if not unserved(line)}


class ReplicaHost(Protocol):
    """What the policy needs of its cache (``MemcachedCache``)."""

    codec: Any
    default_timeout: float | None

    def _failed(self, error: MemcachedError, fallback: Any = None) -> Any:
        """Raise ``error``, or under IGNORE_EXCEPTIONS log it and give ``fallback``."""

    def _failed_softly(self, error: MemcachedError) -> None:
        """Log a replica's failure that cost the call nothing."""

    def _refused(self, error: Refused, key: Any) -> None:
        """Log a value the node refused to store."""

    def _store_request(self, name: bytes, stored_key: str, value: Any,
                       expire: int) -> tuple[wire.Op, bytes, int]:
        """What a ``set`` or an ``add`` sends: its op, the value's bytes, the bytes saved."""

    def _store_entries(self, name: bytes, key_map: dict[str, Any], data: Any, timeout: Any,
                       version: int | None, io: Transport) -> Plan: ...

    def _delete_stale_copies(self, key_map: dict[str, Any], version: int | None,
                             io: Transport) -> Plan: ...


def replicas_for(cluster: Cluster, host: ReplicaHost, failover: bool,
                 stale_copies: bool) -> Replicas:
    """The policy for ``cluster``'s REPLICAS, for one cache."""
    policy = Replicas if cluster.replicas > 1 else OneReplica
    return policy(cluster, host, failover, stale_copies)


class Replicas:
    """REPLICAS N > 1: each key on its first N nodes (module docstring)."""

    def __init__(self, cluster: Cluster, host: ReplicaHost, failover: bool,
                 stale_copies: bool) -> None:
        self.cluster = cluster
        self.host = host
        self.failover = failover
        #: get_or_set keeps stale copies beside the entries: they ride with the entry's
        #: writes, and a replica that misses one misses both.
        self.stale_copies = stale_copies

    # --- who is asked -------------------------------------------------------------------

    def decider(self, key: str, failed: Collection[Node] = ()) -> Node:
        """The replica that decides (``Cluster.primary``: the first up, for every process
        alike), passing over those that ``failed`` earlier in the call."""
        return self.cluster.primary(key, self.failover, failed)

    def behind(self, node: Node) -> bool:
        """Whether ``node`` may lack entries its key's other replicas hold — it is down,
        or it failed (or was found restarted) less than the cache's default TIMEOUT ago
        (forever with TIMEOUT None): entries written before with that timeout have
        expired since. A miss there is asked of another replica."""
        if node.health.down_until:
            return True
        since = node.behind_since
        if not since:
            return False
        timeout = self.host.default_timeout
        return timeout is None or time.monotonic() - since < timeout

    def read_order(self, key: str, turn: int) -> list[Node]:
        """The replicas a read of ``key`` asks, in turn: starting at ``turn`` (spread over
        calls), those that are behind last."""
        replicas = self.cluster.replica_set(key)
        start = turn % len(replicas)
        rotated = replicas[start:] + replicas[:start]
        if any(map(self.behind, rotated)):
            rotated.sort(key=self.behind)  # stable: the rotation stays otherwise
        return rotated

    def place(self, keys: Iterable[str]) -> Placement:
        """Where a multi-key write goes: every replica that may be tried."""
        side = (lambda key: (lease.meta_stale_key(key),)) if self.stale_copies else None
        return self.cluster.place_everywhere(keys, self.failover, side)

    # --- reads ----------------------------------------------------------------------------

    def joined_read(self, stored_key: str) -> Awaitable[Any] | None:
        """``aget``'s usual case, on the event loop: a read that joins the pending gets of
        the one node :meth:`read` would ask (``exchange.joined_get``) or, without
        company, goes alone on a free connection (``exchange.sent_alone``), as an
        awaitable of ``(data, flags)`` or None that raises the node's error. None when
        the read is :meth:`read`'s to do — here always: a replica's miss may be asked on."""
        return None

    def read_alone(self, stored_key: str) -> Batch | None:
        """``get``'s usual case, on blocking sockets: the get as a batch holding a free
        connection of the one node :meth:`read` would ask (``exchange.claimed_get``), for
        ``exchange.done_alone``. None when the read is :meth:`read`'s to do — here
        always: a replica's miss may be asked on."""
        return None

    def read(self, stored_key: str, io: Transport) -> Plan:
        """A single-key read: ``(data, flags)`` or None. One replica asked
        (:meth:`read_order`); the next when it is down or fails, or when it misses and
        may lack the entry (:meth:`behind`). Nothing older than the last acknowledged
        write can be read: a replica that missed a write deletes the key before it
        serves again (``stale``). The last error is raised when no replica answered."""
        encoded = stored_key.encode()
        error: MemcachedError | None = None
        turn = next(self.cluster.turns)
        replicas = self.cluster.replica_set(stored_key)
        node = replicas[turn % len(replicas)]
        asked = None
        if not node.health.down_until and not node.behind_since:
            asked = node
            # The usual case: this turn's replica is up and never failed: it answers —
            # unless this very request found it restarted (a miss there is then asked on).
            try:
                found = yield from node.get(encoded, io)
            except MemcachedError as exc:
                error = exc  # then every replica in turn
            else:
                if found is not None or not node.behind_since:
                    return found
        nodes: list[Node | None] = [n for n in self.read_order(stored_key, turn)
                                    if n is not asked]
        if self.failover:
            nodes.append(None)  # every replica down: the next node
        return (yield from self._ask_in_turn(
            stored_key, nodes, io, _get, lambda node, found: found is not None
            or not self.behind(node), answered=asked is not None and error is None,
            error=error, fatal=(),
        ))

    def first_holding(self, key: str, asked: Collection[Node], io: Transport, ask: Ask) -> Plan:
        """``ask`` of the key's replicas but ``asked``, in rendezvous order, until one
        holds it (a reply other than None); None when none does. A replica down or
        failing is passed over (logged); the last error is raised when none answered."""
        nodes = [node for node in self.cluster.replica_set(key) if node not in asked]
        return (yield from self._ask_in_turn(key, nodes, io, ask, _holds, bool(asked)))

    def _ask_in_turn(
        self, key: str, nodes: list[Node | None], io: Transport, ask: Ask,
        enough: Callable[[Node, Any], bool], answered: bool,
        error: MemcachedError | None = None, fatal: tuple[type[BaseException], ...] = (
            Unsupported,),
    ) -> Plan:
        """``ask`` of ``nodes`` in turn until a reply is ``enough``; None (the node
        FAILOVER's next node beyond the replicas, when none answered yet) stands for the
        next node of the key's ranking. A node down is passed over, one that fails is
        asked on (``fatal`` errors are raised at once); the last error is raised when no
        node answered (``answered``: one did before), else logged."""
        found = None
        for node in nodes:
            if node is None:
                if answered:
                    break
                node = self.cluster.beyond_replicas(key)
                if node is None:
                    break
            elif node.health.down_until and not node.health.may_try():
                error = error or node.skipped()
                continue
            try:
                found = yield from ask(node, key, io)
            except fatal:
                raise
            except MemcachedError as exc:
                error = exc
                continue
            answered = True
            if enough(node, found):
                break
        else:
            found = None
        if error is not None:
            if not answered:
                raise error
            self.host._failed_softly(error)
        return found

    def ttl(self, key: str, io: Transport) -> Plan:
        """``ttl()``: the first replica that holds the key answers; 0 when none does."""
        found = yield from self.first_holding(key, (), io, _remaining)
        return 0 if found is None else found[0]

    def elsewhere(self, key: str, asked: Node, io: Transport) -> Plan:
        """``(data, flags)`` of ``key`` on its first replica but ``asked`` that holds it,
        or None (get_or_set's lease store, when the decider lacks the entry)."""
        return (yield from self.first_holding(key, (asked,), io, _get))

    def get_many(self, key_map: dict[str, Any], io: Transport) -> Plan:
        """``get_many``: ``{stored key bytes: (data, flags)}`` of the keys found. Each key
        asked of one replica (the same turn for the whole call, so its keys go to as few
        nodes as without replicas), in one request per node; the keys of a node that is
        down or fails, and the misses of a replica that may lack them (:meth:`behind`),
        asked of their next replica in one more round. Errors are the call's only for
        keys no replica answered."""
        turn = next(self.cluster.turns)
        replica_set, count = self.cluster.replica_set, self.cluster.replicas
        if any(self.behind(node) for node in self.cluster.nodes):
            order = {key: self.read_order(key, turn) for key in key_map}
        else:  # the usual case: each key's replica of this turn, then the others in turn
            start = turn % count
            order = {}
            for key in key_map:
                replicas = replica_set(key)
                order[key] = replicas[start:] + replicas[:start]
        usable = Usable()
        errors: dict[str, MemcachedError] = {}
        answered: set[str] = set()
        found: dict[bytes, tuple[bytes, int]] = {}
        pending = list(key_map)
        while pending:
            groups: dict[Node, list[str]] = {}
            for key in pending:
                nodes = order[key]
                while nodes:
                    node = nodes.pop(0)
                    if usable[node]:
                        groups.setdefault(node, []).append(key)
                        break
                    if node.name not in errors:  # counted once per call, not per key
                        errors[node.name] = node.skipped()
                else:
                    if key not in answered and self.failover:
                        extra = self.cluster.beyond_replicas(key)
                        if extra is not None:
                            groups.setdefault(extra, []).append(key)
            if not groups:
                break
            batches = [fanout.get_batch(node, keys) for node, keys in groups.items()]
            yield from fan_out(batches, io)
            pending = []
            for batch in batches:
                if batch.error is not None:
                    errors.setdefault(batch.node.name, batch.error)
                    pending.extend(key for key in batch.keys if key not in answered)
                    continue
                found.update(batch.result)
                answered.update(batch.keys)
                if self.behind(batch.node):
                    pending.extend(key for key in batch.keys if key.encode() not in batch.result)
        report = self.host._failed if len(answered) < len(key_map) else self.host._failed_softly
        for error in errors.values():
            report(error)
        return found

    # --- writes ---------------------------------------------------------------------------

    def write_alone(self, key: str, op: wire.Op, sent: int = 0, saved: int = 0) -> Batch | None:
        """The usual single-key write on the event loop (``memcached.usual``): ``op`` as a
        batch holding a free connection of the one node :meth:`write` would write to
        (``exchange.claimed_alone``), for ``exchange.sent_alone``, a failure then
        remembered by :meth:`OneReplica.write_missed`. None when the write is
        :meth:`write`'s to do — here always: every replica is written."""
        return None

    def write(
        self, key: str, op: wire.Op, io: Transport, sent: int = 0, saved: int = 0,
        riders: tuple[str, ...] = (), first_op: wire.Op | None = None,
    ) -> Plan:
        """A single-key write: ``op`` on every replica that may be tried, in one round
        trip to each, all at once (``first_op`` instead on the one that decides, as
        ``Cluster.primary`` picks it), each credited with ``sent`` and ``saved`` bytes.
        A replica that is skipped or fails has the key and its ``riders`` (side keys
        written in the same request) marked missed there. Returns the replies, the
        deciding replica's first; raises when no replica answered, and ``Refused`` when
        one refused the value (the caller deletes it everywhere, as after any refused
        ``set``)."""
        nodes = []
        for node in self.cluster.replica_set(key):
            if not node.health.down_until or node.health.may_try():
                nodes.append(node)
            else:
                node.outdated.add((key, *riders))
        if not nodes:  # every replica down: FAILOVER's next node, or the call fails
            side = (lambda _: riders) if riders else None
            placement = self.cluster.place_everywhere((key,), self.failover, side)
            if placement.stranded:
                raise placement.errors[0]
            nodes = list(placement.groups)
        # The deciding replica, as Cluster.primary picks it: the first up, else the first
        # that may be probed (the lease of get_or_set is released there).
        first = next((node for node in nodes if not node.health.down_until), nodes[0])
        nodes.remove(first)
        batches = [Batch(first, first_op or op, sent, saved)]
        batches += [Batch(node, op, sent, saved) for node in nodes]
        yield from self.write_round(batches, io, (key, *riders))
        replies, errors = [], []
        for batch in batches:
            if batch.error is None:
                replies.append(batch.result)
            elif isinstance(batch.error, Refused):
                errors.insert(0, batch.error)
            else:
                batch.node.outdated.add((key, *riders))
                errors.append(batch.error)
        if errors and isinstance(errors[0], Refused) or not replies:
            raise errors[0]
        for error in errors:
            self.host._failed_softly(error)
        return replies

    def write_round(
        self, batches: list[fanout.Batch], io: Transport, keys: tuple[str, ...] = ()
    ) -> Plan:
        """A write's batches, all nodes at once. A round cut short (the call cancelled)
        has each batch not answered yet marked missed on its node (its keys, or ``keys``
        for a single-key batch): it may have landed or not, and a replica never keeps a
        value its partners do not have."""
        try:
            yield from fan_out(batches, io)
        except BaseException:
            for batch in batches:
                if batch.result is None and batch.error is None:
                    batch.node.outdated.add([*(batch.keys or keys), *batch.side_keys])
            raise

    def missed_on(self, key: str, error: MemcachedError) -> None:
        """A single-key write that failed on one node: the failed node only (the others
        did not miss it), or every replica when none could be tried."""
        failed = self.cluster.by_name.get(error.node)
        if isinstance(error, NodeDown) or failed is None:
            for node in self.cluster.replica_set(key):
                node.outdated.add((key,))
        else:
            failed.outdated.add((key,))

    def write_failed(self, key_map: Iterable[str], placement: Placement,
                     batches: list[fanout.Batch]) -> list[str]:
        """The keys of a multi-key write that failed: those no replica answered for."""
        answered = answered_keys(batches)
        return [key for key in key_map if key not in answered]

    def stored(self, written: Any, key_map: dict[str, Any], placement: Placement,
               batches: list[fanout.Batch]) -> tuple[Any, list[str]]:
        """What a multi-key ``set`` did (``Written``) and which keys failed: stored if
        some replica stored it (and none refused it); failed if none answered."""
        refused = list(dict.fromkeys(written.refused))
        stored = [key for key in dict.fromkeys(written.stored) if key not in refused]
        return (written._replace(stored=stored, refused=refused, failed=[]),
                self.write_failed(key_map, placement, batches))

    def batch_errors(self, batches: list[fanout.Batch]) -> list[MemcachedError]:
        """The errors of a round's batches that are the call's: a batch whose every key
        another replica answered for cost nothing (logged, not returned)."""
        errors = [batch.error for batch in batches if batch.error is not None]
        if not errors:
            return errors
        answered = answered_keys(batches)
        errors = []
        for batch in batches:
            if batch.error is None:
                continue
            if all(key in answered for key in batch.keys):
                self.host._failed_softly(batch.error)
            else:
                errors.append(batch.error)
        return errors

    # --- add: one winner ------------------------------------------------------------------

    def add(self, stored_key: str, key: Any, value: Any, expire: int, timeout: Any,
            version: int | None, io: Transport) -> Plan:
        """``add``: one winner, and it loses to a value any replica holds. The ``add``
        goes to the deciding replica (:meth:`decider`) alone: one process stores there,
        the others lose. The winner there then copies the value to the other replicas
        with ``add`` too (:meth:`_add_elsewhere`): one that holds a live value (the
        decider restarted empty, or lost the key) makes the ``add`` lose, and that value
        is given back where ours was stored. Then, with STALE_TIMEOUT, the entry's stale
        copies are deleted after it, as after ``set``."""
        op, data, saved = self.host._store_request(b"add", stored_key, value, expire)
        return (yield from self.add_request(stored_key, key, op, data, saved, version, io))

    def add_request(self, stored_key: str, key: Any, op: wire.Op, data: bytes, saved: int,
                    version: int | None, io: Transport) -> Plan:
        """:meth:`add` once its request is made: ``op``, the ``add`` of ``data``."""
        sent = len(stored_key) + len(data)
        failed: list[Node] = []  # deciders that failed this call: the next one decides
        while True:
            try:
                primary = self.decider(stored_key, failed)
                stored = yield from primary.request(op, io, sent, saved)
            except MemcachedError as exc:
                if self.add_failed(stored_key, key, exc, failed):
                    continue
                return False
            break
        if not stored:
            return False
        try:
            won = yield from self._add_elsewhere(primary, stored_key, op, data, io, saved)
        except BaseException:  # cancelled before every replica was asked: ours withdrawn
            primary.outdated.add((stored_key,))
            raise
        if won and self.stale_copies and not stampede.is_side_key(key):
            yield from self.host._delete_stale_copies({stored_key: key}, version, io)
        return won

    def add_failed(self, stored_key: str, key: Any, error: MemcachedError,
                   failed: list[Node]) -> bool:
        """What the deciding replica's failed ``add`` does. True: the next replica decides
        (the node that failed added to ``failed``). Else the add lost: a refused value
        logged; any other failure has the key missed (an add that may have landed is
        deleted) and is raised, or under IGNORE_EXCEPTIONS logged."""
        if isinstance(error, Refused):
            self.host._refused(error, key)
            return False
        self.missed_on(stored_key, error)
        if self.next_decides(error, len(failed)):
            failed.append(self.cluster.by_name[error.node])
            return True
        self.host._failed(error, False)
        return False

    def _add_elsewhere(
        self, primary: Node, stored_key: str, op: wire.Op, data: bytes, io: Transport,
        saved: int,
    ) -> Plan:
        """After the deciding replica stored an ``add``: the same ``add`` on the other
        replicas. Whether the add won — no replica that answered held a live value. A
        replica that is down or fails has the key marked outdated there."""
        others = [node for node in self.cluster.replica_set(stored_key) if node is not primary]
        sent = len(stored_key) + len(data)
        copies = [Batch(node, op, sent, saved) for node in others if node.health.may_try()]
        for node in others:
            if node.health.down_until and all(batch.node is not node for batch in copies):
                node.outdated.add((stored_key,))
        if copies:
            yield from fan_out(copies, io)
        holder = None
        ours = [primary]
        for batch in copies:
            if batch.error is not None and not isinstance(batch.error, Refused):
                batch.node.outdated.add((stored_key,))
                self.host._failed_softly(batch.error)
            elif batch.error is None:
                if batch.result:
                    ours.append(batch.node)
                else:
                    holder = holder or batch.node
        if holder is None:
            return True
        yield from self._give_back(holder, ours, stored_key, data, io)
        return False

    def _give_back(
        self, holder: Node, ours: list[Node], stored_key: str, data: bytes, io: Transport
    ) -> Plan:
        """An ``add`` that lost to the live value ``holder`` has: on each replica of
        ``ours`` where our value still is (``gets``, then ``cas``: a write since then is
        left alone), the live value instead, with its remaining lifetime (meta commands),
        or without them a miss. A replica that fails has the key marked outdated."""
        encoded = stored_key.encode()
        live = None
        try:
            if (yield from holder.speaks_meta(io)):
                live = yield from holder.request(wire.meta_get(encoded), io)
        except MemcachedError as exc:
            self.host._failed_softly(exc)
        for node in ours:
            try:
                mine = yield from node.request(wire.gets_one(encoded), io)
                if mine is None or mine[0] != data:
                    continue  # written since: not ours to replace
                if live is None:
                    op = wire.cas(encoded, b"", 0, EXPIRED, mine[2])
                else:
                    lifetime = wire.seconds_left(live[2])
                    op = wire.cas(encoded, live[0], live[1], wire.exptime(lifetime), mine[2])
                yield from node.request(op, io)
            except MemcachedError as exc:
                node.outdated.add((stored_key,))
                self.host._failed_softly(exc)

    def next_decides(self, error: MemcachedError, attempt: int) -> bool:
        """After the deciding replica of ``add`` or ``incr`` failed on its
        ``attempt``-th try: whether the next replica decides instead (the failure then
        logged, not raised). So it does when the node failed — it is behind from then
        on, and ``Cluster.primary`` passes it over — and replicas are left."""
        if not isinstance(error, NodeError) or isinstance(error, (NodeDown, NodeBusy)):
            return False
        if error.node not in self.cluster.by_name or attempt + 1 >= self.cluster.replicas:
            return False
        self.host._failed_softly(error)
        return True

    # --- incr: counted on the first replica that holds the counter ------------------------

    def incr(self, key: str, delta: int, caller_key: Any, count: Callable[..., Plan],
             io: Transport) -> Plan:
        """``delta`` added with ``count(node, key, delta, caller_key, io)`` on the deciding
        replica — or, when it lacks the key (restarted empty, or lost it), on the next
        one up — then on every other replica (:meth:`_incr_others`). The new value, or
        None when no replica holds the key (or, under IGNORE_EXCEPTIONS, none answered)."""
        failed: list[Node] = []  # replicas that failed this call or lack the key
        while True:
            try:
                node = self.decider(key, failed)
                value = yield from count(node, key, delta, caller_key, io)
            except (Refused, Unsupported):
                raise  # refused, not missed: the node answered and changed nothing
            except MemcachedError as exc:
                self.missed_on(key, exc)
                if not isinstance(exc, UNREACHABLE):
                    raise  # the node answered (no meta commands, a key that kept changing)
                if self.next_decides(exc, len(failed)):
                    failed.append(self.cluster.by_name[exc.node])
                    continue
                # An unreachable node: raised, or under IGNORE_EXCEPTIONS (logged, counted)
                # the answer for a missing key: Django's contract has incr return the new
                # value or raise ValueError, which callers handle (django-ratelimit counts
                # from its initial value then). Django's PyMemcacheCache with ignore_exc
                # returns False instead — neither a count nor a miss (docs/memcached.rst,
                # incr and decr).
                self.host._failed(exc)
                return None
            except BaseException as exc:
                if not isinstance(exc, Exception):  # cancelled: it may count there yet
                    self._count_cut_short(key, [node])
                raise
            if value is None and self._next_may_hold(key, failed + [node]):
                failed.append(node)  # restarted empty, or lost the key: the next counts
                continue
            break
        if value is not None:
            yield from self._incr_others(node, key, delta, caller_key, count, io, failed)
        return value

    def _next_may_hold(self, key: str, asked: list[Node]) -> bool:
        """After a replica answered that it lacks a counter: whether a replica not
        ``asked`` yet is up, so that the counter is counted on the first replica that
        holds it."""
        return any(node not in asked and not node.health.down_until
                   for node in self.cluster.replica_set(key))

    def _incr_others(
        self, primary: Node, key: str, delta: int, caller_key: Any, count: Callable[..., Plan],
        io: Transport, failed: list[Node],
    ) -> Plan:
        """Once the deciding replica counted: every other replica applies the same delta
        itself (one after another), so they converge — increments commute; their results
        are not compared (concurrent calls make them differ on the way). One that is
        down, fails or cannot apply the delta (it overflows there, holds no integer) has
        the key marked outdated: deleted there before it serves again. One that has no
        such key stays without it. A replica that was unreachable during the call is
        skipped: the key is outdated there."""
        # (a failed one has the key marked outdated already)
        others = [node for node in self.cluster.replica_set(key)
                  if node is not primary and node not in failed]
        for index, node in enumerate(others):
            if node.health.down_until and not node.health.may_try():
                node.outdated.add((key,))
                continue
            try:
                yield from count(node, key, delta, caller_key, io)
            except MemcachedError as exc:
                node.outdated.add((key,))
                self.host._failed_softly(exc)
            except (OverflowError, TypeError) as exc:
                node.outdated.add((key,))
                logger.warning("memcached node %s: the replica of %r differs from the counter "
                               "on %s (%s); deleted there", node.name, caller_key,
                               primary.name, exc)
            except BaseException:  # cancelled: this replica and the next may lack it
                self._count_cut_short(key, [primary, *others[:index]])
                raise

    def _count_cut_short(self, key: str, counted: list[Node]) -> None:
        """An ``incr`` cut short (cancelled, interrupted) once it may have counted on
        some replica: every replica but those that ``counted`` (for the one asked then,
        it may land) has the key marked missed, so that none keeps a count below the
        others' — an ``aincr`` acknowledged later would otherwise be read lower there."""
        for node in self.cluster.replica_set(key):
            if node not in counted:
                node.outdated.add((key,))


class OneReplica(Replicas):
    """REPLICAS 1: the key's node, or with FAILOVER the next of its ranking that may be
    tried. Nothing to read on, copy or converge: a failed write marks the key missed on
    its home node and on the node that failed."""

    #: No other replica to read a key on (get_or_set's lease store).
    elsewhere = None  # type: ignore[assignment]

    def decider(self, key: str, failed: Collection[Node] = ()) -> Node:
        return self.cluster.node(key, self.failover)

    def place(self, keys: Iterable[str]) -> Placement:
        return self.cluster.place(keys, self.failover)

    def read(self, stored_key: str, io: Transport) -> Plan:
        return self.cluster.node(stored_key, self.failover).get(stored_key.encode(), io)

    def joined_read(self, stored_key: str) -> Awaitable[Any] | None:
        node = self.cluster.home(stored_key)
        if node.health.down_until:
            return None  # down, or probed now: which node serves is read's to decide
        key = stored_key.encode()
        share = joined_get(node, key, node.count_get)
        if share is not None:
            return share
        batch = claimed_get(node, key, ASYNCIO)  # no company: it goes alone
        return None if batch is None else sent_alone(batch)

    def read_alone(self, stored_key: str) -> Batch | None:
        node = self.cluster.home(stored_key)
        if node.health.down_until:
            return None  # down, or probed now: which node serves is read's to decide
        return claimed_get(node, stored_key.encode(), BLOCKING)

    def ttl(self, key: str, io: Transport) -> Plan:
        return lease.ttl(self.cluster.node(key, self.failover), key, io)

    def get_many(self, key_map: dict[str, Any], io: Transport) -> Plan:
        """``get_many``: one request per node. A proxy answers SERVER_ERROR for a whole
        get when one of its servers is down: those keys are asked one by one, so that
        only that server's keys miss."""
        placement = self.place(key_map)
        batches = [fanout.get_batch(node, keys) for node, keys in placement.groups.items()]
        yield from fan_out(batches, io)
        retried = [fanout.get_each_batch(batch.node, list(batch.keys)) for batch in batches
                   if isinstance(batch.error, ServerError) and len(batch.keys) > 1]
        if retried:
            yield from fan_out(retried, io)
            batches = [batch for batch in batches if batch.node not in
                       {retry.node for retry in retried}]
        found: dict[bytes, tuple[bytes, int]] = {}
        for batch in batches:
            if batch.error is None:
                found.update(batch.result)
        for batch in retried:
            if batch.error is None:
                values, failed = batch.result
                found.update(values)
                if failed:
                    batch.error = ServerError(
                        batch.node.name, f"SERVER_ERROR for {len(failed)} of "
                        f"{len(batch.keys)} key(s) asked one by one (a proxy's server down?)"
                    )
        for error in placement.errors + self.batch_errors(batches + retried):
            self.host._failed(error)
        return found

    def write(
        self, key: str, op: wire.Op, io: Transport, sent: int = 0, saved: int = 0,
        riders: tuple[str, ...] = (), first_op: wire.Op | None = None,
    ) -> Plan:
        """The write on the key's node (or its failover node): ``[its reply]``. A write
        that fails or is skipped is remembered as missed, with the ``riders``."""
        try:
            return [(yield from self.decider(key).request(first_op or op, io, sent, saved))]
        except MemcachedError as exc:
            self.write_missed(key, exc, riders)
            raise

    def write_alone(self, key: str, op: wire.Op, sent: int = 0, saved: int = 0) -> Batch | None:
        node = self.cluster.home(key)
        if node.health.down_until:
            return None  # down, or probed now: which node is written is write's to decide
        return claimed_alone(node, op, sent, saved)

    def write_missed(self, key: str, error: MemcachedError, riders: tuple[str, ...] = ()) -> None:
        """A single-key write that failed or was skipped (:meth:`write`'s, or a batch of
        :meth:`write_alone` sent with ``exchange.sent_alone``): the key (with its
        ``riders``) missed there. A refused value is not missed: the node answered."""
        if isinstance(error, Refused):
            return
        self.cluster.missed_write(key, error)
        if riders:
            self.cluster.home(key).outdated.add(riders)

    def write_round(
        self, batches: list[fanout.Batch], io: Transport, keys: tuple[str, ...] = ()
    ) -> Plan:
        return fan_out(batches, io)

    def missed_on(self, key: str, error: MemcachedError) -> None:
        self.cluster.missed_write(key, error)

    def write_failed(self, key_map: Iterable[str], placement: Placement,
                     batches: list[fanout.Batch]) -> list[str]:
        return [*placement.stranded, *(k for b in batches if b.error for k in b.keys)]

    def stored(self, written: Any, key_map: dict[str, Any], placement: Placement,
               batches: list[fanout.Batch]) -> tuple[Any, list[str]]:
        return written, self.write_failed(key_map, placement, batches)

    def batch_errors(self, batches: list[fanout.Batch]) -> list[MemcachedError]:
        return [batch.error for batch in batches if batch.error is not None]

    def add(self, stored_key: str, key: Any, value: Any, expire: int, timeout: Any,
            version: int | None, io: Transport) -> Plan:
        """With STALE_TIMEOUT the ``add`` and the deletes of its stale copies go in one
        request (the copies are deleted whatever the ``add`` did), as ``set``'s."""
        if self.stale_copies and not stampede.is_side_key(key):
            written = yield from self.host._store_entries(
                b"add", {stored_key: key}, {key: value}, timeout, version, io
            )
            return stored_key in written.stored
        return (yield from super().add(stored_key, key, value, expire, timeout, version, io))

    def _add_elsewhere(self, *args: Any) -> Plan:
        return _answer(True)

    def next_decides(self, error: MemcachedError, attempt: int) -> bool:
        return False

    def _next_may_hold(self, key: str, asked: list[Node]) -> bool:
        return False

    def _incr_others(self, *args: Any) -> Plan:
        return iter(())

    def _count_cut_short(self, key: str, counted: list[Node]) -> None:
        pass


def _answer(value: Any) -> Plan:
    """A plan that answers ``value`` without any IO."""
    return value
    yield  # (a generator)


def _get(node: Node, key: str, io: Transport) -> Plan:
    return node.get(key.encode(), io)


def _holds(node: Node, found: Any) -> bool:
    return found is not None


def _remaining(node: Node, key: str, io: Transport) -> Plan:
    """``(seconds left,)`` of ``key`` on ``node`` (None: it never expires), or None when
    the node lacks it."""
    remaining = yield from lease.ttl(node, key, io)
    return None if remaining == 0 else (remaining,)
