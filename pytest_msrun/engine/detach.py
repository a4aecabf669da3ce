"""``--join=False``: return at once, leaving a detached supervisor that applies the same rules.

The supervisor is a forked copy of msrun in its own session. It prints the ``Start ...`` lines
to the caller's console, tells the caller it is done with the console (the caller then exits
with status 0, or with the launch error's status), redirects its own output to
``<log_dir>/msrun_supervisor.log`` and supervises the job to the end, writing the final state
to ``<log_dir>/msrun_status.json``.
"""

from __future__ import annotations

import os

from pytest_msrun.engine import heldsignals, processes, suppress
from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.containment import JobGuard
from pytest_msrun.engine.plan import NodeFacts
from pytest_msrun.fileio import open_output_fd

SUPERVISOR_LOG = "msrun_supervisor.log"


def launch_detached(cfg: LaunchConfig, facts: NodeFacts, guard: JobGuard) -> int:
    processes.flush_std_streams()
    guard.ready()  # inside the job's cgroup before forking: the supervisor and its job start there
    read_fd, write_fd = os.pipe()
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:  # the supervisor
        guard.spare.add(launcher)  # it leaves the job's cgroup, but may not have yet
        os.close(read_fd)
        code = 1
        try:
            os.setsid()
            code = _supervise(cfg, facts, write_fd, guard)
        finally:
            os._exit(code)
    guard.hand_off()
    heldsignals.let_in()  # the supervisor answers signals to the job; this process just waits
    os.close(write_fd)
    with open(read_fd, "rb") as fh:
        data = fh.readline()  # the status line, or nothing: the supervisor died before it said one
    try:
        return int(data.strip() or b"1")
    except ValueError:
        return 1


def _supervise(cfg: LaunchConfig, facts: NodeFacts, write_fd: int, guard: JobGuard) -> int:
    from pytest_msrun.engine.agent import Agent

    def console_done(code: int) -> None:
        processes.flush_std_streams()
        with suppress(OSError):
            os.write(write_fd, f"{code}\n".encode())
            os.close(write_fd)
        # A job that did not start (a launch error: nothing to supervise) leaves no log behind.
        log_path = os.path.join(cfg.log_dir or ".", SUPERVISOR_LOG) if code == 0 else os.devnull
        try:
            fd = open_output_fd(log_path, append=True, mode=0o644)
        except OSError:  # (a link or a FIFO put there too: nothing is written through it)
            fd = os.open(os.devnull, os.O_WRONLY)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)

    return Agent(cfg, facts, detached=True, on_console_done=console_done, guard=guard).run().exit_code
