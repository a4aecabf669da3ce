"""What a rank's pytest session records beyond its reports, written to the rank's records.

Registered beside :class:`~pytest_msrun.plugin.rank.rank.RankPlugin` in a rank the controller runs,
as pytest-xdist's worker forwards what its session records: each warning a test raised
(``warning``: category, message, where), and each benchmark pytest-benchmark measured
(``benchmark``: its name, options and raw timings), and what a test gave junitxml
(``junit``: ``record_testsuite_property``, ``record_xml_attribute``). The controller replays them
(:mod:`pytest_msrun.plugin.reports.replay`). Subtest reports already travel as reports; here their
progress letter is kept out of the test's captured output (the rank's output is its log, and a
subtest's report is logged in the middle of the call phase).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from pytest_msrun.engine import processes
from pytest_msrun.plugin.options import JUNITXML, SETUPSHOW
from pytest_msrun.plugin.stdstreams import log_offset, read_log

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pytest_msrun.plugin.rank.rank import RankPlugin

MAX_WARNINGS = 200  # per test and rank: a warning in a loop is one entry per place anyway
MAX_TIMINGS = 200_000  # per benchmark: its rounds, as pytest-benchmark keeps them


def warning_fields(message: Any) -> dict[str, Any]:
    """A ``warnings.WarningMessage`` as JSON: the category by module and name, never the object."""
    category = getattr(message, "category", None) or UserWarning
    return {
        "category": getattr(category, "__name__", "UserWarning"),
        "module": getattr(category, "__module__", "builtins"),
        "message": str(getattr(message, "message", "")),
        "filename": str(getattr(message, "filename", "") or ""),
        "lineno": int(getattr(message, "lineno", 0) or 0),
        "line": getattr(message, "line", None),
    }


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def benchmark_fields(bench: Any) -> dict[str, Any] | None:
    """One pytest-benchmark ``Metadata`` as JSON (None: it has no timings or cannot be carried)."""
    try:
        data = [float(x) for x in bench.stats.data]
        if not data or len(data) > MAX_TIMINGS or bench.fixture.has_error or not all(map(math.isfinite, data)):
            return None
        flat = bench.as_dict(include_data=False, stats=False)
    except Exception:  # another pytest-benchmark's internals: nothing rather than a broken rank
        return None
    return {
        "name": str(flat.get("name", "")),
        "fullname": str(flat.get("fullname", "")),
        "group": flat.get("group"),
        "param": flat.get("param"),
        "params": flat.get("params"),
        "extra_info": dict(flat.get("extra_info") or {}),
        "options": {str(k): _plain(v) for k, v in (flat.get("options") or {}).items()},
        "iterations": int(getattr(bench, "iterations", 1) or 1),
        "data": data,
    }


class RankJunit:
    """Stands in a rank for pytest's junitxml writer (only the controller writes the file):
    ``record_testsuite_property`` and ``record_xml_attribute`` become records."""

    def __init__(self, rank_plugin: RankPlugin, family: str) -> None:
        self.rank_plugin = rank_plugin
        self.family = family

    def add_global_property(self, name: str, value: object) -> None:
        self.rank_plugin._write("junit", what="suite_property", name=str(name), value=str(value))

    def node_reporter(self, report: Any) -> Any:
        nodeid = str(getattr(report, "nodeid", report))

        def add_attribute(name: str, value: object) -> None:
            self.rank_plugin._write("junit", what="attribute", nodeid=nodeid, name=str(name), value=str(value))

        return types.SimpleNamespace(add_attribute=add_attribute)


class PastCapture:
    """What a test writes with capture off - ``capsys.disabled()``, live logging: whatever goes
    through pytest's ``global_and_fixture_disabled`` - lands in the rank's log, its terminal. Each
    such write is recorded (``uncaptured``) for the controller to show where pytest would, and
    (``keep_spans``: a rank capturing through its log) kept out of the phase's captured output."""

    def __init__(self, rank_plugin: RankPlugin, capman: Any, log: str, keep_spans: bool) -> None:
        self.rank_plugin = rank_plugin
        self.log = log
        self.keep_spans = keep_spans
        self.spans: list[tuple[int, int]] = []
        original = capman.global_and_fixture_disabled

        @contextlib.contextmanager
        def disabled() -> Iterator[None]:
            with original():
                start = log_offset() if rank_plugin.current is not None else None
                try:
                    yield
                finally:
                    if start is not None:
                        self._written(start)

        capman.global_and_fixture_disabled = disabled

    def _written(self, start: int) -> None:
        processes.flush_std_streams()
        end, current = log_offset(), self.rank_plugin.current
        if end is None or end <= start or current is None:
            return
        if self.keep_spans:
            self.spans.append((start, end))
        text = read_log(self.log, start, end)
        self.rank_plugin._write("uncaptured", nodeid=current[0], when=current[1], text=text)

    def captured(self, start: int, end: int | None) -> str:
        """The log from ``start`` to ``end`` (a phase's) but what was written past capture."""
        spans, self.spans = sorted(s for s in self.spans if s[0] >= start), []
        pieces, at = [], start
        for first, last in spans:
            pieces.append(read_log(self.log, at, first))
            at = last
        pieces.append(read_log(self.log, at, end))
        return "".join(pieces)


SCOPE_INDENT = {"session": 0, "package": 1, "module": 2, "class": 3, "function": 4}  # as --setup-show indents


class FixtureShow:
    """``--setup-show`` on the controller: each fixture this rank sets up or tears down, recorded
    as the line pytest's own would write (the controller shows the lowest rank's)."""

    def __init__(self, rank_plugin: RankPlugin) -> None:
        self.rank_plugin = rank_plugin
        self.params: dict[int, Any] = {}  # id(fixturedef) -> the parameter it was set up with

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Generator[None, Any, Any]:
        try:
            return (yield)
        finally:
            if hasattr(request, "param"):
                ids = fixturedef.ids
                param = (ids(request.param) if callable(ids) else ids[request.param_index]) if ids else request.param
                self.params[id(fixturedef)] = param
            self._record(fixturedef, "SETUP")

    def pytest_fixture_post_finalizer(self, fixturedef: Any, request: Any) -> None:
        if fixturedef.cached_result is not None:
            self._record(fixturedef, "TEARDOWN")
            self.params.pop(id(fixturedef), None)

    def _record(self, fixturedef: Any, msg: str) -> None:
        from _pytest._io.saferepr import saferepr

        scope = str(fixturedef.scope)
        line = " " * 2 * SCOPE_INDENT.get(scope, 4) + f"{msg:<8} {scope[0].upper()} {fixturedef.argname}"
        deps = sorted(arg for arg in fixturedef.argnames if arg != "request")
        if msg == "SETUP" and deps:
            line += " (fixtures used: {})".format(", ".join(deps))
        if id(fixturedef) in self.params:
            line += f"[{saferepr(self.params[id(fixturedef)], maxsize=42)}]"
        nodeid, when = self.rank_plugin.current or ("", "teardown")
        self.rank_plugin._write("fixture", nodeid=nodeid, when=when, line=line)


class ExtrasRecorder:
    """Records a rank's warnings and benchmarks, test by test, through the rank plugin's writer."""

    def __init__(self, rank_plugin: RankPlugin, config: pytest.Config) -> None:
        self.rank_plugin = rank_plugin
        self.config = config
        self.benchmarks_seen = 0
        self.warnings: dict[str, int] = {}
        if config.stash.get(JUNITXML, False) and config.pluginmanager.hasplugin("junitxml"):
            from _pytest.junitxml import xml_key

            if config.stash.get(xml_key, None) is None:  # pytest's own unregisters it at the end
                junit = RankJunit(rank_plugin, str(config.getini("junit_family")))
                config.stash[xml_key] = junit  # type: ignore[misc]
                config.pluginmanager.register(junit, "msrun-rank-junit")
        if config.stash.get(SETUPSHOW, False):
            config.pluginmanager.register(FixtureShow(rank_plugin), "msrun-rank-setupshow")

    def pytest_warning_recorded(self, warning_message: Any, when: str, nodeid: str, location: Any) -> None:
        if when != "runtest" or not nodeid:
            return  # collection and configuration warnings: the controller's own session raises them too
        count = self.warnings.get(nodeid, 0)
        if count >= MAX_WARNINGS:
            return
        self.warnings[nodeid] = count + 1
        self.rank_plugin._write("warning", nodeid=nodeid, **warning_fields(warning_message))

    @pytest.hookimpl(wrapper=True)
    def pytest_report_teststatus(self, report: pytest.TestReport, config: pytest.Config) -> Generator[None, Any, Any]:
        status = yield
        subtest = type(report).__name__ == "SubtestReport" and self.rank_plugin.current is not None
        if subtest and isinstance(status, tuple) and len(status) == 3:
            return (status[0], "", "")  # its letter or word (-v) would land in the test's own output
        return status

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """The benchmarks measured since the last report, after a test's call or teardown."""
        if report.when not in ("call", "teardown") or type(report).__name__ == "SubtestReport":
            return
        benchmarks = getattr(getattr(self.config, "_benchmarksession", None), "benchmarks", None)
        if not isinstance(benchmarks, list) or len(benchmarks) <= self.benchmarks_seen:
            return
        new = benchmarks[self.benchmarks_seen :]
        self.benchmarks_seen = len(benchmarks)
        for bench in new:
            fields = benchmark_fields(bench)
            if fields is not None:
                self.rank_plugin._write("benchmark", nodeid=report.nodeid, **fields)
