"""``msrun pytest <dir>``: a whole suite inside one job, one table from msrun."""

from __future__ import annotations

import re
import textwrap
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
    assert re.search(r"test_sizes\[worker_num=2\]\s+passed\s+passed", table)
    assert re.search(r"test_sizes\[worker_num=4\]\s+skipped\s+skipped", table)
    assert "5 of 5 test(s) failed on no rank" in table
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
    assert re.search(r"test_bad_on_rank_1\s+passed\s+failed", job.stdout)
    assert "FAILED suite/test_suite.py::test_bad_on_rank_1 on rank(s) 1" in job.stdout


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
