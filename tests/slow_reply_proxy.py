"""A TCP proxy that forwards a MySQL conversation and holds back replies (a fault only: a
slow server, for one kind of statement).

Armed with a byte string and a delay, it forwards every client packet at once, and holds
the server's reply to each statement whose bytes contain the string for that long before
forwarding it: the statement runs, its answer is late.
"""
from __future__ import annotations

import socket
import time

from tests.lost_reply_proxy import LostReplyProxy, chunks, close, send


class SlowReplyProxy(LostReplyProxy):
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.slow: tuple[bytes, float] | None = None
        self.replies_held = 0
        super().__init__(upstream_host, upstream_port)

    def delay_replies_to(self, trigger: bytes, seconds: float) -> None:
        """Hold the reply to every statement containing ``trigger`` for ``seconds``."""
        with self.lock:
            self.slow = (trigger, seconds)

    def forwarding(self, sent: bytes, pair: dict) -> None:
        if self.slow is not None and self.slow[0] in sent:
            pair["hold_until"] = time.monotonic() + self.slow[1]  # before it is sent

    def server_to_client(self, server: socket.socket, client: socket.socket, pair: dict) -> None:
        for chunk in chunks(server):
            hold_until = pair.pop("hold_until", None)
            if hold_until is not None:
                time.sleep(max(0.0, hold_until - time.monotonic()))
                with self.lock:
                    self.replies_held += 1
            if not send(client, chunk):
                break
        close(client, server)
