"""``MSRUN_TIMELINE=1``: where a launch spends its time, printed on stderr when msrun exits.

Each mark is the time since the msrun process started (from ``/proc/self/stat``), so the
interpreter's own start-up shows too. Off by default; a mark then costs one attribute test.
"""

from __future__ import annotations

import os
import sys
import time

from pytest_msrun.engine import suppress

ENABLED = os.environ.get("MSRUN_TIMELINE", "") not in ("", "0")
_marks: list[tuple[float, str]] = []


def _process_start() -> float:
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def mark(what: str) -> None:
    if ENABLED:
        _marks.append((time.time(), what))


def report() -> None:
    """Print the marks (once) and forget them."""
    if not ENABLED or not _marks:
        return
    first = _marks[0][0]
    lines = [
        f"msrun timeline (ms after the interpreter ran msrun's first line, ~{(first - _process_start()) * 1000:.0f} ms "
        "after the process started, at 10 ms resolution):"
    ]
    lines += [f"  {(t - first) * 1000:8.1f}  {what}" for t, what in _marks]
    _marks.clear()
    with suppress(OSError, ValueError):
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
