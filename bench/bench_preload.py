"""Worlds that start with torch loaded: the fork server preloads what the marked tests import.

    python bench/bench_preload.py [--runs 5]

Sessions of real torch (gloo, CPU) tests in this interpreter's environment, interleaved in a
shuffled order each round, each contender with its own pytest cache (warmed by one session
first, as a project's second session has it); ``--msrun-preload=none`` is the code before
preloading, measured in the same run. Per round:

* one 2-rank gloo test: marked (preload), marked (none), marked with no cache (a fresh clone's
  first session), against the same test unmarked (target: preload <= 1.3x unmarked), and the
  marked test's setup - a world's start, from its ranks' start to the test body (target <= 0.3 s);
* twelve 2-rank gloo tests in one world size, against the same twelve in worker_num 1, 2 and 4
  (three worlds; target <= 1.3x);
* eight ``isolated=True`` tests that each make a process group: their call durations (target
  <= 0.15 s each), median and the slowest.

Figures are medians over rounds with the 25th-75th percentile in brackets; ratios are per round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GLOO_GROUP, bench_env, interleaved, machine, quartiles  # noqa: E402

GROUP = GLOO_GROUP
ONE = (
    GROUP
    + """

MARK
def test_all_reduce(rank, group):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
"""
)
PLAIN = """
import torch


def test_all_reduce():
    t = torch.tensor([1.0])
    assert (t + t).item() == 2.0
"""
SIZES = (
    GROUP
    + """

@pytest.mark.parametrize("i", range(12))
def test_all_reduce(rank, world_size, group, i):
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    assert t.item() == world_size
"""
)
SIZES_HOOK = """
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        i = item.callspec.params["i"]  # noqa: F841 - WORKERS may read it
        item.add_marker(pytest.mark.msrun(worker_num=WORKERS))
"""
ISOLATED = """
import time
import pytest
import torch
import torch.distributed as dist


@pytest.mark.msrun(worker_num=2, isolated=True)
@pytest.mark.parametrize("i", range(8))
def test_group(rank, world_size, i):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
"""


def _project(root: Path, name: str, files: dict[str, str]) -> Path:
    path = root / name
    path.mkdir()
    for file, text in {"conftest.py": PHASES, **files}.items():
        (path / file).write_text(text)
    return path


# in each project: every report's phase and duration, written where the bench reads them
PHASES = """
import os


def pytest_runtest_logreport(report):
    if "RANK_ID" not in os.environ:
        with open("phases.txt", "a") as fh:
            fh.write(f"{report.when} {report.duration}\\n")
"""


def _session(project: Path, env: dict[str, str], *args: str) -> tuple[float, str]:
    """One session's wall time, and its reports' phases and durations (``PHASES``)."""
    (project / "phases.txt").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{project.name}: pytest exited {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    phases = project / "phases.txt"
    return took, phases.read_text() if phases.exists() else ""


def _phase(out: str, phase: str) -> list[float]:
    return [float(line.split()[1]) for line in out.splitlines() if line.split()[:1] == [phase]]


def _q(values: list[float], unit: str = "s") -> str:
    lo, mid, hi = quartiles(values)
    return f"{mid:.3f} {unit} [{lo:.3f}-{hi:.3f}]" if unit == "s" else f"{mid:.2f}x [{lo:.2f}-{hi:.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        raise SystemExit("torch is not installed: pip install torch==2.13.0 numpy") from None
    print(machine())
    print(f"torch {torch.__version__}; {args.runs} rounds, interleaved")
    with tempfile.TemporaryDirectory(prefix="bench-preload-") as tmp:
        root = Path(tmp)
        (root / "tmp").mkdir()
        env = bench_env(root, TMPDIR=str(root / "tmp"))  # (torchrun's and torch's own files: here, not in /tmp)
        marked = ONE.replace("MARK", "@pytest.mark.msrun(worker_num=2)")
        one = _project(root, "one", {"test_one.py": marked, "test_plain.py": PLAIN})
        sizes = _project(root, "sizes", {"test_sizes.py": SIZES})
        (sizes / "conftest.py").write_text(PHASES + SIZES_HOOK.replace("WORKERS", "2"))
        mixed = _project(root, "mixed", {"test_sizes.py": SIZES})
        (mixed / "conftest.py").write_text(PHASES + SIZES_HOOK.replace("WORKERS", "(1, 2, 4)[i // 4]"))
        isolated = _project(root, "isolated", {"test_isolated.py": ISOLATED})
        setups: dict[str, list[float]] = {"preload": [], "none": []}
        calls: list[float] = []

        def one_marked(mode: str, cache: bool = True):
            def run(_: int) -> float:
                opts = ["-o", f"cache_dir=.cache-{mode}"] if cache else ["-p", "no:cacheprovider"]
                took, out = _session(one, env, *opts, "test_one.py", f"--msrun-preload={mode}")
                if cache:
                    setups["preload" if mode == "auto" else "none"].extend(_phase(out, "setup")[:1])
                return took

            return run

        def in_dir(project: Path, *extra: str):
            return lambda _: _session(project, env, "-o", f"cache_dir=.cache{'-'.join(extra)}", *extra)[0]

        def isolated_run(_: int) -> float:
            took, out = _session(isolated, env, "-o", "cache_dir=.cache")
            calls.extend(_phase(out, "call"))
            return took

        contenders = {
            "unmarked": lambda _: _session(one, env, "-o", "cache_dir=.cache-plain", "test_plain.py")[0],
            "marked, preload": one_marked("auto"),
            "marked, none": one_marked("none"),
            "marked, preload, no cache": one_marked("auto", cache=False),
            "12 tests, one size": in_dir(sizes),
            "12 tests, sizes 1 2 4": in_dir(mixed),
            "12 tests, sizes 1 2 4, none": in_dir(mixed, "--msrun-preload=none"),
            "8 isolated with a group": isolated_run,
        }
        for run in contenders.values():  # warm each one's cache (the project's second session)
            run(0)
        setups = {"preload": [], "none": []}
        calls.clear()
        times = interleaved(args.runs, contenders)
    print(f"{'session':32} {'median s [p25-p75]':>26}")
    for name, values in times.items():
        print(f"{name:32} {_q(values):>26}")
    per = {name: [t / u for t, u in zip(values, times["unmarked"])] for name, values in times.items()}
    mixed_ratio = [a / b for a, b in zip(times["12 tests, sizes 1 2 4"], times["12 tests, one size"])]
    none_ratio = [a / b for a, b in zip(times["12 tests, sizes 1 2 4, none"], times["12 tests, one size"])]
    print()
    print(f"first marked test / unmarked, preload:            {_q(per['marked, preload'], 'x')}  (target <= 1.3x)")
    print(f"first marked test / unmarked, --msrun-preload=none: {_q(per['marked, none'], 'x')}")
    print(f"first marked test / unmarked, preload, no cache:   {_q(per['marked, preload, no cache'], 'x')}")
    print(f"a world's start (the marked test's setup), preload: {_q(setups['preload'])}  (target <= 0.3 s)")
    print(f"a world's start (the marked test's setup), none:    {_q(setups['none'])}")
    print(f"sizes 1, 2, 4 / one size, preload:                  {_q(mixed_ratio, 'x')}  (target <= 1.3x)")
    print(f"sizes 1, 2, 4 / one size, none:                     {_q(none_ratio, 'x')}")
    slow = max(calls) if calls else 0.0
    print(
        f"an isolated test with a process group (call):      median {statistics.median(calls):.3f} s, "
        f"slowest {slow:.3f} s of {len(calls)}  (target <= 0.15 s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
