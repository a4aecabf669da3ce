"""The control plane's transport: connections, frames, authentication, deadlines, shedding.

A :class:`Transport` owns the listening socket and every connection of one event loop. It reads
frames (:mod:`.wire`) and hands them on to a :class:`Handler` only once a client has
authenticated (challenge-response over the job's token, answered with ``welcome``); a connection
that opens with MindSpore's RPC magic is handed over as a foreign protocol instead.

Deadlines tell attackers from slow friends:

* a client must send its ``hello`` within ``MSRUN_AUTH_TIMEOUT`` (5 s) of connecting and answer the
  challenge within the same time of receiving it - measured by a :class:`LoopClock`, which does
  not count time this process itself could not run (a loaded machine starves the scheduler too:
  its peers' answers are waiting in its sockets, not late);
* at most ``max_pending`` connections may be unauthenticated; beyond that the oldest that has not
  sent a whole hello is shed, else the oldest waiting for its challenge's answer - after reading
  what it already sent, so a client that answered is never shed (our clients retry when they are);
* out of file descriptors, accepting pauses instead of spinning.
"""

from __future__ import annotations

import _socket  # not socket: its import (enums) is a cost on the forked control plane's start
import errno
import os
import selectors
import time

from pytest_msrun.control import wire
from pytest_msrun.control.clock import ConfigError, LoopClock, env_seconds
from pytest_msrun.control.wire import AGENT_FD_ENV

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any, Protocol

    class Handler(Protocol):
        """What the transport calls: authenticated hellos, messages, ends, foreign protocols."""

        def on_hello(self, conn: Conn, hello: dict[str, Any]) -> None: ...

        def on_message(self, conn: Conn, msg: dict[str, Any]) -> None: ...

        def on_lost(self, conn: Conn, why: str) -> None: ...

        def on_foreign(self, conn: Conn) -> None: ...

        def on_relay(self, conn: Conn, data: bytes) -> None: ...


__all__ = ["AGENT_FD_ENV", "ConfigError", "Conn", "LoopClock", "Transport", "env_seconds"]

PENDING_FLOOR = 256  # unauthenticated connections kept at most: max(this, 2 x worker_num)
ACCEPT_PAUSE = 0.1  # out of file descriptors with nothing to shed: stop accepting this long
MINDSPORE_MAGIC = b"RPC"  # the first bytes of every MindSpore RPC message (see msbridge)
CLIENT_KINDS = ("agent", "rank", "observer")  # authenticated clients of our own protocol
DEFAULT_AUTH_TIMEOUT = 5.0


def format_error(exc: BaseException) -> str:
    """``exc`` with its traceback, for the log (imported only when something went wrong)."""
    import traceback

    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


class Conn:
    """One client connection and its buffers."""

    __slots__ = (
        "sock",
        "peer",
        "frames",
        "out",
        "kind",
        "opened",
        "last_seen",
        "closing",
        "head",
        "pair",
        "pending",
        "hello",
        "nonce",
        "broken",
        "draining",
        "writing",
        "deadline",
        "local",
    )

    def __init__(self, sock: _socket.socket, peer: str, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.frames = wire.FrameBuffer(strict=True)  # a stranger's frames until it authenticated
        self.out = bytearray()
        # "" until authenticated, then "agent", "rank" or "observer"; relayed MindSpore
        # connections are "foreign" (the client) and "upstream" (to the MindSpore scheduler).
        self.kind = ""
        self.opened = self.last_seen = now  # loop-clock times
        self.closing = False
        self.head: bytes | None = b""  # first bytes until we know whose protocol this is, then None
        self.pair: Conn | None = None  # the other end of a relayed connection
        self.pending = bytearray()  # relayed bytes waiting for the other end to connect
        self.hello: dict[str, Any] | None = None  # the hello, until the client proved the token
        self.nonce = ""  # our challenge to it
        self.broken = False  # a send failed: it is dropped once what it already sent was handled
        self.draining = 0.0  # when closing: until then, read and discard (so the close is no RST)
        self.writing = False  # registered for EVENT_WRITE (output is waiting)
        self.deadline = 0.0  # loop-clock time by which it must have authenticated (0: none)
        self.local = False  # msrun's end of a socketpair it made when it forked this process


class Transport:
    """Every connection of one control-plane process."""

    def __init__(
        self,
        listener: _socket.socket,
        handler: Handler,
        *,
        token: str,
        auth_timeout: float,
        max_pending: int,
        log: Callable[[str], None],
    ) -> None:
        self.listener = listener
        self.handler = handler
        self.token = token
        self.auth_timeout = auth_timeout
        self.max_pending = max(PENDING_FLOOR, max_pending)
        self.log = log
        self.sel = selectors.DefaultSelector()
        self.clock = LoopClock()
        self.conns: dict[int, Conn] = {}
        # Connections that have not authenticated yet, oldest first (each holds at most one frame).
        self.pending: dict[Conn, None] = {}
        self.limit = wire.message_limit()
        self.accept_paused_until = 0.0
        self.shed = 0
        self.dropped: dict[str, int] = {}  # why -> unauthenticated connections dropped so far
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)

    # ---------------------------------------------------------------- sending
    def send(self, conn: Conn, msg: dict[str, Any] | bytes) -> None:
        """Queue ``msg`` (or an already encoded frame) for ``conn`` and send what the socket takes."""
        if conn.sock.fileno() < 0 or conn.broken:
            return
        conn.out += msg if isinstance(msg, bytes) else wire.encode(msg)
        self.flush(conn)

    def broadcast(self, conns: Iterable[Conn], msg: dict[str, Any]) -> None:
        """The same message to many: encoded once (an all-gather reply to N ranks is O(N), not O(N^2))."""
        frame = wire.encode(msg)
        for conn in conns:
            self.send(conn, frame)

    def flush(self, conn: Conn) -> None:
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            # The peer is gone or going; the messages it sent before are still to be handled (a
            # node's "done" may follow the heartbeat whose reply failed), so its end is decided
            # by the read side.
            conn.out.clear()
            conn.broken = True
        if conn.writing != bool(conn.out):  # a system call only when the interest changes
            conn.writing = bool(conn.out)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
            try:
                self.sel.modify(conn.sock, events, conn)
            except (KeyError, ValueError):
                pass
        if conn.closing and not conn.out and not conn.draining:
            # A lingering close: our FIN now, then discard what the peer still sends until it
            # closes too - closing with unread data would send an RST that can destroy the
            # message just sent (a refusal, say) before the peer reads it.
            conn.draining = self.clock.now + 2.0
            try:
                conn.sock.shutdown(_socket.SHUT_WR)
            except OSError:
                self.close(conn)

    # ---------------------------------------------------------------- ending connections
    def close(self, conn: Conn) -> None:
        self.pending.pop(conn, None)
        fd = conn.sock.fileno()
        if fd < 0:
            return
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self.conns.pop(fd, None)
        conn.sock.close()

    def drop(self, conn: Conn, why: str, quiet: bool = False, category: str = "") -> None:
        """Forget a client (its handler hears of it first; an error there is logged, and the
        connection is closed all the same). Unauthenticated ones are counted by ``category``
        (``why`` when not given): a stranger's input must not choose how many counters exist."""
        self.pending.pop(conn, None)
        if conn.sock.fileno() < 0:
            return
        if conn.kind == "":
            key = category or why
            self.dropped[key] = self.dropped.get(key, 0) + 1
            if not quiet:
                self.log(f"dropped client {conn.peer}: {why}")
        try:
            self.handler.on_lost(conn, why)
        except Exception as exc:
            self.log(f"error handling the loss of {conn.peer} ({why}):\n{format_error(exc)}")
        finally:
            self.close(conn)

    def fault(self, conn: Conn | None, exc: Exception) -> None:
        """The fault boundary: an error while serving one connection (a bug, or input no check
        foresaw) is logged with its traceback and costs that connection, never this process."""
        who = "the listener" if conn is None else f"{conn.peer} ({conn.kind or 'unauthenticated'})"
        self.log(f"error serving {who}; it is dropped:\n{format_error(exc)}")
        if conn is not None:  # drop() itself cannot fail: its handler's errors are logged
            self.drop(conn, f"an error while serving it: {exc!r}"[:300], category="an error while serving it")

    def refuse(self, conn: Conn, reason: str) -> None:
        self.log(f"refused {conn.peer}: {reason}")
        if conn.kind == "":
            self.dropped[f"refused: {reason}"] = self.dropped.get(f"refused: {reason}", 0) + 1
        conn.out += wire.encode({"t": "refused", "reason": reason})
        conn.closing = True
        self.flush(conn)

    def authenticated(self, conn: Conn, kind: str) -> None:
        """``conn`` is a client of ``kind`` now: no deadline, the full message size."""
        conn.kind = kind
        conn.deadline = 0.0
        self.pending.pop(conn, None)
        conn.frames.trust(self.limit)

    # ---------------------------------------------------------------- authentication
    def _authenticate(self, conn: Conn, msg: dict[str, Any]) -> None:
        """hello -> challenge -> auth -> welcome (see :mod:`.wire`): only then is the hello acted on."""
        if conn.hello is None:
            nonce = msg.get("nonce")
            if msg["t"] != "hello" or msg.get("kind") not in CLIENT_KINDS or not isinstance(nonce, str):
                self.drop(conn, "first message is not a hello")
                return
            conn.hello = msg
            if not self.token or conn.local:  # an unauthenticated job (msrun warned loudly), or msrun itself
                self._welcome(conn, msg)
                return
            conn.nonce = wire.new_nonce()
            conn.deadline = self.clock.now + self.auth_timeout  # for the answer, from now
            proof = wire.proof(self.token, "scheduler", nonce[:64], conn.nonce)
            self.send(conn, {"t": "challenge", "nonce": conn.nonce, "proof": proof})
            return
        hello = conn.hello
        expected = wire.proof(self.token, str(hello.get("kind")), str(hello.get("nonce"))[:64], conn.nonce)
        if msg["t"] != "auth" or not wire.token_ok(msg.get("proof"), expected):
            self.refuse(conn, "bad job token (this client's MSRUN_JOB_TOKEN or secret differs from this job's)")
            return
        self._welcome(conn, hello)

    def _welcome(self, conn: Conn, hello: dict[str, Any]) -> None:
        self.authenticated(conn, str(hello["kind"]))
        # ``now``: the scheduler's clock, from which a client estimates its own clock's offset
        self.send(conn, {"t": "welcome", "pid": os.getpid(), "host": _socket.gethostname(), "now": time.time()})
        self.handler.on_hello(conn, hello)

    # ---------------------------------------------------------------- reading
    def on_readable(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(1 << 20 if conn.kind else wire.HELLO_LIMIT + wire.HEADER.size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if conn.draining:
                self.close(conn)
            else:
                self.drop(conn, f"connection error: {exc}")
            return
        if conn.draining:
            if not data:
                self.close(conn)
            return
        if not data:
            self.drop(conn, "connection closed")
            return
        if conn.kind in ("foreign", "upstream"):
            self.handler.on_relay(conn, data)
            return
        if conn.head is not None:  # whose protocol is this? (MindSpore's, or ours)
            conn.head += data
            if conn.head.startswith(MINDSPORE_MAGIC):
                self.handler.on_foreign(conn)
                return
            if MINDSPORE_MAGIC.startswith(conn.head):
                return  # too short to tell yet
            data, conn.head = conn.head, None
        try:
            msgs = conn.frames.feed(data)
        except wire.ProtocolError as exc:
            self.drop(conn, str(exc), category="" if conn.kind else "a malformed frame before authenticating")
            return
        for msg in msgs:
            if conn.sock.fileno() < 0 or conn.closing:
                break
            conn.last_seen = self.clock.now
            try:
                if conn.kind == "":
                    self._authenticate(conn, msg)
                else:
                    self.handler.on_message(conn, msg)
            except Exception as exc:  # a message we failed to handle costs its sender, not the job
                self.log(f"error handling a {msg['t'][:40]!r} message from {conn.peer}:")
                self.fault(conn, exc)
        if conn.broken:  # everything it sent was handled; now it is gone
            self.drop(conn, "connection closed")

    def accept(self) -> None:
        while True:
            try:
                fd, addr = self.listener._accept()  # type: ignore[attr-defined]  # socket.accept() does this
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self.shed_pending("out of file descriptors"):
                        continue  # one freed: take the waiting connection
                    self.pause_accepting()  # never spin on a listener we cannot serve
                return
            sock = _socket.socket(fileno=fd)
            sock.setblocking(False)
            try:
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if len(self.pending) >= self.max_pending:
                self.shed_pending(f"more than {self.max_pending} unauthenticated connections")
            conn = Conn(sock, f"{addr[0]}:{addr[1]}", self.clock.now)
            conn.deadline = self.clock.now + self.auth_timeout  # for its hello
            self.conns[sock.fileno()] = conn
            self.pending[conn] = None
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def adopt_local(self, sock: _socket.socket) -> Conn:
        """The connection msrun made when it forked this process (a socketpair): only msrun holds
        the other end, so its hello is welcomed without a challenge; it is never shed."""
        sock.setblocking(False)
        conn = Conn(sock, "msrun (socketpair)", self.clock.now)
        conn.head = None  # our protocol, not MindSpore's
        conn.local = True
        self.adopt(sock, conn)
        return conn

    def adopt(self, sock: _socket.socket, conn: Conn) -> None:
        """Watch a connection this process opened itself (to the MindSpore scheduler)."""
        self.conns[sock.fileno()] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)

    def shed_pending(self, why: str) -> bool:
        """Drop the oldest unauthenticated connection that has not even sent a whole hello (ours
        send one at once), else the oldest one still owing the answer to our challenge - after
        reading what it sent: one that has answered is authenticated, not shed. False if none."""
        victim = next((c for c in self.pending if c.hello is None), None)
        while victim is None:
            oldest = next(iter(self.pending), None)
            if oldest is None:
                return False
            self.on_readable(oldest)  # its answer may be waiting in its socket
            if oldest in self.pending:
                victim = oldest
        self.shed += 1
        if self.shed in (1, 10, 100, 1000, 10000) or self.shed % 100000 == 0:
            self.log(f"shedding unauthenticated connections ({why}): {self.shed} so far")
        self.drop(victim, why, quiet=True)
        return True

    def pause_accepting(self) -> None:
        try:
            self.sel.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE

    def resume_accepting(self) -> None:
        if self.accept_paused_until and time.monotonic() >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            self.sel.register(self.listener, selectors.EVENT_READ, None)

    # ---------------------------------------------------------------- the loop
    def poll(self, timeout: float, on_other: Callable[[Any], None]) -> None:
        """Wait up to ``timeout`` s and serve what is ready (``on_other`` gets other registered keys).

        Each ready connection is served inside :meth:`fault`'s boundary: whatever goes wrong
        while serving it ends that connection only."""
        for key, events in self.sel.select(timeout=timeout):
            data = key.data
            try:
                if data is None:
                    self.accept()
                elif not isinstance(data, Conn):
                    on_other(data)
                else:
                    if events & selectors.EVENT_WRITE:
                        self.flush(data)
                    if events & selectors.EVENT_READ and data.sock.fileno() >= 0:
                        self.on_readable(data)
            except Exception as exc:
                self.fault(data if isinstance(data, Conn) else None, exc)
        self.clock.tick()

    def expired(self) -> list[Conn]:
        """Connections past their authentication deadline (lingering closes are closed here)."""
        now = self.clock.now
        for conn in [c for c in self.conns.values() if c.draining and now > c.draining]:
            self.close(conn)
        return [c for c in self.conns.values() if c.kind == "" and not c.closing and c.deadline and now > c.deadline]

    def drain(self, seconds: float) -> None:
        """Give queued messages (abort, timeout) a bounded chance to leave."""
        deadline = time.monotonic() + seconds
        while any(c.out for c in self.conns.values()) and time.monotonic() < deadline:
            for key, events in self.sel.select(timeout=0.05):
                if isinstance(key.data, Conn) and events & selectors.EVENT_WRITE:
                    self.flush(key.data)
