"""A rank of a warm world: a pytest session that runs the tests the controller sends, one at a time.

The rank collects every test the world may run once, connects to the controller
(``MSRUN_WORLD=host:port``, proving ``MSRUN_WORLD_TOKEN``), and then for each ``run`` command:
points its records at that test's report directory (the same records a fresh job writes, so the
controller merges them with the same code), runs the item through pytest's own protocol with the
next planned item (module and session fixtures stay set up across tests), restores the process's
environment and working directory, and answers ``done`` with whatever the test leaked: threads
and child processes still running, file descriptors left open, environment changes. ``quit``
tears every fixture down and ends the session.

The wire is one JSON object per line over TCP (loopback): the controller never sends code, only
node ids from its own collection.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

import pytest

from pytest_msrun.plugin.records import SHARED_TMP_ENV

WORLD_ENV = "MSRUN_WORLD"
WORLD_TOKEN_ENV = "MSRUN_WORLD_TOKEN"
SETTLE = 0.2  # seconds a thread or child the test started may take to finish after it


def world_address(env: Any) -> tuple[str, int] | None:
    """The controller's address from ``MSRUN_WORLD`` (``host:port``), or None outside a warm world."""
    value = env.get(WORLD_ENV, "")
    host, _, port = value.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


class Snapshot:
    """What a test may leave behind, taken before it runs."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.threads = {t.ident for t in threading.enumerate()}
        self.fds = _fds()
        self.children = set(_children())
        self.modules = set(sys.modules)

    def leaks(self, ignore_fds: set[int]) -> list[str]:
        """What the test left: threads, child processes, descriptors, environment, working directory.

        A test that imported modules new to this process is not blamed for the threads, processes,
        descriptors and variables that appeared (a library's one-time initialization, e.g. a
        framework's thread pools); its working directory is still checked."""
        if set(sys.modules) - self.modules:
            return self._cwd_changed()
        deadline = time.monotonic() + SETTLE
        while True:
            threads = [t for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
            children = sorted(set(_children()) - self.children)
            if not (threads or children) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        out = [f"thread {t.name!r} still running" + (" (daemon)" if t.daemon else "") for t in threads]
        out += [f"child process {pid} ({_comm(pid)}) still running" for pid in children]
        for fd, target in sorted(_fds().items()):
            if fd not in ignore_fds and self.fds.get(fd) != target:
                out.append(f"file descriptor {fd} left open ({target})")
        env = dict(os.environ)
        for key in sorted(set(env) | set(self.env)):
            if env.get(key) != self.env.get(key):
                how = "set" if key not in self.env else ("removed" if key not in env else "changed")
                out.append(f"environment variable {key} {how}")
        return out + self._cwd_changed()

    def _cwd_changed(self) -> list[str]:
        try:
            cwd = os.getcwd()
        except OSError:
            cwd = "<removed>"
        return [f"working directory changed to {cwd}"] if cwd != self.cwd else []

    def restore(self) -> None:
        """The environment and working directory as they were before the test."""
        if dict(os.environ) != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        try:
            if os.getcwd() == self.cwd:
                return
        except OSError:
            pass
        os.chdir(self.cwd)


def _group_state() -> int | None:
    """The builtin control plane's collective counter of this rank (None: not in a group); ranks
    that may go on together have equal ones."""
    cluster = sys.modules.get("pytest_msrun.control.cluster")
    group = getattr(cluster, "_group", None) if cluster is not None else None
    return None if group is None else int(group.seq)


def _fds() -> dict[int, str]:
    """Open descriptors and what they point at (a number reused for another file counts as new)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the directory's own descriptor, already closed
    return out


def _children() -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as fh:
                out += [int(p) for p in fh.read().split()]
        except OSError:
            continue
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


class Channel:
    """One JSON object per line, both ways."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def receive(self) -> dict[str, Any] | None:
        line = self.reader.readline()
        if not line:
            return None
        msg = json.loads(line)
        return msg if isinstance(msg, dict) else None

    def close(self) -> None:
        for closable in (self.reader, self.sock):
            try:
                closable.close()
            except OSError:
                pass


class WorldServer:
    """Registered in a rank of a warm world: replaces pytest's run loop with the controller's commands."""

    def __init__(self, rank_plugin: Any, address: tuple[str, int], token: str) -> None:
        self.rank_plugin = rank_plugin
        self.address = address
        self.token = token

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        items = {item.nodeid: item for item in session.items}
        sock = socket.create_connection(self.address, timeout=30)
        sock.settimeout(None)
        channel = Channel(sock)
        plugin = self.rank_plugin
        channel.send({"t": "hello", "rank": plugin.rank, "pid": os.getpid(), "token": self.token})
        setup_state = session._setupstate  # pytest's own fixture stack (xdist's workers drive it alike)
        try:
            while True:
                msg = channel.receive()
                if msg is None or msg.get("t") == "quit":
                    break
                if msg.get("t") != "run":
                    continue
                nodeid = str(msg.get("nodeid"))
                item = items.get(nodeid)
                if item is None:
                    channel.send({"t": "missing", "nodeid": nodeid})
                    continue
                nextitem = items.get(str(msg.get("next"))) if msg.get("next") else None
                channel.send({"t": "done", "nodeid": nodeid, **self._run(item, nextitem, msg, setup_state)})
        finally:
            setup_state.teardown_exact(None)
            channel.close()
        return True

    def _run(self, item: pytest.Item, nextitem: pytest.Item | None, msg: dict[str, Any], setup_state: Any) -> dict:
        plugin = self.rank_plugin
        setup_state.teardown_exact(item)  # leave only what this item shares with the one before
        writer = plugin.begin_test(str(msg["report_dir"]), item.nodeid)
        shared = msg.get("shared_dir")
        if shared:
            os.environ[SHARED_TMP_ENV] = str(shared)
        before = Snapshot()
        try:
            item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        finally:
            leaks = before.leaks(ignore_fds={writer.fh.fileno()})
            before.restore()
            failed = plugin.end_test()
        return {"failed": failed, "leaks": leaks, "group": _group_state()}
