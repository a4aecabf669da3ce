"""Warm worlds: marked tests of one shape share a long-lived job - each test isolated, judged alone,
and the world replaced after a crash, a hang or a failure inside it."""

from __future__ import annotations

import os
import re
import uuid

import pytest
from conftest import MARK, wait_gone

PIDS = """
import os

import pytest


@pytest.fixture(scope="module")
def expensive():
    with open(os.environ["SETUPS"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    return os.getpid()


@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", range(4))
def test_shared(rank, msrun, expensive, i):
    assert msrun.all_gather(rank) == [0, 1]
    print(f"PID {i} {rank} {os.getpid()}")


@pytest.mark.msrun(worker_num=2, isolated=True)
def test_isolated(rank):
    print(f"PID iso {rank} {os.getpid()}")
"""


def _run(pytester, monkeypatch, source: str, *args: str, name: str = "test_warm"):
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    pytester.makepyfile(**{name: source})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=240)
    left = wait_gone(mark)
    assert not left, f"leftover processes: {[p.cmdline() for p in left]}"
    return result


def _pids(text: str) -> dict[tuple[str, str], str]:
    return {(m[0], m[1]): m[2] for m in re.findall(r"PID (\w+) (\d) (\d+)", text)}


def test_one_world_serves_a_shape_and_module_fixtures_are_set_up_once(pytester, monkeypatch):
    setups = pytester.path / "setups.txt"
    monkeypatch.setenv("SETUPS", str(setups))
    result = _run(pytester, monkeypatch, PIDS, "-rP")
    result.assert_outcomes(passed=5)
    pids = _pids(result.stdout.str())
    for rank in ("0", "1"):
        assert len({pids[(str(i), rank)] for i in range(4)}) == 1  # the same process ran all four
        assert pids[("iso", rank)] != pids[("0", rank)]  # isolated=True: a fresh job
    assert len(setups.read_text().split()) == 2  # once per rank, not once per test


def test_fresh_worlds_start_a_job_per_test(pytester, monkeypatch):
    setups = pytester.path / "setups.txt"
    monkeypatch.setenv("SETUPS", str(setups))
    result = _run(pytester, monkeypatch, PIDS, "-rP", "--msrun-worlds=fresh")
    result.assert_outcomes(passed=5)
    pids = _pids(result.stdout.str())
    assert len({pids[(str(i), "0")] for i in range(4)}) == 4
    assert len(setups.read_text().split()) == 8


RECOVERY = """
import ctypes, os, time

import pytest


@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", range(20))
def test_many(rank, msrun, i):
    if i == 4 and rank == 1:
        ctypes.string_at(0)  # test 5 of 20 segfaults on rank 1
    assert msrun.all_gather(rank) == [0, 1]


@pytest.mark.msrun(worker_num=2, timeout=3)
def test_hangs(rank, msrun):
    if rank == 1:
        time.sleep(60)
    msrun.barrier()


@pytest.mark.msrun(worker_num=2)
def test_after_the_hang(rank, msrun):
    assert msrun.all_gather(rank) == [0, 1]


@pytest.mark.msrun(worker_num=2)
def test_rank_0_exits_the_process(rank):
    if rank == 0:
        os._exit(0)


@pytest.mark.msrun(worker_num=2)
def test_after_the_exit(rank, msrun):
    assert msrun.all_gather(rank) == [0, 1]
"""


def test_a_crash_a_hang_and_an_exit_fail_their_test_and_the_next_test_runs_normally(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, RECOVERY, "-v")
    result.assert_outcomes(passed=21, failed=3)
    text = result.stdout.str()
    assert re.search(r"test_many\[4\] FAILED", text)
    for i in range(5, 20):
        assert re.search(rf"test_many\[{i}\] PASSED", text), i
    assert re.search(r"test_hangs FAILED", text) and re.search(r"test_after_the_hang PASSED", text)
    assert "msrun job timed out after 3 s" in text and "stack of rank 1 at the timeout" in text
    assert re.search(r"test_rank_0_exits_the_process FAILED", text) and re.search(r"test_after_the_exit PASSED", text)
    assert "Segmentation fault" in text or "signal 11" in text or "SIGSEGV" in text


LEAKS = """
import os, subprocess, threading, time

import pytest


@pytest.mark.msrun(worker_num=2)
def test_sets_env(rank):
    os.environ["LEFT_BEHIND"] = "1"


@pytest.mark.msrun(worker_num=2)
def test_sees_clean_env(rank, tmp_path):
    assert "LEFT_BEHIND" not in os.environ
    os.chdir(tmp_path)


@pytest.mark.msrun(worker_num=2)
def test_cwd_restored(rank, pytestconfig):
    assert os.getcwd() == str(pytestconfig.invocation_params.dir)


@pytest.mark.msrun(worker_num=2)
def test_leaves_a_thread_a_child_and_a_file(rank, tmp_path):
    threading.Thread(target=time.sleep, args=(3,), name="lingering", daemon=True).start()
    subprocess.Popen(["sleep", "3"])
    globals()["fh"] = open(tmp_path / "open.txt", "w")


@pytest.mark.msrun(worker_num=2)
def test_leaves_a_detached_process(rank):
    subprocess.run(["sh", "-c", "sleep 3 >/dev/null 2>&1 </dev/null &"], check=True)


@pytest.fixture
def teardown_skips():
    yield
    pytest.skip("in the teardown")  # pytest then leaves PYTEST_CURRENT_TEST set: not the test's leak


@pytest.mark.msrun(worker_num=2)
def test_clean(rank, teardown_skips):
    pass


@pytest.mark.msrun(worker_num=2)
def test_first_import_of_a_library_that_starts_a_thread(rank):
    import lib_with_a_pool  # noqa: F401 - its thread is the library's, not a leak of this test
"""


POOL = """
import threading, time

threading.Thread(target=time.sleep, args=(5,), name="pool", daemon=True).start()
"""


def test_leaks_are_reported_on_the_test_that_caused_them(pytester, monkeypatch):
    pytester.makepyfile(lib_with_a_pool=POOL)
    result = _run(pytester, monkeypatch, LEAKS)
    result.assert_outcomes(passed=7, skipped=1, warnings=4)  # skipped: a teardown that skips
    text = result.stdout.str()
    assert "test_sets_env left behind in its warm world" in text
    for rank in (0, 1):
        assert f"rank {rank}: environment variable LEFT_BEHIND set" in text
    assert "test_leaves_a_thread_a_child_and_a_file left behind" in text
    assert "thread 'lingering' still running (daemon)" in text
    assert re.search(r"child process \d+ \(sleep\) still running", text)
    detached = r"test_leaves_a_detached_process left behind in its warm world:\s+rank 0: child process \d+ \(sleep\)"
    assert re.search(detached, text)
    assert re.search(r"file descriptor \d+ left open \(.*open\.txt\)", text)
    assert re.search(r"test_sees_clean_env left behind in its warm world:\s+rank 0: working directory changed", text)
    assert "test_clean left behind" not in text and "test_cwd_restored left behind" not in text
    assert "test_first_import_of_a_library_that_starts_a_thread left behind" not in text


NEVER_ENDS = """
import threading, time


def _run():
    while True:
        time.sleep(0.05)


threading.Thread(target=_run, name="never-ends", daemon=False).start()
"""

IMPORTS_IT = """
import pytest


@pytest.mark.msrun(worker_num=2)
def test_imports_a_library_that_keeps_the_rank_from_exiting(rank):
    import lib_never_ends  # noqa: F401 - the library's thread, not this test's leak


@pytest.mark.msrun(worker_num=2)
def test_clean(rank):
    pass
"""


def test_a_hang_at_exit_an_import_started_is_reported_on_the_importing_test(pytester, monkeypatch):
    pytester.makepyfile(lib_never_ends=NEVER_ENDS)
    result = _run(pytester, monkeypatch, IMPORTS_IT, "-rA", "-p", "no:randomly", "--msrun-exit-timeout=3")
    result.assert_outcomes(passed=2, errors=1)
    text = result.stdout.str()
    assert "ERROR test_warm.py::test_imports_a_library_that_keeps_the_rank_from_exiting" in text
    assert re.search(r"rank \d reported every phase, then did not exit within 3 s", text)
    assert "ERROR test_warm.py::test_clean" not in text
    assert "left behind" not in text  # no leak: the world ended after the test, and its exit told


def test_leaks_can_fail_the_test_or_be_ignored(pytester, monkeypatch):
    pytester.makepyfile(lib_with_a_pool=POOL)
    result = _run(pytester, monkeypatch, LEAKS, "--msrun-leaks=error")
    result.assert_outcomes(passed=7, skipped=1, errors=4)  # the call passed, the teardown failed
    assert "(--msrun-leaks=error; isolated=True runs the test in processes of its own)" in result.stdout.str()
    result = _run(pytester, monkeypatch, LEAKS, "--msrun-leaks=off")
    result.assert_outcomes(passed=7, skipped=1)


SHAPES = """
import os

import pytest


@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", range(3))
def test_two(rank, msrun, i):
    assert msrun.all_gather(os.getpid())[rank] == os.getpid()


@pytest.mark.msrun(worker_num=3)
@pytest.mark.parametrize("i", range(3))
def test_three(rank, world_size, i):
    assert world_size == 3


@pytest.mark.msrun(worker_num=2, env={"FLAVOUR": "b"})
def test_other_env(rank):
    assert os.environ["FLAVOUR"] == "b"


@pytest.mark.msrun(worker_num=4, local_worker_num=2)
def test_two_nodes(rank, msrun):
    assert msrun.all_gather(rank) == [0, 1, 2, 3]


def test_plain():
    assert "FLAVOUR" not in os.environ
"""


def test_shapes_get_their_own_worlds_with_xdist_and_exitfirst(pytester, monkeypatch):
    _run(pytester, monkeypatch, SHAPES, "-n", "2").assert_outcomes(passed=9)
    result = _run(pytester, monkeypatch, SHAPES + "\n\n" + FAILING, "-x", name="test_shapes_x")
    result.assert_outcomes(passed=9, failed=1)


FAILING = """
@pytest.mark.msrun(worker_num=2)
def test_zz_fails(rank):
    assert rank == 0


@pytest.mark.msrun(worker_num=2)
def test_zz_not_reached(rank):
    pass
"""


WAITING = """
import pytest


@pytest.mark.msrun(worker_num=2, timeout=120)
def test_rank_1_skips_a_collective(rank, msrun):
    msrun.barrier()
    if rank == 1:
        return  # finished: in a fresh job its exit ends rank 0's wait; here it is still alive
    msrun.all_gather(rank)


@pytest.mark.msrun(worker_num=2)
def test_next(rank, msrun):
    assert msrun.all_gather(rank) == [0, 1]
"""


def test_a_rank_waiting_for_a_rank_that_finished_fails_at_once(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, WAITING, "--durations=0")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert (
        "CollectiveDeadlock: all_gather failed on rank 0: all_gather #2 cannot complete: "
        "rank 1 has left test_rank_1_skips_a_collective's call (passed)"
    ) in text
    call = re.search(r"(\d+\.\d+)s call .*test_rank_1_skips_a_collective", text)
    assert call is not None and float(call.group(1)) < 30  # not the 120 s timeout


TORCH = """
import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo")  # env:// from the job's MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE
    with open(os.environ["INITS"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", range(3))
def test_all_reduce(rank, group, i):
    t = torch.tensor([rank + i], dtype=torch.float32)
    dist.all_reduce(t)
    assert t.item() == 1 + 2 * i
"""


@pytest.mark.torch
def test_a_torch_process_group_in_a_module_fixture_is_made_once_per_world(pytester, monkeypatch):
    inits = pytester.path / "inits.txt"
    monkeypatch.setenv("INITS", str(inits))
    _run(pytester, monkeypatch, TORCH).assert_outcomes(passed=3)
    assert len(inits.read_text().split()) == 2  # one process group per rank for the three tests


MINDSPORE = """
import pytest


@pytest.mark.msrun(worker_num=2, timeout=120)
@pytest.mark.parametrize("i", range(3))
def test_mindspore_init(rank, i):
    from mindspore.communication import get_group_size, get_rank, init

    init()  # MindSpore's own scheduler, started on demand by --scheduler=auto
    assert get_rank() == rank and get_group_size() == 2
"""


@pytest.mark.mindspore
def test_mindspore_jobs_run_warm_without_blaming_its_import(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, MINDSPORE)
    result.assert_outcomes(passed=3)  # no warning: MindSpore's threads and files are its import's


PREFETCH = """
import os
import time
from pathlib import Path

import pytest

if os.environ.get("SHAPE") == "b":  # a rank of the second shape's world: it exists
    Path(os.environ["B_WORLD"]).touch()


@pytest.mark.msrun(worker_num={a})
def test_a_sees_the_next_shape_start(rank):
    deadline = time.monotonic() + float(os.environ["WAIT"])
    while not Path(os.environ["B_WORLD"]).exists():
        assert time.monotonic() < deadline, "the second shape's world did not start during this test"
        time.sleep(0.05)


@pytest.mark.msrun(worker_num=1, env={{"SHAPE": "b"}})
def test_b(rank):
    assert rank == 0
"""


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.skipif(_cpus() < 2, reason="a world is started ahead only where a CPU is left for it")
def test_the_next_shapes_world_starts_while_a_test_runs(pytester, monkeypatch):
    monkeypatch.setenv("B_WORLD", str(pytester.path / "b-world"))
    monkeypatch.setenv("WAIT", "120")
    result = _run(pytester, monkeypatch, PREFETCH.format(a=1), "-p", "no:randomly")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize(
    "why, a, option",
    [
        ("off", 1, "--msrun-prefetch=off"),
        ("no CPU left", _cpus(), "--msrun-prefetch=on"),  # the first world's ranks take every CPU
    ],
)
def test_no_world_is_started_ahead_when_off_or_no_cpu_is_left(pytester, monkeypatch, why, a, option):
    monkeypatch.setenv("B_WORLD", str(pytester.path / "b-world"))
    monkeypatch.setenv("WAIT", "3")  # it never appears during the first test: no race to lose
    result = _run(pytester, monkeypatch, PREFETCH.format(a=a), "-p", "no:randomly", option)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*the second shape's world did not start during this test*"])
