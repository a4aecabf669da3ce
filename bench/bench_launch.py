"""Launcher overhead and failure latency, against baselines measured in the same run.

    python bench/bench_launch.py [--runs 15] [--workers 8] [--torchrun]

* overhead: ``msrun --join=True`` with N trivial workers vs N bare concurrent ``python`` spawns
  of the same script (the floor any launcher pays); target <= 0.10 s (median).
* failure latency: rank 0 records a timestamp and exits 3 while the others sleep; measured
  until msrun has exited, which it does only after every process of the job is gone;
  target <= 0.10 s (median).
* optionally the same N workers under ``torchrun --standalone`` for scale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRIVIAL = "import os\nos.environ.get('RANK_ID')\n"
FAILING = (
    "import os, sys, time\n"
    "if os.environ.get('RANK_ID', os.environ.get('RANK')) == '0':\n"
    "    time.sleep(0.3)\n"
    "    open(os.environ['STAMP'], 'w').write(repr(time.time()))\n"
    "    sys.exit(3)\n"
    "time.sleep(60)\n"
)


def bare(python: str, script: Path, n: int) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([python, "-u", str(script)]) for _ in range(n)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def msrun_cmd(n: int, log_dir: str, script: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest_msrun",
        f"--worker_num={n}",
        f"--local_worker_num={n}",
        "--master_port=0",
        "--join=True",
        f"--log_dir={log_dir}",
        str(script),
    ]


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - t0, rc


def failure_latency(cmd: list[str], env: dict[str, str], stamp: Path) -> float:
    if stamp.exists():
        stamp.unlink()
    rc = subprocess.run(
        cmd, env={**env, "STAMP": str(stamp)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ).returncode
    done = time.time()
    if rc == 0:
        raise RuntimeError("the failing job succeeded?")
    return done - float(stamp.read_text())


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:7.1f} ms (min {min(values) * 1000:.1f}, n={len(values)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--torchrun", action="store_true", help="also time torchrun --standalone")
    args = ap.parse_args()
    n = args.workers
    # A normal install ships bytecode; make sure this checkout has it even under
    # PYTHONDONTWRITEBYTECODE, or every run would measure compiling the launcher.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "pytest_msrun")], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        trivial, failing = tmpd / "trivial.py", tmpd / "failing.py"
        trivial.write_text(TRIVIAL)
        failing.write_text(FAILING)
        for _ in range(2):  # warm caches
            bare(sys.executable, trivial, n)
            timed(msrun_cmd(n, str(tmpd / "warm"), trivial), env)
        base, ours = [], []
        for i in range(args.runs):  # interleave so drift hits both alike
            base.append(bare(sys.executable, trivial, n))
            wall, rc = timed(msrun_cmd(n, str(tmpd / f"ok{i}"), trivial), env)
            if rc != 0:
                raise SystemExit(f"msrun failed with {rc}")
            ours.append(wall)
        fail = [
            failure_latency(msrun_cmd(n, str(tmpd / f"f{i}"), failing), env, tmpd / "stamp") for i in range(args.runs)
        ]
        torch_walls: list[float] = []
        if args.torchrun and shutil.which("torchrun"):
            for _ in range(max(3, args.runs // 3)):
                torch_walls.append(timed(["torchrun", "--standalone", f"--nproc-per-node={n}", str(trivial)], env)[0])

    b, m = statistics.median(base), statistics.median(ours)
    overhead = m - b
    f = statistics.median(fail)
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(f"{n} bare concurrent python spawns     : {median_ms(base)}")
    print(f"msrun --join=True, {n} workers        : {median_ms(ours)}")
    print(f"  ratio msrun / bare                 : {m / b:6.2f}x")
    print(
        f"  launcher overhead (median diff)    : {overhead * 1000:7.1f} ms   target <= 100 ms: "
        f"{'PASS' if overhead <= 0.10 else 'FAIL'}"
    )
    print(
        f"failure -> all gone and msrun exited : {median_ms(fail)}   target <= 100 ms: "
        f"{'PASS' if f <= 0.10 else 'FAIL'}"
    )
    if torch_walls:
        t = statistics.median(torch_walls)
        print(f"torchrun --standalone, {n} workers    : {median_ms(torch_walls)}  ({t / m:.1f}x msrun)")
    return 0 if overhead <= 0.10 and f <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
