"""Facts about this host's processes, from ``/proc`` (no psutil on the launch path)."""

from __future__ import annotations

import os


def state(pid: int) -> str:
    """Process ``pid``'s state letter on this host (``R``, ``S``, ``T`` stopped, ``Z``...; "" if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0].decode("ascii", "replace")
    except (OSError, IndexError):
        return ""


def running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie."""
    return state(pid) not in ("", "Z")


def stopped(pid: int, *, or_its_child: bool = False) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP, a tracer): it runs nothing, answers
    nothing. ``or_its_child``: or a child of its main thread is (a forking world's rank runs each
    test in a child it forked)."""
    if state(pid) in ("T", "t"):
        return True
    if not or_its_child:
        return False
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as fh:
            children = [int(c) for c in fh.read().split()]
    except (OSError, ValueError):
        return False
    return any(state(child) in ("T", "t") for child in children)


STOPPED_WORDS = "stopped (SIGSTOP, SIGTSTP or a tracer): it could run nothing, not even its own timer"


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it on this host, from ``/proc/<pid>/task/*/children``."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children", "rb") as fh:
                    todo += [int(child) for child in fh.read().split()]
            except (OSError, ValueError):
                continue
    return out


def holds_socket(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has the socket ``inode`` open."""
    target = f"socket:[{inode}]"
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") == target:
                return True
        except OSError:
            continue
    return False


def wait_readable(fd: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s until ``fd`` (a socket, a pipe, a pidfd) is readable; whether it is.
    ``poll``, not ``select``: a descriptor numbered 1024 or more is as good as any."""
    import select

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    try:
        return bool(poller.poll(max(0, int(timeout * 1000 + 0.999))))
    except InterruptedError:
        return False
