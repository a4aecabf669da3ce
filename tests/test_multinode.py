"""Two or more msrun invocations on this machine (loopback) form one job through the builtin scheduler."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import psutil
import pytest
from conftest import FAULTY, free_port, read_status, wait_for

from pytest_msrun.control import wire

STRONG = "multinode-test-token-0123456789"  # a token the weakness rule accepts


def _node_args(port, local, total, extra=(), script="env_dump.py", time_out=20):
    """One node's msrun flags and task in a job of ``total`` ranks on this host."""
    return [
        f"--worker_num={total}",
        f"--local_worker_num={local}",
        f"--master_port={port}",
        "--join=True",
        "--log_dir=logs",
        f"--cluster_time_out={time_out}",
        *extra,
        script,
    ]


def _node(msrun, port, local, total, extra=(), env=None, script="env_dump.py"):
    return msrun.start(_node_args(port, local, total, extra, script), env=env)


def _wait_listening(msrun):
    wait_for(
        lambda: (
            (msrun.cwd / "logs" / "scheduler.log").exists()
            and "listening" in (msrun.cwd / "logs" / "scheduler.log").read_text()
        )
    )


def _ranks_by_node(dumps):
    by_node: dict[str, list[int]] = {}
    for d in dumps:
        by_node.setdefault(d["GROUP_RANK"], []).append(int(d["RANK_ID"]))
    return {k: sorted(v) for k, v in sorted(by_node.items())}


@pytest.mark.parametrize(
    "nodes,expected",
    [
        ([(2, ["--node_rank=0"]), (2, ["--node_rank=1"])], {"0": [0, 1], "1": [2, 3]}),
        ([(2, ["--node_rank=1"]), (2, ["--node_rank=0"])], {"0": [0, 1], "1": [2, 3]}),
        ([(2, []), (2, [])], {"0": [0, 1], "1": [2, 3]}),
        ([(3, ["--node_rank=0"]), (1, ["--node_rank=1"])], {"0": [0, 1, 2], "1": [3]}),
        ([(1, ["--node_rank=1"]), (3, ["--node_rank=0"])], {"0": [0, 1, 2], "1": [3]}),
        ([(3, []), (1, [])], {"0": [0, 1, 2], "1": [3]}),
    ],
    ids=["2+2-node_rank", "2+2-node_rank-reversed", "2+2-auto", "3+1-node_rank", "1+3-master-is-node1", "3+1-auto"],
)
def test_two_invocations_form_one_job(msrun, env_dump, nodes, expected):
    port = free_port()
    first = _node(msrun, port, nodes[0][0], 4, nodes[0][1])
    _wait_listening(msrun)
    second = _node(msrun, port, nodes[1][0], 4, nodes[1][1])
    a, b = msrun.finish(first), msrun.finish(second)
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    dumps = msrun.dumps()
    assert sorted(int(d["RANK_ID"]) for d in dumps) == [0, 1, 2, 3]
    assert _ranks_by_node(dumps) == expected
    for d in dumps:
        assert d["RANK_ID"] == d["MS_NODE_ID"] == d["RANK"]
        assert d["RANK_SIZE"] == d["WORLD_SIZE"] == "4" and d["GROUP_WORLD_SIZE"] == "2"
        assert int(d["LOCAL_RANK"]) < int(d["LOCAL_WORLD_SIZE"])
        assert d["MSRUN_JOB_ID"] == dumps[0]["MSRUN_JOB_ID"]
    launchers = {d["GROUP_RANK"]: d["MSRUN_LAUNCHER_ID"] for d in dumps}
    assert len(set(launchers.values())) == 2 and len({(d["GROUP_RANK"], d["MSRUN_LAUNCHER_ID"]) for d in dumps}) == 2
    logs = sorted(p.name for p in (msrun.cwd / "logs").glob("worker_*.log"))
    assert logs == ["worker_0.log", "worker_1.log", "worker_2.log", "worker_3.log"]
    assert "Start scheduler process" in a.stdout and "Start scheduler process" not in b.stdout


@pytest.mark.parametrize("node_rank", [False, True], ids=["ranks-assigned", "node_rank-given"])
def test_nodes_that_all_lost_the_port_still_form_the_job(msrun, env_dump, node_rank):
    """Every node of a job on this host found the scheduler's port taken (something held it a
    moment; or two nodes entering listen together, which Linux can refuse both): while no
    scheduler answers there, a node hosts it once the port is free - else all wait for none."""
    port = free_port()
    holder = socket.socket()  # bound, not listening: the port is taken and no scheduler answers
    holder.bind(("127.0.0.1", port))
    consoles = [msrun.cwd / f"console-{i}.txt" for i in range(2)]
    procs = []
    for i, console in enumerate(consoles):
        args = _node_args(port, 2, 4, [f"--node_rank={i}"] if node_rank else [], time_out=60)
        with open(console, "w") as out:  # GLOG_v=1: msrun's INFO lines, "taken ... joining as a worker node"
            env = msrun.env({"GLOG_v": "1"})
            procs.append(subprocess.Popen(msrun.argv(args), cwd=msrun.cwd, env=env, stdout=out, stderr=out))
    msrun.popens += procs
    try:
        wait_for(lambda: all("is taken on this host" in c.read_text() for c in consoles), timeout=60)
    finally:
        holder.close()
    codes = [p.wait(timeout=60) for p in procs]
    texts = [c.read_text() for c in consoles]
    assert codes == [0, 0], texts
    assert sorted(int(d["RANK_ID"]) for d in msrun.dumps()) == [0, 1, 2, 3]
    assert sum("Start scheduler process" in t for t in texts) == 1, texts


def test_missing_node_times_out_with_a_clear_error(msrun, env_dump):
    t0 = time.monotonic()
    job = msrun.run(
        [
            "--worker_num=4",
            "--local_worker_num=2",
            f"--master_port={free_port()}",
            "--join=True",
            "--log_dir=logs",
            "--cluster_time_out=2",
            "env_dump.py",
        ]
    )
    assert 1.5 < time.monotonic() - t0 < 15
    assert job.returncode == 1, job.stderr
    assert "cluster time out after 2 s (--cluster_time_out): 2 of 4 ranks registered" in job.stderr
    assert "missing 2" in job.stderr
    assert "Start worker" not in job.stdout and not list(msrun.dump.iterdir())


def test_extra_node_is_refused_and_the_job_goes_on(msrun, faulty_sleep):
    port = free_port()
    release = msrun.cwd / "release"  # the job runs until the extra node was refused
    a = _node(msrun, port, 2, 4, env={"RELEASE_FILE": str(release)}, script="faulty.py")
    _wait_listening(msrun)
    b = _node(msrun, port, 2, 4, env={"RELEASE_FILE": str(release)}, script="faulty.py")
    wait_for(lambda: "4/4 ranks" in (msrun.cwd / "logs" / "scheduler.log").read_text())
    extra = msrun.run(
        [
            "--worker_num=4",
            "--local_worker_num=2",
            f"--master_port={port}",
            "--join=True",
            "--log_dir=extra",
            "faulty.py",
        ],
        log_dir="extra",
    )
    release.touch()
    assert extra.returncode == 1
    assert "the scheduler refused this node: extra node" in extra.stderr
    assert "Start worker" not in extra.stdout
    assert msrun.finish(a).returncode == 0
    assert msrun.finish(b).returncode == 0


def test_oversubscribing_node_is_refused(msrun, env_dump):
    port = free_port()
    a = _node(msrun, port, 2, 4)
    _wait_listening(msrun)
    big = msrun.run(
        [
            "--worker_num=4",
            "--local_worker_num=3",
            f"--master_port={port}",
            "--join=True",
            "--log_dir=big",
            "env_dump.py",
        ],
        log_dir="big",
    )
    assert big.returncode == 1
    assert "would exceed --worker_num=4" in big.stderr
    b = _node(msrun, port, 2, 4)
    assert msrun.finish(a).returncode == 0 and msrun.finish(b).returncode == 0


def test_bad_token_is_refused_and_the_job_goes_on(msrun, env_dump):
    port = free_port()
    a = _node(msrun, port, 2, 4, env={"MSRUN_JOB_TOKEN": STRONG})
    _wait_listening(msrun)
    bad = msrun.run(
        [
            "--worker_num=4",
            "--local_worker_num=2",
            f"--master_port={port}",
            "--join=True",
            "--log_dir=bad",
            "env_dump.py",
        ],
        env={"MSRUN_JOB_TOKEN": "a-different-strong-token-0123"},
        log_dir="bad",
    )
    assert bad.returncode == 1
    assert "refused this node: bad job token" in bad.stderr
    b = _node(msrun, port, 2, 4, env={"MSRUN_JOB_TOKEN": STRONG})
    assert msrun.finish(a).returncode == 0 and msrun.finish(b).returncode == 0
    assert sorted(int(d["RANK_ID"]) for d in msrun.dumps()) == [0, 1, 2, 3]


def test_duplicate_node_rank_is_refused(msrun, env_dump):
    port = free_port()
    a = _node(msrun, port, 2, 4, ["--node_rank=0"])
    _wait_listening(msrun)
    dup = msrun.run(
        [
            "--worker_num=4",
            "--local_worker_num=2",
            f"--master_port={port}",
            "--join=True",
            "--node_rank=0",
            "--log_dir=dup",
            "env_dump.py",
        ],
        log_dir="dup",
    )
    assert dup.returncode == 1 and "--node_rank=0 is already taken" in dup.stderr
    b = _node(msrun, port, 2, 4, ["--node_rank=1"])
    assert msrun.finish(a).returncode == 0 and msrun.finish(b).returncode == 0


@pytest.mark.parametrize("failing_node", ["master", "other"])
def test_failure_on_one_node_tears_down_every_node(msrun, faulty_sleep, failing_node):
    port = free_port()
    fail_rank = "1" if failing_node == "master" else "3"
    env = {"FAIL_RANK": fail_rank, "FAIL_MODE": "exit3", "FAIL_AFTER": "0.5"}
    a = _node(msrun, port, 2, 4, ["--node_rank=0"], env=env, script="faulty.py")
    _wait_listening(msrun)
    b = _node(msrun, port, 2, 4, ["--node_rank=1"], env=env, script="faulty.py")
    t0 = time.monotonic()
    ja, jb = msrun.finish(a, timeout=30), msrun.finish(b, timeout=30)
    assert time.monotonic() - t0 < 10, "every node must tear down at once, not after a heartbeat timeout"
    assert ja.returncode == 3, ja.stderr
    assert jb.returncode == 3, jb.stderr
    origin, other = (ja, jb) if failing_node == "master" else (jb, ja)
    assert f"rank {fail_rank} (worker_{fail_rank}.log" in origin.stderr
    assert "job aborted by the scheduler" in other.stderr and f"rank {fail_rank} exited with code 3" in other.stderr


@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_a_killed_node_s_watchdog_sweeps_only_its_own_ranks(msrun, env_dump, cgroup):
    """Two nodes of one job on one kernel (every rank carries the same ``MSRUN_JOB_ID``): node 1's
    launcher SIGKILLed, its watchdog kills node 1's ranks and none of node 0's - which are still
    there when it is done (node 0's launcher is stopped meanwhile, so it cannot tear them down
    itself); let go, node 0 ends the job naming the lost node."""
    port = free_port()
    env = {"RELEASE_FILE": str(msrun.cwd / "never"), "MSRUN_CGROUP": cgroup}
    a = _node(msrun, port, 2, 4, ["--node_rank=0"], env=env)
    _wait_listening(msrun)
    b = _node(msrun, port, 2, 4, ["--node_rank=1"], env=env)
    assert wait_for(lambda: len(msrun.dumps()) == 4, 60), msrun.dumps()
    ranks = {
        int(json.loads(f.read_text())["RANK_ID"]): psutil.Process(int(f.stem.rsplit("_", 1)[1]))
        for f in msrun.dump.glob("*.json")
    }
    watchdog = next(p for p in psutil.Process(b.pid).children() if p.cmdline()[:2] == ["/bin/sh", "-c"])
    psutil.Process(a.pid).suspend()
    try:
        b.kill()
        watchdog.wait(timeout=30)
        assert not any(ranks[r].is_running() for r in (2, 3))
        assert all(ranks[r].is_running() and ranks[r].status() != psutil.STATUS_ZOMBIE for r in (0, 1))
    finally:
        psutil.Process(a.pid).resume()
    job = msrun.finish(a, timeout=60)
    msrun.finish(b)
    assert job.returncode != 0, job.stderr
    assert "lost node" in job.stderr and "killed by SIGKILL" not in job.stderr, job.stderr


def _registered(msrun, count=1):
    log = msrun.cwd / "logs" / "scheduler.log"
    wait_for(lambda: log.exists() and log.read_text().count("agent registered") >= count)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_node_waiting_for_its_ranks_stops_on_a_signal(msrun, env_dump, signum):
    node = _node(msrun, free_port(), 2, 4)
    _registered(msrun)  # waiting for the other node's registration, which never comes
    node.send_signal(signum)
    job = msrun.finish(node, timeout=30)
    assert job.returncode == 128 + signum, job.stderr
    name = signal.Signals(signum).name
    assert f"msrun: error: interrupted by {name} while waiting for the other nodes" in job.stderr
    assert "Start worker" not in job.stdout and not list(msrun.dump.iterdir())


def test_the_scheduler_ending_before_the_assignment_is_a_launch_error(msrun, env_dump):
    node = _node(msrun, free_port(), 2, 4)
    _registered(msrun)
    scheduler = next(p for p in psutil.Process(node.pid).children() if p.name() == "msrun-scheduler")
    scheduler.kill()
    job = msrun.finish(node, timeout=30)
    assert job.returncode == 1, job.stderr
    assert "the scheduler process was killed by SIGKILL (exit status 137) before this node was assigned" in job.stderr
    assert "Start worker" not in job.stdout and not list(msrun.dump.iterdir())


def _scripted_scheduler(server: socket.socket, token: str, together: bool, said: list[str]) -> None:
    """A control plane that welcomes one node, assigns it ranks 2..3 of 4 and answers nothing else
    (no heartbeat echo) until the node is done."""
    server.settimeout(30)
    conn, _ = server.accept()
    with conn:
        channel = wire.Channel(conn)
        hello = channel.recv(30)
        nonce = wire.new_nonce()
        channel.send({"t": "challenge", "nonce": nonce})
        channel.recv(30)  # the node's proof
        proof = wire.proof(token, "server", hello["nonce"], nonce)
        welcome = wire.encode({"t": "welcome", "proof": proof, "pid": 0, "host": "elsewhere", "now": time.time()})
        assign = wire.encode({"t": "assign", "offset": 2, "node_index": 1, "node_count": 2, "job_id": "scripted"})
        if together:  # read by the node's handshake with its welcome
            conn.sendall(welcome + assign)
        else:  # arrives while the node moves from registering to waiting for it
            conn.sendall(welcome)
            conn.sendall(assign)
        while True:
            msg = channel.recv(60)
            said.append(str(msg.get("t")))
            if msg.get("t") == "done":
                channel.send({"t": "done_ack"})
                channel.send({"t": "end", "code": 0})
                return


@pytest.mark.parametrize("together", [True, False], ids=["with-the-welcome", "after-the-welcome"])
def test_an_assignment_sent_with_the_welcome_starts_the_node(msrun, env_dump, together):
    # The last node to register gets its welcome and its ranks back to back: however they arrive
    # (one read, or the second while the node moves on to waiting), the node starts its workers -
    # even from a control plane that sends nothing more (no heartbeat echo would wake it).
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        said: list[str] = []
        thread = threading.Thread(
            target=_scripted_scheduler, args=(server, wire.strengthen(STRONG), together, said), daemon=True
        )
        thread.start()
        node = _node(msrun, port, 2, 4, env={"MSRUN_JOB_TOKEN": STRONG})
        job = msrun.finish(node, timeout=60)
        thread.join(timeout=10)
    assert job.returncode == 0, job.stderr
    assert [int(d["RANK_ID"]) for d in msrun.dumps()] == [2, 3], job.stdout + job.stderr
    assert "done" in said


def test_node_status_files(msrun, env_dump):
    port = free_port()
    a = _node(msrun, port, 2, 4)
    _wait_listening(msrun)
    b = _node(msrun, port, 2, 4)
    assert msrun.finish(a).returncode == 0 and msrun.finish(b).returncode == 0
    st0 = read_status(msrun.cwd / "logs", "msrun_status_node0.json")
    st1 = read_status(msrun.cwd / "logs", "msrun_status_node1.json")
    assert st0["state"] == st1["state"] == "succeeded"
    assert [p["rank"] for p in st1["processes"]] == [2, 3]


@pytest.fixture
def faulty_sleep(msrun):
    return msrun.script("faulty.py", FAULTY)
