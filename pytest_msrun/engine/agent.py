"""Run this node's share of a job: claim ports, plan, start, supervise, stop, report.

The rooms: ports (:mod:`.ports`), the plan (:mod:`.plan`), the processes (:mod:`.processes`),
one event loop for exits, signals and the control plane (:mod:`.loop`), the link to the control
plane (:mod:`.link`), the decisions (:mod:`.policy`) and the output (:mod:`.observers`). The
agent wires them together in one loop whose stages are registering, being assigned ranks,
starting the workers and supervising them (:meth:`Agent._drive`); :mod:`.dryrun` supervises
simulated ranks with the same public API.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from enum import Enum

from pytest_msrun.control import wire
from pytest_msrun.control.clock import env_seconds
from pytest_msrun.engine import console, errorfile, processes, ranknotes, timeline
from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.containment import JobGuard
from pytest_msrun.engine.kinds import JobState, Role
from pytest_msrun.engine.link import ControlLink
from pytest_msrun.engine.loop import Event, EventKind, EventLoop
from pytest_msrun.engine.observers import (
    BindingsObserver,
    ConsoleObserver,
    JobEvent,
    JobResult,
    ReporterObserver,
    StatusObserver,
)
from pytest_msrun.engine.plan import (
    SCHEDULER_MODULE,
    LaunchPlan,
    NodeFacts,
    ProcessSpec,
    RankAssignment,
    assign,
    build_plan,
)
from pytest_msrun.engine.policy import EXIT_LAUNCH_ERROR, Ending, Policy
from pytest_msrun.engine.ports import EXIT_USAGE, LaunchError, claim
from pytest_msrun.engine.processes import Child, Launch, ProcessGroup
from pytest_msrun.engine.progress import StatusLine
from pytest_msrun.engine.status import STATUS_FILE, JobStatus, ProcessStatus, node_status_file
from pytest_msrun.engine.tail import LogTailer, prefix_for
from pytest_msrun.record import replace

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from pytest_msrun.engine.earlystart import FirstStarted
    from pytest_msrun.engine.observers import Observer
    from pytest_msrun.engine.trace import TraceObserver

__all__ = ["Agent", "JobResult"]

SPAWN_SLICE = 0.05  # s of starting workers between two turns of the event loop
REGISTER_RETRY = 0.2  # s between two attempts to reach the control plane


class Stage(Enum):
    """Where one node's run is; the stages of :meth:`Agent._drive`'s loop."""

    REGISTERING = "registering"  # joining the control plane
    ASSIGNING = "assigning"  # waiting for the ranks the control plane gives this node
    STARTING = "starting"  # starting this node's workers, a slice per turn
    SUPERVISING = "supervising"  # until the policy says the job ended


class Agent:
    """Runs one node's processes for one job; :meth:`run` returns its :class:`JobResult`."""

    def __init__(
        self,
        cfg: LaunchConfig,
        facts: NodeFacts,
        *,
        detached: bool = False,
        on_console_done: Callable[[int], None] | None = None,
        guard: JobGuard | None = None,
    ) -> None:
        self.cfg = cfg
        self.facts = facts
        self.detached = detached
        self.on_console_done = on_console_done
        # The watchdog and the job's cgroup: nothing the job starts outlives it (see containment).
        self.guard = guard if guard is not None else JobGuard(facts.job_id, dict(os.environ))
        self.loop = EventLoop()
        self.group = ProcessGroup(self.loop, self.guard)
        self.plan: LaunchPlan | None = None
        self.link: ControlLink | None = None
        self.assignment: RankAssignment | None = None
        self.control_sock: Any = None  # this end of a socketpair to the control plane we forked
        self.first: FirstStarted | None = None  # workers started before the control plane
        self.unsaid: list[tuple[dict[str, Any], bool]] = []  # for the control plane, before registering
        self.stage = Stage.STARTING
        self._register_by = 0.0  # when registering gives up (--cluster_time_out)
        self._spawn_said = False
        self.policy = Policy()
        self.deadlines: ranknotes.DeadlineWatch | None = None  # the workers' own deadlines, watched
        self.tailer: LogTailer | None = None
        self.term_grace = processes.term_grace()
        self.node_timeout = env_seconds(dict(os.environ), "MS_NODE_TIMEOUT", 30.0, allow_negative=True)
        self.started = time.time()
        self.status_name: str | None = STATUS_FILE if not cfg.multi_node else None
        self.observers: list[Observer] = [
            ConsoleObserver(cfg.log_dir, cfg.join, detached),
            StatusObserver(cfg.log_dir, lambda: self.status_name, self.snapshot),
        ]
        if cfg.join and not detached:
            self.observers.append(ReporterObserver())
        self.notices: list[str] = []  # what the control plane said to every node
        self.status_line = StatusLine(enabled=None if cfg.join and not detached else False)
        self.trace: TraceObserver | None = None
        if cfg.trace:
            from pytest_msrun.engine.trace import TraceObserver  # (shutil & co.) only when traced

            self.trace = TraceObserver(cfg.trace, facts.job_id, facts.hostname, max(0, cfg.node_rank))
            self.observers.append(self.trace)

    # ------------------------------------------------------------------ public API (also for dryrun)
    def emit(self, event: JobEvent, payload: Any = None) -> None:
        for observer in self.observers:
            observer.notify(event, payload)

    def start(
        self,
        spec: ProcessSpec,
        extra_env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        call: str = "",
        *,
        held: bool = False,
        announce: bool = True,
    ) -> Child:
        """Start one process of the plan (``call``: in a fork of msrun, see :meth:`_forkable`;
        ``held``: before msrun is in the job's cgroup; ``announce=False`` or ``held``: its line
        comes later - see :meth:`_start_first`)."""
        if spec.error_file:
            errorfile.clear(spec.error_file)
        if spec.role == Role.WORKER and spec.rank is not None:
            ranknotes.clear(self.cfg.log_dir, [spec.rank])  # an earlier job's, in the same log directory
        trace_env = self.trace.child_env if self.trace is not None else {}
        launch = Launch(
            argv=spec.command,
            env={**spec.env, **trace_env, **(extra_env or {})},
            log_path=spec.log_path,
            stdin_devnull=spec.role == Role.SCHEDULER or self.detached,
            pass_fds=pass_fds,
            in_child_cpus=spec.in_child_cpus,
            call=call,
        )
        child = self.group.start(launch, spec, held=held)
        timeline.mark(f"started {spec.label}")
        if announce and not held:
            self.emit(JobEvent.PROCESS_STARTED, child)
        return child

    def _forkable(self, spec: ProcessSpec) -> bool:
        """The builtin control plane runs in a fork of msrun (its code is already imported here)
        rather than a second interpreter: ready ~20 ms sooner, and that much less CPU taken from
        the workers starting beside it. Not when a binding wraps it in a command (numactl), the
        interpreter differs, or (checked at the fork) a thread runs here: a fork copies only the
        calling thread."""
        return (
            spec.role == Role.SCHEDULER
            and not spec.bind_prefix
            and spec.argv[1:] == ["-S", "-m", SCHEDULER_MODULE]
            and os.path.realpath(spec.argv[0]) == os.path.realpath(sys.executable)
        )

    def console_done(self, code: int) -> None:
        """The caller's console is no longer needed (``--join=False``: msrun returns now)."""
        if self.on_console_done is not None:
            callback, self.on_console_done = self.on_console_done, None
            callback(code)

    def conclude(self, ending: Ending, extra: dict[str, Any] | None = None) -> JobResult:
        """Stop everything this node started, then report how the job ended."""
        graceful = ending.state is JobState.SUCCEEDED
        self.status_line.clear()
        timeline.mark(f"ending: {ending.state}")
        self.emit(JobEvent.ENDING, ending)
        self.teardown(graceful)
        timeline.mark("torn down")
        if self.tailer is not None:
            self.tailer.stop()
            self.tailer = None
        terminated = [c.tag.label for c in self.group.children if c.terminated_by_us]
        result = JobResult(ending.code, ending.state, self.policy.reported(), terminated)
        result.status = self.snapshot(ending.state, ending.code, extra, ending.reason)
        if self.cfg.join and not self.detached:
            self._job_end_reports(result)
        self.emit(JobEvent.ENDED, result)
        timeline.mark("reported")
        self._finish_trace()
        if self.link is not None:
            self.link.close()
        return result

    def _finish_trace(self) -> None:
        if self.trace is not None:
            line = self.trace.finish()
            if line:
                console.err_block(line)
            self.trace = None

    def _job_end_reports(self, result: JobResult) -> None:
        """What the job's reporters say; the first verdict one gives is the job's exit status."""
        from pytest_msrun.engine.hooks import run_job_end

        assert result.status is not None
        reports = run_job_end(result.status)
        result.reports = [r.text for r in reports]
        verdict = next((r.exit_code for r in reports if r.exit_code is not None), None)
        if verdict is not None and verdict != result.exit_code:
            result.exit_code = result.status.exit_code = verdict

    def snapshot(
        self, state: JobState, code: int | None, extra: dict[str, Any] | None = None, reason: str = ""
    ) -> JobStatus:
        plan = self.plan
        return JobStatus(
            job_id=self.facts.job_id,
            state=str(state),
            exit_code=code,
            supervisor_pid=os.getpid(),
            host=self.facts.hostname,
            join=self.cfg.join,
            started=self.started,
            node_index=self.assignment.node_index if self.assignment else 0,
            log_dir=self.cfg.log_dir,
            processes=[
                ProcessStatus(
                    name=c.tag.name,
                    role=str(c.tag.role),
                    rank=c.tag.rank,
                    pid=c.pid,
                    log=os.path.abspath(c.tag.log_path),
                    returncode=c.returncode,
                    started=c.started,
                    ended=c.ended,
                    terminated_by_msrun=c.terminated_by_us,
                    settled=self.policy.settled[c.pid].description if c.pid in self.policy.settled else "",
                    late=self.policy.late[c.pid].to_json() if c.pid in self.policy.late else None,
                )
                for c in self.group.children
            ],
            failures=[f.to_json() for f in sorted(self.policy.reported(), key=lambda f: f.at)],
            stop_reason=reason,
            containment=self.guard.describe(),
            notices=list(self.notices),
            worker_num=plan.worker_num if plan is not None else None,
            scheduler_mode=str(plan.scheduler_mode) if plan is not None else None,
            extra=dict(extra or {}),
        )

    # ------------------------------------------------------------------ the run
    def run(self) -> JobResult:
        with self.loop:
            try:
                return self._run()
            except OSError as exc:  # a process could not be started: what did start is stopped
                what = f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc)
                return self._launch_error(f"cannot start the job's processes: {what}", EXIT_LAUNCH_ERROR)
            except BaseException:
                self.teardown(graceful=False)  # nothing the job started outlives an error here
                raise
            finally:
                self.guard.release()

    def _run(self) -> JobResult:
        processes.become_subreaper()
        processes.close_inherited_descriptors()  # children get only what is handed to them
        try:
            ports = claim(self.cfg, self.facts)
        except LaunchError as exc:
            return self._launch_error(str(exc), exc.exit_code)
        self.facts = ports.facts
        plan = build_plan(self.cfg, self.facts, hosts_scheduler=ports.hosts_scheduler)
        self.plan = plan
        for text in plan.warnings:
            console.warning(text)
        for text in plan.infos:
            console.info(text)
        signum = self.loop.signal_received  # one that came while msrun started (held till now)
        if signum is not None:  # ends with 128 + signum, as every launch error a signal caused
            return self._ended_by(
                f"interrupted by {signal.Signals(signum).name} before the job started: nothing was started"
            )
        try:
            self._make_log_dir()
        except LaunchError as exc:
            return self._launch_error(str(exc), exc.exit_code)
        first = self._start_first(plan, ports.listener)
        if plan.scheduler is not None:
            self._start_scheduler(plan.scheduler, ports.listener)
        self._announce_first()
        return self._drive(plan, ranks_said=first)

    def _start_first(self, plan: LaunchPlan, listener: Any) -> bool:
        """Start workers before the control plane, for up to :data:`SPAWN_SLICE` s, so that their
        interpreters start up while msrun still prepares the control plane (announced after it,
        in msrun's order of lines: :meth:`_announce_first`). Only when the ranks are known and the
        control plane is msrun's own, on a port msrun already listens on (a worker that connects
        first waits in the listener's queue). While msrun still waits to be inside the job's
        cgroup, only workers that can be held until then (Python ones: :mod:`.earlystart`), only
        during the wait. Whether any started."""
        scheduler = plan.scheduler
        if (
            scheduler is None
            or listener is None
            or scheduler.argv[1:] != ["-S", "-m", SCHEDULER_MODULE]
            or plan.ranks_pending
            or plan.dry_run
            or not plan.workers
        ):
            return False
        entering = self.guard.entering
        waiting = entering is not None and entering.done.locked()
        if waiting and not self._holdable(plan.workers[0]):
            return False
        from pytest_msrun.engine.earlystart import FirstStarted

        self._ranks_known(plan)  # before any of them starts
        first = self.first = FirstStarted(held=waiting)
        until = time.monotonic() + SPAWN_SLICE
        try:
            for spec in plan.workers:
                if self.loop.signal_received is not None or time.monotonic() >= until:
                    break
                if not waiting:
                    first.children.append(self.start(spec, announce=False))
                elif entering is not None and entering.done.locked():
                    first.children.append(self.start(spec, first.env(), (first.read_fd,), held=True))
                else:
                    break
        finally:
            first.spawned()
        return True

    def _holdable(self, spec: ProcessSpec) -> bool:
        """Whether every worker of the plan (they share ``spec``'s command) can start held."""
        from pytest_msrun.engine.earlystart import holdable

        if spec.role != Role.WORKER or not spec.error_file or spec.bind_prefix:
            return False
        return holdable(spec.argv, spec.env)

    def _move_held_in(self) -> None:
        """Move the held workers into the job's cgroup, which msrun is inside (:meth:`JobGuard.ready`);
        any that cannot be moved is killed, still held: it ends as a worker killed by SIGKILL."""
        first = self.first
        cgroup = self.guard.ready()
        if first is None or not first.held or first.moved or cgroup is None:
            return
        for child, why in first.move_in(cgroup.procs_file):
            console.warning(f"could not move {child.tag.label} into the job's {cgroup.describe()}: {why}")
            child.signal(signal.SIGKILL)

    def _announce_first(self) -> None:
        """The workers started first run on (held ones moved in, then let go) and are announced:
        after the scheduler, in msrun's order of lines."""
        first = self.first
        if first is None:
            return
        self._move_held_in()
        self.first = None
        first.let_go()
        scheduler = self.scheduler_child
        if scheduler is not None:  # listed (status, summary) in msrun's order too
            self.group.put_first(scheduler)
        for child in first.children:
            self.emit(JobEvent.PROCESS_STARTED, child)

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
        stage = Stage.REGISTERING if plan.ranks_pending else Stage.STARTING
        if stage is Stage.STARTING:
            if not ranks_said:
                self._ranks_known(plan)
            if plan.dry_run:
                return self._dry_run(plan)
        self.stage = stage
        started = {id(c.tag) for c in self.group.children}  # held workers started already
        todo = [spec for spec in plan.workers if id(spec) not in started]
        while True:
            stage = self.stage
            scheduler = self.scheduler_child
            outcome = self._interrupted(stage)
            if outcome is None:
                outcome = self._heartbeat(stage)
            wait: float | None = 0.0  # a stage that moved on, or is starting workers, does not wait
            if outcome is not None:
                pass
            elif stage is Stage.REGISTERING:
                outcome = self._register(plan)
                if self.stage is stage:
                    wait = REGISTER_RETRY
            elif stage is Stage.ASSIGNING:
                if self.assignment is None:
                    wait = self.link.hb_interval if self.link is not None else REGISTER_RETRY
                else:
                    plan = self.plan = assign(plan, self.assignment, self.facts.job_id)
                    self._ranks_known(plan)
                    if plan.dry_run:
                        return self._dry_run(plan)
                    todo = list(plan.workers)
                    self.stage = Stage.STARTING
            elif stage is Stage.STARTING:
                if not self._start_slice(todo):
                    self._spawned(plan)
                    self._next_after_start(plan)
            else:
                outcome = self._supervision_step()
                if outcome is None:
                    link = self.link
                    wait = link.hb_interval if link is not None and link.up else None
                    watch = self.deadlines.wait() if self.deadlines is not None else None
                    if watch is not None:
                        wait = watch if wait is None else min(wait, watch)
            if outcome is None:
                for event in self.loop.poll(wait):
                    if event.kind is EventKind.SIGNALLED:
                        break  # acted on at the top of the next turn, in the stage it came in
                    outcome = self._serve(event, self.stage, scheduler)  # as the stage it reached reads it
                    if outcome is not None:
                        break
            if outcome is not None:
                if self.stage is Stage.STARTING:
                    self._spawned(plan)  # msrun's "spawned" line, the status file, the tailer
                return self._ended_by(outcome)

    def _interrupted(self, stage: Stage) -> str | Ending | None:
        """A signal to msrun: a launch error while no worker runs yet, else the job's ending."""
        signum = self.loop.signal_received
        if signum is None:
            return None
        if stage in (Stage.REGISTERING, Stage.ASSIGNING) and not self.workers_started:
            waiting = "the scheduler" if stage is Stage.REGISTERING else "the other nodes"
            return f"interrupted by {signal.Signals(signum).name} while waiting for {waiting}"
        return self.policy.signalled(signum)

    def _heartbeat(self, stage: Stage) -> str | Ending | None:
        link = self.link
        if link is None or not link.up or (stage is Stage.SUPERVISING and link.finished):
            return None
        silent = link.beat()
        if not silent:
            return None
        if not self.workers_started:
            return silent
        return self.policy.lost(f"Lost the scheduler: {silent}.")

    def _serve(self, event: Event, stage: Stage, scheduler: Child | None) -> str | Ending | None:
        """One event, read as its stage reads it: before any worker runs, the scheduler's exit or
        its closed connection is a launch error and its messages may carry the assignment."""
        early = stage in (Stage.REGISTERING, Stage.ASSIGNING) and not self.workers_started
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
            index = self.assignment.node_index if self.assignment else self.cfg.node_rank
            self.status_name = node_status_file(index) if index >= 0 else f"msrun_status_{self.facts.hostname}.json"
        self._place_trace(plan)

    def _dry_run(self, plan: LaunchPlan) -> JobResult:
        from pytest_msrun.engine.dryrun import DryRunSupervisor

        _collect_from_now()
        return DryRunSupervisor(self, plan).run()

    def _next_after_start(self, plan: LaunchPlan) -> None:
        if plan.scheduler_mode.has_control_plane and self.link is None:
            self.stage = Stage.REGISTERING
        else:
            self._supervising()

    def _supervising(self) -> None:
        self.stage = Stage.SUPERVISING
        if self.several_nodes:
            self.policy.host = self.facts.hostname
        self.console_done(0)

    def _place_trace(self, plan: LaunchPlan) -> None:
        """Where this node's trace events go, once the link (if any) is up."""
        if self.trace is not None and (self.link is not None or not plan.ranks_pending):
            index = self.assignment.node_index if self.assignment else max(0, self.cfg.node_rank)
            self.trace.place(index, plan.scheduler is not None, self.link)

    @property
    def scheduler_child(self) -> Child | None:
        """The scheduler process this node started (None: another node hosts it, or none runs)."""
        return next((c for c in self.group.children if c.tag.role == Role.SCHEDULER), None)

    @property
    def workers_started(self) -> bool:
        return any(c.tag.role == Role.WORKER for c in self.group.children)

    def _start_slice(self, todo: list[ProcessSpec]) -> bool:
        """Start workers for up to :data:`SPAWN_SLICE` s (at least one); whether any are left.
        Starting 128 workers on a loaded machine can take a minute: the loop turns between slices."""
        total = len(self.plan.workers) if self.plan is not None else len(todo)
        until = time.monotonic() + SPAWN_SLICE
        while todo and self.loop.signal_received is None:
            self.start(todo.pop(0))
            self.status_line.show(f"started {total - len(todo)}/{total} workers on this node")
            if time.monotonic() >= until:
                break
        return bool(todo) and self.loop.signal_received is None

    def _spawned(self, plan: LaunchPlan) -> None:
        """Every worker of this node was started (or starting stopped): say so once."""
        if self._spawn_said:
            return
        self._spawn_said = True
        _collect_from_now()
        if self.cfg.bind_core.enabled or self.cfg.bind_numa.enabled:
            self.observers.append(BindingsObserver(self.facts.hostname, self.facts.topology))
        self.emit(JobEvent.SPAWNED, list(self.group.children))
        workers = {
            c.tag.rank: c.pid for c in self.group.children if c.tag.role == Role.WORKER and c.tag.rank is not None
        }
        self.deadlines = ranknotes.DeadlineWatch(self.cfg.log_dir, workers)
        if self.cfg.join and not self.detached:
            tailed = [(prefix_for(s.rank, s.local_index), s.log_path) for s in plan.workers if s.tail]
            if tailed:
                self.tailer = LogTailer(tailed)
                self.tailer.start()

    def _ended_by(self, outcome: str | Ending) -> JobResult:
        """Conclude the job (an :class:`Ending`), or report why it could not start (a message)."""
        if isinstance(outcome, Ending):
            return self.conclude(outcome)
        code = 128 + self.loop.signal_received if self.loop.signal_received else EXIT_LAUNCH_ERROR
        return self._launch_error(outcome, self.policy.remote_code or code)

    def _launch_error(self, message: str, code: int) -> JobResult:
        self.status_line.clear()
        console.err_block(f"msrun: error: {message}")
        self.teardown(graceful=False)
        result = JobResult(code, JobState.ERROR, [], [])
        if self.group.children:  # something had started: say how it ended
            result.status = self.snapshot(JobState.ERROR, code, reason=message)
            self.emit(JobEvent.ENDED, result)
        self._finish_trace()
        self.console_done(code)
        return result

    def _make_log_dir(self) -> None:
        """The log directory, made before anything starts: one that cannot be is a usage error."""
        log_dir = self.cfg.log_dir
        if log_dir and not os.path.isdir(log_dir):
            old = os.umask(0o077)
            try:
                os.makedirs(log_dir, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise LaunchError(
                    f"--log_dir: cannot create {log_dir!r} ({exc.strerror or exc}); choose a directory you can write",
                    EXIT_USAGE,
                ) from None
            finally:
                os.umask(old)

    def _start_scheduler(self, spec: ProcessSpec, listener: Any) -> None:
        env: dict[str, str] = {}
        fds: tuple[int, ...] = ()
        if listener is not None:  # the port msrun bound is handed to the scheduler process
            env["MSRUN_LISTEN_FD"] = str(listener.fileno())
            fds += (listener.fileno(),)
        theirs = None
        forkable = self._forkable(spec)
        if forkable:
            # Its code (and json, which msrun needs too) loaded here, where both processes share it,
            # while msrun may still wait to be inside the job's cgroup or the workers start up.
            import importlib

            importlib.import_module(SCHEDULER_MODULE)
            wire.load_json()
        self.guard.ready()  # in the job's cgroup first: the thread that moves msrun there has ended
        self._move_held_in()  # (let go once the fork is done)
        import _thread

        call = f"{SCHEDULER_MODULE}:main" if forkable and _thread._count() == 0 else ""
        if call:  # this node registers over a socketpair: no connect, no challenge
            import _socket  # not socket: its import is a cost on msrun's start path

            self.control_sock, theirs = _socket.socketpair()
            env[wire.AGENT_FD_ENV] = str(theirs.fileno())
            fds += (theirs.fileno(),)
        try:
            self.start(spec, env, fds, call)
        except BaseException:
            if self.control_sock is not None:
                self.control_sock.close()
                self.control_sock = None
            raise
        finally:
            for sock in (listener, theirs):
                if sock is not None:
                    sock.close()

    # ------------------------------------------------------------------ the control plane
    def _register(self, plan: LaunchPlan) -> str | None:
        """The registering stage's step: one attempt to join the control plane (over the
        socketpair when msrun forked it: at once). None when joined or to be retried, else why
        this node cannot join."""
        cfg = self.cfg
        if self.link is None:
            facts = self.facts
            self.link = ControlLink(facts.master_ip, facts.master_port, facts.job_token, self.node_timeout)
            self._register_by = time.monotonic() + (cfg.cluster_time_out if cfg.cluster_time_out >= 0 else 10**9)
        link = self.link
        hello = {
            "t": "hello",
            "kind": "agent",
            "node_rank": cfg.node_rank if cfg.multi_node else 0,
            "local": plan.local_worker_num,
            "host": self.facts.hostname,
            "ip": self.facts.source_ip,
            "pid": os.getpid(),
            "hosts_scheduler": plan.hosts_scheduler,
        }
        scheduler = self.scheduler_child
        if self.control_sock is not None and scheduler is not None:
            link.adopt(self.control_sock, hello, scheduler.pid)
            self.control_sock = None
        else:
            try:
                last = link.try_register(hello, max(0.2, min(5.0, self._register_by - time.monotonic())))
            except wire.AuthError as exc:
                return f"the scheduler at {link.where} refused this node: {exc}"
            if last:
                if time.monotonic() >= self._register_by:
                    within = f"--cluster_time_out={cfg.cluster_time_out}"
                    return f"cannot reach the scheduler at {link.where} within {within}: {last}"
                return None
        self.loop.attach(link)
        timeline.mark("registered with the control plane")
        link.flush_queued()
        for msg, defer in self.unsaid:  # a worker that ended before this node registered
            self._tell(msg, defer)
        self.unsaid = []
        if plan.ranks_pending:  # the control plane places this node's workers next
            if self.detached:
                self.console_done(0)
            self.stage = Stage.ASSIGNING
        else:
            self._place_trace(plan)
            self._supervising()
        return None

    def _assignment(self, msg: dict[str, Any]) -> str | None:
        if self._told(msg):
            return None
        if msg.get("t") != "assign":
            ending = self.policy.message(msg)
            return ending.reason if ending is not None else None
        offset, index, count = msg.get("offset"), msg.get("node_index"), msg.get("node_count")
        if not (isinstance(offset, int) and isinstance(index, int) and isinstance(count, int)):
            return "the scheduler sent a malformed assignment"
        self.assignment = RankAssignment(offset, index, count)
        job_id = msg.get("job_id")
        if isinstance(job_id, str) and job_id:
            self.facts = replace(self.facts, job_id=job_id[:64])
            self.guard.watchdog.job(self.facts.job_id)  # the workers will carry the job's id
        return None

    @property
    def several_nodes(self) -> bool:
        """Whether the control plane put this node in a job of more than one node."""
        return self.assignment is not None and (self.assignment.node_count or 1) > 1

    # ------------------------------------------------------------------ supervision
    def _supervision_step(self) -> Ending | None:
        """The supervising stage's step: this node's ``done`` once its workers succeeded, and the
        job's success once the policy sees it (the first failure, a signal or a lost link end it
        through events)."""
        link = self.link
        workers = [c for c in self.group.children if c.tag.role == Role.WORKER]
        scheduler = self.scheduler_child
        if self.policy.workers_done(workers) and link is not None:
            if self.trace is not None:
                self.trace.ship()  # this node's events reach the trace before its "done"
            link.send_done()
        late = self.deadlines.late(c.tag.rank for c in workers if c.returncode is None) if self.deadlines else None
        if late is not None:
            return self._past_deadline(late, workers)
        return self.policy.finished(workers, scheduler, link is None or link.finished)

    def _past_deadline(self, late: ranknotes.Late, workers: list[Child]) -> Ending:
        """A worker is still there after the deadline it set: its stacks (the signal it named),
        then the job ends, that worker its root cause."""
        child = next(c for c in workers if c.pid == late.pid)
        if late.stack_signal:
            try:
                os.kill(child.pid, late.stack_signal)  # the rank alone: its own children may not catch it
                time.sleep(ranknotes.STACK_WAIT)
            except OSError:
                pass
        return self.policy.past_deadline(child.tag.label, late, child.tag.log_path)

    def _on_event(self, event: Event, scheduler: Child | None) -> Ending | None:
        """Every event of a running job, dispatched in one place."""
        if event.kind is EventKind.EXITED and event.child is not None:
            child, spec = event.child, event.child.tag
            timeline.mark(f"{spec.label} ended ({child.returncode})")
            self.emit(JobEvent.PROCESS_EXITED, child)
            if spec.role == Role.WORKER and spec.rank is not None:
                # Peers blocked in init() or a collective must not wait for a rank that is gone.
                note = {"t": "exit", "rank": spec.rank, "how": processes.describe_returncode(child.returncode or 0)}
                self._tell(note, defer=child.returncode != 0)
            error = errorfile.read_error(spec.error_file) if child.returncode else None
            settled = ""
            if spec.role == Role.WORKER and spec.rank is not None and (child.returncode or 0) > 0:
                settled = ranknotes.settled(self.cfg.log_dir, spec.rank, child.pid, child.returncode or 0) or ""
            ending = self.policy.exited(child, spec.label, spec.log_path, spec.role == Role.WORKER, error, settled)
            if ending is not None and ending.first is not None:
                self._tell({"t": "failed", "reason": ending.reason, "code": min(255, ending.code)}, defer=True)
            return ending
        if event.kind is EventKind.MESSAGE:
            if self._told(event.message):
                return None
            return self.policy.message(event.message)
        if event.kind is EventKind.LINK_CLOSED:
            if (self.link is None or not self.link.done_sent_at) and scheduler is None:
                return self.policy.lost(f"Lost the connection to the scheduler ({event.reason}).")
            if self.link is not None:
                self.link.close()
        return None

    def _tell(self, msg: dict[str, Any], defer: bool) -> None:
        """Say ``msg`` to the control plane (``defer``: once this node's processes are signalled).
        Before this node registered - its workers start first - it is said at registration."""
        if self.link is not None:
            (self.link.defer if defer else self.link.send)(msg)
        elif self.plan is not None and self.plan.scheduler_mode.has_control_plane:
            self.unsaid.append((msg, defer))

    def _told(self, msg: dict[str, Any]) -> bool:
        """A message for the console, not the policy: a notice, progress. Whether it was one."""
        kind = msg.get("t")
        if kind == "notice":
            self._notice(str(msg.get("text", ""))[:2000])
        elif kind == "progress":
            if msg.get("done"):
                self.status_line.clear()
            else:
                self.status_line.show(str(msg.get("text", ""))[:200])
        else:
            return False
        return True

    def _notice(self, text: str) -> None:
        """The control plane tells every node (a dropped connection, a refused node): said on this
        console and kept in the status file."""
        if text and len(self.notices) < 100:
            self.notices.append(text)
            console.warning(f"Control plane: {text}")
            if self.trace is not None:
                self.trace.notice(text)

    # ------------------------------------------------------------------ teardown
    def teardown(self, graceful: bool) -> None:
        """Stop every process of this node's job and sweep what they left behind: the workers are
        signalled first, then msrun's notes go to the control plane (so it learns where they were
        caught), and only then is the control plane signalled."""
        if self.first is not None:  # a worker still held reads end-of-file and exits
            self.first.close()
            self.first = None
        live = self.group.alive()
        scheduler = next((c for c in live if c.tag.role == Role.SCHEDULER), None)
        # On several nodes the scheduler goes last: it must broadcast the failure to the others.
        scheduler_last = scheduler is not None and bool(self.policy.failures) and self.several_nodes
        if not graceful:
            self.group.terminate(c for c in live if c is not scheduler)
            if self.link is not None:
                self.link.flush()
            if scheduler is not None:
                # After the notes: its SIGTERM must not overtake them (it would abort the job's
                # clients with "stopped by SIGTERM" rather than the rank that failed).
                if scheduler_last:
                    self.group.wait(time.monotonic() + min(self.term_grace, 2.0))
                self.group.terminate([scheduler])
            self.group.stop(self.term_grace)
        hit = self.group.sweep()
        if hit and graceful:
            console.warning(f"Killed {len(hit)} leftover process(es) started by the job: {hit}.")


def _collect_from_now() -> None:
    """msrun has started its job: the cyclic GC, held off while it started (see ``entry.main``),
    runs again - supervision may last days. What start-up allocated is long-lived: frozen, so no
    collection walks it again."""
    gc.freeze()
    gc.enable()


def _scheduler_ended(returncode: int) -> str:
    how = processes.describe_returncode(returncode)
    return f"the scheduler process {'was ' if returncode < 0 else ''}{how} before this node was assigned its ranks"
