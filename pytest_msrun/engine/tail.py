"""In-process tailing of worker logs to the console, each line prefixed ``[rank N]``.

One thread polls every tailed file from offset 0 (:meth:`LogTailer.start`; or the owner's loop
calls :meth:`LogTailer.pump` - a dry run's, which forks ranks all along and so runs no second
thread), so no line is skipped at the start, and :meth:`LogTailer.stop` drains every file to the
end, so no line is lost at the end.
"""

from __future__ import annotations

import _thread  # not threading: its import is a cost on every msrun start
import sys

from pytest_msrun.engine import console, suppress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, BinaryIO


class _Tailed:
    def __init__(self, prefix: str, path: str) -> None:
        self.prefix = prefix.encode()
        self.path = path
        self.fh: BinaryIO | None = None
        self.partial = b""

    def read_lines(self, final: bool) -> list[bytes]:
        if self.fh is None:
            try:
                self.fh = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
            except OSError:
                return []
        data = self.fh.read()
        if not data and not (final and self.partial):
            return []
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return [self.prefix + line + b"\n" for line in lines]

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


class LogTailer:
    """Copies new lines of several files to stdout, every 50 ms, until stopped."""

    INTERVAL = 0.05  # s between two polls

    def __init__(self, files: list[tuple[str, str]]) -> None:
        self.files = [_Tailed(prefix, path) for prefix, path in files]
        self.out = sys.stdout.buffer
        self.stopping = _thread.allocate_lock()  # held until stop(): the thread waits on it
        self.stopping.acquire()
        self.ended: Any = None  # held by the thread while it runs (None: never started)
        self.lock = _thread.allocate_lock()

    def _emit(self, chunks: list[bytes]) -> None:
        if chunks:
            with suppress(OSError, ValueError):
                console.clear_status()
                sys.stdout.flush()
                self.out.write(b"".join(chunks))
                self.out.flush()

    def _pump(self, final: bool) -> None:
        with self.lock:
            self._emit([line for tailed in self.files for line in tailed.read_lines(final)])

    def add(self, prefix: str, path: str) -> None:
        """Tail another file too (one process of a job that starts processes over time)."""
        with self.lock:
            self.files.append(_Tailed(prefix, path))

    def pump(self) -> None:
        """Copy the new lines now (where no thread of :meth:`start` polls)."""
        self._pump(final=False)

    def finish(self, path: str) -> None:
        """Copy the rest of ``path`` now and stop tailing it (its process exited)."""
        with self.lock:
            for tailed in [t for t in self.files if t.path == path]:
                self._emit(tailed.read_lines(final=True))
                tailed.close()
                self.files.remove(tailed)

    def _run(self) -> None:
        try:
            while not self.stopping.acquire(timeout=self.INTERVAL):
                self._pump(final=False)
        finally:
            self.ended.release()

    def start(self) -> None:
        if self.ended is None:
            self.ended = _thread.allocate_lock()
            self.ended.acquire()
            _thread.start_new_thread(self._run, ())

    def stop(self) -> None:
        """Stop polling and copy everything that is left, including a last unterminated line."""
        if self.stopping.locked():
            self.stopping.release()
        if self.ended is not None:
            self.ended.acquire()  # the thread has ended
            self.ended.release()
        self._pump(final=True)
        for tailed in self.files:
            tailed.close()


def prefix_for(rank: int | None, local_index: int) -> str:
    return f"[rank {rank}] " if rank is not None else f"[local {local_index}] "
