"""The one verdict rule on hand-made rank records (deterministic versions of races jobs can hit).

Plugin mode judges with ``scope="job"`` (the ranks were started for this test), suite mode with
``scope="suite"`` (every rank runs the whole suite); the rule is the same.
"""

from __future__ import annotations

import pytest

from pytest_msrun.plugin.records import PhaseStart, RankLog, RankTest
from pytest_msrun.plugin.verdict import RankEnd, judge

NODEID = "test_x.py::test_it"


def rep(when: str, outcome: str, longrepr=None, **extra) -> dict:
    return {"nodeid": NODEID, "when": when, "outcome": outcome, "longrepr": longrepr, **extra}


PASS = {"setup": rep("setup", "passed"), "call": rep("call", "passed"), "teardown": rep("teardown", "passed")}


def logs(**per_rank: dict) -> dict[int, RankLog]:
    """``r0={...reports...}``; a rank with ``started=[phases]`` began those phases."""
    out = {}
    for key, spec in per_rank.items():
        rank = int(key[1:])
        reports = {k: v for k, v in spec.items() if k in ("setup", "call", "teardown")}
        test = RankTest(NODEID, reports=reports, stamps={w: 100.0 + rank for w in reports})
        for when in spec.get("started", list(reports)):
            test.started[when] = PhaseStart(99.0 + rank, 0)
        log = RankLog(rank, started=True, finished=spec.get("finished", True), exitstatus=0)
        if test.started or test.reports:
            log.tests[NODEID] = test
        out[rank] = log
    return out


def test_rank_stopped_before_setup_is_reported_with_the_failure_that_caused_it():
    failing = dict(PASS, call=rep("call", "failed", "AssertionError: boom"))
    records = logs(r0=PASS, r1=failing, r2={"finished": False})
    ends = {
        0: RankEnd(returncode=-15, terminated_by_msrun=True),
        1: RankEnd(returncode=1),
        2: RankEnd(returncode=-15, terminated_by_msrun=True, stop_reason="rank 1 exited with code 1"),
    }
    v = judge(NODEID, [0, 1, 2], records, ends)
    assert [(p.phase, p.outcome) for p in v.phases] == [("setup", "passed"), ("call", "failed"), ("teardown", "passed")]
    call = v.phases[1]
    assert [i.rank for i in call.issues] == [1] and call.stopped == [2]
    assert v.cells == {0: "passed", 1: "failed", 2: "stopped"} and v.outcome == "failed"


def test_rank_stopped_with_no_failure_anywhere_is_a_failure():
    records = logs(r0=PASS, r1={"finished": False})
    ends = {0: RankEnd(returncode=0), 1: RankEnd(returncode=-15, terminated_by_msrun=True, stop_reason="x")}
    v = judge(NODEID, [0, 1], records, ends)
    assert v.phases[0].phase == "setup" and v.phases[0].outcome == "failed"
    assert "rank 1 was stopped by msrun during the setup phase" in v.phases[0].issues[0].summary
    assert "(terminated by msrun: x)" in v.phases[0].issues[0].summary


def test_missing_record_after_exit_zero_is_a_failure():
    records = logs(r0=PASS, r1={"setup": PASS["setup"], "started": ["setup", "call"], "finished": False})
    v = judge(NODEID, [0, 1], records, {0: RankEnd(returncode=0), 1: RankEnd(returncode=0)})
    assert [(p.phase, p.outcome) for p in v.phases] == [("setup", "passed"), ("call", "failed"), ("teardown", "passed")]
    assert "rank 1 left no record during the call phase and exited with code 0" in v.phases[1].issues[0].summary
    assert v.cells[1] == "crashed (exit 0)"


def test_a_crash_in_call_is_reported_even_when_another_rank_failed_setup():
    records = logs(
        r0={"setup": rep("setup", "failed", "fixture broke")}, r1={"setup": PASS["setup"], "started": ["setup", "call"]}
    )
    ends = {0: RankEnd(returncode=1), 1: RankEnd(returncode=-11)}
    v = judge(NODEID, [0, 1], records, ends)
    assert [p.phase for p in v.phases] == ["setup", "teardown"] or [p.phase for p in v.phases] == ["setup"]
    assert sorted(i.rank for i in v.phases[0].issues) == [0, 1]
    assert v.cells == {0: "error", 1: "crashed (SIGSEGV)"}


@pytest.mark.parametrize(
    "r0,r1,outcome,xfail",
    [
        (("skipped", False), ("skipped", False), "skipped", False),
        (("skipped", False), ("passed", False), "failed", False),
        (("skipped", True), ("passed", True), "skipped", True),
        (("passed", True), ("passed", True), "passed", True),
        (("skipped", True), ("skipped", True), "skipped", True),
        (("failed", False), ("skipped", True), "failed", False),
        (("strict", True), ("skipped", True), "skipped", True),
        (("strict", True), ("strict", True), "failed", False),
    ],
    ids=[
        "all-skip",
        "mixed-skip",
        "xfail-one-rank",
        "xpass-all",
        "xfail-all",
        "fail-beats-xfail",
        "strict-xfail-fails-on-one-rank-is-xfail",
        "strict-xpass-everywhere-fails",
    ],
)
@pytest.mark.parametrize("scope", ["job", "suite"])
def test_outcome_table(r0, r1, outcome, xfail, scope):
    def call(spec):
        kind, wasxfail = spec
        if kind == "strict":  # pytest's own report of a strict xfail that passed
            return rep("call", "failed", "[XPASS(strict)] reason")
        extra = {"wasxfail": "reason"} if wasxfail else {}
        longrepr = ["test_x.py", 3, "Skipped: why"] if kind == "skipped" and not wasxfail else "AssertionError"
        return rep("call", kind, None if kind == "passed" else longrepr, **extra)

    records = logs(r0=dict(PASS, call=call(r0)), r1=dict(PASS, call=call(r1)))
    v = judge(NODEID, [0, 1], records, {0: RankEnd(returncode=0), 1: RankEnd(returncode=0)}, scope=scope)
    merged = v.phases[1]
    assert merged.outcome == outcome
    assert (merged.wasxfail is not None) == xfail


def test_suite_scope_a_test_a_rank_never_began_did_not_run_there():
    records = logs(r0=PASS, r1={})
    ends = {0: RankEnd(returncode=0), 1: RankEnd(returncode=-11)}
    v = judge(NODEID, [0, 1], records, ends, scope="suite")
    assert v.cells == {0: "passed", 1: "not run"} and v.outcome == "incomplete" and v.not_run == [1]
    # the same records in a job made for this test: rank 1 died before it
    job = judge(NODEID, [0, 1], records, ends, scope="job")
    assert job.outcome == "error" and "killed by SIGSEGV" in job.first_issue.summary


def test_suite_scope_a_rank_stopped_inside_a_test_is_not_blamed():
    records = logs(r0={"setup": PASS["setup"], "started": ["setup", "call"]}, r1=PASS)
    ends = {
        0: RankEnd(returncode=-15, terminated_by_msrun=True, stop_reason="rank 2 exited with code 3"),
        1: RankEnd(0),
    }
    v = judge(NODEID, [0, 1], records, ends, scope="suite")
    assert v.cells == {0: "stopped", 1: "passed"} and v.outcome == "incomplete"
    assert not v.failing_ranks


def test_timeout_record_of_a_rank():
    records = logs(r0={"setup": PASS["setup"], "started": ["setup", "call"]}, r1=PASS)
    records[0].tests[NODEID].timeout = {"timeout": 3, "ts": 120.0, "when": "call"}
    v = judge(NODEID, [0, 1], records, {0: RankEnd(returncode=124), 1: RankEnd(0)}, scope="suite")
    assert v.cells[0] == "timeout" and v.outcome == "failed"
    assert v.first_issue.kind == "timeout" and "rank 0 timed out after 3 s in the call phase" in v.first_issue.summary
