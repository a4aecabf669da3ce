"""The ranks' debugger: ``--pdb`` and ``breakpoint()`` in a rank stop in pdb on the controller's
terminal (a pseudo-terminal here), one rank at a time; without a terminal they are skipped, said once."""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import job_args
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

READ_WAIT = 90.0  # seconds a prompt may take (a loaded machine starts ranks slowly)

FAILS_ON_RANK_1 = """
import pytest

@pytest.mark.msrun(worker_num=2{extra})
def test_fails_on_rank_1(rank):
    local_value = rank * 10 + 7
    assert rank != 1, f"rank {{rank}} fails"
"""

BREAKS = """
import pytest

@pytest.mark.msrun(worker_num=2{extra})
def test_breaks(rank):
    local_value = rank * 10 + 7
    if rank in {ranks}:
        {body}
    assert local_value > 0
"""


class Terminal:
    """``python -m pytest ARGS`` (``before`` it: a command that runs it, such as ``salloc``) with a
    pseudo-terminal as its stdin, stdout and stderr."""

    def __init__(self, cwd: Path, *args: str, before: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        master, slave = os.openpty()
        self.fd = master
        self.seen = b""  # everything read so far
        self.buffer = b""  # read and not yet matched
        self.proc = subprocess.Popen(
            [*before, sys.executable, "-m", "pytest", *args],
            cwd=cwd,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            env={**(os.environ if env is None else env), "COLUMNS": "200"},  # the summary's lines whole
        )
        os.close(slave)

    def expect(self, pattern: str, wait: float = READ_WAIT) -> re.Match[bytes]:
        """Read until ``pattern`` (a regular expression) matches; fails at the deadline or the end."""
        regex = re.compile(pattern.encode())
        deadline = time.monotonic() + wait
        while True:
            found = regex.search(self.buffer)
            if found:
                self.buffer = self.buffer[found.end() :]
                return found
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} within {wait:g} s; the terminal showed:\n{self.text()}"
            data = self._read(left)
            assert data, f"no {pattern!r} before the end; the terminal showed:\n{self.text()}"

    def send(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\n")

    def finish(self, wait: float = READ_WAIT) -> int:
        """Read to the end; the exit status."""
        deadline = time.monotonic() + wait
        while self._read(max(0.0, deadline - time.monotonic())):
            pass
        assert self.proc.wait(timeout=max(1.0, deadline - time.monotonic())) is not None
        return self.proc.returncode

    def text(self) -> str:
        return self.seen.decode(errors="replace")

    def _read(self, wait: float) -> bytes:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if not ready:
            return b""
        try:
            data = os.read(self.fd, 1 << 16)
        except OSError:  # EIO: every holder of the terminal's other end has closed it
            return b""
        self.seen += data
        self.buffer += data
        return data

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        os.close(self.fd)


@pytest.fixture
def terminal(pytester, tracked):
    made: list[Terminal] = []

    def start(*args: str) -> Terminal:
        made.append(Terminal(pytester.path, "-p", "no:randomly", "-p", "no:cacheprovider", *args))
        return made[-1]

    yield start
    for term in made:
        term.close()


MODES = {
    "warm": ("", ()),
    "fresh": ("", ("--msrun-worlds=fresh",)),
    "job": (", scheduler='task'", ()),  # a fresh job of its own (never a world)
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_pdb_stops_the_failing_rank_on_the_controllers_terminal(pytester, terminal, mode):
    extra, args = MODES[mode]
    pytester.makepyfile(test_fails=FAILS_ON_RANK_1.format(extra=extra))
    term = terminal("--pdb", *args, "test_fails.py")
    term.expect(r"AssertionError: rank 1 fails")  # the failure's traceback, before the prompt
    term.expect(r"\(Pdb rank 1\) ")
    term.send("p local_value")
    term.expect(r"\r\n17\r\n")
    term.expect(r"\(Pdb rank 1\) ")
    term.send("c")
    code = term.finish()
    out = term.text()
    assert code == 1, out
    assert "1 failed" in out and "[rank 1] AssertionError: rank 1 fails" in out, out
    assert "(Pdb rank 0)" not in out  # rank 0 did not fail
    assert "the job's timeout is paused" in out


def test_breakpoint_in_rank_1_opens_pdb_on_the_controllers_terminal(pytester, terminal):
    pytester.makepyfile(test_breaks=BREAKS.format(extra="", ranks="(1,)", body="breakpoint()"))
    term = terminal("--msrun-worlds=fresh", "test_breaks.py")
    term.expect(r"breakpoint\(\) in rank 1 at test_breaks.py:7")
    term.expect(r"\(Pdb rank 1\) ")
    term.send("p local_value")
    term.expect(r"\r\n17\r\n")
    term.send("n")  # a step stays in the same session
    term.expect(r"\(Pdb rank 1\) ")
    term.send("c")
    code = term.finish()
    out = term.text()
    assert code == 0 and "1 passed" in out, out
    assert out.count("pdb here") == 1, out


@pytest.mark.parametrize("mode", ["warm", "fresh"])
def test_breakpoints_in_two_ranks_are_two_sessions_one_after_the_other(pytester, terminal, mode):
    body = "import pdb; pdb.set_trace()" if mode == "fresh" else "breakpoint()"
    pytester.makepyfile(test_breaks=BREAKS.format(extra="", ranks="(0, 1)", body=body))
    term = terminal(*MODES[mode][1], "test_breaks.py")
    ranks = []
    for _ in range(2):
        rank = int(term.expect(r"\(Pdb rank (\d)\) ").group(1))
        ranks.append(rank)
        term.send("p local_value")
        term.expect(rf"\r\n{rank * 10 + 7}\r\n")
        term.expect(rf"\(Pdb rank {rank}\) ")
        term.send("c")
        term.expect(rf"rank {rank} goes on")  # the next session begins only after this one ended
    code = term.finish()
    out = term.text()
    assert sorted(ranks) == [0, 1], out
    assert code == 0 and "1 passed" in out, out


def test_the_jobs_timeout_is_paused_while_a_rank_is_in_the_debugger(pytester, terminal):
    pytester.makepyfile(test_breaks=BREAKS.format(extra=", timeout=3", ranks="(1,)", body="breakpoint()"))
    term = terminal("--msrun-worlds=fresh", "test_breaks.py")
    term.expect(r"\(Pdb rank 1\) ")
    term.send("import time; time.sleep(4)")  # longer than the test's timeout, in the debugger
    term.expect(r"\(Pdb rank 1\) ")
    term.send("c")
    code = term.finish()
    out = term.text()
    assert code == 0 and "1 passed" in out, out


SKIPPED = r"msrun: breakpoint\(\) in rank {rank} at test_breaks.py:8 skipped: no terminal \(stdin is not a tty\)"


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_without_a_terminal_breakpoints_and_pdb_are_skipped_and_said_once(pytester, tracked, worlds):
    looped = BREAKS.format(extra="", ranks="(0, 1)", body="for _ in range(3):\n            breakpoint()")
    pytester.makepyfile(test_breaks=looped, test_fails=FAILS_ON_RANK_1.format(extra=""))
    result = pytester.run(
        sys.executable,
        "-m",
        "pytest",
        "--pdb",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        f"--msrun-worlds={worlds}",
        "test_breaks.py",
        "test_fails.py",
        stdin=subprocess.DEVNULL,
        timeout=180,
    )
    out = result.stdout.str()
    assert result.ret == 1, out
    for rank in (0, 1):
        assert len(re.findall(SKIPPED.format(rank=rank), out)) == 1, out
    assert out.count("msrun: --pdb in rank 1 at test_fails.py:6 skipped: no terminal (stdin is not a tty)") == 1, out
    assert "goes on; the job" not in out  # no session began
    assert re.search(r"1 failed, 1 passed", out), out
    assert re.search(r"FAILED test_fails.py::test_fails_on_rank_1 - \[rank 1\] AssertionError", out), out


SUITE = """
def test_fails_on_rank_1(rank):
    assert rank != 1

def test_breaks(rank):
    breakpoint()

def test_after(rank):
    assert True
"""


def test_suite_ranks_skip_pdb_and_breakpoints_and_go_on(msrun):
    """``pmsrun pytest --pdb``: a rank has no terminal (its output is its log): a failure or a
    breakpoint() is said once in its log, and the rank goes on with the suite."""
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_suite.py").write_text(textwrap.dedent(SUITE))
    job = msrun.run(job_args(2, "--scheduler=builtin", "pytest", "-p", "no:cacheprovider", "--pdb", "suite"))
    assert job.returncode == 1, job.stdout + job.stderr
    assert re.search(r"test_after\s+passed\s+passed\s+passed", job.stdout), job.stdout
    assert re.search(r"test_breaks\s+passed\s+passed\s+passed", job.stdout), job.stdout
    log = job.log("worker_1.log")
    assert log.count("msrun: --pdb in rank 1 at suite/test_suite.py:3 skipped: no terminal") == 1, log
    assert log.count("msrun: breakpoint() in rank 1 at suite/test_suite.py:6 skipped: no terminal") == 1, log


def _rank_asks(server, where: str = "t.py:1", token: str | None = None) -> dict:
    """A rank's request for a session, as debugrank makes it: the server's answer (then it goes on)."""
    from pytest_msrun.control import wire

    host, _, port = server.address.rpartition(":")
    channel = wire.Channel.connect(host, int(port), timeout=30)
    try:
        hello = {"t": "hello", "kind": "debug", "rank": 0, "stop": "breakpoint", "where": where, "nodeid": "t.py::x"}
        channel.handshake(hello, server.token if token is None else token, 30)
        return channel.recv(30)
    finally:
        channel.close()


def test_without_a_terminal_the_debugger_does_not_listen():
    """No terminal, no listener: the ranks are told why instead of where."""
    from pytest_msrun.plugin.controller.debugserver import DebugServer

    server = DebugServer(post_mortem=True, terminal=None)
    try:
        env = server.env()
        assert env == {"MSRUN_DEBUG_NONE": "no terminal (stdin is not a tty)", "MSRUN_DEBUG_PDB": "1"}
        assert server.address == "" and server.held() == 0.0
    finally:
        server.close()


@pytest.fixture
def terminal_server():
    """A debug server with a terminal (a pseudo-terminal) and what it says, read after it closed."""
    from pytest_msrun.plugin.controller.debugserver import DebugServer

    primary, secondary = os.openpty()
    read, write = os.pipe()
    server = DebugServer(post_mortem=False, terminal=secondary, stdout_fd=write)
    os.close(write)
    said: list[str] = []
    yield server, said
    server.close()
    with os.fdopen(read, "rb") as fh:
        said.append(fh.read().decode())
    os.close(primary)
    os.close(secondary)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.integers(1, 100_000).map(lambda n: b"[" * n + b"\n"),  # nesting before any token is checked
        st.recursive(
            st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
            lambda inner: st.one_of(
                st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=20,
        ).map(lambda v: json.dumps({"t": "hello", "kind": "debug", "nonce": v, "rank": v}).encode()),
    )
)
def test_whatever_reaches_the_debug_port_ends_only_that_connection(terminal_server, data: bytes) -> None:
    """A stranger's bytes (garbage, deep nesting, hostile fields, as raw bytes or in a frame) cost
    only its connection: a rank with the token is served after them."""
    import struct

    server, _ = terminal_server
    host, _, port = server.address.rpartition(":")
    for payload in (data, struct.pack(">I", len(data)) + data):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                sock.recv(100)
            except OSError:
                pass
    assert _rank_asks(server) == {"t": "ok"}


def test_a_flood_at_the_debug_port_is_bounded_and_a_rank_still_gets_in(terminal_server):
    """A thousand silent connections (another user would keep them open): the server keeps a bounded
    number of them, and a rank's request is served."""
    server, _ = terminal_server
    host, _, port = server.address.rpartition(":")
    before = len(os.listdir("/proc/self/fd"))
    flood = [socket.create_connection((host, int(port)), timeout=10) for _ in range(1000)]
    try:
        from conftest import wait_for

        from pytest_msrun.control.door import PENDING_FLOOR

        # our end of each flood connection is one descriptor; the server's ends are bounded by the door
        wait_for(lambda: len(os.listdir("/proc/self/fd")) - before - len(flood) <= PENDING_FLOOR, timeout=30)
        assert _rank_asks(server, "t.py:9") == {"t": "ok"}
    finally:
        for s in flood:
            s.close()
    assert server.sessions == 1 and server.thread.is_alive()  # served, and still serving


def test_a_wrong_token_gets_no_session(terminal_server):
    from pytest_msrun.control import wire

    server, _ = terminal_server
    with pytest.raises(wire.AuthError, match="bad token"):
        _rank_asks(server, token="f" * 32)
    assert server.sessions == 0
