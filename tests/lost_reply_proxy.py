"""A TCP proxy that forwards a MySQL conversation and can lose one reply (a fault only).

Armed with a byte string, it forwards the next client packet containing it to the server,
lets the server run the statement, and then closes both connections as the server's
reply arrives, without forwarding it: the client sees "lost connection during query"
(2013) for a statement the server has applied.
"""
from __future__ import annotations

import socket
import threading
from typing import Iterator

from tests.servers import free_port

TAIL = 256  # bytes kept from the previous chunk, so a trigger split across reads is seen


class LostReplyProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.trigger: bytes | None = None
        self.replies_lost = 0
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.start_thread(self.accept_loop)

    def drop_reply_to(self, trigger: bytes) -> None:
        """Lose the server's reply to the next statement whose bytes contain ``trigger``."""
        with self.lock:
            self.trigger = trigger

    def start_thread(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def accept_loop(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed by stop()
                return
            server = socket.create_connection(self.upstream, timeout=10)
            server.settimeout(None)
            pair = {"lose_reply": False}
            self.sockets += [client, server]
            self.start_thread(self.client_to_server, client, server, pair)
            self.start_thread(self.server_to_client, server, client, pair)

    def client_to_server(self, client: socket.socket, server: socket.socket, pair: dict) -> None:
        tail = b""
        for chunk in chunks(client):
            with self.lock:
                self.forwarding(tail + chunk, pair)
            tail = chunk[-TAIL:]
            if not send(server, chunk):
                break
        close(client, server)

    def forwarding(self, sent: bytes, pair: dict) -> None:
        """Client bytes (with the tail of the chunk before) are about to reach the server."""
        if self.trigger is not None and self.trigger in sent:
            self.trigger = None
            pair["lose_reply"] = True

    def server_to_client(self, server: socket.socket, client: socket.socket, pair: dict) -> None:
        for chunk in chunks(server):
            if pair["lose_reply"]:  # the statement ran; its reply never arrives
                with self.lock:
                    self.replies_lost += 1
                break
            if not send(client, chunk):
                break
        close(client, server)

    def stop(self) -> None:
        close(self.listener)  # shutdown() wakes the thread blocked in accept()
        for sock in self.sockets:
            close(sock)
        for thread in self.threads:
            thread.join(timeout=10)


def chunks(sock: socket.socket) -> Iterator[bytes]:
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        yield chunk


def send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def close(*sockets: socket.socket) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
