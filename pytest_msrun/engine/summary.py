"""Root-cause reporting: which process failed first, how, and what its log says."""

from __future__ import annotations

import os
import time

from pytest_msrun.engine.errorfile import RankError
from pytest_msrun.engine.processes import describe_returncode
from pytest_msrun.record import record

TAIL_LINES = 20


@record
class Failure:
    """One failed process (local or reported by another node)."""

    label: str  # "rank 3", "scheduler"
    description: str  # "exited with code 3", "killed by SIGSEGV (exit status 139)"
    exit_status: int
    at: float
    log_path: str = ""
    pid: int | None = None
    host: str = ""
    error: RankError | None = None  # its uncaught exception, from its error file

    def headline(self) -> str:
        where = f", pid {self.pid}" if self.pid else ""
        where += f", host {self.host}" if self.host else ""
        stamp = time.strftime("%H:%M:%S", time.localtime(self.at)) + f".{int(self.at * 1000) % 1000:03d}"
        return f"{self.label} ({os.path.basename(self.log_path) or 'no log'}{where}) {self.description} at {stamp}"


def failure_of(label: str, returncode: int, at: float, log_path: str, pid: int, host: str = "") -> Failure:
    status = 128 - returncode if returncode < 0 else returncode
    return Failure(label, describe_returncode(returncode), status, at, log_path, pid, host)


def log_text(path: str, max_bytes: int = 64 * 1024) -> str:
    """The last ``max_bytes`` of a log, decoded leniently ("" if unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def extract_traceback(text: str) -> str:
    """The last Python traceback (or fatal-error dump) in ``text``, or ``""``."""
    lines, fatal = text.splitlines(), "Fatal Python error:"
    starts = [
        i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):") or fatal in line
    ]
    if not starts:
        return ""
    start = starts[-1]
    if fatal in lines[start]:  # faulthandler's dump, maybe after unterminated output
        return "\n".join([lines[start][lines[start].index(fatal) :], *lines[start + 1 : start + 40]])
    out = [lines[start]]
    for line in lines[start + 1 :]:
        out.append(line)
        if line and not line[0].isspace():
            break
    return "\n".join(out)


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + line for line in text.splitlines())


def full_disk_note(directory: str) -> str:
    """A line naming the full file system under ``directory`` ("" when it has room): a process
    that cannot write its log fails (``OSError: No space left on device``) without saying so."""
    from pytest_msrun import fsinfo

    if not fsinfo.is_full(directory):
        return ""
    mount = fsinfo.mount_of(directory)
    where = f"{mount.point} ({mount.fstype})" if mount else "its file system"
    free = fsinfo.free_bytes(directory)
    return (
        f"disk full: the log directory {directory} is on {where}, with {free if free is not None else '?'} bytes "
        "free - writes there fail with 'No space left on device'; free space there, or give --log_dir on "
        "another file system"
    )


def render(failures: list[Failure], terminated: list[str], log_dir: str) -> str:
    """The summary printed on stderr when a job fails (``failures``: the root cause first)."""
    if not failures:
        return ""
    root = failures[0]
    parts = ["msrun: the job failed. Root cause (first observed failure):", f"  {root.headline()}"]
    if root.error is not None:  # it raised: its own record, no log scraping
        if root.log_path:
            parts.append(f"  log: {os.path.abspath(root.log_path)}")
        parts += [f"  error: {root.error.headline}", "  traceback (from its error file):"]
        parts.append(_indent(root.error.traceback.rstrip("\n")))
    elif root.log_path:  # it died without a record (a signal, os._exit, sys.exit): what its log says
        parts.append(f"  log: {os.path.abspath(root.log_path)}")
        text = log_text(root.log_path)
        tb = extract_traceback(text)
        if tb:
            parts += ["  traceback:", _indent(tb)]
        tail = "\n".join(text.splitlines()[-TAIL_LINES:])
        if not tail.strip():
            parts.append("  (its log is empty)")
        elif tail.strip() != tb.strip():  # a log that is just the traceback is shown once
            parts += [f"  last {min(TAIL_LINES, len(tail.splitlines()))} lines of its log:", _indent(tail)]
    if root.log_path:
        disk = full_disk_note(os.path.dirname(os.path.abspath(root.log_path)))
        if disk:
            parts.append(f"  {disk}")
    for other in failures[1:]:
        parts.append(f"  also failed: {other.headline()}")
    if terminated:
        parts.append(f"  terminated by msrun: {', '.join(terminated)}")
    parts.append(f"  logs: {os.path.abspath(log_dir or '.')}")
    return "\n".join(parts) + "\n"
