"""A job's timeline in the Chrome Trace Event Format (Perfetto, ``chrome://tracing``).

Every process of a traced job appends its events as JSON lines to a spool file of its own
(:class:`Recorder`); the node that hosts the control plane merges the spool into one trace when
the job has ended (:func:`merge`). With tracing off no recorder exists: nothing is recorded and a
would-be event costs one ``is None`` test.

Lanes are the format's processes: :data:`MSRUN_PID` (one thread per ``msrun`` node),
:data:`CONTROL_PID` (the control plane) and ``RANK_PID + r`` for rank ``r``. Times are
microseconds of the wall clock of the host that runs the control plane: an agent on another host
shifts its events by its clock's offset from the scheduler's, estimated over its handshake and
heartbeats (:class:`ClockOffset`).
"""

from __future__ import annotations

import os

from pytest_msrun.control.wire import dumps as _dumps
from pytest_msrun.fileio import open_output, write_whole

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

SPOOL_ENV = "MSRUN_TRACE_SPOOL"  # the directory a traced job's processes append their events to
RANKS_FILE = "ranks.jsonl"  # in the spool: the line each rank's Python appends when it starts (the rank hook)
MSRUN_PID, CONTROL_PID, RANK_PID = 1, 2, 1000


def us(t: float) -> int:
    """Seconds since the epoch -> the format's microseconds."""
    return int(t * 1_000_000)


def span(name: str, pid: int, tid: int, start: float, end: float, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """A complete event (``ph: X``): ``name`` from ``start`` to ``end`` on lane ``pid``/``tid``."""
    ev: dict[str, Any] = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": us(start)}
    ev["dur"] = max(0, us(end) - ev["ts"])
    if args:
        ev["args"] = args
    return ev


def spans(name: str, starts: dict[int, float], tid: int, end: float, args: dict[str, Any]) -> str:
    """One :func:`span` per lane (``starts``: lane -> its start), all ending at ``end`` with the
    same name and args, as encoded lines: the name and args are encoded once (a collective of
    1024 ranks is 1024 spans)."""
    tail = f',"args":{_dumps(args)}}}' if args else "}"
    head, stop = f'{{"name":{_dumps(name)},"ph":"X","pid":', us(end)
    return "\n".join(
        f'{head}{pid},"tid":{tid},"ts":{us(start)},"dur":{max(0, stop - us(start))}{tail}'
        for pid, start in starts.items()
    )


def instant(
    name: str, pid: int, tid: int, at: float, args: dict[str, Any] | None = None, scope: str = "t"
) -> dict[str, Any]:
    """An instant event; ``scope`` ``g`` draws it across every lane (the first failure)."""
    ev: dict[str, Any] = {"name": name, "ph": "i", "s": scope, "pid": pid, "tid": tid, "ts": us(at)}
    if args:
        ev["args"] = args
    return ev


def lane(pid: int, name: str, sort: int) -> list[dict[str, Any]]:
    """Metadata naming a lane and placing it (msrun, the control plane, then ranks in order)."""
    return [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": sort}},
    ]


def thread(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def shifted(events: list[dict[str, Any]], offset: float) -> list[dict[str, Any]]:
    """``events`` on a clock ``offset`` seconds behind the control plane's (metadata has no time)."""
    delta = us(offset)
    if not delta:
        return events
    return [({**ev, "ts": ev["ts"] + delta} if "ts" in ev else ev) for ev in events]


class ClockOffset:
    """How far this host's clock is behind the control plane's (Cristian's algorithm): each
    exchange sent at ``sent`` and answered at ``received``, carrying the other side's time
    ``theirs``, bounds the offset within half its round trip; the shortest round trip wins."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.rtt = float("inf")

    def sample(self, sent: float, theirs: float, received: float) -> None:
        rtt = received - sent
        if 0 <= rtt < self.rtt:
            self.rtt = rtt
            self.offset = theirs - (sent + received) / 2


def encode(events: list[dict[str, Any]]) -> str:
    """Events as the spool's JSON lines (one per event, no trailing newline)."""
    return "\n".join(map(_dumps, events))


class Recorder:
    """Appends events to one spool file, buffered; :meth:`flush` at turns of the event loop.

    A write that fails (a full disk) never reaches the caller: the recorder stops, keeps the
    error in :attr:`error` for the one who reports it, and drops what comes after - a trace is
    never worth a job."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fh = open_output(path, append=True, buffering=1 << 16)  # lives as long as the process
        self.error: OSError | None = None

    def _write(self, text: str | None) -> None:
        """Write ``text`` (None: flush); the first error stops the recorder."""
        if self.error is None:
            try:
                if text is None:
                    self.fh.flush()
                else:
                    self.fh.write(text)
            except OSError as exc:
                self._close(exc)
            except ValueError:  # closed
                pass

    def _close(self, error: OSError | None) -> None:
        """Close the file (after ``error``, the recorder's first: stopped)."""
        self.error = error
        try:
            self.fh.close()  # what is buffered may fail again: it is dropped with the file object
        except (OSError, ValueError):
            pass

    def add(self, ev: dict[str, Any]) -> None:
        self._write(_dumps(ev) + "\n")

    def extend(self, events: list[dict[str, Any]]) -> None:
        self.add_lines(encode(events))

    def add_lines(self, text: str) -> None:
        """Events another process encoded (:func:`encode`); lines that are not one JSON object
        each are dropped when the trace is merged."""
        if text:
            self._write(text if text.endswith("\n") else text + "\n")

    def flush(self) -> None:
        self._write(None)

    def close(self) -> None:
        self.flush()
        self._close(self.error)


def recorder_from_env(env: dict[str, str], name: str) -> Recorder | None:
    """This process's recorder (``<spool>/<name>.jsonl``), or None when the job is not traced."""
    spool = env.get(SPOOL_ENV, "")
    if not spool or not os.path.isdir(spool):
        return None
    try:
        return Recorder(os.path.join(spool, f"{name}.jsonl"))
    except OSError:
        return None


def _events(lines: Iterable[str | bytes]) -> list[dict[str, Any]]:
    """The events among spool lines; a line that is not one event (torn: a killed process) is skipped."""
    import json

    events: list[dict[str, Any]] = []
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and "ph" in ev:
            events.append(ev)
    return events


def _spool_files(spool: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The paths of ``spool``'s files (but those named in ``skip``), by name."""
    try:
        names = sorted(os.listdir(spool))
    except OSError:
        return []
    return [os.path.join(spool, name) for name in names if name.endswith(".jsonl") and name not in skip]


def read_spool(spool: str, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every event in ``spool``'s files (but those named in ``skip``)."""
    return [ev for path in _spool_files(spool, skip) for ev in _events(_lines(path))]


class Follower:
    """Reads a file others append whole lines to, from where it stopped last time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0

    def read(self, final: bool = False) -> list[dict[str, Any]]:
        """The events of the lines appended since; a line still being written waits for the next
        call (``final``: there is no next call - a torn last line is dropped)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = len(data) if final else data.rfind(b"\n") + 1
        self.offset += end
        return _events(data[:end].splitlines())


def _lines(path: str) -> list[str]:
    """A spool file's whole lines: only its last can be torn (its process killed mid-write)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = [line.strip() for line in fh if line.strip()]
    except OSError:
        return []
    if lines:
        import json

        try:
            json.loads(lines[-1])
        except ValueError:
            lines.pop()
    return [line for line in lines if line.startswith("{") and line.endswith("}")]


def merge(spool: str, out: str, meta: dict[str, Any]) -> int:
    """Write the trace of every event in ``spool`` to ``out`` (atomically); returns how many.

    The spool's lines are copied as they are (each is already one event's JSON): metadata first,
    then the events in the order each process wrote them - viewers order by time themselves."""
    head: list[str] = []
    body: list[str] = []
    for path in _spool_files(spool):
        for line in _lines(path):
            (head if '"ph":"M"' in line else body).append(line)
    events = ",\n".join([*dict.fromkeys(head), *body])
    write_whole(out, '{"traceEvents":[' + events + '],"displayTimeUnit":"ms","otherData":' + _dumps(meta) + "}\n")
    return len(body)
