"""At home in the pytest ecosystem: fixtures of any scope, other plugins, our command's name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port as pytester_port

SCOPES = """
import pytest
from pathlib import Path

@pytest.fixture(scope="module")
def shard(rank, world_size, msrun):
    return (rank, world_size, msrun.rank)

@pytest.mark.msrun(worker_num=2)
def test_a(shard, msrun, rank):
    assert shard == (rank, 2, rank)
    (msrun.tmp_path / f"a{rank}").touch()
    msrun.barrier()
    assert sorted(p.name for p in msrun.tmp_path.iterdir()) == ["a0", "a1"]

@pytest.mark.msrun(worker_num=2)
def test_b(shard, msrun, rank, msrun_tmp_path):
    msrun.barrier()
    assert msrun.tmp_path == msrun_tmp_path and list(msrun.tmp_path.iterdir()) == []
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_rank_fixtures_serve_fixtures_of_any_scope(pytester: pytest.Pytester, worlds: str) -> None:
    """``rank``, ``world_size`` and ``msrun`` in a module fixture (what warm worlds invite): no
    ScopeMismatch; ``msrun.tmp_path`` is still each test's own shared directory; the world's own
    control-plane connection is not a leak of the test that first used it."""
    pytester.makepyfile(test_scopes=SCOPES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--msrun-worlds={worlds}", "-W", "error")
    result.assert_outcomes(passed=2)
    assert "MsrunLeakWarning" not in result.stdout.str()


def test_our_command_names_itself_and_errors_stay_msruns() -> None:
    out = subprocess.run([sys.executable, "-m", "pytest_msrun", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("usage: pmsrun ")
    argv = [sys.executable, "-m", "pytest_msrun", "--worker_num=0", "x.py"]
    bad = subprocess.run(argv, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: pmsrun ")
    assert bad.stderr.splitlines()[-1] == "msrun: error: argument --worker_num: must be greater than 0, got 0"


SHAPES = """
import random
import pytest
from pathlib import Path

CASES = [pytest.param(n, i, marks=pytest.mark.msrun(worker_num=n), id=f"{n}-{i}") for n in (1, 2, 3) for i in range(4)]

@pytest.mark.parametrize("n,i", CASES)
def test_shapes(n, i, world_size):
    assert world_size == n

@pytest.mark.msrun(worker_num=2)
def test_seeds(rank, msrun, request):
    seeds = msrun.all_gather(request.config.getoption("randomly_seed"))
    assert seeds[1] == seeds[0] + 1, "each rank reseeds with its own: the session's seed plus its rank"
    drawn = msrun.all_gather(random.random())
    assert drawn[0] != drawn[1]
"""


def test_randomly_groups_worlds_by_shape_and_seeds_each_rank(pytester: pytest.Pytester) -> None:
    """pytest-randomly shuffles 13 marked tests of 3 shapes: 3 worlds start, not one per test, and
    each rank reseeds ``random`` differently (the seed plus its rank, said in the header)."""
    pytest.importorskip("pytest_randomly")
    pytester.makepyfile(test_shapes=SHAPES)
    result = pytester.runpytest_subprocess("-p", "randomly", "-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=13)
    result.stdout.fnmatch_lines(["*msrun: pytest-randomly: marked tests run grouped by world shape*"])
    worlds = list(pytester.path.glob("**/msrun.log"))
    assert len(worlds) == 3, [str(w) for w in worlds]
    order = [line.split("::")[1].split()[0] for line in result.stdout.lines if "::test_" in line and "PASSED" in line]
    shapes = [2 if name.startswith("test_seeds") else int(name.split("[")[1].split("-")[0]) for name in order]
    runs = [s for k, s in enumerate(shapes) if k == 0 or s != shapes[k - 1]]
    assert len(runs) == len(set(runs)), f"each shape's tests run together: {shapes}"


SUITE = """
import pytest
from pathlib import Path
from pytest_msrun import cluster

@pytest.mark.parametrize("i", range(8))
def test_collective_per_test(i):
    cluster.init()
    assert cluster.all_gather_object(i) == [i, i], "every rank runs the same test at the same time"
"""


def test_randomly_in_suite_mode_orders_every_rank_alike(pytester: pytest.Pytester) -> None:
    """``pmsrun … pytest`` with pytest-randomly: every rank shuffles the suite the same way (a seed
    of the job), so per-test collectives meet."""
    pytest.importorskip("pytest_randomly")
    pytester.makepyfile(test_suite=SUITE)
    port = str(pytester_port())
    argv = [sys.executable, "-m", "pytest_msrun", "--worker_num=2", "--local_worker_num=2", "--join=True"]
    argv += [f"--master_port={port}", "--log_dir=logs", "--scheduler=builtin", "pytest", "-p", "randomly", "-q"]
    env = {**os.environ, "PYTEST_ADDOPTS": ""}
    run = subprocess.run(
        [*argv, "test_suite.py"], cwd=pytester.path, capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


HANGS = """
import time
import pytest
from pathlib import Path

@pytest.mark.msrun(worker_num=2)
def test_hangs(rank):
    while True:
        time.sleep(0.1)

@pytest.mark.msrun(worker_num=2)
def test_after(rank):
    pass

def test_plain():
    pass
"""


@pytest.mark.parametrize(
    "how", [["--timeout=5"], ["-o", "timeout=5", "--msrun-timeout=5"]], ids=["option", "ini-equal"]
)
def test_pytest_timeout_times_a_marked_test_as_its_job(pytester: pytest.Pytester, how: list[str]) -> None:
    """pytest-timeout's timeout of a marked test is its job's: the test fails with the grouped hang
    report, the session goes on (it used to end in an INTERNALERROR: its timer fired in the
    controller). Set in the ini file, and equal to ours, it is the same."""
    pytest.importorskip("pytest_timeout")
    pytester.makepyfile(test_hangs=HANGS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *how)
    result.assert_outcomes(failed=1, passed=2)
    text = result.stdout.str()
    assert "INTERNALERROR" not in text and "msrun job timed out after 5 s" in text, text
    assert "stack of rank 0 at the timeout" in text


CLOSEST_TIMEOUT = """
import time
import pytest

@pytest.mark.msrun(worker_num=2, timeout=3{isolated})
def test_marker_timeout_beats_the_sessions(rank):
    if rank == 1:
        time.sleep(30)

@pytest.mark.timeout(3)
@pytest.mark.msrun(worker_num=2, timeout=100{isolated})
def test_items_timeout_mark_beats_the_marker(rank):
    if rank == 0:
        time.sleep(30)
"""


@pytest.mark.parametrize(
    "mode",
    [["--msrun-worlds=warm"], ["--msrun-worlds=fresh"], ["isolated"], ["-n", "2"]],
    ids=["warm", "fresh", "isolated", "xdist"],
)
def test_the_closest_timeout_wins_over_pytest_timeouts_session_wide_one(pytester: pytest.Pytester, mode) -> None:
    """A session-wide ``--timeout=60`` never lengthens a marker's ``timeout=3`` (a rank sleeping
    30 s was PASSED); an item's own ``timeout`` mark is closer than its marker and wins."""
    pytest.importorskip("pytest_timeout")
    isolated = mode == ["isolated"]
    pytester.makepyfile(test_closest=CLOSEST_TIMEOUT.format(isolated=", isolated=True" if isolated else ""))
    args = [] if isolated else mode
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "--timeout=60", *args)
    result.assert_outcomes(failed=2)
    text = result.stdout.str()
    # The failures' own headers name the phase; the short summary may repeat the message or cut
    # it, as the terminal's width decides.
    assert text.count("msrun job timed out after 3 s in the call phase") == 2, text
    assert "timed out after 60 s" not in text and "timed out after 100 s" not in text, text


SLOW_WORLD = """
import os, time
if os.environ.get("MSRUN_PLUGIN_ROLE") == "worker":
    time.sleep(3)  # the world's start: not the test's time
"""


def test_pytest_timeout_counts_from_the_tests_start_not_its_worlds(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_timeout")
    pytester.makeconftest(SLOW_WORLD)
    pytester.makepyfile(
        test_quick="""
        import time
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_half_a_second(rank):
            time.sleep(0.5)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--timeout=2.5")
    result.assert_outcomes(passed=1)


FLAKY = """
import os
import pytest
from pathlib import Path

def runs(name, rank):
    path = os.path.join(os.environ["RUNS_DIR"], f"{name}-{rank}")
    count = int(open(path).read()) + 1 if os.path.exists(path) else 1
    with open(path, "w") as fh:
        fh.write(str(count))
    return count

@pytest.mark.msrun(worker_num=2)
def test_fails_only_its_first_time(rank, msrun):
    first = runs("flaky", rank) == 1
    msrun.barrier()  # a rank rerunning alone would wait here for ever
    assert not (first and rank == 1), "rank 1 fails the first run"

@pytest.mark.msrun(worker_num=2)
def test_always_fails_on_rank_0(rank, msrun):
    runs("broken", rank)
    msrun.barrier()
    assert rank != 0
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_rerunfailures_reruns_the_whole_job(
    pytester: pytest.Pytester, worlds: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--reruns 2``: the controller reruns a failing marked test as a whole job (ranks never on
    their own), reported as pytest-rerunfailures does: ``rerun`` for each failed run but the last."""
    pytest.importorskip("pytest_rerunfailures")
    pytester.makepyfile(test_flaky=FLAKY)
    runs = pytester.path / "runs"
    runs.mkdir()
    monkeypatch.setenv("RUNS_DIR", str(runs))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--reruns", "2", f"--msrun-worlds={worlds}")
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("failed"), outcomes.get("rerun")) == (1, 1, 3), result.stdout.str()
    counts = {p.name: int(p.read_text()) for p in runs.iterdir()}
    assert counts == {"flaky-0": 2, "flaky-1": 2, "broken-0": 3, "broken-1": 3}, "every rank ran every attempt"


PKG = {
    "pkg/__init__.py": "",
    "pkg/work.py": """
def only_in_ranks(rank):
    if rank == 0:
        return "zero"
    return "other"


def in_a_world_that_dies(rank):
    return rank + 1
""",
}
COVERED = """
import os
import pytest
from pathlib import Path
from pkg import work

@pytest.mark.msrun(worker_num=2)
def test_ranks_run_it(rank):
    assert work.only_in_ranks(rank) in ("zero", "other")

@pytest.mark.msrun(worker_num=2)
def test_then_the_world_dies(rank):
    assert work.in_a_world_that_dies(rank) == rank + 1

@pytest.mark.msrun(worker_num=2)
def test_crash(rank):
    os._exit(3)  # the world dies here, after the others ran in it
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_cov_counts_lines_run_in_ranks(pytester: pytest.Pytester, worlds: str) -> None:
    """``--cov``: lines run only in ranks count, with no configuration, and a world that crashed
    after them keeps what its earlier tests ran (fresh: what each forked test ran)."""
    pytest.importorskip("pytest_cov")
    for name, text in PKG.items():
        path = pytester.path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    pytester.makepyfile(test_covered=COVERED)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--cov=pkg",
        "--cov-report=term-missing",
        "--import-mode=prepend",
        f"--msrun-worlds={worlds}",
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.re_match_lines([r"pkg/work\.py\s+\d+\s+0\s+100%"])
    assert not list(pytester.path.glob(".coverage.*")), "every rank's data was combined"


FAILS_ON_RANK_1 = """
import pytest
from pathlib import Path

@pytest.mark.msrun(worker_num=2)
def test_one_rank_fails(rank):
    assert rank != 1
"""


def test_junitxml_names_the_failing_ranks_and_pdb_is_explained_on_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fails=FAILS_ON_RANK_1)
    xml = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={xml}", "--pdb", "-q")
    result.assert_outcomes(failed=1)
    assert '<property name="msrun_failing_ranks" value="1"' in xml.read_text()
    result.stdout.fnmatch_lines(
        [
            "*msrun --pdb*",
            "--pdb stops each failing rank in pdb on the controller's terminal*",
            "*msrun: --pdb in rank 1 at test_fails.py:* skipped: no terminal (stdin is not a tty)",  # its warning
        ]
    )
    assert "turn" not in result.stdout.str() and "add --msrun-inprocess" not in result.stdout.str()


def test_ranks_load_hypothesis_only_when_a_test_uses_it(pytester: pytest.Pytester) -> None:
    pytest.importorskip("hypothesis")
    check = """
    import sys
    import pytest
    {imports}

    @pytest.mark.msrun(worker_num=1)
    def test_rank(rank):
        assert ("_hypothesis_pytestplugin" in sys.modules) is {expected}
    """
    pytester.makepyfile(test_plain=check.format(imports="", expected=False))
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    pytester.makepyfile(test_plain=check.format(imports="import hypothesis", expected=True))
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.parametrize("fork_server", ["on", "off"])
def test_a_hypothesis_test_passes_under_w_error_as_unmarked(pytester: pytest.Pytester, fork_server: str) -> None:
    """A template forked at the session's start forgot hypothesis's plugin (no test module had
    imported hypothesis yet) but kept the start it had counted in ``_hypothesis_globals``: each
    rank then warned "Slow code in plugin" (HypothesisSideeffectWarning), an error under ``-W error``."""
    pytest.importorskip("hypothesis")
    pytester.makepyfile(
        test_hyp="""
        import pytest
        from hypothesis import given, settings, strategies as st

        @pytest.mark.msrun(worker_num=2)
        @settings(max_examples=5, deadline=None)
        @given(st.integers())
        def test_marked(x):
            assert isinstance(x, int)

        @settings(max_examples=5, deadline=None)
        @given(st.integers())
        def test_plain(x):
            assert isinstance(x, int)
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-W", "error", f"--msrun-fork-server={fork_server}"
    )
    result.assert_outcomes(passed=2)


SETUP_SHOW = """
import pytest

@pytest.fixture(scope="module", params=["a"])
def shared(request):
    yield request.param

@pytest.fixture
def each(shared, tmp_path):
    yield 2

{mark}
def test_it(each):
    pass
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_setup_show_shows_a_marked_tests_fixtures_as_for_the_test_unmarked(
    pytester: pytest.Pytester, worlds: str
) -> None:
    """``--setup-show``: the fixtures set up and torn down around a marked test (the lowest rank's,
    as it ran them), in pytest's own lines - the same as the test unmarked prints."""

    def shown(mark: str, *args: str) -> list[str]:
        pytester.makepyfile(test_show=SETUP_SHOW.format(mark=mark))
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--setup-show", *args)
        result.assert_outcomes(passed=1)
        lines = result.stdout.lines
        first = next(i for i, line in enumerate(lines) if "SETUP    S" in line)
        last = max(i for i, line in enumerate(lines) if "TEARDOWN S" in line)
        return [line.rstrip() for line in lines[first : last + 1]]

    plain = shown("")
    assert any("SETUP    M shared['a']" in line for line in plain), plain
    assert shown("@pytest.mark.msrun(worker_num=2)", f"--msrun-worlds={worlds}") == plain


PAST_CAPTURE = """
import logging
import pytest

@pytest.mark.msrun(worker_num=2)
def test_marked(capsys, rank):
    with capsys.disabled():
        print("past capture from", rank)
    logging.getLogger("app").info("logged by %s", rank)
    print("captured from", rank)
    assert rank == 0
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_what_a_rank_writes_past_capture_reaches_the_terminal_labelled(pytester: pytest.Pytester, worlds: str) -> None:
    """``capsys.disabled()`` and live logging (``--log-cli-level``) write to the terminal past
    capture, as for a plain test: each rank's lines, labelled, before the test's result - and not
    again in its captured output (a rank's live log was its captured stdout)."""
    pytester.makepyfile(test_past=PAST_CAPTURE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--log-cli-level=INFO", f"--msrun-worlds={worlds}")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    head = text.split("= FAILURES =")[0]
    for rank in (0, 1):
        assert f"[rank {rank}] past capture from {rank}" in head, text
        assert re.search(rf"\[rank {rank}\] INFO +app:test_past.py:\d+ logged by {rank}", head), text
        assert f"[rank {rank}] ---" in head and "live log call" in head, text
    tail = text.split("= FAILURES =")[1]
    assert "] past capture from" not in tail and "live log call" not in tail.split("-- reproduce --")[1], text
    assert "[rank 1] captured from 1" in tail, text  # still the test's captured output
    assert "Captured log call [rank 1]" in tail, text


MAKEREPORT_CONFTEST = """
import os
import pytest

SEEN = []

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    SEEN.append(f"{item.name} {report.when} {report.outcome}")
    return report

def pytest_sessionfinish(session):
    if "RANK_ID" not in os.environ:  # the controller's session
        print("\\nSEEN " + "; ".join(SEEN))
"""

MAKEREPORT_TESTS = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_fails_on_1(rank):
    assert rank == 0

@pytest.mark.msrun(worker_num=0)
def test_refused():
    pass

@pytest.mark.msrun(worker_num=2)
def test_passes(rank):
    pass
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_every_plugins_makereport_sees_a_marked_tests_merged_result_once(
    pytester: pytest.Pytester, worlds: str
) -> None:
    """The controller makes each phase's report through ``pytest_runtest_makereport``: what a plugin
    learns there (pytest-dependency's results, tmp_path's retention) is the merged result, once a
    phase, as for a plain test - refused tests included (it learned nothing of marked tests)."""
    pytester.makeconftest(MAKEREPORT_CONFTEST)
    pytester.makepyfile(test_made=MAKEREPORT_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", f"--msrun-worlds={worlds}")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    (line,) = [line for line in result.stdout.lines if line.startswith("SEEN ")]
    assert line.removeprefix("SEEN ").split("; ") == [
        "test_fails_on_1 setup passed",
        "test_fails_on_1 call failed",
        "test_fails_on_1 teardown passed",
        "test_refused setup failed",
        "test_refused teardown passed",
        "test_passes setup passed",
        "test_passes call passed",
        "test_passes teardown passed",
    ], line


def test_an_import_error_in_a_rank_shows_the_tests_line_only(pytester: pytest.Pytester) -> None:
    """The warm world's import watch is the plugin's frame: hidden, as pytest hides a plugin's own."""
    pytester.makepyfile(
        test_imp="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_imports(rank):
            import no_such_module_here  # noqa: F401
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "watched_import" not in text and "original_import" not in text, text
    result.stdout.fnmatch_lines([">*import no_such_module_here*", "E*ModuleNotFoundError: No module named*"])


def test_a_module_only_ranks_cannot_import_names_the_rank_that_ended_the_world(pytester: pytest.Pytester) -> None:
    """A warm world whose ranks fail to collect the module ends before they connect: the test runs
    as a fresh job and says which rank ended the world, and how (it said only that msrun ended)."""
    pytester.makepyfile(
        test_ranks_only="""
        import os
        import pytest

        if os.environ.get("RANK") == "1":
            raise SyntaxError("rank 1 cannot import this module")

        @pytest.mark.msrun(worker_num=2)
        def test_a():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msrun-worlds=warm")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*its warm world did not start (the world's msrun ended before every rank connected: rank 1 exited*"]
    )


def test_dry_run_suite_prints_the_table_at_once(pytester: pytest.Pytester) -> None:
    """``pmsrun --sim_level=1 … pytest``: the simulated ranks' table, and its exit status, without
    waiting for other nodes' status files (a dry run's ranks are listed by their records)."""
    pytester.makepyfile(
        test_dry="""
        import os

        def test_ok():
            pass

        def test_rank_2_fails():
            assert os.environ["RANK_ID"] != "2"
        """
    )
    argv = [sys.executable, "-m", "pytest_msrun", "--worker_num=4", "--local_worker_num=4", "--sim_level=1"]
    argv += ["--join=True", "--log_dir=logs", "pytest", "-q", "-p", "no:cacheprovider", "test_dry.py"]
    run = subprocess.run(argv, cwd=pytester.path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "test_dry.py::test_ok" in run.stdout and "msrun: 2 test(s): 1 passed, 1 failed" in run.stdout, run.stdout
    assert "no final status from the nodes" not in run.stdout


def test_a_warm_tests_log_paths_point_at_its_own_folder(pytester: pytest.Pytester) -> None:
    """In a warm world the report names each rank's part of the log for this test, in the test's
    own folder - not the world's log, which every test of the world shares."""
    pytester.makepyfile(
        test_two="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_first(rank):
            print(f"first test on rank {rank}")

        @pytest.mark.msrun(worker_num=2)
        def test_second(rank):
            print(f"second test on rank {rank}")
            assert rank == 0
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    (line,) = [ln for ln in result.stdout.lines if ln.startswith("rank 1: /")]
    log = line.split(": ", 1)[1]
    assert "/msrun-test_second" in log and log.endswith("/logs/worker_1.log"), line
    text = Path(log).read_text()
    assert "second test on rank 1" in text and "first test on rank 1" not in text


def test_a_plugin_is_found_by_its_entry_point_on_python_3_9_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``importlib.metadata.entry_points()`` is a dict of groups on Python 3.9 (no ``group=``); the
    lookup of a plugin's module by its entry point's name reads both shapes."""
    from importlib.metadata import EntryPoint

    from pytest_msrun.plugin import options

    randomly = EntryPoint("randomly", "pytest_randomly", "pytest11")
    monkeypatch.setattr(options, "entry_points", lambda: {"pytest11": [randomly], "console_scripts": []})
    options._entry_modules.cache_clear()
    try:
        assert options._entry_modules() == {"randomly": "pytest_randomly"}
    finally:
        options._entry_modules.cache_clear()
