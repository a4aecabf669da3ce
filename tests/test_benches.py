"""The benches run (tiny sizes here: their figures come from full runs) and write nothing into
the checkout. Their verdicts are not asserted: timing targets are for benches, not unit tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tree() -> set[str]:
    """Every file under the checkout that git does not ignore, tracked or not, with its size."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = [n for n in out.split("\0") if n]
    return {f"{n}:{(REPO / n).stat().st_size}" for n in names if (REPO / n).exists()}


BENCHES = {
    "launch, fresh install": (
        ["bench_launch.py", "--runs", "1", "--sizes", "2", "--no-mpirun", "--failure-workers", "2", "--instructions"],
        [
            "N = 2",
            "overhead",
            # counted where valgrind is installed (CI installs it), else the bench says why not
            "msrun's own process" if shutil.which("valgrind") else "valgrind is not installed",
            "failure -> every process gone",
            "result:",
        ],
    ),
    "launch, this checkout": (
        ["bench_launch.py", "--runs", "1", "--sizes", "2", "--no-mpirun", "--failure-workers", "2", "--here"],
        ["pmsrun --join=True, 2 workers", "MSRUN_CGROUP=off", "result:"],
    ),
    "collective": (
        ["bench_collective.py", "--sizes", "8", "--runs", "1", "--nodes", "2", "--here"],
        ["N =     8", "collectives after the last rank arrived", "result:"],
    ),
    "collective, traced": (
        ["bench_collective.py", "--sizes", "8", "--runs", "1", "--nodes", "2", "--here", "--trace"],
        ["N =     8", "traced job", "tracing costs", "result:"],
    ),
    "collective, node ranks given": (
        ["bench_collective.py", "--sizes", "8", "--runs", "1", "--nodes", "2", "--here", "--node-rank"],
        ["each given its --node_rank", "N =     8", "result:"],
    ),
    "soak": (
        ["bench_soak.py", "--jobs", "2", "--ranks", "4", "--nodes", "2", "--here"],
        ["beside 2 CPU hogs", "jobs that did not exit 0: 0 of 2", "processes left behind: 0", "result: PASS"],
    ),
    "plugin": (
        ["bench_plugin.py", "--tests", "1", "--runs", "1"],
        ["per-test overhead, marked", "isolated=True (forked per test)", "like for like", "target:"],
    ),
    "warm worlds": (
        ["bench_warm.py", "--tests", "3", "--runs", "1", "--no-torch", "--no-extras"],
        [
            "one more test in a warm world",
            "the first test of a world",
            "fresh processes per test",
            "three shapes",
            "three shapes, env scope test",
            "interleaved shapes:",
            "target:",
        ],
    ),
    "memory watch": (
        ["bench_memory.py", "--calls", "200", "--rounds", "1", "--tests", "2", "--runs", "1"],
        ["rank side, per test, small heap", "end to end, per test (on - off)", "target:"],
    ),
    "fork server": (
        ["bench_forkserver.py", "--runs", "1", "--only-this-project"],
        ["fork server on:", "a further world's start, on / off, per round", "target <= 0.3x"],
    ),
    "dry run": (
        ["bench_dryrun.py", "--ranks", "16", "--small", "8"],
        ["16 simulated ranks", "msrun peak RSS"],
    ),
    "torch dry run": (
        ["bench_torch_dryrun.py", "--rounds", "1"],
        ["floor: 8 ranks, one process", "pmsrun, 65536 ranks", "target: 8 sampled ranks"],
    ),
    "preload": (
        ["bench_preload.py", "--runs", "1"],
        ["first marked test / unmarked, preload:", "a world's start", "sizes 1, 2, 4", "an isolated test"],
    ),
    "torch harnesses": (
        ["bench_torch_harnesses.py", "--runs", "1", "--tests", "2"],
        ["pytest (msrun marker)", "torchrun -m pytest", "torchrun per test"],
    ),
}
NEEDS = {"torch dry run": pytest.mark.torch, "preload": pytest.mark.torch, "torch harnesses": pytest.mark.torch}


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEEDS.get(n, ())) for n in BENCHES])
def test_bench_runs_and_leaves_the_checkout_alone(name):
    args, expected = BENCHES[name]
    before = _tree()
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / args[0]), *args[1:]], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: a target missed under load
    for text in ("machine:", *expected):
        assert text in proc.stdout, proc.stdout + proc.stderr
    assert _tree() == before, "a bench wrote into the checkout"
