"""A TCP proxy in front of one memcached that can answer one ``mg`` as memcached does when
an ``incr`` from another connection replaces the item while that ``mg`` holds it (a fault
only: the race is a matter of nanoseconds on a real server).

memcached's ``do_add_delta``, when it cannot change the number in place (the item is being
read, or the new number is longer), links a new item and then gives the old one the new
item's CAS; a reader still holding the old item answers with its value and that CAS. Armed
with a key and an increment, the proxy answers the next ``mg`` of the key that asks for
the CAS with exactly that: the value before the increment, which it then applies from a
connection of its own, and the CAS after it. Everything else is forwarded as it is, and
what followed the ``mg`` in the same request reaches the server after the answer.
"""
from __future__ import annotations

import re
import socket

from tests.lost_reply_proxy import LostReplyProxy, chunks, close, send


class RacingReadProxy(LostReplyProxy):
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.racing: tuple[bytes, int] | None = None
        self.races = 0
        super().__init__(upstream_host, upstream_port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def race_next_read(self, key: bytes, increment: int) -> None:
        """Answer the next ``mg`` of ``key`` with its value before ``increment`` (applied
        meanwhile) and the CAS after it."""
        with self.lock:
            self.racing = (key, increment)

    def client_to_server(self, client: socket.socket, server: socket.socket, pair: dict) -> None:
        for chunk in chunks(client):
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
