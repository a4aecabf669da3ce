"""The door of a warm world's listening socket: who connects must prove it is one of its ranks.

Anyone on the host can connect to the controller's port on loopback. A connection becomes a
rank's channel only once it sent one line - a JSON object with this world's token and a rank
number not yet taken - and until then it is a stranger's: read without blocking, at most
:data:`HELLO_LIMIT` bytes, within :data:`HELLO_TIMEOUT` seconds, parsed by code that can only
succeed or reject (:mod:`pytest_msrun.boundedjson`), and at most :data:`MAX_STRANGERS` at once
(the oldest is shed). Whatever a stranger sends costs it its connection, never the test.
"""

from __future__ import annotations

import hmac
import socket
import time
from typing import Any

from pytest_msrun import boundedjson

HELLO_LIMIT = 1 << 20  # a hello names the environment variables a rank read: small, but not tiny
HELLO_DEPTH = 4
HELLO_TIMEOUT = 10.0
MAX_STRANGERS = 64


class Greeter:
    """Connections on ``server`` that have not said who they are yet."""

    def __init__(self, server: socket.socket, token: str) -> None:
        self.server = server
        self.token = token
        self.waiting: dict[socket.socket, tuple[bytearray, float]] = {}  # oldest first
        self.refused = 0

    def fds(self) -> list[socket.socket]:
        return [self.server, *self.waiting]

    def accept(self) -> None:
        while True:
            try:
                conn, _addr = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the next look tries again
                return
            conn.setblocking(False)
            if len(self.waiting) >= MAX_STRANGERS:
                self._refuse(next(iter(self.waiting)))
            self.waiting[conn] = (bytearray(), time.monotonic() + HELLO_TIMEOUT)

    def read(self, conn: socket.socket) -> tuple[int, dict[str, Any]] | None:
        """(rank, hello) once ``conn`` said a valid hello; None while it has not (or was refused)."""
        buf, deadline = self.waiting[conn]
        try:
            data = conn.recv(HELLO_LIMIT + 1 - len(buf))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data = b""
        if not data:
            self._refuse(conn)
            return None
        buf += data
        line, newline, rest = bytes(buf).partition(b"\n")
        if not newline:
            if len(buf) > HELLO_LIMIT:
                self._refuse(conn)
            return None
        try:
            hello = boundedjson.loads(line, max_depth=HELLO_DEPTH)
        except boundedjson.Rejected:
            hello = None
        rank = hello.get("rank") if isinstance(hello, dict) else None
        token = hello.get("token") if isinstance(hello, dict) else None
        if (
            rest  # a rank waits for its first command after its hello
            or not isinstance(rank, int)
            or isinstance(rank, bool)
            or not isinstance(token, str)
            or not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self.token.encode())
        ):
            self._refuse(conn)
            return None
        del self.waiting[conn]
        assert isinstance(hello, dict)
        return rank, hello

    def expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c, (_, deadline) in self.waiting.items() if now > deadline]:
            self._refuse(conn)

    def _refuse(self, conn: socket.socket) -> None:
        self.waiting.pop(conn, None)
        self.refused += 1
        try:
            conn.close()
        except OSError:
            pass

    def close(self) -> None:
        for conn in list(self.waiting):
            self._refuse(conn)
