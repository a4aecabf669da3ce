"""What a marked test's ranks recorded beyond pass and fail, shown by the controller's session.

As pytest-xdist replays its workers' events, the controller replays its ranks' records:

* **warnings** in pytest's warnings summary: one per distinct warning (category, message, place),
  labelled with the ranks that raised it (``[ranks 0, 1] message``);
* **subtests** as pytest's own reports (``SUBPASSED``/``SUBFAILED`` lines and counts), logged before
  the test's call report: one per subtest, failed if it failed on any rank (the first such rank's
  failure shown, labelled), skipped if every rank skipped it, else passed;
* **user properties** (``record_property``): a property every rank recorded with the same value
  once, as recorded; otherwise each rank's as ``name [rank r]``;
* **junitxml**: ``record_testsuite_property`` and ``record_xml_attribute`` of the ranks;
* **pytest-benchmark** measurements: one row per rank (``name [rank r]``) in its table, its JSON
  and its saved runs - ranks measure on their own, and a slow rank is what a user looks for.

The rules are :mod:`.extras`' (pure functions of the ranks' records); this module only turns
records into pytest's objects and hands them to pytest's hooks.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
from collections.abc import Mapping
from typing import Any

import pytest

from pytest_msrun.plugin.options import plugin_loaded
from pytest_msrun.plugin.reports.extras import (
    MergedSubtest,
    attribute_label,
    group_warnings,
    merge_properties,
    merge_subtests,
    rank_label,
    subtests_of,
)
from pytest_msrun.plugin.reports.merge import from_record
from pytest_msrun.plugin.rule.records import RankLog
from pytest_msrun.plugin.stdstreams import tag_lines


# ---------------------------------------------------------------------------- pytest's objects
@functools.cache
def _standin(module: str, name: str) -> type[Warning]:
    return type(name, (UserWarning,), {"__module__": module})


def _category(module: str, name: str) -> type[Warning]:
    """The warning class a rank raised: the controller's own where it has imported it, else a
    stand-in of the same name and module (importing a rank's module here could run its code)."""
    found = getattr(sys.modules.get(module), name, None)
    if isinstance(found, type) and issubclass(found, Warning):
        return found
    return _standin(module, name)


def warning_message(record: Mapping[str, Any], label: str) -> warnings.WarningMessage:
    category = _category(str(record.get("module") or "builtins"), str(record.get("category") or "UserWarning"))
    text = f"{label} {record.get('message', '')}" if label else str(record.get("message", ""))
    try:
        message: Warning = category(text)
    except Exception:  # a category whose constructor wants more
        category = _standin(category.__module__, category.__name__)
        message = category(text)
    lineno = record.get("lineno")
    return warnings.WarningMessage(
        message=message,
        category=category,
        filename=str(record.get("filename") or "?"),
        lineno=lineno if isinstance(lineno, int) else 0,
        line=record.get("line") if isinstance(record.get("line"), str) else None,
    )


class Replay:
    """The extras of one run of one marked test, from its ranks' records."""

    def __init__(self, item: pytest.Item, logs: Mapping[int, RankLog]) -> None:
        self.item = item
        self.config = item.config
        self.tests = {rank: log.test(item.nodeid) for rank, log in sorted(logs.items())}
        self.world = len(logs)

    # ------------------------------------------------------------------ subtests
    def _subtest_report(self, entry: MergedSubtest) -> Any:
        data = entry.reports[entry.shown]
        report = from_record(self.config, {k: v for k, v in data.items() if k != "_ts"})
        if report is None:
            return None
        context, said = getattr(report, "context", None), (data.get("_subtest.context") or {}).get("kwargs")
        if context is not None and isinstance(said, dict):  # as the rank wrote them: pytest 9.2 reprs them
            object.__setattr__(context, "kwargs", dict(said))  # when it makes a report, and again reading one
        sections = []
        for rank in sorted(entry.reports):
            for title, content in entry.reports[rank].get("sections") or []:
                text = tag_lines(str(content), rank) if self.world > 1 else str(content)
                sections.append((f"{title} [rank {rank}]", text))
        report.sections = sections
        report.user_properties = merge_properties(
            {r: [tuple(p) for p in d.get("user_properties") or []] for r, d in entry.reports.items()}
        )
        if entry.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            label = rank_label(entry.failed)
            if crash is not None:
                labelled = dataclasses.replace(crash, message=f"{label} {crash.message}")
                report.longrepr.reprcrash = labelled
                chain = getattr(report.longrepr, "chain", None)
                if chain:  # what pytest's JSON keeps of it (pytest-xdist)
                    chain[-1] = (chain[-1][0], labelled, chain[-1][2])
            elif isinstance(report.longrepr, str):
                report.longrepr = f"{label} {report.longrepr}"
        return report

    def with_subtests(self, reports: list[pytest.TestReport]) -> list[pytest.TestReport]:
        """``reports`` with the subtests' reports before the call's, where pytest logs them."""
        at = next((i for i, r in enumerate(reports) if r.when == "call"), None)
        if at is None:
            return reports
        per_rank = {rank: subtests_of(test) for rank, test in self.tests.items()}
        merged = (self._subtest_report(entry) for entry in merge_subtests({r: s for r, s in per_rank.items() if s}))
        return [*reports[:at], *(report for report in merged if report is not None), *reports[at:]]

    # ------------------------------------------------------------------ warnings
    def warnings(self) -> None:
        per_rank = {rank: test.warnings for rank, test in self.tests.items() if test.warnings}
        for ranks, record in group_warnings(per_rank):
            label = rank_label(ranks) if self.world > 1 else ""
            self.config.hook.pytest_warning_recorded.call_historic(
                kwargs={
                    "warning_message": warning_message(record, label),
                    "when": "runtest",
                    "nodeid": self.item.nodeid,
                    "location": None,
                }
            )

    # ------------------------------------------------------------------ the terminal
    def show_terminal(self, when: str) -> None:
        """What the ranks wrote to the terminal in phase ``when``, where pytest writes it (before
        the phase's report): ``--setup-show``'s lines, the lowest rank's; what a test wrote with
        capture off (``capsys.disabled()``, live logging), every rank's (labelled) - unless ``-s``
        showed the ranks' output as it came."""
        setup_show = self.config.getoption("setupshow", False)
        live = self.config.getoption("capture", "fd") != "no"
        writer = self.config.get_terminal_writer()
        lowest = min(self.tests, default=None)
        for rank, test in self.tests.items():
            for record in test.terminal:
                if record.get("when") != when:
                    continue
                if record.get("kind") == "fixture" and setup_show and rank == lowest:
                    writer.line()
                    writer.write(str(record.get("line")))
                elif record.get("kind") == "uncaptured" and live:
                    text = str(record.get("text") or "")
                    lead = len(text) - len(text.lstrip("\n"))  # the rank's terminal ended a line first
                    writer.write(text[:lead] + (tag_lines(text[lead:], rank) if self.world > 1 else text[lead:]))
        writer.flush()

    def show_item(self) -> None:
        """``--setup-show``: the test's line after its setup passed, as pytest writes it."""
        if self.config.getoption("setupshow", False):
            import inspect

            from _pytest.runner import show_test_item

            # pytest 9.2 added add_space (a space before the result's letter, unless --setup-only)
            takes = "add_space" in inspect.signature(show_test_item).parameters
            kwargs = {"add_space": not self.config.getoption("setuponly", False)} if takes else {}
            show_test_item(self.item, **kwargs)

    # ------------------------------------------------------------------ junitxml
    def junit(self) -> None:
        """``record_testsuite_property`` and ``record_xml_attribute`` of the ranks, into the
        controller's junitxml (before the test's last report, which writes its testcase): a suite
        property every rank gave alike once, else per rank (``name [rank 1]``); an attribute
        likewise (``name_rank1``)."""
        from _pytest.junitxml import xml_key

        xml = self.config.stash.get(xml_key, None)
        if xml is None:
            return
        suite, attributes = (
            {
                rank: [(str(x.get("name")), str(x.get("value"))) for x in test.junit if x.get("what") == what]
                for rank, test in self.tests.items()
            }
            for what in ("suite_property", "attribute")
        )
        if any(suite.values()):
            for name, value in merge_properties(suite):
                xml.add_global_property(name, value)
        if any(attributes.values()):
            reporter = xml.node_reporter(self.item.nodeid)
            for name, value in merge_properties(attributes, attribute_label):
                reporter.add_attribute(name, value)

    # ------------------------------------------------------------------ pytest-benchmark
    def benchmarks(self) -> None:
        """Each rank's measurements as rows of pytest-benchmark's session."""
        session = getattr(self.config, "_benchmarksession", None)
        if session is None or not isinstance(getattr(session, "benchmarks", None), list):
            return
        try:
            from pytest_benchmark.stats import Metadata  # type: ignore[import-untyped,import-not-found,unused-ignore]
        except ImportError:
            return
        metas = [_metadata(Metadata, record, rank) for rank, test in self.tests.items() for record in test.benchmarks]
        session.benchmarks += [meta for meta in metas if meta is not None]


def _metadata(metadata_class: Any, record: Mapping[str, Any], rank: int) -> Any:
    data = record.get("data")
    if not isinstance(data, list) or not data or not all(isinstance(x, (int, float)) for x in data):
        return None
    extra = dict(record.get("extra_info") or {}) if isinstance(record.get("extra_info"), dict) else {}
    extra["msrun_rank"] = rank
    fixture = types.SimpleNamespace(  # what pytest-benchmark's Metadata reads of its fixture
        name=f"{record.get('name', '')} [rank {rank}]",
        fullname=f"{record.get('fullname', '')} [rank {rank}]",
        group=record.get("group"),
        param=record.get("param"),
        params=record.get("params"),
        extra_info=extra,
        cprofile_stats=None,
        has_error=False,
    )
    given = record.get("options")
    options: dict[str, Any] = dict(given) if isinstance(given, dict) else {}
    try:
        meta = metadata_class(fixture, int(record.get("iterations") or 1), options)
        for value in data:
            meta.stats.update(float(value))
    except Exception:  # another pytest-benchmark's internals: the row is left out
        return None
    return meta


# Plugins whose work in a rank does not come back (option dest - "": whenever the plugin is active -,
# plugin name, what the user is told).
NOT_CARRIED = (
    (
        "",
        "flaky",
        "flaky's reruns do not apply to marked tests (a rank cannot rerun a test alone while the others "
        "wait in its collectives): pytest-rerunfailures' do (--reruns, @pytest.mark.flaky), as whole jobs",
    ),
    (
        "",
        "syrupy",
        "syrupy: snapshots that marked tests assert are checked in their ranks, unseen by this session's "
        "syrupy: run them with --snapshot-disable-unused (else it counts them unused: a passing run exits 1, "
        "and --snapshot-update deletes them)",
    ),
    (
        "benchmark_cprofile",
        "benchmark",
        "pytest-benchmark's cProfile tables of marked tests are not brought back: each rank prints its own "
        "in its log (worker_<rank>.log)",
    ),
    (
        "memray",
        "memray",
        "pytest-memray: marked tests are measured in their ranks (limit_memory and limit_leaks judge each "
        "rank); its report shows this process only, and a warm world's ranks keep memray's descriptors open "
        "(reported as left behind: --msrun-leaks=off)",
    ),
    (
        "",
        "pytest_subtests.plugin",
        "pytest-subtests: a marked test whose subtests failed fails, as pytest's own subtests (pytest 9) "
        "have it; pytest-subtests passes such a test (each subtest's failure is reported either way)",
    ),
    (
        "testmon",
        "pytest-testmon",
        "pytest-testmon traces this process only: marked tests run in their ranks (without testmon), so it "
        "does not know what code they depend on and may deselect one whose code changed",
    ),
    (
        "profile",
        "profiling",
        "pytest-profiling profiles this process only: marked tests run in their ranks and are not profiled "
        "(--msrun-inprocess runs them here)",
    ),
)


def not_carried(config: pytest.Config) -> list[str]:
    """What the user is told at the start: active plugins whose work in the ranks is lost."""
    return [
        f"msrun: {text}"
        for dest, plugin, text in NOT_CARRIED
        if plugin_loaded(config, plugin) and (not dest or getattr(config.option, dest, None))
    ]
