"""Fold every rank's records into one pytest report per phase.

Rules: a phase failed if any rank failed it (first failure by time first, the others listed);
a rank that left no record for a phase it should have reached failed it, explained by its exit
status or signal and its log tail, never a pass; skipped only if every rank skipped (a mix of
skip and run is a failure that says so); xfail/xpass follow pytest: any rank failing as expected
makes the test XFAIL, all ranks passing makes it XPASS (strict xpass already fails in the rank).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest._code.code import ReprFileLocation, TerminalRepr

from pytest_msrun.cpulist import format_id_list
from pytest_msrun.plugin.job import JobRun, RankStatus
from pytest_msrun.plugin.records import read_records, records_path
from pytest_msrun.procs import describe_returncode
from pytest_msrun.summary import extract_traceback, log_text

PHASES = ("setup", "call", "teardown")
MAX_RANK_SECTIONS = 8  # per-rank sections shown in a report; big dry runs list the rest compactly


def _ranks_text(ranks) -> str:
    return format_id_list(ranks).replace(",", ", ")


@dataclass
class RankRecords:
    """What one rank reported."""

    rank: int
    reports: dict[str, pytest.TestReport] = field(default_factory=dict)
    stamps: dict[str, float] = field(default_factory=dict)
    collect_errors: list[pytest.CollectReport] = field(default_factory=list)
    started: bool = False
    finished: bool = False
    exitstatus: int | None = None


def load_records(config: pytest.Config, report_dir: str, ranks: list[int], nodeid: str) -> dict[int, RankRecords]:
    out: dict[int, RankRecords] = {}
    for rank in ranks:
        rec = RankRecords(rank)
        for record in read_records(records_path(report_dir, rank)):
            kind = record["kind"]
            if kind == "start":
                rec.started = True
            elif kind == "finish":
                rec.finished = True
                rec.exitstatus = record.get("exitstatus")
            elif kind in ("report", "collect"):
                try:
                    report = config.hook.pytest_report_from_serializable(config=config, data=record["data"])
                except Exception:  # a record this pytest cannot read counts as missing
                    continue
                if report is None:
                    continue
                if kind == "collect":
                    rec.collect_errors.append(report)
                elif isinstance(report, pytest.TestReport) and report.nodeid == nodeid:
                    rec.reports[report.when] = report
                    rec.stamps[report.when] = float(record.get("ts", 0.0))
        out[rank] = rec
    return out


class MergedLongrepr(TerminalRepr):
    """A headline, the first failing rank's own failure representation, then labelled sections."""

    def __init__(self, headline: str, root: Any, sections: list[tuple[str, str]], reprcrash: Any) -> None:
        self.headline = headline
        self.root = root
        self.extra = sections
        self.reprcrash = reprcrash

    def toterminal(self, tw: Any) -> None:
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


@dataclass
class RankFailure:
    """A rank's failure in one phase: its own report, or one made from its exit and log."""

    rank: int
    at: float
    report: pytest.TestReport | None = None
    text: str = ""
    summary: str = ""

    def longrepr_text(self) -> str:
        if self.report is not None:
            return self.report.longreprtext
        return self.text


def _crash_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0] if crash.message else "failed"
    text = report.longreprtext.strip().splitlines()
    return text[-1] if text else "failed"


class Merger:
    """Builds the merged reports for one item from its job run and rank records."""

    def __init__(
        self,
        item: pytest.Item,
        run: JobRun,
        records: dict[int, RankRecords],
        ranks: list[int],
        style: str,
        reproduce: str,
        log_dir: str,
    ) -> None:
        self.item = item
        self.run = run
        self.records = records
        self.ranks = ranks
        self.style = style
        self.reproduce = reproduce
        self.log_dir = log_dir
        self.died_in: dict[int, str] = {}
        self.deferred: list[int] = []  # ranks stopped by msrun, reported with the phase that failed

    # ------------------------------------------------------------------ facts per rank
    def status(self, rank: int) -> RankStatus:
        return self.run.ranks.get(rank) or RankStatus(rank)

    def _exit_text(self, rank: int) -> str:
        status = self.status(rank)
        if status.returncode is None:
            if self.run.timed_out:
                return "was still running at the timeout"
            return "never started" if status.pid is None else "has no recorded exit status"
        how = describe_returncode(status.returncode)
        if status.terminated_by_msrun:
            how += " (terminated by msrun after another process failed)"
        return how

    def _log_excerpt(self, rank: int) -> str:
        """The rank's fatal-error dump or last traceback, then the end of its log."""
        status = self.status(rank)
        path = status.log or os.path.join(self.log_dir, f"worker_{rank}.log")
        text = log_text(path)
        parts = []
        tb = extract_traceback(text)
        if tb:
            lines = tb.splitlines()
            parts.append("\n".join(lines[:24] + (["  ..."] if len(lines) > 24 else [])))
        tail = "\n".join(text.splitlines()[-15:])
        if not tail.strip():
            parts.append(f"{path} is empty")
        elif not tb or tail.strip() not in tb:
            parts.append(f"last lines of {path}:\n{tail}")
        return "\n".join(parts)

    def _synthetic(self, rank: int, phase: str, why: str) -> RankFailure:
        rec = self.records[rank]
        if rec.collect_errors:
            text = "\n".join(r.longreprtext for r in rec.collect_errors)
            summary = f"rank {rank}: collection failed"
            return RankFailure(rank, self._time_of(rank), text=f"{summary}\n{text}", summary=summary)
        summary = f"rank {rank} {why} during the {phase} phase and {self._exit_text(rank)}"
        text = summary + "\n" + self._log_excerpt(rank)
        if rank in self.run.stacks:
            text += f"\nstack of rank {rank} at the timeout:\n{self.run.stacks[rank]}"
        return RankFailure(rank, self._time_of(rank), text=text, summary=summary)

    def _time_of(self, rank: int) -> float:
        ended = self.status(rank).ended
        return float(ended) if ended else self.run.ended

    def _collateral(self, rank: int) -> bool:
        return self.status(rank).terminated_by_msrun and not self.run.timed_out

    # ------------------------------------------------------------------ merging
    def expected(self, rank: int, phase: str) -> bool:
        """Whether ``rank`` should have reported ``phase`` (given its earlier phases)."""
        if rank in self.died_in:
            return False
        reports = self.records[rank].reports
        if phase == "setup":
            return True
        if phase == "call":
            setup = reports.get("setup")
            return setup is not None and setup.passed
        return "setup" in reports

    def merged_reports(self) -> list[pytest.TestReport]:
        out = []
        if self.run.launch_error:
            return [self._launch_failure()]
        for phase in PHASES:
            if phase == "call" and out and not out[0].passed:
                continue  # setup failed or skipped: pytest runs no call phase
            report = self.merge_phase(phase)
            if report is not None:
                out.append(report)
        return out

    def merge_phase(self, phase: str) -> pytest.TestReport | None:
        failures: list[RankFailure] = []
        collateral: list[int] = []
        present: dict[int, pytest.TestReport] = {}
        for rank in self.ranks:
            rec = self.records[rank]
            report = rec.reports.get(phase)
            if report is not None:
                present[rank] = report
                if report.failed:
                    failures.append(
                        RankFailure(
                            rank,
                            rec.stamps.get(phase, 0.0),
                            report=report,
                            summary=f"rank {rank}: {_crash_message(report)}",
                        )
                    )
                continue
            if not self.expected(rank, phase):
                continue
            if self._collateral(rank):
                collateral.append(rank)
                self.died_in[rank] = phase
                continue
            why = "left no record" if not rec.finished else f"ended its pytest session (exit status {rec.exitstatus})"
            if self.run.timed_out:
                why = f"timed out after {self.run.timeout:g} s"
            failures.append(self._synthetic(rank, phase, why))
            self.died_in[rank] = phase
        if collateral and not failures and not self.run.timed_out:
            if self._failed_elsewhere(collateral):
                # Stopped because another rank failed in a later phase: say so there.
                self.deferred.extend(collateral)
                collateral = []
            else:  # nothing else explains why msrun stopped them: their stop is the failure
                failures = [self._synthetic(r, phase, "was stopped by msrun") for r in collateral]
                collateral = []
        if not present and not failures and not collateral:
            return None
        if failures or collateral:
            collateral, self.deferred = collateral + self.deferred, []
            return self._failed(phase, failures, collateral, present)
        return self._outcome(phase, present)

    def _failed_elsewhere(self, stopped: list[int]) -> bool:
        """Whether some rank other than ``stopped`` failed (a failed report, or a bad exit)."""
        for rank in self.ranks:
            if rank in stopped:
                continue
            if any(rep.failed for rep in self.records[rank].reports.values()):
                return True
            status = self.status(rank)
            if status.returncode not in (None, 0) and not status.terminated_by_msrun:
                return True
        return False

    def _sections(self, present: dict[int, pytest.TestReport]) -> list[tuple[str, str]]:
        """Every rank's captured output - for big jobs only the failing ranks' and the first few."""
        out = []
        keep = sorted(present)
        if len(keep) > MAX_RANK_SECTIONS:
            failing = [r for r in keep if present[r].failed]
            keep = sorted(set(failing[:MAX_RANK_SECTIONS]) | set(keep[:MAX_RANK_SECTIONS]))
        for rank in keep:
            for title, content in present[rank].sections:
                out.append((f"{title} [rank {rank}]", content))
        return out

    def _report(
        self, phase: str, outcome: str, longrepr: Any, present: dict[int, pytest.TestReport], **extra: Any
    ) -> pytest.TestReport:
        if isinstance(longrepr, list):  # a skip location (path, lineno, reason) that went through JSON
            longrepr = tuple(longrepr)
        durations = [r.duration for r in present.values()]
        props: list[tuple[str, object]] = []
        for rank in sorted(present):
            props.extend(present[rank].user_properties)
        starts = [getattr(r, "start", 0.0) for r in present.values() if getattr(r, "start", 0.0)]
        stops = [getattr(r, "stop", 0.0) for r in present.values() if getattr(r, "stop", 0.0)]
        return pytest.TestReport(
            nodeid=self.item.nodeid,
            location=self.item.location,
            keywords={k: 1 for k in self.item.keywords},
            outcome=outcome,  # type: ignore[arg-type]
            longrepr=longrepr,
            when=phase,  # type: ignore[arg-type]
            sections=self._sections(present),
            duration=max(durations) if durations else 0.0,
            start=min(starts) if starts else self.run.started,
            stop=max(stops) if stops else self.run.ended,
            user_properties=props,
            **extra,
        )

    def _crash_location(self, message: str) -> ReprFileLocation:
        path = str(self.item.path) if hasattr(self.item, "path") else self.item.location[0]
        lineno = (self.item.location[1] or 0) + 1
        return ReprFileLocation(path=path, lineno=lineno, message=message)

    def _failed(
        self, phase: str, failures: list[RankFailure], collateral: list[int], present: dict[int, pytest.TestReport]
    ) -> pytest.TestReport:
        sections: list[tuple[str, str]] = []
        reported = [f for f in failures if f.report is not None]
        if self.run.timed_out and not reported:
            stuck = sorted(f.rank for f in failures)
            headline = (
                f"msrun job timed out after {self.run.timeout:g} s in the {phase} phase "
                f"(ranks {', '.join(map(str, stuck))} had not finished); every rank's stack follows"
            )
            root: Any = "\n\n".join(f.text for f in sorted(failures, key=lambda f: f.rank))
            crash = self._crash_location(f"msrun job timed out after {self.run.timeout:g} s")
        else:
            failures.sort(key=lambda f: f.at)
            first = failures[0]
            others = [f.rank for f in failures[1:]]
            headline = f"[rank {first.rank}] failed first" + (
                f"; also failed on ranks {_ranks_text(others)}" if others else ""
            )
            if self.run.timed_out:
                headline += f" (the job timed out after {self.run.timeout:g} s)"
            if first.report is not None:
                root = first.report.longrepr
                base = getattr(root, "reprcrash", None)
                message = f"[rank {first.rank}] {base.message if base is not None else _crash_message(first.report)}"
                crash = (
                    dataclasses.replace(base, message=message) if base is not None else self._crash_location(message)
                )
            else:
                root = first.text
                crash = self._crash_location(first.summary)
            for other in failures[1 : 1 + MAX_RANK_SECTIONS]:
                if self.style == "all":
                    sections.append((f"rank {other.rank}", other.longrepr_text()))
                else:
                    sections.append((f"rank {other.rank}", other.summary))
        if len(failures) > 1 + MAX_RANK_SECTIONS:
            sections.append(("more failing ranks", _ranks_text(f.rank for f in failures[1 + MAX_RANK_SECTIONS :])))
        if collateral:
            sections.append(
                ("terminated by msrun", f"ranks {_ranks_text(collateral)} were stopped after the first failure")
            )
        if self.run.stacks:
            for rank in sorted(self.run.stacks):
                if not any(f.rank == rank and f.report is None for f in failures):  # not shown yet
                    sections.append((f"stack of rank {rank} at the timeout", self.run.stacks[rank]))
        shown = [f.rank for f in failures[: 1 + MAX_RANK_SECTIONS]] or self.ranks[:MAX_RANK_SECTIONS]
        if len(self.ranks) <= MAX_RANK_SECTIONS:
            shown = self.ranks
        logs = "\n".join(
            f"rank {r}: {self.status(r).log or os.path.join(self.log_dir, f'worker_{r}.log')}" for r in shown
        )
        if len(self.ranks) > len(shown):
            logs += f"\n(every rank: {self.log_dir}/worker_<rank>.log)"
        sections.append(("msrun logs", f"{logs}\nmsrun: {', '.join(self.run.msrun_logs)}"))
        sections.append(("reproduce", self.reproduce))
        longrepr = MergedLongrepr(headline, root, sections, crash)
        return self._report(phase, "failed", longrepr, present)

    def _outcome(self, phase: str, present: dict[int, pytest.TestReport]) -> pytest.TestReport:
        xfailed = [r for r, rep in present.items() if rep.skipped and hasattr(rep, "wasxfail")]
        skipped = [r for r, rep in present.items() if rep.skipped and not hasattr(rep, "wasxfail")]
        xpassed = [r for r, rep in present.items() if rep.passed and hasattr(rep, "wasxfail")]
        ran = [r for r in present if r not in skipped]
        if skipped and ran:
            reason = present[skipped[0]].longrepr
            text = reason[2] if isinstance(reason, (tuple, list)) and len(reason) == 3 else str(reason)
            message = (
                f"skipped on ranks {', '.join(map(str, sorted(skipped)))} ({text}) but ran on ranks "
                f"{', '.join(map(str, sorted(ran)))}: a test must skip on every rank or on none"
            )
            longrepr = MergedLongrepr(message, None, [("reproduce", self.reproduce)], self._crash_location(message))
            return self._report(phase, "failed", longrepr, present)
        if xfailed:
            first = present[min(xfailed, key=lambda r: self.records[r].stamps.get(phase, 0.0))]
            return self._report(phase, "skipped", first.longrepr, present, wasxfail=first.wasxfail)
        if xpassed:
            first = present[xpassed[0]]
            return self._report(phase, "passed", None, present, wasxfail=first.wasxfail)
        if skipped:
            first = present[skipped[0]]
            return self._report(phase, "skipped", first.longrepr, present)
        return self._report(phase, "passed", None, present)

    def _launch_failure(self) -> pytest.TestReport:
        message = "msrun could not start the job"
        text = self.run.launch_error
        longrepr = MergedLongrepr(message, text, [("reproduce", self.reproduce)], self._crash_location(message))
        return self._report("setup", "failed", longrepr, {})
