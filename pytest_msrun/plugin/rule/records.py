"""Per-rank result records: one JSON object per line, appended and flushed as they happen.

A rank (re)creates its file and writes, in order:

* ``start`` (pid, its log file, its main thread's id, the job's id),
* ``collected`` (the node ids it is going to run) and ``collect`` per failed or skipped collection,
* per test phase a ``phase`` record when the phase *begins* (with the rank log's offset) and a
  ``report`` when it ends (pytest's own serializable report) - and one more ``report`` per
  subtest, and per fixture finalizer failure at a warm world's end (``world_end``),
* ``warning`` per warning a test raised, ``benchmark`` per pytest-benchmark measurement, ``junit``
  per suite property or XML attribute a test recorded, ``fixture`` per fixture set up or torn down
  where the controller shows them (``--setup-show``) (:mod:`.rankextras`), ``uncaptured`` per
  write with capture off (``capsys.disabled()``, live logging),
* ``timeout`` when a marked test ran out of time inside the job (suite mode),
* ``finish`` with pytest's exit status, and ``exit_hang`` if the process then did not exit.

So a rank that dies inside a test leaves the phase it was in on disk: that test failed on that
rank, and its output is the log from that offset on. The reader tolerates a torn last line.
Importing this module does not import pytest.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from pytest_msrun.fileio import make_dirs, open_output
from pytest_msrun.plugin.rule.outcomes import longrepr_text

REPORT_DIR_ENV = "MSRUN_PYTEST_REPORT_DIR"
SHARED_TMP_ENV = "MSRUN_PYTEST_SHARED_TMP"
CACHE_FILE = "pytest_cache.json"  # a suite's rank 0: its cache directory and last-failed set as the job began
LASTFAILED = "cache/lastfailed"  # pytest's cache key of the last-failed set
STEPWISE = "cache/stepwise"  # pytest's cache key of --sw's state (its format is pytest's own)
STEPWISE_FILE = "pytest_stepwise_rank{rank}.json"  # a suite's rank: the --sw state it would have written
BASETEMP_ENV = "MSRUN_PYTEST_BASETEMP"
PHASES = ("setup", "call", "teardown")


def records_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"pytest_rank{rank}.jsonl")


def stacks_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"pytest_rank{rank}.stacks")


_clock_gettime, _REALTIME = time.clock_gettime, time.CLOCK_REALTIME  # taken now: a test cannot move them


def wallclock() -> float:
    """The time a record is stamped with: the system's wall clock, read so that a test replacing
    ``time.time`` (a frozen clock, ``freezegun``) does not move its rank's records in the order of
    failures (a frozen rank was blamed first for a failure that came later)."""
    return _clock_gettime(_REALTIME)


# Bound now: a test may patch ``json.dumps`` (monkeypatch, a mock) while its rank writes records.
encode_json = json.JSONEncoder(default=str).encode


class RecordWriter:
    """Appends records for one rank; every line is flushed before the call returns."""

    def __init__(self, path: str, rank: int, world: int, *, append: bool = False) -> None:
        make_dirs(os.path.dirname(path) or ".")  # the test's reports (made new), or msrun's log directory
        self.fh: IO[str] = open_output(path, append=append)  # a session's
        self.rank = rank
        self.world = world
        self.lock = threading.Lock()  # a timeout is recorded from a timer thread

    def write(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "rank": self.rank, "world": self.world, "ts": wallclock(), **fields}
        line = encode_json(record) + "\n"
        with self.lock:
            self.fh.write(line)
            self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def read_records(path: str, cutoff: int | None, cutoff_ts: float | None) -> Iterator[tuple[dict[str, Any], bool]]:
    """Every complete record in ``path`` (a torn or garbled line is skipped), and whether it is
    *late*: its line ends past byte ``cutoff`` (where the file stood at the test's deadline), or
    it was written after ``cutoff_ts`` (the deadline msrun found a rank past, on the rank's host)."""
    try:
        with open(path, "rb") as fh:
            end = 0
            for raw in fh:
                end += len(raw)
                if not raw.endswith(b"\n"):
                    break
                try:
                    record = json.loads(raw.decode("utf-8", errors="replace"))
                except ValueError:
                    continue
                if isinstance(record, dict) and "kind" in record:
                    late = (cutoff is not None and end > cutoff) or (
                        cutoff_ts is not None and float(record.get("ts") or 0) > cutoff_ts
                    )
                    yield record, late
    except OSError:
        return


def sizes(directory: str, ranks: Iterable[int]) -> dict[int, int]:
    """Where each rank's record file stands now (0: none yet): taken at a test's deadline, what
    lies beyond is late - evidence of what a rank did after it, never a phase's result."""
    out = {}
    for rank in ranks:
        try:
            out[rank] = os.path.getsize(records_path(directory, rank))
        except OSError:
            out[rank] = 0
    return out


@dataclass
class PhaseStart:
    ts: float
    offset: int | None  # where the rank's log stood when the phase began


@dataclass
class RankTest:
    """What one rank recorded for one test."""

    nodeid: str
    started: dict[str, PhaseStart] = field(default_factory=dict)
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # when -> the phase's own report
    more: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # when -> subtests, world-end teardown
    stamps: dict[str, float] = field(default_factory=dict)
    timeout: dict[str, Any] | None = None
    collectives: list[list[Any]] = field(default_factory=list)  # [op, seq, entered, returned, error, when]
    log_end: int | None = None  # where the rank's log stood when the test's teardown ended
    warnings: list[dict[str, Any]] = field(default_factory=list)  # what the test raised (see rankextras)
    benchmarks: list[dict[str, Any]] = field(default_factory=list)  # what pytest-benchmark measured
    junit: list[dict[str, Any]] = field(default_factory=list)  # what it gave junitxml (see rankextras)
    terminal: list[dict[str, Any]] = field(default_factory=list)  # what it wrote past capture (see rankextras)

    def log_span(self) -> tuple[int, int | None] | None:
        """The test's part of the rank's log: from its setup's start to its teardown's end."""
        first = next((self.started[w].offset for w in PHASES if w in self.started), None)
        return (first, self.log_end) if first is not None else None

    def phase_spans(self, until: float) -> Iterator[tuple[str, float, float, dict[str, Any] | None]]:
        """Each phase the rank began or reported: its name, start, stop (``until`` for a phase it never
        ended - a crash, a hang - never before its start), report."""
        for when in PHASES:
            report, began = self.reports.get(when), self.started.get(when)
            if report is None and began is None:
                continue
            start = float((report or {}).get("start") or 0.0) or (began.ts if began is not None else 0.0)
            yield when, start, max(start, float((report or {}).get("stop") or 0.0) or until), report

    def all_reports(self, when: str) -> list[dict[str, Any]]:
        """Every report of phase ``when``: its own, then its subtests' and late ones."""
        own = self.reports.get(when)
        return ([own] if own is not None else []) + self.more.get(when, [])


@dataclass
class RankLog:
    """One rank's record file, read back."""

    rank: int
    started: bool = False
    pid: int | None = None
    log: str = ""
    main_thread: int | None = None
    collected: list[str] | None = None
    collect_errors: list[dict[str, Any]] = field(default_factory=list)
    collect_skips: list[dict[str, Any]] = field(default_factory=list)  # modules skipped at collection
    tests: dict[str, RankTest] = field(default_factory=dict)  # in the order the rank ran them
    finished: bool = False
    exitstatus: int | None = None
    start_ts: float = 0.0
    job: str = ""  # the job whose rank wrote it (MSRUN_JOB_ID): a log directory may be used again
    exit_hang: dict[str, Any] | None = None  # the session finished but the process did not exit
    after_deadline: list[dict[str, Any]] = field(default_factory=list)  # written too late: evidence only

    def reported_failure(self) -> bool:
        """Whether any report of this rank failed (what a pytest exit status of 1 means)."""
        return bool(self.collect_errors) or any(
            rep.get("outcome") == "failed" for t in self.tests.values() for w in PHASES for rep in t.all_reports(w)
        )

    def collect_skip(self, nodeid: str) -> str | None:
        """Why this rank skipped ``nodeid``'s module (or package) at collection, if it did."""
        for data in self.collect_skips:
            prefix = str(data.get("nodeid", ""))
            if prefix and (nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "/")):
                return longrepr_text(data) or "skipped at collection"
        return None

    def test(self, nodeid: str) -> RankTest:
        return self.tests.get(nodeid) or RankTest(nodeid)

    def past_deadline(self, late: dict[str, Any]) -> None:
        """msrun found this rank still there after its deadline (``late``: when, how long, what):
        a timeout where it was then - in a test's phase, or at its exit - as if its own timer had
        fired (it could not: stopped, or holding the interpreter's lock)."""
        due = float(late.get("due") or 0.0)
        seconds = float(late.get("seconds") or 0.0)
        nodeid = self.last_test
        test = self.tests.get(nodeid) if nodeid is not None else None
        when = next((w for w in reversed(PHASES) if test is not None and w in test.started), None)
        if test is None or when is None or (when in test.reports and (when == "teardown" or self.finished)):
            after = "of its pytest session's end" if self.finished else "of its last test's end"
            grace = {"grace": seconds, "ts": due, "after": f"{after} (msrun found it there)"}
            self.exit_hang = self.exit_hang or grace
            return
        if when in test.reports:  # between phases: in the next one
            when = PHASES[PHASES.index(when) + 1]
        if test.timeout is None:
            test.timeout = {"nodeid": nodeid, "when": when, "timeout": seconds, "ts": due, "by": "msrun"}

    def after_deadline_note(self, nodeid: str) -> str:
        """What this rank reported of ``nodeid`` after the deadline ("" if nothing): shown beside
        the timeout, never taken as a result (asked for its stacks, a rank in native code may
        return and finish the phase it was late in)."""
        said = [
            f"{data.get('when')} {data.get('outcome')}"
            for record in self.after_deadline
            if record.get("kind") == "report"
            for data in [record.get("data") or {}]
            if data.get("nodeid") == nodeid
        ]
        if not said:
            return ""
        return f"; after the deadline it reported {', '.join(said)} - too late to count"

    @property
    def last_test(self) -> str | None:
        return next(reversed(self.tests), None) if self.tests else None


def load_rank_log(path: str, rank: int, cutoff: int | None = None, cutoff_ts: float | None = None) -> RankLog:
    """One rank's records; with ``cutoff`` (the file's size at the test's deadline) or ``cutoff_ts``
    (the deadline's time) the records written after it are kept apart in
    :attr:`RankLog.after_deadline`, never taken as results."""
    out = RankLog(rank)

    def test(nodeid: Any) -> RankTest:
        return out.tests.setdefault(str(nodeid), RankTest(str(nodeid)))

    for record, late in read_records(path, cutoff, cutoff_ts):
        if late:
            out.after_deadline.append(record)
            continue
        kind = record["kind"]
        if kind == "start":
            out.started = True
            out.pid = record.get("pid")
            out.log = str(record.get("log") or "")
            out.main_thread = record.get("main_thread")
            out.start_ts = float(record.get("ts", 0.0))
            out.job = str(record.get("job") or "")
        elif kind == "collected":
            out.collected = [str(n) for n in record.get("nodeids", [])]
        elif kind == "collect":
            data = record.get("data", {})
            (out.collect_skips if data.get("outcome") == "skipped" else out.collect_errors).append(data)
        elif kind == "phase":
            started = PhaseStart(float(record.get("ts", 0.0)), record.get("offset"))
            test(record.get("nodeid")).started[str(record.get("when"))] = started
        elif kind == "report":
            data = record.get("data", {})
            one = test(data.get("nodeid", ""))
            when = str(data.get("when", "call"))
            if data.get("_report_type") == "SubTestReport" or record.get("late"):
                one.more.setdefault(when, []).append({**data, "_ts": float(record.get("ts", 0.0))})
            else:
                one.reports[when] = data
                one.stamps[when] = float(record.get("ts", 0.0))
        elif kind == "phase_end" and isinstance(record.get("offset"), int):
            test(record.get("nodeid")).log_end = record["offset"]
        elif kind == "collectives":
            spans, when = record.get("spans"), str(record.get("when"))
            if isinstance(spans, list):
                new = [[*span, when] for span in spans if isinstance(span, list) and len(span) == 5]
                test(record.get("nodeid")).collectives += new
        elif kind in ("warning", "benchmark", "junit", "fixture", "uncaptured"):
            one = test(record.get("nodeid") or out.last_test or "")
            lists = {"warning": one.warnings, "benchmark": one.benchmarks, "junit": one.junit}
            lists.get(kind, one.terminal).append(record)
        elif kind == "timeout":
            test(record.get("nodeid")).timeout = record
        elif kind == "finish":
            out.finished = True
            out.exitstatus = record.get("exitstatus")
        elif kind == "exit_hang":
            out.exit_hang = record
    return out
