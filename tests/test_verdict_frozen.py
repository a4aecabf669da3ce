"""Verdicts from a frozen record, in every mode: what a rank reports after a test's deadline is
evidence, never that phase's result; time is kept outside a rank that cannot keep its own; a rank
that ends its suite normally never stops its peers; a rank survives what a test does to its
process (closed standard descriptors, a replaced ``sys.stdout`` or ``os._exit``).

The scenarios run through :mod:`test_verdict_scenarios`'s harness: plugin modes (fresh, isolated,
warm) and suite mode (``pmsrun ... pytest``).
"""

from __future__ import annotations

import pytest
from test_verdict_scenarios import Scenario, plugin_cases, run_plugin_mode, run_suite_mode

SCENARIOS = [
    Scenario(
        "a_rank_in_native_code_at_the_deadline_returns_when_asked_for_its_stacks",
        """
@pytest.mark.msrun(worker_num=2, timeout=6)
def test_it(rank):
    if rank == 1:
        ctypes.PyDLL(None).sleep(30)  # returns early when a signal arrives (the stack request)
""",
        counts={"failed": 1},
        never=("passed",),
        patterns=(r"rank 1 was still in the call phase at the timeout", r"after the deadline it reported call passed"),
        suite_patterns=(r"test_it\s+passed\s+timeout\s+failed",),
        args=("--msrun-timeout=6",),
    ),
    Scenario(  # however it ends after the deadline, a rank running then is judged as running
        "a_rank_in_native_code_at_the_deadline_calls_os_exit_0_when_asked_for_its_stacks",
        """
@pytest.mark.msrun(worker_num=2, timeout=6)
def test_it(rank):
    if rank == 1:
        ctypes.PyDLL(None).sleep(30)  # returns early when a signal arrives (the stack request)
        os._exit(0)  # before msrun's teardown reaches it
""",
        counts={"failed": 1},
        never=("passed",),
        patterns=(r"rank 1 was still in the call phase at the timeout",),
        absent=(r"left no record",),
        suite_patterns=(r"test_it\s+\S+\s+timeout\s+failed",),
        args=("--msrun-timeout=6",),
    ),
    Scenario(
        "a_barrier_rank_1_never_enters_with_the_timeout_equal_to_the_cluster_time_out",
        """
@pytest.mark.msrun(worker_num=2, timeout=6)
def test_it(rank, msrun):
    if rank == 0:
        msrun.barrier()
    else:
        wait_for(lambda: False, 30.0)
""",
        counts={"failed": 1},
        never=("passed",),
        patterns=(r"rank 1 was still in the call phase at the timeout",),
        absent=(r"hangs at exit",),
        suite_patterns=(r"test_it\s+\S+\s+timeout\s+failed",),
        args=("--msrun-timeout=6",),
    ),
    Scenario(  # one clock: no rank's own init() deadline fires with the test's and pre-empts its report
        "three_ranks_wait_in_init_for_a_fourth_stuck_before_it_at_the_deadline",
        """
def stuck_here():
    wait_for(lambda: False, 60.0)


@pytest.mark.msrun(worker_num=4, timeout=5)
def test_it(rank):
    from pytest_msrun import cluster

    if rank == 3:
        stuck_here()
    cluster.init()
    cluster.barrier()
""",
        counts={"failed": 1},
        never=("passed",),
        patterns=(
            r"ranks 0-2 \(3\): (init|barrier)\(\) at test_scenario.py",
            r"rank 3: wait_for\(\) .* <- stuck_here\(\)",
            r"(never joined the group.*|not there): 3",
        ),
        absent=(
            r"left before the group formed",
            r"ClusterError",
            r"too late to count",
            r"timed out after \d+ s waiting",
        ),
        modes=("fresh", "warm"),
    ),
    Scenario(  # it read "terminated by msrun", "could not end itself": the rank was stopped, and said so
        "a_rank_that_stops_itself_is_named_stopped",
        """
@pytest.mark.msrun(worker_num=2, timeout=4)
def test_it(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
""",
        counts={"failed": 1},
        never=("passed",),
        patterns=(r"rank 1: no stack \(stopped \(SIGSTOP, SIGTSTP or a tracer\)",),
        suite_patterns=(r"test_it\s+passed\s+timeout\s+failed", r"rank 1 ran out of time .*: it was stopped \(SIGSTOP"),
        modes=("fresh", "warm", "suite"),
    ),
    Scenario(
        "a_rank_whose_suite_ends_early_with_failures_stops_no_peer",
        """
@pytest.mark.msrun(worker_num=2)
def test_fails_on_0(rank):
    assert rank != 0, "an ordinary failure on rank 0"


@pytest.mark.msrun(worker_num=2)
def test_last(rank, msrun, msrun_tmp_path):
    msrun.barrier()
    if rank == 1:  # still at work well after rank 0's session ended (with pytest's exit 1)
        wait_for(lambda: (msrun_tmp_path / "never").exists(), 2.0)
        assert False, "rank 1's own failure, after rank 0 left"
""",
        counts={"failed": 2},
        never=("passed",),
        patterns=(r"an ordinary failure on rank 0", r"rank 1's own failure"),
        absent=(r"incomplete", r"not run", r"stopped by msrun"),
        suite_patterns=(r"test_fails_on_0\s+failed\s+passed\s+failed", r"test_last\s+passed\s+failed\s+failed"),
    ),
    *[
        Scenario(
            f"a_rank_that_cannot_keep_its_own_time_{name}",
            f"""
@pytest.mark.msrun(worker_num=2)
def test_stuck(rank, msrun):
    if rank == 1:
        {how}
    else:
        msrun.barrier()  # waits for rank 1, which never comes
""",
            never=("passed",),
            patterns=(r"rank 1 was still in the call phase at the timeout",),
            suite_patterns=(
                r"test_stuck\s+(stopped|timeout)\s+timeout\s+failed",
                r"rank 1 .*(ran out of time|timed out)",
            ),
            args=("--msrun-timeout=6",),
        )
        for name, how in (
            ("holding_the_gil", "while True: ctypes.PyDLL(None).sleep(60)  # no thread of its own can run"),
            ("stopped", "os.kill(os.getpid(), 19)  # SIGSTOP"),
        )
    ],
    Scenario(
        "an_isolated_test_that_replaces_os_exit",
        """
@pytest.mark.msrun(worker_num=2, isolated=True)
def test_it(rank):
    os._exit = lambda code: None  # never restored


@pytest.mark.msrun(worker_num=2, isolated=True)
def test_after(rank):
    pass
""",
        counts={"passed": 2},
        never=("failed", "errors"),
        absent=(r"INTERNALERROR",),
        suite_ok=True,
        modes=("warm",),
    ),
    Scenario(
        "a_rank_that_closes_its_standard_descriptors",
        """
@pytest.mark.msrun(worker_num=2)
def test_closes(rank):
    if rank == 1:
        os.close(1)
        os.close(2)


@pytest.mark.msrun(worker_num=2)
def test_later_fails(rank):
    assert rank != 1, "a real failure after the descriptors were closed"
""",
        counts={"passed": 1, "failed": 1},
        never=("errors",),
        patterns=(r"a real failure after the descriptors were closed",),
        suite_patterns=(r"test_closes\s+passed\s+passed\s+passed", r"test_later_fails\s+passed\s+failed\s+failed"),
    ),
    Scenario(
        "a_failing_rank_after_an_earlier_test_replaced_sys_stdout",
        """
@pytest.mark.msrun(worker_num=2)
def test_replaces(rank):
    sys.stdout = open(os.devnull, "w")


@pytest.mark.msrun(worker_num=2)
def test_fails(rank):
    print(f"output of rank {rank} before it fails")
    assert rank != 1
""",
        counts={"passed": 1, "failed": 1},
        patterns=(r"output of rank 1 before it fails",),
        modes=("fresh", "warm"),
    ),
    *[
        Scenario(
            f"a_rank_in_native_code_at_the_deadline_in_its_{phase}",
            f"""
@pytest.fixture
def native():
    if RANK == 1 and "{phase}" == "setup":
        ctypes.PyDLL(None).sleep(30)
    yield
    if RANK == 1 and "{phase}" == "teardown":
        ctypes.PyDLL(None).sleep(30)


@pytest.mark.msrun(worker_num=2, timeout=6)
def test_it(rank, native):
    pass
""",
            never=("passed",) if phase == "setup" else (),
            patterns=(rf"rank 1 was still in the {phase} phase at the timeout",),
            absent=(r"hangs at exit",),
            suite_patterns=(r"test_it\s+\S+\s+timeout\s+(failed|error)",),
            args=("--msrun-timeout=6",),
        )
        for phase in ("setup", "teardown")
    ],
    Scenario(
        "a_test_that_redirects_descriptor_1_to_dev_null_then_a_failing_one",
        """
@pytest.mark.msrun(worker_num=2)
def test_redirects(rank):
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


@pytest.mark.msrun(worker_num=2)
def test_fails(rank):
    print(f"still heard from rank {rank}", flush=True)
    assert rank != 1
""",
        counts={"passed": 1, "failed": 1},
        patterns=(r"still heard from rank 1",),
        suite_patterns=(r"test_fails\s+passed\s+failed\s+failed",),
    ),
    Scenario(
        "msrun_cannot_start_the_job",
        """
@pytest.mark.msrun(worker_num=2, env={"MSRUN_AUTH_TIMEOUT": "5s"})
def test_it(rank):
    pass
""",
        counts={"errors": 1},
        never=("passed", "failed"),
        patterns=(r"msrun could not start the job", r"MSRUN_AUTH_TIMEOUT='5s'"),
        modes=("fresh", "warm"),
    ),
    Scenario(
        "an_invalid_marker",
        """
@pytest.mark.msrun(worker_num=0)
def test_it(rank):
    pass
""",
        counts={"errors": 1},
        never=("passed",),
        patterns=(r"must be a positive int",),
        suite_patterns=(r"test_it\s+error\s+error\s+error", r"must be a positive int"),
        modes=("warm", "suite"),
    ),
    Scenario(
        "a_rank_that_does_not_collect_the_test",
        """
if os.environ.get("RANK_ID") == "1":
    pytest.skip("not on rank 1", allow_module_level=True)


@pytest.mark.msrun(worker_num=2, timeout=40)
def test_it(rank):
    pass
""",
        never=("passed",),
        patterns=(r"a test must skip on every rank or on none|skipped at collection",),
        seconds=25,  # the right verdict at once, not after a minute's wait for rank 1
        modes=("fresh", "warm"),
    ),
]


# ``isolated`` runs in the same forking worlds as ``--msrun-worlds=fresh``: once is enough here,
# but for the scenarios that are about a forked child's own end
CASES = [c for c in plugin_cases(SCENARIOS) if c.values[1] != "isolated" or "os_exit" in c.values[0].name]


@pytest.mark.parametrize("scenario,mode", CASES)
def test_plugin_modes(pytester: pytest.Pytester, monkeypatch, scenario: Scenario, mode: str):
    run_plugin_mode(pytester, monkeypatch, scenario, mode)


SUITES = [s for s in SCENARIOS if "suite" in s.modes]


@pytest.mark.parametrize("scenario", SUITES, ids=[s.name for s in SUITES])
def test_suite_mode(msrun, scenario: Scenario):
    run_suite_mode(msrun, scenario)
