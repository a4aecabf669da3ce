"""Real jobs dump every child's environment: msrun's variables per role, logs and console lines."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import sys

import psutil
import pytest
from conftest import job_args, read_status, wait_for

START_WORKER = re.compile(
    r"^Start worker process with rank id:(\d+), log file:(\S+)\. Environment variable \[RANK_ID=(\d+)\] is exported\. "
    r"Execute command: (.+)$"
)
START_SCHED = re.compile(r"^Start scheduler process, log file:(\S+)\. Execute command: (.+)$")


def _by_role(dumps, role):
    return [d for d in dumps if d.get("MS_ROLE") == role]


def test_task_mode_scheduler_and_worker_env(msrun, env_dump):
    job = msrun.run(
        [
            "--worker_num=3",
            "--local_worker_num=3",
            "--master_port=0",
            "--scheduler=task",
            "--join=True",
            "--log_dir=logs",
            "--cluster_time_out=77",
            "env_dump.py",
            "a b",
            "--flag",
        ],
        env={"RANK_ID": "7", "DEVICE_ID": "9", "MSRUN_CPU_LIST": "[1]"},
    )
    assert job.returncode == 0, job.stderr
    dumps = msrun.dumps()
    (sched,) = _by_role(dumps, "MS_SCHED")
    port = sched["MS_SCHED_PORT"]
    assert int(port) > 0
    assert {k: sched.get(k) for k in ("MS_SCHED_HOST", "MS_WORKER_NUM", "MS_TOPO_TIMEOUT", "RANK_SIZE", "RANK_ID")} == {
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_WORKER_NUM": "3",
        "MS_TOPO_TIMEOUT": "77",
        "RANK_SIZE": "3",
        "RANK_ID": "0",
    }
    assert "DEVICE_ID" not in sched and "MS_NODE_ID" not in sched and "MSRUN_CPU_LIST" not in sched
    workers = _by_role(dumps, "MS_WORKER")
    assert [w["RANK_ID"] for w in workers] == ["0", "1", "2"]
    for i, w in enumerate(workers):
        assert w["MS_NODE_ID"] == str(i) and w["DEVICE_ID"] == str(i) and w["RANK_SIZE"] == "3"
        assert w["MS_SCHED_HOST"] == "127.0.0.1" and w["MS_SCHED_PORT"] == port and w["MS_TOPO_TIMEOUT"] == "77"
        assert w["MS_WORKER_NUM"] == "3" and w["PYTHONUNBUFFERED"] == "1"
        assert (w["RANK"], w["LOCAL_RANK"], w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"], w["GROUP_RANK"]) == (
            str(i),
            str(i),
            "3",
            "3",
            "0",
        )
        assert w["MASTER_ADDR"] == "127.0.0.1" and w["MASTER_PORT"] != port
        assert "MSRUN_CPU_LIST" not in w
        assert json.loads(w["_argv"]) == ["env_dump.py", "a b", "--flag"]
        assert w["_executable"] == sys.executable
    lines = job.stdout.splitlines()
    m = START_SCHED.match(lines[0])
    assert m and m.group(1) == "logs/scheduler.log"
    for i, line in enumerate(lines[1:4]):
        m = START_WORKER.match(line)
        assert m, line
        assert m.group(1) == m.group(3) == str(i) and m.group(2) == f"logs/worker_{i}.log"
        assert m.group(4) == f"{sys.executable} env_dump.py 'a b' --flag"
    assert "Distributed job is spawned. Waiting all processes to exit..." in job.stderr
    for name in ("scheduler.log", "worker_0.log", "worker_1.log", "worker_2.log"):
        assert (job.log_dir / name).exists()


def test_builtin_scheduler_is_a_fork_of_msrun_with_the_scheduler_environment(msrun, env_dump):
    """The builtin control plane runs in a fork of msrun (no second interpreter): a process of its
    own, named ``msrun-scheduler``, whose environment is the scheduler's. /proc/<pid>/environ shows
    the block the process was exec'd with - msrun's - so the environment is read from the plan,
    and the fork's own ``os.environ`` is checked in test_fork_call_gives_a_fresh_process."""
    release = msrun.cwd / "release"  # the job runs until its scheduler was looked at
    popen = msrun.start(job_args(2, "env_dump.py"), env={"RELEASE_FILE": str(release)})
    status = wait_for(lambda: (st := read_status(msrun.cwd / "logs")) and st["state"] == "running" and st)
    sched = next(p for p in status["processes"] if p["role"] == "scheduler")
    proc = psutil.Process(sched["pid"])
    # the fork names itself once it is set up (its descriptors, its environment): an instant later
    assert wait_for(lambda: proc.name() == "msrun-scheduler", timeout=10), proc.name()
    assert proc.ppid() == popen.pid
    assert os.getsid(proc.pid) == proc.pid  # a session (and process group) of its own, as every child
    release.touch()
    job = msrun.finish(popen)
    assert job.returncode == 0, job.stderr
    plan = msrun.run(["--print_plan", *job_args(2, "env_dump.py")])
    (planned,) = [p for p in json.loads(plan.stdout)["processes"] if p["role"] == "scheduler"]
    env = planned["exported"]
    assert env["MS_ROLE"] == "MS_SCHED" and env["RANK_ID"] == "0" and env["MS_WORKER_NUM"] == "2"
    assert "DEVICE_ID" not in env


def test_log_dir_created_private(msrun, env_dump):
    job = msrun.run(
        [
            "--worker_num=1",
            "--local_worker_num=1",
            "--master_port=0",
            "--join=True",
            "--log_dir=deep/er/logs",
            "env_dump.py",
        ]
    )
    assert job.returncode == 0, job.stderr
    for rel in ("deep", "deep/er", "deep/er/logs"):
        assert stat.S_IMODE(os.stat(msrun.cwd / rel).st_mode) == 0o700, rel


def test_default_log_dir_is_cwd(msrun, env_dump):
    job = msrun.run(["--worker_num=2", "--local_worker_num=2", "--master_port=0", "--join=True", "env_dump.py"])
    assert job.returncode == 0, job.stderr
    assert (msrun.cwd / "worker_0.log").exists() and (msrun.cwd / "scheduler.log").exists()
    assert "log file:worker_1.log." in job.stdout


def test_worker_log_name_in_real_run(msrun, env_dump):
    job = msrun.run(job_args(2, "--worker_log_name=w_{ip}_{hostname}", "env_dump.py"))
    assert job.returncode == 0, job.stderr
    host = socket.gethostname()
    assert (job.log_dir / f"w_127.0.0.1_{host}_0.log").exists()
    assert (job.log_dir / f"w_127.0.0.1_{host}_1.log").exists()


def test_dry_run_starts_no_scheduler(msrun, env_dump):
    job = msrun.run(
        ["--worker_num=4", "--local_worker_num=4", "--sim_level=1", "--join=True", "--log_dir=logs", "env_dump.py"],
        env={"MS_ROLE": "MS_SCHED", "MS_SCHED_HOST": "stale"},
    )
    assert job.returncode == 0, job.stderr
    assert "Start scheduler" not in job.stdout and not (job.log_dir / "scheduler.log").exists()
    dumps = msrun.dumps()
    assert len(dumps) == 4
    for d in dumps:
        assert d["MS_SIMULATION_LEVEL"] == "1" and d["MS_WORKER_NUM"] == "4" and d["RANK_SIZE"] == "4"
        for gone in ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_TOPO_TIMEOUT"):
            assert gone not in d
    assert sorted(d["RANK_ID"] for d in dumps) == ["0", "1", "2", "3"]


def test_dry_run_single_rank_real(msrun, env_dump):
    job = msrun.run(
        [
            "--worker_num=64",
            "--local_worker_num=8",
            "--sim_level=0",
            "--sim_rank_id=13",
            "--join=True",
            "--log_dir=logs",
            "env_dump.py",
        ],
        env={"RANK_ID": "3"},
    )
    assert job.returncode == 0, job.stderr
    (d,) = msrun.dumps()
    assert d["RANK_ID"] == "13" and d["DEVICE_ID"] == "0" and d["RANK_SIZE"] == "64"
    assert (job.log_dir / "worker_0.log").exists()
    assert "In dryrun case, RANK_ID is assigned to 13." in job.stderr


def test_env_rank_id_does_not_force_single_process_dry_run(msrun, env_dump):
    job = msrun.run(
        ["--worker_num=2", "--local_worker_num=2", "--sim_level=0", "--join=True", "--log_dir=logs", "env_dump.py"],
        env={"RANK_ID": "5"},
    )
    assert job.returncode == 0
    assert sorted(d["RANK_ID"] for d in msrun.dumps()) == ["0", "1"]
    assert "RANK_ID=5 in the environment is ignored" in job.stderr


def test_bind_file_and_rank_table_exported(msrun, env_dump, tmp_path):
    (tmp_path / "rt.json").write_text("{}")
    bind = tmp_path / "bind.cfg"
    bind.write_text(json.dumps({"bind_config": {"bind_cpu_mode": "none"}}))
    job = msrun.run(job_args(1, "--rank_table_file=rt.json", f"--bind_numa={bind.name}", "env_dump.py"))
    assert job.returncode == 0, job.stderr
    (d,) = msrun.dumps()
    import hashlib

    assert d["RANK_TABLE_FILE"] == "rt.json"
    assert d["MSRUN_BIND_FILE"] == str(bind)
    assert d["MSRUN_BIND_FILE_HASH"] == hashlib.sha256(bind.read_text().encode()).hexdigest()


@pytest.mark.parametrize("addr,expected", [("localhost", "127.0.0.1"), ("[::1]", "::1"), ("127.0.0.2", "127.0.0.2")])
def test_master_addr_forms(msrun, env_dump, addr, expected):
    if ":" in expected:
        try:
            socket.socket(socket.AF_INET6).bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    job = msrun.run(job_args(1, f"--master_addr={addr}", "env_dump.py"))
    assert job.returncode == 0, job.stderr
    (d,) = msrun.dumps()
    assert d["MS_SCHED_HOST"] == expected and d["MASTER_ADDR"] == expected
    assert "Start scheduler" in job.stdout, "every local address hosts the scheduler, 127.0.0.2 included"


def test_python_and_pytest_run_as_commands(msrun, env_dump):
    job = msrun.run(job_args(1, "python", "env_dump.py", "x"))
    assert job.returncode == 0, job.stderr
    (d,) = msrun.dumps()
    assert json.loads(d["_argv"]) == ["env_dump.py", "x"]
    assert "Execute command: python env_dump.py x" in job.stdout
    msrun.script("test_ok.py", "def test_ok():\n    assert True\n")
    if shutil.which("pytest") is None:
        pytest.skip("no pytest command on PATH")
    job = msrun.run(job_args(2, "pytest", "-q", "-p", "no:msrun", "test_ok.py"))
    assert job.returncode == 0, job.stderr
    assert "1 passed" in job.log("worker_1.log")


def test_executable_non_python_task(msrun):
    script = msrun.cwd / "run.sh"
    script.write_text('#!/bin/sh\necho "rank=$RANK_ID role=$MS_ROLE"\n')
    script.chmod(0o755)
    job = msrun.run(job_args(2, "run.sh"))
    assert job.returncode == 0, job.stderr
    assert job.log("worker_1.log").strip() == "rank=1 role=MS_WORKER"


def test_print_plan_starts_nothing(msrun, env_dump):
    job = msrun.run(["--worker_num=2", "--local_worker_num=2", "--log_dir=logs", "--print_plan", "env_dump.py"])
    assert job.returncode == 0, job.stderr
    plan = json.loads(job.stdout)
    assert [p["name"] for p in plan["processes"]] == ["scheduler", "worker_0", "worker_1"]
    assert plan["processes"][2]["exported"]["RANK_ID"] == "1"
    assert not (msrun.cwd / "logs").exists() and not list(msrun.dump.iterdir())
