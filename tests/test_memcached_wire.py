"""The sans-IO protocol core: every reply parses the same however the bytes arrive.

No server here: each reply is fed whole, split in two at every byte boundary, and one
byte at a time, and must give the same result. The live checks of the same ops against
memcached are in test_memcached_lifecycle/test_memcached_ops.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest

from django_kvcache.memcached import wire

VALUE = b"line one\r\nEND\r\nVALUE fake 0 3\r\n"  # a value that looks like protocol lines


def feed_split(reply_bytes: bytes, make_reply: Callable[[], Any]) -> list[Any]:
    """The parsed result for every way of cutting ``reply_bytes`` in two, and for one
    byte at a time. A reply must never claim to be complete before its last byte."""
    results = []
    cuts = [[reply_bytes[:i], reply_bytes[i:]] for i in range(len(reply_bytes) + 1)]
    cuts.append([reply_bytes[i : i + 1] for i in range(len(reply_bytes))])
    for chunks in cuts:
        buffer, reply = wire.Buffer(), make_reply()
        fed = 0
        complete = reply.parse(buffer)
        for chunk in filter(None, chunks):
            assert not complete, f"complete after {fed} of {len(reply_bytes)} bytes"
            buffer.feed(chunk)
            fed += len(chunk)
            complete = reply.parse(buffer)
        assert complete, "incomplete after every byte"
        assert len(buffer) == 0, "bytes left over"
        results.append(reply.result)
    return results


def parses_to(reply_bytes: bytes, make_reply: Callable[[], Any], expected: Any) -> None:
    for result in feed_split(reply_bytes, make_reply):
        assert result == expected


def test_get_reply_with_values_and_misses():
    reply = (
        b"VALUE a 16 3\r\nabc\r\n"
        b"VALUE b 2 %d\r\n%b\r\n" % (len(VALUE), VALUE) +
        b"VALUE empty 0 0\r\n\r\nEND\r\n"
    )
    asked = {b"a", b"b", b"empty", b"missing"}
    parses_to(reply, lambda: wire.Values(asked),
              {b"a": (b"abc", 16), b"b": (VALUE, 2), b"empty": (b"", 0)})
    parses_to(b"END\r\n", lambda: wire.Values(asked), {})


@pytest.mark.parametrize("value", [b"", b"v", VALUE, b"x\r\nEND\r\n", b"END\r\n\r\nEND"])
def test_single_key_reply_whole_or_in_pieces(value):
    """A one-key reply that arrives whole takes a shortcut; in pieces, the line parser."""
    reply = b"VALUE k 7 %d\r\n%b\r\nEND\r\n" % (len(value), value)
    parses_to(reply, lambda: wire.OneValue(b"k"), (value, 7))
    parses_to(reply, lambda: wire.Values({b"k"}), {b"k": (value, 7)})


def test_single_key_miss_whole_or_in_pieces():
    parses_to(b"END\r\n", lambda: wire.OneValue(b"k"), None)


def test_get_reply_over_several_end_lines():
    reply = b"VALUE a 0 1\r\n1\r\nEND\r\nEND\r\nVALUE c 0 1\r\n3\r\nEND\r\n"
    parses_to(reply, lambda: wire.Values({b"a", b"b", b"c"}, 3), {b"a": (b"1", 0), b"c": (b"3", 0)})


def test_gets_reply_carries_cas():
    parses_to(b"VALUE a 4 2\r\nhi\r\nEND\r\n", lambda: wire.Values({b"a"}, cas=False),
              {b"a": (b"hi", 4)})
    parses_to(b"VALUE a 4 2 99\r\nhi\r\nEND\r\n", lambda: wire.Values({b"a"}, cas=True),
              {b"a": (b"hi", 4, 99)})


@pytest.mark.parametrize(
    "line", [b"STORED", b"NOT_STORED", b"TOUCHED", b"DELETED", b"NOT_FOUND", b"OK", b"EXISTS"]
)
def test_status_lines(line):
    parses_to(line + b"\r\n", lambda: wire.Line("set"), line)


def test_pipelined_status_lines():
    reply = b"STORED\r\nSERVER_ERROR object too large for cache\r\nSTORED\r\n"
    parses_to(reply, lambda: wire.Lines(3, wire.STORE_REPLIES), [
        b"STORED", b"SERVER_ERROR object too large for cache", b"STORED"
    ])


def test_counter_replies():
    op = wire.incr(b"n", 5)
    for line, expected in [(b"42\r\n", 42), (b"NOT_FOUND\r\n", None)]:
        for result in feed_split(line, op.make_reply):
            assert op.finish(result) == expected


def test_error_replies_raise_without_losing_step():
    for line, client_error in [
        (b"SERVER_ERROR out of memory storing object\r\n", False),
        (b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n", True),
    ]:
        buffer = wire.Buffer()
        buffer.feed(line + b"STORED\r\n")
        with pytest.raises(wire.ErrorReply) as refused:
            wire.Line("incr").parse(buffer)
        assert refused.value.client_error is client_error
        assert str(refused.value) in line.decode()
        assert buffer.line() == b"STORED"  # the next reply is intact


def test_unknown_command_and_garbage_are_protocol_errors():
    for make_reply, data in [
        (lambda: wire.Line("set"), b"ERROR\r\n"),
        (lambda: wire.Lines(1), b"ERROR\r\n"),
        (lambda: wire.Values({b"a"}), b"STORED\r\n"),
        (lambda: wire.Values({b"a"}), b"VALUE a 0\r\n"),
        (lambda: wire.Values({b"a"}), b"VALUE a 0 3\r\nabcd\r\n"),  # longer than announced
        (lambda: wire.Values({b"a"}), b"VALUE b 0 1\r\nb\r\nEND\r\n"),  # not asked
        (lambda: wire.OneValue(b"a"), b"VALUE b 0 1\r\nb\r\nEND\r\n"),  # not asked
        (wire.Meta, b"XX 1\r\n"),
        (wire.Stats, b"nonsense\r\n"),
    ]:
        buffer = wire.Buffer()
        buffer.feed(data)
        with pytest.raises(wire.ProtocolError):
            make_reply().parse(buffer)


def test_a_server_error_to_a_get_is_that_request_s_failure():
    """A proxy answers ``SERVER_ERROR`` to a get whose server it cannot reach: the
    request's failure, the connection in step after it (when it ends the reply)."""
    for make_reply, in_step in [(lambda: wire.Values({b"a"}), True),
                                (lambda: wire.OneValue(b"a"), True),
                                (lambda: wire.Values({b"a"}, ends=2), False)]:
        buffer = wire.Buffer()
        buffer.feed(b"SERVER_ERROR Connection refused\r\n")
        with pytest.raises(wire.ErrorReply) as refused:
            make_reply().parse(buffer)
        assert refused.value.in_step is in_step
        assert not refused.value.client_error and not refused.value.refuses_value
    for line, refuses in [(b"SERVER_ERROR object too large for cache", True),
                          (b"SERVER_ERROR out of memory storing object", True),
                          (b"SERVER_ERROR Connection refused", False),
                          (b"CLIENT_ERROR bad data chunk", False)]:
        assert wire.refuses_value(line) is refuses


def test_gets_one_by_one_fail_one_by_one():
    op = wire.get_each([b"a", b"b", b"c"])
    assert op.request == b"get a\r\nget b\r\nget c\r\n"
    reply = b"VALUE a 0 1\r\n1\r\nEND\r\nSERVER_ERROR Connection refused\r\nEND\r\n"
    for result in feed_split(reply, op.make_reply):
        assert result  # the parsers, in order
    parser = op.make_reply()
    buffer = wire.Buffer()
    buffer.feed(reply)
    assert parser.parse(buffer) and parser.in_step
    assert op.result(parser) == ({b"a": (b"1", 0)}, [b"b"])


def test_fence_skips_everything_before_the_version_reply():
    reply = b"STORED\r\nDELETED\r\nSERVER_ERROR out of memory\r\nVERSION 1.6.18\r\n"
    parses_to(reply, wire.Fence, b"1.6.18")


def test_stats_reply():
    reply = b"STAT pid 42\r\nSTAT rusage_user 0.125\r\nSTAT version 1.6.18\r\nEND\r\n"
    parses_to(reply, wire.Stats, {"pid": 42, "rusage_user": 0.125, "version": "1.6.18"})


def test_metadump_lines_end_with_a_bare_newline():
    reply = b"key=a%20b exp=-1 la=1 cas=2 fetch=no cls=1 size=63\nkey=c exp=-1\nEND\r\n"
    for chunks_result in feed_split(reply, lambda: wire.KeyDump(lambda key: None)):
        assert chunks_result is None
    seen: list[str] = []
    buffer = wire.Buffer()
    buffer.feed(reply)
    assert wire.KeyDump(seen.append).parse(buffer)
    assert seen == ["a b", "c"]


def test_meta_replies():
    op = wire.meta_get(b"k")
    parses_to(b"VA 2 f16 t-1 c7\r\nhi\r\n", op.make_reply,
              wire.MetaReply(b"VA", {b"f": b"16", b"t": b"-1", b"c": b"7"}, b"hi"))
    assert op.result(_parsed(op, b"VA 2 f16 t-1 c7\r\nhi\r\n")) == (b"hi", 16, -1, 7)
    assert op.result(_parsed(op, b"EN\r\n")) is None
    cas = wire.meta_cas(b"k", b"1", 2, -1, 7)
    assert cas.request == b"ms k 1 T0 F2 C7\r\n1\r\n"
    for code, stored in [(b"HD", True), (b"EX", False), (b"NF", False), (b"NS", False)]:
        assert cas.result(_parsed(cas, code + b"\r\n")) is stored


def test_a_refusal_of_a_command_that_carried_data_leaves_the_connection_out_of_step():
    """memcached may answer a data command's line before reading its data block (a bad
    command line), so after such a refusal the connection's position is unknown; a
    refusal of a command without data leaves it in step."""
    def in_step_after_refusal(op: wire.Op) -> bool:
        reply = op.make_reply()
        buffer = wire.Buffer()
        buffer.feed(b"CLIENT_ERROR bad command line format\r\n")
        with pytest.raises(wire.ErrorReply) as refused:
            reply.parse(buffer)
        assert refused.value.in_step is reply.in_step
        return reply.in_step

    for op in (wire.store(b"set", b"k", b"v", 0, 0), wire.cas(b"k", b"v", 0, 0, 7),
               wire.meta_cas(b"k", b"v", 0, 0, 7)):
        assert not in_step_after_refusal(op)
    for op in (wire.incr(b"k", 1), wire.touch(b"k", 1), wire.delete(b"k")):
        assert in_step_after_refusal(op)
    many = wire.store_many([(b"a", b"1", 0), (b"b", b"2", 0)], 0)
    reply = _parsed(many, b"STORED\r\nSERVER_ERROR object too large for cache\r\n")
    assert reply.result == [b"STORED", b"SERVER_ERROR object too large for cache"]
    assert reply.in_step is False
    sequence = wire.meta_sequence([b"mg a v\r\n", b"ms b 1\r\nx\r\n"], True)
    reply = _parsed(sequence, b"EN\r\nSERVER_ERROR out of memory\r\n")
    assert [r.code for r in reply.result] == [b"EN", b"SERVER_ERROR"] and not reply.in_step
    assert _parsed(sequence, b"SERVER_ERROR busy\r\nHD\r\n").in_step  # mg refused


@pytest.mark.parametrize("op, reply", [
    (wire.get_one(b"k"), b"VALUE k x 1\r\nv\r\nEND\r\n"),
    (wire.get_many([b"k"]), b"VALUE k 0 -1\r\nEND\r\n"),
    (wire.gets_one(b"k"), b"VALUE k 0 1 cas\r\nv\r\nEND\r\n"),
    (wire.meta_get(b"k"), b"VA 1 t5 c1\r\nv\r\n"),
    (wire.meta_get(b"k"), b"VA 1 fx t5 c1\r\nv\r\n"),
    (wire.meta_ttl(b"k"), b"HD\r\n"),
    (wire.stats(), b"STAT pid\r\nEND\r\n"),
    (wire.key_dump(lambda key: None), b"key=\xff\xfe exp=-1\nEND\r\n"),
    (wire.store(b"set", b"k", b"v", 0, 0), b"VALUE\r\n"),
    (wire.delete(b"k"), b"STORED\r\n"),
    (wire.touch(b"k", 1), b"DELETED\r\n"),
    (wire.delete_many([b"a"]), b"HELLO\r\n"),
    (wire.incr(b"k", 1), b"-1\r\n"),
    # numbers Python will not convert (over 4300 digits): through both get shortcuts
    (wire.get_one(b"k"), b"VALUE k 0 " + b"9" * 5000 + b"\r\nv\r\nEND\r\n"),
    (wire.get_many([b"k"]), b"VALUE k " + b"9" * 5000 + b" 1\r\nv\r\nEND\r\n"),
])
def test_a_reply_we_cannot_read_is_a_protocol_error(op, reply):
    """Never a ValueError or KeyError: those would pass by the node's failure handling."""
    with pytest.raises(wire.ProtocolError):
        op.result(_parsed(op, reply))


def test_meta_probe():
    probe = wire.meta_probe()
    assert probe.result(_parsed(probe, b"MN\r\n")) is True
    assert probe.result(_parsed(probe, b"ERROR\r\n")) is False  # memcached < 1.6.6


def test_requests():
    assert wire.get_one(b"k").request == b"get k\r\n"
    keys = [b"k%d" % i for i in range(wire.GET_KEYS_PER_LINE + 1)]
    request = wire.get_many(keys).request
    assert request.count(b"\r\n") == 2 and request.startswith(b"get k0 k1 ")
    assert wire.store(b"add", b"k", b"v\r\n", 5, 60).request == b"add k 5 60 3\r\nv\r\n\r\n"
    assert wire.store_many([(b"a", b"1", 0), (b"b", b"", 2)], 0).request == (
        b"set a 0 0 1\r\n1\r\nset b 2 0 0\r\n\r\n"
    )
    assert wire.touch(b"k", -1).request == b"touch k -1\r\n"
    assert wire.delete_many([b"a", b"b"]).request == b"delete a\r\ndelete b\r\n"
    assert wire.incr(b"k", 2**64 - 1).request == b"incr k 18446744073709551615\r\n"
    assert wire.flush_all().request == b"flush_all\r\n"
    assert wire.fence().request == wire.FENCE == b"version\r\n"
    assert wire.meta_command(b"md", b"k", b"q", b"O9") == b"md k q O9\r\n"
    assert wire.meta_command(b"mn", b"") == b"mn\r\n"


def test_every_attempt_gets_a_fresh_parser():
    op = wire.get_many([b"a", b"b"])
    first, second = op.make_reply(), op.make_reply()
    assert first is not second
    buffer = wire.Buffer()
    buffer.feed(b"VALUE a 0 1\r\n1\r\n")
    assert not first.parse(buffer)
    buffer2 = wire.Buffer()
    buffer2.feed(b"END\r\n")
    assert second.parse(buffer2) and second.result == {}


def _parsed(op: wire.Op, data: bytes) -> Any:
    buffer, reply = wire.Buffer(), op.make_reply()
    buffer.feed(data)
    assert reply.parse(buffer)
    return reply
