"""Verdicts that must hold in every mode: each scenario runs as marked tests in processes of their
own (``--msrun-worlds=fresh``, and ``isolated=True`` in a warm session: forked from a forking
world's templates), in warm worlds (the default) and as a suite inside one job (``pmsrun ...
pytest``), and no mode may call a failing test passed or exit 0 for it.

Ranks synchronise by events (a file the other rank writes, its process going away), never by
sleeping for the other rank.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

import pytest
from conftest import MARK, job_args, wait_gone

HEAD = """
import atexit, ctypes, os, signal, sys, threading, time, unittest
import pytest

RANK = int(os.environ.get("RANK_ID", "0"))


def crash():
    sys.stdout.flush()
    ctypes.string_at(0)


def wait_for(predicate, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def all_ranks_reach(name, count=2):
    # a barrier through files in the job's log directory (no collective: a teardown may use it)
    ready = os.path.join(os.environ.get("MSRUN_LOG_DIR", "."), name)
    os.makedirs(ready, exist_ok=True)
    open(os.path.join(ready, str(RANK)), "w").close()
    wait_for(lambda: len(os.listdir(ready)) == count)


def peer_pid(shared, rank):
    path = shared / f"pid{rank}"
    wait_for(lambda: path.exists() and path.read_text().strip())  # created, then written
    return int(path.read_text())
"""


@dataclass
class Scenario:
    name: str
    body: str
    # plugin modes (fresh and warm): pytest's counts that must be present, and counts that must be 0
    counts: dict[str, int] = field(default_factory=dict)
    never: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()  # in no mode's output
    seconds: float = 0.0  # plugin modes: the session takes less than this (0: no bound)
    suite_ok: bool = False  # pytest (plugin modes) and msrun (suite mode) exit 0; else 1 and non-zero
    suite_patterns: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    modes: tuple[str, ...] = ("fresh", "warm", "suite")


SCENARIOS = [
    Scenario(
        "crash_in_a_thread_after_passing_while_a_peer_is_in_its_call",
        """
class CrashOnceTheCallIsReported:
    # trylast: after every other plugin's pytest_runtest_logreport, msrun's record of the call
    # included - the thread crashes a rank that has already passed, whatever the machine's load
    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            threading.Thread(target=crash).start()


@pytest.mark.msrun(worker_num=2)
def test_it(rank, msrun_tmp_path, request):
    (msrun_tmp_path / f"pid{rank}").write_text(str(os.getpid()))
    if rank == 1:
        request.config.pluginmanager.register(CrashOnceTheCallIsReported())
        return
    assert wait_for(lambda: gone(peer_pid(msrun_tmp_path, 1))), "rank 1 never went away"
    raise AssertionError("rank 0 would fail")
""",
        never=("passed",),
        patterns=(r"rank 1 .*SIGSEGV",),
        suite_patterns=(r"test_it\s+\S.*\s(failed|error)$", r"rank 1 .*SIGSEGV"),
    ),
    Scenario(
        "crash_at_exit_after_passing_while_a_peer_is_in_its_call",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank, msrun_tmp_path):
    (msrun_tmp_path / f"pid{rank}").write_text(str(os.getpid()))
    if rank == 1:
        atexit.register(crash)
        return
    wait_for(lambda: gone(peer_pid(msrun_tmp_path, 1)), 3.0)
    raise AssertionError("rank 0 would fail")
""",
        never=("passed",),
        patterns=(r"rank 1 .*SIGSEGV",),
        suite_patterns=(r"rank 1 .*SIGSEGV",),
    ),
    *[
        Scenario(
            f"every_rank_passes_then_{name}_at_exit",
            f"""
@pytest.mark.msrun(worker_num=2)
def test_it(rank, msrun_tmp_path):
    def at_exit():  # once every rank's session is over (none is still in its test), then {name}
        (msrun_tmp_path / f"exiting{{rank}}").touch()
        wait_for(lambda: len(list(msrun_tmp_path.glob("exiting*"))) == 2)
        ({how})()

    atexit.register(at_exit)
""",
            counts={"passed": 1, "errors": 1},
            patterns=(r"reported every phase, then " + words,),
            suite_patterns=(r"test_it\s+.*crashed \([^)]*\) at exit.*\s+error$",),
        )
        for name, how, words in (
            ("segfaults", "crash", r"killed by SIGSEGV"),
            ("exits_3", "lambda: os._exit(3)", r"exited with code 3"),
            ("exits_2", "lambda: os._exit(2)", r"exited with code 2"),
        )
    ],
    *[
        Scenario(  # msrun stopped rank 0 in its last test: its verdict was rank 1's crash, not its own
            f"a_rank_{name}_at_exit_while_its_peer_still_runs_its_last_test",
            f"""
def test_one(rank):
    pass


def test_two(rank, msrun_tmp_path):
    (msrun_tmp_path / f"pid{{rank}}").write_text(str(os.getpid()))
    if rank == 1:
        atexit.register({how})
        return
    assert wait_for(lambda: gone(peer_pid(msrun_tmp_path, 1))), "rank 1 never ended"
""",
            suite_patterns=(
                r"test_one\s+passed\s+passed\s+passed$",
                r"test_two\s+passed\s+crashed \([^)]*\) at exit\s+error$",
                words,
            ),
            absent=(r"stopped", r"did not finish"),
            modes=("suite",),
        )
        for name, how, words in (
            ("segfaults", "crash", r"rank 1 reported every phase, then killed by SIGSEGV"),
            ("exits_3", "lambda: os._exit(3)", r"rank 1 reported every phase, then exited with code 3"),
        )
    ],
    Scenario(
        "a_rank_hangs_at_exit",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank):
    if rank == 1:
        threading.Thread(target=threading.Event().wait, name="forever").start()
""",
        counts={"passed": 1, "errors": 1},
        patterns=(r"rank 1 reported every phase, then did not exit within 3 s", r"line \d+ in _shutdown"),
        suite_patterns=(r"test_it\s+passed\s+hung at exit\s+error",),
        args=("--msrun-exit-timeout=3", "--msrun-timeout=8"),
    ),
    Scenario(
        "a_teardown_error_on_one_rank_while_the_other_is_in_its_call",
        """
@pytest.fixture
def broken_on_1(rank):
    yield
    if rank == 1:
        raise RuntimeError("teardown broke on rank 1")


@pytest.mark.msrun(worker_num=2)
def test_it(rank, broken_on_1, msrun_tmp_path):
    (msrun_tmp_path / f"pid{rank}").write_text(str(os.getpid()))
    if rank == 0:
        wait_for(lambda: gone(peer_pid(msrun_tmp_path, 1)), 3.0)
""",
        counts={"errors": 1},
        patterns=(r"teardown broke on rank 1",),
        suite_patterns=(r"teardown broke on rank 1|rank 1 .*error",),
    ),
    *[
        Scenario(
            f"{name}_inside_a_rank",
            f"""
@pytest.mark.msrun(worker_num=2)
def test_it(rank):
    if rank == 1:
        {how}
""",
            counts={"failed": 1},
            never=("passed",),
            patterns=(r"\[rank 1\]|rank 1 ",),
            suite_patterns=(r"test_it\s+.*(crashed|failed|stopped).*\sfailed$",),
        )
        for name, how in (("keyboard_interrupt", "raise KeyboardInterrupt"), ("os_exit_2", "os._exit(2)"))
    ],
    Scenario(
        "a_failing_unittest_subtest_on_one_rank",
        """
@pytest.mark.msrun(worker_num=2)
class TestSub(unittest.TestCase):
    def test_it(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertFalse(RANK == 1 and i == 1, "subtest 1 fails on rank 1")
""",
        never=("passed",),
        patterns=(r"subtest 1 fails on rank 1",),
        suite_patterns=(r"test_it\s+passed\s+failed\s+failed",),
    ),
    Scenario(
        "a_failing_pytest_subtest_on_one_rank",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank, subtests):
    for i in range(3):
        with subtests.test(i=i):
            assert not (rank == 1 and i == 2), "subtest 2 fails on rank 1"
""",
        never=("passed",),
        patterns=(r"subtest 2 fails on rank 1",),
        suite_patterns=(r"test_it\s+passed\s+failed\s+failed",),
    ),
    Scenario(
        "every_rank_skips_in_a_different_phase",
        """
@pytest.fixture
def skip_on_1(rank):
    if rank == 1:
        pytest.skip("rank 1 skips in its fixture")


@pytest.mark.msrun(worker_num=2)
def test_it(rank, skip_on_1):
    pytest.skip("rank 0 skips in the body")
""",
        counts={"skipped": 1},
        never=("passed", "failed", "errors"),
        suite_ok=True,
        suite_patterns=(r"test_it\s+skipped\s+skipped\s+skipped",),
    ),
    Scenario(  # plain pytest's capture passes it: so must a rank's log (it raised UnicodeEncodeError)
        "a_passing_test_prints_a_lone_surrogate",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank):
    print("lone \\ud800 and escaped \\udc80 surrogates")
    sys.stderr.write("\\udfff\\n")
""",
        counts={"passed": 1},
        never=("failed", "errors"),
        suite_ok=True,
        suite_patterns=(r"test_it\s+passed\s+passed\s+passed",),
    ),
    Scenario(  # plain pytest passes them: the rank's own code called what the test had patched
        "tests_patch_what_the_ranks_own_code_calls",
        """
import builtins, json
from unittest import mock


@pytest.mark.msrun(worker_num=2)
def test_json_dumps(rank, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("json.dumps is the test's")

    monkeypatch.setattr(json, "dumps", broken)


@pytest.mark.msrun(worker_num=2)
def test_open(rank, monkeypatch):
    monkeypatch.setattr(builtins, "open", mock.mock_open(read_data="the test's"))


@pytest.mark.msrun(worker_num=2)
def test_getpid(rank, monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 1)


@pytest.mark.msrun(worker_num=2)
def test_after(rank):
    json.dumps(rank)
""",
        counts={"passed": 4},
        never=("failed", "errors"),
        suite_ok=True,
        suite_patterns=tuple(
            rf"test_{name}\s+passed\s+passed\s+passed" for name in ("json_dumps", "open", "getpid", "after")
        ),
    ),
    Scenario(  # as under plain pytest's capture (it returned "": a rank's stdin is /dev/null)
        "reading_stdin_raises_as_under_pytests_capture",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank):
    sys.stdin.read()
""",
        counts={"failed": 1},
        never=("passed",),
        patterns=(r"OSError: pytest: reading from stdin while output is captured",),
        suite_patterns=(r"test_it\s+failed\s+failed\s+failed", r"reading from stdin while output is captured"),
    ),
    Scenario(  # it failed "rank 1 left the job (it called finalize())" when rank 0 came first (a race)
        "the_test_after_one_that_finalizes_inits_again",
        """
@pytest.mark.msrun(worker_num=2)
def test_finalizes(rank):
    from pytest_msrun import cluster

    cluster.init()
    cluster.barrier()
    cluster.finalize()


@pytest.mark.msrun(worker_num=2)
def test_next(rank):
    from pytest_msrun import cluster

    if rank == 1:
        wait_for(lambda: False, 1.0)  # rank 0 enters the barrier first (with the bug: failed at once)
    cluster.init()
    cluster.barrier()
    assert cluster.all_gather_object(rank) == [0, 1]
""",
        counts={"passed": 2},
        never=("failed", "errors"),
        suite_ok=True,
        suite_patterns=(r"test_next\s+passed\s+passed\s+passed",),
    ),
    Scenario(  # the child served the warm world in the rank's place; the rank hung at exit (60 s)
        "a_child_the_test_forks_returns_into_pytest",
        """
@pytest.mark.msrun(worker_num=2)
def test_forks(rank):
    pid = os.fork()
    if pid:
        assert os.waitpid(pid, 0)[1] == 0


@pytest.mark.msrun(worker_num=2)
def test_later(rank, msrun):
    msrun.barrier()
""",
        counts={"passed": 2},
        never=("failed", "errors"),
        seconds=30,
        suite_ok=True,
        suite_patterns=(r"test_forks\s+passed\s+passed\s+passed", r"test_later\s+passed\s+passed\s+passed"),
        absent=(r"hangs at exit",),
    ),
    Scenario(  # a suite's rank wrote the inner session's tests into its records (and its end)
        "a_test_runs_pytest_main_in_a_rank",
        """
@pytest.mark.msrun(worker_num=2)
def test_runs_pytest_main(rank, tmp_path):
    inner = "def test_inner_one():\\n    pass\\n\\n\\ndef test_inner_fails():\\n    assert False\\n"
    (tmp_path / "test_inner.py").write_text(inner)
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:rerunfailures", str(tmp_path)]
    assert pytest.main(args) == 1


@pytest.mark.msrun(worker_num=2)
def test_after(rank):
    pass
""",
        counts={"passed": 2},
        never=("failed", "errors"),
        suite_ok=True,
        suite_patterns=(r"test_runs_pytest_main\s+passed\s+passed\s+passed", r"2 test\(s\): 2 passed"),
        absent=(r"test_inner\.py::test_inner_\w+\s+(passed|failed|crashed|not run)",),  # a table's row
    ),
    Scenario(  # it paired with rank 1's barrier in the next test: everything passed, exit 0
        "a_teardown_barrier_only_rank_0_enters",
        """
@pytest.fixture
def lonely_teardown(rank):
    from pytest_msrun import cluster

    cluster.init()
    yield
    if rank == 0:
        cluster.barrier()


@pytest.mark.msrun(worker_num=2)
def test_first(rank, lonely_teardown):
    pass


@pytest.mark.msrun(worker_num=2)
def test_next(rank):
    from pytest_msrun import cluster

    cluster.init()
    cluster.barrier()
""",
        counts={"passed": 2, "errors": 1},
        patterns=(r"barrier #1 cannot complete: rank 1 (has left test_first's call|left the test)",),
        suite_patterns=(r"test_first\s+error\s+passed\s+error$", r"test_next\s+passed\s+passed\s+passed$"),
        modes=("warm", "suite"),
    ),
    Scenario(  # rank 0's setup barrier paired with rank 1's in a later, innocent test: both failed
        "a_module_fixture_raises_on_rank_1_before_its_barrier",
        """
@pytest.fixture(scope="module")
def shared(rank):
    from pytest_msrun import cluster

    cluster.init()
    if rank == 1:
        raise RuntimeError("rank 1's module fixture fails")
    cluster.barrier()


@pytest.mark.msrun(worker_num=2)
def test_a(rank, shared):
    pass


@pytest.mark.msrun(worker_num=2)
def test_b(rank, shared):
    pass


@pytest.mark.msrun(worker_num=2)
def test_innocent(rank):
    from pytest_msrun import cluster

    cluster.init()
    cluster.barrier()
""",
        counts={"passed": 1, "errors": 2},
        never=("failed",),
        patterns=(r"rank 1's module fixture fails",),
        suite_patterns=(r"test_innocent\s+passed\s+passed\s+passed$", r"test_a\s+error\s+error\s+error$"),
    ),
    Scenario(  # msrun stopped rank 1 in its call when rank 0 exited 1: a passed call became FAILED
        "a_teardown_class_raising_on_rank_0_of_a_task_scheduler_job",
        """
class TestGroup:
    @classmethod
    def teardown_class(cls):
        if RANK == 0:
            raise RuntimeError("teardown_class fails on rank 0")

    @pytest.mark.msrun(worker_num=2, scheduler="task")
    def test_one(self, rank, msrun_tmp_path):
        (msrun_tmp_path / f"pid{rank}").write_text(str(os.getpid()))
        if rank == 1:  # still in its call when rank 0's session has ended with the error
            wait_for(lambda: gone(peer_pid(msrun_tmp_path, 0)), 5.0)
""",
        counts={"passed": 1, "errors": 1},
        never=("failed",),
        patterns=(r"RuntimeError: teardown_class fails on rank 0",),
        modes=("fresh", "warm"),
    ),
    Scenario(  # rank 0's records were stamped by its frozen clock: it was "failed first"
        "a_rank_that_freezes_time_time_fails_after_its_peer",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank, msrun_tmp_path, monkeypatch):
    (msrun_tmp_path / f"pid{rank}").write_text(str(os.getpid()))
    if rank == 1:
        raise AssertionError("rank 1 fails first")
    assert wait_for(lambda: gone(peer_pid(msrun_tmp_path, 1))), "rank 1 never ended"
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    raise AssertionError("rank 0 fails later, its clock frozen")
""",
        suite_patterns=(r"on rank\(s\) 0, 1: rank 1: AssertionError: rank 1 fails first",),
        modes=("suite",),
    ),
    Scenario(
        "a_passing_test_of_a_task_scheduler_job_prints_a_lone_surrogate",
        """
@pytest.mark.msrun(worker_num=2, scheduler="task")
def test_it(rank):
    print("lone \\ud800 surrogate")
""",
        counts={"passed": 1},
        never=("failed", "errors"),
        suite_ok=True,
        modes=("fresh", "warm"),
    ),
    Scenario(
        "rank_1_skips_at_collection_and_ends_first_rank_0_skips_in_the_body",
        """
SHARED = os.path.join(os.environ.get("MSRUN_LOG_DIR", "."), "collection-skip")
if RANK == 1:
    os.makedirs(SHARED, exist_ok=True)
    with open(os.path.join(SHARED, "pid1.tmp"), "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(os.path.join(SHARED, "pid1.tmp"), os.path.join(SHARED, "pid1"))
    pytest.skip("rank 1 skips the module", allow_module_level=True)


def test_it():
    from pathlib import Path

    assert wait_for(lambda: gone(peer_pid(Path(SHARED), 1))), "rank 1's session never ended"
    pytest.skip("rank 0 skips in the body")
""",
        suite_ok=True,
        suite_patterns=(r"test_it\s+skipped\s+skipped\s+skipped",),
        modes=("suite",),
    ),
    Scenario(
        "a_function_fixture_teardown_fails_under_x",
        """
@pytest.fixture
def fx():
    yield
    # every rank is done with the call before any fails this teardown (a rank failing first would
    # have msrun stop one still in its call, on a loaded machine: a failed call, rightly)
    all_ranks_reach("fx-teardown-barrier")
    raise RuntimeError("teardown boom")


@pytest.mark.msrun(worker_num=2)
def test_it(rank, fx):
    pass


@pytest.mark.msrun(worker_num=2)
def test_after(rank):
    pass
""",
        counts={"passed": 1, "errors": 1},  # once, on the test whose fixture failed; -x stops there
        patterns=(r"teardown boom",),
        suite_patterns=(r"teardown boom|error",),
        args=("-x",),
    ),
    Scenario(
        "rank_1_runs_out_of_time_while_rank_0_waits_for_its_teardown_in_the_world",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank):
    if rank == 1:
        wait_for(lambda: False, 60.0)  # past the 15 s timeout


@pytest.mark.msrun(worker_num=2)
def test_after(rank):
    pass
""",
        counts={"failed": 1, "passed": 1},
        never=("errors",),  # rank 0 waited for the controller: no "hangs at exit" blamed on it
        patterns=(r"in the call phase \(rank 1 had not finished\)",),
        args=("--msrun-timeout=15",),
        modes=("warm",),
    ),
    Scenario(
        "a_strict_xfail_failing_slowly_on_rank_0_under_x_then_a_collective",
        """
@pytest.mark.xfail(strict=True, reason="fails on rank 0")
@pytest.mark.msrun(worker_num=2)
def test_it(rank, msrun_tmp_path):
    if rank == 0:
        wait_for((msrun_tmp_path / "done").exists)
        time.sleep(1.5)  # still in the call well after rank 1's strict XPASS (a warm world's failure grace: 0.5 s)
    else:
        (msrun_tmp_path / "done").write_text("")
    assert rank != 0


@pytest.mark.msrun(worker_num=2)
def test_after(rank, msrun):
    msrun.barrier()  # every rank goes on: -x did not stop rank 1 for a test that is XFAIL
""",
        counts={"xfailed": 1, "passed": 1},
        never=("failed", "errors"),
        suite_ok=True,
        suite_patterns=(r"test_after\s+passed\s+passed\s+passed",),
        args=("-x",),
    ),
    Scenario(
        "a_fixture_teardown_skips_on_every_rank",
        """
@pytest.fixture
def skipper():
    yield
    pytest.skip("skip in teardown")


@pytest.mark.msrun(worker_num=2)
def test_it(rank, skipper):
    pass
""",
        counts={"passed": 1, "skipped": 1},  # as pytest counts it: the call passed, the teardown skipped
        suite_ok=True,
        suite_patterns=(r"test_it\s+passed\s+passed\s+passed",),
    ),
    Scenario(
        "rank_1_runs_out_of_time_in_a_test_rank_0_then_waits_for_it_in_the_next",
        """
@pytest.mark.msrun(worker_num=2)
def test_hang(rank):
    if rank == 1:
        wait_for(lambda: False, 60.0)  # past the 10 s timeout


@pytest.mark.msrun(worker_num=2)
def test_after(rank, msrun):
    msrun.barrier()  # rank 0 waits here for rank 1, which is still in test_hang
""",
        suite_patterns=(
            r"test_hang\s+passed\s+timeout\s+failed",  # the root cause is rank 1's, in test_hang
            r"test_after\s+(stopped|timeout)\s+not run\s+incomplete",  # whether rank 0's clock ran out too
        ),
        args=("--msrun-timeout=10",),
        modes=("suite",),
    ),
    Scenario(
        "rank_1_exits_0_in_a_test_rank_0_then_fails_to_meet_it_in_the_next",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank):
    if rank == 1:
        os._exit(0)


@pytest.mark.msrun(worker_num=2)
def test_last(rank, msrun):
    msrun.barrier()  # fails on rank 0: rank 1 has gone (in test_it, which is the failure)
""",
        suite_patterns=(
            r"test_it\s+passed\s+crashed \(exit 0\)\s+failed",
            r"test_last\s+failed\s+not run\s+incomplete",
            r"which had ended in test_scenario.py::test_it",
        ),
        modes=("suite",),
    ),
    Scenario(  # rank 0's barrier failed as a CollectiveDeadlock ("rank 1 left the job") and was blamed
        "rank_1_stops_its_session_at_its_failure_under_x_and_rank_0_fails_to_meet_it_in_the_next",
        """
def test_first(rank):
    from pytest_msrun import cluster

    cluster.init()
    cluster.barrier()


def test_fails_on_1(rank):
    assert rank != 1


def test_third(rank):
    from pytest_msrun import cluster

    cluster.barrier()  # rank 1 stopped its session (-x): rank 0 fails to meet it here


def test_fourth(rank):
    pass
""",
        suite_patterns=(
            r"test_fails_on_1\s+passed\s+failed\s+failed$",
            r"test_third\s+failed\s+not run\s+incomplete$",
            r"which had ended in test_scenario.py::test_fails_on_1",
            r"1 passed, 1 failed, 1 incomplete, 1 not run",
        ),
        args=("-x",),
        modes=("suite",),
    ),
    Scenario(
        "every_rank_skips_at_collection",
        """
if os.environ.get("RANK_ID"):
    pytest.skip("no ranks here", allow_module_level=True)


@pytest.mark.msrun(worker_num=2)
def test_it(rank):
    pass
""",
        counts={"skipped": 1},
        never=("passed", "failed", "errors"),
        suite_ok=True,
        modes=("fresh", "warm"),
    ),
    *[
        Scenario(
            f"a_strict_xfail_failing_on_rank_0_only_{name}",
            f"""
@pytest.mark.xfail(strict=True, reason="fails on rank 0")
@pytest.mark.msrun(worker_num=2)
def test_it(rank, msrun_tmp_path):
    if rank == {slow}:
        wait_for((msrun_tmp_path / "done").exists)
        time.sleep(1.5)  # still in the call well after the other rank reported (a warm world's failure grace: 0.5 s)
    else:
        (msrun_tmp_path / "done").write_text("")
    assert rank != 0
""",
            counts={"xfailed": 1},
            never=("passed", "failed", "xpassed"),
            suite_ok=True,
            suite_patterns=(r"1 xfailed",),
        )
        for name, slow in (("rank_0_slow", 0), ("rank_1_slow", 1))
    ],
    Scenario(
        "a_skip_on_one_rank",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank):
    if rank == 1:
        pytest.skip("only on rank 1")
""",
        never=("passed", "skipped"),
        patterns=(r"a test must skip on every rank or on none",),
        suite_patterns=(r"test_it\s+passed\s+skipped\s+failed", r"a test must skip on every rank or on none"),
    ),
    Scenario(
        "os_exit_0_on_one_rank",
        """
@pytest.mark.msrun(worker_num=2)
def test_it(rank, msrun_tmp_path):
    if rank == 1:
        os._exit(0)
""",
        counts={"failed": 1},
        never=("passed",),
        suite_patterns=(r"test_it\s+passed\s+crashed \(exit 0\)\s+failed",),
    ),
    Scenario(
        "a_module_fixture_whose_teardown_fails_with_the_last_test_statically_skipped",
        """
@pytest.fixture(scope="module")
def resource():
    yield
    # every rank is done with the test before any fails this teardown (a rank whose session ended
    # first would have msrun stop one still in its call, on a loaded machine)
    all_ranks_reach("teardown-barrier")
    raise RuntimeError("module fixture teardown failed")


@pytest.mark.msrun(worker_num=2)
def test_uses(rank, resource):
    pass


@pytest.mark.skipif(True, reason="static")
@pytest.mark.msrun(worker_num=2)
def test_skipped(rank):
    pass
""",
        counts={"passed": 1, "skipped": 1, "errors": 1},
        patterns=(r"module fixture teardown failed",),
        suite_patterns=(r"module fixture teardown failed|error",),
    ),
]


def _source(scenario: Scenario) -> str:
    return HEAD + scenario.body


def plugin_cases(scenarios: list[Scenario]) -> list:
    return [
        pytest.param(s, mode, id=f"{s.name}-{mode}")
        for s in scenarios
        for mode in ("fresh", "isolated", "warm")
        if mode in s.modes or (mode == "isolated" and "fresh" in s.modes)
    ]


PLUGIN_CASES = plugin_cases(SCENARIOS)


@pytest.mark.parametrize("scenario,mode", PLUGIN_CASES)
def test_plugin_modes(pytester: pytest.Pytester, monkeypatch, scenario: Scenario, mode: str):
    run_plugin_mode(pytester, monkeypatch, scenario, mode)


def run_plugin_mode(pytester: pytest.Pytester, monkeypatch, scenario: Scenario, mode: str) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    source = _source(scenario)
    if mode == "isolated":  # in a warm session, each marked test isolated=True
        source = source.replace("@pytest.mark.msrun(", "@pytest.mark.msrun(isolated=True, ")
    pytester.makepyfile(test_scenario=source)
    worlds = "fresh" if mode == "fresh" else "warm"
    started = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rA", f"--msrun-worlds={worlds}", *scenario.args, timeout=120
    )
    text = result.stdout.str()
    counts = result.parseoutcomes()
    for name, count in scenario.counts.items():
        assert counts.get(name, 0) == count, (name, counts, text)
    for name in scenario.never:
        assert not counts.get(name), (name, counts, text)
    assert result.ret == (0 if scenario.suite_ok else 1), text  # the same verdict as suite mode's
    for pattern in scenario.patterns:
        assert re.search(pattern, text), f"{pattern!r} not in:\n{text}"
    for pattern in scenario.absent:
        assert not re.search(pattern, text), f"{pattern!r} in:\n{text}"
    took = time.monotonic() - started
    assert not scenario.seconds or took < scenario.seconds, f"{took:.1f} s:\n{text}"
    assert not wait_gone(mark), "processes left behind"


SUITES = [s for s in SCENARIOS if "suite" in s.modes]


@pytest.mark.parametrize("scenario", SUITES, ids=[s.name for s in SUITES])
def test_suite_mode(msrun, scenario: Scenario):
    run_suite_mode(msrun, scenario)


def run_suite_mode(msrun, scenario: Scenario) -> None:
    msrun.script("test_scenario.py", _source(scenario))
    args = [a for a in scenario.args if a.startswith(("--msrun-timeout", "-x", "--maxfail"))]
    job = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", *args, "test_scenario.py"), timeout=120)
    out = job.stdout + job.stderr
    assert "msrun: pytest results of 2 rank(s)" in job.stdout, out
    table = job.stdout[job.stdout.index("msrun: pytest results of 2 rank(s)") :]
    assert "on rank(s) \n" not in table and not re.search(r"on rank\(s\)\s*:", table)
    if scenario.suite_ok:
        assert job.returncode == 0, out
    else:
        assert job.returncode != 0, out
    for pattern in scenario.suite_patterns:
        assert re.search(pattern, table, re.M), f"{pattern!r} not in:\n{table}"
    for pattern in scenario.absent:
        assert not re.search(pattern, table, re.M), f"{pattern!r} in:\n{table}"
    status = job.status()
    assert status["exit_code"] == job.returncode
