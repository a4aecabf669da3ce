"""A warm world lives as pytest's own lifecycle says: its next test is this process's next test of
its shape (after skips, deselection, ``-x``, ``--lf``, xdist's distribution), it ends with its last
one, and what its end reveals is reported on the last test that used it - never lost, never on a
test that did not run there."""

from __future__ import annotations

import re
import uuid

import pytest
from conftest import MARK, wait_gone

RAISING_MODULE_FIXTURE = """
import os
import pytest


@pytest.fixture(scope="module")
def resource():
    yield
    raise RuntimeError(f"module fixture teardown failed in {__name__}")
"""


def _run(pytester: pytest.Pytester, monkeypatch, *args: str, **files: str) -> pytest.RunResult:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    pytester.makepyfile(**files)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *args, timeout=240)
    assert not wait_gone(mark), "processes left behind"
    return result


def _errors_on(text: str) -> list[str]:
    """The tests an ERROR line of the short summary names."""
    return re.findall(r"^ERROR (\S+)", text, re.M)


INTERLEAVED = (
    RAISING_MODULE_FIXTURE
    + """

@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", range(2))
def test_a(rank, resource, i):
    pass


@pytest.mark.msrun(worker_num=1)
@pytest.mark.parametrize("i", range(2))
def test_b(rank, resource, i):
    pass


@pytest.mark.msrun(worker_num=2, env={"SHAPE": "c"})
@pytest.mark.parametrize("i", range(2))
def test_c(rank, resource, i):
    pass


def pytest_collection_modifyitems(items):
    pass
"""
)

CONFTEST_INTERLEAVE = """
def pytest_collection_modifyitems(items):
    # a1 b1 c1 a2 b2 c2: three shapes interleaved, each world kept idle for its second test
    items.sort(key=lambda item: (item.callspec.params["i"], item.name))
"""


def test_three_interleaved_shapes_lose_no_fixture_teardown_error(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, conftest=CONFTEST_INTERLEAVE, test_mod=INTERLEAVED)
    text = result.stdout.str()
    counts = result.parseoutcomes()
    assert counts.get("passed") == 6, text
    # every world that set the module fixture up reports its teardown failure on its own last test
    errors = _errors_on(text)
    assert errors and all(e.startswith("test_mod.py::test_") for e in errors), text
    for shape in ("a", "b", "c"):
        assert any(f"test_{shape}[" in e for e in errors), (shape, text)
    assert result.ret == 1


LAST_SKIPPED = (
    RAISING_MODULE_FIXTURE
    + """

@pytest.mark.msrun(worker_num=2)
def test_uses(rank, resource):
    pass


@pytest.mark.skipif(True, reason="static")
@pytest.mark.msrun(worker_num=2)
def test_last_skipped(rank):
    pass
"""
)


@pytest.mark.parametrize("args", [(), ("-n", "2"), ("-x",), ("-k", "uses")], ids=["plain", "xdist", "x", "k"])
def test_a_module_fixture_teardown_error_is_never_lost(pytester, monkeypatch, args):
    result = _run(pytester, monkeypatch, *args, test_mod=LAST_SKIPPED)
    text = result.stdout.str()
    assert "module fixture teardown failed" in text, text
    assert result.parseoutcomes().get("errors") == 1, text
    assert result.ret == 1


EXITFIRST = (
    RAISING_MODULE_FIXTURE
    + """

@pytest.mark.msrun(worker_num=2)
def test_fails(rank, resource):
    assert rank == 0


@pytest.mark.msrun(worker_num=2)
def test_never_reached(rank, resource):
    pass
"""
)


def test_exitfirst_ends_the_world_with_the_failing_test(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "-x", test_mod=EXITFIRST)
    text = result.stdout.str()
    counts = result.parseoutcomes()
    assert counts.get("failed") == 1 and counts.get("errors") == 1, text
    assert _errors_on(text) == ["test_mod.py::test_fails"], text
    assert "test_never_reached" not in text.split("short test summary info")[-1]


LAST_FAILED = (
    RAISING_MODULE_FIXTURE
    + """

@pytest.mark.msrun(worker_num=2)
def test_passes(rank, resource):
    pass


@pytest.mark.msrun(worker_num=2)
def test_fails_first_time(rank, resource, msrun_tmp_path):
    flag = os.path.join(os.environ["FLAGS"], f"ran{rank}")
    if not os.path.exists(flag):
        open(flag, "w").close()
        raise AssertionError("first time")
"""
)


def test_last_failed_reruns_only_the_failure_and_reports_the_teardown_on_it(pytester, monkeypatch):
    flags = pytester.mkdir("flags")
    monkeypatch.setenv("FLAGS", str(flags))
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    pytester.makepyfile(test_mod=LAST_FAILED)
    first = pytester.runpytest_subprocess("-rA", timeout=240)
    assert first.parseoutcomes().get("failed") == 1, first.stdout.str()
    second = pytester.runpytest_subprocess("-rA", "--lf", timeout=240)
    text = second.stdout.str()
    assert second.parseoutcomes().get("passed") == 1, text
    assert _errors_on(text) == ["test_mod.py::test_fails_first_time"], text
    assert not wait_gone(mark)


TWO_MODULES_SHARED_SHAPE = {
    "test_m1": RAISING_MODULE_FIXTURE
    + """

@pytest.mark.msrun(worker_num=2)
def test_first(rank, resource):
    pass
""",
    "test_m2": """
import pytest


@pytest.mark.msrun(worker_num=2)
def test_innocent(rank):
    pass
""",
}


def test_another_modules_fixture_teardown_is_not_blamed_on_an_innocent_test(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, **TWO_MODULES_SHARED_SHAPE)
    text = result.stdout.str()
    assert _errors_on(text) == ["test_m1.py::test_first"], text
    assert re.search(r"PASSED test_m2.py::test_innocent", text), text


KILLED_BETWEEN_TESTS = """
import os, signal
import pytest


@pytest.mark.msrun(worker_num=2)
def test_first(rank, msrun_tmp_path):
    with open(os.path.join(os.environ["PIDS"], f"rank{rank}"), "w") as fh:
        fh.write(str(os.getpid()))


def test_plain_kills_rank_1():
    with open(os.path.join(os.environ["PIDS"], "rank1")) as fh:
        os.kill(int(fh.read()), signal.SIGKILL)


@pytest.mark.msrun(worker_num=2)
def test_innocent(rank):
    pass
"""


def test_a_world_that_died_between_tests_is_not_reused_nor_blamed_on_the_next_test(pytester, monkeypatch):
    monkeypatch.setenv("PIDS", str(pytester.mkdir("pids")))
    result = _run(pytester, monkeypatch, test_mod=KILLED_BETWEEN_TESTS)
    text = result.stdout.str()
    assert re.search(r"PASSED test_mod.py::test_innocent", text), text
    assert _errors_on(text) == ["test_mod.py::test_first"], text
    assert "SIGKILL" in text and "its world ended later" in text


KILLED_AFTER_ITS_REPORT = """
import os
import pytest


@pytest.mark.msrun(worker_num=2)
def test_first(rank, msrun_tmp_path):
    with open(os.path.join(os.environ["PIDS"], f"rank{rank}"), "w") as fh:
        fh.write(str(os.getpid()))


@pytest.mark.msrun(worker_num=2)
def test_innocent(rank):
    pass
"""

# The session's own process (not a rank's) kills rank 1 once test_first's last report is logged, and waits until
# it has ended (a zombie of msrun's, or reaped): the world dies between the two tests it serves.
KILLER_CONFTEST = """
import os, signal, time


def pytest_runtest_logreport(report):
    if "RANK_ID" in os.environ:  # a rank's own session: the session's process alone kills
        return
    if report.nodeid.endswith("test_first") and report.when == "teardown" and report.passed:
        with open(os.path.join(os.environ["PIDS"], "rank1")) as fh:
            pid = int(fh.read())
        try:  # under xdist its controller logs the report too, once rank 1 may be gone
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except OSError:
                break
            time.sleep(0.01)
"""


@pytest.mark.parametrize("xdist", [[], ["-n", "1"]], ids=["plain", "xdist"])
def test_a_world_that_died_after_its_tests_report_fails_that_test_in_every_mode(pytester, monkeypatch, xdist):
    """One outcome in every mode: under pytest-xdist too the late end is the last test's teardown
    error and the session fails (it was a warning there, and the session passed)."""
    monkeypatch.setenv("PIDS", str(pytester.mkdir("pids")))
    result = _run(pytester, monkeypatch, *xdist, conftest=KILLER_CONFTEST, test_mod=KILLED_AFTER_ITS_REPORT)
    text = result.stdout.str()
    assert result.ret == 1, text
    assert re.search(r"PASSED test_mod.py::test_innocent", text), text
    assert _errors_on(text) == ["test_mod.py::test_first"], text
    assert "SIGKILL" in text and "its world ended later" in text


IMPORT_AND_THREAD = """
import threading, time
import pytest


@pytest.mark.msrun(worker_num=2)
def test_imports_and_leaks(rank):
    import lib_with_a_pool  # noqa: F401 - its thread is the library's
    threading.Thread(target=time.sleep, args=(5,), name="the-tests-own", daemon=True).start()


@pytest.mark.msrun(worker_num=2)
def test_after(rank):
    pass
"""

POOL = """
import threading, time

threading.Thread(target=time.sleep, args=(5,), name="pool", daemon=True).start()
"""


def test_a_test_that_imports_a_library_is_still_charged_with_its_own_thread(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, lib_with_a_pool=POOL, test_mod=IMPORT_AND_THREAD)
    text = result.stdout.str()
    assert "thread 'the-tests-own' still running (daemon)" in text, text
    assert "'pool'" not in text, text
    assert result.parseoutcomes().get("passed") == 2


DEVICES = """
import time
import pytest


@pytest.mark.msrun(worker_num=1, devices=1, timeout=4)
@pytest.mark.parametrize("i", range(4))
def test_on_a_device(rank, i):
    pass


@pytest.mark.parametrize("i", range(4))
def test_plain_work(i):
    time.sleep(5)  # the work: a world kept alive across it would hold the device idle
"""

INTERLEAVE_BY_I = """
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: (item.callspec.params["i"], item.name))
"""


def test_xdist_workers_share_devices_without_starving(pytester, monkeypatch):
    result = _run(
        pytester, monkeypatch, "-n", "2", "--msrun-devices=cuda:0", conftest=INTERLEAVE_BY_I, test_mod=DEVICES
    )
    text = result.stdout.str()
    assert result.parseoutcomes().get("passed") == 8, text
    assert "waited" not in text
