"""The job's processes on this node: start them, watch them end, stop them with grace, sweep.

Every child runs in its own session (so a tty stays readable for ``pdb``, as with msrun) and
gets ``PR_SET_PDEATHSIG=SIGKILL``. The launcher is a child subreaper, so descendants orphaned
by a dying child are re-parented to it and swept. What survives a SIGKILLed launcher is the
business of :mod:`pytest_msrun.engine.containment` (the job's cgroup and its watchdog).

This layer takes plain inputs (:class:`Launch`); it knows nothing of plans or ranks. Waiting is
done through an :class:`~pytest_msrun.engine.loop.EventLoop`, which also watches signals and the
control-plane link, so one loop sees everything that can happen.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_msrun.engine.containment import JobGuard
    from pytest_msrun.engine.loop import EventLoop


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_SIGKILL = int(signal.SIGKILL)

_libc: ctypes.CDLL | None = None


def _prctl(option: int, arg: int) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process instead of init."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


_setpriv: str | None = None
_setpriv_looked = False


def _pdeathsig_wrapper(sig: str = "KILL") -> list[str]:
    """``setpriv --pdeathsig <sig> --`` when util-linux's setpriv is installed.

    Setting the parent-death signal through a tiny exec'd helper keeps ``subprocess`` on its
    fast vfork path; without setpriv a ``preexec_fn`` does the same, more slowly.
    """
    global _setpriv, _setpriv_looked
    if not _setpriv_looked:
        _setpriv, _setpriv_looked = shutil.which("setpriv"), True
    return [_setpriv, "--pdeathsig", sig, "--"] if _setpriv else []


def with_parent_death_signal(
    argv: list[str], sig: signal.Signals = signal.SIGTERM
) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` and a ``preexec_fn`` (or None) so the child gets ``sig`` when this thread's process dies.

    Used for processes that clean up after themselves on ``sig`` (msrun tears its job down on
    SIGTERM): whatever way their parent ends, ``kill -9`` included, they are told.
    """
    wrapper = _pdeathsig_wrapper(sig.name[3:])
    if wrapper:
        return [*wrapper, *argv], None
    if _libc is None:
        _prctl(0, 0)
    parent = os.getpid()
    signum = int(sig)

    def setup() -> None:  # runs in the forked child, before exec
        assert _libc is not None
        _libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(128 + signum)

    return list(argv), setup


def _child_setup_factory(parent_pid: int, cpus: list[int] | None = None):
    if _libc is None:
        _prctl(0, 0)  # load libc in the parent: the child must not import or load anything

    def setup() -> None:  # runs in the forked child, before exec
        os.setsid()
        assert _libc is not None
        _libc.prctl(PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(137)
        if cpus is not None:  # binding without taskset
            os.sched_setaffinity(0, cpus)

    return setup


@dataclass(frozen=True)
class Launch:
    """What to start: the full command (binding prefix included), its environment and log."""

    argv: list[str]
    env: dict[str, str]
    log_path: str
    stdin_devnull: bool = True  # else the launcher's stdin (a worker of a --join=True job)
    pass_fds: tuple[int, ...] = ()
    in_child_cpus: list[int] | None = None  # bind in the child (no taskset)


@dataclass(eq=False)
class Child:
    """A running (or finished) child process of this job; ``tag`` is the caller's (its spec)."""

    tag: Any
    popen: subprocess.Popen
    started: float
    pidfd: int | None = None
    ended: float | None = None
    returncode: int | None = None
    terminated_by_us: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def reap(self) -> bool:
        """Collect the exit status if the child exited; True when it did (now or before)."""
        if self.returncode is not None:
            return True
        rc = self.popen.poll()
        if rc is None:
            return False
        self.returncode = rc
        self.ended = time.time()
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
        return True


def exit_status(returncode: int) -> int:
    """Shell-style status: the code, or 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_returncode(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (exit status {128 - returncode})"
    return f"exited with code {returncode}"


def spawn(launch: Launch, tag: Any = None) -> Child:
    """Start ``launch`` with its log file as stdout+stderr (truncated, as msrun does)."""
    log_dir = os.path.dirname(launch.log_path)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    # A child bound in-process (no taskset) needs the slower preexec path; others exec setpriv.
    wrapper = _pdeathsig_wrapper() if launch.in_child_cpus is None else []
    with open(launch.log_path, "wb") as log:
        popen = subprocess.Popen(
            [*wrapper, *launch.argv],
            env=launch.env,
            stdin=subprocess.DEVNULL if launch.stdin_devnull else None,
            stdout=log,
            stderr=subprocess.STDOUT,
            close_fds=True,
            pass_fds=launch.pass_fds,
            start_new_session=bool(wrapper),
            preexec_fn=None if wrapper else _child_setup_factory(os.getpid(), launch.in_child_cpus),
        )
    child = Child(tag=tag, popen=popen, started=time.time())
    try:
        child.pidfd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        child.pidfd = None
    return child


def term_grace(env: Mapping[str, str] | None = None) -> float:
    """How long a process may take to end after SIGTERM (``MSRUN_TERM_TIMEOUT``, 5 s)."""
    try:
        return max(0.0, float((os.environ if env is None else env).get("MSRUN_TERM_TIMEOUT", "5")))
    except ValueError:
        return 5.0


def signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid``; False when it no longer exists."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` from ``/proc`` (all threads)."""
    out: list[int] = []
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/children") as fh:
                out.extend(int(x) for x in fh.read().split())
        except OSError:
            continue
    return out


def descendants_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (breadth first)."""
    seen: list[int] = []
    frontier = children_of(pid)
    while frontier:
        nxt: list[int] = []
        for p in frontier:
            if p not in seen:
                seen.append(p)
                nxt.extend(children_of(p))
        frontier = nxt
    return seen


def reap_orphans(exclude: Iterable[int] = ()) -> None:
    """Reap zombies re-parented to this (subreaper) process, except pids still owned elsewhere."""
    skip = set(exclude)
    for pid in children_of(os.getpid()):
        if pid in skip:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def sweep_descendants(exclude: Iterable[int] = ()) -> list[int]:
    """SIGKILL every descendant of this process not in ``exclude``; returns the pids hit."""
    skip = set(exclude)
    hit: list[int] = []
    for pid in descendants_of(os.getpid()):
        if pid in skip:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            hit.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return hit


class ProcessGroup:
    """Every process of this node's job: started inside the job's cgroup and under the watchdog,
    watched by the event loop, stopped along one path (SIGTERM to each process group, a bounded
    grace, SIGKILL, then a sweep of whatever left the tree)."""

    def __init__(self, loop: EventLoop, guard: JobGuard) -> None:
        self.loop = loop
        self.guard = guard
        self.children: list[Child] = []

    def start(self, launch: Launch, tag: Any = None) -> Child:
        self.guard.ready()  # every process starts inside the job's cgroup
        child = spawn(launch, tag)
        self.guard.watchdog.guard(child.pid)
        self.children.append(child)
        self.loop.watch(child)
        return child

    def alive(self) -> list[Child]:
        return [c for c in self.children if c.alive]

    def forget(self, child: Child) -> None:
        """Drop a finished child (a dry run keeps only what runs in memory)."""
        self.children.remove(child)

    def terminate(self, children: Iterable[Child]) -> None:
        for child in children:
            if child.alive:
                child.terminated_by_us = True
                signal_group(child.pid, signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        """Until every child ended or ``deadline`` (other events are irrelevant by now)."""
        while self.alive():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.loop.poll(min(remaining, 0.5))
            for child in self.alive():
                child.reap()

    def stop(self, grace: float) -> None:
        """SIGTERM to whatever still runs, ``grace`` seconds, then SIGKILL."""
        self.terminate(self.alive())
        self.wait(time.monotonic() + grace)
        for child in self.alive():
            signal_group(child.pid, signal.SIGKILL)
        self.wait(time.monotonic() + 10.0)

    def sweep(self) -> list[int]:
        """Kill what the job left: members of its process groups, descendants re-parented to us,
        and anything else in the job's cgroup. Returns the pids hit."""
        for child in self.children:
            signal_group(child.pid, signal.SIGKILL)
        exclude = [p for p in (self.guard.watchdog.pid,) if p]
        hit = sweep_descendants(exclude=exclude)
        hit += [p for p in self.guard.kill_members() if p not in hit]
        if hit:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and descendants_of(os.getpid()) != exclude:
                reap_orphans(exclude=exclude)
                time.sleep(0.005)
        reap_orphans(exclude=exclude)
        return hit
