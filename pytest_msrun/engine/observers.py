"""What the world sees of a job: msrun's console lines, the status file, job-end reporters.

The agent emits named events (:class:`JobEvent`); each observer turns them into output. None of
them decides anything (that is :mod:`pytest_msrun.engine.policy`'s job).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from enum import Enum

from pytest_msrun.engine import console
from pytest_msrun.engine.kinds import JobState, Role
from pytest_msrun.engine.policy import Ending
from pytest_msrun.engine.processes import Child
from pytest_msrun.engine.status import JobStatus, write_status
from pytest_msrun.engine.summary import Failure, render
from pytest_msrun.record import field, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

    class Observer(Protocol):
        """Turns the agent's events into output."""

        def notify(self, event: JobEvent, payload: Any) -> None: ...


class JobEvent(Enum):
    PROCESS_STARTED = "process started"  # payload: the Child (its tag is the ProcessSpec)
    PROCESS_EXITED = "process exited"  # payload: the Child
    SPAWNED = "spawned"  # every process of this node started; payload: the children
    ENDING = "ending"  # payload: the Ending msrun acts on
    ENDED = "ended"  # payload: the JobResult, its status set


@record
class JobResult:
    """How this node's share of a job ended."""

    exit_code: int
    state: JobState
    failures: list[Failure]
    terminated: list[str]  # labels of the processes msrun stopped
    status: JobStatus | None = None
    reports: list[str] = field(default_factory=list)  # what job-end reporters said
    summaries: list[str] = field(default_factory=list)  # their one-line verdicts, for the trace's end
    own_code: int | None = None  # the processes' exit status, where a reporter's verdict replaced it


class ConsoleObserver:
    """msrun's lines: ``Start ... process`` on stdout, the logger's on stderr, the summary, then
    what job-end reporters registered by the job's processes said (``msrun pytest``'s table)."""

    def __init__(self, log_dir: str, join: bool, detached: bool) -> None:
        self.log_dir = log_dir
        self.waiting = join and not detached

    def notify(self, event: JobEvent, payload: Any) -> None:
        if event is JobEvent.PROCESS_STARTED:
            spec = payload.tag
            import shlex  # (and re) only once a line is printed: after the workers have started

            command = shlex.join(spec.command)  # as a shell needs it (msrun joins unquoted: the same for plain words)
            if spec.role == Role.SCHEDULER:
                console.out(f"Start scheduler process, log file:{spec.log_path}. Execute command: {command}")
            else:
                console.out(
                    f"Start worker process with rank id:{spec.rank}, log file:{spec.log_path}. "
                    f"Environment variable [RANK_ID={spec.rank}] is exported. Execute command: {command}"
                )
        elif event is JobEvent.PROCESS_EXITED and payload.returncode not in (0, None):
            child: Child = payload
            if child.tag.role == Role.WORKER:
                console.error(f"Worker process {child.pid} exit with exception. Error code: {child.returncode}.")
            else:
                console.error(f"Scheduler process {child.pid} exit with exception.")
        elif event is JobEvent.SPAWNED and self.waiting:
            console.warning("Distributed job is spawned. Waiting all processes to exit...")
        elif event is JobEvent.ENDING:
            self._ending(payload)
        elif event is JobEvent.ENDED:
            self._ended(payload)
            for text in payload.reports:  # what the job's reporters said (a --join=True job's only)
                console.out(text)

    def _ending(self, ending: Ending) -> None:
        if ending.state is JobState.TERMINATED:
            sig = signal.Signals(ending.code - 128)
            label = "SIGINT (Ctrl+C)" if sig == signal.SIGINT else sig.name
            console.warning(f"msrun process received {label}, terminating all workers.")
        elif ending.first is None and ending.reason and ending.state is JobState.FAILED:
            console.error(ending.reason)  # an abort from another node, a lost or refusing control plane
        if ending.workers_failed:
            console.warning("There's worker exits with exception, kill all other workers.")

    def _ended(self, result: JobResult) -> None:
        if result.state is JobState.SUCCEEDED:
            console.info("All workers successfully exit!")
            return
        if result.state is JobState.ERROR:
            return
        console.error(f"Distributed job exited with exception. Please check logs in directory: {self.log_dir or '.'}.")
        text = render(result.failures, result.terminated, self.log_dir)
        if text:
            console.err_block(text)


class StatusObserver:
    """``msrun_status.json`` when the job is spawned and when it ended."""

    def __init__(self, log_dir: str, name: Callable[[], str | None], snapshot: Callable[..., JobStatus]) -> None:
        self.log_dir = log_dir
        self.name = name  # known once the node's index is (multi-node: after assignment)
        self.snapshot = snapshot

    def notify(self, event: JobEvent, payload: Any) -> None:
        name = self.name()
        if name is None:
            return  # a node that never joined the job writes nothing into a shared log directory
        if event is JobEvent.SPAWNED:
            write_status(self.log_dir, self.snapshot(JobState.RUNNING, None), name)
        elif event is JobEvent.ENDED:
            write_status(self.log_dir, payload.status, name)


class BindingsObserver:
    """After spawning: what the kernel applied to every process, mismatches warned, one table."""

    def __init__(self, hostname: str, topology: object) -> None:
        self.hostname = hostname
        self.topology = topology

    def notify(self, event: JobEvent, payload: Any) -> None:
        if event is not JobEvent.SPAWNED:
            return
        from pytest_msrun.binding.verify import mismatch, past_wrappers, read_binding, report_table

        rows = []
        for child in payload:
            spec = child.tag
            got = read_binding(child.pid) if past_wrappers(child.pid) else None
            if got is not None:
                for problem in mismatch(spec.cpus, spec.mems, got):
                    console.warning(f"Binding of {spec.label} (pid {child.pid}) {problem}.")
            rows.append((spec.label, child.pid, spec.device, spec.cpus, spec.mems, got, spec.bind_how))
        source = getattr(self.topology, "source", "live")
        console.out(report_table(rows, f"msrun: bindings on {self.hostname} (topology: {source})"))
