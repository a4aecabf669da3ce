"""pytest inside a job (every rank runs it): records, output, marked tests in place, timeouts.

Started by the controller, a rank runs one node id and streams its records to the directory in
``MSRUN_PYTEST_REPORT_DIR``. Started by a user (``msrun pytest tests/``), every rank runs the
suite; a marked test runs when the job has its ``worker_num`` ranks (else it is skipped with the
reason) and within its timeout, and the records go to the job's log directory for msrun's table.

Output: a rank's stdout and stderr are its msrun log file. Instead of capturing into temporary
files (lost when a rank segfaults), tests write straight to that log and each phase's part of it
becomes the report's captured output - so whatever a rank wrote before it died is in its log and
in the report.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import sys
import threading
from collections.abc import Generator
from typing import IO, Any

import pytest

from pytest_msrun.control import calls
from pytest_msrun.engine import processes, ranknotes
from pytest_msrun.fileio import make_dirs, open_output, write_whole
from pytest_msrun.netaddr import controller_address
from pytest_msrun.plugin import options
from pytest_msrun.plugin.env import current_rank, current_world
from pytest_msrun.plugin.links import FORK_ENV, WORLD_ENV, WORLD_TOKEN_ENV
from pytest_msrun.plugin.marker import default_timeout, marked_specs
from pytest_msrun.plugin.rank.forked import dump_stacks_on_signals
from pytest_msrun.plugin.rank.suiteclock import SuiteClock, say
from pytest_msrun.plugin.rule.outcomes import STRICT_XPASS
from pytest_msrun.plugin.rule.records import (
    BASETEMP_ENV,
    CACHE_FILE,
    LASTFAILED,
    REPORT_DIR_ENV,
    STEPWISE,
    STEPWISE_FILE,
    RecordWriter,
    encode_json,
    records_path,
    stacks_path,
    wallclock,
)
from pytest_msrun.plugin.stdstreams import StandardStreams, log_file, log_offset, read_log

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pytest_msrun.plugin.rank.rankextras import PastCapture

_getpid = os.getpid  # bound now: a test may patch os.getpid while its phases are recorded


def _strict_xpass(report: pytest.TestReport) -> bool:
    return report.when == "call" and str(report.longrepr).startswith(STRICT_XPASS)


SETTLED = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)


class RankPlugin:
    """Registered in the pytest session of every rank (``records``: this project's jobs only)."""

    def __init__(self, config: pytest.Config, *, records: bool = True, log_capture: bool = False) -> None:
        env = os.environ
        self.config = config
        self.rank = current_rank()
        self.world = current_world()
        self.controlled = bool(env.get(REPORT_DIR_ENV))
        self.randomly_seed = self._common_seed(config)
        self.log = log_file() if log_capture else None  # capture through the log
        self.streams = StandardStreams() if self.log is not None else None  # kept whole across tests
        self.current: tuple[str, str] | None = None  # (nodeid, phase) running now
        self.clock = SuiteClock(self)  # a suite's marked-test timeouts (a controller times its own)
        self.past: PastCapture | None = None  # what tests write with capture off (controlled ranks)
        self.silenced = False  # its terminal reporter writes nowhere (-s in a controlled rank)
        self.writer: RecordWriter | None = None
        self.session_writer: RecordWriter | None = None  # a warm world's, while a test's records are open
        self.test_failed = False
        # a failure other than a strict xfail that passed, in the open test: what would end a fresh
        # job's rank with a non-zero status (and so stop the others)
        self.test_real_failure = False
        self.failed_any = False
        self.real_failure = False  # a failure other than a strict xfail that passed
        self.failed_before_teardown = False  # a failure in a setup or a call (not only in teardowns)
        self.skipped_collectors: set[str] = set()  # modules this rank skipped at collection
        self.session: pytest.Session | None = None
        self.records_dir = ""
        self.stacks: IO[str] | None = None
        self.default_timeout = 0.0
        # MindSpore's own msrun runs the task (this pytest) as its scheduler too: not a rank
        self.scheduler_of_another_job = not records and env.get("MS_ROLE") == "MS_SCHED"
        if not records:
            return
        self.records_dir = directory = env.get(REPORT_DIR_ENV) or os.path.abspath(env.get("MSRUN_LOG_DIR") or ".")
        self.writer = RecordWriter(records_path(directory, self.rank), self.rank, self.world)
        self.stacks = open_output(stacks_path(directory, self.rank))  # lives as long as the session
        dump_stacks_on_signals(self.stacks)
        # Each rank its own temporary directory under the controller's (or the user's --basetemp):
        # pytest empties a given basetemp at start, so ranks sharing one would delete each other's files.
        basetemp = env.get(BASETEMP_ENV) or getattr(config.option, "basetemp", None)
        if basetemp:
            make_dirs(basetemp)  # the test's (made new by the controller), or the user's --basetemp
            config.option.basetemp = os.path.join(basetemp, f"rank{self.rank}")
        xmlpath = getattr(config.option, "xmlpath", None)
        if xmlpath and not self.controlled:
            base, ext = os.path.splitext(xmlpath)
            config.option.xmlpath = f"{base}.rank{self.rank}{ext or '.xml'}"
        # warnings and benchmarks of its tests: for the controller's summary, or a suite's table
        from pytest_msrun.plugin.rank.rankextras import ExtrasRecorder

        config.pluginmanager.register(ExtrasRecorder(self, config), "msrun-rank-extras")
        from pytest_msrun.plugin.rank.debugrank import RankDebugger

        post_mortem = not self.controlled and bool(getattr(config.option, "usepdb", False))
        config.pluginmanager.register(RankDebugger(self.rank, post_mortem, self._running), "msrun-debug")
        address = controller_address(env.get(WORLD_ENV, ""), env)  # None outside a warm world
        if address is not None and self.controlled:  # a warm world's rank: the controller sends tests
            from pytest_msrun.plugin.rank.serve import WorldServer

            token = env.pop(WORLD_TOKEN_ENV, "")
            env.pop(WORLD_ENV, None)
            forking = env.pop(FORK_ENV, "") == "1"
            config.pluginmanager.register(WorldServer(self, address, token, forking), "msrun-world")
        if not self.controlled:
            self.default_timeout = default_timeout(config)
            # msrun prints one table of every test on every rank when the job ends.
            from pytest_msrun.engine.hooks import register

            register(directory, "pytest", "suite-report", env.get("MSRUN_JOB_ID", ""))

    def _running(self) -> str:
        """The node id of the test running now ("" between tests)."""
        return self.current[0] if self.current is not None else ""

    def _write(self, kind: str, **fields: Any) -> None:
        if self.writer is not None:
            self.writer.write(kind, **fields)

    # ---------------------------------------------------------------- session
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session
        if self.controlled and getattr(self.config.option, "capture", "fd") == "no":
            self._quiet_terminal()
        self._write_start()
        capman, log = self.config.pluginmanager.getplugin("capturemanager"), self.log or log_file()
        if self.controlled and self.writer is not None and capman is not None and log:
            from pytest_msrun.plugin.rank.rankextras import PastCapture

            self.past = PastCapture(self, capman, log, keep_spans=self.log is not None)
        cache = getattr(session.config, "cache", None)
        if cache is not None and self.writer is not None and not self.controlled:
            self._hold_cache(cache)

    def _quiet_terminal(self) -> None:
        """Under ``-s`` the controller shows what a rank's tests write as they write it, labelled
        with the rank: the rank's own session header, progress and summary are the controller's
        to show, once - its terminal reporter writes nowhere. An internal error still reaches the
        rank's stderr (pytest writes it there when no reporter takes it)."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        import io

        from _pytest._io import TerminalWriter

        class Discard(io.TextIOBase):
            def write(self, text: str) -> int:
                return len(text)

        reporter._tw = TerminalWriter(Discard())  # type: ignore[arg-type]
        self.silenced = True

    @pytest.hookimpl(tryfirst=True)
    def pytest_internalerror(self, excrepr: Any) -> None:
        if self.silenced:  # (the silenced reporter takes it: pytest's own fallback to stderr, here)
            for line in str(excrepr).split("\n"):
                sys.stderr.write(f"INTERNALERROR> {line}\n")
            sys.stderr.flush()

    def _hold_cache(self, cache: Any) -> None:
        """In a suite, ranks select ``--lf``/``--ff``/``--sw`` tests from the cache as the job found
        it and none writes its last-failed set or its stepwise state: a rank that ended first would
        change what a later one selects. msrun writes both from the job's table
        (:func:`~pytest_msrun.plugin.reports.suite.update_cache`); each rank's stepwise state is kept for it."""
        original = cache.set
        stepwise = os.path.join(self.records_dir, STEPWISE_FILE.format(rank=self.rank))
        try:
            os.unlink(stepwise)  # an earlier job's, in a log directory used again
        except OSError:
            pass

        def set_all_but_selections(key: str, value: object) -> None:
            if key == STEPWISE:
                try:
                    write_whole(stepwise, encode_json(value))
                except (OSError, TypeError, ValueError):
                    pass
            elif key != LASTFAILED:
                original(key, value)

        cache.set = set_all_but_selections
        if self.rank == 0:
            held = {"cache_dir": str(cache._cachedir), "lastfailed": cache.get(LASTFAILED, {})}
            write_whole(os.path.join(self.records_dir, CACHE_FILE), encode_json(held))

    def _write_start(self) -> None:
        self._write(
            "start",
            pid=_getpid(),
            args=list(self.config.invocation_params.args),
            log=log_file() or "",
            main_thread=threading.main_thread().ident,
            job=os.environ.get("MSRUN_JOB_ID", ""),
        )

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        for item, spec in marked_specs(items):  # an invalid marker is reported when the test runs
            if self.scheduler_of_another_job:
                reason = "this process is the scheduler (MS_ROLE=MS_SCHED) of another launcher's job"
            elif spec.worker_num != self.world:
                n = spec.worker_num
                reason = f"needs a job of {n} ranks (msrun --worker_num={n}); this job has {self.world}"
            else:
                continue
            item.add_marker(pytest.mark.skip(reason=reason))

    # pytest-timeout in a rank the controller runs: the controller times the marked test (its job's
    # timeout, stacks of every rank); a timer of the rank's own would cut that report short.
    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item: pytest.Item) -> bool | None:
        return True if self.controlled else None

    pytest_timeout_cancel_timer = pytest_timeout_set_timer

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        """In a rank the controller runs, a test runs once, by pytest's own protocol: a plugin that
        takes the protocol over to run it again or elsewhere (pytest-rerunfailures, flaky,
        pytest-forked) would do so on this rank alone while the others wait in its collectives;
        the controller reruns whole jobs."""
        if not self.controlled:
            return None
        from _pytest import runner

        return runner.pytest_runtest_protocol(item, nextitem)  # pytest's own, ahead of any other plugin's

    def _common_seed(self, config: pytest.Config) -> int | None:
        """pytest-randomly's seed, the same on every rank: the controller's, the one given, or one
        derived from the job (each rank drawing its own would order a suite differently on each)."""
        seed = getattr(config.option, "randomly_seed", None)  # None: pytest-randomly is not installed
        if seed == "default":
            job = os.environ.get("MSRUN_JOB_ID", "")
            if job:
                config.option.randomly_seed = seed = int(hashlib.sha256(job.encode()).hexdigest()[:8], 16)
        return seed if isinstance(seed, int) else None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._write("collected", nodeids=[item.nodeid for item in session.items])
        config = session.config
        seed = getattr(config.option, "randomly_seed", None)
        if options.plugin_loaded(config, "randomly") and isinstance(seed, int):
            # the same order on every rank (collection is done); now each rank its own random
            # streams: pytest-randomly reseeds random, numpy, ... before each test with seed + rank
            config.option.randomly_seed = seed + self.rank

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed or report.skipped:  # a module skipped at collection skips its tests here
            if report.skipped:
                path = report.nodeid.split("::", 1)[0]
                self.skipped_collectors.add(os.path.normpath(os.path.join(str(self.config.rootpath), path)))
            data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
            self._write("collect", data=data)
        if report.nodeid == "" and self.controlled and self.session is not None:
            # The session's own report comes before pytest checks that every requested test was
            # found: one inside a module this rank skipped at collection is skipped, not "not
            # found" (a usage error, exit 4, would make msrun stop the other ranks).
            notfound = getattr(self.session, "_notfound", None)
            if isinstance(notfound, list):
                notfound[:] = [
                    (arg, cols)
                    for arg, cols in notfound
                    if os.path.normpath(str(arg).split("::", 1)[0]) not in self.skipped_collectors
                ]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, None, None]:
        """A strict xfail that passed on this rank fails the test only if it passed on every rank
        (else the test is XFAIL): in a suite it does not count towards ``-x``/``--maxfail`` here,
        so this rank goes on with the others (pytest's session counts it; its limit moves by one)."""
        maxfail = getattr(self.config.option, "maxfail", 0) or 0
        if report.failed and _strict_xpass(report) and not self.controlled and maxfail:
            self.config.option.maxfail = maxfail + 1
        if report.failed:
            self.test_failed = self.failed_any = True
            self.failed_before_teardown |= report.when != "teardown"
            if not _strict_xpass(report):
                self.real_failure = self.test_real_failure = True
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        describe = getattr(report, "_sub_test_description", None)
        if callable(describe) and isinstance(data, dict):  # a subtest's "[msg] (i=1)", as this pytest says it
            data["_subtest.description"] = describe()
        self._write("report", data=data)
        return (yield)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Record pytest's exit status - and end with 0 where a non-zero status would make msrun stop
        the other ranks before their records can decide the verdict: a strict xfail this rank passed
        (the test is XFAIL if another rank fails it), a module this rank skipped at collection."""
        status = int(exitstatus)
        if self.writer is not None and (
            (status == pytest.ExitCode.TESTS_FAILED and self.failed_any and not self.real_failure)
            or (status == pytest.ExitCode.NO_TESTS_COLLECTED and self.skipped_collectors)
        ):
            session.exitstatus = status = pytest.ExitCode.OK
        self._write("finish", exitstatus=status)
        if self.writer is not None and not self.controlled and status in SETTLED:
            # a suite that ran: this rank's result, which must stop no peer still at work - nor
            # must how its process ends after it (a crash at exit, judged on its last test)
            why = "its pytest session ended with failed tests" if status else "its pytest session had ended"
            ranknotes.settle(None, why)
        elif self.writer is not None and status == pytest.ExitCode.TESTS_FAILED and not self.failed_before_teardown:
            # a controller's job whose rank failed only in a teardown (a teardown_class raising):
            # its peers still in their calls finish them - a passed call stays passed
            ranknotes.settle(status, "its pytest session ended with a teardown error")

    # ---------------------------------------------------------------- warm worlds (serve.py)
    def begin_test(self, report_dir: str, nodeid: str) -> RecordWriter:
        """Records of the next test go to its own directory, as a fresh job's would."""
        self.end_test()
        self.session_writer = self.writer
        self.writer = RecordWriter(records_path(report_dir, self.rank), self.rank, self.world)
        self.test_failed = self.test_real_failure = False
        self._write_start()
        self._write("collected", nodeids=[nodeid])
        return self.writer

    def write_late(self, report: pytest.TestReport) -> None:
        """A failed report of the open test written after its phases (a warm world's final teardown)."""
        self.test_failed = self.test_real_failure = True
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self._write("report", data=data, late=True)

    def end_test(self) -> None:
        """Close the open test's records (if any). (No ``finish`` record: the session goes on; how
        the process ends is judged at the world's end.)"""
        if self.session_writer is not None:
            if self.writer is not None:
                self.writer.close()
            self.writer, self.session_writer = self.session_writer, None

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Close the records. A crash while the process exits still dumps every thread's stack into
        the rank's log (pytest's own fault handler has stopped by now), and into the stacks file on
        SIGUSR1 until the process ends (a controller asks a rank that does not exit for them); in
        suite mode a rank that does not exit within the marked tests' timeout records so and ends itself."""
        try:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, AttributeError):  # no usable stderr
            pass
        self.clock.disarm()
        if self.writer is not None:
            self.writer.close()
            if not self.controlled and self.default_timeout:
                self.clock.arm_exit_watchdog(self.writer.fh.name, self.default_timeout)
        if self.streams is not None:
            self.streams.close()
        if "pytest_msrun.plugin.covdata" in sys.modules:  # measured for the controller's --cov
            from pytest_msrun.plugin.covdata import stop

            stop()

    # ---------------------------------------------------------------- phases
    def _phase(self, item: pytest.Item, when: str) -> Generator[None, None, None]:
        self.current = (item.nodeid, when)
        start = log_offset()
        began = wallclock()
        owner = _getpid()
        if when == "setup":  # the tests this rank began, in the order every rank runs them
            calls.place += 1  # its collectives carry it
        self._write("phase", nodeid=item.nodeid, when=when, offset=start)
        if self.streams is not None:
            self.streams.enter()
        try:
            yield
        finally:
            if _getpid() != owner:
                _forked_child_returned(item.nodeid, when)
            if self.streams is not None:
                self.streams.leave()
            self.current = None
            if when == "teardown" and start is not None:  # where this test's part of the log ends
                processes.flush_std_streams()
                self._write("phase_end", nodeid=item.nodeid, when=when, offset=log_offset())
            self._collectives(item.nodeid, when, began)
            if when == "teardown" and "pytest_msrun.plugin.covdata" in sys.modules:
                from pytest_msrun.plugin.covdata import flush

                flush()
            if self.log is not None and start is not None:
                processes.flush_std_streams()
                end = log_offset()
                text = self.past.captured(start, end) if self.past is not None else read_log(self.log, start, end)
                if text:
                    # stdout and stderr are one file in a rank: its output, in order
                    item.add_report_section(when, "stdout", text)

    def _collectives(self, nodeid: str, when: str, began: float) -> None:
        """The builtin collectives this rank ran in the phase (for the timeline of its report)."""
        cluster = sys.modules.get("pytest_msrun.control.cluster")
        if cluster is None:
            return
        spans = [list(entry) for entry in cluster.history if entry[2] >= began]
        if spans:
            self._write("collectives", nodeid=nodeid, when=when, spans=spans[-512:])

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        self.clock.arm(item)
        yield from self._phase(item, "setup")

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        yield from self._phase(item, "call")

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        try:
            yield from self._phase(item, "teardown")
        finally:
            self.clock.disarm()


class SchedulerRolePlugin:
    """pytest started as the scheduler (``--scheduler=task``): it is not a rank and runs no test."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if items:
            config.hook.pytest_deselected(items=list(items))
            items[:] = []

    def pytest_report_header(self, config: pytest.Config) -> str:
        return "msrun: this process has MS_ROLE=MS_SCHED (the scheduler), not a rank: it runs no tests"

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
            session.exitstatus = pytest.ExitCode.OK


def _forked_child_returned(nodeid: str, when: str) -> None:
    """A process the test forked returned into pytest instead of exiting: it ends here, quietly
    (status 0), before it writes the rank's records or serves its world's channel in the rank's
    place (the rank, waiting for it, then hung)."""
    processes.flush_std_streams()
    say(
        f"msrun: a process {nodeid} forked (pid {_getpid()}) returned from its {when} into pytest; it ends "
        "here with status 0 (end a forked child with os._exit())\n"
    )
    os._exit(0)
