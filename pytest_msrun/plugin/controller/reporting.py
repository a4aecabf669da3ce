"""How one run of a marked test is reported in the controller's session, phase by phase.

Setup and call are reported as soon as they are judged (with the subtests' reports before the
call's), the teardown once the test's record is final; then what the ranks recorded beyond their
reports (:mod:`.replay`), the test's spans for its job's trace, and its timeline for the HTML
page. Under pytest-rerunfailures a failed run is reported as that plugin does: up to the failure,
marked ``rerun``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any

import pytest

from pytest_msrun.plugin.controller.attempts import Attempt, TestRecord
from pytest_msrun.plugin.options import plugin_loaded
from pytest_msrun.plugin.reports.merge import Merger
from pytest_msrun.plugin.reports.replay import Replay
from pytest_msrun.plugin.reports.timeline import REPORT_ATTR, test_entry
from pytest_msrun.plugin.reports.tracetests import TraceNotes
from pytest_msrun.plugin.rule.outcomes import TestVerdict, shown


class MsrunLeakWarning(pytest.PytestWarning):
    """A test in a warm world left something behind on a rank (thread, process, file, environment)."""


class MsrunMemoryWarning(pytest.PytestWarning):
    """A rank of a warm world passed ``--msrun-max-rss`` after a test: the world ended after it."""


MERGED = pytest.StashKey[pytest.TestReport]()  # on a marked test's item: the phase's merged report, being made


class MergedReports:
    """The controller's ``pytest_runtest_makereport`` for a marked test: the phase's merged report -
    so every plugin's makereport wrapper (pytest-dependency's results, tmp_path's retention policy,
    pytest-html's extras) sees the one result the user sees, once per phase, as for a plain test."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: Any) -> pytest.TestReport | None:
        return item.stash.get(MERGED, None)


def observed(item: pytest.Item, when: str) -> None:
    """The phase's hook wrappers (pytest-json-report's, allure's, ...) see it pass as around a plain
    test's; the hook's other implementations - what runs a test, pytest's runner first - are left
    out: the ranks ran it. A wrapper's fault is its own."""
    manager, name = item.config.pluginmanager, f"pytest_runtest_{when}"
    keep = {id(i.plugin) for i in getattr(item.ihook, name).get_hookimpls() if i.hookwrapper or i.wrapper}
    if keep:
        caller = manager.subset_hook_caller(name, [p for p in manager.get_plugins() if id(p) not in keep])
        with contextlib.suppress(Exception, pytest.skip.Exception, pytest.fail.Exception):
            caller(item=item, **({"nextitem": None} if when == "teardown" else {}))


def made(item: pytest.Item, report: pytest.TestReport) -> pytest.TestReport:
    """``report`` as the controller's makereport hook makes it (its plugins' wrappers around it),
    after its phase was observed; a plugin's fault there leaves the report as it was."""
    from _pytest.runner import CallInfo

    for key in ("stdout", "stderr"):  # the phase's capture on the item, where pytest's runner leaves it for plugins
        head = f"Captured {key} {report.when}"  # every rank's, tagged (``... [rank 1]``)
        item.add_report_section(report.when, key, "".join(c for n, c in report.sections if n.startswith(head)))
    observed(item, report.when)

    start, stop = float(getattr(report, "start", 0.0)), float(getattr(report, "stop", 0.0))
    call: CallInfo[None] = CallInfo(
        None, None, start=start, stop=stop, duration=report.duration, when=report.when, _ispytest=True
    )
    item.stash[MERGED] = report
    try:
        out = item.ihook.pytest_runtest_makereport(item=item, call=call)
    except Exception:
        out = report
    finally:
        del item.stash[MERGED]
    return out if isinstance(out, pytest.TestReport) else report


class Reporter:
    """Reports the runs of marked tests (one instance per controller)."""

    def __init__(self, config: pytest.Config, style: str, leaks: str, timelines: bool, traces: TraceNotes) -> None:
        config.pluginmanager.register(MergedReports(), "msrun-merged-reports")
        self.config = config
        self.style = style
        self.leaks = leaks
        self.timelines = timelines
        self.traces = traces
        self.cwd = str(config.invocation_params.dir)

    def log(self, item: pytest.Item, reports: Iterable[pytest.TestReport], extras: Replay | None = None) -> None:
        """Log ``reports`` as pytest's runner does; with the ranks' ``extras``, what they wrote to
        the terminal around them."""
        for report in reports:
            if type(report).__name__ == "SubtestReport":  # made by the rank's pytest, logged as it is
                item.ihook.pytest_runtest_logreport(report=report)
                continue
            if extras is not None:
                extras.show_terminal(report.when)
            report = made(item, report)
            item.ihook.pytest_runtest_logreport(report=report)
            if extras is not None and report.when == "setup" and report.passed:
                extras.show_item()

    def setup_call(self, item: pytest.Item, record: TestRecord, rerun: int | None) -> list[pytest.TestReport]:
        """Setup's and call's reports, logged now unless the run may be rerun (``rerun``: its number)."""
        reports = Merger(item, record, self.style, self.cwd, rerun).reports(record.verdict, ("setup", "call"))
        if rerun is None:
            extras = Replay(item, record.logs)
            self.log(item, extras.with_subtests(reports), extras)
        return reports

    def final(
        self,
        item: pytest.Item,
        attempt: Attempt,
        record: TestRecord,
        setup_call: list[pytest.TestReport],
        rerun: int | None,
    ) -> tuple[TestVerdict, bool]:
        """The rest of the run, from its final record: its verdict, and whether to run it again
        (``rerun``: the attempt's number when it may)."""
        final = record.verdict
        extras = Replay(item, record.logs)  # what the ranks recorded beyond their reports
        extras.junit()  # before the last report, which writes the test's junitxml testcase
        trace = attempt.trace
        self.traces.add(trace, (attempt.mode, attempt.job_started), final, shown(final), record.logs, record.run.ended)
        merger = Merger(item, record, self.style, self.cwd, rerun)
        teardown = merger.reports(final, ("teardown",))
        if record.leaks and self.leaks == "warn":  # what it left behind in its warm world, as a warning it raised
            lines = [f"rank {rank}: {what}" for rank, items in sorted(record.leaks.items()) for what in items]
            self._warn(item, MsrunLeakWarning(f"{item.nodeid} left behind in its warm world:\n  " + "\n  ".join(lines)))
        if record.notes:
            self._warn(item, MsrunMemoryWarning(f"{item.nodeid} ended its warm world:\n  " + "\n  ".join(record.notes)))
        if teardown:  # junitxml writes the properties of a test's last report: the earlier phases' too
            have = {name for name, _ in teardown[-1].user_properties}
            for name, value in (prop for report in setup_call for prop in report.user_properties):
                if name.startswith("msrun_") and name not in have:
                    teardown[-1].user_properties.append((name, value))
                    have.add(name)
        if self.timelines and teardown:
            entry = test_entry(merger, record, final, [*setup_call, *teardown], attempt.mode)
            self._attach_timeline(teardown[-1], {**entry, "world": attempt.world_dir, "trace": trace})
        again = False
        if rerun is not None:  # as pytest-rerunfailures reports an attempt: up to its failure ("rerun")
            reports = [*setup_call, *teardown]
            failed = next((i for i, r in enumerate(reports) if r.outcome == "rerun"), None)
            if failed is not None:
                reports = reports[: failed + 1]
                again = True
            self.log(item, extras.with_subtests(reports), extras)
        else:
            self.log(item, teardown, extras)
        extras.warnings()
        if not again:
            extras.benchmarks()
        return final, again

    def _attach_timeline(self, report: pytest.TestReport, entry: dict[str, Any]) -> None:
        """The test's timeline on its last report: for the HTML page, and pytest-html's extras."""
        setattr(report, REPORT_ATTR, entry)
        if plugin_loaded(self.config, "html"):
            with contextlib.suppress(ImportError):
                from pytest_html import extras  # type: ignore[import-untyped,import-not-found,unused-ignore]

                from pytest_msrun.plugin.reports.htmlpage import render_test

                report.extras = [*getattr(report, "extras", []), extras.html(render_test(entry))]  # type: ignore[attr-defined]

    def _warn(self, item: pytest.Item, warning: pytest.PytestWarning) -> None:
        """``warning`` as if the test raised it, at its line."""
        warnings.warn_explicit(warning, type(warning), str(item.path), (item.location[1] or 0) + 1)
