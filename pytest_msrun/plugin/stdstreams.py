"""A rank's standard streams, kept whole across what its tests do to them.

A rank captures through its log (its stdout and stderr are the log file): a test writes there
directly. pytest's own capture would have protected the process - it swaps ``sys.stdout`` and
descriptors 1 and 2 during each test and puts them back after - so a test that closes
``sys.stdout``, replaces it, or closes or redirects descriptor 1 or 2 harms no later test and no
report. :class:`StandardStreams` gives a rank the same protection:

* during a phase, ``sys.stdout`` and ``sys.stderr`` are the session's own writers over copies of
  descriptors 1 and 2 (made again if a test closed them); pytest's terminal keeps the original
  objects, which no test sees;
* when the phase ends, what the test put in their place is dropped (its own objects stay its own)
  and descriptors 1 and 2 are put back where they pointed if a test closed or redirected them.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import sys
from typing import IO, Any

STREAMS = ("stdout", "stderr")

MAX_SECTION = 1 << 20


def log_file() -> str | None:
    """The rank's log (its stdout), when stdout is a regular file."""
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.fstat(1).st_mode):
            return os.readlink("/proc/self/fd/1")
    return None


def log_offset() -> int | None:
    try:
        return os.lseek(1, 0, os.SEEK_CUR)
    except OSError:
        return None


_open = open  # bound now: a test may patch builtins.open (mock_open) while its rank reads its log


def read_log(path: str, start: int, end: int | None = None) -> str:
    """``path`` from byte ``start`` to ``end`` (at most 1 MiB, the end kept), decoded leniently."""
    try:
        with _open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            stop = size if end is None else min(end, size)
            begin = max(start, stop - MAX_SECTION)
            fh.seek(begin)
            data = fh.read(max(0, stop - begin))
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return (f"[... {begin - start} bytes cut ...]\n" + text) if begin > start else text


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class StandardStreams:
    """Descriptors 1 and 2 and ``sys.stdout``/``sys.stderr`` as the rank had them, restored after
    each phase of a test."""

    def __init__(self) -> None:
        self.identity: dict[int, tuple[int, int] | None] = {fd: _identity(fd) for fd in (1, 2)}
        # fd -> a private copy of it (close-on-exec by default)
        self.saved: dict[int, int] = {fd: os.dup(fd) for fd, found in self.identity.items() if found is not None}
        self.originals: dict[str, Any] = {name: getattr(sys, name) for name in STREAMS}
        self.writers: dict[str, IO[str] | None] = dict.fromkeys(STREAMS)
        self.stdin: Any = sys.stdin  # the rank's own, between phases
        for fd, name in ((1, "stdout"), (2, "stderr")):  # made now: not a test's leak
            self._writer(name, fd)

    def fds(self) -> set[int]:
        """The descriptors this holds (a warm world's leak check does not count them)."""
        out = set(self.saved.values())
        for writer in self.writers.values():
            with contextlib.suppress(OSError, ValueError):
                if writer is not None and not writer.closed:
                    out.add(writer.fileno())
        return out

    def _writer(self, name: str, fd: int) -> IO[str] | None:
        """The session's writer for ``name`` over a copy of ``fd`` (a new one if a test closed it)."""
        writer = self.writers[name]
        if writer is not None and not writer.closed:
            return writer
        original = self.originals[name]
        try:
            raw = io.FileIO(os.dup(fd), "w", closefd=True)
        except OSError:
            return None
        writer = io.TextIOWrapper(
            raw,  # unbuffered below the text layer: nothing is lost on a crash
            encoding=getattr(original, "encoding", None) or "utf-8",
            # under pytest's capture printing what the encoding cannot hold (a lone surrogate)
            # passes, so it must in a rank: not a log file's strict, nor surrogateescape (which
            # raises outside U+DC80-U+DCFF and writes bytes that are not UTF-8), but its escape
            errors="backslashreplace",
            line_buffering=True,
            write_through=True,
        )
        self.writers[name] = writer
        return writer

    def enter(self) -> None:
        """A phase begins: the streams are the session's writers, ``sys.stdin`` pytest's stand-in
        that raises when read (as under its own capture: a rank has no input to give)."""
        for fd, name in ((1, "stdout"), (2, "stderr")):
            writer = self._writer(name, fd)
            if writer is not None:
                setattr(sys, name, writer)
        from _pytest.capture import DontReadFromInput

        self.stdin = sys.stdin
        sys.stdin = DontReadFromInput()

    def leave(self) -> None:
        """A phase ended: flush its writers, put back what a test changed."""
        for fd, name in ((1, "stdout"), (2, "stderr")):
            writer = self.writers[name]
            if writer is not None:
                with contextlib.suppress(OSError, ValueError):  # closed by the test
                    writer.flush()
            setattr(sys, name, self.originals[name])
            if fd in self.saved and _identity(fd) != self.identity[fd]:  # closed or redirected by the test
                with contextlib.suppress(OSError):
                    os.dup2(self.saved[fd], fd, inheritable=True)
        sys.stdin = self.stdin

    def close(self) -> None:
        for writer in self.writers.values():
            if writer is not None:
                with contextlib.suppress(OSError, ValueError):
                    writer.close()
        for copy in self.saved.values():
            with contextlib.suppress(OSError):
                os.close(copy)
        self.saved.clear()


def tag_lines(text: str, rank: int) -> str:
    """Each line of a rank's output with its rank in front (``[rank 1] ...``), as ``mpirun
    --tag-output`` does: report files (JUnit's ``system-out``) join the ranks' outputs into one."""
    tag = f"[rank {rank}] "
    return "".join(tag + line for line in text.splitlines(keepends=True))
