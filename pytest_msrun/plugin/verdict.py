"""One verdict rule for a test that ran on several ranks - plugin mode and suite mode alike.

A rank's outcome for a test comes from the phases it reached (its ``phase`` and ``report``
records) and from how its process ended (msrun's status):

* a phase failed if any rank failed it; the first failure by time is the root cause, the other
  failing ranks are listed;
* a rank that began a phase (or was due to) and left no report for it failed that phase - it
  died (its exit status or signal says how), timed out, or was stopped by msrun; a rank stopped
  only because another rank failed is listed as stopped, never blamed;
* skipped only if every rank skipped; a mix of skip and run is a failure;
* xfail: any rank failing as expected makes the test XFAIL (a strict xfail that passed on the
  other ranks included); every rank passing makes it XPASS (strict: failed);
* in a suite (``msrun pytest dir/``) a rank that never began a test did not run it: the test is
  incomplete, not passed; in a job made for one test (plugin mode) such a rank died before it.

Plain data in, plain data out: no pytest import, so the launcher side can use it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_msrun.engine.processes import describe_returncode
from pytest_msrun.engine.status import ProcessStatus
from pytest_msrun.plugin.records import PHASES, RankLog, RankTest

STRICT_XPASS = "[XPASS(strict)]"


@dataclass
class RankEnd:
    """How a rank's process ended, from msrun's status file."""

    returncode: int | None = None  # None: still running, or never started
    ended: float | None = None
    pid: int | None = None
    log: str = ""
    terminated_by_msrun: bool = False
    stop_reason: str = ""  # why msrun stopped the job ("rank 1 exited with code 3", "msrun received SIGTERM")
    host: str = ""  # the host the rank ran on

    @classmethod
    def of(cls, proc: ProcessStatus, stop_reason: str, host: str = "") -> RankEnd:
        """From msrun's status of the rank's process, why msrun stopped the job, and the rank's host."""
        return cls(
            returncode=proc.returncode,
            ended=proc.ended,
            pid=proc.pid,
            log=proc.log,
            terminated_by_msrun=proc.terminated_by_msrun,
            stop_reason=stop_reason,
            host=host,
        )

    def describe(self, timed_out: bool) -> str:
        if self.returncode is None:
            if timed_out:
                return "was still running at the timeout"
            return "never started" if self.pid is None else "has no recorded exit status"
        how = describe_returncode(self.returncode)
        if self.terminated_by_msrun:
            how += f" (terminated by msrun: {self.stop_reason})" if self.stop_reason else " (terminated by msrun)"
        return how


@dataclass
class RankIssue:
    """Why one rank did not pass one phase."""

    rank: int
    kind: str  # failed (its own report) | died | timeout | stopped
    at: float
    summary: str
    report: dict[str, Any] | None = None  # the serialized report, for "failed"


@dataclass
class PhaseVerdict:
    phase: str
    outcome: str  # passed | failed | skipped
    present: dict[int, dict[str, Any]]  # rank -> serialized report
    issues: list[RankIssue] = field(default_factory=list)  # failures, first by time first
    stopped: list[int] = field(default_factory=list)  # stopped by msrun after a failure elsewhere
    wasxfail: str | None = None  # set when the merged outcome is XFAIL (skipped) or XPASS (passed)
    message: str = ""  # a rule's own failure (a mix of skip and run)


@dataclass
class TestVerdict:
    """Every phase's verdict, each rank's cell, and the test's overall outcome."""

    __test__ = False  # not a pytest test class

    nodeid: str
    phases: list[PhaseVerdict]
    cells: dict[int, str]  # rank -> passed | failed | error | skipped | xfailed | xpassed | crashed (...) | ...
    outcome: str  # passed | failed | error | skipped | xfailed | xpassed | incomplete | not run
    not_run: list[int] = field(default_factory=list)

    @property
    def first_issue(self) -> RankIssue | None:
        for phase in self.phases:
            if phase.issues:
                return phase.issues[0]
        return None

    @property
    def failing_ranks(self) -> list[int]:
        return sorted({i.rank for p in self.phases for i in p.issues})


def _longrepr_text(report: dict[str, Any]) -> str:
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


def is_strict_xpass(report: dict[str, Any]) -> bool:
    return report.get("outcome") == "failed" and _longrepr_text(report).startswith(STRICT_XPASS)


def crash_message(report: dict[str, Any]) -> str:
    """The one-line reason of a failed report."""
    text = _longrepr_text(report).strip()
    longrepr = report.get("longrepr")
    if isinstance(longrepr, dict) and not (longrepr.get("reprcrash") or {}).get("message"):
        text = ""
    lines = text.splitlines()
    if isinstance(longrepr, str) and lines:
        return lines[-1]
    return lines[0] if lines else "failed"


def skip_reason(report: dict[str, Any]) -> str:
    longrepr = report.get("longrepr")
    if isinstance(longrepr, (list, tuple)) and len(longrepr) == 3:
        return str(longrepr[2])
    return _longrepr_text(report)


def ranks_text(ranks) -> str:
    """``0, 1, 3`` for a few ranks; ``0-511, 600`` for many."""
    ranks = sorted(ranks)
    if len(ranks) <= 8:
        return ", ".join(map(str, ranks))
    from pytest_msrun.cpulist import format_id_list

    return format_id_list(ranks).replace(",", ", ")


class Judge:
    """Applies the rule to one test. ``scope`` is ``job`` (the ranks were started for this test)
    or ``suite`` (every rank runs a whole suite); ``timed_out`` says the test ran out of time."""

    def __init__(
        self,
        nodeid: str,
        ranks: list[int],
        logs: dict[int, RankLog],
        ends: dict[int, RankEnd],
        *,
        scope: str = "job",
        timed_out: bool = False,
        timeout: float = 0.0,
        job_ended: float = 0.0,
    ) -> None:
        self.nodeid = nodeid
        self.ranks = ranks
        self.logs = logs
        self.ends = ends
        self.scope = scope
        self.timed_out = timed_out
        self.timeout = timeout
        self.job_ended = job_ended
        self.died_in: dict[int, str] = {}
        self.deferred: list[int] = []

    def test(self, rank: int) -> RankTest:
        return self.logs[rank].test(self.nodeid) if rank in self.logs else RankTest(self.nodeid)

    def end(self, rank: int) -> RankEnd:
        return self.ends.get(rank) or RankEnd()

    def reached(self, rank: int) -> bool:
        """Whether ``rank`` began this test (in a job made for it: whether it was due to)."""
        if self.scope == "job":
            return True
        test = self.test(rank)
        return bool(test.started or test.reports or test.timeout)

    def expected(self, rank: int, phase: str) -> bool:
        """Whether ``rank`` should have reported ``phase``, given its earlier phases."""
        if rank in self.died_in or not self.reached(rank):
            return False
        reports = self.test(rank).reports
        if phase == "setup":
            return True
        if phase == "call":
            setup = reports.get("setup")
            return setup is not None and setup.get("outcome") == "passed"
        return "setup" in reports

    def _rank_timed_out(self, rank: int) -> bool:
        return self.timed_out or self.test(rank).timeout is not None

    def _missing(self, rank: int, phase: str) -> RankIssue:
        end = self.end(rank)
        at = float(end.ended) if end.ended else self.job_ended
        own = self.test(rank).timeout
        if own is not None:
            seconds = own.get("timeout", self.timeout)
            return RankIssue(
                rank,
                "timeout",
                float(own.get("ts", at)),
                f"rank {rank} timed out after {seconds:g} s in the {phase} phase",
            )
        if self.timed_out:
            return RankIssue(
                rank, "timeout", at, f"rank {rank} was still in the {phase} phase at the timeout ({self.timeout:g} s)"
            )
        log = self.logs.get(rank)
        if log is not None and log.finished and self.scope == "job":
            why = f"ended its pytest session (exit status {log.exitstatus})"
        else:
            why = "left no record"
        return RankIssue(rank, "died", at, f"rank {rank} {why} during the {phase} phase and {end.describe(False)}")

    def _stopped(self, rank: int) -> bool:
        end = self.end(rank)
        return end.terminated_by_msrun and not self._rank_timed_out(rank)

    def _failed_elsewhere(self, stopped: list[int]) -> bool:
        """Whether a rank not in ``stopped`` failed this test (a failed report, or a bad exit)."""
        for rank in self.ranks:
            if rank in stopped:
                continue
            if any(rep.get("outcome") == "failed" for rep in self.test(rank).reports.values()):
                return True
            end = self.end(rank)
            if end.returncode not in (None, 0) and not end.terminated_by_msrun and self.reached(rank):
                return True
        return False

    def phase(self, phase: str) -> PhaseVerdict | None:
        issues: list[RankIssue] = []
        stopped: list[int] = []
        present: dict[int, dict[str, Any]] = {}
        for rank in self.ranks:
            test = self.test(rank)
            report = test.reports.get(phase)
            if report is not None:
                present[rank] = report
                if report.get("outcome") == "failed" and not is_strict_xpass(report):
                    at = test.stamps.get(phase, 0.0)
                    issues.append(RankIssue(rank, "failed", at, f"rank {rank}: {crash_message(report)}", report))
                continue
            if not self.expected(rank, phase):
                continue
            self.died_in[rank] = phase
            if self._stopped(rank):
                stopped.append(rank)
            else:
                issues.append(self._missing(rank, phase))
        if stopped and not issues and not self.timed_out:
            if self._failed_elsewhere(stopped) or self.scope == "suite":
                # Stopped because something else failed: say so where that failure is reported.
                self.deferred.extend(stopped)
                stopped = []
            else:  # nothing else explains why msrun stopped them: their stop is the failure
                issues = [
                    RankIssue(
                        r,
                        "died",
                        self._end_at(r),
                        f"rank {r} was stopped by msrun during the {phase} phase and {self.end(r).describe(False)}",
                    )
                    for r in stopped
                ]
                stopped = []
        if not present and not issues and not stopped:
            return None
        issues.sort(key=lambda i: i.at)
        if issues or stopped:
            stopped, self.deferred = sorted(stopped + self.deferred), []
            return PhaseVerdict(phase, "failed", present, issues, stopped)
        return self._outcome(phase, present)

    def _end_at(self, rank: int) -> float:
        end = self.end(rank)
        return float(end.ended) if end.ended else self.job_ended

    def _outcome(self, phase: str, present: dict[int, dict[str, Any]]) -> PhaseVerdict:
        def xfail(rep: dict[str, Any]) -> bool:
            return "wasxfail" in rep

        xfailed = [r for r, rep in present.items() if rep.get("outcome") == "skipped" and xfail(rep)]
        skipped = [r for r, rep in present.items() if rep.get("outcome") == "skipped" and not xfail(rep)]
        xpassed = [r for r, rep in present.items() if rep.get("outcome") == "passed" and xfail(rep)]
        strict = [r for r, rep in present.items() if is_strict_xpass(rep)]
        ran = [r for r in present if r not in skipped]
        if skipped and ran:
            message = (
                f"skipped on ranks {ranks_text(skipped)} ({skip_reason(present[skipped[0]])}) but ran on ranks "
                f"{ranks_text(ran)}: a test must skip on every rank or on none"
            )
            return PhaseVerdict(phase, "failed", present, message=message)
        if xfailed:
            first = min(xfailed, key=lambda r: self.test(r).stamps.get(phase, 0.0))
            return PhaseVerdict(phase, "skipped", present, wasxfail=str(present[first].get("wasxfail", "")))
        if strict:  # every rank passed a strict xfail: pytest's own failure, from the first rank
            rank = strict[0]
            issue = RankIssue(
                rank,
                "failed",
                self.test(rank).stamps.get(phase, 0.0),
                f"rank {rank}: {crash_message(present[rank])}",
                present[rank],
            )
            return PhaseVerdict(phase, "failed", present, [issue])
        if xpassed:
            return PhaseVerdict(phase, "passed", present, wasxfail=str(present[xpassed[0]].get("wasxfail", "")))
        if skipped:
            return PhaseVerdict(phase, "skipped", present)
        return PhaseVerdict(phase, "passed", present)

    # ------------------------------------------------------------------ the whole test
    def verdict(self) -> TestVerdict:
        phases: list[PhaseVerdict] = []
        for phase in PHASES:
            verdict = self.phase(phase)  # every phase, so every rank's fate is known
            if verdict is None:
                continue
            if phase == "call" and phases and phases[0].outcome != "passed":
                # The merged setup did not pass, so the test has no call phase; ranks whose own
                # setup passed still ran it, and what went wrong there is part of the failure.
                phases[0].issues.extend(verdict.issues)
                phases[0].stopped = sorted(set(phases[0].stopped) | set(verdict.stopped))
                if verdict.issues and phases[0].outcome != "failed":
                    phases[0].outcome = "failed"
                continue
            phases.append(verdict)
        cells = {rank: self.cell(rank) for rank in self.ranks}
        not_run = [r for r in self.ranks if cells[r] == "not run"]
        return TestVerdict(self.nodeid, phases, cells, self._overall(phases, cells, not_run), not_run)

    def _overall(self, phases: list[PhaseVerdict], cells: dict[int, str], not_run: list[int]) -> str:
        if not phases:
            return "not run"
        by = {p.phase: p for p in phases}
        if by.get("setup") and by["setup"].outcome == "failed":
            return "error"
        if by.get("call") and by["call"].outcome == "failed":
            return "failed"
        if by.get("teardown") and by["teardown"].outcome == "failed":
            return "error"
        if not_run or any(c.startswith("stopped") for c in cells.values()):
            return "incomplete"
        main = by.get("call") or by["setup"]
        if main.wasxfail is not None:
            return "xfailed" if main.outcome == "skipped" else "xpassed"
        return main.outcome

    def cell(self, rank: int) -> str:
        """This rank's own outcome for the test, in a word or two: its first problem, phase by phase."""
        if not self.reached(rank):
            return "not run"
        reports = self.test(rank).reports
        died = self.died_in.get(rank)
        for phase in PHASES:
            if died == phase:
                return self._died_cell(rank)
            report = reports.get(phase)
            if report is None:
                continue
            if is_strict_xpass(report):
                return "xpassed(strict)"
            if report.get("outcome") == "failed":
                return "failed" if phase == "call" else "error"
            if phase == "setup" and report.get("outcome") == "skipped":
                return "xfailed" if "wasxfail" in report else "skipped"
        call = reports.get("call")
        if call is None:
            return "incomplete"
        if "wasxfail" in call:
            return "xfailed" if call.get("outcome") == "skipped" else "xpassed"
        return str(call.get("outcome"))

    def _died_cell(self, rank: int) -> str:
        if self._rank_timed_out(rank):
            return "timeout"
        if self._stopped(rank):
            return "stopped"
        end = self.end(rank)
        if end.returncode is None:
            return "no record"
        if end.returncode < 0:
            import signal

            try:
                return f"crashed ({signal.Signals(-end.returncode).name})"
            except ValueError:
                return f"crashed (signal {-end.returncode})"
        return f"crashed (exit {end.returncode})"


def judge(nodeid: str, ranks: list[int], logs: dict[int, RankLog], ends: dict[int, RankEnd], **kw: Any) -> TestVerdict:
    return Judge(nodeid, ranks, logs, ends, **kw).verdict()
