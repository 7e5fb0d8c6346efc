"""``incr``/``decr`` on one node: the server's ``incr``, compare-and-swap, the classic
protocol's ``decr``.

Signed 64-bit counters, the same as MySQLCache's (docs/guarantees.rst): results below
zero are stored; a result outside the range raises ``OverflowError`` and leaves the value
unchanged; a value that is not an integer raises ``TypeError``; a node that lacks the key
answers None (the caller decides what a missing counter is: with REPLICAS, another
replica may hold it, ``memcached.replicas``).

A value >= 0 plus 0 <= delta <= INT64_MAX is one server ``incr``. Everything else
(negative deltas and values, deltas beyond 64 bits) is computed here and written with
compare-and-swap, which keeps the item's remaining lifetime — on a node without the meta
commands, what the classic protocol can do instead (:meth:`Counters.classic`).
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable, Protocol

from django_kvcache.base import MISSING, counter_overflow
from django_kvcache.codec import FLAG_INTEGER, FLAG_LONG, INT64_MAX, INT64_MIN
from django_kvcache.memcached import MemcachedError, Refused, wire
from django_kvcache.memcached.exchange import Transport
from django_kvcache.memcached.lease import MetaCommandsMissing
from django_kvcache.memcached.node import Node
from django_kvcache.memcached.wire import THIRTY_DAYS
from django_kvcache.steps import Plan, Sleep

CAS_PATIENCE = 5.0  # seconds of compare-and-swap retries before incr gives up


class CounterHost(Protocol):
    """What the counters need of their cache: how its values are stored and read."""

    codec: Any

    def decode(self, data: bytes, flags: int, key: str) -> Any: ...


class Counters:
    """The counter plans of one cache, on whichever node its replica policy picks."""

    def __init__(self, host: CounterHost) -> None:
        self.host = host

    def count(self, node: Node, key: str, delta: int, caller_key: Any, io: Transport) -> Plan:
        """``delta`` added on ``node``: the new value, or None when it lacks the key."""
        if 0 <= delta <= INT64_MAX:
            return self.on_server(node, key, delta, caller_key, io)
        return self.here(node, key, delta, caller_key, io)

    def on_server(self, node: Node, key: str, delta: int, caller_key: Any, io: Transport) -> Plan:
        """The server's ``incr``, which counts modulo 2**64, kept to the signed range.

        From a stored value v in [0, 2**64), the reply is v + delta, or v + delta - 2**64
        when it wrapped, which is then below ``delta``. A wrapped reply or one above
        INT64_MAX is undone by adding 2**64 - delta: modulo 2**64 that restores v exactly,
        whatever other increments ran in between (a CAS-conditional undo would not: an
        overflow on top of ours can wrap the value back into range, which looks like a
        ``set``). Until the undo lands (one round trip) other clients can read the
        out-of-range number, and their increments of the key raise ``OverflowError``
        too; a ``set`` landing inside that round trip is shifted by the undo
        (docs/guarantees.rst, Counters).
        """
        try:
            value = yield from node.request(wire.incr(key.encode(), delta), io)
        except Refused as exc:
            if not exc.client_error:
                raise
            # "non-numeric value": a negative or non-integer value
            return (yield from self.here(node, key, delta, caller_key, io))
        if value is None or delta <= value <= INT64_MAX:
            return value
        if delta:  # a failed undo raises, and the key is deleted as outdated (see incr)
            yield from self.undo(node, key, delta, io)
        raise counter_overflow(caller_key, delta)

    def undo(self, node: Node, key: str, delta: int, io: Transport) -> Plan:
        """Take back an ``incr`` by ``delta`` (modulo 2**64, whatever else was counted
        since): the server's ``incr`` by 2**64 - delta; where the server refuses it,
        the same subtraction by compare-and-swap.

        memcached (1.6.18 among others) can refuse to count a number of 2**63 or more —
        the very numbers an undo starts from — as "non-numeric": its ``safe_strtoull``
        looks for a minus sign with ``strchr``, past the end of the number, in whatever
        memory follows the item. A value that is no longer a number was replaced since:
        nothing to take back.
        """
        try:
            yield from node.request(wire.incr(key.encode(), 2**64 - delta), io)
            return
        except Refused as exc:
            if not exc.client_error:
                raise
        if not (yield from node.speaks_meta(io)):
            # Behind a proxy (twemproxy forwards no meta command) the subtraction cannot
            # be made: the out-of-range counter is deleted before the node serves again,
            # as an outdated copy is, rather than left for every later incr to overflow.
            node.outdated.add((key,))
            return

        def restored(data: bytes, flags: int) -> tuple[bytes, int, bool] | None:
            if not data.rstrip(b" ").isdigit():
                return None  # replaced meanwhile
            return b"%d" % ((int(data) - delta) % 2**64), flags, True  # as incr would

        yield from compare_and_swap(node, key, restored, io)

    def here(self, node: Node, key: str, delta: int, caller_key: Any, io: Transport) -> Plan:
        """What the server's ``incr`` cannot do (negative deltas and values, deltas beyond
        64 bits): compare-and-swap on the meta commands, or without them (memcached
        before 1.6.6, a proxy such as twemproxy) what the classic protocol can do."""
        if (yield from node.speaks_meta(io)):
            return (yield from self.with_cas(node, key, delta, caller_key, io))
        return (yield from self.classic(node, key, delta, caller_key, io))

    def classic(self, node: Node, key: str, delta: int, caller_key: Any, io: Transport) -> Plan:
        """Without the meta commands: a decrement is memcached's own ``decr`` — atomic,
        the lifetime kept, and like it (and Django's ``PyMemcacheCache``) it stops at 0,
        never below. Anything else (a negative stored value, a delta beyond 64 bits)
        would have to rewrite the counter without its lifetime, which the classic
        protocol cannot read: ``MetaCommandsMissing``, the counter unchanged — after the
        answers that need no write: a missing key (None), a value that is not an integer
        (``TypeError``), a result beyond 64 bits (``OverflowError``)."""
        encoded_key = key.encode()
        if -INT64_MAX <= delta < 0:
            try:
                return (yield from node.request(wire.decr(encoded_key, -delta), io))
            except Refused as exc:
                if not exc.client_error:
                    raise  # "non-numeric value": read it to say which
        found = yield from node.request(wire.get_one(encoded_key), io)
        if found is None:
            return None
        value = self.value(found[0], found[1], key, caller_key)
        if value is MISSING:
            return None
        if not INT64_MIN <= value + delta <= INT64_MAX:
            raise counter_overflow(caller_key, delta)
        raise MetaCommandsMissing(
            node.name, f"incr/decr of {caller_key!r} (from {value}, by {delta}) needs the meta "
            "commands (memcached >= 1.6.6; proxies such as twemproxy do not forward them): "
            "the classic protocol cannot keep the entry's lifetime; unchanged"
        )

    def with_cas(self, node: Node, key: str, delta: int, caller_key: Any, io: Transport) -> Plan:
        """``incr`` computed here and stored only if the item did not change meanwhile
        (compare-and-swap on the meta commands, which keep the item's lifetime); retried
        while others change it (:func:`compare_and_swap`).

        Like MySQLCache, only values stored as integers count (a pickled int beyond 64
        bits raises ``TypeError``); a corrupt one is a logged miss.
        """
        def counted(data: bytes, flags: int) -> tuple[bytes, int, int] | None:
            value = self.value(data, flags, key, caller_key)
            if value is MISSING:
                return None
            result = value + delta
            if not (INT64_MIN <= value <= INT64_MAX and INT64_MIN <= result <= INT64_MAX):
                raise counter_overflow(caller_key, delta)  # (beyond: another's undo is due)
            return (*self.host.codec.encode(result, key), result)

        return (yield from compare_and_swap(node, key, counted, io))

    def value(self, data: bytes, flags: int, key: str, caller_key: Any) -> Any:
        """A stored integer (read under the stored ``key``); ``TypeError`` naming the
        ``caller_key`` for any other value, MISSING when corrupt."""
        if flags not in (FLAG_INTEGER, FLAG_LONG):
            raise TypeError(f"The value of key '{caller_key}' is not an integer")
        return self.host.decode(data, flags, key)


def compare_and_swap(node: Node, key: str,
                     rewrite: Callable[[bytes, int], tuple[bytes, int, Any] | None],
                     io: Transport) -> Plan:
    """The item under ``key`` rewritten only if it did not change meanwhile (the meta
    commands' compare-and-swap, which keeps its lifetime), retried while others change
    it, for up to CAS_PATIENCE seconds. ``rewrite(data, flags)`` gives the new data,
    flags and the plan's result, or None to leave the item (the plan's result then, as
    for a missing key). The value and its CAS come from two reads that agree
    (``wire.meta_get_settled``): one read alone can pair the value before a server
    ``incr`` with the CAS after it."""
    encoded_key = key.encode()
    deadline = time.monotonic() + CAS_PATIENCE
    while time.monotonic() < deadline:
        found = yield from node.request(wire.meta_get_settled(encoded_key), io)
        if found is wire.UNSETTLED:
            continue  # an incr replaced the item as it was read
        if found is None:
            return None
        data, flags, ttl, cas = found
        change = rewrite(data, flags)
        if change is None:
            return None
        new_data, new_flags, result = change
        ttl = yield from absolute_if_long(node, ttl, io)
        if (yield from node.request(wire.meta_cas(encoded_key, new_data, new_flags, ttl, cas), io)):
            return result
        yield Sleep(random.random() / 1000)  # someone else won: let them get out of the way
    raise MemcachedError(node.name, f"{key!r} kept changing for {CAS_PATIENCE} s of retries")


def absolute_if_long(node: Node, ttl: int, io: Transport) -> Plan:
    """A remaining lifetime as memcached takes it back: over 30 days, a Unix time on the
    server's own clock (ours runs up to 2 s ahead: it would stretch the lifetime at every
    update)."""
    if ttl <= THIRTY_DAYS:
        return ttl
    return ttl + (yield from node.request(wire.stats(), io))["time"]
