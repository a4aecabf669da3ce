"""The session's fork server: a template interpreter that forks each job's msrun as this process's child.

Started at the session's first job (from the main thread: its forks' parent-death signal is tied to
the thread that started it), with the modules a rank imports - pytest and the plugins this session
loaded from installed distributions - and msrun's own. A job's msrun forked from it forks its
Python workers in turn (:mod:`pytest_msrun.engine.template`), so a world's ranks skip an
interpreter's start-up and every import. An msrun it cannot fork (a Slurm step, a fork server that
did not start or is stale) is spawned as before; each reason is said once, in the session's summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from pytest_msrun.engine import template
from pytest_msrun.engine.processes import Child, popen_dying_with_parent
from pytest_msrun.fileio import open_output
from pytest_msrun.plugin import options
from pytest_msrun.plugin.marker import MARKER
from pytest_msrun.proc import wait_readable
from pytest_msrun.record import field, record
from pytest_msrun.targets import TARGETS

READY_TIMEOUT = 120.0  # s the first request waits for the template's imports
# what every rank imports as it starts (its debugger's hooks, its extras' and call phase's plugins)
RANK_MODULES = (
    "pytest_msrun.plugin.rank.debugrank",
    "pytest_msrun.plugin.rank.rankextras",
    "pytest_msrun.plugin.rank.callphase",
)
# this session's, never a rank's (xdist's worker, the running test, addopts applied already)
SESSION_VARS = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS")
REPLY_TIMEOUT = 30.0  # s a request waits for its pid (a fork: milliseconds)


@record(eq=False)
class ForkedProcess(Child):
    """A child of this process that the fork server forked (``CLONE_PARENT``), with the part of
    :class:`subprocess.Popen` the plugin uses: ``poll``, ``wait``, ``kill``, ``pid``,
    ``returncode``, ``args``."""

    args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.pid)

    def poll(self) -> int | None:
        self.reap()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if timeout is None and not self.reap():  # unreaped: the pid is still this child's
            with contextlib.suppress(ChildProcessError):  # (reaped elsewhere: reap() says so)
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        elif timeout is not None and self.peek_end(timeout) is None and not self.reap():
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def kill(self) -> None:
        if not self.reap():  # unreaped: the pid is still this child's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class ForkServer:
    """The template process of one session, started on first use; :meth:`start_msrun` forks an msrun."""

    def __init__(self, preload: Callable[[], tuple[list[str], list[str]]], log_path: Callable[[], str]) -> None:
        self.preload = preload  # what the template imports (modules, plugins), asked when it starts
        self.log_path = log_path  # where its output goes, asked when it starts
        self._early = False  # a template forked from this process at its start, not yet begun
        self.refusals: list[str] = []  # why msruns or their workers started as new processes (once each)
        self._proc: subprocess.Popen | ForkedProcess | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._broken = ""  # why it forks nothing more
        self.origin: dict[str, str] = {}  # the template's environment
        self.frameworks: list[str] = []  # asked to preload (the marked tests' imports)
        self.modules: list[str] = []  # their modules, in the order of their imports here
        self._asked = 0  # frameworks requests sent; a reply to an older one is passed over

    def refuse(self, why: str) -> None:
        """Note a reason something started as a new process (said once in the summary)."""
        if why not in self.refusals:
            self.refusals.append(why)

    def adopt(self, proc: ForkedProcess, sock: socket.socket, origin: dict[str, str]) -> None:
        """Take the template forked from this process at its start (:mod:`.earlytemplate`)."""
        self._proc, self._sock, self.origin, self._early = proc, sock, origin, True

    def _start(self) -> None:
        if self._early and self._sock is not None:  # forked from this process at its start: its log now
            self._early = False
            try:
                with open_output(self.log_path(), binary=True) as log:
                    socket.send_fds(self._sock, [b'{"session": true}'], [log.fileno()])
                return
            except OSError:  # it is gone: one is spawned instead
                self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.origin = template_env()
        preload, plugins = self.preload()
        hello = json.dumps(
            {
                "preload": preload,
                "plugins": plugins,
                "frameworks": self.frameworks,
                "modules": self.modules,
                "n": self._asked,
            }
        )
        env = {**self.origin, template.FD_ENV: str(theirs.fileno()), template.HELLO_ENV: hello}
        argv = [sys.executable, "-m", template.__name__]
        try:
            with open_output(self.log_path(), binary=True) as log:
                self._proc = popen_dying_with_parent(
                    argv, signal.SIGKILL, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),)
                )
        finally:
            theirs.close()
        self._sock = ours

    def begin(self) -> None:
        """Start the template now (its imports overlap what this session does meanwhile)."""
        if (self._proc is None or self._early) and not self._broken:
            try:
                self._start()
            except OSError as exc:
                self._fail(f"the fork server did not start ({exc})")

    def preload_frameworks(self, names: list[str], modules: list[str]) -> None:
        """Have the template import the packages ``names`` too, and their ``modules`` (each package
        if the preload rule lets it: why not is said in the summary); its next fork waits for them."""
        new = [n for n in names if n not in self.frameworks]
        asked = set(self.modules)
        more = [m for m in modules if m not in asked]
        if not new and not more:
            return
        self.frameworks += new
        self.modules += more
        started = self._proc is not None
        self.begin()
        if not started or self._broken or self._sock is None:
            return  # (a template started now was told them in its hello)
        self._asked += 1
        try:
            request = {"frameworks": self.frameworks, "modules": self.modules, "n": self._asked}
            self._sock.send(json.dumps(request).encode())
        except OSError as exc:
            self._fail(f"the fork server could not be reached ({exc})")
        self._ready = False

    def _fail(self, why: str) -> None:
        self._broken = why
        self.refuse(why)
        self.close()

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        sock = self._sock
        if sock is None or not wait_readable(sock.fileno(), timeout):
            return None
        data = sock.recv(1 << 16)
        if not data:
            return None
        reply = json.loads(data)
        return reply if isinstance(reply, dict) else None

    def _await_ready(self) -> bool:
        while not self._ready:
            reply = self._receive(READY_TIMEOUT)
            if reply is None or reply.get("why"):
                why = "did not get ready" if reply is None else f"forks nothing: {reply['why']}"
                self._fail(f"the fork server {why}")
                return False
            if reply.get("n", 0) != self._asked:
                continue  # ready before the session's last request
            for name, why in dict(reply.get("refused", {})).items():
                self.refuse(f"ranks import {name} themselves (not preloaded: {why})")
            self._ready = True
        return True

    def start_msrun(self, cmd: list[str], env: dict[str, str], stdout: int, stderr: int) -> ForkedProcess | None:
        """Fork ``cmd`` (``python -m pytest_msrun ...``) with ``env``, stdin from /dev/null and
        ``stdout``/``stderr`` as given: its process, or None (it is to be spawned; why is noted)."""
        if cmd[1:3] != ["-m", "pytest_msrun"] or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
            self.refuse("msrun runs under another command (a Slurm step): its ranks start as new processes")
            return None
        self.begin()
        if self._broken or not self._await_ready():
            return None
        assert self._sock is not None
        request = {"cmdline": cmd, "env": env, "cwd": os.getcwd()}
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [null, stdout, stderr])
            reply = self._receive(REPLY_TIMEOUT)
        except OSError as exc:
            self._fail(f"the fork server could not be reached ({exc})")
            return None
        finally:
            os.close(null)
        pid = reply.get("pid") if reply is not None else None
        if not isinstance(pid, int):
            more = f"forks nothing more: {reply.get('error') or 'no pid'}" if reply is not None else "did not answer"
            self._fail(f"the fork server {more}")
            return None
        return ForkedProcess(tag=None, pid=pid, started=time.time(), args=cmd)

    def close(self) -> None:
        """End the template: its socket closed (its end of file: it returns), then its process waited
        for, killed after 5 s (its forks are this process's children and live on)."""
        sock, self._sock = self._sock, None
        proc, self._proc = self._proc, None
        if sock is not None:
            sock.close()
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def template_env() -> dict[str, str]:
    """The template's environment: this process's, as a rank's interpreter starts with it."""
    env = {name: value for name, value in os.environ.items() if name not in SESSION_VARS}
    # as every rank has it (msrun sets it): a fork must stand for a fresh rank's interpreter
    env["PYTHONUNBUFFERED"] = "1"
    return env


def rewriting_hook() -> Callable[[], None] | None:
    """In the template, before it imports plugins: pytest's assertion-rewriting import hook with
    the modules of every plugin distribution marked, as a rank's pytest installs it - so a plugin
    is imported (and its asserts rewritten) as a rank would import it, and the rank's pytest finds
    it imported by its own kind of hook (no "already imported, cannot be rewritten" warning).
    Returns what removes the hook after the imports; None where this pytest's internals differ
    (the template then imports no plugin: each rank does)."""
    import importlib.metadata

    try:
        from _pytest.assertion import install_importhook
        from _pytest.config import _iter_rewritable_modules, get_config

        config = get_config([])
        for attr in ("inicfg", "_inicfg"):  # (where pytest 8 and 9 read ini values; none are set here)
            if not hasattr(config, attr):
                setattr(config, attr, {})
        hook = install_importhook(config)
        files = (
            str(file)
            for dist in importlib.metadata.distributions()
            if any(ep.group == "pytest11" for ep in dist.entry_points)
            for file in dist.files or []
        )
        for name in _iter_rewritable_modules(files):
            hook.mark_rewrite(name)
    except Exception:
        return None

    def remove() -> None:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)

    return remove


MARKED_BEFORE = "msrun/marked-tests"  # pytest's cache: the last session collected marked tests


def last_session(value: object, spec: str) -> tuple[bool, list[str], list[str]]:
    """What the cache's :data:`MARKED_BEFORE` says: the last session had marked tests, the
    frameworks they imported and their modules, as ``spec`` (``--msrun-preload``) changes them
    (false, or ``{"frameworks": [...], "modules": [...]}``; true from older versions)."""
    from pytest_msrun.plugin.controller.frameworks import chosen

    def names(key: str) -> list[str]:
        got = value.get(key) if isinstance(value, dict) else None
        return [str(n) for n in got] if isinstance(got, list) else []

    tops = chosen(names("frameworks"), spec)
    return bool(value), tops, [m for m in names("modules") if m.partition(".")[0] in tops]


class ForkServerHooks:
    """A session's hooks for its fork server: started with the first marked test collected - or
    at the session's start where the project's last session had marked tests (pytest's cache), so
    its imports overlap the whole collection; why anything started as a new process, said in the
    summary; ended with the session."""

    def __init__(self, forks: ForkServer, preload: str = "auto") -> None:
        self.forks = forks
        self.marked_collected = False
        self.preload = preload  # --msrun-preload
        self._frameworks: list[str] | None = None  # (found once, at the collection's end)

    def _found(self, items: list[pytest.Item], config: pytest.Config) -> list[str]:
        if self._frameworks is None:
            from pytest_msrun.plugin.controller.frameworks import frameworks

            self._frameworks = frameworks(items, config, self.preload)
        return self._frameworks

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        from pytest_msrun.plugin.controller.frameworks import module_names, rank_modules

        # (a conftest's pytest_collection_modifyitems may have marked them after they were collected)
        self.marked_collected = self.marked_collected or any(i.get_closest_marker(MARKER) for i in session.items)
        tops = self._found(session.items, session.config)
        self.forks.preload_frameworks(tops, module_names(tops) + rank_modules(session.items, tops))

    def pytest_report_collectionfinish(self, config: pytest.Config, items: list[pytest.Item]) -> str | None:
        names = self._found(items, config)
        if not names:
            return None
        them = "them" if len(names) > 1 else "it"
        return f"msrun: ranks start with {', '.join(names)} imported (the marked tests import {them}; --msrun-preload)"

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        cache = getattr(session.config, "cache", None)
        marked, tops, modules = last_session(
            cache.get(MARKED_BEFORE, False) if cache is not None else False, self.preload
        )
        if marked:  # its imports overlap the collection (the frameworks it had, too)
            if not self.forks.frameworks:
                self.forks.frameworks, self.forks.modules = tops, modules
            self.forks.begin()

    def pytest_collect_file(self, file_path: Any, parent: pytest.Collector) -> None:
        """A test file that uses the marker: the template imports the frameworks it imports (read
        from its text) while the session imports the file - in parallel, not after it."""
        import fnmatch

        patterns = parent.config.getini("python_files") or ["test_*.py"]
        if file_path.suffix == ".py" and any(fnmatch.fnmatch(file_path.name, pat) for pat in patterns):
            from pytest_msrun.plugin.controller.frameworks import file_frameworks

            tops, modules = file_frameworks(str(file_path), self.preload)
            if tops:
                self.forks.preload_frameworks(tops, modules)

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        if not self.marked_collected and item.get_closest_marker(MARKER) is not None:
            self.marked_collected = True
            self.forks.begin()
            # what its module imports: the template imports them while the collection goes on
            from pytest_msrun.plugin.controller.frameworks import frameworks, module_names

            tops = frameworks([item], item.config, self.preload)
            self.forks.preload_frameworks(tops, module_names(tops))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = getattr(session.config, "cache", None)
        tops = self._frameworks or []
        now = {"frameworks": tops, "modules": self.forks.modules} if self.marked_collected else False
        if cache is not None and cache.get(MARKED_BEFORE, False) != now:
            cache.set(MARKED_BEFORE, now)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for why in self.forks.refusals:
            terminalreporter.write_line(f"msrun: {why}")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.forks.close()


def session_fork_server(config: pytest.Config) -> ForkServer:
    """The session's fork server (started with the first marked test collected)."""
    return ForkServer(
        lambda: preload_for(config, options.unused_rank_plugins(config)),  # what the ranks load
        lambda: str(config._tmp_path_factory.getbasetemp() / "msrun-fork-server.log"),  # type: ignore[attr-defined]
    )


def preload_for(config: pytest.Config, skip: list[str]) -> tuple[list[str], list[str]]:
    """What a rank of this session imports before collecting: pytest and this plugin's modules,
    then the plugins loaded from installed distributions (entry points) but those in ``skip``
    (``-p no:NAME`` given to ranks)."""
    names = ["pytest", "pytest_msrun.pytest_plugin", "pytest_msrun.plugin.rank.rank", "pytest_msrun.plugin.rank.serve"]
    names += ["pytest_msrun.plugin.rank.forked", TARGETS["msrun"].partition(":")[0], *RANK_MODULES]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return names, []
    manager = config.pluginmanager
    loaded = [
        (getattr(plugin, "__name__", None), manager.get_name(plugin)) for plugin, _ in manager.list_plugin_distinfo()
    ]
    return names, [name for name, key in loaded if isinstance(name, str) and key not in skip and name not in names]
