"""Fold every rank's records into one pytest report per phase (the rule is :mod:`.verdict`'s).

This module only presents the verdict: the first failure's own traceback under a headline that
names its rank, the other failing and stopped ranks, every rank's captured output (a crashed
rank's from its log), log paths, a grouped hang diagnosis on a timeout, and the command that
reproduces the job. Phase durations add up to the job's wall time, launch included.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import pytest
from _pytest._code.code import ReprFileLocation, TerminalRepr

from pytest_msrun.plugin.reports.excerpts import log_excerpt, stack_excerpt
from pytest_msrun.plugin.reports.extras import carried_attributes, merge_properties
from pytest_msrun.plugin.reports.hang import diagnosis
from pytest_msrun.plugin.rule.outcomes import PhaseVerdict, RankEnd, RankIssue, Refusal, TestVerdict, ranks_text, were
from pytest_msrun.plugin.rule.records import stacks_path
from pytest_msrun.plugin.rule.testrecord import TestRecord
from pytest_msrun.plugin.stdstreams import read_log, tag_lines

MAX_RANK_SECTIONS = 8  # per-rank sections shown in a report; big dry runs list the rest compactly
PDB_NOTE = (
    "--pdb stops each failing rank in pdb on the controller's terminal (prompt '(Pdb rank N)'); without one "
    "(stdin not a tty) it says so and goes on. --msrun-inprocess is no substitute here: it runs the test as "
    "rank 0 of a one-rank world, where another rank's failure does not happen."
)


class MergedLongrepr(TerminalRepr):
    """A headline, the first failing rank's own failure representation, then labelled sections."""

    def __init__(self, headline: str, root: Any, sections: list[tuple[str, str]], reprcrash: Any) -> None:
        self.headline = headline
        self.root = root
        self.extra = sections
        self.reprcrash = reprcrash

    def toterminal(self, tw: Any) -> None:
        if self.headline:
            tw.line(self.headline, red=True, bold=True)
        if self.root is not None:
            if hasattr(self.root, "toterminal"):
                self.root.toterminal(tw)
            else:
                for line in str(self.root).splitlines():
                    tw.line(line)
        for title, text in self.extra:
            tw.sep("-", title)
            for line in text.rstrip("\n").splitlines():
                tw.line(line)


class TextLongrepr(TerminalRepr):
    """A merged failure after a trip through JSON: its text, and the one-line failure it had."""

    def __init__(self, text: str, reprcrash: ReprFileLocation | None) -> None:
        self.text = text
        self.reprcrash = reprcrash

    def __str__(self) -> str:
        return self.text

    def toterminal(self, tw: Any) -> None:
        for line in self.text.splitlines():
            tw.line(line)


def to_serializable(report: pytest.TestReport) -> dict[str, Any]:
    """pytest's own JSON of ``report`` (its failure as text), with the failure's one line beside it."""
    data = report._to_json()
    data["$report_type"] = "TestReport"
    crash = getattr(report.longrepr, "reprcrash", None)
    if isinstance(crash, ReprFileLocation):
        data["msrun_reprcrash"] = dataclasses.asdict(crash)
    return data


def from_record(config: pytest.Config, data: Mapping[str, Any]) -> Any:
    """pytest's report of a rank's record (None: this pytest cannot read it), converted from a copy
    (pytest's conversion changes the dict)."""
    try:
        return config.hook.pytest_report_from_serializable(config=config, data=copy.deepcopy(dict(data)))
    except Exception:
        return None


def from_serializable(data: dict[str, Any]) -> pytest.TestReport:
    data = {k: v for k, v in data.items() if k != "$report_type"}
    crash = data.pop("msrun_reprcrash", None)
    report = pytest.TestReport._from_json(data)
    if isinstance(crash, dict) and isinstance(report.longrepr, str):
        try:
            location = ReprFileLocation(
                path=str(crash.get("path", "")),
                lineno=int(crash.get("lineno") or 0),
                message=str(crash.get("message", "")),
            )
        except (TypeError, ValueError):
            location = None
        report.longrepr = TextLongrepr(report.longrepr, location)
    return report


class Merger:
    """Builds the merged reports of one item from its record and verdict. ``rerun``: the attempt's
    number when it may run again - its reports carry it, and a failed one is built as "rerun" (as
    pytest-rerunfailures reports an attempt it repeats)."""

    def __init__(self, item: pytest.Item, record: TestRecord, style: str, cwd: str, rerun: int | None = None) -> None:
        self.item = item
        self.attempt_no = rerun
        self.config = item.config
        self.run = record.run
        self.logs = record.logs
        self.ranks = record.ranks
        self.style = style
        self.reproduce = record.run.reproduce(cwd)
        self.log_dir = record.log_dir
        self.own_logs = record.own_logs
        self.capture = getattr(self.config.option, "capture", "fd") != "no"
        self._reports: dict[int, pytest.TestReport | None] = {}

    # ------------------------------------------------------------------ facts per rank
    def end(self, rank: int) -> RankEnd:
        return self.run.ranks.get(rank) or RankEnd()

    def _hosts(self) -> dict[int, str]:
        """Each rank's host when the job ran on more than one host or on another (a Slurm step's
        node), else nothing."""
        hosts = {r: end.host for r, end in sorted(self.run.ranks.items()) if end.host}
        elsewhere = any(end.elsewhere for end in self.run.ranks.values())
        return hosts if len(set(hosts.values())) > 1 or elsewhere else {}

    def log_path(self, rank: int) -> str:
        """The rank's whole log (a warm world's: every test of the world)."""
        return self.end(rank).log or self.logs[rank].log or os.path.join(self.log_dir, f"worker_{rank}.log")

    def shown_log(self, rank: int) -> str:
        """The log a report names: the test's own part of it in a warm world, else the whole log."""
        return self.own_logs.get(rank) or self.log_path(rank)

    def _report(self, data: dict[str, Any]) -> pytest.TestReport | None:
        """The TestReport of a record (converted once: pytest's conversion changes the dict)."""
        key = id(data)
        if key not in self._reports:  # a record this pytest cannot read counts as missing
            report = from_record(self.config, data)
            self._reports[key] = report if isinstance(report, pytest.TestReport) else None
        return self._reports[key]

    def _stack(self, rank: int, dump: str) -> str:
        """The frames that matter of ``rank``'s stack dump, naming the file that keeps them all."""
        source = stacks_path(self.run.stacks_dir, rank) if self.run.stacks_dir else ""
        return stack_excerpt(dump, self.logs[rank].main_thread if rank in self.logs else None, source)

    def _issue_text(self, issue: RankIssue) -> str:
        if issue.report is not None:
            report = self._report(issue.report)
            return report.longreprtext if report is not None else issue.summary
        log = self.logs[issue.rank]
        if log.collect_errors and issue.kind == "died":
            texts = [getattr(from_record(self.config, data), "longreprtext", "") for data in log.collect_errors]
            return f"rank {issue.rank}: collection failed\n" + "\n".join(texts)
        text = issue.summary + "\n" + log_excerpt(self.log_path(issue.rank))
        hang = log.exit_hang or {}
        if issue.kind == "exit" and hang.get("stack"):
            text += f"\nstack of rank {issue.rank} when it did not exit:\n{self._stack(issue.rank, hang['stack'])}"
        elif issue.rank in self.run.stacks:
            when = "when it did not exit" if issue.kind == "exit" else "at the timeout"
            text += f"\nstack of rank {issue.rank} {when}:\n{self._stack(issue.rank, self.run.stacks[issue.rank])}"
        return text

    def _issue_summary(self, issue: RankIssue) -> str:
        if issue.report is None and issue.kind == "died" and self.logs[issue.rank].collect_errors:
            return f"rank {issue.rank}: collection failed"
        return issue.summary

    def _died_output(self, rank: int, phase: str) -> str:
        """What a rank that left no report wrote during ``phase`` (from its log)."""
        start = self.logs[rank].test(self.item.nodeid).started.get(phase)
        if start is None or start.offset is None:
            return ""
        return read_log(self.log_path(rank), start.offset)

    # ------------------------------------------------------------------ merging
    def reports(self, verdict: TestVerdict, phases: tuple[str, ...]) -> list[pytest.TestReport]:
        """The merged reports of ``phases`` (a refusal: its setup's, and a teardown with nothing to do)."""
        if verdict.refusal is not None:
            return [self._refused(verdict.refusal, phase) for phase in phases if phase != "call"]
        windows = self._windows(verdict)
        return [self._phase_report(p, windows[p.phase]) for p in verdict.phases if p.phase in phases]

    def _windows(self, verdict: TestVerdict) -> dict[str, tuple[float, float]]:
        """Each merged phase's (start, stop): from the job's start to the last rank leaving the
        phase; the last phase ends when the job ended - so durations include launch and shutdown."""
        out: dict[str, tuple[float, float]] = {}
        begin = self.run.started
        for i, phase in enumerate(verdict.phases):
            stops = [float(rep.get("stop", 0.0)) for rep in phase.present.values() if rep.get("stop")]
            missing = any(issue.report is None for issue in phase.issues) or bool(phase.stopped)
            last = i == len(verdict.phases) - 1
            end = self.run.ended if (last or missing or not stops) else max(stops)
            end = max(end, begin)
            out[phase.phase] = (begin, end)
            begin = end
        return out

    def _phase_report(self, phase: PhaseVerdict, window: tuple[float, float]) -> pytest.TestReport:
        present = {r: rep for r, d in phase.present.items() if (rep := self._report(d)) is not None}
        if phase.outcome == "failed":
            return self._failed(phase, present, window)
        if phase.wasxfail is not None and phase.outcome == "skipped":
            first = min(
                (r for r, rep in present.items() if rep.skipped and hasattr(rep, "wasxfail")),
                key=lambda r: self.logs[r].test(self.item.nodeid).stamps.get(phase.phase, 0.0),
            )
            return self._make(phase.phase, "skipped", present[first].longrepr, present, window, wasxfail=phase.wasxfail)
        if phase.wasxfail is not None:
            return self._make(phase.phase, "passed", None, present, window, wasxfail=phase.wasxfail)
        if phase.outcome == "skipped":
            skipped = [r for r, rep in present.items() if rep.skipped]
            if skipped:
                return self._make(phase.phase, "skipped", present[min(skipped)].longrepr, present, window)
            return self._make(phase.phase, "skipped", self._skip_at(phase.skip_reason), present, window)
        return self._make(phase.phase, "passed", None, present, window)

    def _sections(self, phase: str, present: dict[int, pytest.TestReport], died: list[int]) -> list[tuple[str, str]]:
        """Every rank's captured output - for big jobs only the failing ranks' and the first few."""
        out = []
        keep = sorted(set(present) | set(died))
        if len(keep) > MAX_RANK_SECTIONS:
            failing = [r for r in keep if r in died or present[r].failed]
            keep = sorted(set(failing[:MAX_RANK_SECTIONS]) | set(keep[:MAX_RANK_SECTIONS]))
        label = len(self.ranks) > 1
        for rank in keep:
            if rank in present:
                for title, content in present[rank].sections:
                    out.append((f"{title} [rank {rank}]", tag_lines(content, rank) if label else content))
            elif self.capture:
                text = self._died_output(rank, phase)
                if text:
                    out.append((f"Captured stdout {phase} [rank {rank}]", tag_lines(text, rank) if label else text))
        return out

    def _make(
        self,
        phase: str,
        outcome: str,
        longrepr: Any,
        present: dict[int, pytest.TestReport],
        window: tuple[float, float],
        died: list[int] | None = None,
        failing: list[int] | None = None,
        **extra: Any,
    ) -> pytest.TestReport:
        if isinstance(longrepr, list):  # a skip location (path, lineno, reason) that went through JSON
            longrepr = tuple(longrepr)
        props = merge_properties({rank: [(str(n), v) for n, v in present[rank].user_properties] for rank in present})
        sections = self._sections(phase, present, died or [])
        if self.run.note:  # the test did not run as asked (a warm world's test in a fresh job)
            props.append(("msrun_note", self.run.note))
            if phase == "call" or (phase == "setup" and outcome != "passed"):
                sections.append(("msrun", self.run.note))
        if failing:  # junitxml and other report consumers: which ranks failed, the first one first
            props.append(("msrun_failing_ranks", ",".join(map(str, failing))))
            if getattr(self.config.option, "usepdb", False):
                sections.append(("msrun --pdb", PDB_NOTE))
        if self.run.holdings and phase == "call":
            sections.append(("msrun dry run: what each simulated rank holds", "\n".join(self.run.holdings)))
        hosts = self._hosts()
        if hosts:  # a job across hosts: where each rank ran
            props.append(("msrun_hosts", {str(r): h for r, h in hosts.items()}))
            if phase == "call":
                sections.append(("msrun hosts", "\n".join(f"rank {r}: {h}" for r, h in hosts.items())))
        start, stop = window
        carried = carried_attributes({r: rep.__dict__ for r, rep in present.items()}, failing[0] if failing else None)
        extra = {**carried, **extra}
        if self.attempt_no is not None:
            extra["rerun"] = self.attempt_no
            outcome = "rerun" if outcome == "failed" else outcome
        return pytest.TestReport(
            nodeid=self.item.nodeid,
            location=self.item.location,
            keywords={k: 1 for k in self.item.keywords},
            outcome=outcome,  # type: ignore[arg-type]
            longrepr=longrepr,
            when=phase,  # type: ignore[arg-type]
            sections=sections,
            duration=stop - start,
            start=start,
            stop=stop,
            user_properties=props,
            **extra,
        )

    def _skip_at(self, reason: str) -> tuple[str, int, str]:
        """A skip's longrepr at the test's own line, as pytest makes one."""
        return (str(getattr(self.item, "path", self.item.location[0])), self.item.location[1] or 0, reason)

    def _crash_location(self, message: str) -> ReprFileLocation:
        path, lineno, _ = self._skip_at(message)
        return ReprFileLocation(path=path, lineno=lineno + 1, message=message)

    def _failed(
        self, phase: PhaseVerdict, present: dict[int, pytest.TestReport], window: tuple[float, float]
    ) -> pytest.TestReport:
        sections: list[tuple[str, str]] = []
        shown_stacks: set[int] = set()
        issues = phase.issues
        died = [i.rank for i in issues if i.report is None]
        if phase.message:  # a rule's own failure (a mix of skip and run)
            return self._make(phase.phase, "failed", self._headline(phase.message), present, window)
        reported = [i for i in issues if i.report is not None]
        if not issues and phase.stopped:  # stopped by msrun because of a failure reported in another phase
            cause = phase.cause
            headline = f"{were(phase.stopped)} stopped by msrun in the {phase.phase} phase"
            if cause is not None:
                headline += f" after rank {cause.rank} failed first ({cause.phase or 'its'} phase)"
                report = self._report(cause.report) if cause.report is not None else None
                root: Any = f"{cause.summary}\n{report.longreprtext}" if report is not None else self._issue_text(cause)
                crash = self._crash_location(f"stopped after a failure: {self._issue_summary(cause)}")
            else:
                root = None
                crash = self._crash_location(headline)
        elif self.run.timed_out and not reported:
            stuck = sorted(i.rank for i in issues)
            headline = (
                f"msrun job timed out after {self.run.timeout:g} s in the {phase.phase} phase "
                f"({'rank' if len(stuck) == 1 else 'ranks'} {ranks_text(stuck)} had not finished); where each rank "
                "was, then every rank's stack"
            )
            root = self.hang_text()
            crash = self._crash_location(f"msrun job timed out after {self.run.timeout:g} s")
            for issue in issues[:MAX_RANK_SECTIONS]:
                sections.append((f"rank {issue.rank}", self._issue_text(issue)))
                shown_stacks.add(issue.rank)
        else:
            first = issues[0]
            others = sorted({i.rank for i in issues[1:]} - {first.rank})
            headline = f"[rank {first.rank}] failed first" + (
                f"; also failed on ranks {ranks_text(others)}" if others else ""
            )
            if self.run.timed_out:
                headline += f" (the job timed out after {self.run.timeout:g} s)"
            from pytest_msrun.engine.dryrun import refusal_line  # MindSpore refusing a dry run: said first

            headline = "\n".join(filter(None, [refusal_line([i.summary for i in issues]), headline]))
            first_report = self._report(first.report) if first.report is not None else None
            if first_report is not None:
                root = first_report.longrepr
                base = getattr(root, "reprcrash", None)
                subtest = first.summary.startswith(f"rank {first.rank}: subtest")
                reason = first.summary.split(": ", 1)[-1] if base is None or subtest else base.message
                message = f"[rank {first.rank}] {reason}"
                crash = (
                    dataclasses.replace(base, message=message) if base is not None else self._crash_location(message)
                )
            else:
                root = self._issue_text(first)
                crash = self._crash_location(self._issue_summary(first))
            shown_stacks.add(first.rank)
            for other in issues[1 : 1 + MAX_RANK_SECTIONS]:
                text = self._issue_text(other) if self.style == "all" else self._issue_summary(other)
                sections.append((f"rank {other.rank}", text))
                if self.style == "all":
                    shown_stacks.add(other.rank)
        if len(issues) > 1 + MAX_RANK_SECTIONS:
            sections.append(("more failing ranks", ranks_text(i.rank for i in issues[1 + MAX_RANK_SECTIONS :])))
        if phase.stopped and issues:
            why = self.end(phase.stopped[0]).stop_reason
            said = f"{were(phase.stopped)} stopped after the first failure" + (f" ({why})" if why else "")
            sections.append(("terminated by msrun", said))
        when = "at the timeout" if self.run.timed_out else "when it did not exit"
        for rank in sorted(self.run.stacks):
            if rank not in shown_stacks:
                sections.append((f"stack of rank {rank} {when}", self._stack(rank, self.run.stacks[rank])))
        shown = [i.rank for i in issues[: 1 + MAX_RANK_SECTIONS]] or self.ranks[:MAX_RANK_SECTIONS]
        shown = self.ranks if len(self.ranks) <= MAX_RANK_SECTIONS else shown
        hosts = self._hosts()
        logs = "\n".join(
            f"rank {r}" + (f" on {hosts[r]}" if r in hosts else "") + f": {self.shown_log(r)}" for r in shown
        )
        if len(self.ranks) > len(shown):
            logs += f"\n(every rank: {self.log_dir}/worker_<rank>.log)"
        sections.append(("msrun logs", f"{logs}\nmsrun: {', '.join(self.run.msrun_logs)}"))
        sections.append(("reproduce", self.reproduce))
        if getattr(self.config.option, "tbstyle", "auto") == "line":  # pytest's: the failure's lines, its one line
            headline, sections = "", []
        longrepr = MergedLongrepr(headline, root, sections, crash)
        failing = sorted({i.rank for i in issues}) or sorted(phase.stopped)
        return self._make(phase.phase, "failed", longrepr, present, window, died=died, failing=failing)

    def hang_text(self) -> str:
        main_threads = {r: self.logs[r].main_thread for r in self.ranks}
        no_stack = {r: self.end(r).describe(True) for r in self.ranks if r not in self.run.stacks}
        for r, text in self.run.stacks.items():
            if text.startswith("msrun: "):  # what kept it from giving one (stopped)
                no_stack[r] = f"{text[7:].strip()}; {self.end(r).describe(True)}"
        return diagnosis(self.run.stacks, main_threads, self.ranks, self.run.state, no_stack)

    def _refused(self, refusal: Refusal, phase: str) -> pytest.TestReport:
        """A phase of a test whose job never ran: its setup skipped or failed for the refusal's
        reason (with what msrun said, where it tried), its teardown passed - as pytest reports a
        test whose setup did not pass."""
        window = (self.run.started, self.run.ended)
        if phase != "setup":
            return self._make(phase, "passed", None, {}, window)
        if refusal.outcome == "skipped":
            return self._make(phase, "skipped", self._skip_at(refusal.reason), {}, window)
        longrepr = self._headline(refusal.reason, refusal.detail) if refusal.detail else refusal.reason
        return self._make(phase, "failed", longrepr, {}, window)

    def _headline(self, headline: str, root: str | None = None) -> MergedLongrepr:
        """A failure that is msrun's own: its headline, what it says beside it, the reproduce command."""
        return MergedLongrepr(headline, root, [("reproduce", self.reproduce)], self._crash_location(headline))
