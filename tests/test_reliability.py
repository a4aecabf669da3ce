"""The reliability tier: faults, escapees, floods and abuse, with the figures docs/reliability.md states.

Every scenario runs real msrun processes, signals and sockets on loopback; each records what it
measured in the table printed at the end of the session (``conftest.record``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import psutil
import pytest
from conftest import (
    CGROUP_MODES,
    free_port,
    job_args,
    read_status,
    record,
    wait_empty,
    wait_for,
    wait_gone,
    wait_running,
)

from pytest_msrun.engine import containment

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
# With GO_FILE: the ranks that end on their own (FAIL_RANK, or every rank for a success) wait until
# the test has seen all 8 escapees and creates the file; then FAIL_RANK exits 3, the others 0.
go, fail = os.environ.get("GO_FILE"), os.environ.get("FAIL_RANK")
if go and fail in (None, os.environ["RANK_ID"]):
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3 if fail else 0)
time.sleep(600)  # the workload: a rank that is still running when the job is ended
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
    return wait_empty(lambda: tagged(tag), timeout, interval=0.005)  # fine-grained: the delay is measured


# Every containment mode, on every host: a cgroup mode this host lacks is collected and skips with
# the reason (fails under MSRUN_TEST_REQUIRE=cgroup: tests/conftest.py); the sweep always runs.
MODES = [pytest.param(mode, marks=pytest.mark.cgroup(mode), id=mode) for mode in CGROUP_MODES] + ["off"]


def _cgroups_left(job_id: str) -> list[str]:
    """The job's cgroups still there (other jobs' cgroups may vanish while the tree is walked)."""
    name = f"msrun-{job_id}-"  # and its msrun's PID
    return [
        os.path.join(root, d)
        for m in containment._mounts().values()
        for root, dirs, _ in os.walk(m, onerror=lambda _: None)
        for d in dirs
        if d.startswith(name)
    ]


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
    go = msrun.cwd / "go"
    env = {"TAG": tag, containment.CGROUP_ENV: mode, "GO_FILE": str(go)}
    if ending == "rank fails":
        env["FAIL_RANK"] = "1"
    popen = msrun.start(job_args(2, "escapees.py"), env=env)
    wait_running(msrun.cwd / "logs", 2)
    wait_for(lambda: len(tagged(tag)) == 8, timeout=15)  # every escapee exists before the job ends
    if ending == "SIGTERM to msrun":
        popen.send_signal(signal.SIGTERM)
    else:
        go.touch()
    job = msrun.finish(popen, timeout=60)
    assert job.returncode == {"rank fails": 3, "success": 0, "SIGTERM to msrun": 143}[ending], job.stderr
    # msrun itself cleans up: its watchdog stood down when msrun ended, so nothing else kills the
    # escapees - polling a few seconds only lets the SIGKILLed ones finish dying on a loaded host
    left = wait_none_tagged(tag, timeout=5)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert not _cgroups_left(read_status(job.log_dir)["job_id"]) or wait_for(
        lambda: not _cgroups_left(read_status(job.log_dir)["job_id"]), timeout=5
    )
    record(f"{ending}, 8 escapees, {mode}", "0 left", "")


@pytest.mark.parametrize("mode", MODES)
def test_what_escapes_without_a_cgroup(msrun, mode):
    """The sweep finds processes by the job id in their environment: one started with an empty
    environment in a new session escapes it (docs/launcher.md says so); a cgroup catches it."""
    tag = f"noenv-{mode}-{os.getpid()}"
    msrun.script("escapees.py", ESCAPEES)
    try:
        popen = msrun.start(
            job_args(1, "escapees.py"), env={"TAG": tag, containment.CGROUP_ENV: mode, "NO_ENV_ESCAPEE": "1"}
        )
        wait_for(lambda: len(tagged(tag)) == 5, timeout=15)
        popen.kill()
        popen.wait()
        # The final state: every process carrying the job's environment is gone, the watchdog
        # (which kills the job, then exits) included; only what escaped it can still be running.
        left = wait_gone(msrun.mark, timeout=15)
        assert not left, [(p.pid, p.cmdline()) for p in left]
        if mode == "off":
            assert [p.cmdline()[-1] for p in tagged(tag)] == ["noenv"]
        else:
            left = wait_none_tagged(tag)  # SIGKILLed by the cgroup: let them finish dying
            assert not left, (mode, [p.cmdline() for p in left])
    finally:
        for proc in tagged(tag):
            proc.kill()
        wait_none_tagged(tag)


IN_A_COLLECTIVE = """
import ctypes, os, signal, sys, time
from pytest_msrun import cluster
print("started", flush=True)
cluster.init()
rank = cluster.get_rank()
fault = os.environ["FAULT"]
if fault == "ignores SIGTERM":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
for i in range(int(os.environ.get("ROUNDS", "10000"))):
    if rank == 1 and i == 20:
        if fault == "exit 3":
            sys.exit(3)
        if fault == "segfault":
            ctypes.string_at(0)
        if fault == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "os._exit(0)":
            os._exit(0)
        if fault == "ignores SIGTERM":
            sys.exit(5)
    try:
        cluster.barrier()
    except cluster.ClusterError as exc:
        print("collective failed:", exc, flush=True)
        time.sleep(60 if fault == "ignores SIGTERM" else 0)
        sys.exit(7)
"""
FAULTS = {"exit 3": 3, "segfault": 139, "SIGKILL": 137, "os._exit(0)": 7, "ignores SIGTERM": 5}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_rank_fails_inside_a_collective(msrun, fault):
    """Rank 1 fails while the others wait in barriers: they are told at once, the job ends with
    the first failure's status (os._exit(0) is no failure itself: its peers' collective is), and
    nothing is left - a rank ignoring SIGTERM is killed after the grace period."""
    msrun.script("coll.py", IN_A_COLLECTIVE)
    t0 = time.monotonic()
    job = msrun.run(job_args(4, "coll.py"), env={"FAULT": fault, "MSRUN_TERM_TIMEOUT": "1"}, timeout=60)
    took = time.monotonic() - t0
    assert job.returncode == FAULTS[fault], job.stderr
    assert not wait_gone(msrun.mark)
    if fault == "os._exit(0)":  # its connection closing or its agent's news, whichever came first
        said = job.log("worker_0.log")
        assert re.search(r"collective failed: barrier failed on rank 0: .*rank 1 left the job \(", said), said
    record(f"rank fails in a collective: {fault}", f"exit {job.returncode}, 0 left", f"job {took:.1f} s")


LEAVES_THEN_ENDS = """
import os, sys, time
from pytest_msrun import cluster
from pytest_msrun.control import cluster as control
cluster.init()
rank = cluster.get_rank()
if rank == 1:
    control._require().channel.close()  # as the kernel closes it when the process begins to exit
    time.sleep(float(os.environ["LINGER"]))  # its exit takes this long; its peers fail meanwhile
    sys.exit(3)
try:
    cluster.barrier()
except cluster.ClusterError as exc:
    print("collective failed:", exc, flush=True)
    sys.exit(7)
"""


@pytest.mark.parametrize("linger", [0.5, 5.0])
def test_a_rank_that_left_first_is_the_root_cause_though_it_ends_last(msrun, linger):
    """Rank 1's connection closes as its exit begins; its peers' barrier fails at once and they
    exit first. The job still ends with rank 1's status, its root cause - unless it takes longer
    than LEFT_WAIT (2 s) to end: then the first failure seen decides."""
    msrun.script("leaves.py", LEAVES_THEN_ENDS)
    job = msrun.run(job_args(3, "leaves.py"), env={"LINGER": str(linger)}, timeout=60)
    if linger < 2:
        assert job.returncode == 3, job.stderr
        said = job.stdout + job.stderr
        assert re.search(r"Root cause \(first observed failure\):\s+rank 1 ", said), said
    else:
        assert job.returncode == 7, job.stderr
    assert not wait_gone(msrun.mark)


def test_kill_9_of_the_scheduler_ends_the_job(msrun):
    msrun.script("escapees.py", ESCAPEES)
    tag = f"sched-{os.getpid()}"
    popen = msrun.start(job_args(2, "--scheduler=builtin", "escapees.py"), env={"TAG": tag})
    status = wait_running(msrun.cwd / "logs", 2)
    sched = next(p["pid"] for p in status["processes"] if p["role"] == "scheduler")
    t0 = time.monotonic()
    os.kill(sched, signal.SIGKILL)
    job = msrun.finish(popen, timeout=30)
    took = time.monotonic() - t0
    assert job.returncode == 137, job.stderr
    assert not wait_none_tagged(tag) and not wait_gone(msrun.mark)
    record("kill -9 of the scheduler", "exit 137, 0 left", f"{took * 1000:.0f} ms to exit")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGHUP", "SIGQUIT"])
def test_every_signal_to_msrun_takes_the_escapees_too(msrun, sig):
    tag = f"signal-{sig}-{os.getpid()}"
    msrun.script("escapees.py", ESCAPEES)
    # as a terminal starts it: the signal at its default (a background job of a script ignores SIGINT and SIGQUIT)
    default = getattr(signal, sig)
    popen = msrun.start(
        job_args(2, "escapees.py"), env={"TAG": tag}, preexec_fn=lambda: signal.signal(default, signal.SIG_DFL)
    )
    wait_running(msrun.cwd / "logs", 2)
    wait_for(lambda: len(tagged(tag)) == 8, timeout=15)
    popen.send_signal(default)
    job = msrun.finish(popen, timeout=30)
    expected = 128 + getattr(signal, sig) if sig != "SIGQUIT" else -signal.SIGQUIT
    assert job.returncode == expected, job.stderr
    assert not wait_none_tagged(tag, timeout=5) and not wait_gone(msrun.mark)
    record(f"{sig} to msrun, 8 escapees", "0 left", "")


LOUD = """
import os, sys
rank = os.environ["RANK_ID"]
out = sys.stdout.buffer
for i in range(int(os.environ["LINES"])):
    out.write(b"line %d of rank %s\\n" % (i, rank.encode()))
out.write(b"bad utf-8 \\xff\\xfe\\xc3 in rank " + rank.encode() + b"\\n")
out.write(b"x" * (10 * 1024 * 1024) + b" end of the long line of rank " + rank.encode() + b"\\n")
out.flush()
"""


def test_output_bursts_lose_no_line(msrun):
    """200k lines per rank, invalid UTF-8, a 10 MB line: every line of every rank reaches the
    console, prefixed, in order."""
    msrun.script("loud.py", LOUD)
    lines = 200_000
    proc = subprocess.run(
        msrun.argv(job_args(2, "loud.py")),
        cwd=msrun.cwd,
        env=msrun.env({"LINES": str(lines)}),
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = proc.stdout.split(b"\n")
    lost = 0
    for rank in (0, 1):
        prefix = f"[rank {rank}] ".encode()
        mine = [ln[len(prefix) :] for ln in out if ln.startswith(prefix)]
        expected = [b"line %d of rank %d" % (i, rank) for i in range(lines)]
        assert mine[:lines] == expected
        assert mine[lines] == b"bad utf-8 \xff\xfe\xc3 in rank %d" % rank
        assert mine[lines + 1] == b"x" * (10 * 1024 * 1024) + b" end of the long line of rank %d" % rank
        lost += lines + 2 - len(mine)
    record(f"output burst: 2 x {lines} lines, invalid UTF-8, a 10 MB line", f"{lost} lines lost", "")


def test_64_local_workers(msrun):
    msrun.script("coll.py", IN_A_COLLECTIVE)
    t0 = time.monotonic()
    job = msrun.run(job_args(64, "coll.py"), env={"FAULT": "none", "ROUNDS": "30"}, timeout=300)
    took = time.monotonic() - t0
    assert job.returncode == 0, job.stderr
    assert not wait_gone(msrun.mark)
    failing = msrun.run(job_args(64, "coll.py"), env={"FAULT": "exit 3", "ROUNDS": "30"}, timeout=300)
    assert failing.returncode == 3 and not wait_gone(msrun.mark)
    record("64 local workers: success, then a rank fails", "exit 0, exit 3, 0 left", f"{took:.1f} s")


BIG = """
from pytest_msrun import cluster
cluster.init()
cluster.barrier()
got = cluster.all_gather_object(cluster.get_rank())
assert got == list(range(cluster.get_group_size()))
"""


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


@pytest.mark.parametrize(
    "ranks,node_rank",
    # 1024 ranks without --node_rank only in the slow tier: 512 covers that path, 1024 the scale
    [(512, False), pytest.param(1024, False, marks=pytest.mark.slow), (1024, True)],
    ids=["512", "1024", "1024-node_rank"],
)
def test_many_ranks_on_8_nodes_end_cleanly_under_load(msrun, ranks, node_rank):
    """8 msrun invocations on loopback: init, barrier, all-gather, and every node ends with 0.
    On a 2-core machine 1024 ranks take a node a minute to start: it heartbeats meanwhile, and a
    rank whose handshake the starved scheduler answers late is not dropped (or tries again)."""
    need = ranks * 12 / 1024  # GiB: a rank is a Python process of about 10 MiB
    if _mem_available_gib() < need:
        pytest.skip(f"{ranks} ranks need about {need:.0f} GiB of memory; {_mem_available_gib():.1f} GiB available")
    msrun.script("big.py", BIG)
    port = free_port()
    t0 = time.monotonic()
    nodes = [
        msrun.start(
            [
                f"--worker_num={ranks}",
                f"--local_worker_num={ranks // 8}",
                f"--master_port={port}",
                "--join=True",
                f"--log_dir=n{i}",
                "--tail_worker_log=0",
                *([f"--node_rank={i}"] if node_rank else []),
                "big.py",
            ]
        )
        for i in range(8)
    ]
    jobs = [msrun.finish(n, timeout=900) for n in nodes]
    took = time.monotonic() - t0
    sched = next(p for p in msrun.cwd.glob("n*/scheduler.log"))
    text = sched.read_text()
    if any(j.returncode for j in jobs):  # why, first: each failing node's error lines, the scheduler's last words
        why = [
            f"node {i} exit {j.returncode}: "
            + " | ".join(line for line in j.stderr.splitlines() if "rror" in line)[:600]
            for i, j in enumerate(jobs)
            if j.returncode
        ]
        pytest.fail("\n".join([*why, "scheduler.log ends:", *text.splitlines()[-15:]]), pytrace=False)
    assert text.count("agent done") == 8 and "lost node" not in text and "aborting" not in text
    assert not wait_gone(msrun.mark, timeout=60)
    how = " with --node_rank" if node_rank else ""
    record(f"{ranks} ranks on 8 nodes{how}: init, barrier, all-gather", "8 x exit 0, 0 lost nodes", f"{took:.1f} s")


@pytest.mark.parametrize("mode", [m for m in MODES if m != "off"])
def test_the_next_msrun_removes_empty_cgroups_of_dead_msruns(msrun, mode):
    """A job cgroup whose msrun and watchdog were killed together (a Slurm step cancelled: SIGKILL to
    every process of it) is empty and has no one to remove it: the next msrun below the same cgroup
    does. One whose msrun is alive, or that has members, stays."""
    mount = containment._mounts()["cgroup2" if mode == "v2" else "freezer"]
    own = containment._own_paths()["" if mode == "v2" else next(c for c in containment._own_paths() if "freezer" in c)]
    home = os.path.join(mount, own.lstrip("/"))
    dead = subprocess.Popen(["true"])
    dead.wait()  # its PID names no process now
    stale = os.path.join(home, f"msrun-{os.urandom(8).hex()}-{dead.pid}")
    alive = os.path.join(home, f"msrun-{os.urandom(8).hex()}-{os.getpid()}")
    os.mkdir(stale)
    os.mkdir(alive)
    try:
        msrun.script("ok.py", "pass")
        job = msrun.run(job_args(1, "ok.py"), env={containment.CGROUP_ENV: mode})
        assert job.returncode == 0, job.stderr
        assert not os.path.exists(stale)
        assert os.path.isdir(alive)
    finally:
        for path in (stale, alive):
            if os.path.isdir(path):
                os.rmdir(path)
