"""Secret files fail closed, at once: whatever sits where a token file should be, msrun neither
hangs nor tracebacks - one ``msrun: error:`` naming the file and the fix, exit 2, nothing started.

As ssh with a key: a regular file of this user's that no one else may read, in directories no one
else may write; opened without blocking (a FIFO must not hold msrun), read up to a bound, UTF-8.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import Job, free_port, job_args

SECRET = "7f3c9a01e4b85d26c0aa19f4e7b3d58216c9e07f4ab3d1e5"  # random hex: not guessable


def _refused(job, needle: str) -> None:
    assert job.returncode == 2, job.stdout + job.stderr
    errors = [line for line in job.stderr.splitlines() if line.startswith("msrun: error:")]
    assert len(errors) == 1 and needle in errors[0], job.stderr
    assert "Traceback" not in job.stderr
    assert "Start worker" not in job.stdout + job.stderr


def _make(kind: str, path, tmp_path) -> str:
    """Put ``kind`` at ``path``; returns what the error must say."""
    if kind == "fifo":
        os.mkfifo(path, 0o600)
        return "is not a regular file (a FIFO)"
    if kind == "directory":
        path.mkdir(mode=0o700)
        return "is not a regular file (a directory)"
    if kind == "socket":
        import socket

        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
        os.chmod(path, 0o600)
        return "is not a regular file (a socket)"
    if kind == "not utf-8":
        path.write_bytes(b"\xff\xfe" + SECRET.encode())
        path.chmod(0o600)
        return "is not UTF-8 text"
    if kind == "huge":
        path.write_text("s" * 100_000)
        path.chmod(0o600)
        return "is larger than 4096 bytes"
    if kind == "others may write its directory":
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)  # not sticky: anyone may replace what is in it
        target = shared / "token"
        target.write_text(SECRET)
        target.chmod(0o600)
        path.symlink_to(target)
        return "is writable by others (mode 777)"
    raise AssertionError(kind)


KINDS = ["fifo", "directory", "socket", "not utf-8", "huge", "others may write its directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_file_that_is_not_a_private_regular_file_stops_msrun_at_once(msrun, tmp_path, kind):
    path = tmp_path / "token"
    said = _make(kind, path, tmp_path)
    msrun.script("t.py", "print('ran')\n")
    # A FIFO nobody writes once held msrun in open() forever, deaf to SIGTERM: the timeout fails it.
    job = msrun.run(job_args(2, "t.py"), env={"MSRUN_JOB_TOKEN_FILE": str(path)}, timeout=60)
    _refused(job, said)
    assert f"MSRUN_JOB_TOKEN_FILE={path}" in job.stderr
    assert not (msrun.cwd / "logs").exists()


def test_a_device_as_token_file_is_refused(msrun):
    msrun.script("t.py", "print('ran')\n")
    job = msrun.run(job_args(2, "t.py"), env={"MSRUN_JOB_TOKEN_FILE": "/dev/zero"}, timeout=60)
    _refused(job, "is not a regular file (a character device)")


def test_a_token_that_is_not_utf8_is_refused(msrun):
    msrun.script("t.py", "print('ran')\n")
    env = msrun.env({"MSRUN_JOB_TOKEN": b"\xff\xfe-not-text".decode("utf-8", "surrogateescape")})
    proc = subprocess.run(msrun.argv(job_args(2, "t.py")), cwd=msrun.cwd, env=env, capture_output=True, timeout=60)
    job = Job(proc.returncode, proc.stdout.decode(), proc.stderr.decode(), msrun.cwd / "logs")
    _refused(job, "MSRUN_JOB_TOKEN is not UTF-8 text")


def _multi_node_args() -> list[str]:
    return ["--worker_num=2", "--local_worker_num=1", "--node_rank=0", f"--master_port={free_port()}", "t.py"]


@pytest.mark.parametrize("existing", [True, False], ids=["secret there", "secret to be made"])
def test_the_users_secret_in_a_directory_others_may_write_is_refused(msrun, tmp_path, existing):
    """ssh refuses a key in a group- or world-writable directory: someone else could have put it
    there, or may swap it. msrun neither uses nor creates a secret there."""
    config = tmp_path / "config"
    directory = config / "msrun"
    directory.mkdir(parents=True)
    directory.chmod(0o777)
    secret = directory / "secret"
    if existing:
        secret.write_text(SECRET + "\n")
        secret.chmod(0o600)
    msrun.script("t.py", "print('ran')\n")
    job = msrun.run(_multi_node_args(), env={"XDG_CONFIG_HOME": str(config)}, timeout=60)
    _refused(job, f"its directory {directory} is writable by others (mode 777)")
    assert f"chmod go-w {directory}" in job.stderr
    assert sorted(p.name for p in directory.iterdir()) == (["secret"] if existing else [])


def test_a_token_file_in_a_sticky_shared_directory_is_used(msrun, tmp_path):
    """/tmp-like directories (sticky: others cannot rename or remove what is ours) are fine."""
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    token = shared / "token"
    token.write_text(SECRET + "\n")
    token.chmod(0o600)
    msrun.script("t.py", "print('ran')\n")
    job = msrun.run(job_args(2, "t.py"), env={"MSRUN_JOB_TOKEN_FILE": str(token)}, timeout=60)
    assert job.returncode == 0, job.stderr
