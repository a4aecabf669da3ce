"""The samples in sample_code/ run under our msrun."""

from __future__ import annotations

import shutil

import pytest
from conftest import REPO, free_port, job_args, wait_for

SAMPLES = REPO / "sample_code" / "startup_method"


def test_cluster_demo_four_ranks(msrun):
    job = msrun.run(
        job_args(4, str(SAMPLES / "cluster_demo.py")),
        env={"DEMO_N": "10000"},
    )
    assert job.returncode == 0, job.stderr
    for rank in range(4):
        assert f"[rank {rank}] rank {rank}/4" in job.stdout


def test_cluster_demo_two_nodes(msrun):
    port = free_port()
    args = [
        "--worker_num=4",
        "--local_worker_num=2",
        f"--master_port={port}",
        "--join=True",
        "--log_dir=logs",
        str(SAMPLES / "cluster_demo.py"),
    ]
    a = msrun.start(args, env={"DEMO_N": "10000"})
    wait_for(lambda: (msrun.cwd / "logs" / "scheduler.log").exists())
    b = msrun.start(args, env={"DEMO_N": "10000"})
    assert msrun.finish(a).returncode == 0 and msrun.finish(b).returncode == 0


@pytest.mark.torch
def test_torch_gloo_all_reduce(msrun):
    job = msrun.run(
        job_args(2, str(SAMPLES / "torch_allreduce.py")),
        timeout=120,
    )
    assert job.returncode == 0, job.stderr + job.stdout
    assert "[rank 0] rank 0/2: all_reduce -> [3.0, 2.0]" in job.stdout
    assert "[rank 1] rank 1/2: all_reduce -> [3.0, 2.0]" in job.stdout


@pytest.mark.mindspore
def test_mindspore_net_sample(msrun):
    job = msrun.run(
        job_args(2, "--scheduler=mindspore", str(SAMPLES / "net.py")),
        env={"SAMPLES": "256"},
        timeout=600,
    )
    assert job.returncode == 0, job.stderr + job.stdout
    assert "loss is" in job.log("worker_0.log")


def test_shell_scripts_are_valid_bash():
    bash = shutil.which("bash")
    assert bash
    import subprocess

    for name in ("msrun_single.sh", "msrun_1.sh", "msrun_2.sh"):
        assert subprocess.run([bash, "-n", str(SAMPLES / name)]).returncode == 0, name


@pytest.mark.mindspore
def test_mindspore_failure_is_torn_down_at_once(msrun):
    msrun.script(
        "ms_fail.py",
        """
        import os, sys, time
        from mindspore.communication import init, get_rank
        init()
        if get_rank() == 1:
            sys.exit(3)
        time.sleep(120)
    """,
    )
    import time

    t0 = time.monotonic()
    job = msrun.run(
        job_args(2, "--scheduler=mindspore", "ms_fail.py"),
        timeout=300,
    )
    assert job.returncode == 3, job.stderr
    assert time.monotonic() - t0 < 60, "the MindSpore scheduler is killed, not waited for (~30 s in real msrun)"
    assert "terminated by msrun: scheduler, rank 0" in job.stderr
