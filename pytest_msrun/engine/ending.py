"""How one node's run ends: its teardown (one path, whatever the ending), its result and status
file, what the job's reporters say, a launch error. A part of :class:`~.agent.Agent`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from pytest_msrun.engine import console, timeline
from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.containment import JobGuard
from pytest_msrun.engine.kinds import JobState, Role
from pytest_msrun.engine.link import ControlLink
from pytest_msrun.engine.loop import EventLoop
from pytest_msrun.engine.observers import (
    JobEvent,
    JobResult,
)
from pytest_msrun.engine.plan import (
    LaunchPlan,
    NodeFacts,
    RankAssignment,
)
from pytest_msrun.engine.policy import EXIT_LAUNCH_ERROR, Ending, Policy
from pytest_msrun.engine.processes import ProcessGroup
from pytest_msrun.engine.progress import StatusLine
from pytest_msrun.engine.status import JobStatus, ProcessStatus
from pytest_msrun.engine.tail import LogTailer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from pytest_msrun.engine.earlystart import FirstStarted
    from pytest_msrun.engine.trace import TraceObserver


class JobEnding:
    """Ending this node's run (a part of :class:`~.agent.Agent`)."""

    assignment: RankAssignment | None
    cfg: LaunchConfig
    detached: bool
    facts: NodeFacts
    first: FirstStarted | None
    group: ProcessGroup
    guard: JobGuard
    link: ControlLink | None
    loop: EventLoop
    notices: list[str]
    on_console_done: Callable[[int], None] | None
    plan: LaunchPlan | None
    policy: Policy
    started: float
    status_line: StatusLine
    tailer: LogTailer | None
    term_grace: float
    trace: TraceObserver | None

    if TYPE_CHECKING:

        def emit(self, event: JobEvent, payload: Any = None) -> None: ...

        @property
        def several_nodes(self) -> bool: ...

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
        result.summaries = [r.summary for r in reports if r.summary]
        verdict = next((r.exit_code for r in reports if r.exit_code is not None), None)
        if verdict is not None and verdict != result.exit_code:
            result.own_code = result.exit_code
            result.exit_code = result.status.exit_code = verdict
        if self.trace is not None:
            self.trace.reported([r.trace for r in reports if r.trace is not None])

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
