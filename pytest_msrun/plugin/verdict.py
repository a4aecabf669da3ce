"""One verdict rule for a test that ran on several ranks - fresh jobs, warm worlds and suite mode alike.

The verdict is a pure function of a complete record: every report of every phase each rank wrote
(subtests and a warm world's final fixture teardown included), how each rank's process ended
(:class:`RankEnd`: exit status or signal, when, whether msrun stopped it and why, or that it lives
on in a warm world), and the job's end (a timeout). Its invariant, checked before any report is
built (:func:`check_invariant`)::

    A test is passed, skipped or xfailed only if every rank due to run it reported that outcome for
    every phase it was due, and every rank's process ended cleanly or was ended by the job's normal
    finish.

The rule that follows from it:

* a rank is due ``setup``; ``call`` when its setup passed; ``teardown`` when it began setup. A due
  phase without a report failed on that rank: it died there (its exit status or signal says how),
  timed out, or was stopped by msrun;
* a phase failed on a rank when any of its reports failed (a subtest's too);
* a rank whose reports are complete but whose process then ended badly - a signal, an exit status
  its pytest session does not explain, a hang at exit (still running at the timeout, or its own
  exit watchdog fired) - failed the test's *teardown*. "Explained": exit 0; pytest's 1 after a
  reported failure; 5 after its module was skipped at collection; stopped by msrun because of a
  failure reported elsewhere. Only the test that was the last thing a process did answers for its
  end (a fresh job's only test, a warm world's last, a suite rank's last);
* a rank msrun stopped is excused only by a failure that is itself reported: the phase it was
  stopped in still failed (it cannot pass), pointing at that failure as the cause; with no failure
  anywhere the stop itself is the failure;
* the first failure by time is the root cause (a crash's time comes from its error file or fatal
  dump, not from when msrun reaped it);
* skipped only if every rank skipped - in any phase, or at collection; a mix of skip and run fails;
* xfail: any rank failing as expected makes the test XFAIL (strict included: a rank that passed a
  strict xfail does not end its job early, so this never depends on which rank finished first);
  every rank passing makes it XPASS (strict: failed);
* in a suite (``msrun pytest dir/``) a rank that never began a test did not run it: the test is
  incomplete, not passed; in a job made for one test (plugin mode) such a rank died before it.

Plain data in, plain data out: no pytest import, so the launcher side can use it too.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from pytest_msrun.control.observer import waiting_for_others
from pytest_msrun.engine.processes import describe_returncode
from pytest_msrun.engine.status import ProcessStatus
from pytest_msrun.plugin.records import PHASES, RankLog, RankTest

STRICT_XPASS = "[XPASS(strict)]"
PASSING = ("passed", "skipped", "xfailed", "xpassed")


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
            died_at=death_time(proc.log) if proc.returncode not in (None, 0) else None,
        )

    @property
    def at(self) -> float | None:
        """When the process ended, as well as it is known."""
        return self.died_at if self.died_at is not None else self.ended

    def describe(self, timed_out: bool) -> str:
        if self.alive:
            return "is still running (it finished the test)"
        if self.returncode is None:
            if timed_out:
                return "was still running at the timeout"
            return "never started" if self.pid is None else "has no recorded exit status"
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
    try:
        with open(log, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - 16384))
            tail = fh.read()
        if b"Fatal Python error" in tail:
            return os.stat(log).st_mtime
    except OSError:
        pass
    return None


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


@dataclass
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


@dataclass
class TestVerdict:
    """Every phase's verdict, each rank's cell, and the test's overall outcome."""

    __test__ = False  # not a pytest test class

    nodeid: str
    phases: list[PhaseVerdict]
    cells: dict[int, str]  # rank -> passed | failed | error | skipped | xfailed | crashed (...) | ...
    outcome: str  # passed | failed | error | skipped | xfailed | xpassed | incomplete | not run
    not_run: list[int] = field(default_factory=list)
    note: str = ""  # why an outcome was changed after the rule (suite mode: a failure caused by another test)

    @property
    def issues(self) -> list[RankIssue]:
        """Every rank's failure, first by time first - a rank that only waited for others last."""
        return sorted((i for p in self.phases for i in p.issues), key=lambda i: (i.waited, i.at))

    @property
    def first_issue(self) -> RankIssue | None:
        issues = self.issues
        return issues[0] if issues else None

    @property
    def failing_ranks(self) -> list[int]:
        return sorted({i.rank for p in self.phases for i in p.issues})

    @property
    def stopped(self) -> list[int]:
        return sorted({r for p in self.phases for r in p.stopped})

    @property
    def passing(self) -> bool:
        return self.outcome in PASSING


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


def is_subtest(report: dict[str, Any]) -> bool:
    return report.get("_report_type") == "SubTestReport"


def crash_message(report: dict[str, Any]) -> str:
    """The one-line reason of a failed report."""
    text = _longrepr_text(report).strip()
    longrepr = report.get("longrepr")
    if isinstance(longrepr, dict) and not (longrepr.get("reprcrash") or {}).get("message"):
        text = ""
    lines = text.splitlines()
    if isinstance(longrepr, str) and lines:
        line = lines[-1]
    else:
        line = lines[0] if lines else "failed"
    if is_subtest(report):
        context = report.get("_subtest.context") or {}
        label = " ".join(
            filter(
                None,
                [
                    f"[{context['msg']}]" if context.get("msg") is not None else "",
                    ", ".join(f"{k}={v!r}" for k, v in (context.get("kwargs") or {}).items()),
                ],
            )
        )
        return f"subtest {label or '(<subtest>)'} failed: {line}"
    return line


def skip_reason(report: dict[str, Any]) -> str:
    longrepr = report.get("longrepr")
    if isinstance(longrepr, (list, tuple)) and len(longrepr) == 3:
        return str(longrepr[2])
    return _longrepr_text(report)


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


@dataclass
class _Kind:
    """A rank's own outcome of a test it completed without a failure."""

    word: str  # skipped | xfailed | xpassed | xpass_strict | passed
    phase: str  # the phase it is decided in
    report: dict[str, Any] | None  # that phase's report (None: skipped at collection)
    reason: str = ""


class Judge:
    """Applies the rule to one test.

    ``scope`` is ``job`` (the ranks were started for this test) or ``suite`` (every rank runs a
    whole suite); ``final`` the ranks whose process end answers to this test (default: all);
    ``timed_out`` says the test ran out of time; ``failed_elsewhere`` that a failure outside this
    test (another test of the suite) is reported, which excuses ranks msrun stopped."""

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
        final: Collection[int] | None = None,
        failed_elsewhere: bool = False,
    ) -> None:
        self.nodeid = nodeid
        self.ranks = ranks
        self.logs = logs
        self.ends = ends
        self.scope = scope
        self.timed_out = timed_out
        self.timeout = timeout
        self.job_ended = job_ended
        self.final = set(ranks if final is None else final)
        self.failed_elsewhere = failed_elsewhere
        self.died_in: dict[int, str] = {}
        self.end_issue: dict[int, RankIssue] = {}

    # ------------------------------------------------------------------ facts per rank
    def test(self, rank: int) -> RankTest:
        return self.logs[rank].test(self.nodeid) if rank in self.logs else RankTest(self.nodeid)

    def end(self, rank: int) -> RankEnd:
        return self.ends.get(rank) or RankEnd()

    def began(self, rank: int) -> bool:
        test = self.test(rank)
        return bool(test.started or test.reports or test.more or test.timeout)

    def collect_skip(self, rank: int) -> str | None:
        """Why ``rank`` skipped this test at collection (it never began it)."""
        if self.began(rank) or rank not in self.logs:
            return None
        return self.logs[rank].collect_skip(self.nodeid)

    def reached(self, rank: int) -> bool:
        """Whether ``rank`` began this test (in a job made for it: whether it was due to)."""
        return self.scope == "job" or self.began(rank) or self.collect_skip(rank) is not None

    def due(self, rank: int, phase: str) -> bool:
        """Whether ``rank`` should have reported ``phase``, given its earlier phases."""
        if self.collect_skip(rank) is not None:
            return False
        reports = self.test(rank).reports
        if phase == "setup":
            return True
        if phase == "call":
            setup = reports.get("setup")
            return setup is not None and setup.get("outcome") == "passed"
        return "setup" in reports and ("teardown" in reports or not self.end(rank).held)

    def _rank_timed_out(self, rank: int) -> bool:
        return self.timed_out or self.test(rank).timeout is not None

    def _at(self, rank: int) -> float:
        at = self.end(rank).at
        return float(at) if at else self.job_ended

    def _missing(self, rank: int, phase: str) -> RankIssue:
        end = self.end(rank)
        own = self.test(rank).timeout
        if own is not None:
            seconds = own.get("timeout", self.timeout)
            summary = f"rank {rank} timed out after {seconds:g} s in the {phase} phase"
            if own.get("by") == "msrun":
                summary += " (it could not end itself: msrun found it there)"
            waited = waiting_for_others(own.get("state"), rank, len(self.ranks))
            return RankIssue(rank, "timeout", float(own.get("ts", self._at(rank))), summary, phase=phase, waited=waited)
        if self.timed_out and (end.returncode is None or end.terminated_by_msrun):
            summary = f"rank {rank} was still in the {phase} phase at the timeout ({self.timeout:g} s)"
            summary += self.logs[rank].after_deadline_note(self.nodeid) if rank in self.logs else ""
            return RankIssue(rank, "timeout", self._at(rank), summary, phase=phase)
        log = self.logs.get(rank)
        if end.alive:
            why = "sent no report"
        elif log is not None and log.finished and self.scope == "job":
            why = f"ended its pytest session (exit status {log.exitstatus})"
        else:
            why = "left no record"
        summary = f"rank {rank} {why} during the {phase} phase and {end.describe(False)}"
        return RankIssue(rank, "died", self._at(rank), summary, phase=phase)

    def _stopped(self, rank: int) -> bool:
        end = self.end(rank)
        return end.terminated_by_msrun and not self._rank_timed_out(rank)

    def _end_problem(self, rank: int) -> RankIssue | None:
        """How ``rank``'s process ended badly after it reported every phase it was due (or None)."""
        if rank not in self.final:
            return None
        end, log = self.end(rank), self.logs.get(rank) or RankLog(rank)
        at = self._at(rank)
        if end.alive or end.held:
            return None
        head = f"rank {rank} reported every phase, then"
        if log.exit_hang is not None:
            seconds = float(log.exit_hang.get("grace", 0))
            after = str(log.exit_hang.get("after") or "of its pytest session's end (--msrun-timeout)")
            return RankIssue(
                rank,
                "exit",
                float(log.exit_hang.get("ts", at)),
                f"{head} did not exit within {seconds:g} s {after}: it hangs at exit (a non-daemon thread, "
                f"an atexit handler, a library's finalizer) and {end.describe(False)}",
                phase="teardown",
            )
        if end.returncode is None or (self.timed_out and end.terminated_by_msrun):
            if end.returncode is None and not self.timed_out and end.pid is None:
                return None  # never started: reported where its phases are missing
            return RankIssue(
                rank,
                "exit",
                at,
                f"{head} was still running at the timeout ({self.timeout:g} s): it hangs at exit",
                phase="teardown",
            )
        if end.terminated_by_msrun:
            return None  # excused by the failure that made msrun stop it (or judged below: see verdict)
        code = end.returncode
        if code == 0:
            return None
        if code > 0 and log.finished and code == log.exitstatus:
            if code == 1 and log.reported_failure():
                return None  # pytest's "tests failed": the failure is reported
            if code == 5 and log.collect_skips and not log.collected:
                return None  # pytest's "no tests collected": its module was skipped at collection
        session = f" (its pytest session ended with exit status {log.exitstatus})" if log.finished else ""
        return RankIssue(rank, "exit", at, f"{head} {describe_returncode(code)}{session}", phase="teardown")

    def _stopped_after(self, rank: int) -> bool:
        """Whether msrun stopped ``rank`` after it reported everything (excused only by a failure)."""
        end = self.end(rank)
        return rank in self.final and end.terminated_by_msrun and not self.timed_out and not end.alive

    # ------------------------------------------------------------------ the rule
    def verdict(self) -> TestVerdict:
        issues: dict[str, list[RankIssue]] = {p: [] for p in PHASES}
        stopped: dict[str, list[int]] = {p: [] for p in PHASES}
        present: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in PHASES}
        kinds: dict[int, _Kind] = {}
        stopped_after: list[int] = []
        reached = [r for r in self.ranks if self.reached(r)]
        for rank in reached:
            test = self.test(rank)
            skipped_at_collection = self.collect_skip(rank)
            if skipped_at_collection is not None:
                kinds[rank] = _Kind("skipped", "setup", None, skipped_at_collection)
                continue
            complete = True
            for phase in PHASES:
                if not self.due(rank, phase):
                    continue
                reports = test.all_reports(phase)
                if phase in test.reports:
                    present[phase][rank] = test.reports[phase]
                if phase not in test.reports:
                    self.died_in[rank] = phase
                    complete = False
                    if self._stopped(rank):
                        stopped[phase].append(rank)
                    else:
                        issues[phase].append(self._missing(rank, phase))
                for rep in reports:
                    if rep.get("outcome") == "failed" and not is_strict_xpass(rep):
                        at = float(rep.get("_ts", test.stamps.get(phase, 0.0)))
                        summary = f"rank {rank}: {crash_message(rep)}"
                        issues[phase].append(RankIssue(rank, "failed", at, summary, rep, phase))
                if not complete:
                    break
            if complete:
                problem = self._end_problem(rank)
                if problem is not None:
                    issues["teardown"].append(problem)
                    self.end_issue[rank] = problem
                elif self._stopped_after(rank):
                    stopped_after.append(rank)
            if self.died_in.get(rank) not in ("setup", "call"):
                kind = self._kind(rank)  # from its setup and call alone: teardown and exit do not change it
                if kind is not None:
                    kinds[rank] = kind
        # Every rank's own outcome together - only when every rank has one: a rank that did not
        # finish its setup and call makes the test fail anyway, and nobody knows what it would say.
        merged = self._merge(kinds, present) if set(kinds) == set(reached) else {}
        for phase, together in merged.items():
            issues[phase] += together.issues  # every rank passed a strict xfail
        failing = {p for p in PHASES if issues[p] or (p in merged and merged[p].message)}
        everything = [i for p in PHASES for i in issues[p]]
        if not failing and not self.failed_elsewhere:
            # msrun stopped ranks and nothing reported explains it: the stop is the failure
            for phase in PHASES:
                for rank in stopped[phase]:
                    issues[phase].append(self._unexplained_stop(rank, f"during the {phase} phase"))
                stopped[phase] = []
            for rank in stopped_after:
                issue = self._unexplained_stop(rank, "after its last report")
                issue.kind, issue.phase = "exit", "teardown"
                issues["teardown"].append(issue)
                self.end_issue[rank] = issue
            everything = [i for p in PHASES for i in issues[p]]
            failing = {p for p in PHASES if issues[p]}
        cause = min(everything, key=lambda i: i.at) if everything else None
        if failing:
            self._regroup_stopped(min(failing, key=PHASES.index), stopped)
        phases = self._phases(issues, stopped, present, merged, cause)
        cells = {rank: self.cell(rank, kinds) for rank in self.ranks}
        not_run = [r for r in self.ranks if cells[r] == "not run"]
        verdict = TestVerdict(self.nodeid, phases, cells, self._overall(phases, cells, not_run), not_run)
        return verdict

    @staticmethod
    def _regroup_stopped(first: str, stopped: dict[str, list[int]]) -> None:
        """Excused stopped ranks are shown where the test first failed, so that how far a rank got
        before msrun stopped it does not change the verdict: in that phase when they were stopped
        there or later; in the call when stopped earlier (a rank stopped in its setup did not run
        the call either, so the call cannot pass)."""
        moved: dict[str, list[int]] = {p: [] for p in PHASES}
        for phase in PHASES:
            target = first if PHASES.index(phase) >= PHASES.index(first) else "call"
            moved[target] += stopped[phase]
        for phase in PHASES:
            stopped[phase] = sorted(moved[phase])

    def _unexplained_stop(self, rank: int, when: str) -> RankIssue:
        end = self.end(rank)
        summary = f"rank {rank} was stopped by msrun {when} and {end.describe(False)}"
        return RankIssue(rank, "died", self._at(rank), summary)

    def _kind(self, rank: int) -> _Kind | None:
        """This rank's own outcome when nothing failed on it (None: something did)."""
        test = self.test(rank)
        reports = test.reports
        setup, call = reports.get("setup"), reports.get("call")
        if setup is None or any(
            rep.get("outcome") == "failed" and not is_strict_xpass(rep)
            for phase in ("setup", "call")
            for rep in test.all_reports(phase)
        ):
            return None
        if setup.get("outcome") == "skipped":
            word = "xfailed" if "wasxfail" in setup else "skipped"
            return _Kind(word, "setup", setup, skip_reason(setup))
        if setup.get("outcome") != "passed" or call is None:
            return None
        outcome = call.get("outcome")
        if outcome == "skipped":
            return _Kind("xfailed" if "wasxfail" in call else "skipped", "call", call, skip_reason(call))
        if is_strict_xpass(call):
            return _Kind("xpass_strict", "call", call)
        if outcome == "passed":
            return _Kind("xpassed" if "wasxfail" in call else "passed", "call", call)
        return None

    def _phases(
        self,
        issues: dict[str, list[RankIssue]],
        stopped: dict[str, list[int]],
        present: dict[str, dict[int, dict[str, Any]]],
        merged: dict[str, PhaseVerdict],
        cause: RankIssue | None,
    ) -> list[PhaseVerdict]:
        out: list[PhaseVerdict] = []
        for phase in PHASES:
            own, halted = sorted(issues[phase], key=lambda i: i.at), sorted(stopped[phase])
            message = merged[phase].message if phase in merged else ""
            if phase == "call" and out and out[0].outcome != "passed":
                # The merged setup did not pass, so the test has no call phase; ranks whose own
                # setup passed still ran it, and what went wrong there is part of the failure.
                setup = out[0]
                setup.issues = sorted(setup.issues + own, key=lambda i: i.at)
                setup.stopped = sorted(set(setup.stopped) | set(halted))
                if (own or halted or message) and setup.outcome != "failed":
                    setup.outcome, setup.wasxfail = "failed", None
                setup.message = setup.message or message
                if setup.outcome == "failed" and not setup.issues:
                    setup.cause = cause
                continue
            if own or halted:
                verdict = PhaseVerdict(phase, "failed", present[phase], own, halted, message=message)
                verdict.cause = None if own or message else cause
                out.append(verdict)
                continue
            if phase in merged:
                out.append(merged[phase])
                continue
            if phase == "teardown" and any(r.get("outcome") == "skipped" for r in present[phase].values()):
                # pytest.skip() in a fixture's teardown: pytest reports that teardown as skipped
                # (the test keeps its outcome); so does the merged report, on any rank's word
                out.append(PhaseVerdict(phase, "skipped", present[phase]))
                continue
            if present[phase] or (phase == "setup" and merged):
                out.append(PhaseVerdict(phase, "passed", present[phase]))
        return out

    def _merge(self, kinds: dict[int, _Kind], present: dict[str, dict[int, dict[str, Any]]]) -> dict[str, PhaseVerdict]:
        """The merged outcome of ranks that all completed the test without a failure."""
        if not kinds:
            return {}

        def first(ranks: list[int]) -> int:
            return min(ranks, key=lambda r: (self.test(r).stamps.get(kinds[r].phase, 0.0), r))

        by: dict[str, list[int]] = {}
        for rank, kind in kinds.items():
            by.setdefault(kind.word, []).append(rank)
        skipped = by.get("skipped", [])
        ran = [r for r in kinds if r not in skipped]
        if skipped and ran:
            phase = "setup" if any(kinds[r].phase == "setup" for r in skipped) else "call"
            reasons: dict[str, list[int]] = {}
            for r in skipped:
                reasons.setdefault(kinds[r].reason, []).append(r)
            why = (
                next(iter(reasons))
                if len(reasons) == 1
                else "; ".join(f"ranks {ranks_text(rs)}: {reason}" for reason, rs in reasons.items())
            )
            message = (
                f"skipped on ranks {ranks_text(skipped)} ({why}) but ran on ranks "
                f"{ranks_text(ran)}: a test must skip on every rank or on none"
            )
            return {phase: PhaseVerdict(phase, "failed", present[phase], message=message)}
        if skipped:
            phase = "setup" if any(kinds[r].phase == "setup" for r in skipped) else "call"
            lowest = min(r for r in skipped if kinds[r].phase == phase)
            return {phase: PhaseVerdict(phase, "skipped", present[phase], skip_reason=kinds[lowest].reason)}
        if by.get("xfailed"):
            phase = "setup" if any(kinds[r].phase == "setup" for r in by["xfailed"]) else "call"
            rank = first([r for r in by["xfailed"] if kinds[r].phase == phase])
            report = kinds[rank].report or {}
            return {phase: PhaseVerdict(phase, "skipped", present[phase], wasxfail=str(report.get("wasxfail", "")))}
        if len(by.get("xpass_strict", [])) == len(kinds):  # pytest's own failure, from the lowest rank
            rank = min(kinds)
            report = kinds[rank].report or {}
            issue = RankIssue(
                rank, "failed", self.test(rank).stamps.get("call", 0.0), f"rank {rank}: {crash_message(report)}", report
            )
            return {"call": PhaseVerdict("call", "failed", present["call"], [issue])}
        if by.get("xpassed") or by.get("xpass_strict"):
            rank = min(by.get("xpassed", []) or by["xpass_strict"])
            report = kinds[rank].report or {}
            reason = str(report.get("wasxfail", "")) or _longrepr_text(report)[len(STRICT_XPASS) :].strip()
            return {"call": PhaseVerdict("call", "passed", present["call"], wasxfail=reason)}
        return {}

    def _overall(self, phases: list[PhaseVerdict], cells: dict[int, str], not_run: list[int]) -> str:
        if not phases:
            return "not run"
        by = {p.phase: p for p in phases}
        failed = [p for p in phases if p.outcome == "failed"]
        if failed and not any(p.issues or p.message for p in failed):
            return "incomplete"  # only ranks msrun stopped, excused by a failure reported elsewhere
        for phase, word in (("setup", "error"), ("call", "failed"), ("teardown", "error")):
            if phase in by and by[phase].outcome == "failed":
                return word
        if not_run or any(c.startswith("stopped") for c in cells.values()):
            return "incomplete"
        main = by.get("call") or by["setup"]
        if main.wasxfail is not None:
            return "xfailed" if main.outcome == "skipped" else "xpassed"
        return main.outcome

    def cell(self, rank: int, kinds: dict[int, _Kind]) -> str:
        """This rank's own outcome for the test, in a word or two: its first problem, phase by phase."""
        if not self.reached(rank):
            return "not run"
        if self.collect_skip(rank) is not None:
            return "skipped"
        test = self.test(rank)
        died = self.died_in.get(rank)
        for phase in PHASES:
            for report in test.all_reports(phase):
                if report.get("outcome") == "failed" and not is_strict_xpass(report):
                    return "failed" if phase == "call" else "error"
            if died == phase:
                return self._died_cell(rank)
        end = self.end_issue.get(rank)
        if end is not None:
            return self._exit_cell(rank)
        kind = kinds.get(rank)
        if kind is None:
            return "incomplete"
        return _WORDS[kind.word]  # stopped after its last report by a failure elsewhere: excused

    def _exit_cell(self, rank: int) -> str:
        log = self.logs.get(rank) or RankLog(rank)
        end = self.end(rank)
        if log.exit_hang is not None or end.returncode is None or self.timed_out:
            return "hung at exit"
        if end.terminated_by_msrun:
            return "stopped at exit"
        return f"{self._crash_word(end.returncode)} at exit"

    def _died_cell(self, rank: int) -> str:
        if self._rank_timed_out(rank):
            return "timeout"
        if self._stopped(rank):
            return "stopped"
        end = self.end(rank)
        if end.returncode is None:
            return "no record"
        return self._crash_word(end.returncode)

    @staticmethod
    def _crash_word(code: int) -> str:
        if code < 0:
            import signal

            try:
                return f"crashed ({signal.Signals(-code).name})"
            except ValueError:
                return f"crashed (signal {-code})"
        return f"crashed (exit {code})"


_WORDS = {
    "skipped": "skipped",
    "xfailed": "xfailed",
    "xpassed": "xpassed",
    "xpass_strict": "xpassed(strict)",
    "passed": "passed",
}


def check_invariant(verdict: TestVerdict, judge: Judge) -> None:
    """Raise if ``verdict`` calls a test passing that the invariant forbids (see the module doc)."""
    if not verdict.passing:
        return
    for rank in judge.ranks:
        if not judge.reached(rank) or judge.collect_skip(rank) is not None:
            continue
        if rank in judge.died_in or rank in judge.end_issue:
            raise AssertionError(f"{verdict.nodeid}: {verdict.outcome} although rank {rank} did not finish cleanly")
        for phase in PHASES:
            if judge.due(rank, phase) and phase not in judge.test(rank).reports:
                raise AssertionError(f"{verdict.nodeid}: {verdict.outcome} without rank {rank}'s {phase} report")
            for report in judge.test(rank).all_reports(phase):
                if report.get("outcome") == "failed" and not is_strict_xpass(report):
                    raise AssertionError(f"{verdict.nodeid}: {verdict.outcome} although rank {rank} failed {phase}")


def judge(nodeid: str, ranks: list[int], logs: dict[int, RankLog], ends: dict[int, RankEnd], **kw: Any) -> TestVerdict:
    """The verdict of one test (see the module doc); its invariant is checked before it is returned."""
    rule = Judge(nodeid, ranks, logs, ends, **kw)
    verdict = rule.verdict()
    check_invariant(verdict, rule)
    return verdict
