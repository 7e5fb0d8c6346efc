"""What compression saved, per kind of value: whether it is worth trying on the next one.

The codec stores a value compressed only when compression takes at least
``COMPRESS_MIN_SAVING`` of its bytes off (``Codec.payload``); a value that does not
shrink that much is stored as it is, and reading it runs no decompressor. Finding that
out costs a whole compression, about as much as compressing a value that pays: random
or already-compressed bytes, tokens and other high-entropy text would cost every write
a compression whose result is thrown away. So the codec remembers, per kind of value —
its Python type and the power of two its serialized size falls under — what
compression saved on the values of that kind it tried (an exponentially weighted
average), and stops trying a kind whose average is below the threshold: it then
compresses only one value of that kind in ``SAMPLE_EVERY``, which keeps the average up
to date, so a kind whose values change (a dictionary installed, other content) is
compressed again after a few samples. A kind skipped loses at most the threshold's share
of its bytes on average, the same bound each value has.

The record is shared by every cache of one compression setting in the process (Django
builds a cache instance per thread and per ASGI request, each with its own codec), and
holds only types and numbers, never a value or a key.
"""
from __future__ import annotations

import functools
from typing import Hashable

#: A kind whose values saved less than the threshold on average is compressed again once
#: in this many of its values (its other values are stored without trying).
SAMPLE_EVERY = 16
#: The weight of the newest saving in a kind's average: a quarter, so that one sample of
#: content that now compresses well (0.75 saved) lifts an average of 0.2 over 0.25.
WEIGHT = 0.25
#: Kinds remembered at most (types times size classes): past it, everything is forgotten
#: and learnt again, so a process storing many types keeps a bounded record.
MAX_KINDS = 512


class Savings:
    """The average share of bytes compression took off each kind of value it was tried on."""

    __slots__ = ("min_saving", "kinds")

    def __init__(self, min_saving: float) -> None:
        self.min_saving = min_saving
        #: kind -> [average saving, values not tried since the last sample]
        self.kinds: dict[Hashable, list[float]] = {}

    def worth_trying(self, kind: Hashable) -> bool:
        """Whether to compress the next value of ``kind``: yes unless its values did not
        pay on average, and then once in SAMPLE_EVERY values."""
        state = self.kinds.get(kind)
        if state is None or state[0] >= self.min_saving:
            return True
        state[1] += 1  # a lost increment between threads only moves the next sample
        if state[1] < SAMPLE_EVERY:
            return False
        state[1] = 0
        return True

    def record(self, kind: Hashable, saving: float) -> None:
        """What compression took off a value of ``kind``, as a share of its bytes."""
        state = self.kinds.get(kind)
        if state is None:
            if len(self.kinds) >= MAX_KINDS:
                self.kinds.clear()
            self.kinds[kind] = [saving, 0]
        else:
            state[0] += (saving - state[0]) * WEIGHT


@functools.lru_cache(maxsize=64)
def shared_savings(setting: Hashable, min_saving: float) -> Savings:
    """The record of every codec with this compression ``setting`` and threshold."""
    return Savings(min_saving)
