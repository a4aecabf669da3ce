"""Real multi-host msrun without Slurm: one msrun per namespaced host (tests/lab/netlab.py), explicit flags.

Each node has its own hostname, address and loopback, so the job crosses a real network: the
scheduler listens on node1's lab address, node2 reaches it over the bridge, and a partition is a
link taken down.
"""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest
from conftest import Job, free_port, rank_dumps, wait_for, wait_gone

pytestmark = pytest.mark.netns

HEARTBEAT = 2  # MS_NODE_TIMEOUT for the partition case, in seconds

# Joins the group, all-gathers who is where, barriers, writes what it saw; then, with HOLD, parks
# (after printing "parked") in a barrier that only completes when every rank comes back from sleep.
TASK = """
import json, os, socket, sys, time
from pytest_msrun import cluster

cluster.init()
rank, size = cluster.get_rank(), cluster.get_group_size()
host = socket.gethostname()
me = {"rank": rank, "size": size, "host": host, "addr": socket.gethostbyname(host), "local": cluster.get_local_rank()}
everyone = cluster.all_gather_object(me)
cluster.barrier()
keys = ("RANK_ID", "MS_SCHED_HOST", "MS_SCHED_PORT", "MSRUN_JOB_ID", "GROUP_RANK")
with open(os.path.join(os.environ["DUMP_DIR"], f"rank{rank}.json"), "w") as fh:
    json.dump({"me": me, "everyone": everyone, "env": {k: os.environ.get(k, "") for k in keys}}, fh)
hold = float(os.environ.get("HOLD", "0"))
if hold:
    print("parked", flush=True)
    time.sleep(hold)
    cluster.barrier()
cluster.finalize()
"""


def _start(msrun, lab, k: int, port: int, master: str, env: dict[str, str], log_dir: str) -> subprocess.Popen[str]:
    """msrun on node ``k`` of ``lab``: node k-1 of 2, 2 workers of 4, logs in ``log_dir``."""
    args = [
        "--worker_num=4",
        "--local_worker_num=2",
        f"--master_addr={master}",
        f"--master_port={port}",
        f"--node_rank={k - 1}",
        "--join=True",
        f"--log_dir={log_dir}",
        "--cluster_time_out=30",
        "task.py",
    ]
    popen = subprocess.Popen(
        [*lab.prefix(k), *msrun.argv(args)],
        cwd=msrun.cwd,
        env=msrun.env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    msrun.popens.append(popen)  # killed by the msrun fixture if the test fails early
    return popen


def _job(msrun, lab, master_of, extra: dict[str, str] | None = None) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Start node1 (the scheduler's node), wait until it listens, start node2."""
    msrun.script("task.py", TASK)
    port = free_port()
    env = {"MSRUN_JOB_TOKEN": uuid.uuid4().hex, **(extra or {})}
    first = _start(msrun, lab, 1, port, master_of(1), env, "logs1")
    sched = msrun.cwd / "logs1" / "scheduler.log"
    wait_for(lambda: sched.exists() and "listening" in sched.read_text(), 30)
    second = _start(msrun, lab, 2, port, master_of(2), env, "logs2")
    return first, second


def _finish(msrun, popen: subprocess.Popen, log_dir: str, timeout: float = 60) -> Job:
    out, err = popen.communicate(timeout=timeout)
    return Job(popen.returncode, out, err, msrun.cwd / log_dir)


def _dumps(msrun) -> dict[int, dict]:
    return rank_dumps(msrun.dump)


def _assert_nothing_left(msrun, lab) -> None:
    left = wait_gone(msrun.mark, timeout=10)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    for k in (1, 2):
        assert lab.processes(k) == [], f"processes left on node{k}"


def _check_layout(msrun, lab) -> None:
    dumps = _dumps(msrun)
    assert sorted(dumps) == [0, 1, 2, 3]
    where = {r: (d["me"]["host"], d["me"]["addr"]) for r, d in dumps.items()}
    node1, node2 = ("node1", lab.address(1)), ("node2", lab.address(2))
    assert where == {0: node1, 1: node1, 2: node2, 3: node2}
    for rank, d in dumps.items():
        assert [e["host"] for e in d["everyone"]] == ["node1", "node1", "node2", "node2"], rank
        assert [e["rank"] for e in d["everyone"]] == [0, 1, 2, 3]
        assert d["me"]["local"] == rank % 2 and d["me"]["size"] == 4
        assert d["env"]["MSRUN_JOB_ID"] == dumps[0]["env"]["MSRUN_JOB_ID"]


def test_two_hosts_form_one_job_over_lab_addresses(msrun, netlab2):
    first, second = _job(msrun, netlab2, lambda k: netlab2.address(1))
    a, b = _finish(msrun, first, "logs1"), _finish(msrun, second, "logs2")
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    _check_layout(msrun, netlab2)
    for d in _dumps(msrun).values():
        assert d["env"]["MS_SCHED_HOST"] == netlab2.address(1)
    assert sorted(p.name for p in (msrun.cwd / "logs1").glob("worker_*.log")) == ["worker_0.log", "worker_1.log"]
    assert sorted(p.name for p in (msrun.cwd / "logs2").glob("worker_*.log")) == ["worker_2.log", "worker_3.log"]
    assert "Start scheduler process" in a.stdout and "Start scheduler process" not in b.stdout
    _assert_nothing_left(msrun, netlab2)


def test_master_addr_is_a_hostname_resolved_on_each_node(msrun, netlab2):
    first, second = _job(msrun, netlab2, lambda k: "node1")
    a, b = _finish(msrun, first, "logs1"), _finish(msrun, second, "logs2")
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    _check_layout(msrun, netlab2)
    assert "Start scheduler process" in a.stdout and "Start scheduler process" not in b.stdout
    _assert_nothing_left(msrun, netlab2)


def test_partition_ends_every_node_within_the_heartbeat_timeout(msrun, netlab2):
    extra = {"HOLD": "120", "MS_NODE_TIMEOUT": str(HEARTBEAT)}
    first, second = _job(msrun, netlab2, lambda k: netlab2.address(1), extra)
    try:
        wait_for(lambda: len(_dumps(msrun)) == 4, 60)
        logs = [msrun.cwd / f"logs{1 + r // 2}" / f"worker_{r}.log" for r in range(4)]
        wait_for(lambda: all(p.exists() and "parked" in p.read_text() for p in logs), 30)
        netlab2.set_link(2, up=False)
        t0 = time.monotonic()
        a = _finish(msrun, first, "logs1", timeout=HEARTBEAT + 30)
        ta = time.monotonic() - t0
        b = _finish(msrun, second, "logs2", timeout=HEARTBEAT + 30)
        tb = time.monotonic() - t0
    finally:
        netlab2.set_link(2, up=True)
    print(f"partition: node1 exited {a.returncode} after {ta:.2f} s, node2 exited {b.returncode} after {tb:.2f} s")
    assert a.returncode != 0, a.stderr
    assert b.returncode != 0, b.stderr
    # Each side notices within the heartbeat timeout (plus a heartbeat and the teardown).
    assert ta < HEARTBEAT + 4, (ta, a.stderr)
    assert tb < HEARTBEAT + 4, (tb, b.stderr)
    # The master's side names the lost node; the lost node says it lost the scheduler.
    assert f"lost node node2 ({netlab2.address(2)}, node_rank 1" in a.stderr, a.stderr
    assert "no heartbeat" in a.stderr, a.stderr
    assert "Lost the scheduler" in b.stderr and "heartbeat" in b.stderr, b.stderr
    _assert_nothing_left(msrun, netlab2)


MINDSPORE_TASK = """
import socket
import mindspore as ms
from mindspore.communication import get_group_size, get_rank, init
ms.set_device("CPU")
init()
print(f"mindspore rank {get_rank()}/{get_group_size()} on {socket.gethostname()}", flush=True)
import os, time
while not os.path.exists(os.environ["STOP_FILE"]):
    time.sleep(0.05)
"""

# A stranger on node2 (not a process of the job there): MindSpore's magic, held open, then garbage.
STRANGER = """
import socket, sys, time
held = []
for i in range(30):
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    s.sendall(b"RPC" + bytes(i))
    held.append(s)
time.sleep(float(sys.argv[3]))
print("sent", len(held), flush=True)
"""


@pytest.mark.mindspore
def test_mindspore_workers_of_both_hosts_are_relayed_and_a_strangers_are_not(msrun, netlab2):
    """MindSpore's RPC has no authentication: a connection speaking it from node2 is relayed only
    when node2's msrun vouches that a process of its job holds it. The job's own MindSpore workers
    on both hosts form their group; a stranger's connections from node2 are dropped and counted,
    and the job ends 0 on both nodes."""
    import sys

    msrun.script("task.py", MINDSPORE_TASK)
    port = free_port()
    stop = msrun.cwd / "stop"
    env = {"MSRUN_JOB_TOKEN": uuid.uuid4().hex, "STOP_FILE": str(stop)}
    first = _start(msrun, netlab2, 1, port, netlab2.address(1), env, "logs1")
    sched = msrun.cwd / "logs1" / "scheduler.log"
    wait_for(lambda: sched.exists() and "listening" in sched.read_text(), 60)
    second = _start(msrun, netlab2, 2, port, netlab2.address(1), env, "logs2")
    logs = [msrun.cwd / d / f"worker_{r}.log" for r, d in ((0, "logs1"), (1, "logs1"), (2, "logs2"), (3, "logs2"))]
    wait_for(lambda: all(p.exists() and "mindspore rank" in p.read_text() for p in logs), 180)
    attack = netlab2.run(2, [sys.executable, "-c", STRANGER, netlab2.address(1), str(port), "6"], timeout=60)
    assert attack.stdout.strip() == "sent 30", attack.stderr
    stop.touch()
    a, b = _finish(msrun, first, "logs1", timeout=120), _finish(msrun, second, "logs2", timeout=120)
    log = sched.read_text()
    assert (a.returncode, b.returncode) == (0, 0), a.stderr + b.stderr + log[-3000:]
    for rank, path in enumerate(logs):
        assert f"mindspore rank {rank}/4 on node" in path.read_text()
    import re

    said = re.search(rf"dropped \d+ connection\(s\) from {re.escape(netlab2.address(2))} in .*", log)
    assert said and "30 MindSpore-protocol client its node's msrun does not know as this job's" in said.group(0), log
    assert "Traceback" not in log
    _assert_nothing_left(msrun, netlab2)
