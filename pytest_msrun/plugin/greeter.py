"""The door of a warm world's listening socket: who connects must prove it is one of its ranks.

Anyone on the host can connect to the controller's port on loopback. A connection becomes a
rank's channel only once it sent one line - a JSON object with this world's token and a rank
number not yet taken - and until then it is a stranger's: read without blocking, at most
:data:`HELLO_LIMIT` bytes, within :data:`HELLO_TIMEOUT` seconds, parsed by code that can only
succeed or reject (:mod:`pytest_msrun.boundedjson`), and at most :data:`MAX_STRANGERS` at once
(beyond, what everyone sent is read - a rank's hello comes at once - and the oldest still silent
is shed). Whatever a stranger sends costs it its connection, never the test.
"""

from __future__ import annotations

import hmac
import select
import socket
import time
from typing import Any

from pytest_msrun import boundedjson

HELLO_LIMIT = 256 * 1024  # a hello names the environment variables a rank read: small, but not tiny
HELLO_DEPTH = 4
HELLO_TIMEOUT = 10.0
MAX_STRANGERS = 256  # waiting at once (at most 64 MiB of buffers); beyond, the oldest silent one is shed
Admitted = tuple[socket.socket, int, dict[str, Any]]  # a rank's connection, its number and its hello


class Greeter:
    """Connections on ``server`` that have not said who they are yet."""

    def __init__(self, server: socket.socket, token: str) -> None:
        self.server = server
        self.token = token
        self.waiting: dict[socket.socket, tuple[bytearray, float]] = {}  # oldest first
        self.refused = 0

    def serve(self, timeout: float) -> list[Admitted]:
        """Wait up to ``timeout`` s; returns who proved to be a rank meanwhile (socket, rank, hello)."""
        admitted: list[Admitted] = []
        ready, _, _ = select.select([self.server, *self.waiting], [], [], timeout)
        for sock in ready:
            if sock is self.server:
                admitted += self._accept()
            elif sock in self.waiting:
                said = self._read(sock)
                if said is not None:
                    admitted.append(said)
        self._expire()
        return admitted

    def _accept(self) -> list[Admitted]:
        admitted: list[Admitted] = []
        while True:
            try:
                conn, _addr = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return admitted
            except OSError:  # out of descriptors: the next look tries again
                return admitted
            conn.setblocking(False)
            if len(self.waiting) >= MAX_STRANGERS:
                admitted += self._shed()
            self.waiting[conn] = (bytearray(), time.monotonic() + HELLO_TIMEOUT)

    def _shed(self) -> list[Admitted]:
        """Make room: first read what everyone waiting has sent (a rank sends its hello the moment it
        connects, so it is let in, not shed), then refuse the oldest still waiting."""
        admitted = [said for said in map(self._read, list(self.waiting)) if said is not None]
        if len(self.waiting) >= MAX_STRANGERS:
            self._refuse(next(iter(self.waiting)))
        return admitted

    def _read(self, conn: socket.socket) -> Admitted | None:
        """(conn, rank, hello) once ``conn`` said a valid hello; None while it has not (or was refused)."""
        buf, _deadline = self.waiting[conn]
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
            or not isinstance(hello, dict)
            or not isinstance(rank, int)
            or isinstance(rank, bool)
            or not isinstance(token, str)
            or not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self.token.encode())
        ):
            self._refuse(conn)
            return None
        del self.waiting[conn]
        return conn, rank, hello

    def _expire(self) -> None:
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
