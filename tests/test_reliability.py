"""The reliability tier: faults, escapees, floods and abuse, with the figures the README states.

Every scenario runs real msrun processes, signals and sockets on loopback; each records what it
measured in the table printed at the end of the session (``conftest.record``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from conftest import job_args, read_status, record, wait_for, wait_gone, wait_running

from pytest_msrun import containment

# A rank that starts every kind of process that leaves its process group, then waits.
ESCAPEES = """
import os, subprocess, sys, time
tag = os.environ["TAG"]
sleeper = [sys.executable, "-c", "import time; time.sleep(600)", tag]
subprocess.Popen(sleeper)                                  # same group
subprocess.Popen(sleeper, start_new_session=True)          # a new session
subprocess.Popen([sys.executable, "-c", "import os, time; os.setpgid(0, 0); time.sleep(600)", tag])
if os.fork() == 0:                                         # a double-forked daemon
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, sleeper)
    os._exit(0)
if os.environ.get("NO_ENV_ESCAPEE"):                       # a process without the job's environment
    subprocess.Popen(sleeper + ["noenv"], env={}, start_new_session=True)
print("started", flush=True)
if os.environ.get("RANK_ID") == os.environ.get("FAIL_RANK"):
    time.sleep(0.5)
    sys.exit(3)
time.sleep(float(os.environ.get("SLEEP", "600")))
"""


def tagged(tag: str) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if tag in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def wait_none_tagged(tag: str, timeout: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        left = tagged(tag)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def modes() -> list[str]:
    """The containment modes this host supports (the sweep always)."""
    out = ["off"]
    probe = containment.create(f"probe{os.getpid()}")
    if probe is not None:
        probe.leave()
        probe.remove(1)
        out.insert(0, probe.kind)
        if probe.kind == "v2" and containment._mounts().get("freezer"):
            out.insert(1, "freezer")
    return out


MODES = modes()


def _cgroups_left(job_id: str) -> list[str]:
    mounts = containment._mounts().values()
    return [str(p) for m in mounts for p in Path(m).rglob(f"msrun-{job_id}")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", ["msrun", "supervisor"])
def test_kill_9_leaves_no_escapee(msrun, mode, target):
    """kill -9 of msrun (--join=True) or of the detached supervisor (--join=False): the job's
    processes, whichever group or session they moved to, are all gone."""
    tag = f"escapee-{mode}-{target}-{os.getpid()}"
    msrun.script("escapees.py", ESCAPEES)
    env = {"TAG": tag, containment.CGROUP_ENV: mode}
    if target == "msrun":
        popen = msrun.start(job_args(2, "escapees.py"), env=env)
    else:
        msrun.run(job_args(2, "escapees.py", join=False), env=env)
    status = wait_running(msrun.cwd / "logs", 2)
    wait_for(lambda: len(tagged(tag)) == 8, timeout=15)  # 4 per rank
    t0 = time.monotonic()
    if target == "msrun":
        popen.kill()
        popen.wait()
    else:
        os.kill(status["supervisor_pid"], signal.SIGKILL)
    left = wait_none_tagged(tag)
    gone_in = time.monotonic() - t0
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert not wait_gone(msrun.mark), "and nothing else of the job"
    job_id = status["job_id"]
    assert wait_for(lambda: not _cgroups_left(job_id), timeout=10)
    record(f"kill -9 of {target}, 8 escapees, {mode}", "0 left", f"{gone_in * 1000:.0f} ms")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ending", ["rank fails", "success", "SIGTERM to msrun"])
def test_escapees_die_with_the_job(msrun, mode, ending):
    tag = f"escapee-{mode}-{ending.replace(' ', '')}-{os.getpid()}"
    msrun.script("escapees.py", ESCAPEES)
    env = {"TAG": tag, containment.CGROUP_ENV: mode, "SLEEP": "1" if ending == "success" else "600"}
    if ending == "rank fails":
        env["FAIL_RANK"] = "1"
    popen = msrun.start(job_args(2, "escapees.py"), env=env)
    wait_running(msrun.cwd / "logs", 2)
    if ending == "SIGTERM to msrun":
        wait_for(lambda: len(tagged(tag)) == 8, timeout=15)
        popen.send_signal(signal.SIGTERM)
    job = msrun.finish(popen, timeout=60)
    assert job.returncode == {"rank fails": 3, "success": 0, "SIGTERM to msrun": 143}[ending], job.stderr
    left = wait_none_tagged(tag, timeout=1)  # msrun itself cleans up: no waiting for a watchdog
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert not _cgroups_left(read_status(job.log_dir)["job_id"]) or wait_for(
        lambda: not _cgroups_left(read_status(job.log_dir)["job_id"]), timeout=5
    )
    record(f"{ending}, 8 escapees, {mode}", "0 left", "")


def test_what_escapes_without_a_cgroup(msrun):
    """The sweep finds processes by the job id in their environment: one started with an empty
    environment in a new session escapes it (the README says so); a cgroup catches it."""
    tag = f"noenv-{os.getpid()}"
    msrun.script("escapees.py", ESCAPEES)
    try:
        for mode in MODES:
            popen = msrun.start(
                job_args(1, "escapees.py"), env={"TAG": tag, containment.CGROUP_ENV: mode, "NO_ENV_ESCAPEE": "1"}
            )
            wait_for(lambda: len(tagged(tag)) == 5, timeout=15)
            popen.kill()
            popen.wait()
            time.sleep(1.0)
            left = [p for p in tagged(tag)]
            if mode == "off":
                assert [p.cmdline()[-1] for p in left] == ["noenv"]
            else:
                assert not left, (mode, [p.cmdline() for p in left])
            for proc in left:
                proc.kill()
            wait_none_tagged(tag)
    finally:
        for proc in tagged(tag):
            proc.kill()
