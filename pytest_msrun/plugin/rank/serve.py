"""A rank of a warm world: a pytest session that runs the tests the controller sends, one at a time.

The rank collects every test the world may run once, connects to the controller
(``MSRUN_WORLD=host:port``, proving ``MSRUN_WORLD_TOKEN``), and then for each ``run`` command points
its records at that test's report directory (the same records a fresh job writes, so the
controller merges them with the same code) and runs the item through pytest's own protocol. The
protocol's ``nextitem`` - which fixtures the teardown keeps - is learnt only when the test reaches
its teardown: the rank says ``called`` and the controller, having reported setup and call (so
``-x`` and ``--maxfail`` have acted), answers ``teardown`` with the next test this world will run
(or none). Module and session fixtures thus live exactly as long as in a plain pytest run.

After the test the rank restores the environment and working directory and answers ``done`` with
what the test left behind: threads and child processes still running, descriptors left open,
environment changes, memory grown (:mod:`.rankmemory`) - not counting what an import of a new module
or a fixture of a broader scope created meanwhile (a library's thread pool, a module fixture's
socket, its memory), which stays. ``quit`` tears every fixture left down - a failure there is
recorded as a late teardown report of the last test, where it belongs - and ends the session with
status 0 (each test was judged from its own records), so the controller judges the process's end
like a fresh job's.

The wire is the control plane's (:mod:`pytest_msrun.control.wire`: length-prefixed JSON frames, the
door's handshake first): the controller never sends code, only node ids from its own collection.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from os import _exit  # taken now: a test that replaces os._exit does not change how a rank ends
from typing import Any

import pytest

from pytest_msrun import proc
from pytest_msrun.engine import processes
from pytest_msrun.plugin import envscope, rankmemory
from pytest_msrun.plugin.links import Channel, join_world
from pytest_msrun.plugin.rank import forked
from pytest_msrun.plugin.rule.records import SHARED_TMP_ENV
from pytest_msrun.waiting import wait_until

PYTEST_OWN_ENV = "PYTEST_CURRENT_TEST"  # pytest itself leaves it set after a teardown that raised
SETTLE = 0.2  # seconds a thread or child the test started may take to finish after it


class State:
    """What a test may leave behind: threads, child processes, descriptors, environment."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.threads = {t.ident for t in threading.enumerate()}
        self.fds = _fds()
        self.children = set(_children())


class Owned:
    """What imports of new modules and fixtures of a broader scope created during a test: theirs, not
    the test's (they outlive it on purpose)."""

    def __init__(self) -> None:
        self.threads: set[int | None] = set()
        self.imported_threads: set[int | None] = set()  # those an import started
        self.fds: set[tuple[int, str]] = set()
        self.children: set[int] = set()
        self.env: dict[str, str | None] = {}  # variable -> the value it was left with (None: removed)

    def add(self, before: State, after: State, imported: bool) -> None:
        self.threads |= after.threads - before.threads
        if imported:
            self.imported_threads |= after.threads - before.threads
        self.fds |= {(fd, target) for fd, target in after.fds.items() if before.fds.get(fd) != target}
        self.children |= after.children - before.children
        for key in set(before.env) | set(after.env):
            if before.env.get(key) != after.env.get(key):
                self.env[key] = after.env.get(key)


class Snapshot:
    """The state before a test, and what others own of what appeared since."""

    def __init__(self) -> None:
        self.before = State()
        self.cwd = os.getcwd()
        self.owned = Owned()
        self.memory = rankmemory.Watch()  # what the test grows the rank by (theirs not counted)
        self._depth = 0

    # ---------------------------------------------------------------- who created what
    @contextlib.contextmanager
    def owning(self, imported: bool = False) -> Iterator[None]:
        """A context in which whatever appears belongs to the code run (an import, a fixture)."""
        self._depth += 1
        state = State() if self._depth == 1 else None
        if state is not None:
            self.memory.enter()
        try:
            yield
        finally:
            self._depth -= 1
            if state is not None:
                self.memory.exit()
                self.owned.add(state, State(), imported)

    # ---------------------------------------------------------------- after the test
    def leaks(self, ignore_fds: set[int]) -> tuple[list[str], bool]:
        """What the test itself left, and whether any of it still runs (a thread or a process)."""
        owned, before = self.owned, self.before
        known = before.threads | owned.threads
        threads: list[threading.Thread] = []
        children: list[int] = []

        def settled() -> bool:
            nonlocal threads, children
            threads = [t for t in threading.enumerate() if t.ident not in known and t.is_alive()]
            children = sorted(set(_children()) - before.children - owned.children)
            return not (threads or children)

        wait_until(settled, SETTLE)
        out = [f"thread {t.name!r} still running" + (" (daemon)" if t.daemon else "") for t in threads]
        out += [f"child process {pid} ({_comm(pid)}) still running" for pid in children]
        for fd, target in sorted(_fds().items()):
            if fd not in ignore_fds and before.fds.get(fd) != target and (fd, target) not in owned.fds:
                out.append(f"file descriptor {fd} left open ({target})")
        env, expected = dict(os.environ), self._expected_env()
        for key in sorted((set(env) | set(expected)) - {PYTEST_OWN_ENV}):
            if env.get(key) != expected.get(key):
                how = "set" if key not in expected else ("removed" if key not in env else "changed")
                out.append(f"environment variable {key} {how}")
        # A non-daemon thread an import started and left running is the library's, not a leak -
        # but it may keep the rank from exiting: the world ends after this test, so that a hang
        # at exit is reported on the test whose import started it, not on a later one.
        blocking = [t for t in threading.enumerate() if t.ident in owned.imported_threads and not t.daemon]
        return out + self._cwd_changed(), bool(threads or children or [t for t in blocking if t.is_alive()])

    def _expected_env(self) -> dict[str, str]:
        env = dict(self.before.env)
        for key, value in self.owned.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def _cwd_changed(self) -> list[str]:
        try:
            cwd = os.getcwd()
        except OSError:
            cwd = "<removed>"
        return [f"working directory changed to {cwd}"] if cwd != self.cwd else []

    def restore(self) -> None:
        """The environment (with what imports and broader fixtures set) and working directory as
        they were before the test."""
        expected = self._expected_env()
        if dict(os.environ) != expected:
            os.environ.clear()
            os.environ.update(expected)
        if self._cwd_changed():
            os.chdir(self.cwd)


@contextlib.contextmanager
def watching_imports(snapshot: Snapshot) -> Iterator[None]:
    """Inside it, the first import of a module new to this process runs inside ``owning()``."""
    original_import, original_import_module = builtins.__import__, importlib.import_module

    def owning_if_new(name: str, package: str | None = None, level: int = 0) -> Any:
        """``snapshot.owning()`` for a module not imported yet, else a context that does nothing."""
        if level:
            try:
                name = importlib.util.resolve_name("." * level + name, package)
            except (ImportError, ValueError):
                return contextlib.nullcontext()
        return snapshot.owning(imported=True) if name and name not in sys.modules else contextlib.nullcontext()

    def watched_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0):
        __tracebackhide__ = True  # a failing import shows the test's line, not this wrapper
        with owning_if_new(name, (globals or {}).get("__package__") if level else None, level):
            return original_import(name, globals, locals, fromlist, level)

    def watched_import_module(name: str, package: str | None = None):
        __tracebackhide__ = True
        with owning_if_new(name.lstrip("."), package, len(name) - len(name.lstrip("."))):
            return original_import_module(name, package)

    builtins.__import__ = watched_import
    importlib.import_module = watched_import_module
    try:
        yield
    finally:
        builtins.__import__, importlib.import_module = original_import, original_import_module


def _memory(snapshot: Snapshot, msg: dict[str, Any]) -> dict[str, Any]:
    """The test's memory sample for its ``done`` when the controller watches memory (``msg["memory"]``:
    the growth bound, the resident bound), else nothing."""
    bounds = msg.get("memory")
    if not isinstance(bounds, list) or not bounds:
        return {}
    bound = bounds[0] if isinstance(bounds[0], int) else 0
    return {"memory": snapshot.memory.end(bound)}


def _group_fds() -> set[int]:
    """The world's own connection to its control plane (``cluster.init()``, the ``msrun``
    fixture's collectives): it serves every test of the world, no test leaked it."""
    channel = getattr(forked.cluster_group(), "channel", None)
    try:
        return {channel.fileno()} if channel is not None else set()
    except (OSError, ValueError):
        return set()


def _interrupted_status(exc: BaseException) -> int:
    """The status a rank's pytest ends with when ``exc`` ends its session inside a test:
    ``pytest.exit``'s (2 by default), 2 for an interrupt, else 70 (an internal error, with its
    traceback in the rank's log)."""
    from _pytest.outcomes import Exit

    if isinstance(exc, Exit):
        sys.stderr.write(f"!!! {exc.msg} !!!\n")
        return int(exc.returncode) if exc.returncode is not None else int(pytest.ExitCode.INTERRUPTED)
    if isinstance(exc, KeyboardInterrupt):
        return int(pytest.ExitCode.INTERRUPTED)
    import traceback

    traceback.print_exc()
    return 70


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
    """This process's children still running (with orphans it adopted as a subreaper)."""
    out: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for task in tasks:
        out += [int(p) for p in (_proc(f"/proc/self/task/{task}/children") or "").split()]
    # An ended child - a zombie not yet waited for - is left to whoever started it (a fixture's
    # ``Popen`` still reads its status); an adopted orphan's goes to msrun with the rank.
    return [pid for pid in out if proc.state(pid) not in ("", "Z", "X")]


def _comm(pid: int) -> str:
    return (_proc(f"/proc/{pid}/comm") or "?").strip()


def _proc(path: str) -> str | None:
    """A /proc file's text (None: it cannot be read - the process or task has ended)."""
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


@dataclass
class LateNext:
    """The ``nextitem`` of a test in a warm world, known only when its teardown begins: pytest's
    teardown asks it for its collectors once the controller said which test comes next."""

    item: pytest.Item | None = None

    def listchain(self) -> list[Any]:
        return self.item.listchain() if self.item is not None else []


class WorldServer:
    """Registered in a rank of a warm world: replaces pytest's run loop with the controller's commands."""

    def __init__(self, rank_plugin: Any, address: tuple[str, int], token: str, forking: bool) -> None:
        self.rank_plugin = rank_plugin
        self.address = address
        self.token = token
        self.forking = forking  # a template: each test runs in a child forked for it (:mod:`.forked`)
        self.channel: Channel | None = None
        self.items: dict[str, pytest.Item] = {}
        self.next: LateNext | None = None  # the running test's
        self.snapshot: Snapshot | None = None
        self.quit = False  # the controller is gone or said quit while a test ran
        self.called = False  # a forked child said its call was over (its template reads the answer)
        self.last: pytest.Item | None = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        self.items = {item.nodeid: item for item in session.items}
        env_read = envscope.reads()  # collection is over: what it read, not what comes next
        # A child subreaper: what a test starts and detaches (``cmd &`` in a shell it ran) re-parents to
        # the rank - where the leak check sees it - not to msrun, unseen until it kills the rank later.
        processes.become_subreaper()
        if self.forking:
            forked.join_group()
        self.channel = channel = join_world(self.address, self.token, self.rank_plugin.rank)
        channel.send({"t": "env_read", "names": env_read})
        setup_state = session._setupstate  # pytest's own fixture stack (xdist's workers drive it alike)
        try:
            while not self.quit:
                msg = channel.receive()
                if msg is None or msg.get("t") == "quit":
                    break
                if msg.get("t") == "teardown":  # of a test this rank did not have: nothing to tear down
                    channel.send({"t": "done", "leaks": []})
                    continue
                if msg.get("t") != "run":
                    continue
                nodeid = str(msg.get("nodeid"))
                item = self.items.get(nodeid)
                if item is None:
                    channel.send({"t": "missing", "nodeid": nodeid})
                    continue
                if self.forking:
                    why = forked.unforkable()
                    if why:
                        channel.send({"t": "unforkable", "nodeid": nodeid, "why": why})
                    else:
                        self._run_forked(item, msg)
                    continue
                channel.send({"t": "done", "nodeid": nodeid, **self._run(item, msg)})
        finally:
            self._world_end(setup_state)
            # Every test was judged on its own, from its records: the session ends with 0, so that msrun
            # never stops the other ranks while they still tear down (their reports are not lost).
            session.testsfailed = 0
            channel.close()
        return True

    def _begin(self, item: pytest.Item, msg: dict[str, Any]) -> tuple[Any, dict[str, Any], Snapshot]:
        """Open ``item``'s records, set its shared directory and its own variables
        (--msrun-env-scope=test): its record writer, the variables replaced, the state before it."""
        writer = self.rank_plugin.begin_test(str(msg["report_dir"]), item.nodeid)
        shared = msg.get("shared_dir")
        if shared:
            os.environ[SHARED_TMP_ENV] = str(shared)
        replaced = envscope.apply(msg.get("env") or {})
        self.snapshot = snapshot = Snapshot()
        self.next = LateNext()
        self.last = item
        return writer, replaced, snapshot

    def _protocol(self, item: pytest.Item, snapshot: Snapshot) -> None:
        with watching_imports(snapshot):
            item.ihook.pytest_runtest_protocol(item=item, nextitem=self.next)

    def _done(self, leaks: list[str], lingering: bool) -> dict[str, Any]:
        """``group``: the builtin control plane's collective counter of this rank (None: not in a
        group); ranks that may go on together have equal ones."""
        group = forked.cluster_group()
        state = None if group is None else int(group.seq)
        return {"failed": self.rank_plugin.test_failed, "leaks": leaks, "lingering": lingering, "group": state}

    def _run(self, item: pytest.Item, msg: dict[str, Any]) -> dict[str, Any]:
        plugin = self.rank_plugin
        if self.last is not None:  # fixtures kept for another test than this one: the last test's to end
            self._teardown_for(self.last, lambda: item.session._setupstate.teardown_exact(item))
        writer, replaced, snapshot = self._begin(item, msg)
        try:
            self._protocol(item, snapshot)
        finally:
            streams = plugin.streams.fds() if plugin.streams is not None else set()
            leaks, lingering = snapshot.leaks(ignore_fds={writer.fh.fileno(), *_group_fds(), *streams})
            memory = _memory(snapshot, msg)
            snapshot.restore()
            envscope.revert(replaced)
            self.snapshot = self.next = None
        return {**self._done(leaks, lingering), **memory}

    # ---------------------------------------------------------------- a forking world's template
    def _run_forked(self, item: pytest.Item, msg: dict[str, Any]) -> None:
        """Run ``item`` in a child of this template; then say how it ended - or, when it ended
        as a fresh job's rank would not have, end this process the same way."""
        assert self.channel is not None
        read_fd, write_fd = os.pipe()
        processes.flush_std_streams()
        gc.freeze()  # the child's collections skip the template's objects: no copy of their pages
        with warnings.catch_warnings():  # Python >= 3.12 warns of a runtime's native threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            self._child(item, msg, write_fd)  # never returns
        os.close(write_fd)
        code, terminated = forked.wait_forwarding(pid, self.rank_plugin.stacks)
        info = forked.read_info(read_fd)
        if not info.get("done") or code != info.get("status"):
            forked.mirror(code)
        if info.get("quit"):
            self.quit = True
        if info.get("called"):  # the controller's answer to the child's "called", unread by the child
            answer = self.channel.receive()
            if answer is None or answer.get("t") != "teardown":
                self.quit = True  # the controller is gone, or ends the world now
        forked.take_group(info.get("group"))
        retire = forked.retire_reason(info, _children())
        ended = {"t": "ended", "nodeid": item.nodeid, "pid": pid, "code": code, "retire": retire}
        self.channel.send({**ended, "rss": rankmemory.rss()})  # the template's (--msrun-max-rss)
        forked.raise_again(terminated)  # msrun ended the job while the child finished its test

    def _child(self, item: pytest.Item, msg: dict[str, Any], fd: int) -> None:
        """The forked child: the whole protocol of ``item`` (nothing kept for a next test), its
        records, its ``done`` - then the end of a process, with pytest's status."""
        try:
            forked.child_start()
            plugin = self.rank_plugin
            _, _, snapshot = self._begin(item, msg)  # the snapshot for its memory: what imports and fixtures grew
            self._protocol(item, snapshot)
            plugin.end_test()
            code = 1 if plugin.test_real_failure else 0
            assert self.channel is not None
            self.channel.send({"t": "done", "nodeid": item.nodeid, **self._done([], False), **_memory(snapshot, msg)})
            info = {
                "done": True,
                "status": code,
                "group": forked.group_state(),
                "quit": self.quit,
                "called": self.called,
            }
            forked.tell_parent(fd, {**info, "runtimes": forked.new_runtimes()})
            forked.child_exit(code)
        except BaseException as exc:  # noqa: BLE001 - the template mirrors the end
            _exit(_interrupted_status(exc))

    # ---------------------------------------------------------------- hooks while a test runs
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
        """Before the teardown: say the call is over, learn which test comes next."""
        if self.next is not None and nextitem is self.next and self.channel is not None:
            # "failed": what would end this rank in a fresh job (a strict xfail that passed would not)
            self.channel.send({"t": "called", "nodeid": item.nodeid, "failed": self.rank_plugin.test_real_failure})
            if self.forking:
                # A forked child keeps nothing for a next test: it tears every fixture down at once,
                # as a fresh job's rank does, not waiting for the controller's answer (its template
                # reads it once the child ended: whether the world goes on).
                self.called = True
                return (yield)
            answer = self.channel.receive()
            if answer is None or answer.get("t") != "teardown":
                self.quit = True  # the controller is gone, or ends the world now: tear everything down
            else:
                following = answer.get("next")
                if not answer.get("keep", True):  # the next test's variables differ: no fixture serves it
                    following = None
                self.next.item = self.items.get(str(following)) if following else None
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Generator[None, None, Any]:
        """What a fixture broader than a test creates lives on with it: not the test's leak."""
        if self.snapshot is None or getattr(fixturedef, "scope", "function") == "function":
            return (yield)
        with self.snapshot.owning():
            return (yield)

    # ---------------------------------------------------------------- the world's end
    def _world_end(self, setup_state: Any) -> None:
        """Tear every fixture left down (a failure is a late teardown report of the last test) and
        close the last test's records. (No test ran here - a forking world's template, which runs
        each in a child - has nothing set up.)"""
        if self.last is not None:
            self._teardown_for(self.last, lambda: setup_state.teardown_exact(None))
            self.rank_plugin.end_test()

    def _teardown_for(self, item: pytest.Item, teardown: Any) -> None:
        """Run ``teardown``; a failure is a late teardown report of ``item`` (whose records are open)."""
        from _pytest import runner

        reraise = getattr(runner, "get_reraise_exceptions", lambda config: (pytest.exit.Exception, KeyboardInterrupt))
        call = runner.CallInfo.from_call(teardown, when="teardown", reraise=reraise(item.config))
        if call.excinfo is not None:
            self.rank_plugin.write_late(item.ihook.pytest_runtest_makereport(item=item, call=call))
