"""What one test's record says about each rank: which test it ran, how its process ended, what
it was due to report, what is missing and why, how its process end answers for the test.

The facts the verdict rule (:mod:`.verdict`) is built on, kept apart from it so that the invariant
check can read the record without the rule's own state.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from pytest_msrun.control.observer import waiting_for_others
from pytest_msrun.engine.processes import describe_returncode
from pytest_msrun.plugin.rule.outcomes import RankEnd, RankIssue, Refusal, was
from pytest_msrun.plugin.rule.records import RankLog, RankTest


@dataclass
class RankFacts:
    """What the record of one test says about each rank - read by the rule (:class:`~.verdict.Judge`)
    and, independently of it, by the invariant check.

    ``scope`` is ``job`` (the ranks were started for this test) or ``suite`` (every rank runs a
    whole suite); ``final`` the ranks whose process end answers to this test (default: all);
    ``timed_out`` says the test ran out of time; ``failed_elsewhere`` that a failure outside this
    test (another test of the suite) is reported, which excuses ranks msrun stopped."""

    nodeid: str
    ranks: list[int]
    logs: dict[int, RankLog]
    ends: dict[int, RankEnd]
    scope: str = "job"
    timed_out: bool = False
    timeout: float = 0.0
    job_ended: float = 0.0
    final: Collection[int] | None = None
    failed_elsewhere: bool = False
    leaks: dict[int, list[str]] = field(default_factory=dict)  # as failures (--msrun-leaks=error)
    refusal: Refusal | None = None  # the job never ran: a bad marker, a skip, no room, msrun's launch error
    running: Collection[int] = ()
    answering: set[int] = field(init=False)  # ``final``, or every rank

    def __post_init__(self) -> None:
        self.answering = set(self.ranks if self.final is None else self.final)
        self.leaks = {r: list(items) for r, items in self.leaks.items() if items}
        self.running = frozenset(self.running) if self.timed_out else frozenset()

    # ------------------------------------------------------------------ facts per rank
    def test(self, rank: int) -> RankTest:
        return self.logs[rank].test(self.nodeid) if rank in self.logs else RankTest(self.nodeid)

    def end(self, rank: int) -> RankEnd:
        """How ``rank``'s process ended, as the record stood at the deadline (see ``running``)."""
        end = self.ends.get(rank) or RankEnd()
        if rank in self.running and end.returncode is not None and not end.terminated_by_msrun:
            return RankEnd(pid=end.pid, log=end.log, host=end.host, held=end.held, after=end.describe(False))
        return end

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
        """Whether ``rank`` (not skipped at collection) should have reported ``phase``, given its earlier phases."""
        reports = self.test(rank).reports
        if phase == "setup":
            return True
        if phase == "call":
            return (reports.get("setup") or {}).get("outcome") == "passed"
        return "setup" in reports and ("teardown" in reports or not self.end(rank).held)

    def rank_timed_out(self, rank: int) -> bool:
        return self.timed_out or self.test(rank).timeout is not None

    def end_at(self, rank: int) -> float:
        end = self.end(rank)  # when it ended, as well as it is known: its crash, else its reaping
        at = end.died_at if end.died_at is not None else end.ended
        return float(at) if at else self.job_ended

    def missing(self, rank: int, phase: str) -> RankIssue:
        end = self.end(rank)
        own = self.test(rank).timeout
        if own is not None:
            seconds = own.get("timeout", self.timeout)
            summary = f"rank {rank} timed out after {seconds:g} s in the {phase} phase"
            if own.get("by") == "msrun":
                summary += " (it could not end itself: msrun found it there)"
            waited = waiting_for_others(own.get("state"), rank, len(self.ranks))
            at = float(own.get("ts", self.end_at(rank)))
            return RankIssue(rank, "timeout", at, summary, phase=phase, waited=waited)
        if self.timed_out and (end.returncode is None or end.terminated_by_msrun):
            summary = f"rank {rank} was still in the {phase} phase at the timeout ({self.timeout:g} s)"
            summary += self.logs[rank].after_deadline_note(self.nodeid) if rank in self.logs else ""
            return RankIssue(rank, "timeout", self.end_at(rank), summary, phase=phase)
        log = self.logs.get(rank)
        if end.alive:
            why = "sent no report"
        elif log is not None and log.finished and self.scope == "job":
            why = f"ended its pytest session (exit status {log.exitstatus})"
        else:
            why = "left no record"
        summary = f"rank {rank} {why} during the {phase} phase and {was(end.describe(False))}"
        return RankIssue(rank, "died", self.end_at(rank), summary, phase=phase)

    def stopped_by_msrun(self, rank: int) -> bool:
        return self.end(rank).terminated_by_msrun and not self.rank_timed_out(rank)

    def end_problem(self, rank: int) -> RankIssue | None:
        """How ``rank``'s process ended badly after it reported every phase it was due (or None)."""
        if rank not in self.answering:
            return None
        end, log = self.end(rank), self.logs.get(rank) or RankLog(rank)
        at = self.end_at(rank)
        if end.alive or end.held:
            return None

        def ended(when: float, how: str) -> RankIssue:
            return RankIssue(rank, "exit", when, f"rank {rank} reported every phase, then {how}", phase="teardown")

        if log.exit_hang is not None:
            seconds = float(log.exit_hang.get("grace", 0))
            after = str(log.exit_hang.get("after") or "of its pytest session's end (--msrun-timeout)")
            how = (
                f"did not exit within {seconds:g} s {after}: it hangs at exit (a non-daemon thread, "
                f"an atexit handler, a library's finalizer) and {end.describe(False)}"
            )
            return ended(float(log.exit_hang.get("ts", at)), how)
        if end.returncode is None or (self.timed_out and end.terminated_by_msrun):
            if end.returncode is None and not self.timed_out and end.pid is None:
                return None  # never started: reported where its phases are missing
            return ended(at, f"was still running at the timeout ({self.timeout:g} s): it hangs at exit")
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
        return ended(at, f"{describe_returncode(code)}{session}")

    def stopped_after(self, rank: int) -> bool:
        """Whether msrun stopped ``rank`` after it reported everything (excused only by a failure)."""
        end = self.end(rank)
        return rank in self.answering and end.terminated_by_msrun and not self.timed_out and not end.alive

    def unexplained_stop(self, rank: int, when: str) -> RankIssue:
        end = self.end(rank)
        summary = f"rank {rank} was stopped by msrun {when} and {end.describe(False)}"
        return RankIssue(rank, "died", self.end_at(rank), summary)
