"""The control plane survives hostile or broken clients: each is dropped, the job goes on."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time

import pytest
from conftest import REPO, free_port, wait_for

from pytest_msrun.control import wire


def start_scheduler(tmp_path, **extra: str):
    """A standalone builtin scheduler for a 2-rank job; returns (port, process, log path)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MS_WORKER_NUM": "2",
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": str(port),
        "MS_TOPO_TIMEOUT": "30",
        "MSRUN_JOB_TOKEN": "tok",
        **extra,
    }
    log = tmp_path / "scheduler.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest_msrun.control.scheduler"], env=env, stdout=fh, stderr=subprocess.STDOUT
        )
    wait_for(lambda: "listening" in log.read_text())
    return port, proc, log


@pytest.fixture
def scheduler(tmp_path):
    port, proc, log = start_scheduler(tmp_path, MSRUN_AUTH_TIMEOUT="0.5", MSRUN_MAX_MESSAGE_BYTES="100000")
    yield port, proc, log
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed(sock: socket.socket, timeout: float = 3) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


AGENT = {
    "t": "hello",
    "kind": "agent",
    "node_rank": -1,
    "local": 1,
    "host": "h",
    "ip": "127.0.0.1",
    "hosts_scheduler": False,
}


def _agent(port: int, token: str = "tok", local: int = 1, node_rank: int = -1, pid: int | None = None) -> wire.Channel:
    ch = wire.Channel.connect("127.0.0.1", port, timeout=5)
    hello = {**AGENT, "pid": os.getpid() if pid is None else pid, "local": local, "node_rank": node_rank}
    ch.handshake(hello, token, 5)
    return ch


def _gone_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _rank(port: int, rank: int, token: str = "tok") -> wire.Channel:
    ch = wire.Channel.connect("127.0.0.1", port, timeout=5)
    ch.handshake({"t": "hello", "kind": "rank", "rank": rank, "world": 2}, token, 5)
    return ch


def test_hostile_clients_are_dropped_and_the_job_goes_on(scheduler):
    port, proc, log = scheduler
    http = _raw(port)
    http.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    notjson = _raw(port)
    notjson.sendall(struct.pack(">I", 5) + b"\xff\xfe{{{")
    oversized = _raw(port)
    oversized.sendall(struct.pack(">I", 10**9))
    silent = _raw(port)
    half_header = _raw(port)
    half_header.sendall(b"\x00\x00")  # half of a length prefix, then nothing
    half_body = _raw(port)
    half_body.sendall(struct.pack(">I", 100) + b'{"t": "hel')  # half a hello, then nothing
    wrongtype = _raw(port)
    wrongtype.sendall(wire.encode({"t": "done"}))
    badtoken = wire.Channel.connect("127.0.0.1", port, timeout=5)
    with pytest.raises(wire.AuthError, match="bad job token"):
        badtoken.handshake({**AGENT, "pid": 1}, "nope", 5)
    # the old protocol: the token itself in the hello, no answer to the challenge
    replayed = wire.Channel.connect("127.0.0.1", port, timeout=5)
    replayed.send({**AGENT, "pid": 1, "token": "tok", "nonce": "ab"})
    challenge = replayed.recv(5)
    assert challenge["t"] == "challenge" and set(challenge) == {"t", "nonce"}, "nothing computed from the token"
    replayed.send({"t": "auth", "proof": "0" * 64})
    malformed = wire.Channel.connect("127.0.0.1", port, timeout=5)
    malformed.handshake({"t": "hello", "kind": "agent", "local": "many"}, "tok", 5)
    for sock in (http, notjson, oversized, wrongtype, malformed.sock):
        assert _closed(sock), sock
    assert replayed.recv(5)["t"] == "refused" and _closed(badtoken.sock)  # badtoken's refusal: its AuthError
    for stalled in (silent, half_header, half_body):
        assert _closed(stalled, timeout=5), "a silent or stalled client is dropped after the auth timeout"
    assert proc.poll() is None, "the scheduler must survive all of that"

    a, b = _agent(port), _agent(port)
    assert a.recv(5)["t"] == "assign" and b.recv(5)["t"] == "assign"
    for ch in (a, b):
        ch.send({"t": "done"})
    assert proc.wait(timeout=10) == 0
    text = log.read_text()
    # strangers are summed up (by address and reason), not logged one by one
    for why in (
        "a malformed frame",
        "no hello within",
        "its first message is not a hello",
        "refused: bad token",
        "malformed agent registration",
    ):
        assert why in text, why
    assert "Traceback" not in text and text.count("dropped ") <= 3, text


def test_oversized_message_from_a_rank_drops_only_that_rank(scheduler):
    port, proc, log = scheduler
    a, b = _agent(port), _agent(port)
    a.recv(5), b.recv(5)
    r0, r1 = _rank(port, 0), _rank(port, 1)
    assert r0.recv(5)["t"] == "ready" and r1.recv(5)["t"] == "ready"
    r0.send({"t": "coll", "op": "barrier", "seq": 1, "src": 0})
    r1.send({"t": "coll", "op": "gather", "seq": 1, "src": 0, "data": "A" * 200000})
    reply = r0.recv(5)
    assert reply["t"] == "error" and "rank 1 left" in reply["reason"]
    assert proc.poll() is None


@pytest.mark.parametrize(
    "bad",
    [
        {"t": "call", "test": 5, "state": "out"},
        {"t": "call", "test": "t.py::x", "state": "gone"},
        {"t": "call", "test": "t.py::x", "state": "out", "outcome": ["passed"]},
        {"t": "coll", "op": "barrier", "seq": 1, "src": 0, "test": "t.py::x", "when": "lunch"},
        {"t": "coll", "op": "barrier", "seq": 1, "src": 0, "test": {"a": 1}, "when": "call"},
    ],
)
def test_a_malformed_call_notice_or_tag_drops_that_rank_and_a_valid_one_fails_a_collective(scheduler, bad):
    port, proc, log = scheduler
    a, b = _agent(port), _agent(port)
    a.recv(5), b.recv(5)
    r0, r1 = _rank(port, 0), _rank(port, 1)
    assert r0.recv(5)["t"] == "ready" and r1.recv(5)["t"] == "ready"
    r0.send({"t": "coll", "op": "gather", "seq": 1, "src": 0, "data": "", "test": "t.py::test_x", "when": "call"})
    r1.send({"t": "call", "test": "t.py::test_x", "state": "out", "outcome": "passed"})
    reply = r0.recv(5)
    assert reply["t"] == "error" and reply["reason"] == (
        "all_gather #1 cannot complete: rank 1 has left test_x's call (passed)"
    )
    r1.send(bad)
    assert _closed(r1.sock)
    assert proc.poll() is None


@pytest.mark.parametrize("alive", [False, True], ids=["gone", "alive-here"])
def test_agent_heartbeat_timeout_aborts_unless_the_node_is_alive_here(tmp_path, alive):
    """A silent node is lost after MS_NODE_TIMEOUT - unless it is a live process of this host
    (starting its workers on a loaded machine): then it is slow, not gone."""
    port, proc, log = start_scheduler(tmp_path, MS_NODE_TIMEOUT="0.5")
    try:
        a, b = _agent(port), _agent(port, pid=None if alive else _gone_pid())
        assert a.recv(5)["t"] == "assign" and b.recv(5)["t"] == "assign"
        t0 = time.monotonic()
        deadline = t0 + 3
        got = None
        while time.monotonic() < deadline:  # a keeps beating, b falls silent
            try:
                a.send({"t": "hb"})
            except OSError:  # the scheduler aborted and closed a's connection: its abort is still to be read
                pass
            try:
                msg = a.recv(0.1)
            except socket.timeout:
                continue
            if msg["t"] == "abort":
                got = msg
                break
        if alive:
            assert got is None and proc.poll() is None
            for ch in (a, b):
                ch.send({"t": "done"})
            assert proc.wait(timeout=5) == 0
            return
        assert got is not None and "no heartbeat for 0.5 s (MS_NODE_TIMEOUT)" in got["reason"]
        assert proc.wait(timeout=5) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_garbage_during_a_real_job(msrun):
    msrun.script(
        "job.py",
        """
        import os, time
        from pytest_msrun import cluster
        cluster.init()
        deadline = time.monotonic() + 120  # the barrier comes after the garbage reached the scheduler
        while not os.path.exists(os.environ["SENT"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        cluster.barrier()
        print("barrier ok", flush=True)
    """,
    )
    port = free_port()
    popen = msrun.start(
        [
            "--worker_num=2",
            "--local_worker_num=2",
            f"--master_port={port}",
            "--join=True",
            "--log_dir=logs",
            "--scheduler=builtin",
            "job.py",
        ],
        env={"SENT": str(msrun.cwd / "garbage-sent")},
    )
    wait_for(lambda: (msrun.cwd / "logs" / "scheduler.log").exists())
    socks = []
    for payload in (b"\x00" * 64, struct.pack(">I", 2**31), b"garbage\n"):
        s = _raw(port)
        s.sendall(payload)
        socks.append(s)
    (msrun.cwd / "garbage-sent").touch()
    job = msrun.finish(popen)
    assert job.returncode == 0, job.stderr
    assert "barrier ok" in job.log("worker_0.log") and "barrier ok" in job.log("worker_1.log")
    for s in socks:
        s.close()


@pytest.mark.parametrize("op", ["barrier", "gather"])
def test_a_rank_flooding_collectives_is_dropped_at_its_second_entry_and_the_job_goes_on(scheduler, op):
    """A rank is in one collective at a time: a flood of entries - which once cost the control plane
    quadratic CPU (20,000 barriers: 26 s) and held every gather's data - ends that rank's connection at
    its second entry, naming why; whoever waits for it hears the same, the control plane goes on."""
    port, proc, log = scheduler
    r0, r1 = _rank(port, 0), _rank(port, 1)
    assert r0.recv(5)["t"] == "ready" and r1.recv(5)["t"] == "ready"
    data = {"data": "QUJD" * 20000} if op == "gather" else {}  # 80 kB a gather (the limit: 100 kB)
    count = 20000 if op == "barrier" else 40
    flood = b"".join(wire.encode({"t": "coll", "op": op, "seq": seq, "src": 0, **data}) for seq in range(1, count + 1))
    try:
        r1.sock.sendall(flood)
    except OSError:  # closed before it all arrived
        pass
    name = "barrier" if op == "barrier" else "all_gather"
    reason = f"rank 1 entered {name} #2 while still in {name} #1: a rank is in one collective at a time"
    refused = r1.recv(10)
    assert refused["t"] == "refused" and refused["reason"].startswith(reason)
    r0.send({"t": "coll", "op": op, "seq": 1, "src": 0, **data})
    failed = r0.recv(10)
    assert failed["t"] == "error" and failed["reason"].startswith(
        f"{name} #1 cannot complete: rank 1 left the job (its connection was dropped: {reason}"
    )
    assert proc.poll() is None
    assert reason in log.read_text()


def test_a_gather_whose_result_exceeds_the_message_limit_fails_every_rank_in_it(scheduler):
    """Each part fits the limit (100 kB here), the two together do not: every rank gets the reason
    (not a frame its connection would end at), and the group goes on."""
    port, proc, log = scheduler
    r0, r1 = _rank(port, 0), _rank(port, 1)
    assert r0.recv(5)["t"] == "ready" and r1.recv(5)["t"] == "ready"
    for ch in (r0, r1):
        ch.send({"t": "coll", "op": "gather", "seq": 1, "src": 0, "data": "QUJD" * 15000})
    size = len(wire.encode({"t": "coll", "seq": 1, "data": ["QUJD" * 15000] * 2})) - wire.HEADER.size
    for ch in (r0, r1):
        reply = ch.recv(5)
        assert reply["t"] == "error" and reply["reason"] == (
            f"all_gather #1 cannot complete: its result, every rank's object together, is a message of {size} bytes, "
            "over the limit of 100000 bytes (MSRUN_MAX_MESSAGE_BYTES); gather less, or raise MSRUN_MAX_MESSAGE_BYTES "
            "in msrun's environment"
        )
    for ch in (r0, r1):
        ch.send({"t": "coll", "op": "gather", "seq": 2, "src": 0, "data": "QUJD"})
    assert r0.recv(5) == r1.recv(5) == {"t": "coll", "seq": 2, "data": ["QUJD", "QUJD"]}


def test_a_rank_taken_twice_is_refused_naming_the_process_that_holds_it(scheduler):
    port, proc, log = scheduler
    first = wire.Channel.connect("127.0.0.1", port, timeout=5)
    first.handshake({"t": "hello", "kind": "rank", "rank": 1, "world": 2, "pid": 4242, "host": "node-a"}, "tok", 5)
    second = wire.Channel.connect("127.0.0.1", port, timeout=5)
    second.handshake({"t": "hello", "kind": "rank", "rank": 1, "world": 2, "pid": 5151, "host": "node-b"}, "tok", 5)
    reply = second.recv(5)
    assert reply["t"] == "refused"
    reason = reply["reason"]
    assert reason.startswith("rank 1 already joined: pid 4242 on host 'node-a' (from 127.0.0.1:"), reason
    assert ", joined at " in reason and "holds it; this is pid 5151 on host 'node-b' (from 127.0.0.1:" in reason
    assert "Probably two jobs share one MSRUN_JOB_TOKEN and --master_port, two processes have RANK_ID=1" in reason
    assert proc.poll() is None
