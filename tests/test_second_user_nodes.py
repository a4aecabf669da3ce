"""No other user gets in (issue 45), across two namespaced nodes (tests/lab/netlab.py).

The victim runs one msrun per node (node1 the master, node2 the other; 2 ranks each); the
attacker works from node2 - one of the job's own nodes, whose address the master trusts - and
connects to the master's scheduler port. Nothing it sends may end the job: both nodes exit 0 and
all four ranks finish.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import free_port, wait_for
from test_second_user import HOLD, MSRUN, attack
from test_second_user_listeners import NOFILE, status_of, tail
from users import ATTACKER, Account, UserLab, stop

pytestmark = [pytest.mark.users, pytest.mark.netns]

# Run by the victim: a venv of its own without MindSpore (no system site-packages; every package
# of this interpreter's site-packages linked in, MindSpore's left out).
NO_MINDSPORE_VENV = """
import os, site, subprocess, sys
venv = sys.argv[1]
subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
target = subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                        check=True, capture_output=True, text=True).stdout.strip()
for source in site.getsitepackages():
    for name in os.listdir(source):
        if name.lower().startswith("mindspore") or os.path.exists(os.path.join(target, name)):
            continue
        os.symlink(os.path.join(source, name), os.path.join(target, name))
"""
CHECK_NO_MINDSPORE = (
    "import importlib.util, pytest_msrun; assert importlib.util.find_spec('mindspore') is None; print('no mindspore')"
)


def _node(lab, netlab, k: int, port: int, mode: str, victim_dir: Path, python: str) -> subprocess.Popen:
    """The victim's msrun on node ``k`` of 2 (2 of 4 ranks), logs in ``logs<k>``."""
    args = [
        "--worker_num=4",
        "--local_worker_num=2",
        f"--master_addr={netlab.address(1)}",
        f"--master_port={port}",
        f"--node_rank={k - 1}",
        "--join=True",
        f"--log_dir=logs{k}",
        "--cluster_time_out=90",
        f"--scheduler={mode}",
        "task.py",
    ]
    return lab.victim.start(
        [python, *MSRUN[1:], *args],
        cwd=victim_dir,
        env={"RELEASE_FILE": str(victim_dir / "release")},
        nofile=NOFILE,
        prefix=netlab.prefix(k),
    )


def _worker_log(victim_dir: Path, rank: int) -> Path:
    return victim_dir / f"logs{1 + rank // 2}" / f"worker_{rank}.log"


def _ready(victim_dir: Path) -> bool:
    for rank in range(4):
        try:
            if "ready" not in _worker_log(victim_dir, rank).read_text(errors="replace"):
                return False
        except OSError:
            return False
    return True


def _two_node_job(lab: UserLab, netlab, victim_dir: Path, mode: str, python: str, attack_from_node2) -> None:
    """Start the victim's job on both nodes, wait until its 4 ranks joined the control plane, run
    ``attack_from_node2(host, port)``, release the ranks; both nodes must exit 0, every rank finish."""
    lab.victim.write(victim_dir / "task.py", HOLD)
    port = free_port()
    nodes = [_node(lab, netlab, 1, port, mode, victim_dir, python)]
    try:
        sched = victim_dir / "logs1" / "scheduler.log"
        wait_for(lambda: sched.exists() and "listening" in sched.read_text(errors="replace"), 60)
        nodes.append(_node(lab, netlab, 2, port, mode, victim_dir, python))
        wait_for(lambda: _ready(victim_dir) or any(n.poll() is not None for n in nodes), 120, 0.1)
        assert _ready(victim_dir), "the job did not start: " + " | ".join(tail(n.communicate()[1], 8) for n in nodes)
        attacked = attack_from_node2(netlab.address(1), port)
        (victim_dir / "release").touch()
        results = [n.communicate(timeout=120) for n in nodes]
    finally:
        (victim_dir / "release").touch()
        for n in nodes:
            stop(n)
    codes = [n.returncode for n in nodes]
    assert codes == [0, 0], f"node exits {codes} after the attack {attacked}:\n" + "\n".join(
        f"node{k}: {tail(err, 12)}" for k, (_, err) in enumerate(results, 1)
    )
    for rank in range(4):
        assert "finished" in _worker_log(victim_dir, rank).read_text(errors="replace"), f"rank {rank} did not finish"
    return attacked


def _no_mindspore_python(victim: Account) -> str:
    venv = victim.home / "venv-no-mindspore"
    if not (venv / "bin" / "python").exists():
        made = victim.python_code(NO_MINDSPORE_VENV, str(venv), timeout=120)
        assert made.returncode == 0, made.output
    python = str(venv / "bin" / "python")
    checked = victim.run([python, "-c", CHECK_NO_MINDSPORE], timeout=60)
    assert checked.returncode == 0 and "no mindspore" in checked.stdout, checked.output
    return python


# ---------------------------------------------------------------- 3. three bytes from another node
@pytest.mark.parametrize("mode", ["builtin", "auto", "auto, no MindSpore"])
def test_rpc_bytes_from_another_user_on_a_job_node_end_no_job(user_lab, netlab2, victim_dir, mode):
    """The attacker, on node2 (a node of the victim's job, which the master trusts by address),
    opens connections to the master's scheduler port that begin with MindSpore's RPC magic:
    ``RPC`` alone, ``RPC`` and garbage, 60 of them, 8 at once. They are not the job's MindSpore
    processes (no rank calls MindSpore's ``init()``): the job goes on - both nodes exit 0, every rank
    finishes - and the master's scheduler log counts what it dropped. With ``auto``, also where the
    task's interpreter cannot import MindSpore (a venv of the victim's without it)."""
    python = _no_mindspore_python(user_lab.victim) if "no MindSpore" in mode else "python"

    def rpc(host: str, port: int) -> dict:
        return attack(
            user_lab, "spam", host, str(port), "--count", "60", "--kinds", "rpc", "--concurrency", "8",
            prefix=netlab2.prefix(2), timeout=120,
        )  # fmt: skip

    attacked = _two_node_job(user_lab, netlab2, victim_dir, mode.split(",")[0], python, rpc)
    assert attacked["connected"] >= 50, attacked
    log = (victim_dir / "logs1" / "scheduler.log").read_text(errors="replace")
    assert re.search(r"drop", log, re.IGNORECASE), tail(log)


# ---------------------------------------------------------------- 8. a flood from another node
def test_a_flood_from_another_user_on_a_job_node_ends_no_job(user_lab, netlab2, victim_dir):
    """The attacker, on node2, floods the master's scheduler port of a running 2-node job: it
    holds 1,500 connections (silent, or junk with no end, each reopened when closed) while 2,000
    more come and go - garbage, hellos that answer the challenge with a wrong proof, hellos with a
    lone surrogate nonce - 64 at once. The job passes: both nodes exit 0, every rank finishes."""
    attacker = user_lab.attacker

    def flood(host: str, port: int) -> dict:
        status = attacker.home / "hold.json"
        holder = attacker.start(
            ["python", str(ATTACKER), "hold", host, str(port), "--connections", "1500", "--status", str(status)],
            cwd=attacker.home,
            nofile=8192,
            prefix=netlab2.prefix(2),
        )
        try:
            wait_for(lambda: status_of(status).get("attempts", 0) >= 1500 or holder.poll() is not None, 60, 0.1)
            spammed = attack(
                user_lab, "spam", host, str(port), "--count", "2000", "--kinds", "garbage,wrong_token,surrogate",
                "--concurrency", "64", prefix=netlab2.prefix(2), timeout=240, nofile=8192,
            )  # fmt: skip
        finally:
            stop(holder)
        return {**spammed, "held": status_of(status)}

    attacked = _two_node_job(user_lab, netlab2, victim_dir, "builtin", "python", flood)
    assert attacked["connected"] >= 1800 and attacked["held"].get("connected", 0) >= 1000, attacked
