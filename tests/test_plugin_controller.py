"""The controller side of the plugin with pytest's own options: junitxml, xdist, -s, --lf, ..."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import psutil
import pytest
from conftest import record, wait_for, wait_gone

EIGHT = """
import pytest

@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", range(8))
def test_marked(i, rank, msrun):
    assert msrun.all_gather(rank) == [0, 1]
"""


HANGS = """
import os, time
import pytest

@pytest.mark.msrun(worker_num=2)
def test_long(rank):
    print("started", flush=True)
    if os.environ.get("STARTED_DIR"):  # tells the test that this rank is inside its test
        open(os.path.join(os.environ["STARTED_DIR"], f"rank{rank}"), "w").close()
    time.sleep(60)  # the workload: a test still running when the controller is ended
"""


def test_junitxml_has_one_testcase_per_item(pytester, tracked):
    pytester.makepyfile(
        test_j="""
        import pytest

        @pytest.mark.msrun(worker_num=3)
        def test_ok(rank):
            print("rank", rank)

        @pytest.mark.msrun(worker_num=3)
        def test_bad(rank):
            assert rank != 2
    """
    )
    result = pytester.runpytest_subprocess("--junitxml=out.xml")
    result.assert_outcomes(passed=1, failed=1)
    cases = list(ET.parse(pytester.path / "out.xml").getroot().iter("testcase"))
    assert sorted(c.get("name") for c in cases) == ["test_bad", "test_ok"]
    bad = next(c for c in cases if c.get("name") == "test_bad")
    failure = bad.find("failure")
    assert failure is not None and failure.get("message").startswith("[rank 2] ")
    assert not list(pytester.path.glob("out.rank*.xml"))


@pytest.mark.parametrize("attempt", [1, 2])
def test_xdist_eight_marked_tests_no_port_collision(pytester, tracked, attempt):
    pytester.makepyfile(test_eight=EIGHT)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:randomly")
    result.assert_outcomes(passed=8)


def test_dash_s_shows_rank_output_live(pytester, tracked):
    """What a rank's test writes, labelled - and none of the rank's own session chrome (its header,
    progress and summary): the controller shows those once, as for a plain test."""
    pytester.makepyfile(
        test_s="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_prints(rank):
            print(f"live line from rank {rank}")

        @pytest.mark.msrun(worker_num=2)
        def test_fails(rank):
            assert rank == 0
    """
    )
    result = pytester.runpytest_subprocess("-s", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines_random(["*[[]rank 0[]]*live line from rank 0*", "*[[]rank 1[]]*live line from rank 1*"])
    chrome = re.compile(r"\[rank \d+\] .*(test session starts|rootdir:|collected \d|FAILURES|test summary| in \d)")
    assert not [line for line in result.stdout.lines if chrome.search(line)], result.stdout.str()
    assert sum("test session starts" in line for line in result.stdout.lines) == 1


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_dash_s_shows_a_tests_lines_before_its_result(pytester, tracked, worlds):
    """Under ``-s`` each test's lines come before its progress mark, as a plain test's do: a warm
    world's msrun relays the ranks' logs as it polls them, so the controller waits (bounded) for it
    to catch up before reporting (they came after every test's mark)."""
    pytester.makepyfile(
        test_order="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_a(rank):
            for i in range(3):
                print(f"a{i} from rank {rank}")

        @pytest.mark.msrun(worker_num=2)
        def test_b(rank):
            print(f"b from rank {rank}")
    """
    )
    result = pytester.runpytest_subprocess("-s", "-p", "no:randomly", f"--msrun-worlds={worlds}")
    result.assert_outcomes(passed=2)
    in_order = r"test_order\.py (\[rank [01]\] a\d from rank [01]\n){6}\.(\[rank [01]\] b from rank [01]\n){2}\."
    assert re.search(in_order, result.stdout.str()), result.stdout.str()


@pytest.mark.parametrize("style", ["line", "no"])
def test_terse_tb_styles_show_a_marked_failure_as_briefly_as_a_plain_one(pytester, tracked, style):
    """``--tb=line`` shows a failure's own lines and its one line; ``--tb=no`` nothing: a marked test
    failing on one rank shows as many lines as the same failure in a plain test (no headline, no
    logs or reproduce sections)."""
    pytester.makepyfile(
        test_tb="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_marked(rank):
            assert [1, 2, rank] == [1, 2, 0]

        def test_plain():
            rank = 1
            assert [1, 2, rank] == [1, 2, 0]
    """
    )
    result = pytester.runpytest_subprocess(f"--tb={style}", "-p", "no:randomly")
    result.assert_outcomes(failed=2)
    lines = result.stdout.lines
    end = next(i for i, line in enumerate(lines) if "short test summary" in line)
    failures = [i for i, line in enumerate(lines) if "= FAILURES =" in line]
    if style == "no":
        assert not failures
        return
    shown = lines[failures[0] + 1 : end]
    marked_end = next(i for i, line in enumerate(shown) if "[rank 1] assert [1, 2, 1] == [1, 2, 0]" in line)
    marked, plain = shown[: marked_end + 1], shown[marked_end + 1 :]
    assert plain[-1].endswith("assert [1, 2, 1] == [1, 2, 0]"), shown
    assert len(marked) == len(plain), "\n".join(shown)


def test_inprocess_mode_runs_in_this_process(pytester, tracked):
    pytester.makepyfile(
        test_in="""
        import os
        import pytest

        @pytest.mark.msrun(worker_num=4)
        def test_debuggable(rank, world_size, msrun):
            assert (rank, world_size) == (0, 1) and "MS_ROLE" not in os.environ
            # the variables of a one-rank world
            env = {k: os.environ.get(k) for k in ("RANK_ID", "RANK_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE", "DEVICE_ID", "MS_NODE_ID", "MASTER_ADDR")}
            assert env == {"RANK_ID": "0", "RANK_SIZE": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "DEVICE_ID": "0", "MS_NODE_ID": "0", "MASTER_ADDR": "127.0.0.1"}
            assert int(os.environ["MASTER_PORT"]) > 0
            assert msrun.all_gather("x") == ["x"]
            msrun.barrier()

        def test_plain_afterwards():
            assert "RANK_ID" not in os.environ and "MASTER_PORT" not in os.environ
    """
    )
    result = pytester.runpytest_subprocess("--msrun-inprocess", "-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_inside_another_launchers_job_marked_tests_run_in_place(pytester, tracked, monkeypatch):
    """MindSpore's own msrun (MS_ROLE, RANK_ID) started this pytest: it is not one of our ranks."""
    pytester.makepyfile(
        test_foreign="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_two(rank, world_size):
            assert (rank, world_size) == (1, 2)

        @pytest.mark.msrun(worker_num=4)
        def test_four():
            pass
    """
    )
    for name, value in {"MS_ROLE": "MS_WORKER", "RANK_ID": "1", "RANK_SIZE": "2", "MSRUN_JOB_ID": "stale"}.items():
        monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*needs a job of 4 ranks*this job has 2*"])
    assert not list(pytester.path.rglob("pytest_rank*")), "another launcher's rank writes no records"
    assert not list(pytester.path.rglob("msrun_hooks"))


@pytest.mark.parametrize("how", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_controller_ended_by_a_signal_leaves_nothing(pytester, tracked, how):
    """CI cancellation, timeout(1), Kubernetes: a signal to pytest's group (or kill -9 of pytest)."""
    pytester.makepyfile(test_hang=HANGS)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # the signals' default actions, as a terminal's session has them (under nohup SIGHUP is ignored)
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGHUP, signal.SIGTERM)],
    )
    try:
        wait_for(lambda: len(_ranks_of(proc.pid)) == 2, timeout=30)
        sig = getattr(signal, how)
        if sig == signal.SIGKILL:
            os.kill(proc.pid, sig)
        else:
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
        t0 = time.monotonic()
        left = wait_gone(tracked, timeout=10)
        assert not left, [p.cmdline() for p in left]
        gone = time.monotonic() - t0
        assert gone < 3, "every process of the job is gone within a second or two"
        record(f"{how} to the pytest controller (a job running)", "0 left", f"{gone * 1000:.0f} ms")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ranks_of(pid: int) -> list[psutil.Process]:
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in procs if _is_rank(p)]


def _is_rank(p: psutil.Process) -> bool:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return False
    return "test_hang.py" in " ".join(cmd) and "pytest_msrun" not in cmd and "-S" not in cmd


def test_timeout_report_names_the_timeout_not_a_failure(pytester, tracked):
    pytester.makepyfile(
        test_to="""
        import time
        import pytest

        @pytest.mark.msrun(worker_num=2, timeout=2)
        def test_slow(rank):
            time.sleep(60)
    """
    )
    result = pytester.runpytest_subprocess("--junitxml=out.xml")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "msrun job timed out after 2 s" in text
    assert "after another process failed" not in text
    assert "timeout -s TERM 2 pmsrun --worker_num=2" in text, "the reproduce command times out the same way"
    (case,) = ET.parse(pytester.path / "out.xml").getroot().iter("testcase")
    assert float(case.get("time")) >= 2.0, "launch and job time are the test's duration"


def test_the_reproduce_line_runs_the_test_with_the_sessions_options(pytester, tracked):
    """The reproduce line names the session's options (a conftest's ``--runslow`` here): run from
    a shell it applies them - it ran without them, failing as another test - and where their file
    is gone it says so and runs nothing."""
    pytester.makeconftest(
        """
        def pytest_addoption(parser):
            parser.addoption("--runslow", action="store_true", default=False)
        """
    )
    pytester.makepyfile(
        test_opts="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_it(request, rank):
            assert request.config.getoption("runslow"), "--runslow not given"
            assert rank == 0, "fails on rank 1"
        """
    )
    result = pytester.runpytest_subprocess("--runslow", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    lines = result.stdout.lines
    at = next(i for i, line in enumerate(lines) if "reproduce" in line and line.startswith("---"))
    script = "\n".join(lines[at + 1 : at + 3])  # cd DIR, then the command
    assert script.startswith("cd ") and "MSRUN_PYTEST_OPTIONS=" in script, script
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    env.pop("PYTEST_ADDOPTS", None)
    rerun = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert rerun.returncode != 0 and "fails on rank 1" in rerun.stdout, rerun.stdout + rerun.stderr
    assert "AssertionError: --runslow not given" not in rerun.stdout
    options = script.split("MSRUN_PYTEST_OPTIONS=", 1)[1].split()[0]
    os.unlink(options)
    gone = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert gone.returncode != 0, gone.stdout
    assert f"MSRUN_PYTEST_OPTIONS={options}: the controller's pytest options cannot be read" in gone.stdout
    assert "fails on rank 1" not in gone.stdout and "--runslow not given" not in gone.stdout


def test_a_timeout_does_not_kill_a_rank_still_starting_with_its_stack_request(pytester, tracked):
    """The stack request (SIGUSR1) goes only to ranks that already catch it: one still importing
    its conftest would be killed by it, and the diagnosis would say so instead of where it was."""
    pytester.makeconftest(
        """
        import os, time
        if os.environ.get("RANK_ID") == "1":
            time.sleep(120)  # rank 1 is still starting when the test runs out of time
        """
    )
    pytester.makepyfile(
        test_to="""
        import pytest

        @pytest.mark.msrun(worker_num=2, timeout=5)
        def test_it(rank):
            pass
        """
    )
    result = pytester.runpytest_subprocess("--msrun-worlds=fresh", timeout=120)
    result.assert_outcomes(errors=1)
    text = result.stdout.str()
    assert "msrun job timed out after 5 s" in text
    assert "SIGUSR1" not in text, text


def test_last_failed_and_k_and_durations(pytester, tracked):
    pytester.makepyfile(
        test_lf="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_good(rank):
            pass

        @pytest.mark.msrun(worker_num=2)
        def test_flaky(rank):
            import os
            assert not os.path.exists("fail.flag") or rank == 0
    """
    )
    (pytester.path / "fail.flag").write_text("x")
    first = pytester.runpytest_subprocess("--durations=5", "-vv")
    first.assert_outcomes(passed=1, failed=1)
    first.stdout.fnmatch_lines(["*slowest 5 durations*", "*call*test_lf.py::test_*"])
    second = pytester.runpytest_subprocess("--lf", "-v")
    second.assert_outcomes(failed=1)
    second.stdout.fnmatch_lines(["*test_flaky FAILED*"])
    assert "test_good" not in second.stdout.str().split("short test summary")[0].split("collected")[1]
    third = pytester.runpytest_subprocess("-k", "good")
    third.assert_outcomes(passed=1)


def test_report_style_all_shows_every_failing_rank(pytester, tracked):
    # The ranks meet before failing, so both failures are recorded before msrun stops anyone.
    pytester.makepyfile(
        test_all="""
        import time
        import pytest

        @pytest.mark.msrun(worker_num=3)
        def test_two_fail(rank, world_size, msrun_tmp_path):
            (msrun_tmp_path / f"ready{rank}").touch()
            while len(list(msrun_tmp_path.glob("ready*"))) < world_size:
                time.sleep(0.01)
            assert rank == 0, f"rank {rank} disagrees"
    """
    )
    first = pytester.runpytest_subprocess()
    first.assert_outcomes(failed=1)
    text = first.stdout.str()
    assert "also failed on ranks" in text
    assert text.count("disagrees") >= 2
    every = pytester.runpytest_subprocess("--msrun-report=all")
    every.assert_outcomes(failed=1)
    out = every.stdout.str()
    assert "AssertionError: rank 1 disagrees" in out and "AssertionError: rank 2 disagrees" in out


def test_parent_options_reach_the_ranks(pytester, tracked):
    pytester.makepyfile(
        test_opts="""
        import warnings
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_warns(rank):
            warnings.warn("careful", UserWarning)

        @pytest.mark.xfail(reason="made strict by -o")
        @pytest.mark.msrun(worker_num=2)
        def test_xpasses(rank):
            pass
    """
    )
    result = pytester.runpytest_subprocess("-W", "error:careful", "-o", "xfail_strict=true")
    result.assert_outcomes(failed=2)
    assert "UserWarning: careful" in result.stdout.str()


def test_every_option_reaches_the_ranks_but_the_sessions_own(pytester, tracked):
    """conftest options, core options in addopts, plugin options: the rank sees the controller's
    values; selection and report files stay the controller's."""
    pytester.makeconftest(
        """
        def pytest_addoption(parser):
            parser.addoption("--runslow", action="store_true", default=False)
            parser.addoption("--level", type=int, default=1)
            parser.addoption("--tags", action="append", default=[])
        """
    )
    pytester.makeini("[pytest]\naddopts = --showlocals\n")
    pytester.makepyfile(
        test_cfg="""
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_options(rank, request):
            opt = request.config.option
            assert opt.runslow is True and opt.level == 3 and opt.tags == ["a", "b"]
            assert opt.showlocals and opt.runxfail and opt.tbstyle == "short"
            assert opt.keyword == "" and opt.xmlpath is None and opt.maxfail != 1 and not opt.usepdb
            assert request.config.getoption("--level") == 3

        def test_plain():
            pass
    """
    )
    result = pytester.runpytest_subprocess(
        "--runslow", "--level=3", "--tags=a", "--tags=b", "--runxfail", "--tb=short", "-k", "options or plain",
        "--junitxml=out.xml", "-x",
    )  # fmt: skip
    result.assert_outcomes(passed=2)
    assert (pytester.path / "out.xml").exists()


def test_devices_are_disjoint_across_xdist_workers(pytester, tracked):
    pytester.makepyfile(
        test_dev="""
        import json, os, time
        import pytest

        @pytest.mark.msrun(worker_num=2, devices=2)
        @pytest.mark.parametrize("i", range(4))
        def test_devices(i, rank, msrun_tmp_path):
            start = time.time()
            time.sleep(0.6)
            if rank == 0:
                rec = {"devices": os.environ["CUDA_VISIBLE_DEVICES"], "start": start, "end": time.time()}
                with open(os.path.join(os.environ["DEV_LOG"], f"{i}.json"), "w") as fh:
                    json.dump(rec, fh)
    """
    )
    log = pytester.path / "devlog"
    log.mkdir()
    os.environ["DEV_LOG"] = str(log)
    try:
        result = pytester.runpytest_subprocess("-n", "2", "--msrun-devices=cuda:0,1,2")
    finally:
        del os.environ["DEV_LOG"]
    result.assert_outcomes(passed=4)
    recs = [json.loads(p.read_text()) for p in log.glob("*.json")]
    assert len(recs) == 4
    for a in recs:
        assert len(set(a["devices"].split(","))) == 2
        for b in recs:
            if a is b:
                continue
            overlap_in_time = a["start"] < b["end"] and b["start"] < a["end"]
            if overlap_in_time:
                assert not set(a["devices"].split(",")) & set(b["devices"].split(",")), (a, b)


def test_ctrl_c_of_the_controller_leaves_nothing(pytester, tracked):
    pytester.makepyfile(test_hang=HANGS)
    started = pytester.path / "started"
    started.mkdir()
    # A terminal's Ctrl+C: SIGINT to the foreground process group. (xdist workers ignore SIGINT,
    # and children inherit that, so restore the default for the pytest under test.)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=pytester.path,
        env={**os.environ, "STARTED_DIR": str(started)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for(lambda: len(list(started.iterdir())) == 2, timeout=60)  # both ranks are in the test
    except AssertionError:
        proc.kill()
        raise AssertionError(f"the ranks never started their test:\n{proc.communicate()[0].decode()}") from None
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2, out.decode()
    assert b"KeyboardInterrupt" in out


CACHE = """
import pytest


@pytest.mark.msrun(worker_num=2)
def test_cache(rank, cache, request):
    cache.set(f"msrun/rank{rank}", rank)
    assert request.config.cache.get(f"msrun/rank{rank}", None) == rank
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_the_cache_fixture_works_in_marked_tests(pytester, tracked, worlds):
    pytester.makepyfile(test_cache=CACHE)
    result = pytester.runpytest_subprocess(f"--msrun-worlds={worlds}")
    result.assert_outcomes(passed=1)
    # the ranks wrote into the session's own cache directory; only the session keeps last-failed
    for rank in (0, 1):
        assert (pytester.path / ".pytest_cache" / "v" / "msrun" / f"rank{rank}").exists()


COUNTING = """
import json, os
from pytest_msrun.plugin.rule import testrecord

COUNTS = {}
_judge = testrecord.judge


def counting_judge(nodeid, *args, **kwargs):
    COUNTS[nodeid] = COUNTS.get(nodeid, 0) + 1
    return _judge(nodeid, *args, **kwargs)


testrecord.judge = counting_judge


def pytest_sessionfinish(session):
    if COUNTS:  # the controller's (and an xdist worker's) judgements, by test
        name = f"judged-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json"
        with open(os.path.join(os.environ["COUNT_DIR"], name), "w") as fh:
            json.dump(COUNTS, fh)
"""

JUDGED = """
import pytest


@pytest.mark.msrun(worker_num=2)
def test_passes(rank):
    pass


@pytest.mark.msrun(worker_num=2)
def test_fails(rank):
    assert rank == 0


@pytest.mark.msrun(worker_num=2)
def test_last(rank):
    pass


@pytest.mark.skip(reason="not here")
@pytest.mark.msrun(worker_num=2)
def test_skipped(rank):
    pass


@pytest.mark.msrun(worker_num=-1)
def test_bad_marker(rank):
    pass
"""


@pytest.mark.parametrize(
    "mode,most",
    [
        (["--msrun-worlds=fresh"], 2),
        (["--msrun-worlds=warm"], 2),
        (["-n", "2", "--msrun-worlds=warm"], 2),
        (["own-job"], 1),
    ],
    ids=["fresh", "warm", "xdist", "a-job-of-its-own"],
)
def test_each_record_is_judged_once(pytester, monkeypatch, mode, most):
    """The rule runs once per record: a test in a world has two (after its call, while its world
    lives on; after its teardown), judged once each; a job of its own (a task-scheduler job) one,
    judged once - never again for another reporter (it was judged twice). A test the runner
    refuses (a skip, a bad marker) is a record too, judged once like any other."""
    counts = pytester.mkdir("counts")
    monkeypatch.setenv("COUNT_DIR", str(counts))
    pytester.makeconftest(COUNTING)
    own = mode == ["own-job"]
    pytester.makepyfile(
        test_judged=JUDGED.replace("worker_num=2)", 'worker_num=2, scheduler="task")' if own else "worker_num=2)")
    )
    mode = [] if own else mode
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *mode)
    result.assert_outcomes(passed=2, failed=1, skipped=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_bad_marker*", "*worker_num*"])
    judged: dict[str, int] = {}
    for path in counts.iterdir():
        for nodeid, count in json.loads(path.read_text()).items():
            judged[nodeid] = judged.get(nodeid, 0) + count
    tests = ("test_bad_marker", "test_fails", "test_last", "test_passes", "test_skipped")
    assert sorted(judged) == [f"test_judged.py::{t}" for t in tests], judged
    assert all(1 <= count <= most for count in judged.values()), judged
    assert judged["test_judged.py::test_bad_marker"] == 1, judged  # a refusal: one record
