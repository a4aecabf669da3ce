"""``MSRUN_TRACE=<file>`` / ``--trace <file>``: this node's share of the job's timeline.

An observer of the agent's events (:class:`TraceObserver`): on msrun's lane, the launch, the
registration, the stop with its reason, the teardown; on each rank's lane, its process from spawn
to exit (status or signal), and the first failure as an instant across every lane carrying the
error and the rank. The ranks add when their Python started (the rank hook); the control plane
adds ``init()`` joins, every collective, deadlines and aborts (:mod:`pytest_msrun.control.tracelog`).

The node that runs the control plane (on one node: that node) writes the trace: its processes
append to a spool beside the trace file, merged when the job has ended. Every other node sends its
events over its control-plane link, shifted onto the control plane's clock by the offset its link
estimated (:class:`~pytest_msrun.control.tracelog.ClockOffset`).
"""

from __future__ import annotations

import os
import signal
import time

from pytest_msrun.control import tracelog
from pytest_msrun.engine import console, suppress
from pytest_msrun.engine.kinds import JobState, Role
from pytest_msrun.engine.observers import JobEvent, JobResult
from pytest_msrun.fileio import private_dir

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from pytest_msrun.engine.link import ControlLink
    from pytest_msrun.engine.policy import Ending
    from pytest_msrun.engine.processes import Child
    from pytest_msrun.engine.status import ProcessStatus

SEND_BATCH = 256  # events per message of a node that is not the writer


def _exit_args(code: int | None) -> dict[str, Any]:
    if code is not None and code < 0:
        try:
            return {"signal": signal.Signals(-code).name}
        except ValueError:
            return {"signal": -code}
    return {"exit code": code}


def _ended(result: JobResult) -> str:
    """The trace's last line: how the job ended - with what job-end reporters judged (a suite's
    tests), the processes' end said as such, and the exit status the verdict gave msrun."""
    if not result.summaries:
        return f"job ended: {result.state} ({result.exit_code})"
    own = result.exit_code if result.own_code is None else result.own_code
    ended = "processes exited 0" if result.state is JobState.SUCCEEDED and own == 0 else f"{result.state} ({own})"
    verdict = f"; msrun exits {result.exit_code}" if result.exit_code != own else ""
    return f"job ended: {ended}; {'; '.join(result.summaries)}{verdict}"


class TraceObserver:
    """Records the agent's events; :meth:`finish` writes (or ships) them when the job has ended."""

    def __init__(self, path: str, job_id: str, hostname: str, node: int = 0) -> None:
        self.path = path
        self.job_id = job_id
        self.hostname = hostname
        self.node = node
        self.writer = True  # this node runs the control plane (or is the only node)
        self.link: ControlLink | None = None
        self.outbox: list[dict[str, Any]] = []  # not the writer: events not sent yet
        self.started = time.time()
        base = os.path.basename(path)
        # an unguessable name: in a sticky directory another user cannot make it first
        spool = f".{base}.spool-{job_id[:16]}-{os.getpid()}-{os.urandom(4).hex()}"
        self.spool = os.path.join(os.path.dirname(path), spool)
        private_dir(self.spool)
        self.recorder: tracelog.Recorder | None = tracelog.Recorder(os.path.join(self.spool, "msrun.jsonl"))
        self.broken = False
        self.exited: set[int] = set()  # pids whose end is recorded
        self.ranks = tracelog.Follower(os.path.join(self.spool, tracelog.RANKS_FILE))  # shipped from here on

    # ------------------------------------------------------------------ where events go
    @property
    def child_env(self) -> dict[str, str]:
        """What every process of the job gets: its spool (ranks record when they started)."""
        return {tracelog.SPOOL_ENV: self.spool}

    def place(self, node_index: int, hosts_control_plane: bool, link: ControlLink | None) -> None:
        """This node's index is known: the writer keeps its spool, any other ships its events
        (what it recorded so far included) as they happen - the control plane ends when the
        last node is done, so nothing may wait for this node's end."""
        self.node = node_index
        self.link = link
        self.add(
            tracelog.thread(tracelog.MSRUN_PID, node_index, f"node {node_index}: {self.hostname} (pid {os.getpid()})")
        )
        if hosts_control_plane or link is None:
            return
        self.writer = False
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
        self.outbox = tracelog.read_spool(self.spool, skip=(tracelog.RANKS_FILE,)) + self.outbox
        with suppress(OSError):
            os.unlink(os.path.join(self.spool, "msrun.jsonl"))
        self.ship()

    def add(self, ev: dict[str, Any]) -> None:
        if self.writer:
            if self.recorder is not None:
                self.recorder.add(ev)
        else:
            self.outbox.append(ev)
            if len(self.outbox) >= SEND_BATCH:
                self.ship()

    def ship(self) -> None:
        """Send what is waiting (not the writer; link up), on the control plane's clock and as
        the spool's JSON lines: the control plane appends them as they are. Called when the
        workers started, when a batch is full, before this node says it is done, and at the end."""
        link = self.link
        if self.writer or link is None or not link.up:
            return
        self.outbox += self.ranks.read()  # what this node's ranks recorded since
        if not self.outbox:
            return
        events, self.outbox = tracelog.shifted(self.outbox, link.offset.offset), []
        for i in range(0, len(events), SEND_BATCH):
            link.send({"t": "trace", "lines": tracelog.encode(events[i : i + SEND_BATCH])})

    def mark(self, name: str, args: dict[str, Any] | None = None, scope: str = "t") -> None:
        self.add(tracelog.instant(name, tracelog.MSRUN_PID, self.node, time.time(), args, scope))

    # ------------------------------------------------------------------ the agent's events
    def notify(self, event: JobEvent, payload: Any) -> None:
        if self.broken:
            return
        try:
            self._notify(event, payload)
        except Exception as exc:  # a trace must never break the job it watches
            self.broken = True
            console.warning(f"Tracing stopped: {type(exc).__name__}: {exc}.")

    def _notify(self, event: JobEvent, payload: Any) -> None:
        if event is JobEvent.PROCESS_STARTED:
            child: Child = payload
            spec = child.tag
            if spec.role == Role.WORKER and spec.rank is not None:
                name = f"rank {spec.rank} ({self.hostname}, pid {child.pid})"
                for ev in tracelog.lane(tracelog.RANK_PID + spec.rank, name, 10 + spec.rank):
                    self.add(ev)
                self.add(tracelog.instant("spawn", tracelog.RANK_PID + spec.rank, 0, child.started))
            else:
                self.mark(f"started {spec.label} (pid {child.pid})")
        elif event is JobEvent.PROCESS_EXITED:
            child = payload
            rank = child.tag.rank if child.tag.role == Role.WORKER else None
            self._exited(rank, child.tag.label, child, child.terminated_by_us)
        elif event is JobEvent.SPAWNED:
            self.add(tracelog.span("launch", tracelog.MSRUN_PID, self.node, self.started, time.time()))
        elif event is JobEvent.ENDING:
            self._ending(payload)
        elif event is JobEvent.ENDED:  # what msrun's teardown stopped ended without an event
            for proc in payload.status.processes:
                rank = proc.rank if proc.role == str(Role.WORKER) else None
                self._exited(rank, proc.name, proc, proc.terminated_by_msrun)
            self.mark(_ended(payload), {"exit code": payload.exit_code})
        if event in (JobEvent.SPAWNED, JobEvent.ENDING, JobEvent.ENDED):  # exits go in batches (:meth:`ship`)
            self.ship()

    def _exited(self, rank: int | None, label: str, proc: Child | ProcessStatus, stopped: bool) -> None:
        """``proc`` ended (a child, or a process of the job's status: what the teardown stopped)."""
        pid, code = proc.pid, proc.returncode
        if pid in self.exited or code is None:
            return
        self.exited.add(pid)
        args = {**_exit_args(code), "pid": pid, "stopped by msrun": stopped}
        at = proc.ended or time.time()
        if rank is None:
            self.mark(f"{label} ended", args)
            return
        lane = tracelog.RANK_PID + rank
        self.add(tracelog.span("process", lane, 0, proc.started, at, args))
        self.add(tracelog.instant("exit", lane, 0, at, args))

    def _ending(self, ending: Ending) -> None:
        first = ending.first
        if first is not None:
            word, _, number = first.label.partition(" ")
            rank = int(number) if word == "rank" and number.isdigit() else None
            where = tracelog.RANK_PID + rank if rank is not None else tracelog.MSRUN_PID
            args: dict[str, Any] = {"rank": rank, "process": first.label, "how": first.description}
            if first.host:
                args["host"] = first.host
            if first.error is not None:
                args["error"] = first.error.headline
            tid = 0 if rank is not None else self.node
            self.add(tracelog.instant(f"first failure: {first.label}", where, tid, first.at, args, "g"))
        if ending.state is not JobState.SUCCEEDED:
            self.mark(f"stop: {ending.reason or ending.state}"[:200], {"reason": ending.reason, "code": ending.code})

    def reported(self, adders: list[Callable[[], list[dict[str, Any]]]]) -> None:
        """What job-end reporters add to the trace (a suite's tests), built now: the job is traced."""
        for add in adders:
            try:
                events = add()
            except Exception as exc:  # a reporter's trace must never break the job's
                console.warning(f"A job-end reporter's trace events failed: {type(exc).__name__}: {exc}.")
                continue
            for ev in events:
                self.add(ev)

    # ------------------------------------------------------------------ the end
    def finish(self) -> str:
        """Write the trace (the writer) or ship the rest (any other node); the spool is removed.
        Returns a line for msrun's console ("" when this node writes nothing)."""
        try:
            if not self.writer:
                self.outbox += tracelog.read_spool(self.spool, skip=(tracelog.RANKS_FILE,))
                self.outbox += self.ranks.read(final=True)
                self.ship()  # if the control plane is still there to take it
                return ""
            if self.recorder is not None:
                self.recorder.close()
                self.recorder = None
            meta = {
                "job_id": self.job_id,
                "written by": f"msrun on {self.hostname} (pid {os.getpid()})",
                "clock": "wall clock of this host, microseconds; other hosts' events shifted by their offset",
            }
            lanes = tracelog.Recorder(os.path.join(self.spool, "lanes.jsonl"))
            lanes.extend(tracelog.lane(tracelog.MSRUN_PID, "msrun", 0))
            lanes.close()
            count = tracelog.merge(self.spool, self.path, meta)
            return f"msrun: wrote the job's trace ({count} events) to {self.path}: open it in https://ui.perfetto.dev"
        except OSError as exc:
            from pytest_msrun.fsinfo import describe_write_error

            return f"msrun: could not write the trace {describe_write_error(self.path, exc, '--trace')}"
        finally:
            import shutil

            shutil.rmtree(self.spool, ignore_errors=True)
