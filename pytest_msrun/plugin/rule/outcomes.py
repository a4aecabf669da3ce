"""The words of a verdict, shared by everything that shows one: how a rank's process ended
(:class:`RankEnd`), why a rank did not pass a phase (:class:`RankIssue`), each phase's verdict and the
test's (:class:`PhaseVerdict`, :class:`TestVerdict`), and how a report's failure reads.

One vocabulary, read by the console's reports, JUnit, the HTML page, the suite table and msrun's
exit status: a test's outcome is one of :data:`OUTCOMES`.

Plain data: no pytest import, so the launcher side can use it too.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from pytest_msrun.engine.processes import describe_returncode
from pytest_msrun.engine.status import ProcessStatus
from pytest_msrun.engine.summary import log_text

STRICT_XPASS = "[XPASS(strict)]"
PASSING = ("passed", "skipped", "xfailed", "xpassed")
# every outcome a test can have: pytest's own, then a suite's "incomplete" (a rank stopped because
# of a failure elsewhere) and "not run" (no rank began it)
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "incomplete", "not run")


@dataclass
class RankEnd:
    """How a rank's process ended (msrun's status file), or that it lives on (a warm world)."""

    returncode: int | None = None  # None: still running, or never started
    ended: float | None = None
    pid: int | None = None
    log: str = ""
    terminated_by_msrun: bool = False
    stop_reason: str = ""  # why msrun stopped the job ("rank 1 exited with code 3", "msrun received SIGTERM")
    host: str = ""  # the host the rank ran on
    alive: bool = False  # a warm world's rank that finished the test and serves the next one
    # a warm world's rank that was waiting for the controller (to tear the test down, or for the
    # next one) when the world was stopped because another rank ran out of time: not due its teardown
    held: bool = False
    died_at: float | None = None  # when it crashed, from its error file or fatal-error dump
    after: str = ""  # how a rank running at a test's deadline ended after it (evidence only)

    @classmethod
    def of(cls, proc: ProcessStatus, stop_reason: str, host: str) -> RankEnd:
        """From msrun's status of the rank's process, why msrun stopped the job, and the rank's host."""
        return cls(
            returncode=proc.returncode,
            ended=proc.ended,
            pid=proc.pid,
            log=proc.log,
            terminated_by_msrun=proc.terminated_by_msrun,
            stop_reason=stop_reason,
            host=host,
            died_at=death_time(proc.log) if proc.returncode not in (None, 0) else None,
        )

    @property
    def elsewhere(self) -> bool:
        """Whether the rank ran on another host than this one (its PID means nothing here)."""
        return bool(self.host) and self.host != socket.gethostname()

    def describe(self, timed_out: bool) -> str:
        if self.alive:
            return "is still running (it finished the test)"
        if self.returncode is None:
            if timed_out:
                return "was still running at the timeout" + (f" (after it, it {self.after})" if self.after else "")
            if self.pid is None:
                return "never started"
            if self.elsewhere:  # a node's msrun ended without a word
                lost = "(that node, or its task there, was lost)"
                return f"has no recorded exit status: msrun on {self.host} recorded none {lost}"
            return "has no recorded exit status"
        how = describe_returncode(self.returncode)
        if self.terminated_by_msrun:
            how += f" (terminated by msrun: {self.stop_reason})" if self.stop_reason else " (terminated by msrun)"
        return how


def death_time(log: str) -> float | None:
    """When a rank crashed, as written beside its log: its error file's time, else - when its log
    ends with a fatal-error dump (written as it died) - the log's modification time."""
    if not log:
        return None
    from pytest_msrun.engine.errorfile import error_file_for, read_error

    error = read_error(error_file_for(log))
    if error is not None and error.time:
        return error.time
    if "Fatal Python error" in log_text(log, 16384):
        with contextlib.suppress(OSError):
            return os.stat(log).st_mtime
    return None


def shown(verdict: TestVerdict) -> str:
    """The test's outcome in pytest's words, as the console, JUnit and the HTML page show it: a
    failed setup or teardown is an error, a failed call a failure; otherwise the verdict's own
    (a phase that failed only by ranks msrun stopped - "incomplete" - is still that phase's error)."""
    failed = {p.phase for p in verdict.phases if p.outcome == "failed"}
    if failed & {"setup", "teardown"}:
        return "error"
    if "call" in failed:
        return "failed"
    if verdict.outcome in ("incomplete", "not run"):
        return "error"
    return verdict.outcome


@dataclass
class RankIssue:
    """Why one rank did not pass one phase."""

    rank: int
    kind: str  # failed (its own report) | died | timeout | stopped | exit (ended badly after its reports)
    at: float
    summary: str
    report: dict[str, Any] | None = None  # the serialized report, for "failed"
    phase: str = ""
    waited: bool = False  # it timed out waiting in the control plane for other ranks: not a root cause before theirs


@dataclass(frozen=True)
class Refusal:
    """Why a test's job never ran: the outcome pytest gives it (``skipped``, or ``failed`` - the
    setup's error), the reason, and what msrun said where it tried (``detail``)."""

    outcome: str
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class PhaseVerdict:
    phase: str
    outcome: str  # passed | failed | skipped
    present: dict[int, dict[str, Any]]  # rank -> its own report of the phase
    issues: list[RankIssue] = field(default_factory=list)  # failures, first by time first
    stopped: list[int] = field(default_factory=list)  # stopped by msrun after a failure elsewhere
    wasxfail: str | None = None  # set when the merged outcome is XFAIL (skipped) or XPASS (passed)
    message: str = ""  # a rule's own failure (a mix of skip and run)
    cause: RankIssue | None = None  # for a phase failed only by stopped ranks: the failure that stopped them
    skip_reason: str = ""  # a skip no report of this phase carries (every rank skipped at collection)


@dataclass(frozen=True)
class TestVerdict:
    """Every phase's verdict, each rank's cell, and the test's overall outcome."""

    __test__ = False  # not a pytest test class

    nodeid: str
    phases: list[PhaseVerdict]
    cells: dict[int, str]  # rank -> passed | failed | error | skipped | xfailed | crashed (...) | ...
    outcome: str  # passed | failed | error | skipped | xfailed | xpassed | incomplete | not run
    not_run: list[int] = field(default_factory=list)
    note: str = ""  # why an outcome was changed after the rule (suite mode: a failure caused by another test)
    refusal: Refusal | None = None  # the job never ran (a bad marker, a skip, no room, msrun's launch error)

    @property
    def issues(self) -> list[RankIssue]:
        """Every rank's failure, first by time first - a rank that only waited for others last."""
        return sorted((i for p in self.phases for i in p.issues), key=lambda i: (i.waited, i.at))

    @property
    def first_issue(self) -> RankIssue | None:
        return next(iter(self.issues), None)

    @property
    def failing_ranks(self) -> list[int]:
        return sorted({i.rank for p in self.phases for i in p.issues})

    @property
    def passing(self) -> bool:
        return self.outcome in PASSING


def longrepr_text(report: dict[str, Any]) -> str:
    """A report's failure or skip in one text: its own, its crash line, or its skip's reason."""
    longrepr = report.get("longrepr")
    if isinstance(longrepr, str):
        return longrepr
    if isinstance(longrepr, dict):
        crash = (longrepr.get("reprcrash") or {}).get("message")
        if crash:
            return str(crash)
    if isinstance(longrepr, (list, tuple)) and len(longrepr) == 3:
        return str(longrepr[2])
    return ""


def fails(report: dict[str, Any]) -> bool:
    """A failed report, but a strict xfail that passed (it fails the test only on every rank)."""
    return report.get("outcome") == "failed" and not longrepr_text(report).startswith(STRICT_XPASS)


def crash_message(report: dict[str, Any]) -> str:
    """The one-line reason of a failed report."""
    lines = longrepr_text(report).strip().splitlines()
    if isinstance(report.get("longrepr"), str) and lines:
        line = lines[-1]
    else:
        line = lines[0] if lines else "failed"
    if report.get("_report_type") == "SubTestReport":
        label = report.get("_subtest.description")  # as the rank's pytest describes it
        return f"subtest {label if isinstance(label, str) else '(<subtest>)'} failed: {line}"
    return line


def was(how: str) -> str:
    """ "killed by ..." as a predicate: "was killed by ..."."""
    return f"was {how}" if how.startswith("killed") else how


def were(ranks) -> str:
    """``rank 0 was`` / ``ranks 0, 1 were``: a sentence's subject."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]} was" if len(ranks) == 1 else f"ranks {ranks_text(ranks)} were"


def ranks_text(ranks) -> str:
    """``0, 1, 3`` for a few ranks; ``0-511, 600`` for many."""
    ranks = sorted(ranks)
    if len(ranks) <= 8:
        return ", ".join(map(str, ranks))
    from pytest_msrun.cpulist import format_id_list

    return format_id_list(ranks).replace(",", ", ")
