"""The plugin's behaviour table: example test files x expected merged outcomes (real jobs, real pytest)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import MARK, wait_gone

EXAMPLES = Path(__file__).parent / "examples"
TIMEOUT = "{timeout}"  # in a pattern: the timeout the example's marker configures (see configured_timeout)

# (example file, extra pytest args, expected outcomes, patterns that must appear in the output)
TABLE = [
    ("all_pass", ["-rP"], {"passed": 1}, [r"Captured stdout call \[rank 0\]", r"output of rank 2"]),
    (
        "one_fails",
        [],
        {"failed": 1},
        [
            r"\[rank 1\] failed first",
            r"AssertionError: rank 1 computed the wrong value",
            r"FAILED test_one_fails.py::test_rank_one_fails - \[rank 1\] AssertionError",
            r"msrun --worker_num=3",
            r"worker_1.log",
        ],
    ),
    (
        "segfault",
        [],
        {"failed": 1},
        [
            r"rank 1 left no record during the call phase and was killed by SIGSEGV \(exit status 139\)",
            r"Fatal Python error: Segmentation fault",
            r"terminated by msrun",
            r"rank 0 was stopped after the first failure \(rank 1 killed by SIGSEGV",
            # what the crashed rank wrote is in the report (and in its log: checked below)
            r"Captured stdout call \[rank 1\] -+\n\[rank 1\] rank 1 wrote this just before it crashed",
        ],
    ),
    ("os_exit_zero", [], {"failed": 1}, [r"rank 1 left no record during the call phase and exited with code 0"]),
    (
        "early_return",
        [],
        {"failed": 1},
        [
            r"\[rank 0\] failed first",
            # a warm world: rank 1 left the call (and waits) without joining the group; fresh (the
            # group joined by the templates the test forked from): the control plane heard it leave
            r"(ClusterError: init\(\) failed on rank 0: rank 1 (exited|has left "
            r"test_rank_one_skips_the_collective's call) without joining the group"
            r"|CollectiveDeadlock: barrier failed on rank 0: barrier #\d+ cannot complete: "
            r"rank 1 has left test_rank_one_skips_the_collective's call \(passed\))",
        ],
    ),
    (
        "skips",
        ["-rs"],
        {"skipped": 2, "failed": 1},
        [
            r"not on this platform",
            r"statically skipped",
            r"skipped on ranks 2 \(.*rank 2 has no device.*\) but ran on ranks 0, 1",
        ],
    ),
    (
        "xfails",
        ["-rxX"],
        {"xfailed": 2, "xpassed": 1, "failed": 1},
        [
            r"XFAIL test_xfails.py::test_xfail_all_ranks",
            r"XFAIL test_xfails.py::test_xfail_one_rank",
            r"XPASS test_xfails.py::test_xpass",
            r"\[XPASS\(strict\)\] strict",
        ],
    ),
    (
        "hang",
        [],
        {"failed": 1},
        [
            r"msrun job timed out after {timeout} s in the call phase \(ranks 0, 1 had not finished\)",
            r"stack of rank 0 at the timeout",
            r"stack of rank 1 at the timeout",
            r"in wait_forever_here",
            r"ranks 0-1 \(2\): wait_forever_here\(\) at test_hang.py:8 <- test_hangs\(\) at test_hang.py:13",
            r"no rank joined the group|every rank joined the group, none entered a collective",
        ],
    ),
    (
        "hang_collective",
        ["--durations=0", "-vv"],
        {"failed": 1},
        [
            r"ranks 0-2 \(3\): barrier\(\) at test_hang_collective.py:16 <- test_stuck\(\)\n",
            r"rank 3: compute\(\) at test_hang_collective.py:8 <- test_stuck\(\) at test_hang_collective.py:15",
            r"ranks 0-2 \(3\) entered barrier #2; not there: 3",
            r"rank 3: last collective barrier #1, none pending",
            # the job's time is the test's: launch in setup, the wait in call (check_durations)
        ],
    ),
    ("fixture_error", [], {"errors": 1}, [r"\[rank 1\] failed first", r"RuntimeError: no device for rank 1"]),
    (
        "parametrized",
        ["-v"],
        {"passed": 5},
        [
            r"test_sizes\[worker_num-1\] PASSED",
            r"test_sizes\[worker_num-2\] PASSED",
            r"test_sizes\[worker_num-4\] PASSED",
            r"test_with_user_params\[1\] PASSED",
        ],
    ),
    (
        "parametrized",
        ["-v", "-k", "worker_num-2"],
        {"passed": 1},
        [r"test_sizes\[worker_num-2\] PASSED"],
    ),  # -k takes an id
    ("classes", ["-v"], {"passed": 3}, [r"TestClass::test_override PASSED"]),
    ("many_failures", ["-x"], {"failed": 1}, [r"stopping after 1 failures"]),
    ("many_failures", ["--maxfail=2"], {"failed": 2}, [r"stopping after 2 failures"]),
    ("shared", [], {"passed": 1}, []),
    ("multinode", [], {"passed": 1}, []),
    ("dryrun", [], {"passed": 2}, []),
    (
        "bad_marker",
        [],
        {"errors": 2},
        [r"msrun\(worker_num=...\) must be a positive int", r"unknown msrun\(\) argument\(s\) \['colour'\]"],
    ),
    (
        "devices",
        ["-rs", "--msrun-devices=cuda:0,1,2"],
        {"passed": 1, "skipped": 1},
        [r"needs 64 devices; this machine has 3 \(cuda: 0,1,2\)"],
    ),
    ("binding", [], {"passed": 2}, []),
    (
        "collect_error_in_rank",
        [],
        {"errors": 1},
        [r"rank 1: collection failed", r"ImportError: rank 1 cannot import a dependency"],
    ),
]


def configured_timeout(example: str) -> float:
    """The timeout the example's ``msrun(..., timeout=N)`` marker sets."""
    source = (EXAMPLES / f"{example}.py").read_text()
    (value,) = re.findall(r"@pytest\.mark\.msrun\([^)]*\btimeout=(\d+(?:\.\d+)?)", source)
    return float(value)


def check_durations(text: str, example: str) -> None:
    """``--durations=0`` of a test that timed out: the launch is in its setup, the wait in its call.

    A fresh job's timeout includes its launch, a warm world's does not, and a loaded machine may
    launch slowly - so the call is not held to a fixed figure but to what the configured timeout
    leaves after the setup: whatever the launch took, the rest of the job's time is the call's.
    """
    timeout = configured_timeout(example)
    took = {when: float(sec) for sec, when in re.findall(r"(?m)^(\d+\.\d\d)s (setup|call|teardown) +\S*::", text)}
    assert {"setup", "call"} <= set(took), text
    assert took["setup"] >= 0.1, f"the launch is the setup's time: {took}"
    assert took["call"] >= timeout - took["setup"] - 1.0, f"the wait is the call's time (timeout {timeout:g} s): {took}"
    assert took["call"] > took.get("teardown", 0.0), took


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
@pytest.mark.parametrize(
    "example,args,outcomes,patterns",
    TABLE,
    ids=[f"{name}{''.join(a.split('=')[0] for a in args)}" for name, args, _, _ in TABLE],
)
def test_example(pytester: pytest.Pytester, monkeypatch, example, args, outcomes, patterns, worlds):
    """Every example gives the same outcomes in warm worlds and in fresh jobs."""
    mark = f"plugin-{example}-{id(args)}-{worlds}"
    monkeypatch.setenv(MARK, mark)
    pytester.makepyfile(**{f"test_{example}": (EXAMPLES / f"{example}.py").read_text()})
    result = pytester.runpytest_subprocess(*args, f"--msrun-worlds={worlds}", timeout=180)
    text = result.stdout.str()
    result.assert_outcomes(**outcomes)
    for pattern in patterns:
        if TIMEOUT in pattern:
            pattern = pattern.replace(TIMEOUT, f"{configured_timeout(example):g}")
        assert re.search(pattern, text), f"{pattern!r} not in output:\n{text}"
    if "--durations=0" in args:
        check_durations(text, example)
    left = wait_gone(mark)
    assert not left, f"leftover processes: {[p.cmdline() for p in left]}"
    if example == "segfault":
        # the job's log (fresh), or the world's and the test's own part of it (warm)
        logs = list(pytester.path.glob("**/logs/worker_1.log"))
        assert logs and all("rank 1 wrote this just before it crashed" in log.read_text() for log in logs)
