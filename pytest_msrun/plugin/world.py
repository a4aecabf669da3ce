"""Warm worlds: marked tests of one shape run in one long-lived job, each test isolated and judged alone.

A world is an msrun job started like a fresh test's job, whose ranks are pytest sessions that
collected every test of its shape and wait (:mod:`.serve`). For each test the controller sends
its node id - and the next test of the same shape, so module and session fixtures stay up - to
every rank, waits for every rank's ``done``, and merges the records the ranks wrote into that
test's own report directory exactly as for a fresh job.

A world ends, and the next test of its shape starts a new one, when a test crashes a rank (the
job ends: msrun's first-failure rule), fails on a rank while another is still inside it (that
rank may be blocked on the failed one: the world is stopped as a fresh job's would be), or runs
out of time (stacks first). Worlds end too when no test of their shape is left, when more than
:data:`MAX_WORLDS` are alive (the least recently used), and with the session - however the
controller ends, like fresh jobs (parent-death signal, own sessions).
"""

from __future__ import annotations

import hmac
import os
import selectors
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from pytest_msrun.plugin.job import JobRun, Launched, TestJob
from pytest_msrun.plugin.marker import MsrunSpec
from pytest_msrun.plugin.serve import WORLD_ENV, WORLD_TOKEN_ENV, Channel

MAX_WORLDS = 2  # worlds alive at once per controller (each holds its ranks' processes)
FAILURE_GRACE = 0.5  # s the other ranks may still finish a test one rank failed (a fresh job's teardown gap)
STUCK_CHECK = 0.25  # s between looks at the control plane while some ranks finished a test and others not


def world_key(spec: MsrunSpec, devices: int) -> tuple[Any, ...]:
    """What makes two marked tests able to share a world: everything that shapes the job."""
    return (
        spec.worker_num,
        tuple(spec.node_sizes()),
        spec.scheduler,
        spec.bind_core,
        spec.bind_numa,
        devices,
        tuple(sorted(spec.env.items())),
    )


def eligible(spec: MsrunSpec) -> bool:
    """Whether a test may run in a warm world (dry runs and ``scheduler='task'`` jobs are fresh)."""
    return not spec.isolated and spec.sim_level is None and spec.scheduler != "task"


@dataclass
class WarmResult:
    """One test in a world: the run to merge, what ranks leaked, and whether the world survived."""

    run: JobRun
    leaks: dict[int, list[str]] = field(default_factory=dict)
    missing: bool = False  # a rank did not collect the test: run it as a fresh job instead


class World:
    """One warm world: its job, the controller's listening socket, one channel per rank."""

    def __init__(self, key: tuple[Any, ...], job: TestJob, lease: Any, cluster_time_out: int) -> None:
        self.key = key
        self.job = job
        self.lease = lease
        self.token = os.urandom(16).hex()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.setblocking(False)
        port = self.server.getsockname()[1]
        env = {WORLD_ENV: f"127.0.0.1:{port}", WORLD_TOKEN_ENV: self.token}
        self.launched: Launched = job.launch(cluster_time_out, env)
        self.channels: dict[int, Channel] = {}
        self.dead = ""  # why it can run no more tests
        self.tests = 0
        self.last_used = time.monotonic()
        self.created = time.time()

    @property
    def ranks(self) -> list[int]:
        return list(range(self.job.spec.worker_num))

    def connect(self, deadline: float) -> str:
        """Wait for every rank to connect; "" or why the world did not come up."""
        sel = selectors.DefaultSelector()
        sel.register(self.server, selectors.EVENT_READ)
        try:
            while len(self.channels) < len(self.ranks):
                if self.launched.exited():
                    return "the world's msrun ended before every rank connected"
                if time.monotonic() > deadline:
                    return "the world's ranks did not all connect in time"
                for _key, _ in sel.select(timeout=0.05):
                    try:
                        conn, _addr = self.server.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(True)
                    conn.settimeout(10)
                    channel = Channel(conn)
                    try:
                        hello = channel.receive()
                    except (OSError, ValueError):
                        hello = None
                    rank = hello.get("rank") if hello else None
                    token = str(hello.get("token", "")) if hello else ""
                    if not isinstance(rank, int) or not hmac.compare_digest(token, self.token) or rank in self.channels:
                        channel.close()
                        continue
                    conn.settimeout(None)
                    self.channels[rank] = channel
            return ""
        finally:
            sel.close()

    def run_test(self, test: TestJob, nodeid: str, nextid: str | None, timeout: float) -> WarmResult:
        """Run one test on every rank; the merged run, as for a fresh job."""
        self.tests += 1
        self.last_used = time.monotonic()
        started = self.created if self.tests == 1 else time.time()  # the first test's setup starts the world
        msg = {
            "t": "run",
            "nodeid": nodeid,
            "next": nextid,
            "report_dir": str(test.report_dir),
            "shared_dir": str(test.shared_dir),
        }
        for channel in self.channels.values():
            try:
                channel.send(msg)
            except OSError:
                pass
        replies: dict[int, dict[str, Any]] = {}
        sel = selectors.DefaultSelector()
        for rank, channel in self.channels.items():
            sel.register(channel.sock, selectors.EVENT_READ, rank)
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        timed_out = False
        next_check = 0.0
        declared = False
        try:
            while len(replies) < len(self.channels):
                now = time.monotonic()
                if now > deadline:
                    timed_out = True
                    break
                if failed_at is not None and now - failed_at > FAILURE_GRACE:
                    self.dead = "a rank failed the test while others were still in it"
                    break
                if self.dead:
                    break
                if replies and not declared and now >= next_check and self.job.has_control_plane():
                    next_check = now + STUCK_CHECK
                    declared = self._release_waiters(set(replies))
                if self.launched.exited():
                    self.dead = "the world's job ended (a rank died)"
                    self._await_job_end()
                    break
                for key, _ in sel.select(timeout=0.05):
                    rank = key.data
                    try:
                        reply = self.channels[rank].receive()
                    except (OSError, ValueError):
                        reply = None
                    sel.unregister(key.fileobj)
                    if reply is None:  # its connection closed: the rank is gone (even with status 0)
                        self.dead = f"rank {rank} ended inside the test"
                        self._await_job_end()
                        break
                    replies[rank] = reply
                    if reply.get("failed") and failed_at is None:
                        failed_at = time.monotonic()
        finally:
            sel.close()
        if any(r.get("t") == "missing" for r in replies.values()):
            return WarmResult(run=self._run(test, started, timeout, False), missing=True)
        stacks: dict[int, str] = {}
        state = None
        if timed_out:
            self.dead = f"the test ran out of time ({timeout:g} s)"
            from pytest_msrun.control.observer import query_state

            if self.job.has_control_plane():
                state = query_state(self.job.master_host, self.job.ports[0], self.job.token)
            stacks = self.job.collect_stacks()
        if self.dead:
            self.stop()
        run = self._run(test, started, timeout, timed_out)
        run.stacks = stacks
        run.state = state
        groups = {repr(reply.get("group")) for reply in replies.values()}
        if not self.dead and (declared or len(groups) > 1):
            # Who waited for whom, or unequal collective counters: the next test needs a fresh group.
            self.dead = "the ranks' control-plane state diverged in this test"
            self.stop()
        leaks = {r: list(reply.get("leaks") or []) for r, reply in replies.items() if reply.get("leaks")}
        return WarmResult(run=run, leaks=leaks)

    def _release_waiters(self, finished: set[int]) -> bool:
        """Ranks still in the test that wait - to form the group, or in a collective - only for ranks
        that finished it would wait forever (in a fresh job those ranks exit and the wait fails):
        tell the control plane, which fails those waits now. Whether it was told."""
        from pytest_msrun.control.observer import declare_finished, query_state

        host, port, token = self.job.master_host, self.job.ports[0], self.job.token
        state = query_state(host, port, token, timeout=1.0)
        if not state:
            return False
        everyone = set(self.ranks)
        stuck_in_init = (
            not state.get("ready")
            and bool(everyone - set(state.get("joined", [])))
            and (everyone - set(state.get("joined", [])) <= finished)
        )
        stuck_in_collective = any(
            (everyone - set(c.get("ranks", []))) and (everyone - set(c.get("ranks", []))) <= finished
            for c in state.get("collectives", [])
        )
        if not (stuck_in_init or stuck_in_collective):
            return False
        return declare_finished(host, port, token, sorted(finished), "finished its test", timeout=1.0)

    def _await_job_end(self, seconds: float = 1.0) -> None:
        """Give msrun a moment to record how the ranks ended (a crash ends the job by itself)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(p.poll() is not None for p in self.launched.procs):
            time.sleep(0.01)

    def _run(self, test: TestJob, started: float, timeout: float, timed_out: bool) -> JobRun:
        cluster_time_out = max(1, min(600, int(timeout)))
        run = JobRun(
            reproduce_lines=test.reproduce_lines(cluster_time_out, timeout),
            exit_codes=[p.returncode for p in self.launched.procs],
            timed_out=timed_out,
            timeout=timeout,
            started=started,
            ended=time.time(),
            msrun_logs=list(self.launched.logs),
        )
        run.ranks = self.job.rank_ends()
        return run

    def stop(self) -> None:
        """End the world: ``quit`` (fixtures torn down, sessions end), then msrun's own teardown."""
        for channel in self.channels.values():
            try:
                channel.send({"t": "quit"})
            except OSError:
                pass
        deadline = time.monotonic() + 10
        if not self.dead:
            for popen in self.launched.procs:
                try:
                    popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # a world that does not end cleanly is stopped below
                    break
        self.job.stop(self.launched)
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()
        self.server.close()
        if not self.dead:
            self.dead = "stopped"
