"""Process isolation without a process start-up: a rank of a forking world forks each test.

A forking world is a warm world (:mod:`.serve`) whose ranks never run a test themselves: each is a
*template* - pytest configured, the plugins loaded, every test of the world collected (its modules
imported), the control plane's group joined - that forks one child per test. The child runs the
test through pytest's own protocol with no next test (every fixture, of every scope, is set up
and torn down in it), answers the controller over the connection it inherited, and ends the way
a fresh job's rank would: pytest's status (1 when the test failed on this rank, else 0), after
the threads and exit handlers the test left have run.

The child *is* the rank for that test. What would end a fresh job's rank - the test's process
crashing, ending before its test did, or ending with another status than its test's - ends the
template the same way (:func:`mirror`), so msrun sees the rank end as it would have in a fresh
job (its first-failure rule, its status file, the controller's verdict - all unchanged). A child
that ends cleanly hands back what it changed of the template's state that outlives it: the
group's collective counter. A test that left the group, left a process running, or initialised
a distributed runtime that joins a job once per process (MindSpore's communication) ends the
world after it.

A template in which an import started a Python thread refuses to fork (:func:`unforkable`), and
its tests run as fresh jobs.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import weakref
from os import _exit  # taken now: a test that replaces os._exit does not change how a rank ends
from typing import Any

from pytest_msrun.engine import processes, suppress
from pytest_msrun.plugin.rule.records import encode_json


def join_group() -> None:
    """Join the control plane's group before the first fork, so that every child shares it (a
    child that joined on its own would leave it when it ends)."""
    env = os.environ
    if env.get("MS_ROLE") == "MS_WORKER" and env.get("MSRUN_SCHEDULER") in ("auto", "builtin", "mindspore"):
        from pytest_msrun.control import cluster

        cluster.init()


def unforkable() -> str:
    """Why this process must not fork ("" when it may): a Python thread an import started would be
    missing in the child, holding whatever it held (a lock, a half-written buffer). The native
    threads of a library's runtime (torch's, MindSpore's thread pools) are left alone: those
    runtimes re-create them in a forked child, as every DataLoader worker relies on."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if not others:
        return ""
    names = ", ".join(sorted(repr(t.name) for t in others)[:3])
    return f"its ranks run {len(others)} thread(s) an import started ({names}): forking them is unsafe"


def cluster_group() -> Any:
    """This process's group in the builtin control plane (``cluster.init()``), or None - without
    importing the cluster API where nothing used it."""
    cluster = sys.modules.get("pytest_msrun.control.cluster")
    return getattr(cluster, "_group", None) if cluster is not None else None


def group_state() -> Any:
    """The group as this child leaves it: its collective counter, None when it never joined,
    or "left" when it left or holds messages it has not consumed (the group cannot go on)."""
    group = cluster_group()
    if group is None:
        return "left" if _joined_at_fork else None
    channel = getattr(group, "channel", None)
    if channel is not None and (getattr(channel, "pending", None) or getattr(channel, "eof", False)):
        return "left"
    return int(group.seq)


# ---------------------------------------------------------------- in the child
def child_start() -> None:
    """The child's first steps: it dies with its template, adopts what its test detaches, and
    runs at its exit only the exit handlers its test registered (the template's are not its own:
    a module's ``TemporaryDirectory`` must outlive the test that imported it)."""
    processes.die_with_parent(signal.SIGKILL)
    processes.become_subreaper()
    global _runtimes_at_fork, _joined_at_fork
    _runtimes_at_fork = runtimes_started()
    _joined_at_fork = cluster_group() is not None
    atexit._clear()
    for info in list(weakref.finalize._registry.values()):  # type: ignore[attr-defined]
        info.atexit = False
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]


def child_exit(status: int) -> None:
    """End the child as the interpreter ends a process: its non-daemon threads are waited for,
    its exit handlers run, its output flushed - then ``status``."""
    processes.run_exit_steps()
    _exit(status)


def tell_parent(fd: int, info: dict[str, Any]) -> None:
    with suppress(OSError), os.fdopen(fd, "wb", buffering=0) as pipe:
        pipe.write(encode_json(info).encode())


# ---------------------------------------------------------------- in the template
# Every thread's stack lands in a rank's stacks file on SIGUSR1 (the controller's timeout) and on
# SIGTERM (msrun tearing the job down), which then still ends the process (chained).
STACK_SIGNALS = {signal.SIGUSR1: False, signal.SIGTERM: True}  # signal: chain to its handler


def dump_stacks_on_signals(stacks: Any) -> None:
    """Dump every thread's stack into ``stacks`` on :data:`STACK_SIGNALS`."""
    import faulthandler

    for signum, chain in STACK_SIGNALS.items():
        faulthandler.register(signum, file=stacks, all_threads=True, chain=chain)


def wait_forwarding(pid: int, stacks: Any) -> tuple[int, int]:
    """Wait for the child ``pid``: its return code as ``subprocess`` reports it (the exit status,
    or minus the signal), and the terminating signal (SIGTERM) this template got meanwhile (0 if
    none).

    While it waits, the child is the rank: a stack request (SIGUSR1) is the child's to answer,
    and SIGTERM ends the child first - the template ends only after it (a template ending first
    would SIGKILL its child, its parent-death signal, in the middle of what the child does on
    SIGTERM: coverage saving its data). A SIGTERM to the child's process group reached the child
    too; one to the template alone is passed on. The caller ends the template after that
    (:func:`mirror`, or :func:`raise_again`). The stack dumps are registered again afterwards
    (``faulthandler`` must be unregistered before another handler is set, else its registration
    is silently lost)."""
    import faulthandler

    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            if received:
                return  # once: the child's handler may not be re-entrant
            received.append(signum)
            try:
                if os.getpgid(pid) == os.getpgrp():
                    return  # the group's signal reached the child as well
            except OSError:
                return
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    previous = {}
    for signum in STACK_SIGNALS:
        if stacks is not None:
            faulthandler.unregister(signum)
        previous[signum] = signal.signal(signum, forward)
    try:
        _, status = os.waitpid(pid, 0)  # retried after a handler ran (PEP 475)
    except ChildProcessError:
        status = 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if stacks is not None:
            dump_stacks_on_signals(stacks)
    return os.waitstatus_to_exitcode(status), (received[0] if received else 0)


def raise_again(signum: int) -> None:
    """Deliver ``signum`` to this process again, now that its child has ended (its own handler
    runs: a stack dump, coverage saving, the default end)."""
    if signum:
        os.kill(os.getpid(), signum)


def read_info(fd: int) -> dict[str, Any]:
    """What the child told (:func:`tell_parent`); {} where it ended before it had told all."""
    with os.fdopen(fd, "rb") as pipe, suppress(OSError, ValueError):
        return json.loads(pipe.read() or b"{}")
    return {}


def mirror(code: int) -> None:
    """End this process as its child ended (``code`` as :func:`wait_forwarding` gives it): msrun then
    sees the rank end as the test's process did."""
    processes.flush_std_streams()
    if code < 0:
        signum = -code
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # neither can be handled nor blocked
            with suppress(OSError, ValueError):
                signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        with suppress(OSError):
            os.kill(os.getpid(), signum)
        _exit(128 + signum)
    _exit(code)


def take_group(state: Any) -> None:
    """The child's collective counter becomes the template's (the next child goes on from it)."""
    group = cluster_group()
    if group is not None and isinstance(state, int):
        group.seq = state


def retire_reason(info: dict[str, Any], leftover: list[int]) -> str:
    """Why the world cannot serve another test after this child ("" when it can)."""
    if info.get("group") == "left":
        return "the test left the control plane's group (or left messages in it)"
    if leftover:
        return "the test left a process running on a rank"
    runtimes = info.get("runtimes") or []
    if runtimes:
        return f"the test initialised {' and '.join(runtimes)}, which joins a job once per process"
    return ""


def runtimes_started() -> list[str]:
    """The distributed runtimes this process initialised that join a job once per process (a
    registration with their own scheduler), so that a world cannot fork another test after one.
    (torch.distributed is not one: each forked child makes its own group at the job's address.)"""
    out = []
    helper = sys.modules.get("mindspore.communication._comm_helper")
    if helper is not None and getattr(getattr(helper, "GlobalComm", None), "INITED", False):
        out.append("MindSpore's communication")
    return out


def new_runtimes() -> list[str]:
    """The distributed runtimes the child's test initialised."""
    return [name for name in runtimes_started() if name not in _runtimes_at_fork]


_runtimes_at_fork: list[str] = []  # what the template had when this child was forked from it
_joined_at_fork = False
