"""The control plane cannot be forged or flooded: outsiders neither join nor abort a job.

Part of the reliability tier: each scenario records what it measured.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401 - a forked attacker (user nobody) may not read this stdlib to import it
import hashlib
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, free_port, job_args, record, wait_for, wait_running
from test_scheduler_protocol import AGENT, start_scheduler

from pytest_msrun.control import wire

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")

# Rounds of barriers until ROUNDS are done or, with STOP_FILE, until the test creates that file.
# Whether to stop is decided once, by rank 0, and broadcast: ranks that looked at the file each on
# their own could disagree (one breaks out while another waits in the next barrier alone).
SLOW = """
import os, time
print("started", flush=True)
from pytest_msrun import cluster
cluster.init()
stop = os.environ.get("STOP_FILE", "")
rounds = int(os.environ.get("ROUNDS", "100000" if stop else "20"))
for i in range(rounds):
    cluster.barrier()  # every round needs every rank: an abort or a lost rank would show here
    seen = bool(stop) and cluster.get_rank() == 0 and os.path.exists(stop)
    if cluster.broadcast_object(seen, src=0):
        break
    time.sleep(0.05)  # pacing: the job keeps running (and talking to the scheduler) meanwhile
print("finished", flush=True)
"""


@pytest.fixture(autouse=True)
def private_config(tmp_path, monkeypatch):
    """Each test's own msrun secret (XDG_CONFIG_HOME), never the user's real one."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _more_fds() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))


def two_nodes(msrun, port: int, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    args = [
        "--worker_num=2",
        "--local_worker_num=1",
        f"--master_port={port}",
        "--join=True",
        "--log_dir=logs",
        "slow.py",
    ]
    first = msrun.start(args, env=env)
    wait_for(lambda: (msrun.cwd / "logs" / "scheduler.log").exists())
    return [first, msrun.start([*args[:-2], "--log_dir=logs2", "slow.py"], env=env)]


def test_the_formerly_public_token_opens_no_job(msrun, tmp_path):
    """0.1.0 derived a multi-node token from sha256("msrun:<ip>:<port>:<worker_num>"): anyone
    could compute it, join, and abort the job with an exit code of their choice."""
    msrun.script("slow.py", SLOW)
    port = free_port()
    stop = msrun.cwd / "stop"  # the job runs until the forgery has been refused
    env = {"STOP_FILE": str(stop), "XDG_CONFIG_HOME": os.environ["XDG_CONFIG_HOME"]}
    nodes = two_nodes(msrun, port, env=env)
    wait_running(msrun.cwd / "logs", 1, "msrun_status_node0.json")
    old = hashlib.sha256(f"msrun:127.0.0.1:{port}:2".encode()).hexdigest()[:32]
    forged = wire.Channel.connect("127.0.0.1", port, timeout=5)
    with pytest.raises(wire.AuthError, match="bad job token"):  # the control plane's refusal
        forged.handshake({**AGENT, "pid": 1}, old, 5)
    stop.touch()
    jobs = [msrun.finish(n, timeout=60) for n in nodes]
    assert [j.returncode for j in jobs] == [0, 0], [j.stderr for j in jobs]
    secret = tmp_path / "config" / "msrun" / "secret"
    assert secret.stat().st_mode & 0o777 == 0o600 and secret.parent.stat().st_mode & 0o777 == 0o700
    record("forged (formerly public) token", "refused, job exit 0", "")


def _as_nobody(attack) -> str:
    """Run ``attack()`` (returning a str) in a forked child that became user nobody."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write_fd, attack().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as fh:
        out = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out


@needs_root
def test_another_user_can_neither_read_the_token_nor_join_nor_abort(msrun):
    msrun.script("slow.py", SLOW)
    port = free_port()
    stop = msrun.cwd / "stop"  # the job runs until the attack is over
    nodes = two_nodes(msrun, port, env={"STOP_FILE": str(stop), "XDG_CONFIG_HOME": os.environ["XDG_CONFIG_HOME"]})
    status = wait_running(msrun.cwd / "logs", 1, "msrun_status_node0.json")
    rank = next(p["pid"] for p in status["processes"] if p["role"] == "worker")
    secret = os.environ["XDG_CONFIG_HOME"] + "/msrun/secret"

    def attack() -> str:
        out = []
        for what, path in (("environ", f"/proc/{rank}/environ"), ("secret", secret)):
            try:
                Path(path).read_bytes()
                out.append(f"{what}: READ")
            except OSError:
                out.append(f"{what}: denied")
        ch = wire.Channel.connect("127.0.0.1", port, 5)
        try:
            ch.handshake({**AGENT, "pid": 1}, "guess", 5)
            out.append("join: ACCEPTED")
        except wire.AuthError:
            out.append("join: refused")
        s = socket.create_connection(("127.0.0.1", port), 5)  # MindSpore's magic, as if a worker
        s.sendall(b"RPC0" + b"\0" * 60)
        try:
            out.append("magic: dropped" if not s.recv(10) else "magic: answered")
        except ConnectionResetError:
            out.append("magic: dropped")
        return " | ".join(out)

    assert _as_nobody(attack) == "environ: denied | secret: denied | join: refused | magic: dropped"
    stop.touch()
    jobs = [msrun.finish(n, timeout=90) for n in nodes]
    assert [j.returncode for j in jobs] == [0, 0], [j.stderr for j in jobs]
    assert "MindSpore-protocol client of another user" in (msrun.cwd / "logs" / "scheduler.log").read_text()
    record("another user: read token / join / abort", "denied, job exit 0", "")


def test_no_secret_available_is_said_loudly(msrun, tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    msrun.script("slow.py", SLOW)
    port = free_port()
    nodes = two_nodes(msrun, port, env={"ROUNDS": "2", "XDG_CONFIG_HOME": str(tmp_path / "not-a-dir")})
    jobs = [msrun.finish(n, timeout=60) for n in nodes]
    assert [j.returncode for j in jobs] == [0, 0]
    for job in jobs:
        assert "[WARNING]" in job.stderr and "this job runs WITHOUT authentication" in job.stderr
        assert "Set MSRUN_JOB_TOKEN" in job.stderr


def test_a_flood_of_half_hellos_leaves_the_job_and_the_scheduler_alone(msrun):
    """2000 connections, each holding a partial pre-auth frame, during a running job."""
    _more_fds()
    msrun.script("slow.py", SLOW)
    port = free_port()
    stop = msrun.cwd / "stop"
    popen = msrun.start(job_args(2, "slow.py", port=port), env={"STOP_FILE": str(stop)})
    status = wait_running(msrun.cwd / "logs", 2)
    sched = psutil.Process(next(p["pid"] for p in status["processes"] if p["role"] == "scheduler"))
    before = sched.memory_info().rss
    socks = []
    for _ in range(2000):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(struct.pack(">I", wire.HELLO_LIMIT) + b"x" * (wire.HELLO_LIMIT - 100))
        socks.append(s)
    peak = sched.memory_info().rss
    stop.touch()
    job = msrun.finish(popen, timeout=120)
    for s in socks:
        s.close()
    assert job.returncode == 0, job.stderr
    assert "finished" in job.log("worker_0.log") and "finished" in job.log("worker_1.log")
    grew = (peak - before) / 2**20
    assert grew < 16, f"the scheduler grew by {grew:.1f} MiB under the flood"
    record("2000 half-hello connections during a job", "job exit 0", f"scheduler RSS +{grew:.1f} MiB")


def test_out_of_file_descriptors_does_not_spin(tmp_path):
    """The scheduler may hold 128 files; 1000 idle connections later it still serves a node."""
    _more_fds()
    port, proc, log = start_scheduler(tmp_path)
    proc.kill()
    proc.wait()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MS_WORKER_NUM": "1",
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": str(port),
        "MS_TOPO_TIMEOUT": "60",
        "MSRUN_JOB_TOKEN": "tok",
    }
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest_msrun.control.scheduler"],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            preexec_fn=limit,
        )
    try:
        wait_for(lambda: "listening" in log.read_text())
        socks = []
        for _ in range(1000):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                break
        p = psutil.Process(proc.pid)
        cpu0 = sum(p.cpu_times()[:2])
        time.sleep(2.0)
        busy = sum(p.cpu_times()[:2]) - cpu0
        assert busy < 0.3, f"the scheduler used {busy:.2f} s of CPU in 2 s while out of file descriptors"
        agent = wire.Channel.connect("127.0.0.1", port, timeout=5)
        agent.handshake({**AGENT, "pid": 1}, "tok", 5)
        assert agent.recv(5)["t"] == "assign"
        for s in socks:
            s.close()
        record(
            f"{len(socks)} idle connections, 128 file descriptors",
            "a node still registers",
            f"scheduler CPU {busy / 2 * 100:.0f}%",
        )
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("key_len", [0, 1, 32, 64, 65, 300])
def test_the_proof_is_standard_hmac_sha256(key_len):
    """The handshake's HMAC is computed without OpenSSL; it must equal the standard one."""
    import hmac

    from pytest_msrun.control.wire import hmac_sha256

    key, msg = os.urandom(key_len), os.urandom(3 * key_len + 7)
    assert hmac_sha256(key, msg) == hmac.digest(key, msg, "sha256")


def test_racing_nodes_all_read_one_whole_secret(tmp_path):
    """Nodes starting at once on a shared home create the secret together: each reads the
    winner's whole secret (never an empty or half-written file), and no temporary is left."""
    code = (
        "import sys, time; from pytest_msrun.engine.jobtoken import user_secret\n"
        "t = float(sys.argv[1])\n"
        "while time.time() < t: pass\n"
        "secret, problem = user_secret({'XDG_CONFIG_HOME': sys.argv[2]})\n"
        "print(secret or 'PROBLEM: ' + problem)\n"
    )
    for attempt in range(5):
        home = tmp_path / f"home{attempt}"
        start = time.time() + 0.5
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(start), str(home)], stdout=subprocess.PIPE, text=True)
            for _ in range(6)
        ]
        seen = {p.communicate(timeout=30)[0].strip() for p in procs}
        assert len(seen) == 1 and len(seen.pop()) == 64, seen
        assert [p.name for p in (home / "msrun").iterdir()] == ["secret"]


GATED_INIT = """
import os, time
from pytest_msrun import cluster
print("started", flush=True)
while not os.path.exists(os.environ["GO_FILE"]):
    time.sleep(0.02)  # pacing: wait for the test's go, while a flood is on
cluster.init()
cluster.barrier()
assert cluster.all_gather_object(cluster.get_rank()) == list(range(cluster.get_group_size()))
print("finished", flush=True)
"""


def test_a_flood_of_complete_hellos_during_init_costs_the_job_nothing(msrun):
    """Token-less but complete hellos from the ranks' own address, as fast as they can be made,
    while 4 ranks init(): each stranger is kept its grace, so a rank that answers gets in; the
    flood waits its turn in the kernel's queue (it once took the ranks 43 s, and at times 120)."""
    import threading

    _more_fds()
    msrun.script("gated.py", GATED_INIT)
    port = free_port()
    go = msrun.cwd / "go"
    popen = msrun.start(job_args(4, "gated.py", port=port), env={"GO_FILE": str(go)})
    wait_running(msrun.cwd / "logs", 4)
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        hello = wire.encode({"t": "hello", "kind": "rank", "rank": 0, "world": 4, "nonce": "ab" * 16})
        held = []
        while not stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                s.sendall(hello)
                held.append(s)
                sent[0] += 1
            except OSError:
                pass
            if len(held) > 600:
                held.pop(0).close()
        for s in held:
            s.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    wait_for(lambda: sent[0] >= 300, timeout=30)  # the flood is on before the ranks start to init
    go.touch()
    started = time.monotonic()
    job = msrun.finish(popen, timeout=120)
    took = time.monotonic() - started
    stop.set()
    flooder.join(timeout=30)
    assert job.returncode == 0, job.stdout + job.stderr
    for rank in range(4):
        assert "finished" in job.log(f"worker_{rank}.log")
    # what the control plane did about it is on the console and in the status file, not only its log
    assert "Control plane: dropped " in job.stderr and "connection(s) from 127.0.0.1" in job.stderr
    status = json.loads((job.log_dir / "msrun_status.json").read_text())
    assert status["notices"] and all(n.startswith("dropped ") for n in status["notices"])
    assert len(status["notices"]) <= 2, status["notices"]  # summed up, not a line per connection
    record(
        "a flood of complete hellos during init() of 4 ranks",
        "job exit 0",
        f"{sent[0]} hellos, {took:.1f} s to the end",
    )


def test_a_client_with_a_wrong_token_is_said_on_every_nodes_console(msrun):
    msrun.script("slow.py", SLOW)
    port = free_port()
    stop = msrun.cwd / "stop"
    env = {"STOP_FILE": str(stop), "MSRUN_JOB_TOKEN": "the-right-token-0123456789"}
    nodes = two_nodes(msrun, port, env)
    statuses = [msrun.cwd / "logs" / "msrun_status_node0.json", msrun.cwd / "logs2" / "msrun_status_node1.json"]
    wait_for(lambda: all(p.exists() for p in statuses), timeout=60)
    channel = wire.Channel.connect("127.0.0.1", port, timeout=10)
    with pytest.raises(wire.AuthError, match="bad job token"):
        channel.handshake({**AGENT, "node_rank": 5}, "a-wrong-token", 10)
    channel.close()
    stop.touch()
    jobs = [msrun.finish(p) for p in nodes]
    for job, path in zip(jobs, statuses):
        assert job.returncode == 0, job.stderr
        said = "dropped 1 connection(s) from 127.0.0.1 in "
        assert f"Control plane: {said}" in job.stderr and "1 refused: bad token" in job.stderr
        assert any(n.startswith(said) for n in json.loads(path.read_text())["notices"])


@pytest.mark.parametrize("problem", ["world-readable", "unreadable", "missing"])
def test_a_token_file_others_can_read_or_that_cannot_be_read_stops_msrun(msrun, tmp_path, problem):
    """As ssh with a key file: exit 2 naming the file and the fix, nothing started."""
    secret = tmp_path / "token"
    if problem != "missing":
        secret.write_text("s" * 40 + "\n")
        secret.chmod(0o644 if problem == "world-readable" else 0o000)
    if problem == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads any file")
    msrun.script("t.py", "print('ran')\n")
    job = msrun.run(job_args(2, "t.py"), env={"MSRUN_JOB_TOKEN_FILE": str(secret)})
    assert job.returncode == 2, job.stdout + job.stderr
    assert f"MSRUN_JOB_TOKEN_FILE={secret}" in job.stderr
    assert ("chmod 600" in job.stderr) if problem != "missing" else ("cannot be read" in job.stderr)
    assert "Start worker" not in job.stdout and not (msrun.cwd / "logs").exists()


def test_the_users_secret_readable_by_others_stops_a_multi_node_job(msrun, tmp_path):
    config = tmp_path / "config"
    (config / "msrun").mkdir(parents=True)
    secret = config / "msrun" / "secret"
    secret.write_text("s" * 64 + "\n")
    secret.chmod(0o640)
    msrun.script("t.py", "print('ran')\n")
    args = [
        "--worker_num=2",
        "--local_worker_num=1",
        "--node_rank=0",
        f"--master_port={free_port()}",
        "--log_dir=logs",
        "t.py",
    ]
    job = msrun.run(args, env={"XDG_CONFIG_HOME": str(config)})
    assert job.returncode == 2 and f"the msrun secret {secret}" in job.stderr and "chmod 600" in job.stderr
