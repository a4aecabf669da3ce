"""Each marked test in its job's trace: built from the ranks' records and the controller's verdict.

msrun writes a job's trace knowing processes, not tests. The ranks' records (``pytest_rank{r}.jsonl``)
already hold every phase's start and end; this module turns a judged test into trace events: on each
rank's lane, a span per test with its phases (setup, call, teardown) nested in it and an instant where
a rank failed a phase (its short message); on the ``tests`` lane, one span per test carrying the
verdict. :class:`TraceNotes` collects them per trace file and adds them once the job has ended (its
msrun wrote the file), renaming msrun's bare ``job ended: succeeded (0)`` - a warm world's ranks exit
0 whatever its tests did - to what that exit means and the tests' tally. Suite mode adds the same
events through its job-end reporter (:mod:`.suite`) before msrun writes the trace.

Times are the ranks' own wall clocks (the trace's clock on one host). Standard library only.
"""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from collections.abc import Iterable

from pytest_msrun import fsinfo
from pytest_msrun.control import tracelog
from pytest_msrun.fileio import write_whole
from pytest_msrun.plugin.rule.outcomes import TestVerdict
from pytest_msrun.plugin.rule.records import RankLog

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

TESTS_PID = 3  # the lane of the tests' verdicts (after msrun's and the control plane's)
TEST_TID = 1  # on each rank's lane: the row of its tests (row 0 is its process)
ORDER = ("passed", "failed", "error", "incomplete", "not run", "skipped", "xfailed", "xpassed")
MESSAGE_MAX = 200  # characters of a failure's message in the trace


def short(text: object) -> str:
    """A message's first line, cut to :data:`MESSAGE_MAX` characters."""
    lines = str(text or "").strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= MESSAGE_MAX else first[: MESSAGE_MAX - 1] + "…"


def tally(outcomes: Iterable[str]) -> str:
    """``3 passed, 1 failed``: the tests' outcomes counted, in a fixed order."""
    counts = Counter(outcomes)
    parts = [f"{counts[k]} {k}" for k in ORDER if counts.get(k)]
    parts += [f"{n} {k}" for k, n in sorted(counts.items()) if k not in ORDER]
    return ", ".join(parts) or "none ran"


def _phase_spans(verdict: TestVerdict, log: RankLog, until: float) -> list[dict[str, Any]]:
    """The phases one rank ran of the test: (name, start, end, outcome) as span events."""
    test = log.tests.get(verdict.nodeid)
    if test is None:
        return []
    lane = tracelog.RANK_PID + log.rank
    out = []
    for when, start, stop, report in test.phase_spans(until):
        outcome = str((report or {}).get("outcome") or "unfinished")
        out.append(tracelog.span(when, lane, TEST_TID, start, stop, {"outcome": outcome}))
    return out


def _span_us(name: str, pid: int, tid: int, start: int, end: int, args: dict[str, Any]) -> dict[str, Any]:
    """A span from microseconds other spans already hold (no round trip through seconds: at
    today's clock a float of seconds can move a microsecond, and a test's span must hold its phases)."""
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start, "dur": max(0, end - start), "args": args}


def test_events(verdict: TestVerdict, outcome: str, logs: dict[int, RankLog], until: float) -> list[dict[str, Any]]:
    """The trace events of one judged test (``outcome``: its verdict as reported): per rank a span
    with its phases inside and its failures; a span on the tests lane with the verdict. ``until``:
    where a phase a rank never finished ends (its death, the job's end)."""
    events: list[dict[str, Any]] = []
    nodeid = verdict.nodeid
    name = nodeid.split("::", 1)[-1]  # without its file (the args carry the node id)
    bounds: list[int] = []  # microseconds, as the spans hold them
    for rank in sorted(logs):
        phases = _phase_spans(verdict, logs[rank], until)
        if not phases:
            continue
        start = min(ev["ts"] for ev in phases)
        end = max(ev["ts"] + ev["dur"] for ev in phases)
        bounds += [start, end]
        own = {"nodeid": nodeid, "on this rank": verdict.cells.get(rank, ""), "verdict": outcome}
        events.append(_span_us(name, tracelog.RANK_PID + rank, TEST_TID, start, end, own))
        events += phases
    for issue in verdict.issues:
        at = float((issue.report or {}).get("stop") or 0.0) or issue.at or until
        where = f" in {issue.phase}" if issue.phase else ""
        said = {"nodeid": nodeid, "rank": issue.rank, "message": short(issue.summary)}
        events.append(tracelog.instant(f"{issue.kind}{where}", tracelog.RANK_PID + issue.rank, TEST_TID, at, said))
    cells = {str(rank): cell for rank, cell in sorted(verdict.cells.items())}
    args: dict[str, Any] = {"nodeid": nodeid, "verdict": outcome, "ranks": cells}
    first = verdict.first_issue
    if verdict.refusal is not None:
        args["refused"] = short(verdict.refusal.reason)
    if first is not None:
        args["first failure"] = f"rank {first.rank}" + (f" in {first.phase}" if first.phase else "")
        args["message"] = short(first.summary)
    if bounds:
        events.append(_span_us(f"{outcome}: {name}", TESTS_PID, 0, min(bounds), max(bounds), args))
    else:  # no rank began it: an instant where the job ended
        events.append(tracelog.instant(f"{outcome}: {name}", TESTS_PID, 0, until, args))
    return events


def lanes() -> list[dict[str, Any]]:
    """The tests lane (placed after msrun's and the control plane's) and each rank's tests row."""
    return tracelog.lane(TESTS_PID, "tests", 2)


def rank_rows(ranks: Iterable[int]) -> list[dict[str, Any]]:
    rows = [tracelog.thread(tracelog.RANK_PID + rank, 0, "process") for rank in ranks]
    return rows + [tracelog.thread(tracelog.RANK_PID + rank, TEST_TID, "tests") for rank in ranks]


def annotate(path: str, events: list[dict[str, Any]], outcomes: list[str], world: bool) -> None:
    """Add ``events`` to the trace file ``path`` (written whole again) and say the tests' tally at
    msrun's end; nothing when there is no trace to annotate (the job's msrun wrote none). An error
    writing it (a full disk) is raised, the trace left as msrun wrote it."""
    try:
        with open(path, encoding="utf-8") as fh:
            trace = json.load(fh)
        existing = trace["traceEvents"]
        if not isinstance(existing, list):
            return
    except (OSError, ValueError, KeyError, TypeError):
        return
    ranks = sorted({ev["pid"] - tracelog.RANK_PID for ev in events if ev.get("pid", 0) >= tracelog.RANK_PID})
    for ev in existing:
        name = ev.get("name") if isinstance(ev, dict) else None
        if isinstance(name, str) and ev.get("pid") == tracelog.MSRUN_PID and name.startswith("job ended:"):
            args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
            ev["args"] = {**args, "msrun": name, "tests": dict(Counter(outcomes))}
            # msrun's "job ended: <state> (<code>)" said of a plugin job: what its processes' end
            # means (a world's ranks exit 0 whatever its tests did), and the tests' tally
            state = name.split(":", 1)[1].strip()
            processes = "ranks exited 0" if state == "succeeded (0)" else f"msrun {state}"
            ev["name"] = f"{'world' if world else 'job'} ended: {processes}; tests: {tally(outcomes)}"
    trace["traceEvents"] = [*existing, *lanes(), *rank_rows(ranks), *events]
    write_whole(path, json.dumps(trace, separators=(",", ":")) + "\n")


class TraceNotes:
    """The tests judged in each traced job, added to its trace once its msrun has written it."""

    def __init__(self) -> None:
        # trace path -> (how its tests ran: fresh | warm, when its job started, node id -> (events, outcome))
        self.pending: dict[str, tuple[str, float, dict[str, tuple[list[dict[str, Any]], str]]]] = {}
        self.problem = ""  # the first trace lost (a full disk): said once, at the session's end

    def add(
        self,
        path: str,
        job: tuple[str, float],
        verdict: TestVerdict,
        outcome: str,
        logs: dict[int, RankLog],
        until: float,
    ) -> None:
        """One judged test of the job (``job``: fresh or warm, when it started) whose trace is ``path``
        ("": not traced); a test judged again (a world's end revealed more) replaces its first verdict."""
        if not path:
            return
        _, _, tests = self.pending.setdefault(path, (*job, {}))
        tests[verdict.nodeid] = (test_events(verdict, outcome, logs, until), outcome)

    def flush(self, path: str) -> None:
        """The job of ``path`` has ended: add its tests to the trace its msrun wrote (not to a file
        an earlier session left under that name, when this job's msrun wrote none); a refused
        test's trace, which no msrun writes, is written here."""
        if path not in self.pending:
            return
        mode, since, tests = self.pending.pop(path)
        events = [ev for evs, _ in tests.values() for ev in evs]
        if mode == "refused":  # no job, no msrun to write it: the trace holds the refusal alone
            try:
                write_whole(path, json.dumps({"traceEvents": [*lanes(), *events]}, separators=(",", ":")) + "\n")
            except OSError as exc:
                self._lost(path, exc)
            return
        try:
            fresh = os.path.getmtime(path) >= since - 1
        except OSError:  # its msrun wrote none: said when its disk is full, the likely why
            if fsinfo.is_full(os.path.dirname(path)):
                self._lost(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path))
            return
        if fresh:
            try:
                annotate(path, events, [outcome for _, outcome in tests.values()], mode == "warm")
            except OSError as exc:
                self._lost(path, exc)

    def _lost(self, path: str, exc: OSError) -> None:
        if not self.problem:
            what = fsinfo.describe_write_error(path, exc, "--msrun-trace")
            self.problem = f"a test's trace was not written ({what}); later ones may be lost too"

    def flush_all(self) -> None:
        for path in list(self.pending):
            self.flush(path)
