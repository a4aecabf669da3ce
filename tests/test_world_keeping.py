"""Interleaved shapes (``worker_num=[2, 3, 4]`` on several tests: 2, 3, 4, 2, 3, 4, ...) keep one world
per shape alive while tests of it are to come; a rank budget too small for all of them ends the
world needed farthest ahead; verdicts and module fixtures stay exact (:mod:`pytest_msrun.plugin.controller.keeping`)."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from conftest import MARK, wait_gone

INTERLEAVED = """
import os

import pytest


def _log(what, world_size, rank):
    with open(os.environ["WORLD_LOG"], "a") as fh:
        fh.write(f"{what} {world_size} {rank} {os.getpid()}\\n")


@pytest.fixture(scope="module")
def per_world(rank, world_size):
    _log("setup", world_size, rank)
    yield
    _log("teardown", world_size, rank)


@pytest.mark.msrun(worker_num=[2, 3, 4])
def test_a(per_world, rank, world_size):
    _log("run", world_size, rank)


@pytest.mark.msrun(worker_num=[2, 3, 4])
def test_b(per_world, rank, world_size):
    _log("run", world_size, rank)
    assert world_size != 3, "test_b fails in the 3-rank world"


@pytest.mark.msrun(worker_num=[2, 3, 4])
def test_c(per_world, rank, world_size):
    _log("run", world_size, rank)
"""


def _run(pytester: pytest.Pytester, monkeypatch, *args: str) -> tuple[pytest.RunResult, list[list[str]]]:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    log = pytester.path / "worlds.log"
    monkeypatch.setenv("WORLD_LOG", str(log))
    pytester.makepyfile(test_shapes=INTERLEAVED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=300)
    assert not wait_gone(mark), "processes left behind"
    return result, [line.split() for line in log.read_text().splitlines()]


def _worlds(lines: list[list[str]]) -> Counter[str]:
    """Worlds started per shape: distinct rank-0 processes that ran a test."""
    return Counter(size for what, size, rank, pid in {tuple(x) for x in lines} if what == "run" and rank == "0")


def _fixture_once_per_world(lines: list[list[str]]) -> None:
    """Each rank process that ran tests set the module fixture up once and tore it down once."""
    pids = {pid for what, _, _, pid in lines if what == "run"}
    for pid in pids:
        events = [what for what, _, _, p in lines if p == pid and what != "run"]
        assert events == ["setup", "teardown"], (pid, events)


def test_nine_interleaved_tests_of_three_shapes_start_three_worlds(pytester, monkeypatch):
    result, lines = _run(pytester, monkeypatch, "-rA")
    result.assert_outcomes(passed=8, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_shapes.py::test_b[[]worker_num-3[]]*"])
    order = [size for what, size, rank, _ in lines if what == "run" and rank == "0"]
    assert order == ["2", "3", "4"] * 3  # the order was interleaved
    assert _worlds(lines) == {"2": 1, "3": 1, "4": 1}
    _fixture_once_per_world(lines)


def test_a_budget_too_small_for_every_shape_ends_the_world_needed_farthest_ahead(pytester, monkeypatch):
    # 7 ranks: two of the 2-, 3- and 4-rank worlds fit, never all three
    result, lines = _run(pytester, monkeypatch, "-rA", "--msrun-max-ranks=7")
    result.assert_outcomes(passed=8, failed=1)
    worlds = _worlds(lines)
    # Belady on 2 3 4 2 3 4 2 3 4 with room for two: 3 ends at the first 4, 2 at the second 3, ...
    assert sum(worlds.values()) == 6, worlds
    _fixture_once_per_world(lines)


def test_no_world_is_kept_with_a_budget_of_one_world(pytester, monkeypatch):
    result, lines = _run(pytester, monkeypatch, "--msrun-max-ranks=4")
    result.assert_outcomes(passed=8, failed=1)
    assert sum(_worlds(lines).values()) == 9
    _fixture_once_per_world(lines)


def test_xdist_workers_keep_verdicts_and_fixtures_exact(pytester, monkeypatch):
    result, lines = _run(pytester, monkeypatch, "-n", "2")
    result.assert_outcomes(passed=8, failed=1)
    assert len([x for x in lines if x[0] == "run"]) == 2 * 3 + 3 * 3 + 4 * 3
    _fixture_once_per_world(lines)


def test_max_ranks_must_be_auto_or_a_count(pytester):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msrun-max-ranks=many")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*msrun_max_ranks*'many'*auto or a positive count*"])
