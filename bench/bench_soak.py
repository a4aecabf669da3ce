"""Soak: back-to-back jobs beside CPU hogs - every job must exit 0 and leave nothing behind.

    python bench/bench_soak.py [--jobs 40] [--hogs 2] [--ranks 16] [--nodes 2]

Each job is ``--nodes`` ``pmsrun`` invocations of ``--ranks`` ranks in all (init, barrier,
all-gather, a broadcast), started one after the other as a CI loop would. Rounds alternate, in
shuffled order, between "quiet" (nothing else running) and "loaded" (``--hogs`` busy loops
``sh -c 'while :; do :; done'`` beside the job), so the two are measured under the same
conditions otherwise. Reported: jobs that did not exit 0 (the target: none), processes left
behind after each job (target: none), and the loaded/quiet ratio of the median job time.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interpreter, job_port, machine, pmsrun, seconds  # noqa: E402

RANK = """
from pytest_msrun import cluster
cluster.init()
cluster.barrier()
assert cluster.all_gather_object(cluster.get_rank()) == list(range(cluster.get_group_size()))
assert cluster.broadcast_object("from 0" if cluster.get_rank() == 0 else None, src=0) == "from 0"
"""


def job_processes(mark: str) -> int:
    """Processes still carrying this bench's mark in their environment."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if f"SOAK_MARK={mark}".encode() in fh.read().split(b"\0"):
                    count += 1
        except OSError:
            continue
    return count


def run_job(python: str, env: dict[str, str], scratch: Path, ranks: int, nodes: int, tag: str) -> tuple[float, list]:
    port = job_port()
    cmd = [*pmsrun(python), f"--worker_num={ranks}", f"--local_worker_num={ranks // nodes}"]
    cmd += [f"--master_port={port}", "--join=True", "--cluster_time_out=300"]
    token = os.urandom(16).hex()  # the same on every node of the job
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [*cmd, f"--node_rank={i}", f"--log_dir={scratch / f'logs-{tag}-{i}'}", str(scratch / "rank.py")],
            env={**env, "MSRUN_JOB_TOKEN": token},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(nodes)
    ]
    codes = [p.wait() for p in procs]
    return time.perf_counter() - t0, codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=40, help="jobs in all (half quiet, half loaded)")
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--here", action="store_true", help="this interpreter and checkout, not a fresh install")
    args = ap.parse_args()
    print(machine())
    print(
        f"{args.jobs} back-to-back jobs of {args.ranks} ranks on {args.nodes} msrun nodes; half of them beside "
        f"{args.hogs} CPU hogs, in shuffled order"
    )
    mark = os.urandom(8).hex()
    failed: list[str] = []
    times: dict[str, list[float]] = {"quiet": [], "loaded": []}
    leftovers = 0
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        python, env = interpreter(scratch, args.here)
        env["SOAK_MARK"] = mark
        (scratch / "rank.py").write_text(RANK)
        order = ["quiet", "loaded"] * (args.jobs // 2)
        random.Random(1).shuffle(order)
        for i, kind in enumerate(order):
            hogs = []
            if kind == "loaded":
                hogs = [
                    subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True)
                    for _ in range(args.hogs)
                ]
            try:
                wall, codes = run_job(python, env, scratch, args.ranks, args.nodes, str(i))
            finally:
                for hog in hogs:
                    os.killpg(hog.pid, signal.SIGKILL)
                    hog.wait()
            times[kind].append(wall)
            if any(codes):
                failed.append(f"job {i} ({kind}): exit codes {codes}")
            deadline = time.monotonic() + 10
            while job_processes(mark) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = job_processes(mark)
            leftovers += left
            if left:
                failed.append(f"job {i} ({kind}): {left} process(es) left behind")
    import statistics

    ratio = statistics.median(times["loaded"]) / statistics.median(times["quiet"])
    print(f"quiet jobs:  {seconds(times['quiet'])}")
    print(f"loaded jobs: {seconds(times['loaded'])}  ({ratio:.2f}x the quiet median)")
    print(f"jobs that did not exit 0: {sum('exit codes' in f for f in failed)} of {len(order)}")
    print(f"processes left behind: {leftovers}")
    for line in failed:
        print("  " + line)
    print(f"\nresult: {'PASS' if not failed else 'FAIL'}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
