"""Collectives that can no longer complete fail at once, naming the peers and where they are;
hypothesis draws the same examples on every rank."""

from __future__ import annotations

import re
import uuid

import pytest
from conftest import MARK, job_args, wait_gone

CASES = """
import os

import pytest

from pytest_msrun import cluster
from pytest_msrun.control import cluster as implementation


@pytest.fixture(scope="module")
def synced(msrun):
    msrun.barrier()  # a module fixture's collective, outside any call: never failed for that
    return True


@pytest.mark.msrun(worker_num=2, timeout=60)
def test_left(rank, msrun, synced):
    msrun.barrier()
    if rank == 0:
        return
    msrun.barrier()


@pytest.mark.msrun(worker_num=2, timeout=60)
def test_caught(rank, msrun, synced):
    msrun.barrier()
    if rank == 1:
        with pytest.raises(cluster.CollectiveDeadlock, match="rank 0 has left test_caught's call"):
            msrun.all_gather(rank)


@pytest.mark.msrun(worker_num=2, timeout=60)
def test_mismatch(rank, msrun, synced):
    msrun.barrier()
    if rank == 1:
        implementation._group.seq += 1  # as after a collective only this rank entered, whose error it caught
        msrun.all_gather(rank)
    else:
        msrun.barrier()


@pytest.mark.msrun(worker_num=2, timeout=60)
def test_next(rank, msrun):
    assert msrun.all_gather(rank) == [0, 1]


@pytest.mark.msrun(worker_num=2, timeout=60)
def test_exits(rank, msrun, synced):
    msrun.barrier()
    if rank == 0:
        os._exit(0)
    msrun.barrier()
"""

HYPOTHESIS = """
import os

import pytest
from hypothesis import given, settings, strategies as st

ONE = os.environ.get("RANK_ID") == "0"  # rank 0 draws one example, rank 1 more


@pytest.mark.msrun(worker_num=2, timeout=60)
@settings(deadline=None, max_examples=1 if ONE else 20, database=None)
@given(xs=st.lists(st.integers(0, 1000), min_size=1))
def test_shrinks_alone(xs, rank, msrun):
    msrun.all_gather(len(xs))
    assert rank == 0  # rank 1 fails and shrinks while rank 0 has passed


@pytest.mark.msrun(worker_num=2, timeout=60)
@settings(deadline=None, database=None)
@given(x=st.integers(0, 100))
def test_fails_alike(x, rank, msrun):
    assert max(msrun.all_gather(x)) < 50  # on gathered values: every rank fails and shrinks alike


@pytest.mark.msrun(worker_num=2, timeout=60)
@settings(deadline=None, max_examples=15, database=None)
@given(x=st.integers(0, 2**64), xs=st.lists(st.text(), max_size=3))
def test_drawn(x, xs, rank):
    with open(os.path.join(os.environ["DRAWN"], f"rank{rank}"), "a") as fh:
        fh.write(f"{x} {xs!r}\\n")


@pytest.mark.msrun(worker_num=2, timeout=60)
@settings(deadline=None, max_examples=200, database=None)
@given(xs=st.lists(st.text(max_size=30), min_size=5, max_size=5))
def test_drawn_after_modules_only_one_rank_imported(xs, rank):
    # hypothesis also draws constants of the "local" modules imported so far (this package is
    # one, installed editable): rank 0 imported modules rank 1 did not
    if rank == 0:
        import pytest_msrun.binding.gen_bind_json, pytest_msrun.perfetto, pytest_msrun.engine.dryrun  # noqa
    with open(os.path.join(os.environ["DRAWN"], f"modules{rank}"), "a") as fh:
        fh.write(f"{xs!r}\\n")
"""


def _run(pytester, monkeypatch, source: str, *args: str):
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    pytester.makepyfile(test_cases=source)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=240)
    left = wait_gone(mark)
    assert not left, f"leftover processes: {[p.cmdline() for p in left]}"
    return result


def _call_seconds(text: str, name: str) -> float:
    found = re.search(rf"(\d+\.\d+)s (call|setup) .*::{name}\b", text)
    assert found is not None, name
    return float(found.group(1))


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_collectives_that_cannot_complete_fail_at_once_naming_the_peer(pytester, monkeypatch, worlds):
    result = _run(pytester, monkeypatch, CASES, "--durations=0", "--durations-min=0", f"--msrun-worlds={worlds}")
    text = result.stdout.str()
    result.assert_outcomes(passed=2, failed=3)
    assert re.search(
        r"CollectiveDeadlock: barrier failed on rank 1: barrier #\d+ cannot complete: "
        r"rank 0 has left test_left's call \(passed\)",
        text,
    ), text
    # two ranks in different collectives: each is told where the other is
    assert re.search(r"all_gather failed on rank 1: all_gather #(\d+) cannot complete: rank 0 is in barrier #\d+", text)
    assert re.search(r"barrier failed on rank 0: barrier #\d+ cannot complete: rank 1 is in all_gather #\d+", text)
    exited = r"rank 0 left the job \((its process exited with code 0|connection closed)\)"
    assert re.search(rf"barrier failed on rank 1: barrier #\d+ cannot complete: {exited}", text), text
    for name in ("test_left", "test_mismatch", "test_exits"):
        assert _call_seconds(text, name) < 30, name  # not the 60 s timeout
    # the traceback ends at the test's own call, as for a plugin's frames (--full-trace shows them)
    assert "cluster.py:" not in text and "fixtures.py:" not in text and "def _exchange" not in text, text
    assert re.search(r"^>\s+msrun\.(barrier|all_gather)\(", text, re.M), text


def test_a_hypothesis_test_shrinking_on_one_rank_fails_at_once_naming_the_other(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("DRAWN", str(tmp_path))
    result = _run(pytester, monkeypatch, HYPOTHESIS, "--durations=0", "--durations-min=0", "-k", "shrinks")
    text = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "[rank 1] failed first" in text
    assert re.search(r"all_gather #\d+ cannot complete: rank 0 has left test_shrinks_alone's call \(passed\)", text)
    assert _call_seconds(text, "test_shrinks_alone") < 30


def test_a_property_failing_alike_on_every_rank_shrinks_in_step(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, HYPOTHESIS, "-k", "alike")
    text = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "also failed on ranks" in text and re.search(r"x=50,", text) and "CollectiveDeadlock" not in text
    # the falsifying example names the msrun fixture as its repr does, not all its fields
    assert re.search(r"msrun=<msrun rank \d/2>,", text) and "MsrunContext(" not in text, text


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_hypothesis_draws_the_same_examples_on_every_rank(pytester, monkeypatch, tmp_path, worlds):
    monkeypatch.setenv("DRAWN", str(tmp_path))
    result = _run(pytester, monkeypatch, HYPOTHESIS, "-k", "drawn and not modules", f"--msrun-worlds={worlds}")
    result.assert_outcomes(passed=1)
    drawn = [(tmp_path / f"rank{rank}").read_text().splitlines() for rank in (0, 1)]
    assert len(drawn[0]) >= 15 and drawn[0] == drawn[1]


def test_hypothesis_draws_the_same_examples_whatever_modules_each_rank_imported(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("DRAWN", str(tmp_path))
    result = _run(pytester, monkeypatch, HYPOTHESIS, "-k", "modules_only_one_rank")
    result.assert_outcomes(passed=1)
    drawn = [(tmp_path / f"modules{rank}").read_text().splitlines() for rank in (0, 1)]
    assert len(drawn[0]) >= 100 and drawn[0] == drawn[1]


def test_in_suite_mode_a_rank_waiting_for_one_that_left_the_call_fails_at_once(msrun):
    (msrun.cwd / "test_suite.py").write_text(CASES.replace("test_exits", "_not_in_suite"))
    job = msrun.run(job_args(2, "--scheduler=builtin", "pytest", "-q", "-p", "no:cacheprovider", "test_suite.py"))
    assert job.returncode == 1, job.stdout + job.stderr
    assert re.search(r"test_left\s+passed\s+failed\s+failed", job.stdout), job.stdout
    assert re.search(r"test_caught\s+passed\s+passed\s+passed", job.stdout), job.stdout
    assert re.search(r"test_next\s+passed\s+passed\s+passed", job.stdout), job.stdout
    assert "barrier #3 cannot complete: rank 0 has left test_left's call (passed)" in job.stdout
