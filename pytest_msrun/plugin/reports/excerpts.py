"""What a failure report shows of a rank's log and stacks: the frames and lines that matter.

A log's excerpt leaves out the rank's pytest session header (platform, rootdir, plugins: the
controller's own, repeated per rank). A stack's excerpt keeps the test's code and the msrun call
it waits in, hides pytest's, pluggy's and runpy's frames and msrun's own below its API (saying how
many), and names the file that keeps every frame; a rank idle in a warm world's serve loop is
described in words. No pytest import.
"""

from __future__ import annotations

import re

from pytest_msrun.engine.summary import extract_traceback, log_text
from pytest_msrun.plugin.reports.hang import Frame, idle, is_harness, is_msrun, is_stdlib, main_stack, threads

TAIL_LINES = 15
TRACEBACK_LINES = 24
_HEADER_START = re.compile(r"^=+ test session starts =+$")
_HEADER_END = re.compile(r"^collected \d+ items?\b")


def without_session_header(text: str) -> str:
    """``text`` less every pytest session header in it (from its ``test session starts`` line
    through its ``collected N items`` line, or to the end when collection never ended)."""
    out: list[str] = []
    inside = False
    for line in text.split("\n"):
        if _HEADER_START.match(line):
            inside = True
        elif inside and _HEADER_END.match(line):
            inside = False
        elif not inside:
            out.append(line)
    while out and not out[0].strip():
        out.pop(0)
    return "\n".join(out)


def log_excerpt(path: str) -> str:
    """A rank's fatal-error dump or last traceback, then the end of its log (without its header)."""
    text = without_session_header(log_text(path))
    parts = []
    tb = extract_traceback(text)
    if tb:
        lines = tb.splitlines()
        parts.append("\n".join(lines[:TRACEBACK_LINES] + (["  ..."] if len(lines) > TRACEBACK_LINES else [])))
    tail = "\n".join(text.splitlines()[-TAIL_LINES:])
    if not tail.strip():
        parts.append(f"{path} has nothing after pytest's session header")
    elif not tb or tail.strip() not in tb:
        parts.append(f"last lines of {path} (its session header left out):\n{tail}")
    return "\n".join(parts)


def trim(frames: list[Frame]) -> tuple[list[tuple[Frame, int]], int]:
    """The frames that matter (innermost first), each with the number of msrun frames hidden
    inside it, and the number of pytest frames hidden. Kept: from the innermost frame to the
    outermost frame of the test's code, less pytest's frames, msrun's frames collapsed into the
    outermost one the code called. Without the test's code: the frames above pytest's."""
    code = [i for i, f in enumerate(frames) if not (is_harness(f[0]) or is_msrun(f[0]) or is_stdlib(f[0]))]
    if code:
        last = code[-1]
    else:
        last = next((i for i, f in enumerate(frames) if is_harness(f[0])), len(frames)) - 1
    kept: list[tuple[Frame, int]] = []
    inner = 0  # msrun frames since the last kept frame
    hidden = len(frames) - (last + 1)
    for i, frame in enumerate(frames[: last + 1]):
        if is_harness(frame[0]):
            hidden += 1
        elif code and is_msrun(frame[0]) and i + 1 <= last and is_msrun(frames[i + 1][0]):
            inner += 1
        else:
            kept.append((frame, inner))
            inner = 0
    return kept, hidden


def _frame_lines(kept: list[tuple[Frame, int]]) -> list[str]:
    out = []
    for (path, line, func), inner in kept:
        note = f" ({inner} msrun frame{'s' if inner != 1 else ''} inside it hidden)" if inner else ""
        out.append(f'  File "{path}", line {line} in {func}{note}')
    return out


def stack_excerpt(dump: str, main_thread: int | None, source: str = "") -> str:
    """The frames that matter of a rank's stack dump (faulthandler's), main thread first."""
    found = threads(dump)
    main = main_stack(found, main_thread)
    if not main:
        return dump.rstrip("\n")
    where = f"; every frame of every thread: {source}" if source else ""
    kept, hidden = trim(main)
    words = idle(main) if not any(not is_msrun(f[0]) for f, _ in kept) else None
    if words:
        lines = [f"{words} (msrun's serve loop; {len(main)} frames hidden{where})"]
    else:
        lines = [f"main thread, most recent call first ({hidden} pytest frames hidden{where}):"]
        lines += _frame_lines(kept)
    quiet = 0
    for frames in found.values():
        if frames is main:
            continue
        others, _ = trim(frames)
        if not any(not (is_msrun(f[0]) or is_stdlib(f[0])) for f, _ in others):
            quiet += 1
            continue
        lines.append("another thread, most recent call first:")
        lines += _frame_lines(others)
    if quiet:
        lines.append(f"({quiet} other thread{'s' if quiet != 1 else ''} with no frame of the test's code hidden)")
    return "\n".join(lines)
