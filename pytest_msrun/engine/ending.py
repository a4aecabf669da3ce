"""How one node's run ends: its teardown (one path, whatever the ending), its result and status
file, what the job's reporters say, a launch error. A part the :class:`~.agent.Agent` owns."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from pytest_msrun.engine import console, timeline
from pytest_msrun.engine.kinds import JobState, Role
from pytest_msrun.engine.noderun import NodeRun
from pytest_msrun.engine.observers import JobEvent, JobResult
from pytest_msrun.engine.policy import EXIT_LAUNCH_ERROR, Ending
from pytest_msrun.engine.status import JobStatus, ProcessStatus
from pytest_msrun.record import asdict

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class JobEnding:
    """Ending this node's run: a part the :class:`~.agent.Agent` owns. ``node``: the run it ends;
    ``on_console_done``: called once msrun's caller may go on."""

    def __init__(self, node: NodeRun, on_console_done: Callable[[int], None] | None) -> None:
        self.node = node
        self.on_console_done = on_console_done

    def console_done(self, code: int) -> None:
        """The caller's console is no longer needed (``--join=False``: msrun returns now)."""
        if self.on_console_done is not None:
            callback, self.on_console_done = self.on_console_done, None
            callback(code)

    def conclude(self, ending: Ending, extra: dict[str, Any] | None = None) -> JobResult:
        """Stop everything this node started, then report how the job ended."""
        graceful = ending.state is JobState.SUCCEEDED
        self.node.status_line.clear()
        timeline.mark(f"ending: {ending.state}")
        self.node.emit(JobEvent.ENDING, ending)
        self.teardown(graceful)
        timeline.mark("torn down")
        if self.node.tailer is not None:
            self.node.tailer.stop()
            self.node.tailer = None
        terminated = [c.tag.label for c in self.node.group.children if c.terminated_by_us]
        result = JobResult(ending.code, ending.state, self.node.policy.reported(), terminated)
        result.status = self.snapshot(ending.state, ending.code, extra, ending.reason)
        if self.node.cfg.join and not self.node.detached:
            self._job_end_reports(result)
        self.node.emit(JobEvent.ENDED, result)
        timeline.mark("reported")
        self._finish_trace()
        if self.node.link is not None:
            self.node.link.close()
        return result

    def _finish_trace(self) -> None:
        if self.node.trace is not None:
            line = self.node.trace.finish()
            if line:
                console.err_block(line)
            self.node.trace = None

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
        if self.node.trace is not None:
            self.node.trace.reported([r.trace for r in reports if r.trace is not None])

    def snapshot(
        self, state: JobState, code: int | None, extra: dict[str, Any] | None = None, reason: str = ""
    ) -> JobStatus:
        plan = self.node.plan
        return JobStatus(
            job_id=self.node.facts.job_id,
            state=str(state),
            exit_code=code,
            supervisor_pid=os.getpid(),
            host=self.node.facts.hostname,
            join=self.node.cfg.join,
            started=self.node.started,
            node_index=self.node.assignment.node_index if self.node.assignment else 0,
            log_dir=self.node.cfg.log_dir,
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
                    settled=self.node.policy.settled[c.pid].description if c.pid in self.node.policy.settled else "",
                    late=self.node.policy.late[c.pid].to_json() if c.pid in self.node.policy.late else None,
                )
                for c in self.node.group.children
            ],
            failures=[asdict(f) for f in self.node.policy.reported()],
            stop_reason=reason,
            containment=self.node.guard.describe(),
            notices=list(self.node.notices),
            worker_num=plan.config.worker_num if plan is not None else None,
            scheduler_mode=str(plan.scheduler_mode) if plan is not None else None,
            extra=dict(extra or {}),
        )

    def ended_by(self, outcome: str | Ending) -> JobResult:
        """Conclude the job (an :class:`Ending`), or report why it could not start (a message)."""
        if isinstance(outcome, Ending):
            return self.conclude(outcome)
        code = 128 + self.node.loop.signal_received if self.node.loop.signal_received else EXIT_LAUNCH_ERROR
        return self.launch_error(outcome, self.node.policy.remote_code or code)

    def launch_error(self, message: str, code: int) -> JobResult:
        self.node.status_line.clear()
        console.err_block(f"msrun: error: {message}")
        self.teardown(graceful=False)
        result = JobResult(code, JobState.ERROR, [], [])
        if self.node.group.children:  # something had started: say how it ended
            result.status = self.snapshot(JobState.ERROR, code, reason=message)
            self.node.emit(JobEvent.ENDED, result)
        self._finish_trace()
        self.console_done(code)
        return result

    def teardown(self, graceful: bool) -> None:
        """Stop every process of this node's job and sweep what they left behind: the workers are
        signalled first, then msrun's notes go to the control plane (so it learns where they were
        caught), and only then is the control plane signalled."""
        if self.node.first is not None:  # a worker still held reads end-of-file and exits
            self.node.first.close()
            self.node.first = None
        live = self.node.group.alive()
        scheduler = next((c for c in live if c.tag.role == Role.SCHEDULER), None)
        # On several nodes the scheduler goes last: it must broadcast the failure to the others.
        scheduler_last = scheduler is not None and bool(self.node.policy.failures) and self.node.several_nodes
        if not graceful:
            self.node.group.terminate(c for c in live if c is not scheduler)
            if self.node.link is not None:
                self.node.link.flush()
            if scheduler is not None:
                # After the notes: its SIGTERM must not overtake them (it would abort the job's
                # clients with "stopped by SIGTERM" rather than the rank that failed).
                if scheduler_last:
                    self.node.group.wait(time.monotonic() + min(self.node.term_grace, 2.0))
                self.node.group.terminate([scheduler])
            self.node.group.stop(self.node.term_grace)
        hit = self.node.group.sweep()
        if hit and graceful:
            console.warning(f"Killed {len(hit)} leftover process(es) started by the job: {hit}.")
