"""The labs themselves (tests/lab): namespaced hosts that really are separate, and a real Slurm cluster."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import MARK, marked_processes, wait_for, wait_gone
from netlab import NetLab, pids_in_netns

LAB = Path(__file__).resolve().parent / "lab"

# A one-shot TCP server: prints "listening", accepts one connection, sends back the peer's address.
SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.listen()
    print("listening", flush=True)
    conn, peer = s.accept()
    conn.sendall(f"{socket.gethostname()} {peer[0]}".encode())
    conn.close()
    """
)

# Connects to argv[1]:argv[2]; prints what came back, or the error's name.
CLIENT = textwrap.dedent(
    """
    import socket, sys
    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
            print("ok", c.recv(100).decode())
    except OSError as exc:
        print("error", type(exc).__name__, exc.errno)
    """
)


def _serve(lab: NetLab, k: int, port: int) -> subprocess.Popen[str]:
    server = subprocess.Popen(
        [*lab.prefix(k), sys.executable, "-c", SERVER, lab.address(k), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    return server


def _connect(lab: NetLab, k: int, address: str, port: int, timeout: float = 5.0) -> str:
    proc = lab.run(k, [sys.executable, "-c", CLIENT, address, str(port), str(timeout)], timeout=timeout + 10)
    return proc.stdout.strip()


def _outside_address(lab: NetLab) -> str:
    """An IPv4 address of this machine outside the lab (else a documentation address)."""
    net = ipaddress.IPv4Network(lab.network)
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            inside = a.family == socket.AF_INET and ipaddress.IPv4Address(a.address) in net
            if a.family == socket.AF_INET and not a.address.startswith("127.") and not inside:
                return a.address
    return "192.0.2.1"


# ---------- netlab ----------
@pytest.mark.netns
def test_each_node_has_its_own_hostname_and_address(netlab2):
    probe = "import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))"
    seen = set()
    for k in (1, 2):
        out = netlab2.run(k, [sys.executable, "-c", probe]).stdout.split()
        assert out == [f"node{k}", netlab2.address(k)]
        eth0 = netlab2.run(k, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert f" {netlab2.address(k)}/24 " in eth0
        routes = netlab2.run(k, ["ip", "-4", "route", "show", "table", "all"]).stdout
        assert "default" not in routes
        hosts = netlab2.run(k, ["getent", "hosts", "node1", "node2", "labhost"]).stdout.split()
        assert hosts == [netlab2.address(1), "node1", netlab2.address(2), "node2", netlab2.host_address, "labhost"]
        seen.add(netlab2.address(k))
    assert len(seen) == 2
    net = ipaddress.IPv4Network(netlab2.network)
    assert net.prefixlen == 24 and all(ipaddress.IPv4Address(a) in net for a in seen)
    # The host keeps its own name; the bridge is the only place it holds a lab address.
    assert socket.gethostname() not in ("node1", "node2")
    # Commands keep the caller's working directory inside a node.
    assert netlab2.run(1, ["pwd"], cwd="/usr").stdout.strip() == "/usr"


@pytest.mark.netns
def test_node1_reaches_node2_over_tcp(netlab2):
    port = 7001
    server = _serve(netlab2, 2, port)
    try:
        assert _connect(netlab2, 1, netlab2.address(2), port) == f"ok node2 {netlab2.address(1)}"
    finally:
        server.kill()
        server.wait()


@pytest.mark.netns
def test_a_node_cannot_reach_outside(netlab2):
    # No default route: anything off the lab subnet fails at once (no packet leaves the node).
    for target in (_outside_address(netlab2), "192.0.2.1"):
        out = _connect(netlab2, 1, target, 80, timeout=2)
        assert out.startswith("error") and out.endswith(" 101"), (target, out)  # ENETUNREACH
    # Loopback inside a node is the node's own: the host's listeners are not there.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = _connect(netlab2, 1, "127.0.0.1", s.getsockname()[1], timeout=2)
    assert out.startswith("error ConnectionRefusedError"), out


@pytest.mark.netns
def test_link_down_partitions_a_node(netlab2):
    port = 7002
    server = _serve(netlab2, 2, port)
    try:
        netlab2.set_link(2, up=False)
        t0 = time.monotonic()
        out = _connect(netlab2, 1, netlab2.address(2), port, timeout=1.5)
        assert out.startswith("error"), out  # timed out (packets dropped) or host unreachable
        assert time.monotonic() - t0 < 10
        netlab2.set_link(2, up=True)
        assert wait_for(lambda: _connect(netlab2, 1, netlab2.address(2), port, timeout=1).startswith("ok"), 15)
    finally:
        netlab2.set_link(2, up=True)
        server.kill()
        server.wait()


@pytest.mark.netns
def test_teardown_leaves_nothing(tmp_path):
    private = tmp_path / "private"
    lab = NetLab(3, private_dirs=[str(private)])
    with lab:
        assert [lab.hostname(k) for k in (1, 2, 3)] == ["node1", "node2", "node3"]
        # Each node sees its own directory at the private path.
        for k in (1, 2, 3):
            lab.run(k, ["sh", "-c", f"hostname > {private}/me"], check=True)
        assert sorted((Path(n.dir) / "private0" / "me").read_text().strip() for n in lab.members) == [
            "node1",
            "node2",
            "node3",
        ]
        assert not (private / "me").exists()
        sleeper = subprocess.Popen([*lab.prefix(2), "sleep", "300"])
        wait_for(lambda: sleeper.pid in lab.processes(2))
        holders = [n.holder for n in lab.members]
        inodes = [n.netns for n in lab.members]
        names = [lab.bridge, *(n.veth for n in lab.members)]
        directory = lab.directory
        assert all(name in os.listdir("/sys/class/net") for name in names)
    assert sleeper.wait(timeout=5) == -9
    assert not any(name in os.listdir("/sys/class/net") for name in names)
    assert not [p for inode in inodes for p in pids_in_netns(inode)]
    for pid in holders:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert directory and not os.path.exists(directory)
    assert not private.exists()
    assert lab.leftovers() == []


# ---------- slurm ----------
@pytest.mark.slurm
def test_srun_runs_one_task_on_each_node(slurm_lab):
    proc = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "hostname"],
        env=slurm_lab.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["node1", "node2"]
    # Nodes carry this machine's CPU count, and go back to idle once the step completed.
    expected = [f"node1 {os.cpu_count()} idle", f"node2 {os.cpu_count()} idle"]

    def states() -> bool:
        argv = ["sinfo", "-h", "-N", "-o", "%N %c %T"]
        out = subprocess.run(argv, env=slurm_lab.env(), capture_output=True, text=True, timeout=30).stdout
        return sorted(filter(None, out.split("\n"))) == expected

    wait_for(states, 30)


@pytest.mark.slurm
def test_scancel_leaves_no_process(slurm_lab):
    mark = uuid.uuid4().hex
    name = f"lab-{mark[:8]}"
    env = {**slurm_lab.env(), MARK: mark}
    srun = subprocess.Popen(
        ["srun", "-N2", "--ntasks-per-node=1", f"--job-name={name}", "sleep", "100"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # One sleep per node, each in its node's network namespace.
        sleeps = wait_for(lambda: len([p for p in marked_processes(mark) if p.name() == "sleep"]) == 2, 30)
        assert sleeps
        job = subprocess.run(
            ["squeue", "-h", "-o", "%i", "-n", name], env=env, capture_output=True, text=True, timeout=30
        ).stdout.strip()
        assert job.isdigit(), job
        t0 = time.monotonic()
        subprocess.run(["scancel", job], env=env, check=True, timeout=30)
        srun.communicate(timeout=30)
        left = wait_gone(mark, timeout=10)
        assert not left, [(p.pid, p.cmdline()) for p in left]
        assert time.monotonic() - t0 < 10
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.communicate()
    slurm_lab.wait_idle(30)


def _lab_processes(directory: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and directory in " ".join(p.info["cmdline"] or ()):
            found.append(p)
    return found


@pytest.mark.slurm
def test_cli_lab_up_runs_jobs_and_down_leaves_nothing(tmp_path):
    directory = str(tmp_path / "cli-lab")
    script = str(LAB / "slurmlab.py")
    t0 = time.monotonic()
    up = subprocess.run(
        [sys.executable, script, "up", "--nodes", "2", "--dir", directory], capture_output=True, text=True, timeout=90
    )
    up_seconds = time.monotonic() - t0
    mark = uuid.uuid4().hex
    running: subprocess.Popen[bytes] | None = None
    try:
        assert up.returncode == 0, up.stderr
        info = json.loads(up.stdout)
        assert [n["name"] for n in info["nodes"]] == ["node1", "node2"]
        daemons = info["daemons"]
        assert set(daemons) == {"munged", "slurmctld", "slurmd-node1", "slurmd-node2"}
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = info["SLURM_CONF"]
        proc = subprocess.run(
            ["srun", "-N2", "--ntasks-per-node=1", "hostname"], env=env, capture_output=True, text=True, timeout=60
        )
        assert sorted(proc.stdout.split()) == ["node1", "node2"], proc.stderr
        assert _lab_processes(directory)
        # A job still running at teardown: down kills its processes on the nodes.
        running = subprocess.Popen(
            ["srun", "-N2", "--ntasks-per-node=1", "sleep", "300"],
            env={**env, MARK: mark},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: len([p for p in marked_processes(mark) if p.name() == "sleep"]) == 2, 30)
    finally:
        t1 = time.monotonic()
        down = subprocess.run(
            [sys.executable, script, "down", "--dir", directory], capture_output=True, text=True, timeout=90
        )
        down_seconds = time.monotonic() - t1
        # The client on the host outlives its controller (it keeps retrying): not the lab's to end.
        left = [p for p in marked_processes(mark) if p.name() == "sleep"]
        if running is not None:
            running.kill()
            running.wait()
    assert down.returncode == 0, down.stderr
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert not _lab_processes(directory)
    for pid in daemons.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(directory)
    assert not [i for i in os.listdir("/sys/class/net") if i.startswith(info["bridge"])]
    print(f"slurm lab via CLI: up {up_seconds:.2f} s, down {down_seconds:.2f} s")
