"""A test's record - everything its verdict is a function of - and the run of its job.

A record is a value: frozen, judged once by the one rule (:func:`.verdict.judge` is called here
and nowhere else), whatever produced it - a job of its own, a warm or forking world, a refusal, or
a suite run whole by msrun (:func:`suite_records`). What is known later makes a new record.

Plain data: no pytest import, so msrun's job-end reporter (suite mode) reads records too.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass, field
from typing import Any

from pytest_msrun.plugin.rule.outcomes import RankEnd, Refusal, TestVerdict
from pytest_msrun.plugin.rule.records import RankLog, load_rank_log, records_path
from pytest_msrun.plugin.rule.verdict import judge


@dataclass(frozen=True)
class JobRun:
    """The outcome of a test's job, before merging reports."""

    reproduce_lines: list[str]
    exit_codes: list[int | None]
    timed_out: bool
    timeout: float
    started: float
    ended: float
    ranks: dict[int, RankEnd] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    stacks_dir: str = ""  # where each rank's stacks file is (records.stacks_path): every frame
    state: dict[str, Any] | None = None  # the control plane's view at the timeout
    msrun_logs: list[str] = field(default_factory=list)
    launch_error: str = ""
    exit_hung: list[int] = field(default_factory=list)  # ranks that did not exit after every session ended
    exit_timeout: float = 0.0
    note: str = ""  # how the test ran, when not as asked (a warm world's test run as a fresh job)
    # at the deadline, where each rank's record file stood: what lies beyond is not a result
    cutoff: dict[int, int] | None = None
    running: list[int] | None = None  # at the deadline, the ranks whose processes still ran
    holdings: tuple[str, ...] = ()  # a dry run's ranks side by side (engine/holdings.py)

    def reproduce(self, cwd: str) -> str:
        lines = [f"cd {shlex.quote(cwd)}"]
        several = len(self.reproduce_lines) > 1
        lines += [line + (" &" if several else "") for line in self.reproduce_lines]
        if several:
            lines.append("wait")
        return "\n".join(lines)


@dataclass(frozen=True)
class TestRecord:
    """A test's complete record, as far as it goes: ranks, their records, their ends, the job's run."""

    __test__ = False  # not a pytest test class

    nodeid: str
    ranks: list[int]
    logs: dict[int, RankLog]
    run: JobRun
    log_dir: str
    leaks: dict[int, list[str]] = field(default_factory=dict)
    own_logs: dict[int, str] = field(default_factory=dict)  # a warm test's part of each rank's log
    leaks_fail: bool = False  # --msrun-leaks=error: what the test left behind fails its teardown
    notes: list[str] = field(default_factory=list)  # why its warm world ended after it (--msrun-max-rss)
    refusal: Refusal | None = None  # its job never ran (a bad marker, a skip, no room, no devices)
    # a suite's test (``pmsrun ... pytest``): the ranks whose process end answers to it (their last
    # test), and whether a failure elsewhere in the suite explains msrun stopping ranks
    suite: tuple[frozenset[int], bool] | None = None

    @classmethod
    def load(cls, nodeid: str, ranks: list[int], paths: Any, run: JobRun) -> TestRecord:
        """``paths``: where the ranks wrote their records (``report_dir``) and logs (``log_dir``)."""
        cutoff = run.cutoff or {}
        logs = {
            rank: load_rank_log(records_path(str(paths.report_dir), rank), rank, cutoff.get(rank)) for rank in ranks
        }
        for rank in run.exit_hung:  # measured by the controller: every session had ended
            logs.setdefault(rank, RankLog(rank)).exit_hang = {
                "grace": run.exit_timeout,
                "ts": run.ended,
                "after": "after every rank's pytest session ended (--msrun-exit-timeout)",
            }
        return cls(nodeid, ranks, logs, run, str(paths.log_dir))

    @functools.cached_property
    def verdict(self) -> TestVerdict:
        """The rule's verdict on this record. A record is a value, so it is judged once: every
        reporter reads the same verdict (a later fact makes a new record, judged in its turn)."""
        run = self.run
        launch = Refusal("failed", "msrun could not start the job", run.launch_error) if run.launch_error else None
        return judge(
            self.nodeid,
            self.ranks,
            self.logs,
            run.ranks,
            scope="job" if self.suite is None else "suite",
            final=None if self.suite is None else self.suite[0],
            failed_elsewhere=self.suite is not None and self.suite[1],
            timed_out=run.timed_out,
            timeout=run.timeout,
            job_ended=run.ended,
            leaks=self.leaks if self.leaks_fail else {},
            refusal=self.refusal or launch,
            running=run.running or (),
        )


def suite_records(logs: dict[int, RankLog], ends: dict[int, RankEnd], ended: float) -> list[TestRecord]:
    """A suite's tests (``pmsrun ... pytest``: every rank ran the whole suite), in the order the
    ranks ran them, each as a record: every rank's records and process end; a rank's end answers to
    the last test it ran; a rank msrun stopped is excused when a failure is reported anywhere."""
    ranks = sorted(logs)
    order = dict.fromkeys(nodeid for rank in ranks for nodeid in [*(logs[rank].collected or []), *logs[rank].tests])
    run = JobRun([], [], False, 0.0, ended, ended, ranks=ends)
    elsewhere = failed_anywhere(logs, ends)  # what may explain msrun stopping a rank
    last = {rank: logs[rank].last_test for rank in ranks}
    return [
        TestRecord(nodeid, ranks, logs, run, "", suite=(frozenset(r for r in ranks if last[r] == nodeid), elsewhere))
        for nodeid in order
    ]


def failed_anywhere(logs: dict[int, RankLog], ends: dict[int, RankEnd]) -> bool:
    """Whether the suite's record holds a failure that can explain msrun stopping ranks - a failed
    report or collection, a timeout, a hang at exit, a process that ended badly by itself - read
    from the record (each test is then judged once, knowing it)."""
    return any(
        log.reported_failure() or log.exit_hang is not None or any(t.timeout is not None for t in log.tests.values())
        for log in logs.values()
    ) or any(end.returncode not in (0, None) and not end.terminated_by_msrun for end in ends.values())
