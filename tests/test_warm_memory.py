"""Memory watched per test in warm and forking worlds: a test that grows a rank past
--msrun-leak-rss is named (or failed, --msrun-leaks=error); a rank past --msrun-max-rss ends its
world after the test."""

from __future__ import annotations

import re
import uuid

import pytest
from conftest import MARK, wait_gone
from hypothesis import given
from hypothesis import strategies as st

from pytest_msrun import sizes
from pytest_msrun.plugin import rankmemory

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


# ---------------------------------------------------------------- the rules, against tiny oracles
FACTORS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "kB": 1000, "KB": 1000}
FACTORS.update({"MB": 1000**2, "GB": 1000**3, "TB": 1000**4, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3})
FACTORS.update({"TiB": 1024**4, "mib": 1024**2, "gb": 1000**3})


@given(st.integers(0, 10**15 - 1), st.sampled_from(sorted(FACTORS)), st.sampled_from(["", " "]))
def test_sizes_in_every_unit(n, unit, space):
    assert sizes.parse_size(f"{n}{space}{unit}") == n * FACTORS[unit]


@given(st.integers(0, 10**6), st.integers(0, 999), st.sampled_from(["MiB", "GB", "K"]))
def test_fractional_sizes_round_down(whole, thousandths, unit):
    expected = (whole * 1000 + thousandths) * FACTORS[unit] // 1000
    assert sizes.parse_size(f"{whole}.{thousandths:03d}{unit}") == expected


@given(st.text(max_size=30))
def test_any_text_is_a_size_or_one_clear_error(text):
    try:
        assert sizes.parse_size(text) >= 0
    except ValueError as exc:
        assert "is not a size: use a size such as 200MB" in str(exc)


@pytest.mark.parametrize("text", ["", "-1", "1e9", "nan", "inf", "1.5.5M", "12 parsecs", "0x10", "1,000"])
def test_not_sizes(text):
    with pytest.raises(ValueError, match="is not a size"):
        sizes.parse_size(text)


@given(st.integers(-(1 << 45), 1 << 45))
def test_sizes_are_shown_close_to_their_value(n):
    shown = sizes.format_size(n)
    number, _, unit = shown.partition(" ")
    factor = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[unit]
    assert abs(float(number) * factor - n) <= 0.05 * factor


SIZES = st.integers(0, 1 << 36)


@given(SIZES, SIZES, st.integers(-(1 << 30), 1 << 30), st.booleans(), st.integers(-1, 1 << 32))
def test_a_growth_is_named_iff_past_the_bound_less_imports_and_a_new_runtime(before, after, owned, runtime, bound):
    sample = {"before": before, "after": after, "owned": owned}
    if runtime:
        sample.update(runtime=True, devices={"cuda:0": [0, 0, 0, 0]})
    named = bound > 0 and not runtime and after - before - max(owned, 0) > bound  # the oracle
    items = rankmemory.judge(sample, bound)
    assert bool(items) == named
    if named:
        assert items[0].startswith(f"resident memory grew by {sizes.format_size(after - before - max(owned, 0))}")


@given(SIZES, SIZES, SIZES, SIZES, st.integers(1, 1 << 32))
def test_device_growth_is_judged_by_allocated_memory(alloc0, alloc1, reserved0, reserved1, bound):
    sample = {"before": 0, "after": 0, "owned": 0, "runtime": False}
    sample["devices"] = {"cuda:1": [alloc0, reserved0, alloc1, reserved1]}
    items = rankmemory.judge(sample, bound)
    assert bool(items) == (alloc1 - alloc0 > bound)
    assert all(item.startswith("cuda:1 memory allocated grew by") for item in items)


@given(st.one_of(st.none(), st.text(), st.lists(st.integers()), st.dictionaries(st.text(), st.text())))
def test_samples_from_the_wire_are_judged_totally(sample):
    assert rankmemory.judge(sample, 1) == [] or isinstance(sample, dict)
    assert rankmemory.past_max(sample, 1) is False


@given(st.integers(-10, 1 << 40), st.integers(-10, 1 << 40))
def test_past_max(resident, maximum):
    assert rankmemory.past_max(resident, maximum) == (maximum > 0 and resident > maximum)


class _Cuda:
    def __init__(self, initialised: bool) -> None:
        self.initialised = initialised

    def is_initialized(self) -> bool:
        return self.initialised

    def device_count(self) -> int:
        return 2

    def memory_allocated(self, i: int) -> int:
        return 100 + i

    def memory_reserved(self, i: int) -> int:
        return 200 + i


class _Torch:
    def __init__(self, initialised: bool) -> None:
        self.cuda = _Cuda(initialised)


def test_device_memory_only_where_a_framework_initialised_it():
    assert rankmemory.devices({}) == {}  # never imported to look
    assert rankmemory.devices({"torch": _Torch(False)}) == {}
    assert rankmemory.devices({"torch": _Torch(True)}) == {"cuda:0": [100, 200], "cuda:1": [101, 201]}


WATCHED = """
from pytest_msrun.plugin import rankmemory


def _touched(size):
    return bytearray(b"m") * size


big = 120 << 20
watch = rankmemory.Watch()
watch.enter()  # a first import
imported = _touched(big)
watch.exit()
assert rankmemory.judge(watch.end(100 << 20), 100 << 20) == [], "an import's growth counted"
cycle = [_touched(big)]
cycle.append(cycle)  # garbage only a collection frees
del cycle
assert rankmemory.judge(watch.end(100 << 20), 100 << 20) == [], "garbage counted"
kept = _touched(big)
assert rankmemory.judge(watch.end(100 << 20), 100 << 20), "a kept 120 MiB not named"
"""


def test_the_watch_counts_the_tests_growth_not_what_imports_grew_nor_garbage():
    """In a process of its own (this one's heap holds whatever earlier tests left)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", WATCHED], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
