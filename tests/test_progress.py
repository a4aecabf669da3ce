"""Live progress: one rewritten status line on a terminal, nothing on a pipe or in CI."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from conftest import job_args

from pytest_msrun.control.registry import NodeRegistry
from pytest_msrun.engine import progress

# Rank 3 joins the group only once the test has seen the status line waiting for it.
LATE_RANK = """
import os, time
from pytest_msrun import cluster
if os.environ["RANK_ID"] == "3":
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["GO_FILE"]) and time.monotonic() < deadline:
        time.sleep(0.02)
cluster.init()
cluster.barrier()
"""


def _env(msrun, extra: dict[str, str]) -> dict[str, str]:
    env = msrun.env(extra)
    env.pop("CI", None)
    env.pop(progress.PROGRESS_ENV, None)
    return env


def test_a_terminal_sees_ranks_join_and_the_line_goes_away(msrun):
    msrun.script("late.py", LATE_RANK)
    go = msrun.cwd / "go"
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        msrun.argv(job_args(4, "--scheduler=builtin", "late.py")),
        cwd=msrun.cwd,
        env=_env(msrun, {"GO_FILE": str(go)}),
        stdout=subprocess.DEVNULL,
        stderr=slave,
    )
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the other side closed: msrun exited
                    break
                seen += chunk
                if not go.exists() and b"3/4 ranks joined; waiting for 1 on node 0" in seen:
                    go.touch()  # the line named the missing rank: let it join
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, seen.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = seen.decode(errors="replace")
    assert go.exists(), text
    line = "\r\x1b[Kmsrun: 3/4 ranks joined; waiting for 1 on node 0"
    assert line in text, text
    after = text[text.index(line) + len(line) :]
    assert "\r\x1b[K" in after, "the status line is cleared before anything else is written"


def test_a_pipe_gets_no_status_line(msrun):
    msrun.script("late.py", LATE_RANK)
    (msrun.cwd / "go").touch()
    job = msrun.run(job_args(4, "--scheduler=builtin", "late.py"), env={"GO_FILE": str(msrun.cwd / "go")})
    assert job.returncode == 0, job.stderr
    assert "\r" not in job.stderr and "ranks joined" not in job.stderr and "\r" not in job.stdout


def test_status_line_is_off_in_ci_and_when_asked(monkeypatch):
    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("GLOG_v", raising=False)
    assert progress.wanted({}, Tty())  # type: ignore[arg-type]
    assert not progress.wanted({"CI": "true"}, Tty())  # type: ignore[arg-type]
    assert not progress.wanted({progress.PROGRESS_ENV: "0"}, Tty())  # type: ignore[arg-type]
    assert not progress.wanted({}, sys.stdin if not sys.stdin.isatty() else None)  # a pipe or nothing
    monkeypatch.setenv("GLOG_v", "3")  # errors only
    assert not progress.wanted({}, Tty())  # type: ignore[arg-type]


def test_waiting_text_names_the_node_missing_most():
    reg = NodeRegistry(8)
    for i, host in enumerate(["a", "b", "c"]):
        reg.register(object(), i, [4, 2, 2][i], host, f"10.0.0.{i}", 100 + i, i == 0)
    assert reg.waiting_text(set()) == "8/8 ranks registered from 3 node(s)"
    reg.assign()
    assert reg.waiting_text({0, 1, 4}) == "3/8 ranks joined; waiting for 2 on node 0 (a) and 3 on 2 other node(s)"
    assert reg.waiting_text(set(range(8))) == "8/8 ranks joined"
    assert reg.waiting_text(set(range(7))) == "7/8 ranks joined; waiting for 1 on node 2 (c)"
