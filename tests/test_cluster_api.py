"""The in-rank API over the builtin control plane: init, ranks, collectives, prompt failure."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest
from conftest import free_port, job_args, wait_for

from pytest_msrun import cluster
from pytest_msrun.control import wire

COLLECTIVES = """
import json, os, sys
from pytest_msrun import cluster
cluster.init()
rank, size = cluster.get_rank(), cluster.get_group_size()
assert rank == int(os.environ["RANK_ID"]) and size == 4
cluster.barrier()
gathered = cluster.all_gather_object({"rank": rank, "sq": rank * rank})
root = cluster.broadcast_object({"from": rank, "payload": list(range(5))} if rank == 2 else None, src=2)
big = cluster.all_gather_object(b"x" * 200000)
for i in range(20):
    cluster.barrier()
out = {"rank": rank, "local": cluster.get_local_rank(), "local_size": cluster.get_local_rank_size(),
       "gathered": gathered, "root": root, "big": [len(b) for b in big], "dryrun": cluster.is_dryrun()}
with open(os.path.join(os.environ["DUMP_DIR"], f"out_{rank}.json"), "w") as fh:
    json.dump(out, fh)
cluster.finalize()
"""


def test_collectives_across_four_ranks(msrun):
    msrun.script("coll.py", COLLECTIVES)
    job = msrun.run(job_args(4, "--scheduler=builtin", "coll.py"))
    assert job.returncode == 0, job.stderr + job.stdout
    outs = [json.loads((msrun.dump / f"out_{r}.json").read_text()) for r in range(4)]
    for r, out in enumerate(outs):
        assert out["rank"] == r and out["local"] == r and out["local_size"] == 4 and out["dryrun"] is False
        assert out["gathered"] == [{"rank": i, "sq": i * i} for i in range(4)]
        assert out["root"] == {"from": 2, "payload": [0, 1, 2, 3, 4]}
        assert out["big"] == [200000] * 4


def test_collectives_across_two_nodes(msrun):
    msrun.script("coll.py", COLLECTIVES)
    port = free_port()
    args = [
        "--worker_num=4",
        "--local_worker_num=2",
        f"--master_port={port}",
        "--join=True",
        "--log_dir=logs",
        "--scheduler=builtin",
        "coll.py",
    ]
    a = msrun.start(args)
    wait_for(lambda: (msrun.cwd / "logs" / "scheduler.log").exists())
    b = msrun.start(args)
    ja, jb = msrun.finish(a), msrun.finish(b)
    assert ja.returncode == 0 and jb.returncode == 0, ja.stderr + jb.stderr
    outs = [json.loads((msrun.dump / f"out_{r}.json").read_text()) for r in range(4)]
    assert [o["local"] for o in outs] == [0, 1, 0, 1]
    assert all(o["gathered"][3] == {"rank": 3, "sq": 9} for o in outs)


# Rank 1 leaves while the others are blocked in a barrier: it asks the control plane (as an
# observer, with the job's own token) until ranks 0 and 2 wait in that barrier - an event, not a
# guess at how long they take to get there. The ranks record, on the machine-wide monotonic clock,
# when they entered the barrier and when it raised; rank 1 when it left.
PEER_DIES = """
import os, signal, sys, time
from pytest_msrun import cluster
from pytest_msrun.control.observer import query_from_env


def peers_wait_in_a_barrier(others, seconds=60.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = query_from_env(dict(os.environ)) or {}
        if any(c["op"] == "barrier" and c["ranks"] == others for c in state.get("collectives", [])):
            return True
        time.sleep(0.02)
    return False


if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
cluster.init()
rank = cluster.get_rank()
dump = os.environ["DUMP_DIR"]
if rank == 1:
    waited = peers_wait_in_a_barrier([0, 2])
    with open(os.path.join(dump, "left_1.txt"), "w") as fh:
        fh.write(f"{time.monotonic():.6f} {waited}")
    os._exit(7)
t0 = time.monotonic()
try:
    cluster.barrier()
except cluster.ClusterError as exc:
    print(f"rank {rank} barrier raised after {time.monotonic() - t0:.2f}s: {type(exc).__name__}: {exc}", flush=True)
    out = os.path.join(dump, f"raised_{rank}.txt")
    with open(out + ".tmp", "w") as fh:
        fh.write(f"{t0:.6f} {time.monotonic():.6f} {exc}")
    os.rename(out + ".tmp", out)  # whole or absent: the first to exit 5 ends the job, the other with it
    sys.exit(5)
print("barrier passed?!", flush=True)
"""


def _raised(dump) -> dict[str, tuple[float, float, str]]:
    out = {}
    for path in dump.glob("raised_*.txt"):
        entered, raised, text = path.read_text().split(" ", 2)
        out[path.name] = (float(entered), float(raised), text)
    return out


def test_blocked_barrier_raises_promptly_when_a_peer_dies(msrun):
    msrun.script("peer.py", PEER_DIES)
    # The survivors ignore SIGTERM, so msrun's teardown does not end them before they can
    # observe what their blocked barrier does when rank 1 dies.
    job = msrun.run(
        job_args(3, "--scheduler=builtin", "peer.py"),
        env={"IGNORE_TERM": "1", "MSRUN_TERM_TIMEOUT": "5"},
    )
    ended = time.monotonic()
    assert job.returncode == 7, job.stderr
    left, waited = (msrun.dump / "left_1.txt").read_text().split()
    assert waited == "True", "ranks 0 and 2 were seen waiting in the barrier before rank 1 left"
    raised = _raised(msrun.dump)
    assert sorted(raised) == ["raised_0.txt", "raised_2.txt"], job.stderr
    for entered, at, text in raised.values():
        assert entered < float(left), "blocked in the barrier when rank 1 left"
        assert at - float(left) < 2.0 and "rank 1" in text, text
    assert ended - float(left) < 10, "the job ended within seconds of rank 1 leaving"


def test_barrier_error_without_teardown(msrun):
    """A rank that leaves cleanly but early (exit 0 without finalize) makes peers' barrier fail, not hang."""
    msrun.script("early.py", PEER_DIES.replace("os._exit(7)", "os._exit(0)"))
    job = msrun.run(job_args(3, "--scheduler=builtin", "early.py"))
    assert job.returncode == 5, job.stderr
    raised = _raised(msrun.dump)
    assert raised and set(raised) <= {"raised_0.txt", "raised_2.txt"}
    assert all("rank 1 left the job" in text for _, _, text in raised.values()), raised


# Rank 1 exits before init(); rank 2 calls init() only once the control plane knows rank 1's process
# ended, and rank 0 (already waiting in init()) stays until rank 2 has its answer: each side of
# "told at once" is ordered by the event it is about, never by sleeping.
EXITS_BEFORE_JOINING = """
import os, sys, time
from pytest_msrun import cluster
rank = int(os.environ["RANK_ID"])
dump = os.environ["DUMP_DIR"]


def wait_for(predicate, seconds=60.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def rank_1_exited():
    from pytest_msrun.control.observer import query_from_env
    return "1" in (query_from_env(dict(os.environ)) or {}).get("exited", {})


if rank == 1:
    print("rank 1 returns without joining", flush=True)
    with open(os.path.join(dump, "exit_1.txt"), "w") as fh:
        fh.write(f"{time.monotonic():.6f}")
    sys.exit(0)
if rank == 2:
    assert wait_for(rank_1_exited), "the control plane never heard that rank 1 exited"
t0 = time.monotonic()
try:
    cluster.init(timeout=60)
except cluster.ClusterError as exc:
    with open(os.path.join(dump, f"init_{rank}.tmp"), "w") as fh:
        fh.write(f"{t0:.6f} {time.monotonic():.6f} {exc}")
    os.rename(os.path.join(dump, f"init_{rank}.tmp"), os.path.join(dump, f"init_{rank}.txt"))
    if rank == 0:  # the job ends when rank 0 exits: not before rank 2 arrived late and was told
        wait_for(lambda: os.path.exists(os.path.join(dump, "init_2.txt")))
    sys.exit(4)
sys.exit(9)
"""


def test_init_fails_at_once_when_a_rank_exited_without_joining(msrun):
    """Rank 1 exits 0 before init(): peers waiting in init() (or arriving later) are told at once."""
    msrun.script("early_exit.py", EXITS_BEFORE_JOINING)
    job = msrun.run(job_args(3, "--scheduler=builtin", "--cluster_time_out=60", "early_exit.py"))
    assert job.returncode == 4, job.stdout + job.stderr
    exited = float((msrun.dump / "exit_1.txt").read_text())
    for rank in (0, 2):
        started, told, text = (msrun.dump / f"init_{rank}.txt").read_text().split(" ", 2)
        # told within seconds of calling init() or of rank 1's exit, whichever came later - not
        # after the 60 s the init() and --cluster_time_out would otherwise wait
        assert float(told) - max(float(started), exited) < 5.0, text
        assert "rank 1 exited without joining the group: its process exited with code 0" in text


# msrun whose node registers with its control plane only once it has seen rank 1 exit: workers
# start before the control plane, so on a loaded machine a rank can end before the node joined.
LATE_REGISTRATION = """
import sys
from pytest_msrun.engine import agent

register = agent.Agent._register
def late(self, plan):
    if not any(c.tag.rank == 1 and c.returncode is not None for c in self.node.group.children):
        return None  # tried again next turn, after the loop served the events
    return register(self, plan)

agent.Agent._register = late
from pytest_msrun.entry import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_that_exits_before_its_node_registered_is_still_reported(msrun):
    """The exit note of a rank that ended before its node joined the control plane is sent when
    the node joins - dropped, peers in init() would wait for that rank until the timeout."""
    msrun.script("early_exit.py", EXITS_BEFORE_JOINING)
    driver = msrun.script("driver.py", LATE_REGISTRATION)
    args = job_args(3, "--scheduler=builtin", "--cluster_time_out=60", "early_exit.py")
    cmd = [sys.executable, str(driver), *args]
    proc = subprocess.run(cmd, cwd=msrun.cwd, env=msrun.env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    for rank in (0, 2):
        text = (msrun.dump / f"init_{rank}.txt").read_text().split(" ", 2)[2]
        assert "rank 1 exited without joining the group: its process exited with code 0" in text


def test_collective_mismatch_is_an_error(msrun):
    msrun.script(
        "mismatch.py",
        """
        import sys
        from pytest_msrun import cluster
        cluster.init()
        try:
            if cluster.get_rank() == 0:
                cluster.barrier()
            else:
                cluster.all_gather_object(1)
        except cluster.ClusterError as exc:
            print("ERR", exc, flush=True)
            sys.exit(4)
    """,
    )
    job = msrun.run(job_args(2, "--scheduler=builtin", "mismatch.py"))
    assert job.returncode == 4
    assert "mismatch" in job.log("worker_0.log") + job.log("worker_1.log")


def test_dry_run_and_standalone_groups(msrun, monkeypatch):
    msrun.script(
        "dry.py",
        """
        import json, os
        from pytest_msrun import cluster
        cluster.init()
        assert cluster.is_dryrun()
        cluster.barrier()
        errors = []
        for call in (lambda: cluster.all_gather_object(1), lambda: cluster.broadcast_object(1, src=0)):
            try:
                call()
            except cluster.ClusterError as exc:
                errors.append(str(exc))
        out = [cluster.get_rank(), cluster.get_group_size(), errors]
        with open(os.path.join(os.environ["DUMP_DIR"], f"dry_{cluster.get_rank()}.json"), "w") as fh:
            json.dump(out, fh)
    """,
    )
    job = msrun.run(
        ["--worker_num=2", "--local_worker_num=2", "--sim_level=0", "--join=True", "--log_dir=logs", "dry.py"]
    )
    assert job.returncode == 0, job.stderr
    rank, size, errors = json.loads((msrun.dump / "dry_1.json").read_text())
    assert (rank, size) == (1, 2) and len(errors) == 2
    assert errors[0].startswith("all_gather_object is not available in a dry run")
    assert errors[1].startswith("broadcast_object is not available in a dry run")

    for name in ("MS_ROLE", "RANK_ID", "RANK_SIZE", "MS_SIMULATION_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    cluster.finalize()
    cluster.init()
    try:
        assert cluster.get_rank() == 0 and cluster.get_group_size() == 1
        assert cluster.all_gather_object("x") == ["x"] and cluster.broadcast_object(5) == 5
    finally:
        cluster.finalize()


def test_collective_before_init_raises(monkeypatch):
    cluster.finalize()
    with pytest.raises(cluster.ClusterError, match="has not been inited"):
        cluster.barrier()


def test_non_builtin_scheduler_is_named(monkeypatch):
    cluster.finalize()
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("MSRUN_SCHEDULER", "task")
    monkeypatch.setenv("RANK_ID", "0")
    with pytest.raises(cluster.ClusterError, match="--scheduler=task"):
        cluster.init()


# ---------------------------------------------------------------- sizes, bad data, protocol errors (issue 45)
# This process is one rank of a 2-rank job of a standalone control plane (cluster.init()); the
# other rank is a raw connection the test drives, so it can send what no cluster.py would.
@pytest.fixture
def control_plane(tmp_path, monkeypatch):
    from test_scheduler_protocol import start_scheduler

    procs = []

    def start(**env: str) -> int:
        port, proc, _ = start_scheduler(tmp_path, **env)
        procs.append(proc)
        monkeypatch.delenv("MS_SIMULATION_LEVEL", raising=False)
        settings = {"MS_ROLE": "MS_WORKER", "MSRUN_SCHEDULER": "builtin", "RANK_SIZE": "2", "RANK_ID": "0"}
        settings.update(MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port), MSRUN_JOB_TOKEN="tok", **env)
        for name, value in settings.items():
            monkeypatch.setenv(name, value)
        return port

    cluster.finalize()
    yield start
    cluster.finalize()
    for proc in procs:
        proc.kill()
        proc.wait()


def _raw_rank(port: int, rank: int, **hello: object):
    from pytest_msrun.control import wire

    peer = wire.Channel.connect("127.0.0.1", port, timeout=5)
    peer.handshake({"t": "hello", "kind": "rank", "rank": rank, "world": 2, **hello}, "tok", 5)
    return peer


def _joined_beside_a_raw_rank(port: int):
    """Rank 1 (raw) joins, then this process as rank 0; returns rank 1's connection."""
    peer = _raw_rank(port, 1)
    cluster.init(timeout=10)
    assert peer.recv(5)["t"] == "ready"
    return peer


def test_an_object_over_the_message_limit_is_refused_before_anything_is_sent(control_plane, monkeypatch):
    """A 60 MiB object once ended the rank's connection ("Connection reset by peer")."""
    monkeypatch.delenv("MSRUN_MAX_MESSAGE_BYTES", raising=False)
    peer = _joined_beside_a_raw_rank(control_plane())
    big = bytes(60 << 20)
    for name in ("all_gather_object", "broadcast_object"):
        with pytest.raises(cluster.ClusterError) as raised:
            getattr(cluster, name)(big)
        text = str(raised.value)
        assert text.startswith(f"{name} on rank 0: this rank's object pickles to {len(pickle.dumps(big))} bytes, a ")
        assert "over the limit of 67108864 bytes (MSRUN_MAX_MESSAGE_BYTES); send less, or raise" in text
    peer.send({"t": "coll", "op": "barrier", "seq": 1, "src": 0})  # nothing was sent, no number taken:
    cluster.barrier(timeout=10)  # the next collective is #1 on both ranks
    assert peer.recv(5) == {"t": "coll", "seq": 1}


def test_a_gather_whose_result_is_over_the_limit_raises_naming_it(control_plane):
    peer = _joined_beside_a_raw_rank(control_plane(MSRUN_MAX_MESSAGE_BYTES="100000"))
    peer.send({"t": "coll", "op": "gather", "seq": 1, "src": 0, "data": "QUJD" * 15000})
    with pytest.raises(cluster.ClusterError, match=r"over the limit of 100000 bytes \(MSRUN_MAX_MESSAGE_BYTES\)"):
        cluster.all_gather_object(bytes(40000), timeout=10)
    assert peer.recv(5)["t"] == "error"


@pytest.mark.parametrize(
    ("op", "data", "why"),
    [
        ("gather", "!!not base64!!", "rank 1 sent data that is not an object's (data field is not base64"),
        ("gather", None, "rank 1 sent data that is not an object's (data field is not a string)"),
        ("bcast", "!!not base64!!", "rank 1 sent data that is not an object's (data field is not base64"),
        ("gather", "AAAA", "rank 1's object cannot be unpickled here: "),
        ("bcast", "AAAA", "rank 1's object cannot be unpickled here: "),
    ],
)
def test_a_peers_bad_data_raises_cluster_error_naming_the_peer(control_plane, op, data, why):
    peer = _joined_beside_a_raw_rank(control_plane())
    msg = {"t": "coll", "op": op, "seq": 1, "src": 1 if op == "bcast" else 0}
    peer.send(msg if data is None else {**msg, "data": data})
    with pytest.raises(cluster.ClusterError) as raised:
        if op == "gather":
            cluster.all_gather_object(0, timeout=10)
        else:
            cluster.broadcast_object(src=1, timeout=10)
    assert why in str(raised.value), raised.value


def test_a_collective_retried_after_its_timeout_completes_with_the_peer_that_came_late(control_plane):
    """A retry loop: the call whose ``timeout=`` ran out still counts the rank in it, so calling it
    again waits for it again (nothing is sent twice) - and completes when the late peer enters."""
    peer = _joined_beside_a_raw_rank(control_plane())
    with pytest.raises(cluster.ClusterError, match="gather timed out after 0.2 s on rank 0"):
        cluster.all_gather_object("first", timeout=0.2)  # rank 1 is not there yet
    with pytest.raises(cluster.ClusterError, match="gather timed out after 0.2 s on rank 0"):
        cluster.all_gather_object("again", timeout=0.2)
    peer.send({"t": "coll", "op": "gather", "seq": 1, "src": 0, "data": wire.pack_data(pickle.dumps("late"))})
    assert cluster.all_gather_object("third", timeout=10) == ["first", "late"]  # the first call's object
    assert peer.recv(5)["seq"] == 1
    peer.send({"t": "coll", "op": "barrier", "seq": 2, "src": 0})
    cluster.barrier(timeout=10)  # in step: the next collective is #2 on both


def test_another_collective_waits_for_the_one_whose_timeout_ran_out_then_begins_in_step(control_plane):
    """A rank is in one collective at a time: entering another while still in one whose timeout
    ran out first waits for that one to complete (or fail), then begins - nothing refused, no
    connection dropped; with neither in time, it times out saying what it waited for."""
    peer = _joined_beside_a_raw_rank(control_plane())
    with pytest.raises(cluster.ClusterError, match="barrier timed out after 0.2 s on rank 0"):
        cluster.barrier(timeout=0.2)  # rank 1 is not there: rank 0 is still in barrier #1
    waited = "gather timed out after 0.2 s on rank 0: it waited for barrier #1, whose timeout ran out on this rank"
    with pytest.raises(cluster.ClusterError, match=f"^{waited}"):
        cluster.all_gather_object(0, timeout=0.2)
    peer.send({"t": "coll", "op": "barrier", "seq": 1, "src": 0})
    assert peer.recv(5) == {"t": "coll", "seq": 1}  # barrier #1 completed: rank 0's part was there
    peer.send({"t": "coll", "op": "gather", "seq": 2, "src": 0, "data": wire.pack_data(pickle.dumps(1))})
    assert cluster.all_gather_object(0, timeout=10) == [0, 1]


def test_a_collective_given_up_in_one_test_does_not_fail_the_next_tests(control_plane, monkeypatch):
    """Rank 0's test moved on from a barrier whose timeout ran out; the control plane fails it once
    rank 1 left that test's call too. The next test's barrier waits for that failure, then pairs
    with rank 1's - it is not failed by the earlier test's collective."""
    peer = _joined_beside_a_raw_rank(control_plane())
    from pytest_msrun.control import cluster as control

    group = control._require()
    first, second = "t.py::test_one", "t.py::test_two"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{first} (call)")
    group.note_call(first, True, "")
    peer.send({"t": "call", "test": first, "state": "in", "outcome": ""})
    with pytest.raises(cluster.ClusterError, match="barrier timed out after 0.2 s on rank 0"):
        cluster.barrier(timeout=0.2)
    group.note_call(first, False, "passed")
    peer.send({"t": "call", "test": first, "state": "out", "outcome": "passed"})  # barrier #1 cannot complete
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{second} (call)")
    group.note_call(second, True, "")
    peer.send({"t": "call", "test": second, "state": "in", "outcome": ""})
    peer.send({"t": "coll", "op": "barrier", "seq": 1, "src": 0, "test": second, "when": "call"})
    cluster.barrier(timeout=10)  # rewound with its peer: barrier #1 again, in test_two
    assert peer.recv(5) == {"t": "coll", "seq": 1}


def test_a_rank_taken_twice_says_which_process_holds_it(control_plane, monkeypatch):
    port = control_plane()
    holder = _raw_rank(port, 1, pid=4242, host="node-a")
    monkeypatch.setenv("RANK_ID", "1")
    with pytest.raises(cluster.ClusterError) as raised:
        cluster.init(timeout=10)
    text = str(raised.value)
    assert text.startswith("init() failed on rank 1: rank 1 already joined: pid 4242 on host 'node-a' (from 127.0.0.1:")
    assert f"this is pid {os.getpid()} on host {os.uname().nodename!r} (from 127.0.0.1:" in text
    assert "two processes have RANK_ID=1, or rank 1 was restarted while its first process still runs" in text
    holder.close()
