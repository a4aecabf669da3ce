"""One marked test, run as a fresh job or in a warm world, behind one interface.

What pytest-xdist's ``WorkerController`` is to its controller, an :data:`Attempt` is to ours: it
runs the test's setup and call on every rank (its ``record``), then - once the controller has
reported them, so ``-x`` has acted - its teardown, keeping what the next test of the same world
shares with it (``finish``: None keeps nothing; ``leaks_fail``: what the test left behind in its
world fails its teardown). Both steps give a :class:`TestRecord`: everything the verdict is a
function of (every rank's records, every process end, the job's timeout), and the same merge
turns it into reports. A fresh job runs whole in the first step; a warm world in two.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Union

from pytest_msrun.fileio import private_dir, write_whole
from pytest_msrun.plugin.controller.job import TestPaths
from pytest_msrun.plugin.controller.world import Called, World, teardown
from pytest_msrun.plugin.rule.testrecord import TestRecord


@dataclass
class WholeAttempt:
    """A test run whole at once - a job of its own (``fresh``), its ranks' process ends included, or
    a refusal whose job never ran (``refused``: a bad marker, a skip that applies here, no room, no
    devices; its record holds the refusal, judged like any other)."""

    mode: str
    record: TestRecord
    trace: str  # its job's trace file, or a refusal's own (its tests lane); "": none kept
    world_dir = ""

    @property
    def job_started(self) -> float:
        return self.record.run.started

    def finish(self, next_id: str | None, exit_timeout: float, leaks_fail: bool = False) -> TestRecord:
        return self.record  # nothing left behind in a world


class WarmAttempt:
    """A test in a warm world: setup and call now, the teardown when the controller knows what follows."""

    mode = "warm"

    def __init__(self, nodeid: str, world: World, job_dir: Path, timeout: float, exit_timeout: float) -> None:
        self.nodeid = nodeid
        self.world = world
        self.paths = paths = TestPaths(job_dir, world.job.paths.log_dir)
        paths.make()
        self.called: Called = world.begin(paths, nodeid, timeout, exit_timeout)
        self.next_id: str | None = None  # the test its world kept fixtures for, once torn down
        self.trace = world.job.trace
        self.job_started = world.created
        self.world_dir = str(world.job.paths.job_dir)
        record = TestRecord.load(nodeid, world.job.expected_ranks, paths, self.called.run)
        # each rank's part of the log so far (setup and call); completed with the teardown in finish()
        self.record = replace(record, own_logs=self._own_logs(record))

    def left_before(self) -> list[int]:
        """The ranks whose leaving ended the world before they began this test (the world was
        already dying when it was sent): not this test's failure. Judged from the ranks' own
        ends, whether or not the world has noticed yet (on a loaded machine msrun may reap a rank
        killed between tests only after the next test was sent): a rank that ended by itself and
        left no record of this test never began it."""
        causes = set(self.world.lost) | {
            rank
            for rank, end in self.record.run.ranks.items()
            if end.returncode not in (None, 0) and not end.terminated_by_msrun
        }
        if any(self.record.logs[r].started for r in causes if r in self.record.logs):
            return []
        return sorted(causes)

    def finish(self, next_id: str | None, exit_timeout: float, leaks_fail: bool = False) -> TestRecord:
        self.next_id = next_id
        done = teardown(self.called, next_id, exit_timeout)
        record = TestRecord.load(self.nodeid, self.world.job.expected_ranks, self.paths, done.run)
        own_logs = self._own_logs(record)
        return replace(record, leaks=done.leaks, leaks_fail=leaks_fail, notes=list(done.notes), own_logs=own_logs)

    def _own_logs(self, record: TestRecord) -> dict[int, str]:
        """Each rank's part of the world's log, in the test's own folder (``logs/worker_<rank>.log``):
        what reports point at, instead of a log every test of the world shares."""
        folder = self.paths.job_dir / "logs"
        own: dict[int, str] = {}
        for rank, end in list(record.run.ranks.items()):
            log = record.logs.get(rank)
            test = log.tests.get(self.nodeid) if log is not None else None
            span = test.log_span() if test is not None else None
            source = end.log or (log.log if log is not None else "")
            if span is None or not source:
                continue
            with contextlib.suppress(OSError), open(source, "rb") as fh:
                fh.seek(span[0])
                part = fh.read() if span[1] is None else fh.read(max(0, span[1] - span[0]))
                private_dir(str(folder))
                target = str(folder / f"worker_{rank}.log")
                write_whole(target, part)
                own[rank] = target
        return own


Attempt = Union[WholeAttempt, WarmAttempt]  # its mode (fresh, refused, warm) names it in reports
