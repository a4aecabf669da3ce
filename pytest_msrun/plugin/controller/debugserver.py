"""The controller's end of the ranks' debugger: pdb sessions of ranks, on this terminal, one at a time.

Ranks run without a terminal (stdin ``/dev/null``, output into their logs). A rank that stops in
pdb - ``breakpoint()``, or ``--pdb`` on a failure (:mod:`.debugrank`) - connects here through the
one door of every listener (:mod:`pytest_msrun.control.door`: it proves the session's token, and
strangers are bounded) and says who and where it is. The controller serves one session at a time
on a thread: the rank's pdb output goes to the terminal, what the user types goes to the rank,
until the rank goes on (``c``) and closes its end; a rank that comes meanwhile waits its turn.

The server listens only where a session can use it: with a terminal (stdin a tty). Without one
nothing listens; the ranks are told why, and each skips its stops, saying so once for each place.

While a session is open or waiting, :meth:`DebugServer.held` grows: the jobs' deadlines (their
timeout, the exit and failure graces) add it, so a rank in the debugger is neither timed out nor
taken for hung.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from pytest_msrun.control import wire
from pytest_msrun.control.door import Admitted, Door, Tally, unregister
from pytest_msrun.netaddr import rank_listener
from pytest_msrun.plugin.links import DEBUG_ENV, DEBUG_NONE_ENV, DEBUG_PDB_ENV, DEBUG_TOKEN_ENV

HELLO_WAIT = 5.0  # seconds a connection may take to prove the session's token
MAX_QUEUED = 1024  # ranks waiting their turn at most (they hold the token: the session's own ranks)
NO_TTY = "no terminal (stdin is not a tty)"


def _what(hello: dict) -> str:
    """The stop a rank's hello asks the debugger for."""
    rank, where = hello.get("rank"), hello.get("where", "?")
    if hello.get("stop") == "post_mortem":
        return f"--pdb: the failure of rank {rank} at {where}"
    return f"breakpoint() in rank {rank} at {where}"


class DebugServer:
    """A loopback server the ranks' pdb sessions come to; one thread relays them to the terminal."""

    def __init__(self, *, post_mortem: bool, terminal: int | None, stdout_fd: int = 1, steps: bool = False) -> None:
        """``terminal``: the user's terminal to read (a tty; its owner closes it), None: there is none.
        ``stdout_fd``: where the sessions' output goes (a copy of it is taken now). ``steps``: ranks
        run in Slurm steps, on other nodes."""
        self.post_mortem = post_mortem
        self.steps = steps
        self.token = os.urandom(16).hex()
        self.tty = terminal is not None and os.isatty(terminal)
        self.stdin = terminal if terminal is not None and self.tty else -1
        self.stdout = os.dup(stdout_fd)
        self.lock = threading.Lock()
        self._held = 0.0
        self._busy_since: float | None = None
        self.sessions = 0  # served so far
        self._closed = False
        self._address = ""  # the server and its thread start with the first job (a session may have none)
        self.strangers = Tally(time.monotonic())  # who its door dropped (read once its thread ended)

    @property
    def address(self) -> str:
        """``host:port`` ranks connect to (the server starts listening the first time it is asked;
        only with a terminal)."""
        if not self._address and self.tty:
            # ranks of Slurm steps reach this host where srun ran (only the session's token is served)
            self.server, address = rank_listener(self.steps, backlog=128)
            self._wake_r, self._wake_w = os.pipe()
            self.thread = threading.Thread(target=self._loop, name="msrun-debug", daemon=True)
            self.thread.start()
            self._address = address
        return self._address

    # ---------------------------------------------------------------- for the jobs
    def env(self) -> dict[str, str]:
        """What a rank needs to reach this server - or, without a terminal, why there is none."""
        out = {DEBUG_ENV: self.address, DEBUG_TOKEN_ENV: self.token} if self.tty else {DEBUG_NONE_ENV: NO_TTY}
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
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            self.thread.join(timeout=5)
            fds += [self._wake_r, self._wake_w]
            self.server.close()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---------------------------------------------------------------- the thread
    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        door = Door(
            self.server, token=self.token, kinds=("debug",), timeout=HELLO_WAIT, selector=sel, tally=self.strangers
        )
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        queue: list[Admitted] = []
        active: Admitted | None = None
        try:
            while True:
                if active is None and queue:
                    active = self._start(queue.pop(0), sel)
                self._busy(active is not None or bool(queue))
                for key, _ in sel.select(timeout=door.wait(0.5)):
                    tag = key.data
                    if tag == "wake":
                        return
                    try:
                        if tag is door:
                            queue += [s for s in map(self._session, door.ready(key.fileobj)) if s is not None]
                            del queue[MAX_QUEUED:]
                        elif tag == "rank" and active is not None:
                            if not self._from_rank(active):
                                self._end(active, sel)
                                active = None
                        elif tag == "stdin" and active is not None:
                            self._from_user(active, sel)
                    except Exception as exc:  # noqa: BLE001 - that connection's fault, not the server's end
                        if tag == "rank" and active is not None:
                            self._say(f"msrun: the ranks' debugger dropped {_what(active.hello)}: {exc!r}")
                            unregister(sel, active.sock)
                            active.sock.close()
                            active = None
                door.expire()
        except Exception as exc:  # noqa: BLE001 - the debugger must never break the session
            self._say(f"msrun: the ranks' debugger stopped: {exc!r}")
        finally:
            self._busy(False)
            for s in [*queue, *([active] if active else [])]:
                s.sock.close()
            door.close()
            sel.close()

    @staticmethod
    def _session(admitted: Admitted) -> Admitted | None:
        """A rank in (it proved the token): its session, once its hello holds only short scalars."""
        if not all(isinstance(v, (str, int, float, bool, type(None))) for v in admitted.hello.values()):
            admitted.sock.close()
            return None
        return admitted

    def _start(self, session: Admitted, sel: selectors.BaseSelector) -> Admitted | None:
        sock = session.sock
        sock.setblocking(True)
        try:
            sock.sendall(wire.encode({"t": "ok"}))
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        self.sessions += 1
        nodeid = session.hello.get("nodeid") or ""
        self._say(
            f"msrun: {_what(session.hello)}{' (' + nodeid + ')' if nodeid else ''}: pdb here; the job's timeout is "
            "paused until the rank goes on (c: continue; q: quit)"
        )
        sel.register(sock, selectors.EVENT_READ, "rank")
        sel.register(self.stdin, selectors.EVENT_READ, "stdin")
        return session

    def _end(self, session: Admitted, sel: selectors.BaseSelector) -> None:
        for obj in (session.sock, self.stdin):
            unregister(sel, obj)
        session.sock.close()
        self._say(f"msrun: rank {session.hello.get('rank')} goes on; the job's timeout runs again")

    def _from_rank(self, session: Admitted) -> bool:
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

    def _from_user(self, session: Admitted, sel: selectors.BaseSelector) -> None:
        try:
            data = os.read(self.stdin, 4096)
        except OSError:
            data = b""
        if not data:  # Ctrl+D: the end of pdb's input (pdb takes it as quit)
            sel.unregister(self.stdin)
            with contextlib.suppress(OSError):
                session.sock.shutdown(socket.SHUT_WR)
            return
        with contextlib.suppress(OSError):
            session.sock.setblocking(True)
            session.sock.sendall(data)
        session.sock.setblocking(False)

    def _say(self, line: str) -> None:
        _write_all(self.stdout, ("\n" + line + "\n").encode("utf-8", "replace"))


def paused_clock(debug: DebugServer, held: float | None = None) -> Callable[[], float]:
    """A monotonic clock that stands still while ranks are in the debugger (since ``held``, a value
    of ``debug.held()``; default: now): the jobs' deadlines are read on it."""
    start = debug.held() if held is None else held
    return lambda: time.monotonic() - (debug.held() - start)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            n = os.write(fd, data)
        except OSError:
            return
        data = data[n:]
