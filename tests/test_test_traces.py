"""Each marked test in its job's trace (``--msrun-trace=DIR``, ``pmsrun --trace``): a span per test
per rank with its phases nested, an instant where a rank failed a phase, the verdict on the
``tests`` lane, and an end line that says what the processes' exit means and the tests' tally -
in warm worlds, forking worlds, fresh jobs and suite mode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import job_args
from hypothesis import example, given
from hypothesis import strategies as st

from pytest_msrun.plugin.reports.tracetests import tally
from pytest_msrun.plugin.reports.tracetests import test_events as events_of
from pytest_msrun.plugin.rule.outcomes import TestVerdict
from pytest_msrun.plugin.rule.records import PHASES, PhaseStart, RankLog, RankTest

RANK_PID, TESTS_PID, MSRUN_PID = 1000, 3, 1

TWO = """
import pytest

@pytest.mark.msrun(worker_num=2{extra})
def test_passes(rank):
    pass

@pytest.mark.msrun(worker_num=2{extra})
def test_fails_on_rank_1(rank):
    assert rank != 1, "rank 1 disagrees"
"""


def _events(paths: list[Path]) -> list[dict[str, Any]]:
    assert paths, "no trace written"
    return [ev for path in paths for ev in json.loads(path.read_text())["traceEvents"]]


def _within(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def check_tests_in_trace(events: list[dict[str, Any]], names: tuple[str, str]) -> list[str]:
    """The two tests' spans, phases, failure and verdicts are in ``events``; returns the end lines."""
    passing, failing = names
    for rank in (0, 1):
        lane = [ev for ev in events if ev["pid"] == RANK_PID + rank and ev.get("tid") == 1 and ev["ph"] == "X"]
        tests = {ev["name"]: ev for ev in lane if "verdict" in ev.get("args", {})}
        assert set(tests) == {passing, failing}, lane
        assert tests[passing]["args"]["verdict"] == "passed"
        assert tests[failing]["args"]["verdict"] == "failed"
        assert tests[failing]["args"]["on this rank"] == ("failed" if rank == 1 else "passed")
        for test in tests.values():
            phases = [ev for ev in lane if ev["name"] in ("setup", "call", "teardown") and _within(ev, test)]
            assert [p["name"] for p in sorted(phases, key=lambda p: p["ts"])] == ["setup", "call", "teardown"]
        calls = [ev for ev in lane if ev["name"] == "call" and _within(ev, tests[failing])]
        assert calls[0]["args"]["outcome"] == ("failed" if rank == 1 else "passed")
    failures = [ev for ev in events if ev["ph"] == "i" and ev["name"] == "failed in call"]
    assert [(ev["pid"], ev["tid"]) for ev in failures] == [(RANK_PID + 1, 1)]
    assert "rank 1 disagrees" in failures[0]["args"]["message"]
    verdicts = {ev["args"]["nodeid"].split("::")[-1]: ev for ev in events if ev["pid"] == TESTS_PID and ev["ph"] != "M"}
    assert {k: v["args"]["verdict"] for k, v in verdicts.items()} == {passing: "passed", failing: "failed"}
    assert verdicts[failing]["args"]["ranks"] == {"0": "passed", "1": "failed"}
    assert "rank 1 disagrees" in verdicts[failing]["args"]["message"]
    assert any(
        ev["name"] == "process_name" and ev["args"]["name"] == "tests" for ev in events if ev["pid"] == TESTS_PID
    )
    ends = [ev["name"] for ev in events if ev["pid"] == MSRUN_PID and ev["name"].split(":")[0].endswith(" ended")]
    ends = [name for name in ends if name.startswith(("job ended", "world ended"))]
    assert ends and "job ended: succeeded (0)" not in ends, ends
    return ends


@pytest.mark.parametrize("worlds", ["warm", "forking"])
def test_a_worlds_trace_shows_each_test(pytester: pytest.Pytester, worlds: str) -> None:
    pytester.makepyfile(test_two=TWO.format(extra=""))
    traces = pytester.path / "traces"
    mode = "fresh" if worlds == "forking" else "warm"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", f"--msrun-trace={traces}", f"--msrun-worlds={mode}"
    )
    result.assert_outcomes(passed=1, failed=1)
    files = sorted(traces.glob("*.trace.json"))
    assert len(files) == 1, "one world for both tests"
    ends = check_tests_in_trace(_events(files), ("test_passes", "test_fails_on_rank_1"))
    assert ends == ["world ended: ranks exited 0; tests: 1 passed, 1 failed"]


def test_a_fresh_jobs_trace_shows_its_test(pytester: pytest.Pytester) -> None:
    # dry runs are fresh jobs: one job, and one trace, per test
    pytester.makepyfile(test_two=TWO.format(extra=", sim_level=0"))
    traces = pytester.path / "traces"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", f"--msrun-trace={traces}")
    result.assert_outcomes(passed=1, failed=1)
    files = sorted(traces.glob("*.trace.json"))
    assert len(files) == 2, "a job per test"
    ends = check_tests_in_trace(_events(files), ("test_passes", "test_fails_on_rank_1"))
    assert sorted(ends) == [
        "job ended: msrun failed (1); tests: 1 failed",
        "job ended: ranks exited 0; tests: 1 passed",
    ]


REFUSED = """
import pytest

@pytest.mark.msrun(worker_num=0)
def test_bad_marker():
    pass

@pytest.mark.skip(reason="not here")
@pytest.mark.msrun(worker_num=2)
def test_skipped():
    pass
"""


@pytest.mark.parametrize("mode", ["warm", "fresh"])
def test_a_refused_test_has_a_trace_that_says_why(pytester: pytest.Pytester, mode: str) -> None:
    """A test whose job never ran (a bad marker, a skip) is a record judged like any other: its
    own trace holds its verdict and the reason on the tests lane."""
    pytester.makepyfile(test_refused=REFUSED)
    traces = pytester.path / "traces"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", f"--msrun-trace={traces}", f"--msrun-worlds={mode}"
    )
    result.assert_outcomes(errors=1, skipped=1)
    files = sorted(traces.glob("*.trace.json"))
    assert [f.name.split("-refused-")[0] for f in files] == ["test_bad_marker", "test_skipped"], files
    verdicts = {}
    for path in files:
        events = json.loads(path.read_text())["traceEvents"]
        assert any(ev["name"] == "process_name" and ev["args"]["name"] == "tests" for ev in events)
        (said,) = [ev for ev in events if ev["pid"] == TESTS_PID and ev["ph"] != "M"]
        verdicts[said["args"]["nodeid"].split("::")[-1]] = said["args"]
    assert verdicts["test_bad_marker"]["verdict"] == "error"
    assert "worker_num" in verdicts["test_bad_marker"]["refused"]
    assert verdicts["test_skipped"]["verdict"] == "skipped"
    assert verdicts["test_skipped"]["refused"] == "not here"


def test_a_suites_trace_shows_each_test(msrun) -> None:
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_two.py").write_text(TWO.replace("@pytest.mark.msrun(worker_num=2{extra})\n", ""))
    trace = msrun.cwd / "suite.trace.json"
    job = msrun.run(
        job_args(2, f"--trace={trace}", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "suite")
    )
    assert job.returncode == 1, job.stdout + job.stderr
    ends = check_tests_in_trace(_events([trace]), ("test_passes", "test_fails_on_rank_1"))
    assert ends == ["job ended: failed (1); tests: 1 passed, 1 failed"]


phase_times = st.lists(
    st.tuples(st.floats(1e9, 2e9), st.one_of(st.none(), st.floats(0, 100)), st.booleans()), min_size=1, max_size=3
)


@given(ranks=st.dictionaries(st.integers(0, 7), phase_times, min_size=1, max_size=4), until=st.floats(1e9, 2.1e9))
@example(ranks={0: [(1073741725.0, 99.556640625, True)]}, until=1e9)  # a span through seconds moved a µs
def test_every_phase_lies_within_its_test_and_every_test_within_its_verdict(
    ranks: dict[int, list[tuple[float, float | None, bool]]], until: float
) -> None:
    """Built from any record: each rank's phases lie in its test span, which lies in the verdict's
    span on the tests lane; a phase never finished ends at ``until`` (never before it began)."""
    nodeid = "t.py::test_x"
    logs = {}
    for rank, phases in ranks.items():
        test = RankTest(nodeid)
        for when, (start, length, finished) in zip(PHASES, phases):
            test.started[when] = PhaseStart(start, None)
            if finished and length is not None:
                test.reports[when] = {"start": start, "stop": start + length, "outcome": "passed"}
        logs[rank] = RankLog(rank, tests={nodeid: test})
    verdict = TestVerdict(nodeid, [], dict.fromkeys(ranks, "passed"), "passed")
    events = events_of(verdict, "passed", logs, until)
    (lane,) = [ev for ev in events if ev["pid"] == TESTS_PID]
    for rank, phases in ranks.items():
        row = [ev for ev in events if ev["pid"] == RANK_PID + rank]
        (test,) = [ev for ev in row if ev["name"] == "test_x"]
        spans = [ev for ev in row if ev["name"] in PHASES]
        assert [ev["name"] for ev in spans] == list(PHASES[: len(phases)])
        assert all(ev["dur"] >= 0 and _within(ev, test) for ev in spans) and _within(test, lane)


@given(st.lists(st.sampled_from(["passed", "failed", "error", "skipped", "xfailed", "weird"]), max_size=20))
def test_the_tally_counts_every_outcome_once(outcomes: list[str]) -> None:
    said = tally(outcomes)
    counted = {} if said == "none ran" else {k: int(n) for n, k in (part.split(" ", 1) for part in said.split(", "))}
    assert counted == {k: outcomes.count(k) for k in set(outcomes)}
