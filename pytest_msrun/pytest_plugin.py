"""pytest entry point (``pytest11``): the ``msrun`` marker, options, fixtures, and the role plugins.

* In a normal session (the controller) each ``@pytest.mark.msrun`` test runs as a real msrun
  job and its ranks' results come back as one report per phase.
* Inside a job (``msrun pytest ...``, or a rank the controller started) marked tests run in
  place when the job has their ``worker_num`` ranks, and every rank records its results.
* As the scheduler (``--scheduler=task``) pytest runs no test.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from pytest_msrun.plugin import env as roles
from pytest_msrun.plugin import envscope, options
from pytest_msrun.plugin.fixtures import local_rank, msrun, msrun_tmp_path, rank, world_size
from pytest_msrun.plugin.marker import MARKER_HELP, PARAM, MarkerError, worker_nums

__all__ = ["local_rank", "msrun", "msrun_tmp_path", "rank", "world_size"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("msrun", "multi-rank tests with msrun")
    group.addoption(
        "--msrun-timeout",
        type=float,
        help="seconds a marked test's job may run before every rank's stack is collected and the job "
        "is torn down (default: ini msrun_timeout, else 300; the marker's timeout= wins)",
    )
    group.addoption(
        "--msrun-exit-timeout",
        type=float,
        help="seconds a marked test's ranks may take to exit once every rank's pytest session ended; a "
        "rank still running then hangs at exit and fails the test's teardown (default: ini "
        "msrun_exit_timeout, else 60)",
    )
    group.addoption(
        "--msrun-report",
        metavar="FILE.html",
        help="write one self-contained HTML page of the marked tests: verdicts, every rank's timeline "
        "(phases, collectives, the first failure), outputs, reproduce commands, the environment, a search "
        "box, and links to each rank's log and the job's trace (copied into FILE_files/ beside it) "
        "(first and all: the same as --msrun-detail, as before)",
    )
    group.addoption(
        "--msrun-detail",
        choices=("first", "all"),
        help="failure detail: the first failing rank's traceback and one line per other failing rank "
        "(first, default), or every failing rank's traceback (all)",
    )
    group.addoption(
        "--msrun-trace",
        metavar="DIR",
        help="keep each marked test's job trace (Chrome trace format, for Perfetto) in DIR: one file per "
        "fresh job, one per warm world, one per test whose job never ran (the reason); each test in it (spans "
        "per rank, phases, failures, verdicts)",
    )
    group.addoption(
        "--msrun-inprocess",
        action="store_true",
        help="run marked tests in this process as rank 0 of a one-rank world (for IDE debuggers; a failure of "
        "another rank does not happen there: --pdb stops a failing rank of a normal run on this terminal)",
    )
    group.addoption(
        "--msrun-devices",
        help="devices jobs may use: auto (default: visible-device variables, then NVML), none, "
        "cuda:0,1,... or ascend:0-7",
    )
    group.addoption(
        "--msrun-worlds",
        choices=("warm", "fresh"),
        help="warm (default): marked tests of one shape share a long-lived job, each test isolated and "
        "judged alone, the world restarted after a crash, hang or failure inside it; fresh: each marked "
        "test in processes of its own, forked from its shape's world (as msrun(isolated=True) does for "
        "one test)",
    )
    group.addoption(
        "--msrun-prefetch",
        choices=("on", "off"),
        help="on (default): while a test runs in its warm world, start the world of the next shape "
        "the session will need (within --msrun-max-ranks, when its ranks, the running world's and those "
        "still starting fit this machine's CPUs), so its start-up overlaps the test; off: each world "
        "starts when its first test comes",
    )
    group.addoption(
        "--msrun-max-ranks",
        help="auto (default) or N: the ranks the warm worlds of this pytest process may hold together. An "
        "idle world is kept while a test of its shape is still to come; a world that needs room ends the "
        "worlds needed farthest ahead. auto: the memory available at 512 MiB a rank (shared by xdist's "
        "workers)",
    )
    group.addoption(
        "--msrun-fork-server",
        choices=("on", "off"),
        help="on (default): a template process of this session imports pytest and its plugins once; "
        "each job's msrun and its Python ranks are forked from it rather than started as new "
        "interpreters (where a fork stands for one exactly: same interpreter and start-up variables, "
        "no binding command in front); off: every msrun and rank is a new process",
    )
    group.addoption(
        "--msrun-preload",
        metavar="SPEC",
        help="what the fork server imports before it forks a world's ranks, besides pytest and the plugins: "
        "auto (default): the installed modules the marked tests' modules import (torch, numpy, ...), each "
        "only if its import reads no job variable, opens no device and leaves no thread across a fork; "
        "none; NAME adds a module, -NAME takes one out (comma-separated: auto,-mindspore)",
    )
    group.addoption(
        "--msrun-env-scope",
        choices=("job", "test"),
        help="job (default): a marker's env is its job's environment, each env a world of its own; test: "
        "tests differing only in env share a world, each with its variables set for its setup, call and "
        "teardown (variables launchers and native libraries read at start - MSRUN_, MS_, OMP_, CUDA_, ... "
        "- stay the job's; a test whose variable the ranks read while collecting runs as a fresh job)",
    )
    group.addoption(
        "--msrun-leaks",
        choices=("warn", "error", "off"),
        help="what a test in a warm world leaves behind (threads, child processes, open files, "
        "environment, working directory): a warning (default), a failure, or nothing",
    )
    group.addoption(
        "--msrun-leak-rss",
        metavar="SIZE",
        help="a test in a warm or forking world that grows a rank's resident memory (or a device's "
        "allocated memory) by more than SIZE left it behind, judged as --msrun-leaks says: 200MB, 100MiB, "
        "1GiB, bytes, 0 (off); what first imports of modules and broader fixtures grow is not counted "
        "(default: 100MiB)",
    )
    group.addoption(
        "--msrun-max-rss",
        metavar="SIZE",
        help="a warm world whose rank's resident memory is past SIZE after a test ends after it, and "
        "the next test starts a new one (a warning names the rank): 2GiB, 500MB, ... (default: 0, off)",
    )
    parser.addini("msrun_timeout", "default timeout in seconds of a marked test's job", default="300")
    parser.addini("msrun_exit_timeout", "seconds ranks may take to exit (see --msrun-exit-timeout)", default="60")
    parser.addini("msrun_worlds", "warm or fresh (see --msrun-worlds)", default="warm")
    parser.addini("msrun_prefetch", "on or off (see --msrun-prefetch)", default="on")
    parser.addini("msrun_max_ranks", "auto or N (see --msrun-max-ranks)", default="auto")
    parser.addini("msrun_env_scope", "job or test (see --msrun-env-scope)", default="job")
    parser.addini("msrun_fork_server", "on or off (see --msrun-fork-server)", default="on")
    parser.addini("msrun_preload", "what the fork server preloads (see --msrun-preload)", default="auto")
    parser.addini("msrun_leaks", "warn, error or off (see --msrun-leaks)", default="warn")
    parser.addini("msrun_leak_rss", "memory growth a test may leave (see --msrun-leak-rss)", default="100MiB")
    parser.addini("msrun_max_rss", "a warm world's rank's resident bound (see --msrun-max-rss)", default="0")
    parser.addini("msrun_report", "failure detail: first or all (see --msrun-detail)", default="first")
    parser.addini("msrun_devices", "devices jobs may use (see --msrun-devices)", default="auto")


LOG_CAPTURE = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]):
    """In a rank of this project's msrun, capture through the rank's log instead of temporary files.

    pytest's fd/sys capture keeps a test's output in memory or unlinked files until the phase
    ends, so a rank that crashes loses it. A rank's stdout and stderr are already its log file:
    tests write there directly and each phase's part of the log becomes its captured output.
    """
    role = roles.detect(os.environ)
    if os.environ.get(envscope.TRACK_ENV) and role == roles.RANK:
        envscope.track(os.environ.pop(envscope.TRACK_ENV).split(","))  # a world's rank: what collection reads
    if os.environ.get("MSRUN_COV") and role == roles.RANK:
        from pytest_msrun.plugin.covdata import start_in_rank

        start_in_rank(dict(os.environ))  # the controller runs --cov: measured before conftests load
    if role == roles.CONTROLLER:
        from pytest_msrun.plugin.controller.earlytemplate import fork_session

        fork_session(early_config)  # before any conftest, coverage or capture starts
        _keep_terminal(early_config)
    ns = early_config.known_args_namespace
    use = role == roles.RANK and getattr(ns, "capture", "fd") in ("fd", "sys") and _stdout_is_a_file()
    early_config.stash[LOG_CAPTURE] = use
    if use:
        ns.capture = "no"
    yield
    envscope.wholesale_reads(False)  # plugins configure themselves next: until collection


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection(session: pytest.Session) -> Any:
    """Wholesale reads of the environment count again while tests are collected (see envscope)."""
    envscope.wholesale_reads(True)
    return (yield)


TERMINAL = pytest.StashKey[int]()


def _keep_terminal(config: pytest.Config) -> None:
    """The controller's terminal (stdin, when a tty), kept before pytest's capture points fd 0 at
    /dev/null for the session: the ranks' debugger reads the user's input from it."""
    try:
        if not os.isatty(0):
            return
        fd = os.dup(0)
    except OSError:
        return
    os.set_inheritable(fd, False)
    config.stash[TERMINAL] = fd

    def close() -> None:
        try:
            os.close(fd)
        except OSError:
            pass

    config.add_cleanup(close)


def _stdout_is_a_file() -> bool:
    import stat

    try:
        return stat.S_ISREG(os.fstat(1).st_mode) and stat.S_ISREG(os.fstat(2).st_mode)
    except OSError:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """A rank takes over the controller's options before any plugin is configured: a plugin's
    ``pytest_configure`` may read them, whichever plugin was registered first."""
    if roles.role() in (roles.RANK, roles.FOREIGN):
        options.apply(config)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    where = roles.claim()
    if where in (roles.RANK, roles.FOREIGN):
        from pytest_msrun.plugin.rank.rank import RankPlugin

        plugin = RankPlugin(config, records=where == roles.RANK, log_capture=config.stash.get(LOG_CAPTURE, False))
        config.pluginmanager.register(plugin, "msrun-rank")
        if where == roles.RANK:
            from pytest_msrun.plugin.rank.callphase import CallPhase

            config.pluginmanager.register(CallPhase(plugin.randomly_seed), "msrun-call")
    elif where == roles.SCHEDULER:
        from pytest_msrun.plugin.rank.rank import SchedulerRolePlugin

        config.pluginmanager.register(SchedulerRolePlugin(), "msrun-scheduler-role")
    elif config.getoption("msrun_inprocess"):
        from pytest_msrun.plugin.controller.inprocess import InProcessPlugin

        config.pluginmanager.register(InProcessPlugin(), "msrun-inprocess")
    elif not (getattr(config.option, "collectonly", False) or getattr(config.option, "setuponly", False)):
        # --setup-only and --setup-plan run no test, marked or not: pytest's own protocol shows the fixtures
        from pytest_msrun.plugin.controller.controller import Controller

        config.pluginmanager.register(Controller(config), "msrun-controller")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``msrun(worker_num=[2, 4])`` runs the test once per job size, ids ``worker_num-2`` ... (no
    ``=``: ``-k worker_num-2`` selects one, where ``-k`` cannot parse ``worker_num=2``)."""
    mark = metafunc.definition.get_closest_marker("msrun")
    if mark is None:
        return
    try:
        nums = worker_nums(mark, metafunc.definition.nodeid)
    except MarkerError:
        return  # reported when the item runs
    value = mark.kwargs.get("worker_num", mark.args[0] if mark.args else None)
    if isinstance(value, (list, tuple)):
        metafunc.fixturenames.append(PARAM)
        metafunc.parametrize(PARAM, nums, ids=[f"worker_num-{n}" for n in nums])


@pytest.hookimpl(tryfirst=True)
def pytest_report_to_serializable(config: pytest.Config, report: Any) -> dict[str, Any] | None:
    """A merged report keeps its one-line failure (``[rank 1] AssertionError: ...``) when it is
    sent elsewhere (pytest-xdist's controller, report-log files): pytest's own conversion turns it
    into its text, whose first line is the headline."""
    merge = sys.modules.get("pytest_msrun.plugin.reports.merge")
    if merge is None or not isinstance(getattr(report, "longrepr", None), merge.MergedLongrepr):
        return None
    return merge.to_serializable(report)


@pytest.hookimpl(tryfirst=True)
def pytest_report_from_serializable(config: pytest.Config, data: dict[str, Any]) -> Any:
    if not isinstance(data, dict) or data.get("$report_type") != "TestReport" or "msrun_reprcrash" not in data:
        return None
    from pytest_msrun.plugin.reports.merge import from_serializable

    return from_serializable(data)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    roles.release()
