"""The merge rules on hand-made rank records (deterministic versions of races the jobs can hit)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_msrun.plugin.job import JobRun, RankStatus
from pytest_msrun.plugin.merge import Merger, RankRecords

NODEID = "test_x.py::test_it"


def _item():
    return SimpleNamespace(
        nodeid=NODEID, location=("test_x.py", 3, "test_it"), keywords={"test_it": 1}, path=Path("/tmp/test_x.py")
    )


def _rep(when: str, outcome: str, longrepr=None, **extra) -> pytest.TestReport:
    return pytest.TestReport(NODEID, ("test_x.py", 3, "test_it"), {}, outcome, longrepr, when, **extra)


def _records(**per_rank: dict[str, pytest.TestReport]) -> dict[int, RankRecords]:
    out = {}
    for key, reports in per_rank.items():
        rank = int(key[1:])
        rec = RankRecords(
            rank,
            reports=dict(reports),
            stamps={w: 100.0 + rank for w in reports},
            started=True,
            finished=True,
            exitstatus=0,
        )
        out[rank] = rec
    return out


def _merge(records, statuses, timed_out=False):
    run = JobRun(
        commands=[],
        exit_codes=[0],
        timed_out=timed_out,
        timeout=5.0,
        started=0.0,
        ended=1.0,
        ranks=statuses,
        msrun_logs=["msrun.log"],
    )
    merger = Merger(_item(), run, records, sorted(records), "first", "msrun ...", "/tmp/logs")
    return merger.merged_reports()


PASS = {"setup": _rep("setup", "passed"), "call": _rep("call", "passed"), "teardown": _rep("teardown", "passed")}


def test_rank_stopped_before_setup_is_reported_with_the_failure_that_caused_it():
    failing = dict(PASS, call=_rep("call", "failed", "AssertionError: boom"))
    records = _records(r0=PASS, r1=failing, r2={})
    records[2].finished = records[2].started = False
    statuses = {
        0: RankStatus(0, returncode=-15, terminated_by_msrun=True),
        1: RankStatus(1, returncode=1),
        2: RankStatus(2, returncode=-15, terminated_by_msrun=True),
    }
    reports = _merge(records, statuses)
    assert [(r.when, r.outcome) for r in reports] == [("setup", "passed"), ("call", "failed"), ("teardown", "passed")]
    text = reports[1].longreprtext
    assert "[rank 1] failed first" in text and "ranks 2 were stopped after the first failure" in text


def test_rank_stopped_with_no_failure_anywhere_is_a_failure():
    records = _records(r0=PASS, r1={})
    records[1].finished = False
    statuses = {0: RankStatus(0, returncode=0), 1: RankStatus(1, returncode=-15, terminated_by_msrun=True)}
    reports = _merge(records, statuses)
    assert reports[0].when == "setup" and reports[0].failed
    assert "rank 1 was stopped by msrun during the setup phase" in reports[0].longreprtext


def test_missing_record_after_exit_zero_is_a_failure():
    records = _records(r0=PASS, r1={"setup": PASS["setup"]})
    records[1].finished = False
    reports = _merge(records, {0: RankStatus(0, returncode=0), 1: RankStatus(1, returncode=0)})
    assert [(r.when, r.outcome) for r in reports] == [("setup", "passed"), ("call", "failed"), ("teardown", "passed")]
    assert "rank 1 left no record during the call phase and exited with code 0" in reports[1].longreprtext


@pytest.mark.parametrize(
    "r0,r1,outcome,xfail",
    [
        (("skipped", False), ("skipped", False), "skipped", False),
        (("skipped", False), ("passed", False), "failed", False),
        (("skipped", True), ("passed", True), "skipped", True),
        (("passed", True), ("passed", True), "passed", True),
        (("skipped", True), ("skipped", True), "skipped", True),
        (("failed", False), ("skipped", True), "failed", False),
    ],
    ids=["all-skip", "mixed-skip", "xfail-one-rank", "xpass-all", "xfail-all", "fail-beats-xfail"],
)
def test_outcome_table(r0, r1, outcome, xfail):
    def call(spec):
        kind, wasxfail = spec
        extra = {"wasxfail": "reason"} if wasxfail else {}
        longrepr = ("test_x.py", 3, "Skipped: why") if kind == "skipped" and not wasxfail else "AssertionError"
        return _rep("call", kind, None if kind == "passed" else longrepr, **extra)

    records = _records(r0=dict(PASS, call=call(r0)), r1=dict(PASS, call=call(r1)))
    reports = _merge(records, {0: RankStatus(0, returncode=0), 1: RankStatus(1, returncode=0)})
    merged = reports[1]
    assert merged.outcome == outcome
    assert hasattr(merged, "wasxfail") == xfail
