"""The one runner: every marked test's attempt comes from here, whatever it runs in.

:meth:`Runner.start` hands out an :data:`~.attempts.Attempt` for every marked test - in its warm or
forking world, in a job of its own, or refused (a bad marker, a skip that applies here, no room, no
devices, no files): each ends in one immutable :class:`~.attempts.TestRecord`, judged by the one
rule. The controller never asks which kind it holds; what worlds keep between tests is kept here.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_msrun.fsinfo import describe_write_error
from pytest_msrun.plugin.controller.attempts import Attempt, TestRecord, WarmAttempt, WholeAttempt
from pytest_msrun.plugin.controller.jobs import Jobs, static_skip
from pytest_msrun.plugin.controller.pool import DeviceShortage
from pytest_msrun.plugin.controller.worlds import LateEnd, WorldPool
from pytest_msrun.plugin.marker import MarkerError, MsrunSpec, spec_for
from pytest_msrun.plugin.rule.outcomes import Refusal, TestVerdict
from pytest_msrun.plugin.rule.testrecord import JobRun


class Runner:
    """Hands out the attempts of one session's marked tests and keeps what worlds share between them."""

    def __init__(self, jobs: Jobs, worlds: WorldPool, leaks_fail: bool) -> None:
        self.jobs = jobs
        self.worlds = worlds
        self.leaks_fail = leaks_fail  # --msrun-leaks=error: an input of the rule, not a rewrite of its outcome
        # each world's last test and the teardown failures reported on it (a late judgement repeats none)
        self.reported: dict[tuple, tuple[Any, frozenset[tuple[int, str, str]]]] = {}

    # ---------------------------------------------------------------- one test
    def start(self, item: pytest.Item, nextitem: pytest.Item | None) -> Attempt:
        """``item``'s setup and call, run on its ranks - or its refusal."""
        try:
            spec = spec_for(item)
        except MarkerError as exc:
            return self._refused(item, [], Refusal("failed", str(exc)))
        assert spec is not None
        ranks = list(range(spec.worker_num))
        key = self.worlds.key_of(item)
        skip = static_skip(item)
        note = ""
        try:
            if key is not None and (skip is None or self.worlds.expecting.get(key) == item.nodeid):
                # a skipped test its world kept fixtures for still goes there: its ranks skip it and tear down
                attempt, note = self.worlds.attempt(item, spec, key, nextitem)
                if attempt is not None:
                    return attempt
            if skip is not None:
                return self._refused(item, ranks, Refusal("skipped", skip))
            no_room = self.worlds.no_room.pop(item.nodeid, "")
            if no_room:
                return self._refused(item, ranks, Refusal("failed", f"msrun: {no_room}"), note)
            return self._fresh(item, spec, ranks, note)
        except OSError as exc:
            return self._refused(item, ranks, Refusal("failed", self._no_files(exc)), note)

    def _fresh(self, item: pytest.Item, spec: MsrunSpec, ranks: list[int], note: str) -> Attempt:
        try:
            devices = self.jobs.pooled_devices(spec)
        except DeviceShortage as exc:  # more GPUs per node than the Slurm allocation has: as on a host
            return self._refused(item, ranks, Refusal("skipped", f"msrun: {exc}"), note)
        inventory = self.jobs.inventory
        try:
            lease = self.worlds.resources.lease(ports=2, devices=devices, inv=inventory, wait=self.jobs.timeout(spec))
        except DeviceShortage as exc:
            outcome = "skipped" if spec.devices > len(inventory.ids) else "failed"
            return self._refused(item, ranks, Refusal(outcome, f"msrun: {exc}"), note)
        try:
            job = self.jobs.new(item, spec, lease.ports, lease.devices)
            run = dataclasses.replace(job.run(self.jobs.test_timeout(item, spec), self.jobs.exit_timeout), note=note)
            return WholeAttempt("fresh", TestRecord.load(item.nodeid, job.expected_ranks, job.paths, run), job.trace)
        finally:
            self.worlds.resources.release(lease)

    def _refused(self, item: pytest.Item, ranks: list[int], refusal: Refusal, note: str = "") -> WholeAttempt:
        tag = "refused-" + hashlib.sha1(item.nodeid.encode()).hexdigest()[:8]  # tests of one name in two files
        now = time.time()
        record = TestRecord(
            item.nodeid, ranks, {}, JobRun([], [], False, 0.0, now, now, note=note), "", refusal=refusal
        )
        return WholeAttempt("refused", record, self.jobs.trace_of(item, tag))

    def _no_files(self, exc: OSError) -> str:
        """The test's directories or files could not be made (a full basetemp, a file someone put
        there): the test's setup error, naming the place, its file system and the fix."""
        path = exc.filename
        if not path and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a write: which file is not said
            try:
                path = str(self.jobs.config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]
            except OSError:
                path = ""
        if path:
            return f"msrun: cannot make the test's files: {describe_write_error(str(path), exc, '--basetemp')}"
        return f"msrun: cannot start the test's job: {exc}"

    def finish(self, attempt: Attempt, item: pytest.Item, nextitem: pytest.Item | None, again: bool) -> TestRecord:
        """The attempt's teardown and its complete record: a world keeps what the next test it
        serves shares with this one - nothing when this one runs ``again`` (a rerun gets a fresh world)."""
        next_id = None
        if isinstance(attempt, WarmAttempt) and not again:
            next_id = self.worlds.world_next(item, nextitem, attempt.world.key)
        return attempt.finish(next_id, self.jobs.exit_timeout, leaks_fail=self.leaks_fail)

    def done(self, attempt: Attempt, item: pytest.Item, final: TestVerdict) -> bool:
        """The attempt is reported (``final``); whether its job ended with it (its trace is complete)."""
        if not isinstance(attempt, WarmAttempt):
            return True
        key = attempt.world.key
        if key in self.worlds.live:  # its world lives on: a late judgement repeats none of these failures
            self.reported[key] = (attempt.world.last, frozenset(teardown_failures(final)))
        self.worlds.after(item, key, attempt.next_id)
        return key not in self.worlds.live

    # ---------------------------------------------------------------- worlds' ends outside a test
    def late(self) -> Iterator[tuple[LateEnd, TestRecord, frozenset[tuple[int, str, str]]]]:
        """Each world's end since, with the record of its last test judged again with it, and the
        teardown failures already reported on that test."""
        ends, self.worlds.late = self.worlds.late, []
        for end in ends:
            world, last = end.world, end.last
            lines = world.job.reproduce_lines(last.timeout, [last.nodeid], last.env)
            run = dataclasses.replace(end.run, reproduce_lines=lines, started=last.started)
            test, said = self.reported.get(world.key, (None, frozenset()))
            record = TestRecord.load(end.item.nodeid, world.job.expected_ranks, last.paths, run)
            yield end, record, said if test is last else frozenset()


def teardown_failures(verdict: TestVerdict) -> set[tuple[int, str, str]]:
    """What failed a test's teardown, rank by rank: (rank, kind, summary)."""
    return {
        (issue.rank, issue.kind, issue.summary)
        for phase in verdict.phases
        if phase.phase == "teardown"
        for issue in [*phase.issues, *([phase.cause] if phase.cause else [])]
    } | {(-1, "rule", phase.message) for phase in verdict.phases if phase.phase == "teardown" and phase.message}
