"""The verdict rule against an independent oracle, on thousands of generated rank traces.

A trace is what a job can leave behind for one test: per rank, how far it got through setup, call
(with subtests) and teardown and what each phase reported, whether it skipped the module at
collection, and how its process ended (an exit status that its pytest session may or may not
explain, a signal, a stop by msrun, a hang at exit, or living on in a warm world). The oracle below
states the invariant in a few lines, without the rule's code; the rule must agree with it on
whether a test passes, and on what it passes as.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.plugin.rule.records import PhaseStart, RankLog, RankTest
from pytest_msrun.plugin.rule.verdict import RankEnd, judge

NODEID = "test_m.py::test_t"
MODULE = "test_m.py"

# ------------------------------------------------------------------ the oracle
# A rank's trace: (collect_skip, setup, call, subtests, teardown, end, finished, exitstatus)
# setup/teardown: passed | failed | skipped | xfailed | None (no report: the rank died, hung or was
# stopped there); call: passed | failed | skipped | xfailed | xpassed | strict | None.


def oracle(traces: dict, final: set[int], failed_elsewhere: bool, reached: set[int]) -> str | None:
    """The test's passing outcome, or None when it must not pass. Straight from the invariant."""
    words = {}
    for rank, t in traces.items():
        if rank not in reached:
            return None  # a rank due to run it never began it
        if t["collect_skip"]:
            words[rank] = "skipped"
            continue
        if t["setup"] in (None, "failed"):
            return None
        if t["setup"] in ("skipped", "xfailed"):
            words[rank] = t["setup"]
        else:
            if t["call"] in (None, "failed") or "failed" in t["subtests"]:
                return None
            words[rank] = t["call"]
        if t["teardown"] in (None, "failed"):
            return None
        if rank in final and not clean_end(t, failed_elsewhere):
            return None
    if not words:
        return None
    values = set(words.values())
    if "skipped" in values:
        return "skipped" if values == {"skipped"} else None
    if "xfailed" in values:
        return "xfailed"
    if values == {"strict"}:
        return None
    if values & {"xpassed", "strict"}:
        return "xpassed"
    return "passed"


def clean_end(t: dict, failed_elsewhere: bool) -> bool:
    kind, code = t["end"]
    if kind == "alive":
        return True
    if kind == "stopped":
        return failed_elsewhere
    if kind != "exit":
        return False
    if code == 0:
        return True
    explained = t["finished"] and t["exitstatus"] == code
    reported_failure = t["call"] == "strict" or "failed" in t["subtests"]
    return explained and code == 1 and reported_failure


# ------------------------------------------------------------------ traces -> records
def report(when: str, word: str) -> dict:
    data = {"nodeid": NODEID, "when": when, "outcome": word, "longrepr": None}
    if word == "skipped":
        data["longrepr"] = [MODULE, 1, "Skipped: why"]
    elif word == "failed":
        data["longrepr"] = "AssertionError: boom"
    elif word == "xfailed":
        data.update(outcome="skipped", wasxfail="reason")
    elif word == "xpassed":
        data.update(outcome="passed", wasxfail="reason")
    elif word == "strict":
        data.update(outcome="failed", longrepr="[XPASS(strict)] reason")
    return data


def records(rank: int, t: dict, stamps: list[float]) -> RankLog:
    log = RankLog(rank, started=True, finished=t["finished"], exitstatus=t["exitstatus"])
    if t["collect_skip"]:
        log.collected = []
        log.collect_skips.append({"nodeid": MODULE, "outcome": "skipped", "longrepr": [MODULE, 1, "Skipped: no"]})
        return log
    test = RankTest(NODEID)
    for i, when in enumerate(("setup", "call", "teardown")):
        if when == "call" and t["setup"] != "passed":
            continue
        if when == "teardown" and t["setup"] is None:
            break
        test.started[when] = PhaseStart(stamps[i] - 0.5, 0)
        if when == "call":
            for j, sub in enumerate(t["subtests"]):
                data = {**report("call", sub), "_report_type": "SubTestReport", "_ts": stamps[1] - 0.1 * (j + 1)}
                data["_subtest.context"] = {"msg": f"sub{j}", "kwargs": {}}
                test.more.setdefault("call", []).append(data)
        word = t[when]
        if word is None:
            break
        test.reports[when] = report(when, word)
        test.stamps[when] = stamps[i]
    log.tests[NODEID] = test
    return log


def end_of(t: dict, at: float) -> RankEnd:
    kind, code = t["end"]
    if kind == "alive":
        return RankEnd(alive=True, pid=1)
    if kind == "stopped":
        return RankEnd(returncode=-15, ended=at, pid=1, terminated_by_msrun=True, stop_reason="rank 9 failed")
    if kind == "running":
        return RankEnd(returncode=None, pid=1)
    return RankEnd(returncode=code, ended=at, pid=1)


# ------------------------------------------------------------------ strategies
MARKS = ("none", "xfail", "strict")


@st.composite
def rank_trace(draw, mark: str) -> dict:
    t = {"collect_skip": False, "subtests": [], "call": None, "teardown": None}
    if draw(st.integers(0, 12)) == 0:
        t.update(collect_skip=True, setup=None, end=("exit", draw(st.sampled_from([5, 0, 1, -11]))))
        t.update(finished=True, exitstatus=5)
        return t
    t["setup"] = draw(st.sampled_from(["passed", "passed", "passed", "failed", "skipped", None]))
    if t["setup"] == "passed":
        calls = {
            "none": ["passed", "passed", "failed", "skipped", "xfailed", None],
            "xfail": ["xfailed", "xpassed", None],
            "strict": ["xfailed", "strict", None],
        }[mark]
        t["call"] = draw(st.sampled_from(calls))
        if mark == "none" and t["call"] is not None:
            t["subtests"] = draw(st.lists(st.sampled_from(["passed", "passed", "failed", "skipped"]), max_size=3))
    complete = t["setup"] is not None and (t["setup"] != "passed" or t["call"] is not None)
    if complete:
        t["teardown"] = draw(st.sampled_from(["passed", "passed", "passed", "failed", None]))
        complete = t["teardown"] is not None
    failed = "failed" in (t["setup"], t["call"], t["teardown"]) or "failed" in t["subtests"] or t["call"] == "strict"
    ends = [("exit", 0), ("exit", 1), ("exit", 2), ("exit", 3), ("signal", -11), ("stopped", None)]
    if complete:
        ends += [("alive", None), ("running", None), ("exit", 0), ("exit", 1 if failed else 0)]
    kind, code = draw(st.sampled_from(ends))
    t["end"] = ("exit", code) if kind == "signal" else (kind, code)
    t["finished"] = complete and draw(st.booleans())
    t["exitstatus"] = (1 if failed else 0) if t["finished"] else None
    return t


@st.composite
def job(draw) -> dict:
    n = draw(st.integers(1, 4))
    mark = draw(st.sampled_from(MARKS))
    traces = {rank: draw(rank_trace(mark)) for rank in range(n)}
    scope = draw(st.sampled_from(["job", "suite"]))
    reached = set(range(n))
    if scope == "suite":
        for rank, t in traces.items():
            if not t["collect_skip"] and t["setup"] is None and draw(st.booleans()):
                reached.discard(rank)  # never began it: no record of the test at all
    final = set(draw(st.lists(st.sampled_from(range(n)), unique=True))) if draw(st.booleans()) else set(range(n))
    stamps = {rank: sorted(draw(st.lists(st.floats(1, 100), min_size=3, max_size=3))) for rank in range(n)}
    return {
        "traces": traces,
        "scope": scope,
        "reached": reached,
        "final": final,
        "elsewhere": scope == "suite" and draw(st.booleans()),
        "stamps": stamps,
    }


def run_rule(j: dict, stamps: dict | None = None):
    stamps = stamps or j["stamps"]
    logs, ends = {}, {}
    for rank, t in j["traces"].items():
        if rank in j["reached"]:
            logs[rank] = records(rank, t, stamps[rank])
        else:
            logs[rank] = RankLog(rank, started=True)
        ends[rank] = end_of(t, stamps[rank][2] + 1)
    timed_out = any(t["end"][0] == "running" for t in j["traces"].values())
    return judge(
        NODEID,
        sorted(j["traces"]),
        logs,
        ends,
        scope=j["scope"],
        final=j["final"],
        failed_elsewhere=j["elsewhere"],
        timed_out=timed_out,
        timeout=5.0,
        job_ended=200.0,
    )


@settings(max_examples=3000, deadline=None)
@given(job())
def test_the_rule_agrees_with_the_oracle(j):
    expected = oracle(j["traces"], j["final"], j["elsewhere"], j["reached"])
    verdict = run_rule(j)
    if expected is None:
        assert not verdict.passing, (verdict.outcome, verdict.cells)
        assert verdict.outcome in ("failed", "error", "incomplete", "not run")
    else:
        assert verdict.outcome == expected, (verdict.outcome, verdict.cells)
    # a reported failure is always somebody's: every failing rank is named
    for rank, t in j["traces"].items():
        own = "failed" in (t["setup"], t["call"], t["teardown"]) or "failed" in t["subtests"]
        if own and rank in j["reached"] and not t["collect_skip"]:
            assert rank in verdict.failing_ranks


@settings(max_examples=1000, deadline=None)
@given(job(), st.randoms(use_true_random=False))
def test_the_verdict_does_not_depend_on_which_rank_finished_first(j, rnd: random.Random):
    shuffled = {rank: sorted(rnd.uniform(1, 100) for _ in range(3)) for rank in j["stamps"]}
    first, second = run_rule(j), run_rule(j, shuffled)
    assert first.outcome == second.outcome
    assert first.failing_ranks == second.failing_ranks
    assert [(p.phase, p.outcome) for p in first.phases] == [(p.phase, p.outcome) for p in second.phases]


@settings(max_examples=1000, deadline=None)
@given(job())
def test_the_root_cause_is_the_earliest_failure(j):
    verdict = run_rule(j)
    issues = verdict.issues
    if issues:
        assert verdict.first_issue is issues[0]
        assert all(issues[0].at <= i.at for i in issues)
        for phase in verdict.phases:  # a phase failed only by stopped ranks points at the root cause
            if phase.outcome == "failed" and not phase.issues and not phase.message:
                assert phase.stopped and phase.cause is verdict.first_issue


@settings(max_examples=1000, deadline=None)
@given(job())
def test_setup_and_call_verdicts_are_final_once_every_rank_finished_its_call(j):
    """A warm world logs setup and call before it runs the teardown: their verdicts must not change
    with what the teardown and the process ends add, when every rank finished its call."""
    traces = j["traces"]
    finished = all(
        t["collect_skip"] or (t["setup"] is not None and (t["setup"] != "passed" or t["call"] is not None))
        for t in traces.values()
    )
    if not finished or j["scope"] != "job":
        return
    early = {rank: {**t, "teardown": "passed", "end": ("alive", None)} for rank, t in traces.items()}
    before = run_rule({**j, "traces": early})
    after = run_rule(j)

    def first_phases(v):
        return [(p.phase, p.outcome, p.wasxfail) for p in v.phases if p.phase != "teardown"]

    assert first_phases(before) == first_phases(after)


@settings(max_examples=1000, deadline=None)
@given(job(), st.sampled_from(["setup", "call", "teardown"]))
def test_where_msrun_stopped_a_rank_does_not_change_the_verdict(j, cut):
    """msrun stops the other ranks when one fails: how far each got by then is chance, so a stopped
    rank's trace cut at any phase gives the same outcome, when a failure is reported in the setup or
    call (a call a rank did not finish cannot pass; one it finished can)."""
    traces = j["traces"]
    stopped = [r for r, t in traces.items() if t["end"][0] == "stopped" and not t["collect_skip"]]
    if not stopped or j["scope"] != "job":
        return
    first = run_rule(j)
    if not first.failing_ranks or any(r in first.failing_ranks for r in stopped):
        return  # the stopped ranks' own failures are part of the trace, not chance
    if not any(p.issues for p in first.phases if p.phase != "teardown"):
        return  # only a teardown failed: a rank stopped after its call did finish it, one stopped before did not
    rank = stopped[0]
    if traces[rank]["setup"] not in (None, "passed") or traces[rank]["call"] not in (None, "passed"):
        return  # what it reported is its own (a skip, a failure); only how far a passing rank got is chance
    cut_trace = dict(traces[rank], setup="passed", call="passed", teardown=None, subtests=[], finished=False)
    if cut == "setup":
        cut_trace.update(setup=None, call=None)
    elif cut == "call":
        cut_trace.update(call=None)
    second = run_rule({**j, "traces": {**traces, rank: cut_trace}})
    if rank not in second.failing_ranks:
        assert first.outcome == second.outcome, (first.outcome, second.outcome, cut)
