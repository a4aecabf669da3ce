"""Supervision: exit codes, root cause, signals, and not one process left behind."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from conftest import FAULTY, REPO, job_args, read_status, wait_for, wait_gone, wait_running

BASE = job_args(3)


@pytest.fixture
def faulty(msrun):
    return msrun.script("faulty.py", FAULTY)


def test_success_sweeps_leftover_grandchildren(msrun, faulty):
    job = msrun.run([*BASE, "faulty.py"], env={"SLEEP": "0.2", "GRANDCHILD": "1", "DAEMON": "1"})
    assert job.returncode == 0, job.stderr
    assert "Killed" in job.stderr and "leftover process" in job.stderr
    assert read_status(job.log_dir)["state"] == "succeeded"
    assert not wait_gone(msrun.mark, timeout=3)


def test_rank_exit_code_propagates(msrun, faulty):
    t0 = time.monotonic()
    job = msrun.run([*BASE, "faulty.py"], env={"FAIL_RANK": "1", "FAIL_MODE": "exit3", "GRANDCHILD": "1"})
    assert time.monotonic() - t0 < 10
    assert job.returncode == 3, job.stderr
    assert "Error code: 3." in job.stderr
    assert "There's worker exits with exception, kill all other workers." in job.stderr
    assert "Distributed job exited with exception. Please check logs in directory: logs." in job.stderr
    summary = job.stderr[job.stderr.index("Root cause") :]
    assert "rank 1 (worker_1.log" in summary and "exited with code 3" in summary
    assert "rank failing on purpose" in summary
    assert "terminated by msrun: scheduler, rank 0, rank 2" in summary
    st = read_status(job.log_dir)
    assert st["state"] == "failed" and st["exit_code"] == 3 and st["failures"][0]["label"] == "rank 1"


def test_traceback_is_the_root_cause(msrun, faulty):
    job = msrun.run([*BASE, "faulty.py"], env={"FAIL_RANK": "2", "FAIL_MODE": "raise"})
    assert job.returncode == 1
    summary = job.stderr[job.stderr.index("Root cause") :]
    assert "error: RuntimeError: boom on rank 2" in summary
    assert "traceback (from its error file):" in summary and 'raise RuntimeError(f"boom on rank' in summary


def test_segfault_exits_139(msrun, faulty):
    job = msrun.run([*BASE, "faulty.py"], env={"FAIL_RANK": "0", "FAIL_MODE": "segv"})
    assert job.returncode == 139, job.stderr
    assert "killed by SIGSEGV (exit status 139)" in job.stderr
    assert "Error code: -11." in job.stderr


def test_worker_ignoring_sigterm_is_killed_after_grace(msrun, faulty):
    t0 = time.monotonic()
    job = msrun.run(
        [*BASE, "faulty.py"],
        env={"FAIL_RANK": "0", "FAIL_MODE": "exit3", "IGNORE_TERM": "1", "MSRUN_TERM_TIMEOUT": "0.5"},
    )
    assert job.returncode == 3
    assert time.monotonic() - t0 < 8


def test_scheduler_death_fails_the_job(msrun, faulty):
    popen = msrun.start([*BASE, "faulty.py"])
    st = wait_running(msrun.cwd / "logs", 3)
    sched = next(p for p in st["processes"] if p["role"] == "scheduler")
    os.kill(sched["pid"], signal.SIGKILL)
    job = msrun.finish(popen)
    assert job.returncode == 137, job.stderr
    assert f"Scheduler process {sched['pid']} exit with exception." in job.stderr
    assert "scheduler (scheduler.log" in job.stderr


@pytest.mark.parametrize(
    "sig,code,text",
    [
        (signal.SIGINT, 130, "msrun process received SIGINT (Ctrl+C), terminating all workers."),
        (signal.SIGTERM, 143, "msrun process received SIGTERM, terminating all workers."),
        (signal.SIGHUP, 129, "msrun process received SIGHUP, terminating all workers."),
    ],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_signals_tear_everything_down(msrun, faulty, sig, code, text):
    popen = msrun.start([*BASE, "faulty.py"], env={"GRANDCHILD": "1"}, start_new_session=True)
    wait_running(msrun.cwd / "logs", 3)
    if sig == signal.SIGINT:
        os.killpg(popen.pid, sig)  # what a terminal's Ctrl+C does: the whole foreground group
    else:
        popen.send_signal(sig)
    job = msrun.finish(popen, timeout=20)
    assert job.returncode == code, job.stderr
    assert text in job.stderr
    assert read_status(job.log_dir)["state"] == "terminated"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
def test_a_signal_while_msrun_starts_ends_it_with_nothing_started(msrun, faulty, sig):
    """A signal that comes before msrun's event loop is in place (here: while planning reads its
    topology from a FIFO nobody has written yet) is held, not fatal by default action: msrun ends
    with 128+N and says why, starts nothing, and leaves no process and no cgroup."""
    fifo = msrun.cwd / "topology.fifo"
    os.mkfifo(fifo)
    env = {"MSRUN_TOPOLOGY": str(fifo), "GRANDCHILD": "1"}
    popen = msrun.start([*BASE, "--bind_core=True", "faulty.py"], env=env, start_new_session=True)
    fd = _planning(fifo, popen)
    os.killpg(popen.pid, sig) if sig == signal.SIGINT else popen.send_signal(sig)
    with os.fdopen(fd, "w") as fh:  # planning goes on: the signal is answered once it can be
        fh.write((REPO / "fixtures" / "smt_1node_16cpu_2gpu.json").read_text())
    job = msrun.finish(popen, timeout=60)
    assert job.returncode == 128 + sig, job.stderr
    assert f"msrun: error: interrupted by {sig.name} before the job started: nothing was started" in job.stderr
    assert "Start worker process" not in job.stdout + job.stderr
    assert not (msrun.cwd / "logs").exists()


def _planning(fifo, popen) -> int:
    """Once msrun has ``fifo`` open to read (it is planning, its event loop not there yet): the
    FIFO's write end."""

    def reading() -> int | None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            assert popen.poll() is None, popen.communicate()
            return None

    return wait_for(reading, timeout=60)


def test_kill_9_while_msrun_plans_leaves_no_cgroup(msrun, faulty):
    """msrun SIGKILLed before it started anything: its watchdog, told of the job's cgroup as soon
    as it was made, removes it (the fixture fails the test on an empty ``msrun-*`` cgroup left)."""
    fifo = msrun.cwd / "topology.fifo"
    os.mkfifo(fifo)
    popen = msrun.start([*BASE, "--bind_core=True", "faulty.py"], env={"MSRUN_TOPOLOGY": str(fifo)})
    fd = _planning(fifo, popen)
    popen.kill()
    assert popen.wait(timeout=60) == -signal.SIGKILL
    os.close(fd)


def test_kill_9_of_msrun_leaves_nothing(msrun, faulty):
    popen = msrun.start([*BASE, "faulty.py"], env={"GRANDCHILD": "1"})
    st = wait_running(msrun.cwd / "logs", 3)
    pids = [p["pid"] for p in st["processes"]]
    popen.kill()
    popen.wait()
    left = wait_gone(msrun.mark, timeout=5)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    wait_for(lambda: not any(_alive(pid) for pid in pids), timeout=5)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_join_false_returns_at_once_and_supervises(msrun, faulty):
    # Rank 1 fails only once msrun has returned (the file FAIL_WHEN), and the other ranks hold
    # 120 s: msrun returning at all shows that it does not wait for its job.
    fail_now = msrun.cwd / "fail-now"
    t0 = time.monotonic()
    job = msrun.run(
        job_args(3, "faulty.py", join=False),
        env={"FAIL_RANK": "1", "FAIL_MODE": "exit3", "FAIL_WHEN": str(fail_now), "GRANDCHILD": "1"},
    )
    returned = time.monotonic() - t0
    fail_now.touch()
    assert job.returncode == 0, job.stderr
    assert returned < 30, "at once: in the time it takes to start the job, not to run it"
    assert job.stdout.count("Start worker process") == 3 and "Start scheduler process" in job.stdout
    final = wait_for(lambda: (st := read_status(job.log_dir)) and st["state"] != "running" and st, timeout=20)
    assert final["state"] == "failed" and final["exit_code"] == 3
    assert final["failures"][0]["label"] == "rank 1"
    supervisor_log = (job.log_dir / "msrun_supervisor.log").read_text()
    assert "Root cause" in supervisor_log
    assert not wait_gone(msrun.mark, timeout=5)


def test_join_false_success_status(msrun, faulty):
    job = msrun.run(
        job_args(2, "faulty.py", join=False),
        env={"SLEEP": "0.2"},
    )
    assert job.returncode == 0
    final = wait_for(lambda: (st := read_status(job.log_dir)) and st["state"] != "running" and st, timeout=20)
    assert final["state"] == "succeeded" and final["exit_code"] == 0
    assert all(p["returncode"] == 0 for p in final["processes"])


def test_os_exit_zero_mid_job_is_success_for_that_rank(msrun, faulty):
    job = msrun.run([*BASE, "faulty.py"], env={"FAIL_RANK": "0", "FAIL_MODE": "exit0", "SLEEP": "0.5"})
    assert job.returncode == 0, job.stderr
