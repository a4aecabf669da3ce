"""The one door of every listener: who connects is a stranger until it proves the listener's token.

Every listening socket of this project - the control plane's port, a warm world's, the ranks'
debugger - accepts through a :class:`Door`. Until a connection has proved the token it is a
stranger's, and the door alone serves it:

* **The handshake** (frames of :mod:`.wire`, parsed by the total parser): the client's ``hello``
  (a ``kind`` the listener serves, a nonce of hex digits), the door's ``challenge`` (a fresh nonce,
  nothing computed from the token), the client's ``auth`` (its proof over both nonces), the door's
  ``welcome`` (the door's own proof, then whatever the listener adds). The client proves first, so a
  stranger who connects learns nothing to guess the token against (:func:`wire.proof`).
* **Bounds.** At most ``max_pending`` strangers at once. Each is kept :data:`GRACE` seconds after
  it connected, and again after its challenge, whatever comes: a client that can answer gets in, even
  under a flood. Room for a newcomer is made by a lingering refusal, else by the oldest stranger past
  its grace - after what it sent was read, so a client whose answer is waiting gets in; with every
  stranger within its grace, accepting pauses until the first grace ends, and newcomers wait their
  turn in the kernel's queue (a flood is slowed to the door's pace; nobody is locked out). A hello
  within ``timeout`` seconds of connecting, the answer within ``timeout`` of the challenge, a frame
  of at most :data:`wire.HELLO_LIMIT` bytes. Out of file descriptors, the same: room, or a pause.
* **A fault boundary.** Whatever goes wrong while one stranger is served costs that connection.
* **Counted, not logged.** Strangers dropped are counted by peer address and reason (reasons are the
  door's words, never the stranger's); :meth:`Tally.summary` gives at most one line per address per
  :data:`SUMMARY_EVERY` seconds (and :data:`SUMMARY_ADDRESSES` addresses), never a traceback.

A listener may also take a foreign protocol (MindSpore's RPC, whose first bytes are a magic): such
a connection leaves the door as it came, unproven - its owner must attribute it before serving it.

Standard library only, no :mod:`socket` or :mod:`dataclasses` import (the control plane's start).
"""

from __future__ import annotations

import _socket
import errno
import select
import selectors
import time

from pytest_msrun.control import wire
from pytest_msrun.record import field, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

PENDING_FLOOR = 256  # strangers kept at most by a listener: max(this, what the owner asks)
GRACE = 0.25  # s a stranger is never shed within, after it connected and after its challenge
ACCEPT_PAUSE = 0.1  # s: out of file descriptors and no stranger to shed: stop accepting this long
LINGER = 2.0  # s a refused stranger is read (and discarded) so the refusal is not lost to a reset
SUMMARY_EVERY = 60.0  # s: strangers are summed up at most this often
SUMMARY_ADDRESSES = 8  # addresses named per summary; the others are counted together
TRACKED_ADDRESSES = 1024  # addresses counted one by one per summary; beyond, "other addresses"
NONCE_MAX = 64  # hex digits of a hello's nonce


def unregister(sel: selectors.BaseSelector, fileobj: Any) -> None:
    """``sel`` no longer watches ``fileobj`` (whether it did or not)."""
    try:
        sel.unregister(fileobj)
    except (KeyError, ValueError):
        pass


@record(eq=False)
class Admitted:
    """A connection that went through the door: a client that proved the token (``kind`` from its
    hello), or a foreign protocol's (``kind`` ``"foreign"``, ``hello`` empty, ``rest`` its first bytes).

    ``messages`` were read after the handshake, ``rest`` bytes after those, not yet a whole frame."""

    sock: Any
    peer: str
    kind: str
    hello: dict[str, Any]
    messages: list[dict[str, Any]]
    rest: bytes


@record(eq=False)
class Stranger:
    """A connection the door still serves."""

    sock: Any
    ip: str
    peer: str
    deadline: float  # for its hello, then for its answer, then for its lingering close
    since: float  # when it connected, then when it was challenged: never shed within GRACE of this
    frames: wire.FrameBuffer = field(default_factory=lambda: wire.FrameBuffer(strict=True))
    head: bytes | None = b""  # its first bytes, until they tell whose protocol it speaks
    hello: dict[str, Any] | None = None
    nonce: str = ""  # the door's challenge
    lingering: bool = False  # refused: read and discarded until it closes


class Tally:
    """Strangers dropped: totals by reason, and by address and reason since the last summary."""

    def __init__(self, now: float) -> None:
        self.totals: dict[str, int] = {}
        self.window: dict[str, dict[str, int]] = {}
        self.since = now

    def add(self, ip: str, why: str) -> None:
        self.totals[why] = self.totals.get(why, 0) + 1
        if ip not in self.window and len(self.window) >= TRACKED_ADDRESSES:
            ip = "other addresses"
        counts = self.window.setdefault(ip, {})
        counts[why] = counts.get(why, 0) + 1

    def summary(self, now: float, force: bool = False) -> list[str]:
        """Lines summing up the strangers dropped since the last summary (at most one per address per
        :data:`SUMMARY_EVERY` s; ``force``: now, e.g. at the end)."""
        if not self.window or (now - self.since < SUMMARY_EVERY and not force):
            return []
        span = max(1, round(now - self.since))
        ranked = sorted(self.window.items(), key=lambda item: -sum(item[1].values()))
        lines = []
        for ip, counts in ranked[:SUMMARY_ADDRESSES]:
            reasons = ", ".join(f"{n} {why}" for why, n in sorted(counts.items(), key=lambda c: -c[1]))
            lines.append(f"dropped {sum(counts.values())} connection(s) from {ip} in {span} s: {reasons}")
        rest = ranked[SUMMARY_ADDRESSES:]
        if rest:
            count = sum(sum(c.values()) for _, c in rest)
            lines.append(f"dropped {count} connection(s) from {len(rest)} other address(es) in {span} s")
        self.window, self.since = {}, now
        return lines


class Door:
    """Strangers at one listening socket, until each proved the token (or was dropped).

    With ``selector`` the door serves inside its owner's loop: the listener and the strangers are
    registered with the door itself as their data, and the owner hands each ready key's file object
    to :meth:`ready`. Without one, :meth:`serve` waits on a selector of the door's own."""

    def __init__(
        self,
        listener: Any,
        *,
        token: str,
        kinds: tuple[str, ...],
        timeout: float,
        max_pending: int = PENDING_FLOOR,
        selector: selectors.BaseSelector | None = None,
        now: Callable[[], float] = time.monotonic,
        welcome: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        foreign: bytes = b"",
        refusal: str = "bad token (this client's token differs from this listener's)",
        tally: Tally | None = None,
    ) -> None:
        self.listener = listener
        self.token = token  # "": an unauthenticated job (msrun warned): a hello is welcomed at once
        self.kinds = kinds
        self.timeout = timeout
        self.max_pending = max(PENDING_FLOOR, max_pending)
        self.grace = min(GRACE, timeout)
        self.own_selector = selector is None
        self.sel = selectors.DefaultSelector() if selector is None else selector
        self.now = now
        self.extra = welcome
        self.foreign = foreign
        self.refusal = refusal  # what a client whose proof is wrong is told
        self.strangers: dict[Stranger, None] = {}  # oldest first
        self.by_sock: dict[int, Stranger] = {}
        self.tally = tally if tally is not None else Tally(now())  # shared by the doors of one owner
        self.paused_until = 0.0  # accepting resumes then (self.now's clock); 0: not paused
        self.waiting = select.poll()  # whether a newcomer waits in the kernel's queue
        self.waiting.register(listener, select.POLLIN)
        self.closed = False
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, self)

    # ---------------------------------------------------------------- the owner's calls
    def serve(self, timeout: float) -> list[Admitted]:
        """Wait up to ``timeout`` s (a door with its own selector) and return who got in meanwhile."""
        admitted: list[Admitted] = []
        for key, _ in self.sel.select(timeout=self.wait(timeout)):
            admitted += self.ready(key.fileobj)
        return admitted + self.expire()

    def wait(self, timeout: float) -> float:
        """How long the owner may wait for events, at most ``timeout``: no longer than a pause of
        accepting lasts (one that is over ends now)."""
        if not self.paused_until:
            return timeout
        left = self.paused_until - self.now()
        if left > 0:
            return min(timeout, left)
        self.paused_until = 0.0
        if not self.closed:
            self.sel.register(self.listener, selectors.EVENT_READ, self)
        return timeout

    def ready(self, fileobj: Any) -> list[Admitted]:
        """Serve the listener or one stranger that ``select`` found ready; who got in."""
        if fileobj is self.listener:
            return self._accept()
        stranger = self.by_sock.get(fileobj.fileno()) if fileobj.fileno() >= 0 else None
        if stranger is None:
            return []
        try:
            return self._read(stranger)
        except Exception:  # noqa: BLE001 - the fault boundary: this stranger's connection, nothing else
            self._drop(stranger, "an error while serving it")
            return []

    def expire(self, silent: Callable[[], bool] | None = None) -> list[Admitted]:
        """Drop the strangers past their deadline; a silent one (no byte sent) leaves as foreign
        when ``silent()`` says a foreign protocol is being served (its clients may speak later).
        Accepting resumes once a pause is over."""
        now = self.now()
        admitted: list[Admitted] = []
        for stranger in [s for s in self.strangers if now > s.deadline]:
            if stranger.lingering:
                self._close(stranger)
            elif stranger.head == b"" and self.foreign and silent is not None and silent():
                admitted.append(self._leave_foreign(stranger))
            elif stranger.hello is None:
                self._drop(stranger, f"no hello within {self.timeout:g} s")
            else:
                self._drop(stranger, f"no answer to the challenge within {self.timeout:g} s")
        self.wait(0.0)
        return admitted

    def close(self) -> None:
        """Close every stranger's connection and the listener (the listener exists no more)."""
        if self.closed:
            return
        self.closed = True
        for stranger in list(self.strangers):
            self._close(stranger)
        unregister(self.sel, self.listener)
        self.listener.close()
        if self.own_selector:
            self.sel.close()

    # ---------------------------------------------------------------- accepting
    def _accept(self) -> list[Admitted]:
        admitted: list[Admitted] = []
        while not self.closed and not self.paused_until:
            if len(self.strangers) >= self.max_pending:
                if not self.waiting.poll(0):
                    break
                admitted += self._make_room(f"more than {self.max_pending} strangers at once")
                continue
            try:
                fd, addr = self.listener._accept()  # socket.accept() without wrapping it in socket.socket
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    break
                admitted += self._make_room("out of file descriptors")  # then take the waiting connection
                continue
            sock = _socket.socket(fileno=fd)
            sock.setblocking(False)
            ip, port = (str(addr[0]), int(addr[1])) if isinstance(addr, tuple) else ("local", 0)
            peer = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            now = self.now()
            stranger = Stranger(sock, ip, peer, now + self.timeout, now)
            self.strangers[stranger] = None
            self.by_sock[sock.fileno()] = stranger
            self.sel.register(sock, selectors.EVENT_READ, self)
        return admitted

    def _make_room(self, why: str) -> list[Admitted]:
        """Free a place: a lingering refusal's, else the oldest stranger's past its grace - read first,
        so a client whose answer waits gets in (and one whose hello waited is challenged: its grace
        begins). With every stranger within its grace, accepting pauses until the first grace ends
        (none: :data:`ACCEPT_PAUSE`); newcomers wait in the kernel's queue. Who got in meanwhile."""
        lingering = next((s for s in self.strangers if s.lingering), None)
        if lingering is not None:
            self._close(lingering)
            return []
        admitted: list[Admitted] = []
        now = self.now()
        for stranger in [s for s in self.strangers if now >= s.since + self.grace]:
            admitted += self.ready(stranger.sock)
            if stranger not in self.strangers:
                return admitted  # it got in, or was dropped for what it sent
            if now >= stranger.since + self.grace:
                self._drop(stranger, f"shed ({why})")
                return admitted
        unregister(self.sel, self.listener)  # never spin on a listener that cannot be served
        self.paused_until = min((s.since + self.grace for s in self.strangers), default=now + ACCEPT_PAUSE)
        return admitted

    # ---------------------------------------------------------------- reading
    def _read(self, stranger: Stranger) -> list[Admitted]:
        try:
            data = stranger.sock.recv(wire.HELLO_LIMIT + wire.HEADER.size)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if stranger.lingering:
            if not data:
                self._close(stranger)
            return []
        if not data:
            self._drop(stranger, "closed before it proved the token")
            return []
        if stranger.head is not None:  # whose protocol is this?
            stranger.head += data
            if self.foreign and stranger.head.startswith(self.foreign):
                return [self._leave_foreign(stranger)]
            if self.foreign and self.foreign.startswith(stranger.head):
                return []  # too short to tell yet
            data, stranger.head = stranger.head, None
        try:
            messages = stranger.frames.feed(data)
        except wire.ProtocolError:
            self._drop(stranger, "a malformed frame")
            return []
        for index, msg in enumerate(messages):
            if stranger.hello is not None:
                return self._answer(stranger, msg, messages[index + 1 :])
            if not self._hello(stranger, msg):
                return []
            if not self.token:  # an unauthenticated job: welcomed at its hello
                return self._admit(stranger, messages[index + 1 :])
        return []

    def _hello(self, stranger: Stranger, msg: dict[str, Any]) -> bool:
        """Take a hello; whether the stranger is still being served."""
        nonce = msg.get("nonce")
        if msg["t"] != "hello" or msg.get("kind") not in self.kinds:
            self._drop(stranger, "its first message is not a hello")
            return False
        if not (isinstance(nonce, str) and 0 < len(nonce) <= NONCE_MAX and wire.HEX_DIGITS.issuperset(nonce)):
            self._drop(stranger, "a hello whose nonce is not hex digits")
            return False
        stranger.hello = msg
        if not self.token:
            return True
        stranger.nonce = wire.new_nonce()
        stranger.since = self.now()
        stranger.deadline = stranger.since + self.timeout  # for its answer, from now
        return self._send(stranger, {"t": "challenge", "nonce": stranger.nonce})

    def _answer(self, stranger: Stranger, msg: dict[str, Any], after: list[dict[str, Any]]) -> list[Admitted]:
        hello = stranger.hello
        assert hello is not None
        expected = wire.proof(self.token, str(hello["kind"]), str(hello["nonce"]), stranger.nonce)
        if msg["t"] != "auth" or not wire.token_ok(msg.get("proof"), expected):
            self._refuse(stranger, self.refusal)
            return []
        return self._admit(stranger, after)

    def _admit(self, stranger: Stranger, messages: list[dict[str, Any]]) -> list[Admitted]:
        """Welcome ``stranger`` (with the door's proof) and let it in (none: its connection failed)."""
        hello = stranger.hello
        assert hello is not None
        welcome: dict[str, Any] = {"t": "welcome"}
        if self.token:
            welcome["proof"] = wire.proof(self.token, "server", str(hello["nonce"]), stranger.nonce)
        if self.extra is not None:
            welcome.update(self.extra(hello))
        if not self._send(stranger, welcome):
            return []
        self._forget(stranger)
        return [Admitted(stranger.sock, stranger.peer, str(hello["kind"]), hello, messages, bytes(stranger.frames.buf))]

    def _leave_foreign(self, stranger: Stranger) -> Admitted:
        self._forget(stranger)
        return Admitted(stranger.sock, stranger.peer, "foreign", {}, [], bytes(stranger.head or b""))

    # ---------------------------------------------------------------- answering and ending
    def _send(self, stranger: Stranger, msg: dict[str, Any]) -> bool:
        """Send a handshake message (small: the socket's buffer takes it whole); False if it could not."""
        frame = wire.encode(msg)
        try:
            sent = stranger.sock.send(frame)
        except OSError:
            sent = 0
        if sent != len(frame):
            self._drop(stranger, "its connection failed")
            return False
        return True

    def _refuse(self, stranger: Stranger, reason: str) -> None:
        """Say why, then read and discard until it closes (closing with unread data would reset the
        connection and could destroy the refusal before the client reads it)."""
        self.tally.add(stranger.ip, "refused: bad token")
        try:
            stranger.sock.send(wire.encode({"t": "refused", "reason": reason}))
            stranger.sock.shutdown(_socket.SHUT_WR)
        except OSError:
            self._close(stranger)
            return
        stranger.lingering = True
        stranger.deadline = self.now() + LINGER

    def _drop(self, stranger: Stranger, why: str) -> None:
        self.tally.add(stranger.ip, why)
        self._close(stranger)

    def _forget(self, stranger: Stranger) -> None:
        """No longer the door's: unregistered, out of every group (its socket stays open)."""
        self.strangers.pop(stranger, None)
        fd = stranger.sock.fileno()
        if fd >= 0:
            self.by_sock.pop(fd, None)
            unregister(self.sel, stranger.sock)

    def _close(self, stranger: Stranger) -> None:
        self._forget(stranger)
        stranger.sock.close()
