"""One verdict rule for a test that ran on several ranks - fresh jobs, warm worlds and suite mode alike.

The verdict is a pure function of a complete record: every report of every phase each rank wrote
(subtests and a warm world's final fixture teardown included), how each rank's process ended
(:class:`RankEnd`: exit status or signal, when, whether msrun stopped it and why, or that it lives
on in a warm world), and the job's end (a timeout). Its invariant, checked before any report is
built (:func:`invariant_breach`, which fails a breaking verdict closed)::

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

from dataclasses import dataclass, replace
from typing import Any

from pytest_msrun.plugin.rule.outcomes import (
    STRICT_XPASS,
    PhaseVerdict,
    RankEnd,
    RankIssue,
    TestVerdict,
    crash_message,
    fails,
    longrepr_text,
    ranks_text,
)
from pytest_msrun.plugin.rule.rankfacts import RankFacts
from pytest_msrun.plugin.rule.records import PHASES, RankLog

CLUSTER_ERRORS = ("ClusterError", "ClusterAborted")  # pytest_msrun.cluster's: a peer left, the job aborts


@dataclass
class _Kind:
    """A rank's own outcome of a test it completed without a failure."""

    word: str  # skipped | xfailed | xpassed | xpass_strict | passed
    phase: str  # the phase it is decided in
    report: dict[str, Any] | None  # that phase's report (None: skipped at collection)
    reason: str = ""


class Judge:
    """Applies the rule to one test, on the facts of its record (``facts``, which the invariant
    check reads on its own)."""

    def __init__(self, facts: RankFacts) -> None:
        self.facts = facts
        self.died_in: dict[int, str] = {}
        self.end_issue: dict[int, RankIssue] = {}

    # ------------------------------------------------------------------ the rule
    def verdict(self) -> TestVerdict:
        refusal = self.facts.refusal
        if refusal is not None:  # nothing ran: the setup's outcome is the refusal's, its reason the message
            phases = [PhaseVerdict("setup", refusal.outcome, {}, message=refusal.reason)]
            outcome, cell = ("skipped", "skipped") if refusal.outcome == "skipped" else ("error", "not run")
            cells = dict.fromkeys(self.facts.ranks, cell)
            not_run = [] if outcome == "skipped" else list(self.facts.ranks)
            return TestVerdict(self.facts.nodeid, phases, cells, outcome, not_run, refusal=refusal)
        issues: dict[str, list[RankIssue]] = {p: [] for p in PHASES}
        stopped: dict[str, list[int]] = {p: [] for p in PHASES}
        present: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in PHASES}
        kinds: dict[int, _Kind] = {}
        stopped_after: list[int] = []
        reached = [r for r in self.facts.ranks if self.facts.reached(r)]
        for rank in reached:
            test = self.facts.test(rank)
            skipped_at_collection = self.facts.collect_skip(rank)
            if skipped_at_collection is not None:
                kinds[rank] = _Kind("skipped", "setup", None, skipped_at_collection)
                continue
            for phase in PHASES:
                if not self.facts.due(rank, phase):
                    continue
                if phase in test.reports:
                    present[phase][rank] = test.reports[phase]
                else:
                    self.died_in[rank] = phase
                    if self.facts.stopped_by_msrun(rank):
                        stopped[phase].append(rank)
                    else:
                        issues[phase].append(self.facts.missing(rank, phase))
                for rep in test.all_reports(phase):
                    if fails(rep):
                        at = float(rep.get("_ts", test.stamps.get(phase, 0.0)))
                        summary = f"rank {rank}: {crash_message(rep)}"
                        issues[phase].append(RankIssue(rank, "failed", at, summary, rep, phase))
                if rank in self.died_in:
                    break
            if rank not in self.died_in:  # it reported every phase it was due
                problem = self.facts.end_problem(rank)
                if problem is not None:
                    issues["teardown"].append(problem)
                    self.end_issue[rank] = problem
                elif self.facts.stopped_after(rank):
                    stopped_after.append(rank)
            if self.died_in.get(rank) not in ("setup", "call"):
                kind = self._kind(rank)  # from its setup and call alone: teardown and exit do not change it
                if kind is not None:
                    kinds[rank] = kind
        for rank, items in sorted(self.facts.leaks.items()):  # --msrun-leaks=error: what a test left fails its teardown
            what = "; ".join(items)
            summary = (
                f"rank {rank} left behind in its warm world: {what} (--msrun-leaks=error; isolated=True runs "
                "the test in processes of its own)"
            )
            issues["teardown"].append(RankIssue(rank, "leak", self.facts.job_ended, summary, phase="teardown"))
        # Every rank's own outcome together - only when every rank has one: a rank that did not
        # finish its setup and call makes the test fail anyway, and nobody knows what it would say.
        merged = self._merge(kinds, present) if set(kinds) == set(reached) else {}
        for phase, together in merged.items():
            issues[phase] += together.issues  # every rank passed a strict xfail
        failing = {p for p in PHASES if issues[p] or (p in merged and merged[p].message)}
        if not failing and not self.facts.failed_elsewhere:
            # msrun stopped ranks and nothing reported explains it: the stop is the failure
            for phase in PHASES:
                for rank in stopped[phase]:
                    issues[phase].append(self.facts.unexplained_stop(rank, f"during the {phase} phase"))
                stopped[phase] = []
            for rank in stopped_after:
                issue = self.facts.unexplained_stop(rank, "after its last report")
                issue.kind, issue.phase = "exit", "teardown"
                issues["teardown"].append(issue)
                self.end_issue[rank] = issue
            failing = {p for p in PHASES if issues[p]}
        cause = min((i for p in PHASES for i in issues[p]), key=lambda i: i.at, default=None)
        if failing:
            self._regroup_stopped(min(failing, key=PHASES.index), stopped)
        phases = self._phases(issues, stopped, present, merged, cause)
        cells = {rank: self.cell(rank, kinds) for rank in self.facts.ranks}
        not_run = [r for r in self.facts.ranks if cells[r] == "not run"]
        verdict = TestVerdict(self.facts.nodeid, phases, cells, self._overall(phases, cells, not_run), not_run)
        return self._blame_an_earlier_test(verdict)

    def _blame_an_earlier_test(self, verdict: TestVerdict) -> TestVerdict:
        """Suite mode: a test whose only failures are ranks waiting for the others - the cluster
        API's errors, or a timeout in a collective they waited in - while those others never began
        it, their process having ended in an earlier test (reported failed there), is incomplete
        here, not failed: that earlier test is the failure. Part of the rule, applied once."""
        if self.facts.scope != "suite" or verdict.outcome not in ("failed", "error") or not verdict.not_run:
            return verdict
        issues = verdict.issues
        if not issues or not all(self._only_waited(issue) for issue in issues):
            return verdict
        gone = [r for r in verdict.not_run if self.facts.end(r).returncode is not None]
        if gone != verdict.not_run:
            return verdict
        where = sorted(
            {str(self.facts.logs[r].last_test) for r in gone if r in self.facts.logs and self.facts.logs[r].last_test}
        )
        note = (
            f"ranks {ranks_text(verdict.failing_ranks)} failed only waiting for ranks {ranks_text(gone)}, "
            "which had ended" + (f" in {', '.join(where)}" if where else "")
        )
        return replace(verdict, outcome="incomplete", note=note)

    def _only_waited(self, issue: RankIssue) -> bool:
        if issue.kind == "failed":  # the cluster API's errors; a collective a peer left cannot complete
            left = "CollectiveDeadlock" in issue.summary and " left the job" in issue.summary
            return left or any(e in issue.summary for e in CLUSTER_ERRORS)
        return issue.kind == "timeout" and issue.waited

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

    def _kind(self, rank: int) -> _Kind | None:
        """This rank's own outcome when nothing failed on it (None: something did)."""
        test = self.facts.test(rank)
        setup, call = test.reports.get("setup"), test.reports.get("call")
        if setup is None or any(fails(rep) for phase in ("setup", "call") for rep in test.all_reports(phase)):
            return None
        phase, report = ("setup", setup) if setup.get("outcome") != "passed" else ("call", call or {})
        outcome = report.get("outcome")
        if outcome == "skipped":  # a setup that did not pass skipped (a failed one was checked above)
            return _Kind("xfailed" if "wasxfail" in report else "skipped", phase, report, longrepr_text(report))
        if outcome == "failed":  # not a failure (checked above): a strict xfail that passed
            return _Kind("xpass_strict", "call", report)
        if outcome == "passed":
            return _Kind("xpassed" if "wasxfail" in report else "passed", "call", report)
        return None  # no call report (it died in its call)

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
                joined = sorted(setup.issues + own, key=lambda i: i.at)
                fails_now = bool(own or halted or message) and setup.outcome != "failed"
                outcome = "failed" if fails_now else setup.outcome
                out[0] = replace(
                    setup,
                    issues=joined,
                    stopped=sorted(set(setup.stopped) | set(halted)),
                    outcome=outcome,
                    wasxfail=None if fails_now else setup.wasxfail,
                    message=setup.message or message,
                    cause=cause if outcome == "failed" and not joined else setup.cause,
                )
                continue
            if own or halted:
                shown = None if own or message else cause
                out.append(PhaseVerdict(phase, "failed", present[phase], own, halted, message=message, cause=shown))
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

        by: dict[str, list[int]] = {}
        for rank, kind in kinds.items():
            by.setdefault(kind.word, []).append(rank)

        def decided_in(ranks: list[int]) -> str:
            return "setup" if any(kinds[r].phase == "setup" for r in ranks) else "call"

        skipped = by.get("skipped", [])
        ran = [r for r in kinds if r not in skipped]
        if skipped and ran:
            phase = decided_in(skipped)
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
            phase = decided_in(skipped)
            lowest = min(r for r in skipped if kinds[r].phase == phase)
            return {phase: PhaseVerdict(phase, "skipped", present[phase], skip_reason=kinds[lowest].reason)}
        if by.get("xfailed"):
            phase = decided_in(by["xfailed"])
            xfailed = [r for r in by["xfailed"] if kinds[r].phase == phase]
            rank = min(xfailed, key=lambda r: (self.facts.test(r).stamps.get(phase, 0.0), r))
            report = kinds[rank].report or {}
            return {phase: PhaseVerdict(phase, "skipped", present[phase], wasxfail=str(report.get("wasxfail", "")))}
        if len(by.get("xpass_strict", [])) == len(kinds):  # pytest's own failure, from the lowest rank
            rank = min(kinds)
            report = kinds[rank].report or {}
            at = self.facts.test(rank).stamps.get("call", 0.0)
            issue = RankIssue(rank, "failed", at, f"rank {rank}: {crash_message(report)}", report)
            return {"call": PhaseVerdict("call", "failed", present["call"], [issue])}
        if by.get("xpassed") or by.get("xpass_strict"):
            rank = min(by.get("xpassed", []) or by["xpass_strict"])
            report = kinds[rank].report or {}
            reason = str(report.get("wasxfail", "")) or longrepr_text(report)[len(STRICT_XPASS) :].strip()
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
        if not self.facts.reached(rank):
            return "not run"
        if self.facts.collect_skip(rank) is not None:
            return "skipped"
        test = self.facts.test(rank)
        died = self.died_in.get(rank)
        for phase in PHASES:
            if any(fails(report) for report in test.all_reports(phase)):
                return "failed" if phase == "call" else "error"
            if died == phase:
                return self._died_cell(rank)
        if rank in self.end_issue:
            return self._exit_cell(rank)
        if rank in self.facts.leaks:
            return "error"
        kind = kinds.get(rank)
        if kind is None:
            return "incomplete"
        # stopped after its last report by a failure elsewhere: excused
        return "xpassed(strict)" if kind.word == "xpass_strict" else kind.word

    def _exit_cell(self, rank: int) -> str:
        log = self.facts.logs.get(rank) or RankLog(rank)
        end = self.facts.end(rank)
        if log.exit_hang is not None or end.returncode is None or self.facts.timed_out:
            return "hung at exit"
        if end.terminated_by_msrun:
            return "stopped at exit"
        return f"{self._crash_word(end.returncode)} at exit"

    def _died_cell(self, rank: int) -> str:
        if self.facts.rank_timed_out(rank):
            return "timeout"
        if self.facts.stopped_by_msrun(rank):
            return "stopped"
        code = self.facts.end(rank).returncode
        return "no record" if code is None else self._crash_word(code)

    @staticmethod
    def _crash_word(code: int) -> str:
        if code < 0:
            import signal

            try:
                return f"crashed ({signal.Signals(-code).name})"
            except ValueError:
                return f"crashed (signal {-code})"
        return f"crashed (exit {code})"


def invariant_breach(verdict: TestVerdict, facts: RankFacts) -> str:
    """Why ``verdict`` breaks the invariant ("" when it holds), read from the record's facts alone
    (not the rule's state): a passing outcome needs every reached rank's due phases reported,
    none failed, no timeout, and a clean process end (see the module doc)."""
    if not verdict.passing:
        return ""
    if facts.refusal is not None:  # no rank ran: only a skip passes
        skipped = (facts.refusal.outcome, verdict.outcome) == ("skipped", "skipped")
        return "" if skipped else f"although its job never ran ({facts.refusal.reason})"
    if facts.leaks:
        return f"although ranks {ranks_text(sorted(facts.leaks))} left things behind (--msrun-leaks=error)"
    for rank in facts.ranks:
        if not facts.reached(rank) or facts.collect_skip(rank) is not None:
            continue
        test = facts.test(rank)
        for phase in PHASES:
            if facts.due(rank, phase) and phase not in test.reports:
                return f"without rank {rank}'s {phase} report"
            if any(fails(r) for r in test.all_reports(phase)):
                return f"although rank {rank} failed its {phase}"
        if test.timeout is not None:
            return f"although rank {rank} ran out of time"
        problem = facts.end_problem(rank)
        if problem is not None:
            return f"although {problem.summary}"
        if facts.stopped_after(rank) and not facts.failed_elsewhere:
            return f"although msrun stopped rank {rank} with no failure reported"
    return ""


def _closed(verdict: TestVerdict, breach: str) -> TestVerdict:
    """A verdict that broke the invariant fails instead (closed, in every mode), saying why."""
    message = (
        f"msrun: the verdict rule called this test {verdict.outcome} {breach}; it is reported as an error "
        "instead (a bug in pytest-msrun: please report it)"
    )
    phases = [p for p in verdict.phases if p.phase != "teardown"]
    teardown = next((p for p in verdict.phases if p.phase == "teardown"), None)
    present = teardown.present if teardown is not None else {}
    phases.append(PhaseVerdict("teardown", "failed", present, message=message))
    return TestVerdict(verdict.nodeid, phases, verdict.cells, "error", verdict.not_run, note=message)


def judge(nodeid: str, ranks: list[int], logs: dict[int, RankLog], ends: dict[int, RankEnd], **kw: Any) -> TestVerdict:
    """The verdict of one test (see the module doc); one that breaks the invariant is failed closed."""
    facts = RankFacts(nodeid, ranks, logs, ends, **kw)
    verdict = Judge(facts).verdict()
    breach = invariant_breach(verdict, facts)
    return _closed(verdict, breach) if breach else verdict
