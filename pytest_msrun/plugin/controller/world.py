"""Warm worlds: marked tests of one shape run in one long-lived job, each test isolated and judged alone.

A world is an msrun job started like a fresh test's job, whose ranks are pytest sessions that
collected every test of its shape and wait (:mod:`.serve`). A test runs in two steps, as in pytest's
own protocol: :meth:`World.begin` sends its node id and waits until every rank finished setup and
call (:class:`Called` then holds what the controller reports for them); :func:`teardown`
sends the teardown with the next test this world will run - or none, which ends the world with
this test: its ranks tear every fixture down, exit, and their process ends are judged on it.

A world ends, and the next test of its shape starts a new one, when a test crashes a rank (the
job ends: msrun's first-failure rule), fails on a rank while another is still inside it (that
rank may be blocked on the failed one: the world is stopped as a fresh job's would be), runs out
of time (stacks first), leaves a thread or a process running (it could crash the next test),
leaves the ranks' control-plane state diverged, or leaves a rank past ``--msrun-max-rss``
(:mod:`.rankmemory`). It also ends after the last test the controller
will send it, and - however the controller ends - with the session (parent-death signal, own
sessions). A world found dead before a test is sent is never used for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pytest_msrun import sizes
from pytest_msrun.control import wire
from pytest_msrun.control.door import Admitted, Door, Tally
from pytest_msrun.control.observer import declare_finished, query_state
from pytest_msrun.netaddr import rank_listener
from pytest_msrun.plugin import envscope, rankmemory
from pytest_msrun.plugin.controller.debugserver import paused_clock
from pytest_msrun.plugin.controller.job import JobRun, Launched, TestJob, TestPaths
from pytest_msrun.plugin.links import FORK_ENV, WORLD_ENV, WORLD_TOKEN_ENV, Channel
from pytest_msrun.plugin.marker import MsrunSpec
from pytest_msrun.plugin.rule.outcomes import RankEnd
from pytest_msrun.proc import running
from pytest_msrun.waiting import wait_until

FAILURE_GRACE = 0.5  # s the other ranks may still finish a test one rank failed (a fresh job's teardown gap)
STUCK_CHECK = 0.25  # s between looks at the control plane while some ranks finished a test and others not
# s after the first rank finished before the first look: ranks of one test finish within
# milliseconds of each other, and each look is a new authenticated connection to the control plane
STUCK_FIRST_CHECK = 0.05
HELLO_TIMEOUT = 10.0  # s a connection to a world's door may take to prove its token


def world_key(spec: MsrunSpec) -> tuple[Any, ...]:
    """What makes two marked tests able to share a world: everything that shapes the job."""
    return (
        spec.worker_num,
        tuple(spec.node_sizes()),
        spec.scheduler,
        spec.bind_core,
        spec.bind_numa,
        spec.devices,
        tuple(sorted(spec.env.items())),
    )


def world_need(key: tuple[Any, ...]) -> tuple[int, int]:
    """The ranks and devices a world of ``key`` holds while it lives."""
    return int(key[0]), int(key[5])


FORKING = "forking"  # the last element of a forking world's key


@dataclass(frozen=True)
class WarmTest:
    """One test as sent to a world: what its record and reproduce line are made of."""

    world: World
    paths: TestPaths
    nodeid: str
    started: float
    deadline: float
    timeout: float
    env: dict[str, str] = field(default_factory=dict)  # its own variables (--msrun-env-scope=test)
    held: float = 0.0  # the debug server's held() when it began: time in the debugger since moves its deadline


@dataclass(frozen=True)
class Called:
    """What a test's setup and call left in its world: the run to judge them by (every rank done with
    its call, or the world ended), and the ranks that did not run it (``absent``: they did not
    collect it, or - ``unforkable`` says why - cannot fork it; it runs as a fresh job instead)."""

    test: WarmTest
    run: JobRun
    absent: frozenset[int] = frozenset()
    unforkable: str = ""


@dataclass(frozen=True)
class TornDown:
    """A test's teardown in its world: the complete run (its process ends too when the world ended
    with it), what it left behind on each rank, and why its world ended after it (--msrun-max-rss)."""

    run: JobRun
    leaks: dict[int, list[str]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def teardown(called: Called, next_id: str | None, exit_timeout: float) -> TornDown:
    """The teardown of ``called``'s test, keeping what the test ``next_id`` shares with it (None
    ends the world)."""
    test = called.test
    world = test.world
    if world.dead:
        return TornDown(called.run)
    # fixtures kept for the next test only if it runs with the same variables as this one
    keep = next_id is None or world.test_envs.get(next_id, {}) == test.env
    message = {"t": "teardown", "next": next_id, "keep": keep}
    world.template_rss = {}  # a forking world's, once its children ended after this test
    replies, timed_out = world.exchange(message, "done", test.deadline, release=True, held=test.held)
    world.shown()
    leaks = {r: list(reply.get("leaks") or []) for r, reply in replies.items() if reply.get("leaks")}
    for rank, reply in replies.items():  # what the test grew each rank by: one more thing left behind
        grown = rankmemory.judge(reply.get("memory"), world.memory[0])
        if grown:
            leaks.setdefault(rank, []).extend(grown)
    groups = {repr(reply.get("group")) for reply in replies.values()}
    lingering = any(reply.get("lingering") for reply in replies.values())
    if timed_out:
        return TornDown(world.stop_on_timeout(test, set(replies)), leaks)
    # a forking world's children end: one that ended as a fresh rank would not ended its template alike
    forked = world.forking and not world.lost and not world.dead
    hung = world.await_ends(exit_timeout, set(called.absent)) if forked else []
    if world.dead:  # a rank died in the teardown
        world.stop()
        return TornDown(world.job_run(test, False), leaks)
    if hung:  # a child does not end (a thread the test left, an exit handler)
        stacks = world.job.collect_stacks()
        world.stop()
        return TornDown(world.ended_run(test, hung, exit_timeout, stacks), leaks)
    # a rank (a forking world's template) past --msrun-max-rss: a new world next
    notes = _past_max(world, world.template_rss if world.forking else _resident(replies))
    if world.declared or len(groups) > 1:
        world.retire("the ranks' control-plane state diverged in this test")
    elif lingering:
        world.retire("the test left a thread or a process running on a rank")
    elif next_id is None:
        world.retire("its last test ran")
    if world.retiring:
        return TornDown(world.end(test, exit_timeout), leaks, notes)
    return TornDown(world.job_run(test, False), leaks, notes)


def _past_max(world: World, resident: dict[int, int]) -> tuple[str, ...]:
    """Why ``world`` ends after this test: its ranks whose resident set passed ``--msrun-max-rss``."""
    maximum = world.memory[1]
    what = "its template" if world.forking else "it"
    notes = tuple(
        f"rank {rank}: resident memory {sizes.format_size(size)} past --msrun-max-rss="
        f"{sizes.format_size(maximum)}: the world ended after {what}, the next test starts a new one"
        for rank, size in sorted(resident.items())
        if rankmemory.past_max(size, maximum)
    )
    if notes:
        world.retire("a rank's resident memory passed --msrun-max-rss")
    return notes


def _resident(replies: dict[int, dict[str, Any]]) -> dict[int, int]:
    samples = {rank: reply.get("memory") for rank, reply in replies.items()}
    return {r: s["after"] for r, s in samples.items() if isinstance(s, dict) and isinstance(s.get("after"), int)}


class World:
    """One warm world: its job, the controller's listening socket, one channel per rank."""

    def __init__(
        self,
        key: tuple[Any, ...],
        job: TestJob,
        lease: Any,
        test_envs: dict[str, dict[str, str]],
        memory: tuple[int, int],
        strangers: Tally,
    ) -> None:
        """``strangers``: where the world's door counts who it dropped (the session's, for its summary)."""
        self.key = key
        self.memory = memory  # --msrun-leak-rss and --msrun-max-rss in bytes (0: off)
        self.template_rss: dict[int, int] = {}  # a forking world's templates after the last child
        self.job = job
        self.lease = lease
        self.forking = bool(key) and key[-1] == FORKING  # each test in a child forked for it
        # --msrun-env-scope=test: each test's own variables, set for it alone (node id -> variables)
        self.test_envs = test_envs
        self.env_read: set[str] = set()  # which of them a rank looked up while it collected
        self.token = os.urandom(16).hex()
        # a Slurm step's ranks reach this host where srun ran (only the world's token is let in)
        server, address = rank_listener(steps=job.cluster is not None)
        self.door = Door(server, token=self.token, kinds=("world",), timeout=HELLO_TIMEOUT, tally=strangers)
        env = {WORLD_ENV: address, WORLD_TOKEN_ENV: self.token}
        if self.forking:
            env[FORK_ENV] = "1"
        watched = sorted({key for test_env in self.test_envs.values() for key in test_env})
        if watched:
            env[envscope.TRACK_ENV] = ",".join(watched)
        self.launched: Launched = job.launch(env)
        self.channels: dict[int, Channel] = {}
        self.dead = ""  # why it can run no more tests
        self.retiring = ""  # why it ends after the current test
        self.lost: set[int] = set()  # ranks that left the world (their connection closed)
        self.declared = False  # the control plane was told ranks had finished a test
        self.last: WarmTest | None = None  # the last test it ran
        self.created = time.time()
        self.connected = False  # every rank connected (a world started ahead is not, until needed)
        self.claimed = 0.0  # when its first test asked for it (it may have been started ahead)
        self.ranks = list(range(job.spec.worker_num))

    def connect(self, deadline: float) -> str:
        """Wait for every rank to connect; "" or why the world did not come up. Others who
        connect meanwhile are strangers at the door (:class:`~pytest_msrun.control.door.Door`),
        never the test's problem. Once every rank is in, the world listens no more."""
        self.claimed = self.claimed or time.time()
        clock = paused_clock(self.job.debug)  # a breakpoint() while the ranks collect
        try:
            while len(self.channels) < len(self.ranks):
                if self.launched.exited():  # said with the first rank that ended it (a collection error, say)
                    ends = sorted(self.job.rank_ends().items())
                    first = [
                        f"rank {r} {e.describe(False)}" for r, e in ends if e.returncode and not e.terminated_by_msrun
                    ]
                    return "the world's msrun ended before every rank connected" + (f": {first[0]}" if first else "")
                if clock() > deadline:
                    return "the world's ranks did not all connect in time"
                for admitted in self.door.serve(0.05):
                    self._admit(admitted)
            return self._env_read(deadline + time.monotonic() - clock())
        finally:
            self.door.close()

    def _admit(self, admitted: Admitted) -> None:
        """A client that proved the world's token: the rank its hello names, unless taken."""
        rank = admitted.hello.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank in self.channels or rank not in self.ranks:
            admitted.sock.close()
            return
        admitted.sock.setblocking(True)
        admitted.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = Channel(admitted.sock)
        channel.pending = admitted.messages + channel.frames.feed(admitted.rest)
        self.channels[rank] = channel

    def _env_read(self, deadline: float) -> str:
        """Each rank's first message: which environment variables it read while it collected."""
        for rank, channel in self.channels.items():
            try:
                msg = channel.recv(max(0.0, deadline - time.monotonic()))
            except (OSError, wire.ProtocolError):
                msg = {}
            names = msg.get("names")
            if msg.get("t") != "env_read" or not isinstance(names, list):
                return f"rank {rank} did not say what it read while it collected"
            self.env_read.update(name for name in names if isinstance(name, str))
        self.connected = True
        return ""

    def check(self) -> str:
        """Why this world can run no more tests ("" when it can): a rank gone, msrun ended."""
        if self.dead:
            return self.dead
        if self.launched.exited():
            self.dead = "the world's job ended between tests"
            return self.dead
        for rank, channel in self.channels.items():
            try:
                channel.sock.setblocking(False)
                try:
                    data = channel.sock.recv(1, socket.MSG_PEEK)
                finally:
                    channel.sock.setblocking(True)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self.dead = f"rank {rank} ended between tests"
                break
        return self.dead

    # ---------------------------------------------------------------- one test
    def begin(self, paths: TestPaths, nodeid: str, timeout: float, exit_timeout: float) -> Called:
        """Send the test to every rank and wait until each finished its setup and call. A rank that
        leaves meanwhile while the job goes on (an ``os._exit(0)``) ends the world within this test,
        the others finishing it as in a fresh job, so the run is complete at once."""
        # the first test's setup starts the world - or, started ahead, waits for it from its request
        started = max(self.created, self.claimed) if self.last is None else time.time()
        deadline = time.monotonic() + timeout
        msg: dict[str, Any] = {"t": "run", "nodeid": nodeid, "report_dir": str(paths.report_dir)}
        msg["shared_dir"] = str(paths.shared_dir)
        env = self.test_envs.get(nodeid, {})
        if env:
            msg["env"] = env
        if any(self.memory):
            msg["memory"] = list(self.memory)
        test = WarmTest(self, paths, nodeid, started, deadline, timeout, env, held=self.job.debug.held())
        self.last = test
        left = f"has left {nodeid.rsplit('::', 1)[-1]}'s call"
        replies, timed_out = self.exchange(
            msg, "called", deadline, release=True, released=left, failure_grace=True, held=test.held
        )
        self.shown()
        refusals = [str(r.get("why")) for r in replies.values() if r.get("t") == "unforkable"]
        absent = frozenset(rank for rank, r in replies.items() if r.get("t") in ("missing", "unforkable"))
        if absent:
            if refusals:  # no test can fork there (and ranks that could, run this one now)
                self.stop()
            return Called(test, self.job_run(test, False), absent, refusals[0] if refusals else "")
        if timed_out:
            return Called(test, self.stop_on_timeout(test, set(replies)))
        if self.lost and not self.dead:
            return Called(test, teardown(Called(test, self.job_run(test, False)), None, exit_timeout).run)
        if self.dead:
            self.stop()
        return Called(test, self.job_run(test, False))

    def exchange(
        self,
        msg: dict[str, Any] | None,
        answer: str,
        deadline: float,
        *,
        release: bool = False,
        released: str = "finished its test",
        failure_grace: bool = False,
        without: set[int] | None = None,
        held: float | None = None,
    ) -> tuple[dict[int, dict[str, Any]], bool]:
        """Send ``msg`` to every rank and collect each one's ``answer`` (or ``missing``); whether the
        deadline passed first. A rank that closes its connection, or the job ending, makes the world
        dead; a rank that leaves while msrun goes on is *lost* (the world ends after this test, the
        others finish it); so does (``failure_grace``) a failure on one rank while others are still
        at it past :data:`FAILURE_GRACE`. Time ranks spend in the debugger since ``held`` (a value of
        the debug server's :meth:`~.debugserver.DebugServer.held`; default: now) moves the deadline.
        ``release``: ranks waiting in the control plane only for ranks that already answered are
        failed at once (in a fresh job those ranks would have exited), saying they ``released``.
        ``without``: ranks not asked."""
        skip = self.lost | (without or set())
        live = {rank: channel for rank, channel in self.channels.items() if rank not in skip}
        if msg is not None:
            self._tell(msg, live.values())
        replies: dict[int, dict[str, Any]] = {}
        sel = selectors.DefaultSelector()
        for rank, channel in live.items():
            sel.register(channel.sock, selectors.EVENT_READ, rank)
        failed_at: float | None = None
        next_check: float | None = None  # set once a first rank answered
        clock = paused_clock(self.job.debug, held)
        try:
            while len(replies) + len(self.lost & set(live)) < len(live):
                # time a rank spends in the debugger counts for neither the deadline nor the grace
                now = clock()
                if now > deadline:
                    return replies, True
                if failed_at is not None and now - failed_at > FAILURE_GRACE:
                    self.dead = "a rank failed the test while others were still in it"
                    break
                if release and replies and not self.declared and next_check is None:
                    next_check = now + STUCK_FIRST_CHECK
                elif release and replies and not self.declared and next_check is not None and now >= next_check:
                    next_check = now + STUCK_CHECK
                    self.declared = release_waiters(self.job, self.ranks, set(replies), released)
                if self.launched.exited():
                    self.dead = "the world's job ended (a rank died)"
                    break
                waiting = [rank for rank in live if rank not in replies and rank not in self.lost]
                ready = [rank for rank in waiting if self.channels[rank].pending] or [
                    key.data for key, _ in sel.select(timeout=0.05)
                ]
                for rank in ready:
                    try:
                        reply = self.channels[rank].receive()
                    except (OSError, ValueError):  # a malformed frame: that rank is lost as if it left
                        reply = None
                    if reply is not None and reply.get("t") not in (answer, "missing", "unforkable"):
                        continue  # not the answer awaited (a line read ahead of it)
                    sel.unregister(self.channels[rank].sock)
                    if reply is None:  # its connection closed: the rank is gone (even with status 0)
                        self.lost.add(rank)
                        self.retire(f"rank {rank} left the world inside a test")
                        self._settle(rank)
                        if self.launched.exited():  # msrun ended the job: a failure (first-failure rule)
                            self.dead = f"rank {rank} ended inside the test"
                            break
                        continue
                    replies[rank] = reply
                    if failure_grace and reply.get("failed") and failed_at is None:
                        failed_at = clock()
                if self.dead:
                    break
        finally:
            sel.close()
        return replies, False

    def shown(self) -> None:
        """With ``-s``: wait (at most 1 s) until msrun has shown every line the ranks wrote so far (its
        tail polls their logs), so a test's lines come before its result, as a plain test's do."""
        relayed = self.launched.relayed
        if relayed is not None:
            logs = {rank: self.job.paths.log_dir / f"worker_{rank}.log" for rank in self.ranks}
            wait_until(lambda: all(relayed.get(r, 0) >= _whole_lines(str(p)) for r, p in logs.items()), 1.0)

    def await_ends(self, exit_timeout: float, absent: set[int]) -> list[int]:
        """A forking world's children ending after their test, as processes do (threads joined,
        exit handlers run): the ranks whose child did not end within ``exit_timeout`` s. A child
        that ended as a fresh job's rank would not ended its template too (the world is dead)."""
        replies, timed_out = self.exchange(None, "ended", time.monotonic() + exit_timeout, without=absent)
        self.template_rss = {r: reply["rss"] for r, reply in replies.items() if isinstance(reply.get("rss"), int)}
        for reply in replies.values():
            if reply.get("retire"):
                self.retire(str(reply["retire"]))
        if not timed_out:
            return []
        return sorted(set(self.channels) - set(replies) - self.lost - absent)

    def _settle(self, rank: int) -> None:
        """Let a rank that left the world end its process (10 s at most), and msrun record how and act on it (its
        first-failure rule stops the others, as in a fresh job) - before the world is stopped, which
        would otherwise stop that rank too and hide why it left."""
        end = self.job.rank_ends().get(rank)
        if end is not None and end.pid:
            pid = end.pid
            wait_until(lambda: not running(pid), 10.0)
        wait_until(self.launched.exited, 1.0)  # msrun reacts to an exit within milliseconds

    def stop_on_timeout(self, test: WarmTest, waiting: set[int]) -> JobRun:
        """The test ran out of time: where every rank is (control plane, stacks), then the world ends.
        ``waiting``: the ranks that had answered and waited for the controller (not stuck)."""
        self.dead = f"the test ran out of time ({test.timeout:g} s)"
        facts = self.job.at_deadline(str(test.paths.report_dir), self.ranks)  # the record, frozen now
        self.stop()
        run = self.job_run(test, True)
        ranks = {r: dataclasses.replace(end, held=True) if r in waiting else end for r, end in run.ranks.items()}
        return dataclasses.replace(run, ranks=ranks, **facts)

    def job_run(self, test: WarmTest, timed_out: bool) -> JobRun:
        """The run to judge ``test`` by: each rank's end, or - the world living on - that it lives on."""
        ends = self.job.rank_ends()
        live = not self.dead and not self.launched.exited()
        for rank, end in ends.items():
            if live and end.returncode is None and rank not in self.lost:
                ends[rank] = RankEnd(pid=end.pid, log=end.log, host=end.host, alive=True)
        reproduce = self.job.reproduce_lines(test.timeout, [test.nodeid], test.env)  # the test alone, as run here
        return self.job.outcome(self.launched, test.timeout, test.started, reproduce, timed_out=timed_out, ranks=ends)

    def ended_run(self, test: WarmTest, hung: list[int], exit_timeout: float, stacks: dict[int, str]) -> JobRun:
        """The run to judge ``test`` by once the world ended with it: ``hung``, the ranks still
        running ``exit_timeout`` s after their sessions (or forked tests) ended, with ``stacks``."""
        return dataclasses.replace(self.job_run(test, False), exit_hung=hung, exit_timeout=exit_timeout, stacks=stacks)

    # ---------------------------------------------------------------- the end
    def retire(self, why: str) -> None:
        self.retiring = self.retiring or why  # the first reason stands

    def end(self, test: WarmTest, exit_timeout: float) -> JobRun:
        """End the world after its last test, ``test``: ``quit`` (fixtures torn down, sessions end),
        every process gone within ``exit_timeout`` s - else the ranks still running and their stacks
        (then msrun's own teardown); the run to judge ``test`` by."""
        self._tell({"t": "quit"})
        clock = paused_clock(self.job.debug)  # a fixture's breakpoint() at the world's end
        deadline = clock() + exit_timeout
        while not self.launched.wait_ended(0.05) and clock() < deadline:
            pass  # (the clock pauses while a debugger holds a rank)
        ended = self.launched.ended()
        hung = [] if ended else self.job.running_ranks()
        stacks = {} if ended else self.job.collect_stacks()
        self.dead = self.dead or self.retiring or "ended"
        self._close()
        return self.ended_run(test, hung, exit_timeout, stacks)

    def stop(self) -> None:
        """End the world now: ``quit``, then msrun's own teardown (SIGTERM, its grace, SIGKILL)."""
        self._tell({"t": "quit"})
        if not self.dead:  # a world that does not end cleanly within 10 s is stopped below
            self.launched.wait_ended(10)
        self.dead = self.dead or "stopped"
        self._close()

    def _tell(self, msg: dict[str, Any], channels: Iterable[Channel] | None = None) -> None:
        for channel in self.channels.values() if channels is None else channels:
            with contextlib.suppress(OSError):
                channel.send(msg)

    def _close(self) -> None:
        self.job.stop(self.launched)
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()
        self.door.close()


def release_waiters(job: TestJob, ranks: list[int], finished: set[int], why: str) -> bool:
    """Ranks still in the test that wait - to form the group, or in a collective - only for ranks
    that finished it would wait forever (in a fresh job those ranks exit and the wait fails):
    tell the control plane, which fails those waits now. Whether it was told."""
    host, port, token = job.master_host, job.ports[0], job.token
    state = query_state(host, port, token, timeout=1.0)
    if not state:
        return False

    def waits_for_finished(present: list[int]) -> bool:  # the ranks not there all finished the test
        absent = set(ranks) - set(present)
        return bool(absent) and absent <= finished

    stuck_in_init = not state.get("ready") and waits_for_finished(state.get("joined", []))
    if not stuck_in_init and not any(waits_for_finished(c.get("ranks", [])) for c in state.get("collectives", [])):
        return False
    return declare_finished(host, port, token, sorted(finished), why, timeout=1.0)


def _whole_lines(path: str) -> int:
    """The bytes of ``path`` up to its last newline (0 where it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            start = max(0, fh.seek(0, os.SEEK_END) - 65536)
            fh.seek(start)
            tail = fh.read()
    except OSError:
        return 0
    return start + tail.rfind(b"\n") + 1  # (rfind: -1 without one)
