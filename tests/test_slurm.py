"""msrun and the plugin on a real Slurm cluster: the lab's two namespaced nodes (tests/lab/slurmlab.py).

``srun -N2 --ntasks-per-node=1 msrun --local_worker_num=2 task.py`` with no other flag is one
4-rank job across node1 and node2; scancel, a failing rank, a killed msrun and a node that never
starts leave nothing running; inside ``salloc -N2`` a marked test of two nodes runs on both.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import REPO, rank_dumps, wait_for, wait_gone

pytestmark = pytest.mark.slurm

TASK = """
import json, os, socket, sys, time
from pytest_msrun import cluster

cluster.init()
rank = cluster.get_rank()
everyone = cluster.all_gather_object({"rank": rank, "host": socket.gethostname()})
cluster.barrier()
with open(os.path.join(os.environ["DUMP_DIR"], f"rank{rank}.json"), "w") as fh:
    json.dump({"everyone": everyone, "size": cluster.get_group_size(), "env": dict(os.environ)}, fh)
cluster.barrier()  # every rank wrote what it saw before FAIL_RANK fails
if os.environ.get("FAIL_RANK") == str(rank):
    sys.exit(3)
hold = float(os.environ.get("HOLD", "0"))
if hold:
    print("parked", flush=True)
    time.sleep(hold)
cluster.finalize()
"""

MSRUN = [sys.executable, "-m", "pytest_msrun"]
SRUN = ["srun", "-N2", "--ntasks-per-node=1"]


def _env(msrun, slurm_lab, **extra: str) -> dict[str, str]:
    return slurm_lab.env(msrun.env(extra))


def _srun(msrun, slurm_lab, args: list[str], env: dict[str, str], srun: list[str] = SRUN) -> subprocess.Popen[str]:
    popen = subprocess.Popen(
        [*srun, *MSRUN, *args], cwd=msrun.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    msrun.popens.append(popen)
    return popen


def _dumps(msrun) -> dict[int, dict]:
    return rank_dumps(msrun.dump)


def _job_of(slurm_lab, name: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i", "-n", name], env=slurm_lab.env(), capture_output=True, text=True, timeout=30
    ).stdout.strip()
    assert out.isdigit(), out
    return out


def _parked(msrun, n: int) -> bool:
    logs = list((msrun.cwd / "logs").glob("worker_*.log"))
    return sum("parked" in p.read_text(errors="replace") for p in logs) >= n


def test_srun_with_no_flag_but_local_worker_num_is_one_job(msrun, slurm_lab):
    msrun.script("task.py", TASK)
    popen = _srun(
        msrun, slurm_lab, ["--local_worker_num=2", "--join=True", "--log_dir=logs", "task.py"], _env(msrun, slurm_lab)
    )
    out, err = popen.communicate(timeout=120)
    assert popen.returncode == 0, out + err
    dumps = _dumps(msrun)
    assert sorted(dumps) == [0, 1, 2, 3]
    hosts = {d["rank"]: d["host"] for d in dumps[0]["everyone"]}
    assert hosts == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    assert {d["size"] for d in dumps.values()} == {4}
    assert {d["env"]["MS_SCHED_HOST"] for d in dumps.values()} == {slurm_lab.net.address(1)}  # node1, resolved
    assert len({d["env"]["MS_SCHED_PORT"] for d in dumps.values()}) == 1
    # Each node printed what it took from the step, once.
    lines = [line for line in out.splitlines() if "inferred" in line]
    assert len(lines) == 2, out
    assert all(re.search(r"Slurm job \d+ step \d+, node [01] of 2 \(node1, node2\)", line) for line in lines)
    assert any("--node_rank=1 --worker_num=4 --master_addr=node1 --master_port=" in line for line in lines)
    # The status files of the two nodes do not collide in the shared log directory.
    for n in (0, 1):
        status = json.loads((msrun.cwd / "logs" / f"msrun_status_node{n}.json").read_text())
        assert status["state"] == "succeeded" and status["host"] == f"node{n + 1}"


def test_a_failing_rank_on_node2_ends_every_node_with_its_code(msrun, slurm_lab):
    msrun.script("task.py", TASK)
    env = _env(msrun, slurm_lab, FAIL_RANK="3", HOLD="60")
    t0 = time.monotonic()
    popen = _srun(msrun, slurm_lab, ["--local_worker_num=2", "--join=True", "--log_dir=logs", "task.py"], env)
    out, err = popen.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert popen.returncode == 3, out + err
    assert elapsed < 30  # not the 60 s the other ranks would hold
    # Both msruns exited with the first failure's code and name where it happened.
    for n in (0, 1):
        status = json.loads((msrun.cwd / "logs" / f"msrun_status_node{n}.json").read_text())
        assert status["exit_code"] == 3, status
    assert "rank 3" in err and "node2" in err, err
    assert not wait_gone(msrun.mark)


def test_scancel_clears_every_node(msrun, slurm_lab):
    msrun.script("task.py", TASK)
    name = f"msrun-{msrun.mark[:8]}"
    env = _env(msrun, slurm_lab, HOLD="300")
    popen = _srun(
        msrun,
        slurm_lab,
        ["--local_worker_num=2", "--join=True", "--log_dir=logs", "task.py"],
        env,
        srun=[*SRUN, f"--job-name={name}"],
    )
    wait_for(lambda: _parked(msrun, 4), 60)
    t0 = time.monotonic()
    subprocess.run(["scancel", _job_of(slurm_lab, name)], env=slurm_lab.env(), check=True, timeout=30)
    popen.communicate(timeout=60)
    left = wait_gone(msrun.mark, timeout=10)
    gone_after = time.monotonic() - t0
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert gone_after < 10
    assert popen.returncode != 0


def test_a_killed_msrun_on_one_node_ends_the_job_everywhere(msrun, slurm_lab):
    msrun.script("task.py", TASK)
    env = _env(msrun, slurm_lab, HOLD="300")
    popen = _srun(msrun, slurm_lab, ["--local_worker_num=2", "--join=True", "--log_dir=logs", "task.py"], env)
    wait_for(lambda: _parked(msrun, 4), 60)
    status = json.loads((msrun.cwd / "logs" / "msrun_status_node1.json").read_text())
    t0 = time.monotonic()
    psutil.Process(status["supervisor_pid"]).send_signal(signal.SIGKILL)
    out, err = popen.communicate(timeout=60)
    left = wait_gone(msrun.mark, timeout=10)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert time.monotonic() - t0 < 15
    assert popen.returncode != 0
    assert "lost node node2" in err or "node2" in err, err


def test_a_node_that_never_starts_stops_the_others_with_kill_on_bad_exit(msrun, slurm_lab):
    """node2's msrun refuses to start (exit 2); srun -K stops node1's at once instead of letting it
    wait --cluster_time_out for the missing node."""
    msrun.script("task.py", TASK)
    env = _env(msrun, slurm_lab, HOLD="300")
    launcher = '[ "$SLURM_NODEID" = 1 ] && exec "$0" -m pytest_msrun --bind_core=nonsense task.py; exec "$0" "$@"'
    argv = [*SRUN, "--kill-on-bad-exit=1", "sh", "-c", launcher, sys.executable]
    argv += ["-m", "pytest_msrun", "--local_worker_num=2", "--join=True", "--log_dir=logs", "task.py"]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=msrun.cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 30, proc.stderr
    assert "--bind_core" in proc.stderr
    assert not wait_gone(msrun.mark, timeout=10)


PLUGIN_TEST = """
import socket

import pytest


@pytest.mark.msrun(worker_num=4, local_worker_num=2)
def test_two_nodes(rank, world_size, msrun):
    hosts = msrun.all_gather(socket.gethostname())
    assert world_size == 4
    assert hosts == ["node1", "node1", "node2", "node2"]


@pytest.mark.msrun(worker_num=4, local_worker_num=2)
def test_fails_on_node2(rank):
    assert rank < 2
"""


def test_a_marked_two_node_test_inside_salloc_runs_on_both_nodes(msrun, slurm_lab):
    (msrun.cwd / "test_cluster.py").write_text(textwrap.dedent(PLUGIN_TEST))
    env = _env(msrun, slurm_lab)
    env["PYTHONPATH"] = str(REPO)
    argv = ["salloc", "-N2", sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_cluster.py"]
    proc = subprocess.run(argv, cwd=msrun.cwd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    # Where each rank ran, in the report; the failure's reproduce line is an srun inside the allocation.
    assert re.search(r"rank 0: node1\s+rank 1: node1\s+rank 2: node2\s+rank 3: node2", out), out
    assert re.search(r"rank 2 on node2: .*worker_2\.log", out), out
    assert "srun --nodes=2" in out and "--exact" in out
    assert not wait_gone(msrun.mark, timeout=10)


SUITE = """
def test_everywhere(rank, world_size):
    assert world_size == 4

def test_bad_on_rank_2(rank):
    assert rank != 2
"""


def test_suite_mode_under_srun_prints_one_table_and_fails(msrun, slurm_lab):
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_suite.py").write_text(textwrap.dedent(SUITE))
    env = _env(msrun, slurm_lab)
    args = ["--local_worker_num=2", "--join=True", "--log_dir=logs", "pytest", "-q", "-p", "no:cacheprovider", "suite"]
    popen = _srun(msrun, slurm_lab, args, env)
    out, err = popen.communicate(timeout=180)
    assert popen.returncode != 0, out + err
    assert out.count("msrun: pytest results of 4 rank(s)") == 1, out
    table = out[out.index("msrun: pytest results of 4 rank(s)") :]
    assert re.search(r"test_everywhere\s+passed\s+passed\s+passed\s+passed\s+passed", table), table
    assert re.search(r"test_bad_on_rank_2\s+passed\s+passed\s+failed\s+passed\s+failed", table), table
    assert "msrun: hosts: node1: ranks 0, 1; node2: ranks 2, 3" in table
    assert "node 0 prints the pytest results of every node" in out


def test_a_marked_two_node_test_in_an_sbatch_script(msrun, slurm_lab):
    (msrun.cwd / "test_cluster.py").write_text(textwrap.dedent(PLUGIN_TEST))
    script = msrun.cwd / "job.sh"
    script.write_text(
        f"#!/bin/sh\nexec {sys.executable} -m pytest -q -rA -p no:cacheprovider test_cluster.py -k two_nodes\n"
    )
    env = _env(msrun, slurm_lab)
    env["PYTHONPATH"] = str(REPO)
    argv = ["sbatch", "--wait", "-N2", f"--output={msrun.cwd / 'job.out'}", str(script)]
    proc = subprocess.run(argv, cwd=msrun.cwd, env=env, capture_output=True, text=True, timeout=300)
    out = (msrun.cwd / "job.out").read_text()
    assert proc.returncode == 0, proc.stderr + out
    assert "1 passed" in out and re.search(r"rank 0: node1\s+rank 1: node1\s+rank 2: node2\s+rank 3: node2", out), out
    assert not wait_gone(msrun.mark, timeout=10)
