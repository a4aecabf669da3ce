"""The controller's end of the ranks' debugger: pdb sessions of ranks, on this terminal, one at a time.

Ranks run without a terminal (stdin ``/dev/null``, output into their logs). A rank that stops in
pdb - ``breakpoint()``, or ``--pdb`` on a failure (:mod:`.debugrank`) - connects here (loopback
TCP, proving the session's token) and says who and where it is. With a terminal (stdin a tty) the
controller serves one session at a time on a thread: the rank's pdb output goes to the terminal,
what the user types goes to the rank, until the rank goes on (``c``) and closes its end; a rank
that comes meanwhile waits its turn. Without a terminal it refuses, saying so once for each rank
and place, and the rank goes on.

While a session is open or waiting, :meth:`DebugServer.held` grows: the jobs' deadlines (their
timeout, the exit and failure graces) add it, so a rank in the debugger is neither timed out nor
taken for hung.
"""

from __future__ import annotations

import hmac
import json
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from pytest_msrun.netaddr import rank_listener

DEBUG_ENV = "MSRUN_DEBUG"  # host:port of the controller's debug server
DEBUG_TOKEN_ENV = "MSRUN_DEBUG_TOKEN"
DEBUG_PDB_ENV = "MSRUN_DEBUG_PDB"  # "1": the controller runs --pdb (post-mortem on a failure)
HELLO_MAX = 8192  # bytes of a rank's hello line
HELLO_WAIT = 5.0  # seconds a connection may take to say its hello
NO_TTY = "no terminal (stdin is not a tty)"


@dataclass
class Waiting:
    """A connection that has not said its hello yet."""

    sock: socket.socket
    since: float
    data: bytes = b""


@dataclass
class Session:
    """A rank that asked for the debugger: its connection and what it said."""

    sock: socket.socket
    hello: dict

    @property
    def what(self) -> str:
        rank, where = self.hello.get("rank"), self.hello.get("where", "?")
        if self.hello.get("kind") == "post_mortem":
            return f"--pdb: the failure of rank {rank} at {where}"
        return f"breakpoint() in rank {rank} at {where}"


class NoDebug:
    """No debug server: deadlines run as they are."""

    def held(self) -> float:
        return 0.0

    def env(self) -> dict[str, str]:
        return {}


class DebugServer:
    """A loopback server the ranks' pdb sessions come to; one thread relays them to the terminal."""

    def __init__(self, *, post_mortem: bool, terminal: int | None, stdout_fd: int = 1, steps: bool = False) -> None:
        """``terminal``: the user's terminal to read (a tty; its owner closes it), None: there is none.
        ``stdout_fd``: where the sessions' output goes (a copy of it is taken now). ``steps``: ranks
        run in Slurm steps, on other nodes."""
        self.post_mortem = post_mortem
        self.steps = steps
        self.token = os.urandom(16).hex()
        self.tty = terminal is not None and _isatty(terminal)
        self.stdin = terminal if terminal is not None and self.tty else -1
        self.stdout = os.dup(stdout_fd)
        self.lock = threading.Lock()
        self._held = 0.0
        self._busy_since: float | None = None
        self.said: set[tuple] = set()
        self.sessions = 0  # served so far
        self._closed = False
        self._address = ""  # the server and its thread start with the first job (a session may have none)

    @property
    def address(self) -> str:
        """``host:port`` ranks connect to (the server starts listening the first time it is asked)."""
        if not self._address:
            # ranks of Slurm steps reach this host where srun ran (only the session's token is served)
            self.server, address = rank_listener(self.steps, backlog=128)
            self.server.setblocking(False)
            self._wake_r, self._wake_w = os.pipe()
            self.thread = threading.Thread(target=self._loop, name="msrun-debug", daemon=True)
            self.thread.start()
            self._address = address
        return self._address

    # ---------------------------------------------------------------- for the jobs
    def env(self) -> dict[str, str]:
        """What a rank needs to reach this server."""
        out = {DEBUG_ENV: self.address, DEBUG_TOKEN_ENV: self.token}
        if self.post_mortem:
            out[DEBUG_PDB_ENV] = "1"
        return out

    def held(self) -> float:
        """Seconds ranks have spent in (or waiting for) a debug session, the open one included."""
        with self.lock:
            since = self._busy_since
            return self._held + (time.monotonic() - since if since is not None else 0.0)

    def _busy(self, busy: bool) -> None:
        with self.lock:
            now = time.monotonic()
            if busy and self._busy_since is None:
                self._busy_since = now
            elif not busy and self._busy_since is not None:
                self._held += now - self._busy_since
                self._busy_since = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        fds = [self.stdout]
        if self._address:  # started
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
            self.thread.join(timeout=5)
            fds += [self._wake_r, self._wake_w]
            self.server.close()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # ---------------------------------------------------------------- the thread
    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.server, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        waiting: dict[socket.socket, Waiting] = {}
        queue: list[Session] = []
        active: Session | None = None
        try:
            while True:
                if active is None and queue:
                    active = self._start(queue.pop(0), sel)
                self._busy(active is not None or bool(queue))
                for key, _ in sel.select(timeout=0.5):
                    tag = key.data
                    if tag == "wake":
                        return
                    try:
                        if tag == "accept":
                            self._accept(sel, waiting)
                        elif tag == "hello":
                            session = self._hello(key.fileobj, sel, waiting)  # type: ignore[arg-type]
                            if session is not None:
                                queue.append(session)
                        elif tag == "rank" and active is not None:
                            if not self._from_rank(active):
                                self._end(active, sel)
                                active = None
                        elif tag == "stdin" and active is not None:
                            self._from_user(active, sel)
                    except Exception as exc:  # noqa: BLE001 - that connection's fault, not the server's end
                        sock = key.fileobj
                        if tag == "hello" and isinstance(sock, socket.socket):
                            waiting.pop(sock, None)
                            _forget(sel, sock)
                        elif tag == "rank" and active is not None:
                            self._say(f"msrun: the ranks' debugger dropped {active.what}: {exc!r}")
                            _forget(sel, active.sock)
                            active = None
                now = time.monotonic()
                for sock, w in list(waiting.items()):
                    if now - w.since > HELLO_WAIT:
                        sel.unregister(sock)
                        del waiting[sock]
                        sock.close()
        except Exception as exc:  # noqa: BLE001 - the debugger must never break the session
            self._say(f"msrun: the ranks' debugger stopped: {exc!r}")
        finally:
            self._busy(False)
            for s in [*queue, *([active] if active else [])]:
                s.sock.close()
            for sock in waiting:
                sock.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, waiting: dict[socket.socket, Waiting]) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            waiting[sock] = Waiting(sock, time.monotonic())
            sel.register(sock, selectors.EVENT_READ, "hello")

    def _hello(
        self, sock: socket.socket, sel: selectors.BaseSelector, waiting: dict[socket.socket, Waiting]
    ) -> Session | None:
        w = waiting[sock]
        try:
            data = sock.recv(HELLO_MAX)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data = b""
        w.data += data
        if data and b"\n" not in w.data and len(w.data) < HELLO_MAX:
            return None
        sel.unregister(sock)
        del waiting[sock]
        line = w.data.partition(b"\n")[0]
        hello = _hello_of(line) if data and b"\n" in w.data else None
        token = hello.get("token") if hello is not None else None
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            sock.close()  # a stranger, or a rank gone before it said who it is
            return None
        assert hello is not None
        session = Session(sock, hello)
        if not self.tty:
            self._reply(sock, {"ok": False, "why": NO_TTY})
            sock.close()
            place = (hello.get("kind"), hello.get("rank"), hello.get("where"), hello.get("nodeid"))
            if place not in self.said:
                self.said.add(place)
                self._say(f"msrun: {session.what} skipped: {NO_TTY}")
            return None
        return session

    def _start(self, session: Session, sel: selectors.BaseSelector) -> Session | None:
        sock = session.sock
        sock.setblocking(True)
        if not self._reply(sock, {"ok": True}):
            sock.close()
            return None
        sock.setblocking(False)
        self.sessions += 1
        nodeid = session.hello.get("nodeid") or ""
        self._say(
            f"msrun: {session.what}{' (' + nodeid + ')' if nodeid else ''}: pdb here; the job's timeout is "
            "paused until the rank goes on (c: continue; q: quit)"
        )
        sel.register(sock, selectors.EVENT_READ, "rank")
        sel.register(self.stdin, selectors.EVENT_READ, "stdin")
        return session

    def _end(self, session: Session, sel: selectors.BaseSelector) -> None:
        for obj in (session.sock, self.stdin):
            try:
                sel.unregister(obj)
            except (KeyError, ValueError):
                pass
        session.sock.close()
        self._say(f"msrun: rank {session.hello.get('rank')} goes on; the job's timeout runs again")

    def _from_rank(self, session: Session) -> bool:
        """Relay what the rank's pdb wrote; False once the rank closed its end."""
        try:
            data = session.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            return False
        _write_all(self.stdout, data)
        return True

    def _from_user(self, session: Session, sel: selectors.BaseSelector) -> None:
        try:
            data = os.read(self.stdin, 4096)
        except OSError:
            data = b""
        if not data:  # Ctrl+D: the end of pdb's input (pdb takes it as quit)
            sel.unregister(self.stdin)
            try:
                session.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return
        try:
            session.sock.setblocking(True)
            session.sock.sendall(data)
        except OSError:
            pass
        finally:
            session.sock.setblocking(False)

    @staticmethod
    def _reply(sock: socket.socket, msg: dict) -> bool:
        try:
            sock.sendall(json.dumps(msg).encode() + b"\n")
            return True
        except OSError:
            return False

    def _say(self, line: str) -> None:
        _write_all(self.stdout, ("\n" + line + "\n").encode("utf-8", "replace"))


def _hello_of(line: bytes) -> dict[str, object] | None:
    """A rank's hello: one flat JSON object of short scalars (anything else: None). Parsed by the
    total parser - whoever can reach the loopback port can send it."""
    from pytest_msrun.boundedjson import Rejected, loads

    try:
        hello = loads(line, max_depth=1)
    except Rejected:
        return None
    if not isinstance(hello, dict) or not all(
        isinstance(v, (str, int, float, bool, type(None))) for v in hello.values()
    ):
        return None
    return hello


def _forget(sel: selectors.BaseSelector, sock: socket.socket) -> None:
    try:
        sel.unregister(sock)
    except (KeyError, ValueError):
        pass
    sock.close()


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            n = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:
            return
        data = data[n:]
