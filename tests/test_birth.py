"""The job's processes are born inside its cgroup (``clone3`` with ``CLONE_INTO_CGROUP``): msrun never
moves, so it never waits for the kernel's RCU grace period a move costs; where the kernel refuses,
msrun moves in and its children inherit the cgroup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid

import pytest
from conftest import job_args, wait_child, wait_for

from pytest_msrun.engine import containment, processes

pytestmark = pytest.mark.cgroup("v2")


def _cgroup_of(pid: int | str) -> str:
    with open(f"/proc/{pid}/cgroup", encoding="ascii") as fh:
        return next(line.split(":", 2)[2].strip() for line in fh if line.startswith("0::"))


def _relative(cgroup: containment.JobCgroup) -> str:
    mount = containment._mounts()["cgroup2"]
    return "/" + os.path.relpath(cgroup.path, mount)


@pytest.fixture
def job_cgroup():
    if not containment.births_possible({}):
        pytest.skip(f"Linux {os.uname().release} cannot start a process inside a cgroup (needs >= 5.7)")
    cgroup = containment.create(f"test{uuid.uuid4().hex[:12]}", {}, birth=True, births_only=True)
    assert cgroup is not None and cgroup.fd is not None
    try:
        yield cgroup
    finally:
        os.close(cgroup.fd)
        assert cgroup.remove(10), "the test cgroup still had members"


def _status_fields(text: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def test_a_spawned_child_is_born_inside_and_starts_as_posix_spawn_would(job_cgroup, tmp_path):
    """Its cgroup, session, descriptors, CPUs and signals at exec - read by ``cat`` (not a Python,
    which sets its own signals) - are those ``posix_spawn`` gives; this process stays where it was."""
    own = _cgroup_of(os.getpid())
    log = tmp_path / "child.log"
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    old = signal.signal(signal.SIGTERM, lambda *_: None)  # this process's handler is not the child's
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        argv = ["cat", "/proc/self/status", "/proc/self/cgroup"]
        pid = processes.spawn_pid(argv, {"PATH": os.defpath}, output_fd=log_fd, cpus=[cpu], cgroup_fd=job_cgroup.fd)
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        os.close(log_fd)
    assert wait_child(pid) == 0
    text = log.read_text()
    fields = _status_fields(text)
    assert int(fields["SigBlk"], 16) == 0
    assert int(fields["SigIgn"], 16) == 0  # SIGPIPE and SIGXFSZ at their defaults, as after posix_spawn
    assert int(fields["SigCgt"], 16) == 0
    assert fields["NSsid"].split()[-1] == fields["Pid"] == str(pid)  # a session of its own
    assert fields["Cpus_allowed_list"].strip() == str(cpu)
    assert f"0::{_relative(job_cgroup)}" in text.splitlines()
    assert _cgroup_of(os.getpid()) == own
    assert os.sched_getaffinity(0) != {cpu} or os.cpu_count() == 1  # this process's CPUs are untouched


def test_an_exec_that_fails_raises_here_and_leaves_no_child(job_cgroup, tmp_path):
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        processes.spawn_pid([str(script)], {}, cgroup_fd=job_cgroup.fd)
    assert job_cgroup.members() == []


def where(env: dict[str, str]) -> int:
    """Run in the fork: write its cgroup and session."""
    with open(env["OUT"], "w") as fh:
        json.dump({"self": _cgroup_of("self"), "sid": os.getsid(0), "pid": os.getpid()}, fh)
    return 5


def test_a_forked_call_is_born_inside(job_cgroup, tmp_path):
    out = tmp_path / "where.json"
    pid = processes.fork_call(f"{__name__}:where", {"OUT": str(out)}, cgroup_fd=job_cgroup.fd)
    assert wait_child(pid) == 5
    facts = json.loads(out.read_text())
    assert facts["self"] == _relative(job_cgroup)
    assert facts["sid"] == facts["pid"] == pid


def test_a_refused_birth_raises_and_leaves_this_process_able_to_fork(tmp_path):
    """A descriptor that is no cgroup: the kernel refuses; this interpreter recovers as after a
    fork (threads start, ``os.fork`` works)."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(processes.BirthRefused):
            processes.fork_into(fd)
    finally:
        os.close(fd)
    done = threading.Event()
    thread = threading.Thread(target=done.set)
    thread.start()
    thread.join(10)
    assert done.is_set()
    pid = os.fork()
    if pid == 0:
        os._exit(4)
    assert wait_child(pid) == 4


WHERE = """
import os
def cgroup(pid):
    with open(f"/proc/{pid}/cgroup") as fh:
        return next(line.split(":", 2)[2].strip() for line in fh if line.startswith("0::"))
with open(os.path.join(os.environ["DUMP_DIR"], f"rank{os.environ['RANK_ID']}.json.part"), "w") as fh:
    fh.write(f'{{"self": "{cgroup("self")}", "msrun": "{cgroup(os.getppid())}"}}')
os.rename(fh.name, fh.name[:-5])
"""

REFUSING = """
import sys
from pytest_msrun.engine import processes

real = processes.fork_into
def refusing(cgroup_fd):
    if cgroup_fd is not None:
        raise processes.BirthRefused(38, "Function not implemented")  # as under a seccomp filter
    return real(cgroup_fd)

processes.fork_into = refusing
from pytest_msrun.entry import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("how", ["born inside", "the kernel refuses", "MSRUN_CGROUP_BIRTH=0"])
def test_workers_and_the_control_plane_run_inside_and_msrun_only_when_it_had_to_move(msrun, how):
    if how != "MSRUN_CGROUP_BIRTH=0" and not containment.births_possible({}):
        pytest.skip(f"Linux {os.uname().release} cannot start a process inside a cgroup (needs >= 5.7)")
    msrun.script("where.py", WHERE)
    args = job_args(2, "where.py")
    env = msrun.env({containment.CGROUP_ENV: "v2"})
    if how == "MSRUN_CGROUP_BIRTH=0":
        env[containment.BIRTH_ENV] = "0"
    argv = [sys.executable, str(msrun.script("refusing.py", REFUSING)), *args] if how == "the kernel refuses" else None
    proc = subprocess.run(argv or msrun.argv(args), cwd=msrun.cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((msrun.dump / f"rank{r}.json").read_text()) for r in (0, 1)]
    job_id = json.loads((msrun.cwd / "logs" / "msrun_status.json").read_text())["job_id"]
    own = _cgroup_of(os.getpid())
    for rank in ranks:
        assert rank["self"].endswith(f"/msrun-{job_id}")
        assert rank["msrun"] == (own if how == "born inside" else rank["self"])
    home = os.path.join(containment._mounts()["cgroup2"], own.lstrip("/"))
    assert wait_for(lambda: not os.path.exists(os.path.join(home, f"msrun-{job_id}")), timeout=10)
