"""What a worker may tell msrun about itself: a *settled* exit status, and a *deadline*.

Both are opt-in and neutral - msrun knows nothing of pytest; a suite's ranks use them:

* **A settled exit.** msrun's first-failure rule stops every other worker when one exits
  non-zero. A worker whose non-zero status is an ordinary result (a pytest session that ran its
  tests and some failed) says so just before it exits (:func:`settle`): when it then exits with
  exactly that status, msrun keeps it as that rank's result - the job's status is non-zero at its
  end - but stops nobody: its peers finish their own work. Any other status is a failure as ever.
* **A deadline.** A worker that is to finish something by a given time says what and by when
  (:func:`set_deadline`; :func:`clear_deadline` when done). Its own timer should act first; if
  the worker cannot - stopped, or holding the interpreter's lock in native code - msrun's watch
  (:class:`DeadlineWatch`) finds it still there :data:`BACKSTOP` seconds after the deadline, asks
  it for its stacks (the signal it named) and ends the job with :data:`TIMEOUT_EXIT`, naming that
  rank as the root cause at its deadline's time. Time is kept outside the rank.

Files: ``<log_dir>/msrun_ranks/rank<N>.settled`` and ``rank<N>.deadline`` (JSON), written whole
(``os.replace``). One ``stat`` of that directory per look tells msrun whether anything changed.
Standard library only, but for the package's own records.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping

from pytest_msrun.engine import suppress
from pytest_msrun.record import record

NOTES_DIR = "msrun_ranks"
TIMEOUT_EXIT = 124  # timeout(1)'s status: a rank that ran out of time
BACKSTOP = 1.0  # s after a deadline that msrun acts for a rank that has not ended itself
LOOK_EVERY = 0.25  # s between msrun's looks while deadlines are set
STACK_WAIT = 0.5  # s msrun gives a late rank to dump its stacks


def notes_dir(log_dir: str) -> str:
    return os.path.join(os.path.abspath(log_dir or "."), NOTES_DIR)


def _path(log_dir: str, rank: int, kind: str) -> str:
    return os.path.join(notes_dir(log_dir), f"rank{rank}.{kind}")


def _write(path: str, data: dict[str, object]) -> None:
    import json  # not on msrun's start path

    from pytest_msrun.fileio import private_dir, write_whole

    with suppress(OSError):
        private_dir(os.path.dirname(path))
        write_whole(path, json.dumps(data))


def _read(path: str) -> dict[str, object] | None:
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _where(env: Mapping[str, str]) -> tuple[str, int] | None:
    log_dir, rank = env.get("MSRUN_LOG_DIR"), env.get("RANK_ID", "")
    if not log_dir or not rank.isdigit():
        return None
    return log_dir, int(rank)


# ---------------------------------------------------------------- the worker's side
def settle(code: int | None, why: str, env: Mapping[str, str] = os.environ) -> None:
    """This process is about to exit with ``code`` as its ordinary result (None: whatever status it
    ends with - its work is done, what follows is its own end): stop no peer for it."""
    where = _where(env)
    if where is not None:
        _write(_path(*where, "settled"), {"code": None if code is None else int(code), "why": why, "pid": os.getpid()})


def set_deadline(seconds: float, what: str, stack_signal: int = 0, env: Mapping[str, str] = os.environ) -> None:
    """This process is to finish ``what`` within ``seconds`` from now; ``stack_signal``: the
    signal that makes it dump its stacks (0: none)."""
    where = _where(env)
    if where is not None:
        due = time.time() + seconds
        data = {"due": due, "seconds": seconds, "what": what, "signal": stack_signal, "pid": os.getpid()}
        _write(_path(*where, "deadline"), data)


def clear_deadline(env: Mapping[str, str] = os.environ) -> None:
    where = _where(env)
    if where is not None:
        with suppress(OSError):
            os.unlink(_path(*where, "deadline"))


# ---------------------------------------------------------------- msrun's side
def settled_status(log_dir: str, rank: int, pid: int, code: int) -> str | None:
    """Why ``rank`` (process ``pid``) exiting with ``code`` is its settled result, or None."""
    note = _read(_path(log_dir, rank, "settled"))
    if note is None or note.get("code") not in (None, code) or note.get("pid") != pid:
        return None
    return str(note.get("why") or "its own result")


@record(eq=False)
class Late:
    """A rank found past its deadline."""

    rank: int
    pid: int
    due: float
    seconds: float
    what: str
    stack_signal: int
    stopped: bool = False  # msrun found the process stopped (SIGSTOP, SIGTSTP, a tracer)

    def describe(self) -> str:
        why = "it was stopped (SIGSTOP, SIGTSTP or a tracer)" if self.stopped else "and could not end itself"
        return f"ran out of time ({self.seconds:g} s) in {self.what}{':' if self.stopped else ','} {why}"

    def to_json(self) -> dict[str, object]:
        return {"due": self.due, "seconds": self.seconds, "what": self.what, "stopped": self.stopped}


class DeadlineWatch:
    """The deadlines this node's workers set, looked at every :data:`LOOK_EVERY` s at most."""

    def __init__(self, log_dir: str, pids: Mapping[int, int]) -> None:
        self.directory = notes_dir(log_dir)
        self.log_dir = log_dir
        self.pids = dict(pids)  # rank -> pid of this node's workers
        self.mtime = 0.0
        self.deadlines: dict[int, dict[str, object]] = {}
        self.next_look = 0.0

    def wait(self) -> float | None:
        """How long msrun may sleep before the next look (None: no deadline set, no hurry)."""
        return LOOK_EVERY if self.deadlines or os.path.isdir(self.directory) else None

    def late(self, alive: Iterable[int], now: float | None = None) -> Late | None:
        """The first of the ``alive`` ranks past its deadline by :data:`BACKSTOP` s (or None)."""
        now = time.time() if now is None else now
        if now < self.next_look:
            return None
        self.next_look = now + LOOK_EVERY
        try:
            mtime = os.stat(self.directory).st_mtime
        except OSError:
            return None
        if mtime != self.mtime:
            self.mtime = mtime
            self.deadlines = {}
            for rank in self.pids:
                note = _read(_path(self.log_dir, rank, "deadline"))
                if note is not None and note.get("pid") == self.pids[rank] and isinstance(note.get("due"), float):
                    self.deadlines[rank] = note
        alive = set(alive)
        overdue = [
            (float(note["due"]), rank)  # type: ignore[arg-type]
            for rank, note in self.deadlines.items()
            if rank in alive and now > float(note["due"]) + BACKSTOP  # type: ignore[arg-type]
        ]
        if not overdue:
            return None
        due, rank = min(overdue)
        note = self.deadlines.pop(rank)
        seconds, signal, what = note.get("seconds"), note.get("signal"), str(note.get("what") or "its work")
        seconds = float(seconds) if isinstance(seconds, (int, float)) else 0.0
        return Late(rank, self.pids[rank], due, seconds, what, signal if isinstance(signal, int) else 0)
