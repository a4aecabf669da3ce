"""The job's processes on this node: start them, watch them end, stop them with grace, sweep.

Every child runs in its own session (so a tty stays readable for ``pdb``, as with msrun),
started with ``posix_spawn`` - one ``vfork`` + ``exec`` from C, no Python in the child. The
launcher is a child subreaper, so descendants orphaned by a dying child are re-parented to it
and swept. What survives a SIGKILLed launcher is the business of
:mod:`pytest_msrun.engine.containment` (the job's cgroup and its watchdog).

This layer takes plain inputs (:class:`Launch`); it knows nothing of plans or ranks. Waiting is
done through an :class:`~pytest_msrun.engine.loop.EventLoop`, which also watches signals and the
control-plane link, so one loop sees everything that can happen.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping

from pytest_msrun.engine import suppress
from pytest_msrun.fileio import make_dirs, open_output_fd
from pytest_msrun.pathsearch import which
from pytest_msrun.proc import descendants, wait_readable
from pytest_msrun.record import record
from pytest_msrun.waiting import wait_until

TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from typing import Any

    from pytest_msrun.engine.containment import JobGuard
    from pytest_msrun.engine.loop import EventLoop


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Python ignores these; a child must start with them at their defaults (as subprocess does).
_DEFAULT_IN_CHILD = (signal.SIGPIPE, signal.SIGXFSZ)

_prctl_call: Any = None  # calls libc's prctl(2) with five integers; loaded once


def _load_prctl() -> Any:
    """A function calling libc's ``prctl`` with five integers. Through ``_ctypes`` itself (its
    ``call_function``): ~2 ms less on msrun's start path than importing :mod:`ctypes`."""
    try:
        import _ctypes

        address = _ctypes.dlsym(_ctypes.dlopen(None, os.RTLD_NOW), "prctl")  # type: ignore[arg-type]
        call = _ctypes.call_function
        return lambda *args: call(address, args)
    except (ImportError, AttributeError, OSError):
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl


def _prctl(option: int, arg: int) -> None:
    global _prctl_call
    with suppress(OSError, AttributeError):
        if _prctl_call is None:
            _prctl_call = _load_prctl()
        _prctl_call(option, arg, 0, 0, 0)


def become_subreaper() -> None:
    """Make orphaned descendants re-parent to this process instead of init."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int, parent: int = 0) -> None:
    """This process gets ``sig`` when the thread that forked it ends (``PR_SET_PDEATHSIG``); given
    its ``parent``'s pid, it ends at once (status ``128 + sig``) where that parent is gone already."""
    _prctl(PR_SET_PDEATHSIG, int(sig))
    if parent and os.getppid() != parent:
        os._exit(128 + int(sig))


def popen_dying_with_parent(argv: list[str], sig: signal.Signals, **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen)`` in a session of its own with stdin from /dev/null, the
    child getting ``sig`` when this thread's process dies.

    Used for processes that clean up after themselves on ``sig`` (msrun tears its job down on
    SIGTERM): whatever way their parent ends, ``kill -9`` included, they are told. util-linux's
    ``setpriv --pdeathsig`` sets it where installed (``subprocess`` keeps its fast path); else a
    ``preexec_fn`` does.
    """
    import subprocess

    setpriv, preexec, parent = which("setpriv"), None, os.getpid()
    if setpriv:
        argv = [setpriv, "--pdeathsig", sig.name[3:], "--", *argv]
    else:
        _prctl(0, 0)  # libc loaded in the parent: the child must not import or load anything
        preexec = lambda: die_with_parent(sig, parent)  # noqa: E731 - runs in the forked child, before exec
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec, **popen)


def resolve(program: str, env: Mapping[str, str]) -> str:
    """``program`` as ``exec`` will run it: a path, or found on the *child's* ``PATH``."""
    if os.sep in program:
        return program
    found = which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(2, "No such file or directory", program)
    return found


def fork_call(
    call: str,
    env: Mapping[str, str],
    *,
    stdin_fd: int | None = None,
    output_fd: int | None = None,
    keep_fds: tuple[int, ...] = (),
    args: list[str] | None = None,
) -> int:
    """Run ``call`` (a key of :data:`~pytest_msrun.targets.TARGETS`, called with the environment
    as a dict - and ``args`` when given - and returning the exit status) in a forked copy of this
    process, in a session of its own; returns its pid.

    What ``posix_spawn`` of a Python program would give, minus an interpreter's start-up and its
    imports: signals at their defaults and unblocked, fds 0-2 as given, every other descriptor
    closed but ``keep_fds``, ``os.environ`` replaced by ``env`` (in the child only). Call it with
    no other thread running (a fork copies only the calling thread, not the locks others hold).

    Signals stay blocked across the fork until the child has its session and default handlers: a
    SIGTERM sent the instant after it (by pid: its group does not exist yet) then ends it, rather
    than running a handler inherited from this process."""

    def run() -> int:
        become_fresh_child(env, stdin_fd=stdin_fd, stdout_fd=output_fd, stderr_fd=output_fd, keep_fds=keep_fds)
        # what ps and top show: the program a command stands for, else msrun's part
        comm = os.path.basename(args[0]) if args else f"msrun-{call}"
        with suppress(OSError), open("/proc/self/comm", "w") as fh:
            fh.write(comm[:15])
        from pytest_msrun.targets import resolve

        target = resolve(call)
        result = target(dict(env)) if args is None else target(dict(env), list(args))
        return result if isinstance(result, int) else 0

    return forked(run, os.fork)


def forked(body: Callable[[], int], fork: Callable[[], int]) -> int:
    """Run ``body`` in a child that ``fork`` makes, this process's streams flushed first (nothing
    buffered may be written twice) and every signal blocked across the fork (see :func:`fork_call`);
    returns its pid here. In the child ``body()``'s result is the exit status (a ``SystemExit``'s as
    the interpreter computes it; another exception is printed, and gives 1), after the standard
    streams are flushed."""
    flush_std_streams()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    pid = -1
    try:
        pid = fork()
    finally:
        if pid:  # here: forked, or the fork failed
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if pid:
        return pid
    code = 1
    try:
        code = body()
    except SystemExit as exc:
        code = exit_code_of(exc)
    except BaseException:
        import traceback

        with suppress(Exception):
            traceback.print_exc()
    finally:
        flush_std_streams()
        os._exit(code)


_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
_MPOL_DEFAULT, _MPOL_BIND = 0, 2


def set_memory_policy(nodes: list[int] | None) -> None:
    """This thread's memory policy: ``MPOL_BIND`` to ``nodes`` (as ``numactl --membind`` sets
    it), or the default (None)."""
    import ctypes

    number = _SYS_SET_MEMPOLICY.get(os.uname().machine)
    if number is None:
        raise OSError(f"set_mempolicy is not wired up on {os.uname().machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    if nodes:
        bits = 64
        words = max(nodes) // bits + 1
        mask = (ctypes.c_ulong * words)()
        for node in nodes:
            mask[node // bits] |= 1 << (node % bits)
        result = libc.syscall(ctypes.c_long(number), _MPOL_BIND, mask, ctypes.c_ulong(words * bits + 1))
    else:
        result = libc.syscall(ctypes.c_long(number), _MPOL_DEFAULT, None, ctypes.c_ulong(0))
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"set_mempolicy: {os.strerror(errno)}")


def flush_std_streams() -> None:
    """Write out what ``sys.stdout`` and ``sys.stderr`` buffer (a closed or broken stream is skipped)."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()


def run_exit_steps() -> None:
    """What an interpreter does on its way out, before ``os._exit``: wait for its non-daemon
    threads, run its ``atexit`` handlers, flush its standard streams."""
    import atexit
    import threading

    with suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with suppress(BaseException):
        atexit._run_exitfuncs()
    flush_std_streams()


def exit_code_of(exc: SystemExit) -> int:
    """The status ``SystemExit`` gives a process, as the interpreter computes it (a message is
    printed to stderr and gives 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


def become_fresh_child(
    env: Mapping[str, str],
    *,
    stdin_fd: int | None,
    stdout_fd: int | None,
    stderr_fd: int | None,
    keep_fds: tuple[int, ...] = (),
) -> None:
    """In a forked child whose signals are blocked (:func:`forked`): a session of its own, signals
    as a fresh interpreter started by this process has them and unblocked, fds 0-2 as given with
    fresh ``sys`` streams, every other descriptor closed but ``keep_fds``, ``os.environ`` = ``env``."""
    os.setsid()
    import gc

    gc.freeze()  # the parent's objects: never walked here (nor copied by collections)
    gc.enable()  # as a fresh interpreter has it (msrun holds it off while it starts)
    with suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    # exec keeps what the parent ignores (nohup's SIGHUP, a background job's SIGINT and SIGQUIT) and
    # resets what it handles: so does this fork, as a spawned child inherits them
    ignored = set()
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with suppress(OSError, ValueError):
                if signal.getsignal(sig) == signal.SIG_IGN and sig not in _DEFAULT_IN_CHILD:
                    ignored.add(sig)
                else:
                    signal.signal(sig, signal.SIG_DFL)
    # as a fresh interpreter has them: KeyboardInterrupt (unless ignored), and EPIPE / EFBIG rather than death
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in _DEFAULT_IN_CHILD:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for fd, target in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2)):
        if fd is not None and fd != target:
            os.dup2(fd, target)
    import io

    # fresh streams on fds 0-2: this process's may be anything (pytest's capture, say)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", line_buffering=True)
        setattr(sys, name, stream)
    low = 3
    for fd in sorted(keep_fds):
        os.closerange(low, fd)
        os.set_inheritable(fd, False)
        low = fd + 1
    os.closerange(low, 1 << 16)
    os.environ.clear()  # this is the child: the launcher's own environment is untouched
    os.environ.update(env)


@record(frozen=True)
class Launch:
    """What to start: the full command (binding prefix included), its environment and log."""

    argv: list[str]
    env: dict[str, str]
    log_path: str
    stdin_devnull: bool = True  # else the launcher's stdin (a worker of a --join=True job)
    pass_fds: tuple[int, ...] = ()  # made inheritable for this child (others stay closed)
    in_child_cpus: list[int] | None = None  # bind in the child (no taskset)
    in_child_mems: list[int] | None = None  # MPOL_BIND in the child (a fork's numactl --membind)
    call: str = ""  # a target (pytest_msrun.targets) run in a fork of this process (``argv``: what it stands for)
    call_args: list[str] | None = None  # given to ``call`` after the environment (None: not)


@record(eq=False)
class Child:
    """A running (or finished) child process of this job; ``tag`` is the caller's (its spec)."""

    tag: Any
    pid: int
    started: float
    pidfd: int | None = None
    ended: float | None = None
    returncode: int | None = None  # as subprocess has it: negative for a death by signal
    terminated_by_us: bool = False

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the child's process group; False when nothing was left to signal.

        A child forked an instant ago may not lead its group yet (:func:`fork_call` calls
        ``setsid`` in the child): while it is unreaped its pid cannot be reused, so it gets the
        signal directly (its signals stay blocked until its defaults are set)."""
        return signal_group(self.pid, sig) or (self.returncode is None and _sent(os.kill, self.pid, sig))

    def reap(self) -> bool:
        """Collect the exit status if the child exited; True when it did (now or before)."""
        if self.returncode is not None:
            return True
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (a sweep of orphans): its status is lost
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return False
        self.returncode = os.waitstatus_to_exitcode(status)
        self.ended = time.time()
        if self.pidfd is not None:
            with suppress(OSError):
                os.close(self.pidfd)
        return True

    def peek_end(self, timeout: float = 0.0) -> int | None:
        """The return code once the child ended, waiting up to ``timeout`` s, without collecting
        it: its exit still comes as an event of the loop."""
        if self.returncode is not None:
            return self.returncode
        if timeout > 0 and self.pidfd is not None:
            with suppress(OSError, ValueError):
                wait_readable(self.pidfd, timeout)
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is None or info.si_pid == 0:
            return None
        return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


def describe_returncode(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (exit status {128 - returncode})"
    return f"exited with code {returncode}"


def spawn(launch: Launch, tag: Any = None) -> Child:
    """Start ``launch`` with its log file as stdout+stderr (truncated, as msrun does): in a fork
    (``call``), or with ``posix_spawn``, which passes only inheritable descriptors (Python opens
    everything close-on-exec). ``in_child_cpus`` and ``in_child_mems`` (``MPOL_BIND``) are this
    thread's around the start, so the child has them from its first instruction (as ``taskset``'s
    and ``numactl``'s would, before anyone looks); msrun has the default memory policy again after."""
    log_dir = os.path.dirname(launch.log_path)
    if log_dir:
        make_dirs(log_dir)
    log = open_output_fd(launch.log_path)  # not through a link or into a FIFO someone put there
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) if launch.stdin_devnull else None
    for fd in launch.pass_fds:
        os.set_inheritable(fd, True)
    cpus, mems = launch.in_child_cpus, launch.in_child_mems
    saved = os.sched_getaffinity(0) if cpus is not None else None
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if mems:
            set_memory_policy(mems)
        if launch.call:
            pid = fork_call(
                launch.call, launch.env, stdin_fd=null, output_fd=log, keep_fds=launch.pass_fds, args=launch.call_args
            )
        else:
            argv, env = launch.argv, launch.env
            actions = [(os.POSIX_SPAWN_DUP2, fd, n) for fd, n in ((null, 0), (log, 1), (log, 2)) if fd is not None]
            path = resolve(argv[0], env)
            pid = os.posix_spawn(
                path, argv, env, file_actions=actions, setsid=True, setsigdef=_DEFAULT_IN_CHILD, setsigmask=()
            )
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)
        if mems:
            set_memory_policy(None)
        for fd in launch.pass_fds:
            with suppress(OSError):
                os.set_inheritable(fd, False)
        os.close(log)
        if null is not None:
            os.close(null)
    child = Child(tag=tag, pid=pid, started=time.time())
    with suppress(AttributeError, OSError):
        child.pidfd = os.pidfd_open(pid)
    return child


def close_inherited_descriptors() -> None:
    """Make every descriptor above 2 this process inherited close-on-exec, so children get only
    what is handed to them (as ``subprocess``'s ``close_fds`` did)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        if fd > 2:
            with suppress(OSError):
                if os.get_inheritable(fd):
                    os.set_inheritable(fd, False)


def term_grace() -> float:
    """How long a process may take to end after SIGTERM (``MSRUN_TERM_TIMEOUT``, 5 s)."""
    try:
        return max(0.0, float(os.environ.get("MSRUN_TERM_TIMEOUT", "5")))
    except ValueError:
        return 5.0


def _sent(kill: Callable[[int, int], None], pid: int, sig: int) -> bool:
    """Whether ``kill(pid, sig)`` reached something (False: gone, or not ours to signal)."""
    try:
        kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid``; False when it no longer exists."""
    return _sent(os.killpg, pid, sig)


class ProcessGroup:
    """Every process of this node's job: started inside the job's cgroup and under the watchdog,
    watched by the event loop, stopped along one path (SIGTERM to each process group, a bounded
    grace, SIGKILL, then a sweep of whatever left the tree)."""

    def __init__(self, loop: EventLoop, guard: JobGuard) -> None:
        self.loop = loop
        self.guard = guard
        self.children: list[Child] = []

    def start(self, launch: Launch, tag: Any = None, *, held: bool = False) -> Child:
        """Start ``launch`` inside the job's cgroup - or, ``held``, now, while msrun may still be
        entering it: the caller holds the process until it has moved it in (:mod:`.earlystart`)."""
        if not held:
            self.guard.ready()  # every process starts inside the job's cgroup
        child = spawn(launch, tag)
        self.guard.watchdog.tell(str(child.pid))  # its process group
        self.children.append(child)
        self.loop.watch(child)
        return child

    def alive(self) -> list[Child]:
        return [c for c in self.children if c.alive]

    def terminate(self, children: Iterable[Child]) -> None:
        """SIGTERM to each of ``children`` still running - once: a second SIGTERM would run its
        handler again, inside the first (coverage saving its data twice at once breaks both)."""
        for child in children:
            if child.alive and not child.terminated_by_us:
                child.terminated_by_us = True
                child.signal(signal.SIGTERM)

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
            child.signal(signal.SIGKILL)
        self.wait(time.monotonic() + 10.0)

    def sweep(self) -> list[int]:
        """Kill what the job left: members of its process groups, descendants re-parented to us,
        and anything else in the job's cgroup. Returns the pids hit."""
        for child in self.children:
            child.signal(signal.SIGKILL)
        exclude = [p for p in (self.guard.watchdog.pid,) if p]
        skip, hit = set(exclude), []
        for pid in descendants(os.getpid())[1:]:  # re-parented to this subreaper, or below
            if pid not in skip:
                skip.add(pid)
                if _sent(os.kill, pid, signal.SIGKILL):
                    hit.append(pid)
        hit += [p for p in self.guard.kill_members() if p not in hit]

        def swept() -> bool:  # zombies reaped (only this process's children can be) and none left
            for pid in descendants(os.getpid())[1:]:
                if pid not in exclude:
                    with suppress(ChildProcessError, OSError):
                        os.waitpid(pid, os.WNOHANG)
            return descendants(os.getpid())[1:] == exclude

        if hit:
            wait_until(swept, 2.0, 0.005)
        swept()
        return hit
