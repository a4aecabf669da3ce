"""A rank's pdb, on the controller's terminal: ``breakpoint()``, ``pdb.set_trace()``, and ``--pdb``.

A rank has no terminal: its stdin is ``/dev/null`` and its output is its log. Here each stop of
pdb connects to the controller's debug server (:mod:`.debugserver`) and runs pdb over that
connection, prompt ``(Pdb rank N)``: the user answers on the controller's terminal, the rank's log
keeps only the rank's own output. A stop that keeps stepping (``n``, ``s``) stays on one
connection; ``c`` (or ``q``) closes it, and a breakpoint hit later opens another. Where the
controller has no terminal - or there is no controller (a suite under ``pmsrun pytest``) - the
stop is skipped with one line in the rank's log for each place (and, without a terminal, a warning
of the test, which the controller's report shows), and the rank goes on.

With the controller's ``--pdb`` a failing test's exception stops in ``post_mortem`` the same way
(the records already hold the failure: the verdict does not change).
"""

from __future__ import annotations

import os
import pdb
import sys
import unittest
import warnings
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import pytest

from pytest_msrun.control import wire
from pytest_msrun.netaddr import controller_address
from pytest_msrun.plugin.links import DEBUG_ENV, DEBUG_NONE_ENV, DEBUG_PDB_ENV, DEBUG_TOKEN_ENV

CONNECT_TIMEOUT = 5.0
PENDING_MAX = 1 << 16  # bytes of pdb output kept while no connection is open
NO_CONTROLLER = "no terminal (a rank of pmsrun pytest has none: its output is its log)"


def _place(path: str, line: int) -> str:
    """``path:line``, the path relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line}"


class Link(wire.Channel):
    """One open session with the controller, pdb's stdin and stdout: raw bytes once the handshake's
    frames are read (``frames.buf`` first holds the user's input read with the controller's answer)."""

    def write(self, text: str) -> None:
        try:
            self.sock.sendall(text.encode("utf-8", "replace"))
        except OSError:
            pass

    def readline(self) -> str:
        buf = self.frames.buf
        while b"\n" not in buf:
            try:
                data = self.sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
        end = buf.find(b"\n") + 1 or len(buf)
        line = bytes(buf[:end])
        del buf[:end]
        return line.decode("utf-8", "replace")


class _Stdio:
    """pdb's stdin and stdout: the open session's lines ("" - pdb's EOF, a quit - when none is
    open); what pdb writes goes to it, or is kept until one opens."""

    def __init__(self, owner: RankPdb) -> None:
        self.owner = owner
        self.pending = ""
        self.encoding = "utf-8"

    def write(self, text: str) -> int:
        link = self.owner.link
        if link is None:
            self.pending = (self.pending + text)[-PENDING_MAX:]
        else:
            if self.pending:
                text, self.pending = self.pending + text, ""
            link.write(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        return self.owner.link.readline() if self.owner.link is not None else ""

    def isatty(self) -> bool:
        return False


class RankPdb(pdb.Pdb):
    """pdb over the controller's connection; each stop opens one unless the last is still open."""

    def __init__(self, debugger: RankDebugger, link: Link | None) -> None:
        self.debugger = debugger
        self.link: Link | None = link
        stdio = _Stdio(self)
        super().__init__(stdin=stdio, stdout=stdio, nosigint=True)  # type: ignore[arg-type]
        self.prompt = f"(Pdb rank {debugger.rank}) "

    def interaction(self, frame: FrameType | None, tb: Any) -> None:
        post_mortem = frame is None
        if self.link is None:
            where = _place(frame.f_code.co_filename, frame.f_lineno) if frame is not None else "?"
            self.link = self.debugger.open("breakpoint", where)
            if self.link is None:  # no terminal: go on as if continued
                self.set_continue()
                return
        try:
            super().interaction(frame, tb)
        finally:
            # c or q (or a post-mortem's end): the user is done with this stop; n, s, ... stop again soon
            if post_mortem or self.quitting or getattr(self, "stoplineno", 0) == -1:
                link, self.link = self.link, None
                if link is not None:
                    link.close()


class RankDebugger:
    """Registered in a rank of this project's jobs: its ``breakpoint()`` and ``--pdb`` go to the controller."""

    def __init__(self, rank: int, post_mortem: bool, nodeid: Callable[[], str]) -> None:
        """For the controller's server named in this process's environment (removed from it: a
        process this rank starts is not the rank)."""
        env = os.environ
        self.rank = rank
        self.address = env.pop(DEBUG_ENV, "")  # "" where no controller serves a debugger (a suite, no terminal)
        self.token = env.pop(DEBUG_TOKEN_ENV, "")
        self.none = env.pop(DEBUG_NONE_ENV, "")  # why no controller serves a debugger, as the controller said
        self.post_mortem = env.pop(DEBUG_PDB_ENV, "") == "1" or post_mortem
        self.nodeid = nodeid  # the test running now
        self.refused: set[tuple[str, str]] = set()
        self._saved: tuple[Any, Any, Any] | None = None  # the hooks replaced

    # ---------------------------------------------------------------- hooks of this process
    def install(self) -> None:
        if self._saved is None:
            self._saved = (sys.breakpointhook, pdb.set_trace, getattr(pytest, "set_trace", None))
            sys.breakpointhook = self.breakpointhook
            pdb.set_trace = self.set_trace
            pytest.set_trace = self.set_trace  # type: ignore[attr-defined,unused-ignore]

    def uninstall(self) -> None:
        if self._saved is not None:
            hook, set_trace, pytest_set_trace = self._saved
            if sys.breakpointhook == self.breakpointhook:
                sys.breakpointhook = hook
            if pdb.set_trace == self.set_trace:
                pdb.set_trace = set_trace
            if pytest_set_trace is not None and getattr(pytest, "set_trace", None) == self.set_trace:
                pytest.set_trace = pytest_set_trace  # type: ignore[attr-defined,unused-ignore]
            self._saved = None

    def breakpointhook(self, *args: Any, **kwargs: Any) -> Any:
        chosen = os.environ.get("PYTHONBREAKPOINT", "")
        if chosen == "0":
            return None
        if chosen not in ("", "pdb.set_trace") and self._saved is not None:
            return self._saved[0](*args, **kwargs)  # a debugger of the user's choice
        return self._trace(sys._getframe(1), kwargs.get("header"))

    def set_trace(self, *, header: str | None = None, **_: Any) -> None:
        self._trace(sys._getframe(1), header)

    def _trace(self, frame: FrameType, header: str | None) -> None:
        link = self.open("breakpoint", _place(frame.f_code.co_filename, frame.f_lineno))
        if link is None:
            return
        debugger = RankPdb(self, link)
        if header is not None:
            debugger.message(header)
        debugger.set_trace(frame)

    # ---------------------------------------------------------------- pytest's hooks
    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """After pytest's debugging plugin configured itself: its pdb would read the rank's stdin."""
        manager = session.config.pluginmanager
        for name in ("pdbinvoke", "pdbtrace"):  # a suite's ranks: --pdb and --trace are ours
            plugin = manager.get_plugin(name)
            if plugin is not None:
                manager.unregister(plugin)
        self.install()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.uninstall()

    def pytest_exception_interact(self, node: Any, call: pytest.CallInfo[Any], report: Any) -> None:
        excinfo = call.excinfo
        if not self.post_mortem or excinfo is None or isinstance(excinfo.value, unittest.SkipTest):
            return
        tb = _traceback(excinfo.value, excinfo.tb)
        crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
        where = _place(str(crash.path), int(crash.lineno)) if crash is not None else "?"
        link = self.open("post_mortem", where)
        if link is None:
            return
        debugger = RankPdb(self, link)
        debugger.reset()
        text = getattr(report, "longreprtext", "") or ""
        title = f" rank {self.rank}: {getattr(report, 'nodeid', '')} ({getattr(report, 'when', '')}) "
        debugger.message(f"{title:>^78}\n{text}\n{' entering PDB ':>^78}")
        debugger.interaction(None, tb)

    # ---------------------------------------------------------------- the connection
    def open(self, kind: str, where: str) -> Link | None:
        """A session with the controller for a stop at ``where``; None (said once for each place, in
        the rank's log and as a warning of the test) where there is none to have."""
        if (kind, where) in self.refused:
            return None
        link, why = self._connect(kind, where)
        if link is None:
            self.refused.add((kind, where))
            what = "breakpoint()" if kind == "breakpoint" else "--pdb"
            line = f"msrun: {what} in rank {self.rank} at {where} skipped: {why}"
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            if self.none:  # the controller has no terminal: its console says so, with the test's warnings
                path, _, number = where.rpartition(":")
                lineno = int(number) if number.isdigit() else 0
                warnings.warn_explicit(line, DebuggerSkipped, path or where, lineno, module="msrun")
        return link

    def _connect(self, kind: str, where: str) -> tuple[Link | None, str]:
        if self.none:
            return None, self.none
        address = controller_address(self.address, os.environ)
        if address is None:
            return None, NO_CONTROLLER
        hello = {"t": "hello", "kind": "debug", "rank": self.rank, "stop": kind}
        hello.update(where=where[-2000:], nodeid=self.nodeid()[-4000:])
        try:
            channel = Link.connect(address[0], address[1], timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            return None, f"the controller's debugger cannot be reached ({exc})"
        try:
            channel.handshake(hello, self.token, CONNECT_TIMEOUT)
            reply = channel.recv(None)  # another rank may be in the debugger: this one waits its turn
        except (OSError, wire.ProtocolError) as exc:
            channel.close()
            return None, f"the controller's debugger closed the connection ({exc})"
        if reply.get("t") != "ok":
            channel.close()
            return None, "the controller's debugger refused this rank"
        return channel, ""


class DebuggerSkipped(UserWarning):
    """A rank's ``breakpoint()`` or ``--pdb`` stop skipped: the controller has no terminal."""


def _traceback(exc: BaseException, tb: TracebackType) -> TracebackType:
    """The traceback to inspect (a doctest's unexpected exception: the test's own)."""
    from doctest import UnexpectedException

    return exc.exc_info[2] if isinstance(exc, UnexpectedException) else tb
