"""Memory watched per test in warm and forking worlds: a test that grows a rank past
--msrun-leak-rss is named (or failed, --msrun-leaks=error); a rank past --msrun-max-rss ends its
world after the test."""

from __future__ import annotations

import re
import uuid

import pytest
from conftest import MARK, wait_gone

LEAKY = """
import os

import pytest

KEPT = []


def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.msrun(worker_num=2)
def test_leaks(rank):
    print(f"PID leaks {rank} {os.getpid()} {os.getppid()}")
    if rank == 1:
        before = rss()
        KEPT.append(bytearray(b"x") * (200 << 20))  # written: every page resident
        assert rss() - before > 190 << 20


@pytest.mark.msrun(worker_num=2)
def test_clean(rank):
    print(f"PID clean {rank} {os.getpid()} {os.getppid()}")
    garbage = bytearray(b"y") * (200 << 20)  # freed before the test ends: no leak
    del garbage


@pytest.mark.msrun(worker_num=2)
def test_imports_a_big_module(rank):
    before = rss()
    import big_module  # noqa: F401 - its memory is the module's, as an import of torch's is

    assert rss() - before > 140 << 20
"""

BIG_MODULE = """
TABLE = bytearray(b"z") * (150 << 20)
"""


def _run(pytester, monkeypatch, *args: str):
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    pytester.makepyfile(test_mem=LEAKY, big_module=BIG_MODULE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "-s", *args, timeout=240)
    left = wait_gone(mark)
    assert not left, f"leftover processes: {[p.cmdline() for p in left]}"
    return result


def _pids(text: str) -> dict[tuple[str, str], tuple[str, str]]:
    return {(m[0], m[1]): (m[2], m[3]) for m in re.findall(r"PID (\w+) (\d) (\d+) (\d+)", text)}


LEAK_LINE = r"test_leaks left behind in its warm world:\s+rank 1: resident memory grew by (?:19[5-9]|2\d\d)\.\d MiB \("


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_a_test_that_grows_a_rank_is_named_and_others_are_not(pytester, monkeypatch, worlds):
    result = _run(pytester, monkeypatch, f"--msrun-worlds={worlds}")
    result.assert_outcomes(passed=3, warnings=1)
    text = result.stdout.str()
    assert re.search(LEAK_LINE, text), text
    assert "--msrun-leak-rss=100.0 MiB" in text
    assert "rank 0: resident memory" not in text
    assert "test_clean left behind" not in text and "test_imports_a_big_module left behind" not in text
    pids = _pids(text)
    at = 0 if worlds == "warm" else 1  # the rank's process; a forked test's template
    assert pids[("leaks", "1")][at] == pids[("clean", "1")][at]  # one world served both


def test_leak_rss_errors_and_off(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "--msrun-leaks=error")
    result.assert_outcomes(passed=3, errors=1)
    text = result.stdout.str()
    assert re.search(r"rank 1 left behind in its warm world: resident memory grew by (?:19[5-9]|2\d\d)\.\d MiB", text)
    assert "ERROR test_mem.py::test_leaks" in text or "test_leaks ERROR" in text or "at teardown of test_leaks" in text
    result = _run(pytester, monkeypatch, "--msrun-leak-rss=0")
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize(("worlds", "maximum"), [("warm", "200MB"), ("fresh", "1MB")])
def test_a_rank_past_max_rss_ends_its_world_after_the_test(pytester, monkeypatch, worlds, maximum):
    result = _run(pytester, monkeypatch, f"--msrun-worlds={worlds}", f"--msrun-max-rss={maximum}", "--msrun-leaks=off")
    result.assert_outcomes(passed=3, warnings=3 if worlds == "fresh" else 1)
    text = result.stdout.str()
    pids = _pids(text)
    at = 0 if worlds == "warm" else 1
    assert pids[("leaks", "1")][at] != pids[("clean", "1")][at]  # a new world for the next test
    bound = "190.7 MiB" if maximum == "200MB" else "976.6 KiB"
    assert re.search(rf"rank 1: resident memory \d+\.\d MiB past --msrun-max-rss={bound}", text), text
    assert "test_leaks ended its warm world" in text
    if worlds == "warm":
        assert pids[("leaks", "0")][0] != pids[("clean", "0")][0]  # the whole world, rank 0 too
        assert "test_clean ended its warm world" not in text


@pytest.mark.parametrize(
    ("args", "ini", "said"),
    [
        (["--msrun-leak-rss=lots"], "", "--msrun-leak-rss: 'lots' is not a size"),
        (["--msrun-max-rss=-1GiB"], "", "--msrun-max-rss: '-1GiB' is not a size"),
        ([], "msrun_max_rss = 2 parsecs", "msrun_max_rss in the ini file: '2 parsecs' is not a size"),
    ],
)
def test_bad_sizes_are_usage_errors(pytester, args, ini, said):
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert said in result.stderr.str()
    assert "use a size such as 200MB, 100MiB, 1GiB" in result.stderr.str()
