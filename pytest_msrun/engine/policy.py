"""When a job ends, and with what status: msrun's supervision rules, as decisions only.

* The first failure wins: a worker that exits non-zero, or the scheduler doing so (unless it is
  ending an abort it broadcast), ends the job with that process's status (128+N for signal N).
* A signal to msrun ends it with 128+N; an abort from the control plane (another node failed)
  with the status that node reported; a lost control plane (silence, a closed link, a refusal)
  with 1.
* Success: every worker exited 0, the local scheduler (if any) is gone, and the control plane
  recorded this node's ``done``.

No I/O here: the agent acts on an :class:`Ending` and observers print it.
"""

from __future__ import annotations

import signal
import time

from pytest_msrun.engine.errorfile import RankError
from pytest_msrun.engine.kinds import JobState
from pytest_msrun.engine.processes import Child
from pytest_msrun.engine.summary import Failure, failure_of
from pytest_msrun.record import field, record, replace

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

EXIT_LAUNCH_ERROR = 1


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

    def exited(
        self, child: Child, label: str, log: str, is_worker: bool, error: RankError | None = None
    ) -> Ending | None:
        """A local process ended; ``error``: its uncaught exception, from its error file."""
        rc = child.returncode
        if rc in (0, None):
            return None
        if is_worker or self.remote_code is None:  # a scheduler ending an abort it sent explains nothing
            assert rc is not None
            failure = failure_of(label, rc, child.ended or time.time(), log, child.pid, self.host)
            self.failures.append(replace(failure, error=error))
        return self.first_failure()

    def first_failure(self) -> Ending:
        """The ending the earliest recorded failure decides."""
        if not self.failures:
            return Ending(self.remote_code or EXIT_LAUNCH_ERROR, JobState.FAILED, "the scheduler ended")
        first = min(self.failures, key=lambda f: f.at)
        workers = any(f.label != "scheduler" for f in self.failures)
        reason = f"{first.label} {first.description}" + (f" ({first.error.headline})" if first.error else "")
        return Ending(first.exit_status or 1, JobState.FAILED, reason[:500], first, workers)

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

    @staticmethod
    def succeeded(workers: list[Child], scheduler: Child | None, link_finished: bool) -> bool:
        return (
            bool(workers)
            and all(c.returncode == 0 for c in workers)
            and (scheduler is None or not scheduler.alive)
            and link_finished
        )
