"""Python workers started while msrun still enters the job's cgroup, held until they are inside.

msrun's first move into the job's cgroup waits for an RCU grace period (~10 ms), and nothing the
job runs may start outside that cgroup. A Python worker spends its first ~10-40 ms in the
interpreter's start-up before it runs a line of its own, so msrun starts such workers during the
wait, held at the first line of msrun's rank hook (``rankhook/sitecustomize.py``, which ``site``
imports before the task's code): the hook reads one byte from a pipe whose read end the worker
inherits (:data:`HOLD_ENV` names it). Once msrun is inside, it moves each held worker in (a move
right after its own costs no second grace period), then writes the bytes that let them go. So a
worker never runs its task's code, nor starts a process, outside the job's cgroup; what runs
before the hook is the interpreter's start-up and ``site``'s ``.pth`` files. If msrun dies
meanwhile the pipe's write end closes: the hook reads end-of-file and the worker exits (the
watchdog also kills its session).

Only for a worker that certainly runs the hook first: its program is a CPython interpreter binary
(an ELF file named ``python3``/``python3.N``, or a script whose ``#!`` line names one, through
``env`` or not - never a wrapper that could start processes first), without ``-S``, ``-I`` or
``-E``, with error files on (the hook on ``PYTHONPATH``) and no binding command in front.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pytest_msrun.pathsearch import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pytest_msrun.engine.processes import Child

HOLD_ENV = "MSRUN_HOLD_FD"


def _python_binary(path: str) -> bool:
    name = os.path.basename(os.path.realpath(path))
    if not (name == "python3" or (name.startswith("python3.") and name[8:].isdigit())):
        return False
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


def runs_hook_first(options: list[str]) -> bool:
    """Whether an interpreter given ``options`` (its arguments up to the program) lets ``site``
    import ``sitecustomize`` from ``PYTHONPATH`` before anything else runs: True at the first
    non-option (a script, ``-``) or ``-c``/``-m``; False for ``-S``, ``-I``, ``-E`` and any option
    not known to leave start-up alone."""
    i = 0
    while i < len(options):
        arg = options[i]
        if arg == "-" or not arg.startswith("-"):
            return True
        if arg == "--check-hash-based-pycs":
            i += 2
            continue
        if arg.startswith("--"):
            return False
        for j, ch in enumerate(arg[1:], start=1):
            if ch in "cm":
                return True
            if ch in "WX":  # its value follows, attached or as the next argument
                if j == len(arg) - 1:
                    i += 1
                break
            if ch not in "bBdiOqsuvxP":
                return False
        i += 1
    return True


def holdable(argv: list[str], env: Mapping[str, str]) -> bool:
    """Whether a worker started as ``argv`` with ``env`` runs msrun's rank hook before any code of
    its own (so it can be started held; see the module's docstring)."""
    if not argv:
        return False
    path = which(argv[0], path=env.get("PATH", os.defpath))
    if path is None:
        return False
    if _python_binary(path):
        return runs_hook_first(argv[1:])
    from pytest_msrun.engine.taskcmd import shebang

    words = shebang(path)
    if len(words) >= 2 and os.path.basename(words[0]) == "env" and os.sep in words[0]:
        interpreter = which(words[1], path=env.get("PATH", os.defpath)) if not words[1].startswith("-") else None
        words = words[1:]
    else:
        interpreter = words[0] if words else None
    return interpreter is not None and _python_binary(interpreter) and runs_hook_first([*words[1:], argv[0]])


class FirstStarted:
    """The workers msrun started before its control plane, and - ``held``: started before msrun
    was in the job's cgroup - the pipe that holds them."""

    def __init__(self, held: bool) -> None:
        self.held = held
        self.children: list[Child] = []
        self.moved = False
        # close-on-exec: a child gets the read end only when it is passed to it
        self.read_fd, self.write_fd = os.pipe() if held else (-1, -1)

    def spawned(self) -> None:
        """Every worker to start first has started: msrun no longer needs the read end."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def move_in(self, procs_file: str) -> list[tuple[Child, str]]:
        """Move every held worker into the cgroup whose ``cgroup.procs`` is ``procs_file``.
        Returns those that could not be moved, with why: the caller stops them before
        :meth:`let_go` (they are still outside, and have started nothing)."""
        failed: list[tuple[Child, str]] = []
        self.moved = True
        for child in self.children:
            try:
                with open(procs_file, "w", encoding="ascii") as fh:
                    fh.write(str(child.pid))
            except ProcessLookupError:
                pass  # it has already ended (its end is an event like any other)
            except OSError as exc:
                failed.append((child, exc.strerror or str(exc)))
        return failed

    def let_go(self) -> None:
        """Every held worker runs on (one byte each), and msrun lets go of the pipe."""
        try:
            if self.held and self.children:
                os.write(self.write_fd, b"\0" * len(self.children))
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the pipe: a worker still held then reads end-of-file and exits."""
        self.spawned()
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
