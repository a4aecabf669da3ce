"""The controller: pytest's hooks for marked tests. Each marked test is one attempt of the runner
(:mod:`.runner`) - in a world shared with the tests of its shape, in a job of its own, or refused -
ending in one record; its verdict, judged once, becomes one report per phase.

A marked test follows pytest's own protocol: its setup and call are run and reported, then its
teardown keeps exactly what pytest would keep for the next test - which, in a world, is the next
test of the same shape that *this process* will run (:meth:`.worlds.WorldPool.world_next`: pytest's
``nextitem`` and, where the run loop is pytest's own, the rest of ``session.items`` - after
deselection, ``--lf``, reordering and xdist's distribution; ``-x`` and ``--maxfail`` have acted by
then). A world ends within its last test's protocol, so what its ranks' fixtures and processes do
at the end is reported on that test. What ends a world outside a test (a rank gone between tests,
a world the run loop never came back to) is reported as a late teardown error of the last test
that used it - never on a test that did not run there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from typing import Any

import pytest

from pytest_msrun import sizes
from pytest_msrun.engine.slurm import allocation
from pytest_msrun.fileio import make_dirs, unsafe_directory, unsafe_output_dir
from pytest_msrun.pathsearch import which
from pytest_msrun.plugin import envscope, options, rankmemory
from pytest_msrun.plugin.controller.debugserver import NO_TTY, DebugServer
from pytest_msrun.plugin.controller.earlytemplate import EARLY
from pytest_msrun.plugin.controller.forkserver import ForkServerHooks, session_fork_server
from pytest_msrun.plugin.controller.frameworks import PreloadSpecError, parse_spec
from pytest_msrun.plugin.controller.jobs import PYTEST_TIMEOUT, Jobs
from pytest_msrun.plugin.controller.keeping import default_ranks
from pytest_msrun.plugin.controller.pool import ResourcePool, inventory
from pytest_msrun.plugin.controller.reporting import Reporter
from pytest_msrun.plugin.controller.runner import Runner, teardown_failures
from pytest_msrun.plugin.controller.worlds import WorldPool
from pytest_msrun.plugin.marker import MARKER, default_timeout
from pytest_msrun.plugin.reports.merge import Merger
from pytest_msrun.plugin.reports.replay import not_carried
from pytest_msrun.plugin.reports.reportfiles import traces_dir
from pytest_msrun.plugin.reports.timeline import SessionReport
from pytest_msrun.plugin.reports.tracetests import TraceNotes
from pytest_msrun.plugin.rule.outcomes import shown

DEFAULT_EXIT_TIMEOUT = 60.0  # s the ranks may take to exit once every rank's pytest session ended


LATE_REPORTS = "msrun_late_reports"  # an xdist worker's late teardown errors, for its controller


def _report_options(config: pytest.Config) -> tuple[str, SessionReport | None]:
    """The failure detail (``--msrun-detail``; ``--msrun-report=first|all`` as before) and the HTML
    page ``--msrun-report=FILE.html`` asks for (written by the process that reports the session)."""
    report = config.getoption("msrun_report")
    detail = config.getoption("msrun_detail") or config.getini("msrun_report") or "first"
    if report in ("first", "all"):
        return (config.getoption("msrun_detail") or report), None
    if detail not in ("first", "all"):
        raise pytest.UsageError(f"msrun_report = {detail!r} in the ini file: use first or all")
    if report is None:
        return detail, None
    if not report.lower().endswith((".html", ".htm")) or os.path.isdir(report):
        raise pytest.UsageError(
            f"--msrun-report={report}: name an HTML file (report.html) for the page, or first/all for the "
            "failure detail (also --msrun-detail)"
        )
    where = os.path.dirname(os.path.abspath(report))
    if not os.path.isdir(where):
        raise pytest.UsageError(f"--msrun-report={report}: the directory {where} does not exist")
    problem = unsafe_directory(report)
    if problem:  # the page in a place someone else could replace it
        raise pytest.UsageError(f"--msrun-report={report}: {problem}")
    if hasattr(config, "workerinput"):  # an xdist worker: the controller process writes the page
        return detail, None
    return detail, SessionReport(report, config)


def _trace_dir(config: pytest.Config) -> str:
    """``--msrun-trace=DIR``; with an HTML page and no such option, the page's files folder (each
    test links to its job's trace; xdist's workers write there too)."""
    page = config.getoption("msrun_report")
    html = page if page and page.lower().endswith((".html", ".htm")) else ""
    value = config.getoption("msrun_trace") or (traces_dir(html) if html else "")
    if not value:
        return ""
    path = os.path.abspath(value)
    flag = f"--msrun-trace={value}" if config.getoption("msrun_trace") else f"--msrun-report={page} (its traces)"
    problem = unsafe_output_dir(path)
    if problem:
        raise pytest.UsageError(f"{flag}: {problem}")
    try:
        make_dirs(path)
    except OSError as exc:
        raise pytest.UsageError(f"{flag}: cannot use {path} as a directory ({exc})") from None
    return path


def _setting(config: pytest.Config, name: str, default: Any, choices: tuple[str, ...] = ()) -> Any:
    """``--msrun-NAME``, else the ini file's ``msrun_NAME``, else ``default``; one of ``choices`` where given."""
    value = config.getoption(f"msrun_{name}") or config.getini(f"msrun_{name}") or default
    if choices and value not in choices:
        raise pytest.UsageError(f"msrun_{name} = {value!r} in the ini file: use {' or '.join(choices)}")
    return value


def memory_bounds(config: pytest.Config) -> tuple[int, int]:
    """``--msrun-leak-rss`` and ``--msrun-max-rss`` in bytes (0: off); a bad value is a usage error."""
    out = []
    for name, default in (("leak_rss", rankmemory.DEFAULT_LEAK), ("max_rss", rankmemory.DEFAULT_MAX)):
        option = config.getoption(f"msrun_{name}")
        text = option if option is not None else (config.getini(f"msrun_{name}") or default)
        try:
            out.append(sizes.parse_size(text))
        except ValueError as exc:
            where = f"--msrun-{name.replace('_', '-')}" if option is not None else f"msrun_{name} in the ini file"
            raise pytest.UsageError(f"{where}: {exc}") from None
    return out[0], out[1]


class Controller:
    """Registered in a normal pytest session: runs marked tests as jobs."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.style, self.html = _report_options(config)
        try:
            self.inventory = inventory(_setting(config, "devices", "auto"))
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        try:  # this user's port and device pool: a directory of it someone else made or can write is no use
            self.pool = ResourcePool()
        except OSError as exc:
            raise pytest.UsageError(f"msrun: cannot keep the port and device pool: {exc}") from None
        cluster = allocation(os.environ) if which("srun") else None
        self.leaks = _setting(config, "leaks", "warn")
        prefetch = _setting(config, "prefetch", "on", ("on", "off"))
        forking = _setting(config, "fork_server", "on", ("on", "off"))
        scope = _setting(config, "env_scope", "job", envscope.SCOPES)
        # the ranks' breakpoint() and --pdb, on this terminal (said, and skipped, where there is none)
        from pytest_msrun.pytest_plugin import TERMINAL

        usepdb = bool(getattr(config.option, "usepdb", False))
        terminal = config.stash.get(TERMINAL, None)
        self.debug = DebugServer(post_mortem=usepdb, terminal=terminal, steps=cluster is not None)
        self.traces = TraceNotes()  # each test's spans and verdict, added to its job's trace at the job's end
        # each test's timeline rides on its teardown report (the HTML page, pytest-html's extras)
        timelines = self.html is not None or options.plugin_loaded(config, "html")
        self.reporter = Reporter(config, self.style, self.leaks, timelines, self.traces)
        self.forks = (config.stash.get(EARLY, None) or session_fork_server(config)) if forking == "on" else None
        if self.forks is not None:  # its session hooks: when it starts, what it says, its end
            preload = config.getoption("msrun_preload", None) or config.getini("msrun_preload") or "auto"
            try:
                parse_spec(preload)
            except PreloadSpecError as exc:
                raise pytest.UsageError(str(exc)) from None
            config.pluginmanager.register(ForkServerHooks(self.forks, preload), "msrun-fork-server")
        self.jobs = Jobs(
            config,
            debug=self.debug,
            forks=self.forks,
            args=options.command_line(config),
            trace_dir=_trace_dir(config),
            cluster=cluster,
            inventory=self.inventory,
            default_timeout=default_timeout(config),
            exit_timeout=float(_setting(config, "exit_timeout", DEFAULT_EXIT_TIMEOUT)),
        )
        self.worlds = WorldPool(
            self.jobs,
            self.pool,
            mode=_setting(config, "worlds", "warm"),
            env_per_test=scope == "test",  # tests differing only in env share a world
            # a world started ahead inside a Slurm allocation would hold a step's CPUs while idle
            prefetch=prefetch == "on" and cluster is None,
            memory=memory_bounds(config),
            max_ranks=_max_ranks(config),
        )
        self.runner = Runner(self.jobs, self.worlds, leaks_fail=self.leaks == "error")

    # ---------------------------------------------------------------- the session
    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, Any]:
        """Worlds the loop leaves alive (``-x`` after a teardown error, say) end before the session's
        exit status is decided, their ends reported; an interrupted session just stops them."""
        try:
            outcome = yield
        except session.Failed:
            self.worlds.end_all("the session stopped")
            self._report_late_ends()
            raise
        except BaseException:
            self.worlds.stop_all()
            raise
        self.worlds.end_all("no test of its shape was left")
        self._report_late_ends()
        return outcome

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.worlds.stop_all()
        self.traces.flush_all()
        if self.html is not None:
            self.html.write()
            if self.html.error and session.exitstatus == pytest.ExitCode.OK:  # the page asked for is not there
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        self.debug.close()  # its door's count is final once its thread ended
        doors = (("the worlds' doors", self.worlds.strangers), ("the ranks' debugger", self.debug.strangers))
        for where, tally in doors:
            for line in tally.summary(time.monotonic(), force=True):
                terminalreporter.write_line(f"msrun: strangers at {where}: {line}", yellow=True)
        if self.traces.problem:
            terminalreporter.write_line(f"msrun: WARNING: {self.traces.problem}", yellow=True, bold=True)
        if self.html is not None:  # after the progress line's end, at every verbosity
            self.html.announce(terminalreporter)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.html is not None:
            self.html.add(report)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.worlds.stop_all()
        self.debug.close()
        if self.html is not None:  # no terminal summary (--no-summary, an internal error)
            self.html.announce(config.pluginmanager.get_plugin("terminalreporter"))

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Under pytest-randomly, marked tests of one world shape run together (in their shuffled
        order): an order shuffled across shapes would start a world for nearly every test."""
        if not options.plugin_loaded(config, "randomly"):
            return
        blocks: dict[Any, list[pytest.Item]] = {}  # in the order each first came
        for item in items:
            key = self.worlds.key_of(item)
            blocks.setdefault(("shape", key) if key is not None else ("item", id(item)), []).append(item)
        items[:] = [item for block in blocks.values() for item in block]

    def pytest_report_header(self, config: pytest.Config) -> str | list[str] | None:
        lines = not_carried(config)
        seed = getattr(config.option, "randomly_seed", None)
        if options.plugin_loaded(config, "randomly") and isinstance(seed, int):
            lines.append(
                f"msrun: pytest-randomly: marked tests run grouped by world shape; rank r of a job reseeds "
                f"with {seed} + r (every rank collects in the order of {seed})"
            )
        cluster = self.jobs.cluster
        pdb = "msrun: --pdb: a marked test's failing rank"
        if getattr(config.option, "usepdb", False) and self.debug.tty:
            lines.append(f"{pdb} stops in pdb on this terminal, prompt (Pdb rank N)")
        elif getattr(config.option, "usepdb", False):
            lines.append(f"{pdb} cannot stop in pdb here: {NO_TTY}")
        elif cluster is not None:
            lines.append(
                f"msrun: Slurm allocation {cluster.job_id} ({len(cluster.nodes)} nodes): each marked test's "
                "job or world runs as a Slurm step of its own, on the nodes Slurm picks"
            )
        return lines or None

    # ---------------------------------------------------------------- one marked test
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if item.get_closest_marker(MARKER) is None:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        try:
            self.run_item(item, nextitem)
        finally:
            ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        # Collectors this item shares with the next one stay; the others are torn down now,
        # as pytest's own protocol would have done.
        item.session._setupstate.teardown_exact(nextitem)
        return True

    def run_item(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Run ``item`` on its ranks and report it, phase by phase - again, as a whole job on a
        new world, while pytest-rerunfailures grants the failing test reruns (a failure that may be
        rerun is reported as that plugin does: outcome ``rerun``)."""
        reruns = self._reruns(item)
        for count in range(reruns + 1):
            attempt = self.runner.start(item, nextitem)
            self._report_late_ends()  # a world found ended when this test reached it: on its last test
            number = count if count < reruns else None
            setup_call = self.reporter.setup_call(item, attempt.record, number)
            rerun_now = any(r.outcome == "rerun" for r in setup_call)  # failed already: no world kept for it
            record = self.runner.finish(attempt, item, nextitem, rerun_now)
            final, again = self.reporter.final(item, attempt, record, setup_call, number)
            if self.runner.done(attempt, item, final):  # its job ended: its trace is complete
                self.traces.flush(attempt.trace)
            if not again:
                return

    def _reruns(self, item: pytest.Item) -> int:
        """How often pytest-rerunfailures reruns ``item`` when it fails (0 without the plugin)."""
        if not options.plugin_loaded(self.config, "rerunfailures"):
            return 0
        try:
            from pytest_rerunfailures import get_reruns_count  # type: ignore[import-untyped,import-not-found,unused-ignore]

            return int(get_reruns_count(item) or 0)
        except Exception:  # its internals moved: no reruns rather than a broken session
            return 0

    # pytest-timeout (when installed): a marked test's timeout is its job's, on the job's clock (from
    # the test's start, not its world's), ending in the grouped hang report; its own timer, which
    # would interrupt the controller, is not armed for marked tests.
    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        if item.get_closest_marker(MARKER) is None:
            return None
        timeout = getattr(settings, "timeout", None)
        if timeout:
            item.stash[PYTEST_TIMEOUT] = float(timeout)
        return True

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        return True if item.get_closest_marker(MARKER) is not None else None

    def _report_late_ends(self) -> None:
        """Each world's end found since: its last test - already reported - judged again with it,
        and what failed now reported as a late teardown error of that test."""
        cwd = str(self.config.invocation_params.dir)
        for late, record, said in self.runner.late():
            item, trace, verdict = late.item, late.world.job.trace, record.verdict
            self.traces.add(trace, ("warm", late.world.created), verdict, shown(verdict), record.logs, record.run.ended)
            self.traces.flush(trace)
            if teardown_failures(verdict) <= said:
                continue  # nothing the test's own teardown report did not say already
            reports = [r for r in Merger(item, record, self.style, cwd).reports(verdict, ("teardown",)) if r.failed]
            for report in reports:
                report.sections.append(("msrun world", f"reported after the test: its world ended later ({late.why})"))
            if reports and hasattr(self.config, "workerinput"):  # xdist's worker sends only the running item's reports
                data = self.config.workeroutput.setdefault(LATE_REPORTS, [])  # type: ignore[attr-defined]
                data += [self.config.hook.pytest_report_to_serializable(config=self.config, report=r) for r in reports]
            else:
                self.reporter.log(item, reports)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """pytest-xdist's controller: a worker's late teardown errors (a world that ended after
        its last test was reported) are logged here, as a session of its own logs them."""
        for data in getattr(node, "workeroutput", {}).get(LATE_REPORTS, []):
            report = self.config.hook.pytest_report_from_serializable(config=self.config, data=data)
            if report is not None:
                self.config.hook.pytest_runtest_logreport(report=report)


def _max_ranks(config: pytest.Config) -> int:
    """``--msrun-max-ranks`` (ini ``msrun_max_ranks``): N, or auto - :func:`.keeping.default_ranks`
    (shared by an xdist worker's peers)."""
    value = str(_setting(config, "max_ranks", "auto")).strip()
    if value == "auto":
        return default_ranks(int(getattr(config, "workerinput", {}).get("workercount", 1)))
    if not value.isdigit() or int(value) < 1:
        raise pytest.UsageError(f"--msrun-max-ranks / msrun_max_ranks = {value!r}: use auto or a positive count")
    return int(value)
