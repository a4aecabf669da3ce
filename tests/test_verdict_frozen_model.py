"""The frozen record, property-tested: what a rank writes after a test's deadline never changes its
verdict, nor does how a rank still running at the deadline ends after it; a rank msrun found past
its deadline never passes; and a verdict that would break the invariant is failed closed.

Records go through the real writer and reader (:class:`RecordWriter`, :func:`load_rank_log`): the
deadline is where each rank's record file stood (a byte offset), or - for a rank msrun found late -
the deadline's time.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_verdict_model import NODEID, end_of, job, records, report, run_rule

from pytest_msrun.plugin.rule import verdict as verdict_module
from pytest_msrun.plugin.rule.outcomes import PhaseVerdict, RankEnd, TestVerdict
from pytest_msrun.plugin.rule.records import RankLog, RecordWriter, load_rank_log, records_path, sizes
from pytest_msrun.plugin.rule.verdict import judge

PHASES = ("setup", "call", "teardown")


def write_trace(directory: str, rank: int, t: dict, late: list[tuple[str, str]]) -> int:
    """Write rank ``rank``'s records of trace ``t``; the cutoff (its size at the deadline); then
    ``late`` reports after it. Returns the cutoff."""
    writer = RecordWriter(records_path(directory, rank), rank, 4)
    writer.write("start", pid=1000 + rank, log="", main_thread=1)
    writer.write("collected", nodeids=[NODEID])
    for when in PHASES:
        if when == "call" and t["setup"] != "passed":
            continue
        if when == "teardown" and t["setup"] is None:
            break
        writer.write("phase", nodeid=NODEID, when=when, offset=0)
        word = t[when]
        if word is None:
            break
        writer.write("report", data=report(when, word))
    writer.fh.flush()
    cutoff = sizes(directory, [rank])[rank]
    for when, word in late:
        writer.write("report", data=report(when, word))
    writer.close()
    return cutoff


def frozen_verdict(j: dict, late: dict[int, list[tuple[str, str]]], *, truncate: bool) -> TestVerdict:
    """The verdict from records written to disk, frozen at the deadline (``truncate``: the files
    cut there instead - what the verdict must equal)."""
    with tempfile.TemporaryDirectory() as directory:
        logs, ends = {}, {}
        for rank, t in j["traces"].items():
            if t["collect_skip"] or rank not in j["reached"]:
                return run_rule(j)  # collection skips and unreached ranks: no deadline story here
            cutoff = write_trace(directory, rank, t, late.get(rank, []))
            path = records_path(directory, rank)
            if truncate:
                os.truncate(path, cutoff)
                logs[rank] = load_rank_log(path, rank)
            else:
                logs[rank] = load_rank_log(path, rank, cutoff)
            ends[rank] = end_of(t, 100.0)
        return judge(NODEID, sorted(j["traces"]), logs, ends, scope=j["scope"], final=j["final"], timed_out=True)


late_reports = st.lists(
    st.tuples(st.sampled_from(PHASES), st.sampled_from(["passed", "failed", "skipped"])), max_size=3
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job(), st.dictionaries(st.integers(0, 3), late_reports, max_size=4))
def test_what_arrives_after_the_deadline_never_changes_the_verdict(j, late):
    frozen = frozen_verdict(j, late, truncate=False)
    cut = frozen_verdict(j, late, truncate=True)
    assert (frozen.outcome, frozen.failing_ranks) == (cut.outcome, cut.failing_ranks)
    assert [(p.phase, p.outcome) for p in frozen.phases] == [(p.phase, p.outcome) for p in cut.phases]


# how a process can end after the deadline: by itself (asked for its stacks, told to quit), crashing,
# killed, or stopped by msrun's teardown
LATE_ENDS = st.sampled_from([("exit", 0), ("exit", 1), ("exit", 5), ("exit", -11), ("exit", -9), ("stopped", None)])


def same_verdict(a: TestVerdict, b: TestVerdict) -> bool:
    return (a.outcome, a.failing_ranks, a.cells, [(p.phase, p.outcome) for p in a.phases]) == (
        b.outcome,
        b.failing_ranks,
        b.cells,
        [(p.phase, p.outcome) for p in b.phases],
    )


@settings(max_examples=1000, deadline=None)
@given(job(), st.data())
def test_how_a_rank_running_at_the_deadline_ends_after_it_never_changes_the_verdict(j, data):
    """The ranks whose processes ran when a timed-out test's record was frozen: judged with the
    ends they came to after it, the verdict is the one judged with them still running."""
    ranks = sorted(j["traces"])
    running = data.draw(st.sets(st.sampled_from(ranks), min_size=1))
    logs = {
        r: records(r, t, j["stamps"][r]) if r in j["reached"] else RankLog(r, started=True)
        for r, t in j["traces"].items()
    }
    at_deadline = {r: end_of(t, 100.0) for r, t in j["traces"].items()}
    at_deadline.update({r: RankEnd(returncode=None, pid=1) for r in running})
    after = dict(at_deadline)
    after.update({r: end_of({"end": data.draw(LATE_ENDS)}, 200.0) for r in sorted(running)})
    kw = {"scope": j["scope"], "final": j["final"], "timed_out": True, "timeout": 5.0, "running": running}
    frozen, later = judge(NODEID, ranks, logs, at_deadline, **kw), judge(NODEID, ranks, logs, after, **kw)
    assert same_verdict(frozen, later), (frozen.outcome, frozen.cells, later.outcome, later.cells)
    if running & j["final"] and not any(t["collect_skip"] for t in j["traces"].values()):
        assert not later.passing  # a rank whose end answers to this test ran past its deadline


@settings(max_examples=1000, deadline=None)
@given(job(), st.data())
def test_a_rank_msrun_found_past_its_deadline_never_passes(j, data):
    """msrun found a rank still there after its deadline (it could not end itself) - inside this
    test, or after it as its last: whatever its records say before the deadline, the test does not
    pass, and that rank is named."""
    live = [r for r, t in j["traces"].items() if r in j["reached"] and not t["collect_skip"] and t["setup"] is not None]
    if not live:
        return
    rank = data.draw(st.sampled_from(live))
    logs, ends = {}, {}
    for r, t in j["traces"].items():
        logs[r] = records(r, t, j["stamps"][r]) if r in j["reached"] else RankLog(r, started=True)
        ends[r] = end_of(t, j["stamps"][r][2] + 1)
    if logs[rank].finished:
        logs[rank].finished = False  # msrun found it inside its test, not at its exit
    logs[rank].past_deadline({"due": 150.0, "seconds": 5.0, "what": NODEID})
    ends[rank] = end_of({"end": ("stopped", None)}, 151.0)
    v = judge(NODEID, sorted(j["traces"]), logs, ends, scope="suite", final={*j["final"], rank})
    assert not v.passing, (v.outcome, v.cells)
    assert rank in v.failing_ranks


def test_a_verdict_that_breaks_the_invariant_is_failed_closed(monkeypatch):
    """A rule that (by a bug) passes a test a rank failed: the invariant, read from the record alone,
    turns it into an error that says so - in every mode, whatever called the rule."""
    t = {"collect_skip": False, "setup": "passed", "call": "failed", "subtests": [], "teardown": "passed"}
    j = {
        "traces": {0: {**t, "end": ("exit", 1), "finished": True, "exitstatus": 1}},
        "scope": "job",
        "reached": {0},
        "final": {0},
        "elsewhere": False,
        "stamps": {0: [1.0, 2.0, 3.0]},
    }
    honest = run_rule(j)
    assert honest.outcome == "failed"

    def lying(self):
        return TestVerdict(NODEID, [PhaseVerdict("call", "passed", {})], {0: "passed"}, "passed")

    monkeypatch.setattr(verdict_module.Judge, "verdict", lying)
    closed = run_rule(j)
    assert closed.outcome == "error" and not closed.passing
    assert "although rank 0 failed its call" in closed.note
    assert any(p.phase == "teardown" and p.outcome == "failed" and p.message for p in closed.phases)


@settings(max_examples=1000, deadline=None)
@given(job())
def test_one_vocabulary_every_view_says_the_same(j):
    """The console, JUnit, the HTML page and the suite table read one outcome: a passing verdict
    is shown as itself, a failing one as pytest's error (setup/teardown) or failure (call)."""
    from pytest_msrun.plugin.rule.outcomes import OUTCOMES, shown

    v = run_rule(j)
    assert v.outcome in OUTCOMES
    if v.passing:
        assert shown(v) == v.outcome
    else:
        failed = {p.phase for p in v.phases if p.outcome == "failed"}
        assert shown(v) == ("failed" if failed == {"call"} else "error"), (v.outcome, failed)
