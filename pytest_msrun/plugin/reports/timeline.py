"""A marked test's timeline for the HTML report: phases and collectives per rank, the first
failure, the hang view, each rank's output and log - built from the test's complete record.

:func:`test_entry` returns the JSON-able dict :mod:`.htmlpage` renders (one per test); the
controller attaches it to the test's teardown report as ``msrun_timeline`` so it travels with
the report (pytest-xdist included). :class:`SessionReport` collects them and writes the page.
"""

from __future__ import annotations

import os
import time
from collections import Counter

from pytest_msrun.fileio import write_whole
from pytest_msrun.plugin.reports.merge import Merger
from pytest_msrun.plugin.reports.reportfiles import environment, link_files
from pytest_msrun.plugin.rule.outcomes import TestVerdict, shown
from pytest_msrun.plugin.rule.records import PHASES, RankTest
from pytest_msrun.plugin.rule.testrecord import TestRecord

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    import pytest

REPORT_ATTR = "msrun_timeline"
OUTPUT_LIMIT = 64 * 1024  # characters of a rank's captured output kept on the page


def _rank_spans(record: TestRecord, rank: int, test: RankTest) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    end = record.run.ranks.get(rank)  # a phase never finished lasts until the rank's end or the job's
    until = (end.died_at or end.ended if end is not None else None) or record.run.ended or 0.0
    for when, start, stop, report in test.phase_spans(until):
        outcome = str(report.get("outcome", "")) if report else "running"
        spans.append({"name": when, "kind": "phase", "start": start, "end": stop, "outcome": outcome})
    for op, seq, entered, returned, error, when in test.collectives:
        span = {"name": f"{op} #{seq}", "kind": "collective", "start": entered, "end": returned, "phase": when}
        if error:
            span["error"] = error
        spans.append(span)
    return spans


def _waited_for(ranks: list[dict[str, Any]]) -> None:
    """Mark each collective with the rank(s) that entered it last: those the others waited for."""
    spans = [(lane["rank"], span) for lane in ranks for span in lane["spans"] if span["kind"] == "collective"]
    entered: dict[str, dict[int, float]] = {}
    for rank, span in spans:
        entered.setdefault(span["name"], {})[rank] = span["start"]
    for _, span in spans:
        who = entered[span["name"]]
        span["waited_for"] = sorted(r for r, t in who.items() if t == max(who.values()))


def test_entry(
    merger: Merger, record: TestRecord, verdict: TestVerdict, reports: list[pytest.TestReport], mode: str
) -> dict[str, Any]:
    """The page's view of one marked test."""
    outcome = shown(verdict)  # the one vocabulary (outcomes.py), as the console's reports say it
    failed = next((r for r in reports if r.failed or r.outcome == "rerun"), None)
    skipped = next((r for r in reports if r.skipped), None)
    if failed is not None:
        message = next(iter(failed.longreprtext.strip().splitlines()), "")
    else:
        message = str(skipped.longrepr[2]) if skipped is not None and isinstance(skipped.longrepr, tuple) else ""
    first = verdict.first_issue
    first_failure = None
    first_at = 0.0
    if first is not None:  # a reported failure is drawn where its phase ended, a death where it died
        first_at = float((first.report or {}).get("stop") or 0.0) or first.at
        first_failure = {"rank": first.rank, "phase": first.phase, "error": first.summary, "at": first_at}
    hang = merger.hang_text() if record.run.timed_out else ""
    ranks: list[dict[str, Any]] = []
    for rank in record.ranks:
        end = record.run.ranks.get(rank)
        log = record.logs.get(rank)
        test = log.tests.get(record.nodeid) if log is not None else None
        output = ""
        if test is not None:
            for when in PHASES:
                for rep in test.all_reports(when):
                    for title, text in rep.get("sections", []) or []:
                        if isinstance(text, str) and title.startswith("Captured"):
                            output += f"--- {when}: {title} ---\n{text}\n"
        ranks.append(
            {
                "rank": rank,
                "host": (end.host if end is not None and end.host else os.uname().nodename),
                "pid": end.pid if end is not None and end.pid else (log.pid if log is not None else None),
                "log": merger.shown_log(rank) if log is not None else "",
                "outcome": verdict.cells.get(rank, ""),
                "output": output[-OUTPUT_LIMIT:],
                "spans": _rank_spans(record, rank, test) if test is not None else [],
                "marks": [{"name": "first failure", "at": first_at, "text": first.summary}]
                if first is not None and first.rank == rank
                else [],
            }
        )
    _waited_for(ranks)
    # The window: a fresh job's from its launch; a warm world's test from its first phase (the
    # world started long before); to the last thing any rank did.
    times = [t for lane in ranks for span in lane["spans"] for t in (span["start"], span["end"]) if t]
    t0 = record.run.started if mode == "fresh" or not times else min(times)
    t1 = max([*times, *([first_at] if first_at else [])], default=record.run.ended)
    return {
        "nodeid": record.nodeid,
        "outcome": outcome,
        "duration": sum(float(r.duration or 0.0) for r in reports),
        "phase_seconds": {w: sum(float(r.duration or 0.0) for r in reports if r.when == w) for w in PHASES},
        "worker_num": len(record.ranks),
        "mode": mode,
        "reproduce": merger.reproduce,
        "message": message,
        "longrepr": failed.longreprtext if failed is not None else "",
        "hang": hang,
        "first_failure": first_failure,
        "t0": t0,
        "t1": max(t1, t0),
        "ranks": ranks,
    }


class SessionReport:
    """Every marked test's entry of a session (from its reports), written as one HTML page with
    its linked files beside it (:mod:`.reportfiles`)."""

    def __init__(self, path: str, config: pytest.Config) -> None:
        self.path = os.path.abspath(path)
        self.config = config
        self.command = " ".join(["pytest", *config.invocation_params.args])
        self.entries: list[dict[str, Any]] = []
        self.phase_seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.worlds: set[str] = set()
        self.started = time.time()
        self.written = False
        self.error = ""  # why the page could not be written
        self.announced = False

    def add(self, report: pytest.TestReport) -> None:
        """Called for every report of the session (the controller's, or xdist's workers')."""
        entry = getattr(report, REPORT_ATTR, None)
        if not isinstance(entry, dict):
            return
        self.entries.append(entry)
        for when, seconds in (entry.get("phase_seconds") or {}).items():
            self.phase_seconds[str(when)] = self.phase_seconds.get(str(when), 0.0) + float(seconds)
        world = entry.get("world")
        if isinstance(world, str) and world:
            self.worlds.add(world)

    def write(self) -> None:
        """Write the page and its files; :attr:`error` set when they cannot be written (a
        full disk: no half-written file is left, see :func:`.reportfiles.link_files`)."""
        from pytest_msrun.plugin.reports.htmlpage import render_page

        outcomes = Counter(str(e.get("outcome")) for e in self.entries)
        try:
            link_files(self.entries, self.path)
            session = {
                "title": "msrun: marked tests",
                "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": self.command,
                "environment": environment(self.config),
                "summary": {
                    "tests": len(self.entries),
                    "outcomes": dict(outcomes),
                    "worlds_started": len(self.worlds),
                    "phase_seconds": {w: round(self.phase_seconds[w], 3) for w in PHASES},
                    "duration": time.time() - self.started,
                },
                "tests": self.entries,
            }
            write_whole(self.path, render_page(session))
        except OSError as exc:
            from pytest_msrun.fsinfo import describe_write_error

            where = exc.filename if isinstance(exc.filename, str) else self.path
            what = describe_write_error(where, exc, "--msrun-report")
            self.error = f"could not write the HTML report {self.path}: {what}"
            return
        self.written = True

    def announce(self, reporter: Any) -> None:
        """Name the written page on a line of its own, once: from the terminal summary (pytest has
        ended the progress line by then - under ``-q`` its ``ensure_newline`` does not know of that
        line), or at the end of a session without one (``--no-summary``)."""
        if not (self.written or self.error) or self.announced or reporter is None:
            return
        self.announced = True
        if self.error:
            reporter.write_line(f"msrun: ERROR: {self.error}", red=True, bold=True)
            return
        reporter.write_sep("-", f"msrun: HTML report of {len(self.entries)} marked test(s): {self.path}")
