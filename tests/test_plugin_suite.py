"""``msrun pytest <dir>``: a whole suite inside one job, one table from msrun."""

from __future__ import annotations

import json
import re
import textwrap
import time
import xml.etree.ElementTree as ET

from conftest import job_args

SUITE = """
import pytest

def test_every_rank(rank, world_size):
    assert 0 <= rank < world_size

@pytest.mark.msrun(worker_num=2)
def test_needs_two(world_size, msrun):
    assert world_size == 2
    assert msrun.all_gather(msrun.rank) == [0, 1]

@pytest.mark.msrun(worker_num=4)
def test_needs_four(world_size):
    assert world_size == 4

@pytest.mark.msrun(worker_num=[2, 4])
def test_sizes(world_size):
    assert world_size in (2, 4)
"""


def _suite(msrun, extra: str = "") -> None:
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_suite.py").write_text(textwrap.dedent(SUITE) + textwrap.dedent(extra))


def test_suite_in_a_job_passes_with_one_table(msrun):
    _suite(msrun)
    job = msrun.run(
        job_args(
            2, "--scheduler=builtin", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "suite", "--junitxml=out.xml"
        )
    )
    assert job.returncode == 0, job.stdout + job.stderr
    table = job.stdout[job.stdout.index("msrun: pytest results of 2 rank(s)") :]
    assert re.search(r"suite/test_suite.py::test_every_rank\s+passed\s+passed", table)
    assert re.search(r"suite/test_suite.py::test_needs_two\s+passed\s+passed", table)
    assert re.search(r"suite/test_suite.py::test_needs_four\s+skipped\s+skipped", table)
    assert re.search(r"test_sizes\[worker_num-2\]\s+passed\s+passed", table)
    assert re.search(r"test_sizes\[worker_num-4\]\s+skipped\s+skipped", table)
    assert "msrun: 5 test(s): 3 passed, 2 skipped" in table
    skip_reason = "needs a job of 4 ranks (msrun --worker_num=4); this job has 2"
    assert skip_reason in job.log("worker_0.log") and skip_reason in job.log("worker_1.log")
    for rank in (0, 1):
        cases = list(ET.parse(msrun.cwd / f"out.rank{rank}.xml").getroot().iter("testcase"))
        assert len(cases) == 5
    assert not (msrun.cwd / "out.xml").exists()


def test_suite_fails_when_one_rank_fails_one_test(msrun):
    _suite(
        msrun,
        """
        def test_bad_on_rank_1(rank):
            assert rank != 1
    """,
    )
    job = msrun.run(job_args(2, "--scheduler=builtin", "pytest", "-q", "-p", "no:cacheprovider", "suite"))
    assert job.returncode == 1, job.stdout + job.stderr
    assert re.search(r"test_bad_on_rank_1\s+passed\s+failed\s+failed", job.stdout)
    assert "FAILED suite/test_suite.py::test_bad_on_rank_1 on rank(s) 1: rank 1: assert 1 != 1" in job.stdout
    assert "msrun: 6 test(s): 3 passed, 1 failed, 2 skipped" in job.stdout


def test_a_log_directory_used_again_shows_no_earlier_jobs_results(msrun):
    """A log directory used again holds the last job's records and table registration: a job
    whose ranks end before their pytest registers prints no table, and a rank that ends before
    its pytest writes records is no earlier rank's results - however recent those are."""
    _suite(
        msrun,
        """
        def test_bad_on_rank_1(rank):
            assert rank != 1
    """,
    )
    (msrun.cwd / "conftest.py").write_text(
        "import os\nif os.environ.get('STOP_RANK') == os.environ.get('RANK_ID'):\n    os._exit(3)\n"
    )
    first = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", "suite"))
    assert "msrun: 6 test(s)" in first.stdout, first.stdout + first.stderr
    records = msrun.cwd / "logs" / "pytest_rank1.jsonl"  # rank 1's, as if written a moment ago
    lines = records.read_text().splitlines()
    start = json.loads(lines[0])
    lines[0] = json.dumps({**start, "ts": time.time() + 30})
    records.write_text("\n".join(lines) + "\n")
    stopped = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", "suite"), env={"STOP_RANK": "1"})
    assert stopped.returncode != 0, stopped.stdout + stopped.stderr
    assert not re.search(r"test_bad_on_rank_1\s+passed\s+failed", stopped.stdout), stopped.stdout
    gone = {"MSRUN_PYTEST_OPTIONS": str(msrun.cwd / "gone.json")}  # each rank's pytest stops as it configures
    again = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", "suite"), env=gone)
    assert again.returncode != 0, again.stdout + again.stderr
    assert "test(s):" not in again.stdout and "test_bad_on_rank_1" not in again.stdout, again.stdout


def test_a_suites_tests_are_records_each_judged_once(msrun, monkeypatch):
    """Suite mode reaches its verdicts the way every mode does: each test of the suite is a record
    (``testrecord.suite_records``) judged once by the one rule - the table msrun printed is the one
    those records give, read again from the job's files with every judgement counted."""
    from pytest_msrun.engine.status import read_status
    from pytest_msrun.plugin.reports import suite
    from pytest_msrun.plugin.rule import testrecord

    _suite(msrun, "\ndef test_bad_on_rank_1(rank):\n    assert rank != 1\n")
    job = msrun.run(job_args(2, "--scheduler=builtin", "pytest", "-q", "-p", "no:cacheprovider", "suite"))
    assert job.returncode == 1, job.stdout + job.stderr
    counts: dict[str, int] = {}
    judge = testrecord.judge

    def counting(nodeid, *args, **kwargs):
        counts[nodeid] = counts.get(nodeid, 0) + 1
        return judge(nodeid, *args, **kwargs)

    monkeypatch.setattr(testrecord, "judge", counting)
    status = read_status(str(job.log_dir))
    assert status is not None
    monkeypatch.chdir(msrun.cwd)  # the status names its log directory as msrun was given it
    report = suite.job_report(status)
    assert report is not None
    assert len(counts) == 6 and set(counts.values()) == {1}, counts
    table = report.text.split("\n")[1:]  # its first line names the record directory
    assert all(line in job.stdout for line in table), (report.text, job.stdout)


CRASH = """
import ctypes, os, time

import pytest

def test_first(rank):
    assert rank in (0, 1)

def test_crash_on_rank_1(rank):
    from pytest_msrun import cluster
    cluster.init()
    cluster.barrier()  # both ranks are in this test before rank 1 crashes
    print(f"rank {rank} is about to do something risky", flush=True)
    if rank == 1:
        ctypes.string_at(0)
    time.sleep(60)

def test_after(rank):
    assert True

def test_last(rank):
    assert True
"""


def test_suite_blames_the_test_a_rank_crashed_in(msrun):
    """Rank 1 segfaults inside a test: that test failed on rank 1 with the signal; nothing is 'passed'."""
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_crash.py").write_text(CRASH)
    job = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", "suite"))
    assert job.returncode == 139, job.stdout + job.stderr
    out = job.stdout
    assert re.search(r"test_first\s+passed\s+passed\s+passed", out)
    assert re.search(r"test_crash_on_rank_1\s+stopped\s+crashed \(SIGSEGV\)\s+failed", out), out
    assert re.search(r"test_after\s+not run\s+not run\s+not run", out), out
    assert (
        "FAILED suite/test_crash.py::test_crash_on_rank_1 on rank(s) 1: rank 1 left no record during the call "
        "phase and was killed by SIGSEGV (exit status 139)" in out
    )
    assert "msrun: 4 test(s): 1 passed, 1 failed, 2 not run" in out
    assert "failed on no rank" not in out
    # what the crashed rank printed before it died is in its log (and its pytest wrote no summary)
    assert "rank 1 is about to do something risky" in job.log("worker_1.log")
    assert "Fatal Python error: Segmentation fault" in job.log("worker_1.log")


MIXED = """
import pytest

def test_skips_on_one_rank(rank):
    if rank == 1:
        pytest.skip("no device on rank 1")

@pytest.mark.xfail(strict=True, reason="known bug on rank 1")
def test_strict_xfail_fails_on_rank_1_only(rank):
    assert rank != 1
"""


def test_suite_judges_like_the_plugin(msrun, pytester):
    """A skip on one rank only fails; a strict xfail failing on one rank is XFAIL - in both modes."""
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_mixed.py").write_text(MIXED)
    job = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", "suite"))
    out = job.stdout
    assert job.returncode == 1, out + job.stderr  # pytest's own exit: rank 0's strict XPASS failed its session
    assert re.search(r"test_skips_on_one_rank\s+passed\s+skipped\s+failed", out), out
    assert "skipped on ranks 1 (Skipped: no device on rank 1) but ran on ranks 0" in out
    assert re.search(r"test_strict_xfail_fails_on_rank_1_only\s+xpassed\(strict\)\s+xfailed\s+xfailed", out), out
    # plugin mode, the same file: the same verdicts
    pytester.makepyfile(test_mixed=MIXED.replace("def test_", "@pytest.mark.msrun(worker_num=2)\ndef test_"))
    result = pytester.runpytest_subprocess("-rxXf", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, xfailed=1)
    result.stdout.fnmatch_lines(["*skipped on ranks 1 (Skipped: no device on rank 1) but ran on ranks 0*"])


TIMEOUT = """
import os, time

import pytest

def compute():
    while True:
        time.sleep(0.1)

@pytest.mark.msrun(worker_num=2, timeout=3)
def test_hangs(rank, msrun):
    msrun.barrier()
    if rank == 0:
        compute()
    msrun.barrier()

def test_after_the_hang():
    pass
"""


def test_suite_applies_the_marker_timeout_and_says_who_is_stuck_where(msrun):
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_t.py").write_text(TIMEOUT)
    job = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", "suite"), timeout=60)
    out = job.stdout
    assert job.returncode == 124, out + job.stderr
    # whichever rank's clock runs out first times out (on a loaded machine rank 1's may, its test
    # having begun first); the other is stopped or times out too; each is caught where it was
    assert re.search(r"test_hangs\s+(timeout\s+(timeout|stopped)|stopped\s+timeout)\s+failed", out), out
    failed = r"FAILED suite/test_t.py::test_hangs on rank\(s\) (0|1|0, 1): rank (\d) timed out after 3 s in the call"
    found = re.search(failed, out)
    assert found, out
    first = found.group(2)
    # rank 0 was in compute() - caught there by its own timer, or wherever SIGTERM found it when
    # rank 1's timer fired first (a loaded machine) and msrun stopped it
    rank_0 = r"rank 0: compute\(\) at test_t.py:8 <- test_hangs\(\) at test_t.py:14"
    assert re.search(rank_0 if first == "0" else r"rank 0: \w+\(\) at [^\n]+?:\d+", out), out
    # rank 1 waits in the barrier - or, when the control plane saw rank 0 go before msrun stopped
    # rank 1 (a loaded machine), it is already reporting that barrier's failure (pytest's frames);
    # or its own timer (armed when its test began, on a loaded machine later than rank 0's) had not
    # fired yet when msrun stopped it after rank 0's exit: then it has no stack, and where it
    # waited is the control plane's word (asserted below)
    rank_1 = (
        r"rank 1: (barrier\(\) at test_t.py:15 <- test_hangs\(\)|\w+\(\) at [^\n]+?:\d+"  # <frozen posixpath>:451 too
        r"|no stack \(killed by SIGTERM \(exit status 143\) \(terminated by msrun: rank 0 exited with code 124\)\))"
    )
    assert re.search(rank_1, out), out
    assert "rank 1 entered barrier #2; not there: 0" in out
    assert f"timed out after 3 s on rank {first}" in job.log(f"worker_{first}.log")


def test_task_scheduler_runs_no_test(msrun):
    """With --scheduler=task the scheduler runs the same pytest command; it must run no test."""
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_s.py").write_text("def test_x(rank):\n    assert rank in (0, 1)\n")
    job = msrun.run(job_args(2, "--scheduler=task", "pytest", "-p", "no:cacheprovider", "suite"))
    assert job.returncode == 0, job.stdout + job.stderr
    sched = job.log("scheduler.log")
    assert "not a rank: it runs no tests" in sched
    assert "1 deselected" in sched and "passed" not in sched
    assert "1 passed" in job.log("worker_0.log") and "1 passed" in job.log("worker_1.log")


def test_suite_on_two_nodes_prints_one_table_on_node_0(msrun):
    """Two msrun nodes (loopback invocations sharing the log directory, as cluster nodes share a
    filesystem): node 0 prints every node's ranks in one table, node 1 says so; both fail."""
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_nodes.py").write_text(
        "def test_all(rank, world_size):\n    assert world_size == 4\n\n"
        "def test_bad_on_rank_3(rank):\n    assert rank != 3\n"
    )
    from conftest import free_port

    args = job_args(4, "--cluster_time_out=30", "--scheduler=builtin", local=2, port=free_port())
    task = ["pytest", "-q", "-p", "no:cacheprovider", "suite"]
    nodes = [msrun.start([*args, f"--node_rank={n}", *task]) for n in (0, 1)]
    first, second = (msrun.finish(p) for p in nodes)
    assert first.returncode != 0 and second.returncode != 0, first.stdout + first.stderr + second.stdout + second.stderr
    assert "msrun: pytest results of 4 rank(s)" in first.stdout, first.stdout + first.stderr
    table = first.stdout[first.stdout.index("msrun: pytest results of 4 rank(s)") :]
    assert re.search(r"test_all\s+passed\s+passed\s+passed\s+passed\s+passed", table), table
    assert re.search(r"test_bad_on_rank_3\s+passed\s+passed\s+passed\s+failed\s+failed", table), table
    assert "FAILED suite/test_nodes.py::test_bad_on_rank_3 on rank(s) 3" in table
    assert "node 0 prints the pytest results of every node (this node: ranks 2, 3)" in second.stdout
    assert "msrun: pytest results" not in second.stdout


BASETEMP = """
def test_own_tmp(rank, tmp_path, msrun):
    (tmp_path / "mine.txt").write_text(str(rank))
    msrun.barrier()  # every rank has set its basetemp up and written its file
    assert (tmp_path / "mine.txt").read_text() == str(rank)
"""


def test_suite_with_basetemp_gives_each_rank_its_own(msrun):
    """pytest empties a given --basetemp: ranks sharing one would delete each other's files."""
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_tmp.py").write_text(BASETEMP)
    job = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", "--basetemp=bt", "suite"))
    assert job.returncode == 0, job.stdout + job.stderr
    for rank in (0, 1):
        assert (msrun.cwd / "bt" / f"rank{rank}").is_dir()


LAST_FAILED = """
import os

import pytest


@pytest.mark.msrun(worker_num=2)
def test_good(rank):
    pass


@pytest.mark.msrun(worker_num=2)
def test_bad(rank):
    assert os.environ.get("FIXED") or rank == 0


def test_plain():
    pass
"""


def test_last_failed_selects_the_same_tests_on_every_rank(msrun):
    """--lf in a suite: every rank selects from the cache as the job found it, and the job's own
    verdicts (not one rank's) become the next last-failed set."""
    msrun.script("test_lf.py", LAST_FAILED)
    lastfailed = msrun.cwd / ".pytest_cache" / "v" / "cache" / "lastfailed"

    def run(*env: str) -> tuple[int, str]:
        job = msrun.run(
            job_args(2, "pytest", "-q", "-p", "no:randomly", "--lf", "test_lf.py"), env=dict(e.split("=") for e in env)
        )
        out = job.stdout
        return job.returncode, out[out.index("msrun: pytest results of 2 rank(s)") :]

    code, table = run()  # nothing failed before: every test
    assert code == 1 and "msrun: 3 test(s): 2 passed, 1 failed" in table, table
    assert json.loads(lastfailed.read_text()) == {"test_lf.py::test_bad": True}
    for _ in range(2):  # the failing test only, on both ranks; the set stays as the table says
        code, table = run()
        assert code == 1 and re.search(r"test_lf.py::test_bad\s+passed\s+failed\s+failed", table), table
        assert "test_good" not in table and "msrun: 1 test(s): 1 failed" in table, table
        assert json.loads(lastfailed.read_text()) == {"test_lf.py::test_bad": True}
    code, table = run("FIXED=1")
    assert code == 0 and "msrun: 1 test(s): 1 passed" in table, table
    assert json.loads(lastfailed.read_text()) == {}


STEPWISE = """
import os
import time

PID1 = os.path.join(os.environ["MSRUN_LOG_DIR"], "pid1")


def test_first(rank):
    pass


def test_fails_on_1(rank):
    if rank == 1:
        with open(PID1 + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.rename(PID1 + ".tmp", PID1)
    assert os.environ.get("FIXED") or rank == 0


def test_last(rank):
    if rank == 0 and not os.environ.get("FIXED"):  # rank 1 stopped at its failure (--sw): rank 0 ends last
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not os.path.exists(PID1):
            time.sleep(0.02)
        pid = int(open(PID1).read())
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.02)
"""


def test_stepwise_selects_the_same_tests_on_every_rank(msrun):
    """--sw in a suite: no rank writes its stepwise state (they wrote one cache in turn: the next
    run's ranks began at different tests, and a test one rank skipped was INCOMPLETE); msrun writes
    the state of the rank whose failure comes first, so every rank resumes there."""
    msrun.script("test_sw.py", STEPWISE)

    def run(*env: str) -> tuple[int, str]:
        job = msrun.run(
            job_args(2, "pytest", "-q", "-p", "no:randomly", "--sw", "test_sw.py"), env=dict(e.split("=") for e in env)
        )
        out = job.stdout
        return job.returncode, out[out.index("msrun: pytest results of 2 rank(s)") :]

    code, table = run()
    assert re.search(r"test_sw.py::test_first\s+passed\s+passed\s+passed", table), table
    assert re.search(r"test_sw.py::test_fails_on_1\s+passed\s+failed\s+failed", table), table
    for _ in range(2):  # both ranks resume at the failure: test_first is deselected on both
        code, table = run()
        assert code != 0 and "test_first" not in table, table
        assert re.search(r"test_sw.py::test_fails_on_1\s+passed\s+failed\s+failed", table), table
    code, table = run("FIXED=1")
    assert code == 0 and "test_first" not in table and "msrun: 2 test(s): 2 passed" in table, table
