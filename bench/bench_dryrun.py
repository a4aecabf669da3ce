"""Dry runs at scale: every simulated rank of a large job, on this machine.

    python bench/bench_dryrun.py [--ranks 1024] [--small 128]

Runs ``msrun --worker_num=N --local_worker_num=N --sim_level=0 --join=True trivial.py`` for a
small and a large N, samples msrun's own resident memory while it runs (it must not grow with
N), and times the large run against N x one bare ``python`` run of the same script measured
here (the floor). Target: 1024 ranks in <= 60 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_env, machine  # noqa: E402


def run(n: int, tmp: Path, env: dict[str, str]) -> tuple[float, int, int]:
    """Wall seconds, msrun's peak RSS (bytes), exit status."""
    cmd = [
        sys.executable,
        "-m",
        "pytest_msrun",
        f"--worker_num={n}",
        f"--local_worker_num={n}",
        "--sim_level=0",
        "--join=True",
        f"--log_dir={tmp / f'logs{n}'}",
        str(tmp / "trivial.py"),
    ]
    t0 = time.perf_counter()
    popen = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = [0]

    def sample() -> None:
        proc = psutil.Process(popen.pid)
        while popen.poll() is None:
            try:
                peak[0] = max(peak[0], proc.memory_info().rss)
            except psutil.Error:
                break
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    rc = popen.wait()
    wall = time.perf_counter() - t0
    sampler.join()
    return wall, peak[0], rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--small", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = bench_env(tmp)  # bytecode cached in the scratch directory, not the checkout
        (tmp / "trivial.py").write_text("import os\nassert int(os.environ['RANK_ID']) < int(os.environ['RANK_SIZE'])\n")
        singles = []
        for _ in range(10):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, str(tmp / "trivial.py")], env={**env, "RANK_ID": "0", "RANK_SIZE": "1"})
            singles.append(time.perf_counter() - t0)
        one = sorted(singles)[len(singles) // 2]
        small_wall, small_rss, small_rc = run(args.small, tmp, env)
        big_wall, big_rss, big_rc = run(args.ranks, tmp, env)
    cpus = len(os.sched_getaffinity(0))
    floor = args.ranks * one / cpus
    print(machine())
    print(f"one bare python run of the rank script  : {one * 1000:7.1f} ms")
    print(
        f"{args.small:5d} simulated ranks                  : {small_wall:7.2f} s   "
        f"msrun peak RSS {small_rss / 2**20:6.1f} MiB"
        f"   exit {small_rc}"
    )
    print(
        f"{args.ranks:5d} simulated ranks                  : {big_wall:7.2f} s   "
        f"msrun peak RSS {big_rss / 2**20:6.1f} MiB"
        f"   exit {big_rc}   target <= 60 s: {'PASS' if big_wall <= 60 and big_rc == 0 else 'FAIL'}"
    )
    print(f"  floor (ranks x bare run / CPUs)       : {floor:7.2f} s   ratio {big_wall / floor:.2f}x")
    print(f"  msrun memory, {args.ranks} vs {args.small} ranks      : {big_rss / max(small_rss, 1):.2f}x")
    return 0 if big_wall <= 60 and big_rc == 0 and small_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
