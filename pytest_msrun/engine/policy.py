"""When a job ends, and with what status: msrun's supervision rules, as decisions only.

* The first failure wins: a worker that exits non-zero, or the scheduler doing so (unless it is
  ending an abort it broadcast), ends the job with that process's status (128+N for signal N).
* A signal to msrun ends it with 128+N; an abort from the control plane (another node failed)
  with the status that node reported; a lost control plane (silence, a closed link, a refusal)
  with 1.
* A worker that said its non-zero status is its own result (a *settled* exit, see
  :mod:`.ranknotes`) stops nobody: the node ends when every worker has ended, with the first
  settled status.
* A worker whose connection to the control plane closed is ending, and its peers hear of it:
  a failure that comes while it has not ended yet waits for its end (at most :data:`LEFT_WAIT`
  s), and its failure, if it is one, is the root cause - it left first.
* A worker still there :data:`~.ranknotes.BACKSTOP` s after the deadline it set failed at that
  deadline, with status 124: time is kept outside a rank that cannot keep its own.
* Success: every worker exited 0, the local scheduler (if any) is gone, and the control plane
  recorded this node's ``done``.

No I/O here: the agent acts on an :class:`Ending` and observers print it.
"""

from __future__ import annotations

import signal
import time

from pytest_msrun.engine.errorfile import RankError
from pytest_msrun.engine.kinds import JobState, Role
from pytest_msrun.engine.processes import Child
from pytest_msrun.engine.summary import Failure, failure_of
from pytest_msrun.record import field, record, replace

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from pytest_msrun.engine.ranknotes import Late

EXIT_LAUNCH_ERROR = 1
LEFT_WAIT = 2.0  # s a failure waits for a worker that left the control plane before it to end
TIMEOUT_EXIT = 124  # timeout(1)'s status: a worker that ran out of time (ranknotes.TIMEOUT_EXIT)


@record(frozen=True)
class Ending:
    code: int
    state: JobState
    reason: str = ""  # why msrun ends the job ("" when it ended by itself)
    first: Failure | None = None  # the root cause, for a failure
    workers_failed: bool = False


@record
class Policy:
    host: str = ""  # named in failures when the job spans several nodes
    failures: list[Failure] = field(default_factory=list)
    remote_code: int | None = None  # the status an abort from the control plane carried
    settled: dict[int, Failure] = field(default_factory=dict)  # pid -> a worker's settled non-zero exit
    late: dict[int, Late] = field(default_factory=dict)  # pid -> a worker found past its deadline
    departed: dict[int, str] = field(default_factory=dict)  # pid -> label, as they left the control plane
    first_to_leave: str = ""  # the worker that had left first when a failure came: its own failure is first
    held_until: float | None = None  # a failure's ending waits for departed workers until then

    def exited(self, child: Child, error: RankError | None = None, settled: str = "") -> Ending | None:
        """A local process ended (its tag: its spec); ``error``: its uncaught exception, from its
        error file; ``settled``: why its non-zero status is its own result (it stops nobody)."""
        rc, spec = child.returncode, child.tag
        order = list(self.departed)  # who left before this one (everyone who left, if it did not)
        earlier = [self.departed[pid] for pid in order[: order.index(child.pid) if child.pid in order else None]]
        self.departed.pop(child.pid, None)
        if rc in (0, None):
            return self.first_failure() if self.held_until is not None and not self.departed else None
        failure = failure_of(spec.label, rc, child.ended or time.time(), spec.log_path, child.pid, self.host)
        is_worker = spec.role == Role.WORKER
        if settled and is_worker:
            self.settled[child.pid] = replace(failure, description=f"{failure.description} ({settled})")
            return None
        if is_worker or self.remote_code is None:  # a scheduler ending an abort it sent explains nothing
            self.failures.append(replace(failure, error=error))
        if is_worker and earlier or self.held_until is not None and self.departed:
            self.first_to_leave = self.first_to_leave or earlier[0]
            self.held_until = self.held_until or time.time() + LEFT_WAIT
            return None
        return self.first_failure()

    def _order(self, failure: Failure) -> tuple[bool, float]:
        """Failures in the order they are said: the worker that left first, then by time."""
        return failure.label != self.first_to_leave, failure.at

    def first_failure(self) -> Ending:
        """The ending the earliest recorded failure decides."""
        if not self.failures:
            return Ending(self.remote_code or EXIT_LAUNCH_ERROR, JobState.FAILED, "the scheduler ended")
        first = min(self.failures, key=self._order)
        workers = any(f.label != "scheduler" for f in self.failures)
        reason = f"{first.label} {first.description}" + (f" ({first.error.headline})" if first.error else "")
        return Ending(first.exit_status or 1, JobState.FAILED, reason[:500], first, workers)

    def past_deadline(self, child: Child, late: Late) -> Ending:
        """A worker still there after its deadline failed at that deadline (status 124)."""
        failure = Failure(child.tag.label, late.describe(), TIMEOUT_EXIT, late.due, child.tag.log_path, late.pid)
        self.late[late.pid] = late
        self.failures.append(replace(failure, host=self.host))
        return self.first_failure()

    def workers_done(self, workers: list[Child]) -> bool:
        """Every worker ended with 0 or a settled status: this node's share of the job is done."""
        return bool(workers) and all(c.returncode == 0 or c.pid in self.settled for c in workers)

    def finished(self, workers: list[Child], scheduler: Child | None, link_finished: bool) -> Ending | None:
        """The node's end once every worker is done, its scheduler gone and the control plane
        told: success, or the first settled status."""
        if not (self.workers_done(workers) and (scheduler is None or not scheduler.alive) and link_finished):
            return None
        if not self.settled:
            return Ending(0, JobState.SUCCEEDED)
        first = min(self.settled.values(), key=lambda f: f.at)
        return Ending(first.exit_status, JobState.FAILED, "", first, workers_failed=True)

    def reported(self) -> list[Failure]:
        """Every failure to report, the root cause first: those that ended the job, and settled ones."""
        return sorted([*self.failures, *self.settled.values()], key=self._order)

    def signalled(self, signum: int) -> Ending:
        return Ending(128 + signum, JobState.TERMINATED, f"msrun received {signal.Signals(signum).name}")

    def message(self, msg: dict[str, Any]) -> Ending | None:
        kind = msg.get("t")
        if kind == "abort":
            code = msg.get("code")
            self.remote_code = code if isinstance(code, int) and code > 0 else 1
            return Ending(self.remote_code, JobState.FAILED, f"job aborted by the scheduler: {msg.get('reason')}")
        if kind == "refused":
            return self.lost(f"the scheduler refused this node: {msg.get('reason')}")
        if kind == "timeout":
            return self.lost(str(msg.get("reason")))
        return None

    def lost(self, reason: str) -> Ending:
        return Ending(EXIT_LAUNCH_ERROR, JobState.FAILED, reason)
