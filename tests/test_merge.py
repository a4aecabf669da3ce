"""The one verdict rule on hand-made rank records (deterministic versions of races jobs can hit).

Plugin mode judges with ``scope="job"`` (the ranks were started for this test), suite mode with
``scope="suite"`` (every rank runs the whole suite); the rule is the same.
"""

from __future__ import annotations

import pytest

from pytest_msrun.plugin.rule.records import PhaseStart, RankLog, RankTest
from pytest_msrun.plugin.rule.verdict import RankEnd, judge

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
        failed = any(r.get("outcome") == "failed" for r in reports.values())
        log = RankLog(rank, started=True, finished=spec.get("finished", True), exitstatus=1 if failed else 0)
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
    # rank 2 was stopped before its setup: it is listed where the test failed (it did not run the call)
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
    v = judge(NODEID, [0, 1], records, ends, scope="suite", failed_elsewhere=True)
    assert v.cells == {0: "stopped", 1: "passed"} and v.outcome == "incomplete"
    assert not v.failing_ranks
    assert v.phases[1].outcome == "failed" and v.phases[1].stopped == [0]  # the call cannot pass without rank 0
    # with no failure reported anywhere, the stop itself is the failure
    alone = judge(NODEID, [0, 1], records, ends, scope="suite")
    assert alone.outcome == "failed" and alone.failing_ranks == [0]


def test_timeout_record_of_a_rank():
    records = logs(r0={"setup": PASS["setup"], "started": ["setup", "call"]}, r1=PASS)
    records[0].tests[NODEID].timeout = {"timeout": 3, "ts": 120.0, "when": "call"}
    v = judge(NODEID, [0, 1], records, {0: RankEnd(returncode=124), 1: RankEnd(0)}, scope="suite")
    assert v.cells[0] == "timeout" and v.outcome == "failed"
    assert v.first_issue.kind == "timeout" and "rank 0 timed out after 3 s in the call phase" in v.first_issue.summary


# ------------------------------------------------------------------ the process end counts (issue 16)
def test_a_rank_that_crashes_at_exit_after_passing_fails_the_teardown():
    for end, words in ((RankEnd(returncode=-11), "killed by SIGSEGV"), (RankEnd(returncode=3), "exited with code 3")):
        v = judge(NODEID, [0, 1], logs(r0=PASS, r1=PASS), {0: RankEnd(returncode=0), 1: end})
        assert v.outcome == "error" and not v.passing
        assert [(p.phase, p.outcome) for p in v.phases][-1] == ("teardown", "failed")
        issue = v.first_issue
        assert issue.rank == 1 and issue.kind == "exit" and words in issue.summary
        assert "reported every phase" in issue.summary


def test_pytest_exit_status_2_at_exit_is_not_explained_by_a_passing_session():
    v = judge(NODEID, [0, 1], logs(r0=PASS, r1=PASS), {0: RankEnd(returncode=0), 1: RankEnd(returncode=2)})
    assert v.outcome == "error" and v.cells[1] == "crashed (exit 2) at exit"


def test_a_crash_at_exit_while_another_rank_is_stopped_in_its_call_fails_the_call():
    records = logs(r0={"setup": PASS["setup"], "started": ["setup", "call"]}, r1=PASS)
    ends = {
        0: RankEnd(returncode=-15, terminated_by_msrun=True, stop_reason="rank 1 killed by SIGSEGV"),
        1: RankEnd(returncode=-11, ended=150.0),
    }
    v = judge(NODEID, [0, 1], records, ends)
    by = {p.phase: p for p in v.phases}
    assert by["call"].outcome == "failed" and by["call"].stopped == [0] and by["call"].cause.rank == 1
    assert v.outcome == "failed" and v.failing_ranks == [1]


def test_a_teardown_error_while_another_rank_is_stopped_in_its_call_fails_the_call():
    records = logs(
        r0={"setup": PASS["setup"], "started": ["setup", "call"]},
        r1=dict(PASS, teardown=rep("teardown", "failed", "RuntimeError: fixture")),
    )
    ends = {0: RankEnd(returncode=-15, terminated_by_msrun=True), 1: RankEnd(returncode=1)}
    v = judge(NODEID, [0, 1], records, ends)
    assert {p.phase: p.outcome for p in v.phases}["call"] == "failed" and v.outcome == "failed"


def test_a_rank_still_running_after_its_reports_at_the_timeout_hangs_at_exit():
    v = judge(NODEID, [0, 1], logs(r0=PASS, r1=PASS), {0: RankEnd(0), 1: RankEnd(pid=9)}, timed_out=True, timeout=7)
    assert v.outcome == "error" and v.cells[1] == "hung at exit"
    assert "was still running at the timeout (7 s): it hangs at exit" in v.first_issue.summary


def test_a_warm_world_rank_that_lives_on_ended_cleanly():
    v = judge(NODEID, [0, 1], logs(r0=PASS, r1=PASS), {0: RankEnd(alive=True), 1: RankEnd(alive=True)})
    assert v.outcome == "passed"


def test_a_failing_subtest_fails_the_test():
    records = logs(r0=PASS, r1=PASS)
    sub = rep("call", "failed", "AssertionError: sub", _report_type="SubTestReport", _ts=100.5)
    sub["_subtest.context"] = {"msg": "i=3", "kwargs": {}}
    sub["_subtest.description"] = "[i=3]"  # what the rank's pytest calls it
    records[1].tests[NODEID].more["call"] = [sub]
    records[1].exitstatus = 1  # pytest's "tests failed"
    v = judge(NODEID, [0, 1], records, {0: RankEnd(0), 1: RankEnd(1)})
    assert v.outcome == "failed" and v.failing_ranks == [1]
    assert "subtest [i=3] failed" in v.first_issue.summary


def test_every_rank_skipping_in_different_phases_or_at_collection_is_a_skip():
    skip_call = dict(PASS, call=rep("call", "skipped", ["test_x.py", 3, "Skipped: body"]))
    skip_setup = {"setup": rep("setup", "skipped", ["test_x.py", 3, "Skipped: fixture"]), "teardown": PASS["teardown"]}
    v = judge(NODEID, [0, 1], logs(r0=skip_call, r1=skip_setup), {0: RankEnd(0), 1: RankEnd(0)})
    assert v.outcome == "skipped" and [(p.phase, p.outcome) for p in v.phases][0] == ("setup", "skipped")
    collected = logs(r0={}, r1={})
    for log in collected.values():
        log.collected, log.exitstatus = [], 5
        log.collect_skips.append({"nodeid": "test_x.py", "outcome": "skipped", "longrepr": ["x", 1, "Skipped: no"]})
    v = judge(NODEID, [0, 1], collected, {0: RankEnd(5), 1: RankEnd(5)})
    assert v.outcome == "skipped" and v.phases[0].skip_reason == "Skipped: no"
    mixed = judge(NODEID, [0, 1], {0: collected[0], 1: logs(r1=PASS)[1]}, {0: RankEnd(5), 1: RankEnd(0)})
    assert mixed.outcome == "error" and "a test must skip on every rank or on none" in mixed.phases[0].message


def test_a_crash_is_ordered_by_when_it_happened_not_by_when_msrun_reaped_it(tmp_path):
    """Under load msrun reaps a crashed rank late; the peer's ClusterError about it is reported
    earlier. The crash's own time (its fatal-error dump, its error file) decides who failed first."""
    import os

    from pytest_msrun.plugin.rule.outcomes import death_time

    log = tmp_path / "worker_1.log"
    log.write_text(
        "test_x.py \nFatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
    )
    os.utime(log, (100.2, 100.2))
    assert death_time(str(log)) == 100.2
    (tmp_path / "worker_0.log").write_text("no dump here\n")
    assert death_time(str(tmp_path / "worker_0.log")) is None
    error = tmp_path / "worker_2.error.json"
    error.write_text('{"type": "ValueError", "message": "x", "traceback": "", "time": 99.5, "pid": 3}')
    (tmp_path / "worker_2.log").write_text("")
    assert death_time(str(tmp_path / "worker_2.log")) == 99.5

    peer = dict(PASS, call=rep("call", "failed", "ClusterError: rank 1 left the group"))
    records = logs(r0=peer, r1={"setup": PASS["setup"], "started": ["setup", "call"]})
    records[0].tests[NODEID].stamps["call"] = 100.5  # reported before msrun reaped rank 1
    ends = {0: RankEnd(returncode=1, ended=101.0), 1: RankEnd(returncode=-11, ended=103.0, died_at=100.2)}
    v = judge(NODEID, [0, 1], records, ends)
    assert v.first_issue.rank == 1 and v.first_issue.kind == "died"
    ends[1].died_at = None  # what the reap time alone would say
    assert judge(NODEID, [0, 1], records, ends).first_issue.rank == 0
