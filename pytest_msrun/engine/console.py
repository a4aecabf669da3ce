"""What msrun prints: stdout lines (``Start ... process``: :mod:`.observers`) and logger lines (stderr).

Logger lines keep MindSpore's shape ``[LEVEL] ME(pid:tid,MainProcess):time [msrun] message`` and
its verbosity switch ``GLOG_v`` (0 debug, 1 info, 2 warning - the default, 3 error).
"""

from __future__ import annotations

import _thread  # not threading: its import is a cost on every msrun start
import os
import sys
import time
from collections.abc import Callable

from pytest_msrun.engine import suppress

LEVELS = {"DEBUG": 0, "INFO": 1, "WARNING": 2, "ERROR": 3}
_lock = _thread.allocate_lock()
# A live status line on stderr (pytest_msrun.engine.progress): what clears it before another line.
_status_clearer: list[Callable[[], str]] = []


def _clear_status() -> None:
    """Called with the lock held, before any other line is written."""
    if _status_clearer:
        text = _status_clearer[0]()
        if text:
            sys.stderr.write(text)


def clear_status() -> None:
    """Take the live status line away (before output written elsewhere: tailed logs)."""
    if _status_clearer:
        with _lock, suppress(OSError, ValueError):
            _clear_status()
            sys.stderr.flush()


def status(text: str, clearer: Callable[[], str] | None) -> None:
    """Write the live status line ``text`` (no newline); ``clearer`` says how to take it away."""
    with _lock:
        _status_clearer[:] = [clearer] if clearer is not None else []
        with suppress(OSError, ValueError):
            sys.stderr.write(text)
            sys.stderr.flush()


def threshold() -> int:
    try:
        return int(os.environ.get("GLOG_v", "2"))  # noqa: SIM112 - MindSpore's own spelling
    except ValueError:
        return 2


def log(level: str, message: str) -> None:
    if LEVELS[level] < threshold():
        return
    now = time.time()
    micros = int(now * 1_000_000) % 1_000_000
    stamp = time.strftime("%Y-%m-%d-%H:%M:%S.", time.localtime(now)) + f"{micros // 1000:03d}.{micros % 1000:03d}"
    _write(f"[{level}] ME({os.getpid()}:{_thread.get_ident() % 1000000},MainProcess):{stamp} [msrun] {message}\n")


def _write(text: str, stdout: bool = False) -> None:
    """``text`` on stderr (or stdout), flushed, once the live status line is cleared."""
    with _lock, suppress(OSError, ValueError):
        _clear_status()
        stream = sys.stdout if stdout else sys.stderr
        stream.write(text)
        stream.flush()


def info(message: str) -> None:
    log("INFO", message)


def warning(message: str) -> None:
    log("WARNING", message)


def error(message: str) -> None:
    log("ERROR", message)


def out(line: str) -> None:
    """A stdout line, flushed (msrun's ``print``)."""
    _write(line + "\n", stdout=True)


def err_block(text: str) -> None:
    _write(text if text.endswith("\n") else text + "\n")
