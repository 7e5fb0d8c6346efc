"""A TCP proxy in front of one memcached that can answer a request as memcached does in two
rare cases (faults only: on a real server they are a matter of nanoseconds, or of what
bytes follow an item in memory).

* :meth:`MemcachedFaultProxy.race_next_read` — an ``mg`` racing an ``incr``:

  memcached's ``do_add_delta``, when it cannot change the number in place (the item is
  being read, or the new number is longer), links a new item and then gives the old one
  the new item's CAS; a reader still holding the old item answers with its value and that
  CAS. Armed with a key and an increment, the proxy answers the next ``mg`` of the key
  that asks for the CAS with exactly that: the value before the increment, which it then
  applies from a connection of its own, and the CAS after it.
* :meth:`MemcachedFaultProxy.refuse_next` — a request answered with an error line instead
  of being forwarded: memcached 1.6.18 refuses to ``incr`` a number of 2**63 or more as
  "non-numeric" when a minus sign follows the item in memory (its ``safe_strtoull``
  searches for one with ``strchr``, past the end of the number).

Everything else is forwarded as it is, and what followed the request in the same chunk
reaches the server after the answer.
"""
from __future__ import annotations

import re
import socket

from tests.lost_reply_proxy import LostReplyProxy, chunks, close, send


class MemcachedFaultProxy(LostReplyProxy):
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.racing: tuple[bytes, int] | None = None
        self.races = 0
        self.refusing: tuple[bytes, bytes] | None = None
        self.refusals = 0
        super().__init__(upstream_host, upstream_port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def race_next_read(self, key: bytes, increment: int) -> None:
        """Answer the next ``mg`` of ``key`` with its value before ``increment`` (applied
        meanwhile) and the CAS after it."""
        with self.lock:
            self.racing = (key, increment)

    def refuse_next(self, request_line: bytes, answer: bytes) -> None:
        """Answer the next request whose first line is ``request_line`` with ``answer``
        (an error line), without forwarding it."""
        with self.lock:
            self.refusing = (request_line, answer)

    def client_to_server(self, client: socket.socket, server: socket.socket, pair: dict) -> None:
        for chunk in chunks(client):
            with self.lock:
                refusing = self.refusing
                if refusing is not None and chunk.startswith(refusing[0] + b"\r\n"):
                    self.refusing = None
                    self.refusals += 1
                    chunk = chunk[len(refusing[0]) + 2:]
                else:
                    refusing = None
            if refusing is not None and not send(client, refusing[1]):
                break
            with self.lock:
                racing, self.racing = self.racing, None
            if racing is not None:
                line, sep, rest = chunk.partition(b"\r\n")
                words = line.split()
                if sep and words[:2] == [b"mg", racing[0]] and b"c" in words[2:]:
                    if not send(client, self.raced_answer(line + sep, *racing)):
                        break
                    chunk = rest
                else:
                    with self.lock:
                        self.racing = racing  # not the read it waits for
            if chunk and not send(server, chunk):
                break
        close(client, server)

    def raced_answer(self, request: bytes, key: bytes, increment: int) -> bytes:
        with socket.create_connection(self.upstream, timeout=10) as side:
            replies = side.makefile("rb")
            side.sendall(request)
            head = replies.readline()
            value = replies.read(int(head.split()[1]) + 2) if head.startswith(b"VA ") else b""
            side.sendall(b"incr %b %d\r\nmg %b c\r\n" % (key, increment, key))
            replies.readline()  # the increment's new value
            after = replies.readline().split()[1]  # HD c<cas>
        with self.lock:
            self.races += 1
        return re.sub(rb" c\d+", b" " + after, head, count=1) + value
