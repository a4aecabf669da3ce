"""``--tail_worker_log``: in-process tailing with a ``[rank N]`` prefix, no line lost."""

from __future__ import annotations

import re

from conftest import job_args

LOUD = """
import os, sys
rank = os.environ["RANK_ID"]
for i in range(int(os.environ.get("LOUD_LINES", "20000"))):
    print(f"line {i} of rank {rank}")
sys.stdout.write(f"last words of rank {rank} without newline")
"""


def test_every_line_of_every_rank_arrives_prefixed(msrun):
    msrun.script("loud.py", LOUD)
    job = msrun.run(job_args(2, "loud.py"))
    assert job.returncode == 0, job.stderr
    lines = job.stdout.splitlines()
    for rank in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[rank {rank}] ")]
        assert len(mine) == 20001
        assert mine[0] == f"[rank {rank}] line 0 of rank {rank}"
        assert mine[19999] == f"[rank {rank}] line 19999 of rank {rank}"
        assert mine[-1] == f"[rank {rank}] last words of rank {rank} without newline"


def test_tail_selection_by_rank(msrun):
    msrun.script("loud.py", LOUD)
    job = msrun.run(
        job_args(3, "--tail_worker_log=1", "loud.py"),
        env={"LOUD_LINES": "10"},
    )
    assert job.returncode == 0
    tailed = {ln.split("]")[0] + "]" for ln in job.stdout.splitlines() if ln.startswith("[rank")}
    assert tailed == {"[rank 1]"}
    assert "line 9 of rank 0" in job.log("worker_0.log")
    # Shown at msrun's default verbosity, as a warning (the real msrun's logger.warning).
    for rank in (0, 2):
        assert re.search(
            rf"\[WARNING\] .*The '--tail_worker_log' is:1, which doesn't contain this worker {rank}\. ", job.stderr
        ), job.stderr


def test_no_tail_without_join(msrun):
    msrun.script("loud.py", LOUD)
    job = msrun.run(
        job_args(1, "loud.py", join=False),
        env={"LOUD_LINES": "5"},
    )
    assert job.returncode == 0
    assert "[rank" not in job.stdout


def test_tail_no_tail_subprocess(msrun):
    """msrun tails in-process: no ``tail`` process is ever started."""
    import psutil
    from conftest import wait_running

    release = msrun.cwd / "release"  # the job runs until its processes were listed
    msrun.script(
        "slow.py",
        f"""
        import os, time
        print('started', flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
        """,
    )
    popen = msrun.start(job_args(2, "slow.py"))
    wait_running(msrun.cwd / "logs", 2)
    names = [c.name() for c in psutil.Process(popen.pid).children(recursive=True)]
    assert names and "tail" not in names
    release.touch()
    assert msrun.finish(popen).returncode == 0
