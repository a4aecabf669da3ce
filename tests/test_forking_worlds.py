"""Forking worlds: ``isolated=True`` (and ``--msrun-worlds=fresh``) run each marked test in processes
of its own, forked from a world's templates - every fixture and every piece of process state new,
the start-up of Python, pytest and the test modules paid once per world.

What a forked test does to its process ends with it; what it does to the world (the control
plane's group, a process left running, a per-process runtime) ends the world after it; a template
that cannot fork safely (a thread an import started) sends its tests to fresh jobs. The verdicts
of every scenario in this mode are in ``test_verdict_scenarios.py``.
"""

from __future__ import annotations

import re
import uuid

import pytest
from conftest import MARK, wait_gone

PIDS = """
import atexit, os, sys, tempfile

import pytest

HELD = tempfile.TemporaryDirectory()  # the module's (the template's): it outlives every test
STATE = []


@pytest.fixture(scope="module")
def per_module():
    with open(os.environ["SETUPS"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")


@pytest.mark.msrun(worker_num=2, isolated=True)
@pytest.mark.parametrize("i", range(3))
def test_forked(rank, msrun, per_module, i):
    assert msrun.all_gather(rank) == [0, 1]  # the group the template joined, shared by its children
    assert STATE == [] and "LEFT_BY_A_TEST" not in os.environ  # nothing an earlier test did
    assert os.path.isdir(HELD.name)  # the template's exit handlers did not run in a child
    STATE.append(i)
    os.environ["LEFT_BY_A_TEST"] = "1"
    atexit.register(lambda: open(os.path.join(os.environ["SETUPS"] + f".exit{i}.{rank}"), "w").close())
    print(f"PID {i} {rank} {os.getpid()} {os.getppid()}")
"""


def _run(pytester, monkeypatch, source: str, *args: str):
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    pytester.makepyfile(test_forking=source)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "-rA", *args, timeout=240)
    left = wait_gone(mark)
    assert not left, f"leftover processes: {[p.cmdline() for p in left]}"
    return result


def _pids(text: str) -> dict[tuple[str, str], tuple[str, str]]:
    return {(m[0], m[1]): (m[2], m[3]) for m in re.findall(r"PID (\w+) (\d) (\d+) (\d+)", text)}


def test_each_isolated_test_runs_in_processes_forked_from_one_world(pytester, monkeypatch):
    setups = pytester.path / "setups.txt"
    monkeypatch.setenv("SETUPS", str(setups))
    result = _run(pytester, monkeypatch, PIDS)
    result.assert_outcomes(passed=3)
    pids = _pids(result.stdout.str())
    for rank in ("0", "1"):
        assert len({pids[(str(i), rank)][0] for i in range(3)}) == 3  # a process per test
        assert len({pids[(str(i), rank)][1] for i in range(3)}) == 1  # forked from one template
    assert len(setups.read_text().split()) == 6  # module fixtures: once per test and rank
    assert len(list(pytester.path.glob("setups.txt.exit*"))) == 6  # each test's exit handlers ran


def test_fresh_mode_forks_too(pytester, monkeypatch):
    monkeypatch.setenv("SETUPS", str(pytester.path / "setups.txt"))
    result = _run(pytester, monkeypatch, PIDS.replace("isolated=True", "isolated=False"), "--msrun-worlds=fresh")
    result.assert_outcomes(passed=3)
    pids = _pids(result.stdout.str())
    assert len({pids[(str(i), "0")][1] for i in range(3)}) == 1


THREADED = """
import threading

import pytest

threading.Thread(target=threading.Event().wait, name="started-at-import", daemon=True).start()


@pytest.mark.msrun(worker_num=2, isolated=True)
@pytest.mark.parametrize("i", range(2))
def test_it(rank, i):
    pass
"""


def test_a_template_an_import_gave_a_thread_sends_its_tests_to_fresh_jobs(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, THREADED)
    result.assert_outcomes(passed=2)
    text = result.stdout.str()
    assert text.count("ran as a fresh job: its ranks run 1 thread(s) an import started ('started-at-import')") == 1
    assert "msrun_note" not in text


ENDS_THE_WORLD = """
import os, subprocess

import pytest
from pytest_msrun.control import cluster


@pytest.mark.msrun(worker_num=2, isolated=True)
@pytest.mark.parametrize("how", ["keeps", "leaves_the_group", "keeps_again", "leaves_a_process", "last"])
def test_it(rank, msrun, how):
    msrun.barrier()
    if how == "leaves_the_group":
        cluster.finalize()
    if how == "leaves_a_process":
        subprocess.Popen(["sleep", "300"], start_new_session=True)
    print(f"PID {how} {rank} {os.getpid()} {os.getppid()}")
"""


def test_a_test_that_changes_the_world_ends_it(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, ENDS_THE_WORLD)
    result.assert_outcomes(passed=5)
    pids = _pids(result.stdout.str())
    for rank in ("0", "1"):
        template = {how: parent for (how, r), (_, parent) in pids.items() if r == rank}
        assert template["keeps"] == template["leaves_the_group"]  # the world ends after the test
        assert template["leaves_the_group"] != template["keeps_again"]
        assert template["keeps_again"] == template["leaves_a_process"] != template["last"]


HANGS = """
import os, time

import pytest


@pytest.mark.msrun(worker_num=2, isolated=True, timeout=4)
def test_hangs_in_its_body(rank):
    if rank == 1:
        time.sleep(60)


@pytest.mark.msrun(worker_num=2, isolated=True)
def test_after(rank):
    pass
"""


def test_a_forked_test_that_times_out_shows_its_own_stack(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, HANGS)
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "timed out after 4 s" in text
    assert re.search(r"line \d+ in test_hangs_in_its_body", text), text


TORCH = """
import os

import pytest
import torch  # its runtime's native threads are in the template: it forks all the same


@pytest.mark.msrun(worker_num=2, isolated=True)
@pytest.mark.parametrize("i", range(2))
def test_compute(rank, i):
    assert torch.ones(64, 64).matmul(torch.ones(64, 64)).sum().item() == 64 * 64 * 64
    print(f"PID c{i} {rank} {os.getpid()} {os.getppid()}")


@pytest.mark.msrun(worker_num=2, isolated=True)
@pytest.mark.parametrize("i", range(2))
def test_distributed(rank, world_size, i):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    dist.destroy_process_group()
    print(f"PID d{i} {rank} {os.getpid()} {os.getppid()}")
"""


@pytest.mark.torch
def test_torch_tests_fork_and_each_makes_its_own_process_group(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, TORCH)
    result.assert_outcomes(passed=4)
    pids = _pids(result.stdout.str())
    for rank in ("0", "1"):
        assert len({pids[(name, rank)][1] for name in ("c0", "c1", "d0", "d1")}) == 1  # one template
        assert len({pids[(name, rank)][0] for name in ("c0", "c1", "d0", "d1")}) == 4  # a process per test
    assert "ran as a fresh job" not in result.stdout.str()


MINDSPORE = """
import os

import pytest


@pytest.mark.msrun(worker_num=2, isolated=True)
@pytest.mark.parametrize("i", range(2))
def test_init(rank, i):
    from mindspore.communication import get_rank, init

    init()
    assert get_rank() == rank
    print(f"PID m{i} {rank} {os.getpid()} {os.getppid()}")
"""


@pytest.mark.mindspore
def test_mindspore_communication_ends_its_world(pytester, monkeypatch):
    # MindSpore's ranks register with its scheduler once per process: the world a test initialised
    # it in ends after that test, and the next test forks from a new one.
    result = _run(pytester, monkeypatch, MINDSPORE)
    result.assert_outcomes(passed=2)
    pids = _pids(result.stdout.str())
    for rank in ("0", "1"):
        assert pids[("m0", rank)][1] != pids[("m1", rank)][1]


EXITS = """
import pytest


@pytest.mark.msrun(worker_num=2, isolated=True)
def test_exits(rank):
    if rank == 1:
        pytest.exit("rank 1 stops its session", returncode=3)
"""


def test_pytest_exit_in_a_forked_test_ends_its_rank_with_that_status(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, EXITS)
    assert result.ret == 1
    text = result.stdout.str()
    assert re.search(r"rank 1 .*exited with code 3", text), text


KILLED = """
import os, signal

import pytest


@pytest.mark.msrun(worker_num=2, isolated=True)
def test_killed(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.{sig})
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV"])
def test_a_forked_test_killed_by_a_signal_ends_its_rank_by_that_signal(pytester, monkeypatch, sig):
    """The rank ends as its test's process did: killed by the signal (SIGKILL cannot be handled,
    and its rank once exited 137 instead)."""
    result = _run(pytester, monkeypatch, KILLED.format(sig=sig))
    assert result.ret == 1
    text = result.stdout.str()
    assert re.search(rf"rank 1 .*(killed by|terminated by) {sig}", text), text


SLOW_TO_END = """
import os, signal, time
from pathlib import Path

import pytest

OUT = Path({out!r})


@pytest.mark.msrun(worker_num=2)
def test_ends_slowly(rank):
    if rank == 0:
        deadline = time.monotonic() + 60
        while not (OUT / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(3)  # the first failure: msrun ends the job, rank 1 gets SIGTERM

    def on_term(signum, frame):  # like coverage saving its data: slow, and not re-entrant
        if (OUT / "start").exists():
            (OUT / "nested").touch()
            return
        (OUT / "start").touch()
        time.sleep(1.0)  # the handler's own work, not a synchronisation
        (OUT / "end").touch()
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    (OUT / "ready").touch()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until msrun ends the job
        time.sleep(0.01)
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_a_rank_ending_on_sigterm_finishes_its_handler_once(pytester, monkeypatch, worlds):
    """msrun tears a job down with one SIGTERM per process and waits its grace: a rank's SIGTERM
    handler (coverage saving its data) runs once, to its end. In a forking world the template
    waits for its child (which is the rank) instead of ending first and taking the child with it
    (its parent-death signal)."""
    out = pytester.path / "out"
    out.mkdir()
    result = _run(pytester, monkeypatch, SLOW_TO_END.format(out=str(out)), f"--msrun-worlds={worlds}")
    result.assert_outcomes(failed=1)
    assert (out / "end").exists(), result.stdout.str()
    assert not (out / "nested").exists(), "a second SIGTERM ran the handler inside the first"
