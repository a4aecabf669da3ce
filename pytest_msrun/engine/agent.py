"""Run this node's share of a job: claim ports, plan, start, supervise, stop, report.

The rooms: ports (:mod:`.ports`), the plan (:mod:`.plan`), the processes (:mod:`.processes`),
one event loop for exits, signals and the control plane (:mod:`.loop`), the link to the control
plane (:mod:`.link`), the decisions (:mod:`.policy`) and the output (:mod:`.observers`). The
agent wires them together in one loop whose stages are registering, being assigned ranks,
starting the workers and supervising them (:meth:`Agent._drive`); how processes start
(:mod:`.starting`) and how a run ends (:mod:`.ending`) are parts of it of their own;
:mod:`.dryrun` supervises simulated ranks with the same public API.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from enum import Enum

from pytest_msrun.control import wire
from pytest_msrun.control.clock import env_seconds
from pytest_msrun.engine import console, errorfile, processes, suppress, timeline
from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.containment import JobGuard
from pytest_msrun.engine.ending import JobEnding
from pytest_msrun.engine.kinds import Role
from pytest_msrun.engine.link import ControlLink
from pytest_msrun.engine.loop import Event, EventKind
from pytest_msrun.engine.noderun import NodeRun
from pytest_msrun.engine.observers import ConsoleObserver, JobEvent, JobResult, StatusObserver
from pytest_msrun.engine.plan import LaunchPlan, NodeFacts, RankAssignment, assign, build_plan
from pytest_msrun.engine.policy import EXIT_LAUNCH_ERROR, Ending
from pytest_msrun.engine.ports import LaunchError, claim
from pytest_msrun.engine.processes import Child
from pytest_msrun.engine.starting import Starter, collect_from_now
from pytest_msrun.engine.status import STATUS_FILE, node_status_file
from pytest_msrun.record import replace

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

REGISTER_RETRY = 0.2  # s between two attempts to reach the control plane


class Stage(Enum):
    """Where one node's run is; the stages of :meth:`Agent._drive`'s loop."""

    REGISTERING = "registering"  # joining the control plane
    ASSIGNING = "assigning"  # waiting for the ranks the control plane gives this node
    STARTING = "starting"  # starting this node's workers, a slice per turn
    SUPERVISING = "supervising"  # until the policy says the job ended


class Agent:
    """Runs one node's processes for one job; :meth:`run` returns its :class:`JobResult`. It
    owns the run's state (:class:`NodeRun`) and two parts that act on it: starting processes
    (:class:`Starter`) and ending the run (:class:`JobEnding`)."""

    def __init__(
        self,
        cfg: LaunchConfig,
        facts: NodeFacts,
        *,
        guard: JobGuard,
        detached: bool = False,
        on_console_done: Callable[[int], None] | None = None,
    ) -> None:
        self.node = node = NodeRun(cfg, facts, guard, detached)
        self.starter = Starter(node, self._ranks_known)
        self.ending = JobEnding(node, on_console_done)
        self.unsaid: list[tuple[dict[str, Any], bool]] = []  # for the control plane, before registering
        self.stage = Stage.STARTING
        self._register_by = 0.0  # when registering gives up (--cluster_time_out)
        self._contested = False  # the scheduler's port was taken here when this node started
        self.node_timeout = env_seconds(dict(os.environ), "MS_NODE_TIMEOUT", 30.0, allow_negative=True)
        self.status_name: str | None = STATUS_FILE if not cfg.multi_node else None
        node.observers += [
            ConsoleObserver(cfg.log_dir, cfg.join, detached),
            StatusObserver(cfg.log_dir, lambda: self.status_name, self.ending.snapshot),
        ]
        if cfg.trace:
            from pytest_msrun.engine.trace import TraceObserver  # (shutil & co.) only when traced

            node.trace = TraceObserver(cfg.trace, facts.job_id, facts.hostname, max(0, cfg.node_rank))
            node.observers.append(node.trace)

    # ------------------------------------------------------------------ the run
    def run(self) -> JobResult:
        with self.node.loop:
            try:
                return self._run()
            except LaunchError as exc:  # a port or the log directory: nothing was started
                return self.ending.launch_error(str(exc), exc.exit_code)
            except OSError as exc:  # a process could not be started: what did start is stopped
                what = f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc)
                return self.ending.launch_error(f"cannot start the job's processes: {what}", EXIT_LAUNCH_ERROR)
            except BaseException:
                self.ending.teardown(graceful=False)  # nothing the job started outlives an error here
                raise
            finally:
                self.node.guard.release()

    def _run(self) -> JobResult:
        processes.become_subreaper()
        processes.close_inherited_descriptors()  # children get only what is handed to them
        ports = claim(self.node.cfg, self.node.facts)
        self.node.facts = ports.facts
        self._contested = ports.contested
        plan = build_plan(self.node.cfg, self.node.facts, hosts_scheduler=ports.hosts_scheduler)
        self.node.plan = plan
        for text in plan.warnings:
            console.warning(text)
        for text in plan.infos:
            console.info(text)
        signum = self.node.loop.signal_received  # one that came while msrun started (held till now)
        if signum is not None:  # ends with 128 + signum, as every launch error a signal caused
            return self.ending.ended_by(
                f"interrupted by {signal.Signals(signum).name} before the job started: nothing was started"
            )
        self.starter.make_log_dir()
        first = self.starter.start_first(plan, ports.listener)
        if plan.scheduler is not None:
            self.starter.start_scheduler(plan.scheduler, ports.listener)
        self.starter.announce_first()
        return self._drive(plan, ranks_said=first)

    def _drive(self, plan: LaunchPlan, ranks_said: bool = False) -> JobResult:
        """Registration, assignment, starting and supervision as the stages of one loop.

        Every turn, whatever the stage: a signal is acted on, the heartbeat is sent, the stage
        takes one bounded step (one connection attempt, :data:`SPAWN_SLICE` s of spawning, one
        look at the job's state) and every event is served, as the stage reached reads it (an
        assignment may arrive in the turn the node registered) - so a node starting 128 workers on a
        busy machine still heartbeats and hears of a failure. The order of stages: with ranks the
        control plane assigns (several nodes, no ``--node_rank``), register, be assigned, start,
        supervise; else start, register while the workers start up (their connections wait in
        the listener), supervise.
        """
        stage = Stage.REGISTERING if plan.layout.pending else Stage.STARTING
        if stage is Stage.STARTING:
            if not ranks_said:
                self._ranks_known(plan)
            if plan.config.dry_run:
                from pytest_msrun.engine.dryrun import DryRunSupervisor

                collect_from_now()
                return DryRunSupervisor(self, plan).run()
        self.stage = stage
        started = {id(c.tag) for c in self.node.group.children}  # held workers started already
        todo = [spec for spec in plan.workers if id(spec) not in started]
        while True:
            stage = self.stage
            scheduler = self.starter.scheduler_child
            outcome = self._interrupted(stage) or self._heartbeat(stage)
            wait: float | None = 0.0  # a stage that moved on, or is starting workers, does not wait
            if outcome is not None:
                pass
            elif stage is Stage.REGISTERING:
                outcome = self._register(plan)
                plan = self.node.plan or plan  # this node may have become the scheduler's host
                if self.stage is stage:
                    wait = REGISTER_RETRY
            elif stage is Stage.ASSIGNING:
                if self.node.assignment is None:
                    wait = self.node.link.hb_interval if self.node.link is not None else REGISTER_RETRY
                else:
                    plan = self.node.plan = assign(plan, self.node.assignment, self.node.facts.job_id)
                    self._ranks_known(plan)
                    todo = list(plan.workers)
                    self.stage = Stage.STARTING
            elif stage is Stage.STARTING:
                if not self.starter.start_slice(todo):
                    self.starter.spawned(plan)
                    if plan.scheduler_mode.has_control_plane and self.node.link is None:
                        self.stage = Stage.REGISTERING
                    else:
                        self._supervising()
            else:
                outcome = self._supervision_step()
                if outcome is None:
                    link = self.node.link
                    wait = link.hb_interval if link is not None and link.up else None
                    watch = self.node.deadlines.wait() if self.node.deadlines is not None else None
                    held = self.node.policy.held_until
                    held_for = None if held is None else max(0.0, held - time.time())
                    wait = min((w for w in (wait, watch, held_for) if w is not None), default=None)
            if outcome is None:
                for event in self.node.loop.poll(wait):
                    if event.kind is EventKind.SIGNALLED:
                        break  # acted on at the top of the next turn, in the stage it came in
                    outcome = self._serve(event, self.stage, scheduler)  # as the stage it reached reads it
                    if outcome is not None:
                        break
            if outcome is not None:
                if self.stage is Stage.STARTING:
                    self.starter.spawned(plan)  # msrun's "spawned" line, the status file, the tailer
                return self.ending.ended_by(outcome)

    def _interrupted(self, stage: Stage) -> str | Ending | None:
        """A signal to msrun: a launch error while no worker runs yet, else the job's ending."""
        signum = self.node.loop.signal_received
        if signum is None:
            return None
        if stage in (Stage.REGISTERING, Stage.ASSIGNING) and not self.starter.workers_started:
            waiting = "the scheduler" if stage is Stage.REGISTERING else "the other nodes"
            return f"interrupted by {signal.Signals(signum).name} while waiting for {waiting}"
        return self.node.policy.signalled(signum)

    def _heartbeat(self, stage: Stage) -> str | Ending | None:
        link = self.node.link
        if link is None or not link.up or (stage is Stage.SUPERVISING and link.finished):
            return None
        silent = link.beat()
        if not silent or not self.starter.workers_started:
            return silent or None
        return self.node.policy.lost(f"Lost the scheduler: {silent}.")

    def _serve(self, event: Event, stage: Stage, scheduler: Child | None) -> str | Ending | None:
        """One event, read as its stage reads it: before any worker runs, the scheduler's exit or
        its closed connection is a launch error and its messages may carry the assignment."""
        early = stage in (Stage.REGISTERING, Stage.ASSIGNING) and not self.starter.workers_started
        if early and event.kind is EventKind.EXITED and event.child is not None:
            return _scheduler_ended(event.child.returncode or 0)
        if stage is Stage.ASSIGNING:
            if event.kind is EventKind.LINK_CLOSED:
                # its connection closes as it dies, a moment before its exit can be seen
                code = scheduler.peek_end(timeout=1.0) if scheduler is not None else None
                if code is not None:
                    return _scheduler_ended(code)
                return f"the scheduler closed the connection ({event.reason})"
            if event.kind is EventKind.MESSAGE:
                return self._assignment(event.message)
        return self._on_event(event, scheduler)

    def _ranks_known(self, plan: LaunchPlan) -> None:
        """This node's ranks are known: its status file is named, its trace placed."""
        if self.status_name is None:  # a node of a multi-node job, named by its index once known
            index = self.node.assignment.node_index if self.node.assignment else self.node.cfg.node_rank
            self.status_name = (
                node_status_file(index) if index >= 0 else f"msrun_status_{self.node.facts.hostname}.json"
            )
        self._place_trace(plan)

    def _supervising(self) -> None:
        self.stage = Stage.SUPERVISING
        if self.node.several_nodes:
            self.node.policy.host = self.node.facts.hostname
        self.ending.console_done(0)

    def _place_trace(self, plan: LaunchPlan) -> None:
        """Where this node's trace events go, once the link (if any) is up."""
        if self.node.trace is not None and (self.node.link is not None or not plan.layout.pending):
            index = self.node.assignment.node_index if self.node.assignment else max(0, self.node.cfg.node_rank)
            self.node.trace.place(index, plan.scheduler is not None, self.node.link)

    # ------------------------------------------------------------------ the control plane
    def _register(self, plan: LaunchPlan) -> str | None:
        """The registering stage's step: one attempt to join the control plane (over the
        socketpair when msrun forked it: at once). None when joined or to be retried, else why
        this node cannot join."""
        cfg = self.node.cfg
        if self.node.link is None:
            facts = self.node.facts
            self.node.link = ControlLink(facts.master_ip, facts.master_port, facts.job_token, self.node_timeout)
            self._register_by = time.monotonic() + (cfg.cluster_time_out if cfg.cluster_time_out >= 0 else 10**9)
        link = self.node.link
        hello = {
            "t": "hello",
            "kind": "agent",
            "node_rank": cfg.node_rank if cfg.multi_node else 0,
            "local": plan.layout.local,
            "host": self.node.facts.hostname,
            "ip": self.node.facts.source_ip,
            "pid": os.getpid(),
            "hosts_scheduler": plan.hosts_scheduler,
        }
        scheduler = self.starter.scheduler_child
        if self.node.control_sock is not None and scheduler is not None:
            link.adopt(self.node.control_sock, hello, scheduler.pid)
            self.node.control_sock = None
        else:
            try:
                last = link.try_register(hello, max(0.2, min(5.0, self._register_by - time.monotonic())))
            except wire.AuthError as exc:
                return f"the scheduler at {link.where} refused this node: {exc}"
            if last:
                if time.monotonic() >= self._register_by:
                    within = f"--cluster_time_out={cfg.cluster_time_out}"
                    return f"cannot reach the scheduler at {link.where} within {within}: {last}"
                if self._contested and scheduler is None:  # perhaps no node of this host hosts it
                    self.node.plan = self.starter.host_if_free(plan)
                return None
        self.node.loop.attach(link)
        timeline.mark("registered with the control plane")
        for msg, defer in self.unsaid:  # a worker that ended before this node registered
            self._tell(msg, defer)
        self.unsaid = []
        if plan.layout.pending:  # the control plane places this node's workers next
            if self.node.detached:
                self.ending.console_done(0)
            self.stage = Stage.ASSIGNING
        else:
            self._place_trace(plan)
            self._supervising()
        return None

    def _assignment(self, msg: dict[str, Any]) -> str | None:
        if self._told(msg):
            return None
        if msg.get("t") != "assign":
            ending = self.node.policy.message(msg)
            return ending.reason if ending is not None else None
        offset, index, count = msg.get("offset"), msg.get("node_index"), msg.get("node_count")
        if not (isinstance(offset, int) and isinstance(index, int) and isinstance(count, int)):
            return "the scheduler sent a malformed assignment"
        self.node.assignment = RankAssignment(offset, index, count)
        job_id = msg.get("job_id")
        if isinstance(job_id, str) and job_id:
            self.node.facts = replace(self.node.facts, job_id=job_id[:64])
        return None

    # ------------------------------------------------------------------ supervision
    def _supervision_step(self) -> Ending | None:
        """The supervising stage's step: this node's ``done`` once its workers succeeded, and the
        job's success once the policy sees it (the first failure, a signal or a lost link end it
        through events)."""
        link = self.node.link
        workers = [c for c in self.node.group.children if c.tag.role == Role.WORKER]
        scheduler = self.starter.scheduler_child
        if self.node.policy.workers_done(workers) and link is not None:
            if self.node.trace is not None:
                self.node.trace.ship()  # this node's events reach the trace before its "done"
            link.send_done()
        held = self.node.policy.held_until
        if held is not None and time.time() >= held:  # a worker that left first did not end in time
            return self.node.policy.first_failure()
        deadlines = self.node.deadlines
        late = deadlines.late(c.tag.rank for c in workers if c.returncode is None) if deadlines else None
        if late is None:
            return self.node.policy.finished(workers, scheduler, link is None or link.finished)
        # A worker is still there after the deadline it set: its stacks (the signal it named), then
        # the job ends, that worker its root cause.
        child = next(c for c in workers if c.pid == late.pid)
        from pytest_msrun.engine import ranknotes
        from pytest_msrun.proc import stopped

        late.stopped = stopped(child.pid)
        if late.stack_signal:
            with suppress(OSError):
                os.kill(child.pid, late.stack_signal)  # the rank alone: its own children may not catch it
                time.sleep(ranknotes.STACK_WAIT)
        return self.node.policy.past_deadline(child, late)

    def _on_event(self, event: Event, scheduler: Child | None) -> Ending | None:
        """Every event of a running job, dispatched in one place."""
        if event.kind is EventKind.EXITED and event.child is not None:
            child, spec = event.child, event.child.tag
            timeline.mark(f"{spec.label} ended ({child.returncode})")
            self.node.emit(JobEvent.PROCESS_EXITED, child)
            if spec.role == Role.WORKER and spec.rank is not None:
                # Peers blocked in init() or a collective must not wait for a rank that is gone.
                note = {"t": "exit", "rank": spec.rank, "how": processes.describe_returncode(child.returncode or 0)}
                self._tell(note, defer=child.returncode != 0)
            error = errorfile.read_error(spec.error_file) if child.returncode else None
            settled = ""
            if spec.role == Role.WORKER and spec.rank is not None and child.returncode:
                from pytest_msrun.engine.ranknotes import settled_status

                settled = settled_status(self.node.cfg.log_dir, spec.rank, child.pid, child.returncode or 0) or ""
            ending = self.node.policy.exited(child, error, settled)
            if ending is not None and ending.first is not None:
                self._tell({"t": "failed", "reason": ending.reason, "code": min(255, ending.code)}, defer=True)
            return ending
        if event.kind is EventKind.MESSAGE:
            if self._told(event.message):
                return None
            return self.node.policy.message(event.message)
        if event.kind is EventKind.LINK_CLOSED:
            if (self.node.link is None or not self.node.link.done_sent_at) and scheduler is None:
                return self.node.policy.lost(f"Lost the connection to the scheduler ({event.reason}).")
            if self.node.link is not None:
                self.node.link.close()
        return None

    def _tell(self, msg: dict[str, Any], defer: bool) -> None:
        """Say ``msg`` to the control plane (``defer``: once this node's processes are signalled).
        Before this node registered - its workers start first - it is said at registration."""
        if self.node.link is not None and self.node.link.joined:
            (self.node.link.defer if defer else self.node.link.send)(msg)
        elif self.node.plan is not None and self.node.plan.scheduler_mode.has_control_plane:
            self.unsaid.append((msg, defer))

    def _told(self, msg: dict[str, Any]) -> bool:
        """A message for the console, not the policy: a notice, progress. Whether it was one."""
        kind = msg.get("t")
        if kind == "notice":  # to every node (a dropped connection, a refused node): said, and kept in the status
            text = str(msg.get("text", ""))[:2000]
            if text and len(self.node.notices) < 100:
                self.node.notices.append(text)
                console.warning(f"Control plane: {text}")
                if self.node.trace is not None:
                    self.node.trace.mark(text[:200], {"notice": text})
        elif kind == "vouch":  # is a MindSpore-protocol client of this node one of this job's processes?
            from pytest_msrun.control.foreign import vouch

            if self.node.link is not None:
                self.node.link.send(vouch(msg, os.getpid()))
        elif kind == "left":  # a rank of this node left the control plane: its process is ending
            workers = (c for c in self.node.group.children if c.tag.role == Role.WORKER)
            child = next((c for c in workers if c.tag.rank == msg.get("rank")), None)
            if child is not None and child.alive:
                self.node.policy.departed[child.pid] = child.tag.label
        elif kind == "progress":
            if msg.get("done"):
                self.node.status_line.clear()
            else:
                self.node.status_line.show(str(msg.get("text", ""))[:200])
        else:
            return False
        return True


def _scheduler_ended(returncode: int) -> str:
    how = processes.describe_returncode(returncode)
    return f"the scheduler process {'was ' if returncode < 0 else ''}{how} before this node was assigned its ranks"
