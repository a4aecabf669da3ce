"""Per-test cost of a 2-rank marked test, against baselines measured in the same run.

    python bench/bench_plugin.py [--tests 5] [--runs 3]

* plain: the same trivial tests, unmarked (pytest's own per-test cost);
* marked: ``@pytest.mark.msrun(worker_num=2)`` (scheduler + 2 rank pytest processes per test);
* subprocess pattern: each test shells out to ``msrun ... --scheduler=task pytest file::case``
  and checks the exit status, as MindSpore's own tests do (the scheduler runs pytest too);
* one rank's pytest start-up: ``python -m pytest file::case`` for one trivial test.

Target: marked per-test overhead <= one rank's pytest start-up + 0.1 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_files(d: Path, n: int) -> None:
    (d / "inner.py").write_text("def test_inner():\n    pass\n")
    (d / "test_plain.py").write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(n)))
    (d / "test_marked.py").write_text(
        "import pytest\n\n"
        + "".join(f"@pytest.mark.msrun(worker_num=2)\ndef test_{i}(rank):\n    pass\n\n" for i in range(n))
    )
    (d / "test_subprocess.py").write_text(
        textwrap.dedent(
            """
            import socket, subprocess, sys

            def _port():
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    return s.getsockname()[1]

            def _job(tmp_path):
                cmd = [sys.executable, "-m", "pytest_msrun", "--worker_num=2", "--local_worker_num=2",
                       f"--master_port={_port()}", "--join=True", "--scheduler=task", f"--log_dir={tmp_path}",
                       sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "inner.py::test_inner"]
                assert subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
            """
        )
        + "".join(f"\ndef test_{i}(tmp_path):\n    _job(tmp_path)\n" for i in range(n))
    )


def timed(args: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"pytest {args} failed:\n{proc.stdout.decode()[-3000:]}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    n = args.tests
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "pytest_msrun")], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    results: dict[str, list[float]] = {"startup": [], "plain": [], "marked": [], "subprocess": []}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_files(d, n)
        timed(["test_plain.py"], d, env)  # warm caches
        for _ in range(args.runs):
            results["startup"].append(timed(["inner.py::test_inner"], d, env))
            results["plain"].append(timed(["test_plain.py"], d, env))
            results["marked"].append(timed(["test_marked.py"], d, env))
            results["subprocess"].append(timed(["test_subprocess.py"], d, env))
    med = {k: statistics.median(v) for k, v in results.items()}
    marked = (med["marked"] - med["plain"]) / n
    sub = (med["subprocess"] - med["plain"]) / n
    target = med["startup"] + 0.1
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; {n} tests per file, {args.runs} runs")
    print(f"one rank's pytest start-up (1 trivial test)   : {med['startup'] * 1000:7.0f} ms")
    print(f"{n} plain tests                                : {med['plain'] * 1000:7.0f} ms")
    print(f"{n} marked tests, worker_num=2                 : {med['marked'] * 1000:7.0f} ms")
    print(f"{n} tests shelling out to msrun ... pytest     : {med['subprocess'] * 1000:7.0f} ms")
    print(
        f"per-test overhead, marked                     : {marked * 1000:7.0f} ms   "
        f"target <= start-up + 100 ms = {target * 1000:.0f} ms: {'PASS' if marked <= target else 'FAIL'}"
    )
    print(
        f"per-test overhead, subprocess pattern         : {sub * 1000:7.0f} ms   (marked/subprocess = "
        f"{marked / sub:.2f})"
    )
    return 0 if marked <= target else 1


if __name__ == "__main__":
    sys.exit(main())
