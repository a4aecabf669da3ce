"""Facts about this host's processes, from ``/proc`` (no psutil on the launch path)."""

from __future__ import annotations


def running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
