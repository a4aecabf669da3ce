"""A job's msrun process: forked by the session's fork server where it can be, else spawned.

Either way it runs in a session of its own, with stdin from /dev/null and its output in its log
(with ``-s``, the ranks' tailed lines are also shown live), and gets SIGTERM - which msrun answers
by tearing its job down - if the controller dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Union

from pytest_msrun.engine import template
from pytest_msrun.engine.processes import popen_dying_with_parent
from pytest_msrun.fileio import open_output
from pytest_msrun.plugin.controller.forkserver import ForkedProcess, ForkServer

Process = Union[subprocess.Popen, ForkedProcess]  # an msrun: spawned, or forked by the fork server


def start_msrun(
    cmd: list[str], env: dict[str, str], log_path: str, *, relayed: dict[int, int] | None, forks: ForkServer | None
) -> tuple[Process, threading.Thread | None]:
    """Start one msrun (``cmd``) with ``env``, its output in ``log_path``: its process, and - given
    ``relayed`` (``-s``) - the thread pumping its output live, counting there each rank's bytes of
    log shown. Why its ranks are not forked is noted once."""
    live_output = relayed is not None
    if forks is not None and forks.origin:  # the ranks' environment: this one, with what msrun gives every child
        differ = template.differences({**env, "PYTHONUNBUFFERED": "1"}, forks.origin)
        if differ:
            forks.refuse(f"ranks start as new processes where {', '.join(differ)} differ from this session's")
    log_fh = open_output(log_path, binary=True)  # handed to the child (and the pump), closed below
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC) if live_output else (-1, -1)
    pump = None
    try:
        out = write_fd if live_output else log_fh.fileno()
        proc: Process | None = forks.start_msrun(cmd, env, out, log_fh.fileno()) if forks is not None else None
        if proc is None:
            proc = popen_dying_with_parent(cmd, signal.SIGTERM, env=env, stdout=out, stderr=log_fh)
        if live_output:
            reader, read_fd = os.fdopen(read_fd, "rb"), -1
            pump = threading.Thread(target=_pump_rank_lines, args=(reader, log_fh, relayed), daemon=True)
            pump.start()
        return proc, pump
    finally:
        if pump is None:
            log_fh.close()
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)


def _pump_rank_lines(stream: IO[bytes], log_fh: IO[bytes], relayed: dict[int, int]) -> None:
    """With ``-s``: show the ranks' tailed lines live (counting in ``relayed`` each rank's bytes of
    log shown: msrun tails a log from its start, a line at a time), keep msrun's output in its log."""
    try:
        for line in iter(stream.readline, b""):
            log_fh.write(line)
            if line.startswith((b"[rank ", b"[local ")):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()
                rank, sep, rest = line[6:].partition(b"] ")
                if line.startswith(b"[rank ") and sep and rank.isdigit():
                    relayed[int(rank)] = relayed.get(int(rank), 0) + len(rest)
    finally:
        log_fh.close()
