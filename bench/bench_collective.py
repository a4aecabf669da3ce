"""A large job's control plane: N ranks on 8 local msrun nodes, init + barrier + all-gather.

    python bench/bench_collective.py [--sizes 64,128,256,512,1024] [--runs 3] [--nodes 8]

For each size, in shuffled order every round:

* floor: N bare ``python rank.py`` processes (the same imports, no launcher, no communication),
  started by 8 concurrent spawners as 8 msrun nodes would;
* the job: 8 ``pmsrun`` invocations (one hosts the scheduler) of N/8 workers each, every rank
  calling ``cluster.init()``, ``barrier()`` and ``all_gather_object(rank)``.

Reported: the job's wall time, its ratio to the floor (target <= 2x at 1024 ranks), and the
collective time after the last rank arrived (from the ranks' own clocks: the last rank entering
``init()`` to the last all-gather returning).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_env, installed_python, machine, seconds  # noqa: E402

RANK = """
import os, sys, time
from pytest_msrun import cluster
if os.environ.get("FLOOR"):
    sys.exit(0)
t0 = time.time()
cluster.init()
cluster.barrier()
got = cluster.all_gather_object(cluster.get_rank())
t1 = time.time()
assert got == list(range(cluster.get_group_size())), "wrong all-gather"
with open(os.path.join(os.environ["STAMPS"], str(cluster.get_rank())), "w") as fh:
    fh.write(f"{t0} {t1}")
"""
SPAWNER = """
import subprocess, sys
n, python, script = int(sys.argv[1]), sys.argv[2], sys.argv[3]
procs = [subprocess.Popen([python, script]) for _ in range(n)]
sys.exit(max(p.wait() for p in procs))
"""
RATIO_TARGET = 2.0


def floor(python: str, env: dict[str, str], scratch: Path, n: int, nodes: int) -> float:
    spawner, rank = scratch / "spawner.py", scratch / "rank.py"
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen([python, str(spawner), str(n // nodes), python, str(rank)], env={**env, "FLOOR": "1"})
        for _ in range(nodes)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("a floor process failed")
    return time.perf_counter() - t0


def job(python: str, env: dict[str, str], scratch: Path, n: int, nodes: int, tag: str) -> tuple[float, float]:
    from socket import socket

    with socket() as s:  # a free port for the scheduler (nodes find it by --master_port)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stamps = scratch / f"stamps-{tag}"
    stamps.mkdir()
    job_env = {**env, "STAMPS": str(stamps), "MSRUN_JOB_TOKEN": os.urandom(16).hex()}
    cmd = [python, "-m", "pytest_msrun", f"--worker_num={n}", f"--local_worker_num={n // nodes}"]
    cmd += [f"--master_port={port}", "--join=True", "--cluster_time_out=600"]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [*cmd, f"--log_dir={scratch / f'logs-{tag}-{i}'}", str(scratch / "rank.py")],
            env=job_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(nodes)
    ]
    codes = [p.wait() for p in procs]
    wall = time.perf_counter() - t0
    if any(codes):
        raise SystemExit(f"the job failed: exit codes {codes} (logs in {scratch})")
    pairs = [tuple(map(float, (stamps / str(r)).read_text().split())) for r in range(n)]
    return wall, max(b for _, b in pairs) - max(a for a, _ in pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,128,256,512,1024")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--here", action="store_true", help="this interpreter and checkout, not a fresh install")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print(machine())
    print(f"{args.nodes} msrun nodes on this host; {args.runs} rounds per size, shuffled; medians [25th-75th]")
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if args.here:
            python, env = sys.executable, bench_env(scratch)
        else:
            python, env = installed_python(scratch), bench_env(scratch, checkout=False)
        (scratch / "rank.py").write_text(RANK)
        (scratch / "spawner.py").write_text(SPAWNER)
        rng = random.Random(1)
        for n in sizes:
            floors, walls, colls = [], [], []
            for i in range(args.runs):
                order = ["floor", "job"]
                rng.shuffle(order)
                for what in order:
                    if what == "floor":
                        floors.append(floor(python, env, scratch, n, args.nodes))
                    else:
                        wall, coll = job(python, env, scratch, n, args.nodes, f"{n}-{i}")
                        walls.append(wall)
                        colls.append(coll)
            ratio = statistics.median(walls) / statistics.median(floors)
            line = (
                f"N = {n:5}: floor {seconds(floors)}  job {seconds(walls)}  ratio {ratio:.2f}x  "
                f"collectives after the last rank arrived {seconds(colls)}"
            )
            if n >= 1024:
                ok = ratio <= RATIO_TARGET
                line += f"  target ratio <= {RATIO_TARGET:.0f}x: {'PASS' if ok else 'FAIL'}"
                failed += [] if ok else [f"ratio N={n}"]
            print(line, flush=True)
    print(f"\nresult: {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
