"""The control plane's transport: its door, authenticated connections, frames, relayed bytes.

A :class:`Transport` owns the listening socket's :class:`~.door.Door` (strangers, until they proved
the job's token: bounds, deadlines, the handshake) and every connection that went through it, in one
event loop: it reads frames (:mod:`.wire`) and hands each client's messages to its handler, the
scheduler. A connection that opens with MindSpore's RPC magic leaves the door unproven and is handed
over as a foreign protocol (its handler attributes it before serving it).

Deadlines for strangers are measured by a :class:`LoopClock`, which does not count time this process
itself could not run (a loaded machine starves the scheduler too: its peers' answers are waiting in
its sockets, not late).
"""

from __future__ import annotations

import _socket  # not socket: its import (enums) is a cost on the forked control plane's start
import os
import selectors
import time

from pytest_msrun.control import wire
from pytest_msrun.control.clock import LoopClock
from pytest_msrun.control.door import Admitted, Door, unregister
from pytest_msrun.record import field, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from pytest_msrun.control.scheduler import Scheduler


MINDSPORE_MAGIC = b"RPC"  # the first bytes of every MindSpore RPC message (see msbridge)
CLIENT_KINDS = ("agent", "rank", "observer")  # authenticated clients of our own protocol
DEFAULT_AUTH_TIMEOUT = 5.0


def format_error(exc: BaseException) -> str:
    """``exc`` with its traceback, for the log (imported only when something went wrong)."""
    import traceback

    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


@record(eq=False)
class Conn:
    """One connection that went through the door (or msrun's own socketpair, or one upstream)."""

    sock: _socket.socket
    peer: str
    # "agent", "rank" or "observer"; relayed MindSpore connections are "foreign" (the client,
    # until attributed, then relayed) and "upstream" (to the MindSpore scheduler).
    kind: str
    frames: wire.FrameBuffer
    last_seen: float  # a loop-clock time
    local: bool = False  # msrun's end of a socketpair it made when it forked this process
    out: bytearray = field(default_factory=bytearray)
    closing: bool = False
    pair: Conn | None = None  # the other end of a relayed connection
    pending: bytearray = field(default_factory=bytearray)  # relayed bytes waiting for the other end to connect
    broken: bool = False  # a send failed: it is dropped once what it already sent was handled
    draining: float = 0.0  # when closing: until then, read and discard (so the close is no RST)
    writing: bool = False  # registered for EVENT_WRITE (output is waiting)
    deadline: float = 0.0  # a foreign client not yet attributed: by when it must be (loop clock)


class Transport:
    """Every connection of one control-plane process."""

    def __init__(
        self,
        listener: _socket.socket,
        handler: Scheduler,  # its on_hello, on_message, on_lost, on_foreign and on_relay
        *,
        token: str,
        auth_timeout: float,
        max_pending: int,
        log: Callable[[str], None],
    ) -> None:
        self.listener = listener
        self.handler = handler
        self.log = log
        self.sel = selectors.DefaultSelector()
        self.clock = LoopClock()
        self.door = Door(
            listener,
            token=token,
            kinds=CLIENT_KINDS,
            timeout=auth_timeout,
            max_pending=max_pending,
            selector=self.sel,
            now=lambda: self.clock.now,
            welcome=lambda hello: self.welcome(),
            foreign=MINDSPORE_MAGIC,
            refusal="bad job token (this client's MSRUN_JOB_TOKEN or secret differs from this job's)",
        )
        self.conns: dict[int, Conn] = {}
        self.limit = wire.message_limit()

    @staticmethod
    def welcome() -> dict[str, Any]:
        """What a client's welcome says of this process: its pid and host, and its clock's time (from
        which a client estimates its own clock's offset)."""
        return {"pid": os.getpid(), "host": _socket.gethostname(), "now": time.time()}

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
        fd = conn.sock.fileno()
        if fd < 0:
            return
        unregister(self.sel, conn.sock)
        self.conns.pop(fd, None)
        conn.sock.close()

    def drop(self, conn: Conn, why: str) -> None:
        """Forget a client (its handler hears of it first; an error there is logged, and the
        connection is closed all the same)."""
        if conn.sock.fileno() < 0:
            return
        try:
            self.handler.on_lost(conn, why)
        except Exception as exc:
            self.log(f"error handling the loss of {conn.peer} ({why}):\n{format_error(exc)}")
        finally:
            self.close(conn)

    def drop_stranger(self, conn: Conn, why: str, ip: str) -> None:
        """Drop a connection that proved nothing (a foreign client not of this job, from ``ip``): counted
        by the door with the strangers (``why``: the door's words, not the stranger's), never logged alone."""
        self.door.tally.add(ip, why)
        self.drop(conn, why)

    def fault(self, conn: Conn | None, exc: Exception) -> None:
        """The fault boundary: an error while serving one authenticated connection (a bug, or input
        no check foresaw) is logged with its traceback and costs that connection, never this process."""
        who = "the listener" if conn is None else f"{conn.peer} ({conn.kind})"
        self.log(f"error serving {who}; it is dropped:\n{format_error(exc)}")
        if conn is not None:  # drop() itself cannot fail: its handler's errors are logged
            self.drop(conn, f"an error while serving it: {exc!r}"[:300])

    def refuse(self, conn: Conn, reason: str) -> None:
        """Tell an authenticated client why it cannot be served, then close its connection."""
        self.log(f"refused {conn.peer}: {reason}")
        conn.closing = True  # once the refusal is out
        self.send(conn, {"t": "refused", "reason": reason})

    # ---------------------------------------------------------------- connections in
    def enter(self, admitted: Admitted) -> None:
        """A connection out of the door: a client (welcomed: its hello, then what it sent after),
        or a foreign protocol's, for the handler to attribute."""
        conn = self.adopt(admitted.sock, admitted.peer, admitted.kind)
        if admitted.kind == "foreign":
            conn.pending += admitted.rest
            self.handler.on_foreign(conn)
            return
        self.handler.on_hello(conn, admitted.hello)
        self._handle(conn, admitted.rest, admitted.messages)

    def adopt(self, sock: _socket.socket, peer: str, kind: str, local: bool = False) -> Conn:
        """Watch a connection (one out of the door, msrun's, or one upstream this process opened);
        a TCP one sends each frame at once (no Nagle delay)."""
        conn = Conn(sock, peer, kind, wire.FrameBuffer(self.limit), self.clock.now, local)
        sock.setblocking(False)
        try:
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
        except OSError:  # msrun's socketpair
            pass
        self.conns[sock.fileno()] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)
        return conn

    # ---------------------------------------------------------------- reading
    def on_readable(self, conn: Conn) -> None:
        why = "connection closed"
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data, why = b"", f"connection error: {exc}"
        if conn.draining:
            if not data:
                self.close(conn)
        elif not data:
            self.drop(conn, why)
        elif conn.kind in ("foreign", "upstream"):
            self.handler.on_relay(conn, data)
        else:
            self._handle(conn, data)

    def _handle(self, conn: Conn, data: bytes, earlier: list[dict[str, Any]] | None = None) -> None:
        """The messages ``data`` completes (after those read ``earlier``), each to the handler."""
        try:
            msgs = (earlier or []) + conn.frames.feed(data)
        except wire.ProtocolError as exc:
            self.drop(conn, str(exc))
            return
        for msg in msgs:
            if conn.sock.fileno() < 0 or conn.closing:
                break
            conn.last_seen = self.clock.now
            try:
                if conn.local and not conn.kind:  # msrun's own hello over its socketpair
                    if msg["t"] != "hello" or msg.get("kind") != "agent":
                        self.drop(conn, "msrun's socketpair did not open with an agent's hello")
                        return
                    conn.kind = "agent"
                    self.send(conn, {"t": "welcome", **self.welcome()})
                    self.handler.on_hello(conn, msg)
                else:
                    self.handler.on_message(conn, msg)
            except Exception as exc:  # a message we failed to handle costs its sender, not the job
                self.log(f"error handling a {msg['t'][:40]!r} message from {conn.peer}:")
                self.fault(conn, exc)
        if conn.broken:  # everything it sent was handled; now it is gone
            self.drop(conn, "connection closed")

    # ---------------------------------------------------------------- the loop
    def poll(self, timeout: float, on_other: Callable[[Any], None]) -> None:
        """Wait up to ``timeout`` s and serve what is ready (``on_other`` gets other registered keys).

        Each ready connection is served inside :meth:`fault`'s boundary: whatever goes wrong
        while serving it ends that connection only (the door has a boundary of its own)."""
        for key, events in self.sel.select(timeout=self.door.wait(timeout)):
            data = key.data
            try:
                if data is self.door:
                    for admitted in self.door.ready(key.fileobj):
                        self.enter(admitted)
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

    def expire(self, silent: Callable[[], bool]) -> None:
        """Deadlines: strangers past theirs (a silent one goes to the handler as foreign when
        ``silent()``), lingering closes over, foreign clients not attributed in time."""
        for admitted in self.door.expire(silent):
            self.enter(admitted)
        now = self.clock.now
        for conn in [c for c in self.conns.values() if c.draining and now > c.draining]:
            self.close(conn)

    def drain(self, seconds: float) -> None:
        """Give queued messages (abort, timeout) a bounded chance to leave."""
        deadline = time.monotonic() + seconds
        while any(c.out for c in self.conns.values()) and time.monotonic() < deadline:
            for key, events in self.sel.select(timeout=0.05):
                if isinstance(key.data, Conn) and events & selectors.EVENT_WRITE:
                    self.flush(key.data)
