"""A large job's control plane: N ranks on 8 local msrun nodes, init + barrier + all-gather.

    python bench/bench_collective.py [--sizes 64,128,256,512,1024] [--runs 3] [--nodes 8] [--node-rank]
                                     [--trace]

For each size, in shuffled order every round:

* floor: N bare ``python rank.py`` processes (the same imports, no launcher, no communication),
  started by 8 concurrent spawners as 8 msrun nodes would;
* the job: 8 ``pmsrun`` invocations (one hosts the scheduler) of N/8 workers each, every rank
  calling ``cluster.init()``, ``barrier()`` and ``all_gather_object(rank)``; with ``--node-rank``
  each invocation is given its ``--node_rank`` (how multi-node jobs are usually started: the nodes
  start their workers before they register), else the control plane assigns the nodes.

Reported: the job's wall time, its ratio to the floor (target: <= 2x at 512 ranks; every size
exits 0), and the collective time after the last rank arrived (from the ranks' own clocks: the
last rank entering ``init()`` to the last all-gather returning).

With ``--trace`` every round also runs the job traced (``MSRUN_TRACE``, written by node 0, the
other nodes shipping their events over the control plane) and reports what tracing costs: the
traced job against the same round's untraced one, the median of those paired ratios (target:
<= 2 % at 256 ranks) and, steadier on a busy machine, the same for the CPU time of all the job's
processes; the trace must load and hold every rank's lane.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interpreter, job_port, machine, pmsrun, seconds  # noqa: E402

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
RATIO_AT = 512  # ranks: the size the ratio target is for (every size must exit 0)
TRACE_TARGET = 0.02  # tracing's cost, as a share of the job's wall time
TRACE_AT = 256
JOB_DEADLINE = 120.0  # seconds (plus 0.2 s a rank) before a job counts as hung and is stopped
CPU: dict[str, float] = {}  # job tag -> CPU seconds (user + system) of all its processes


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


def wait_all(procs: list[subprocess.Popen[bytes]], deadline: float, scratch: Path, tag: str) -> list[int]:
    """Every msrun's exit status; one still running at ``deadline`` (a hung job) is stopped -
    SIGTERM, which it passes to its processes, then SIGKILL - and the bench fails, showing the
    end of every log the job wrote."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, deadline - time.perf_counter())))
        except subprocess.TimeoutExpired:
            break
    else:
        return codes
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    raise SystemExit(f"the job {tag} hung: stopped after {JOB_DEADLINE:.0f} s and more\n{tails(scratch, tag)}")


def tails(scratch: Path, tag: str) -> str:
    """The end of each msrun's console and of every log the job ``tag`` wrote."""
    out = []
    for log in sorted([*scratch.glob(f"console-{tag}-*.txt"), *scratch.glob(f"logs-{tag}-*/*.log")]):
        lines = log.read_text(errors="replace").splitlines()[-15:]
        out.append(f"--- {log.relative_to(scratch)} (last {len(lines)} lines)\n" + "\n".join(lines))
    return "\n".join(out)


def check_trace(path: Path, n: int) -> None:
    import json

    events = json.loads(path.read_text())["traceEvents"]
    lanes = {ev["pid"] for ev in events if ev.get("name") == "process_name" and ev["pid"] >= 1000}
    if len(lanes) != n:
        raise SystemExit(f"the trace {path} has {len(lanes)} rank lanes, not {n}")
    path.unlink()


def job(
    python: str, env: dict[str, str], scratch: Path, n: int, nodes: int, tag: str, node_rank: bool, trace: bool = False
) -> tuple[float, float]:
    port = job_port()  # nodes find the scheduler by --master_port
    stamps = scratch / f"stamps-{tag}"
    stamps.mkdir()
    job_env = {**env, "STAMPS": str(stamps), "MSRUN_JOB_TOKEN": os.urandom(16).hex()}
    trace_file = scratch / f"trace-{tag}.json"
    if trace:
        job_env["MSRUN_TRACE"] = str(trace_file)
    cmd = [*pmsrun(python), f"--worker_num={n}", f"--local_worker_num={n // nodes}"]
    cmd += [f"--master_port={port}", "--join=True", "--cluster_time_out=600"]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:  # msrun's own lines, shown if the job fails
        consoles = [stack.enter_context(open(scratch / f"console-{tag}-{i}.txt", "wb")) for i in range(nodes)]
        procs = [
            subprocess.Popen(
                [
                    *cmd,
                    f"--log_dir={scratch / f'logs-{tag}-{i}'}",
                    *([f"--node_rank={i}"] if node_rank else []),
                    str(scratch / "rank.py"),
                ],
                env=job_env,
                stdout=console,
                stderr=subprocess.STDOUT,
            )
            for i, console in enumerate(consoles)
        ]
    codes = wait_all(procs, t0 + JOB_DEADLINE + n * 0.2, scratch, tag)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the job, reaped by its msrun
    CPU[tag] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if any(codes):
        raise SystemExit(f"the job {tag} failed: exit codes {codes}\n{tails(scratch, tag)}")
    if trace:
        check_trace(trace_file, n)
    pairs = [tuple(map(float, (stamps / str(r)).read_text().split())) for r in range(n)]
    return wall, max(b for _, b in pairs) - max(a for a, _ in pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,128,256,512,1024")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--node-rank", action="store_true", help="give each msrun its --node_rank")
    ap.add_argument("--trace", action="store_true", help="also run each job traced: what MSRUN_TRACE costs")
    ap.add_argument("--here", action="store_true", help="this interpreter and checkout, not a fresh install")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print(machine())
    how = "each given its --node_rank" if args.node_rank else "nodes assigned by the control plane"
    print(f"{args.nodes} msrun nodes on this host ({how}); {args.runs} rounds per size, shuffled; medians [25th-75th]")
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        python, env = interpreter(scratch, args.here)
        (scratch / "rank.py").write_text(RANK)
        (scratch / "spawner.py").write_text(SPAWNER)
        rng = random.Random(1)
        for n in sizes:
            floors, walls, colls, traced = [], [], [], []
            for i in range(args.runs):
                order = ["floor", "job"] + (["traced"] if args.trace else [])
                rng.shuffle(order)
                for what in order:
                    if what == "floor":
                        floors.append(floor(python, env, scratch, n, args.nodes))
                    elif what == "traced":
                        tag = f"{n}-{i}-traced"
                        traced.append(job(python, env, scratch, n, args.nodes, tag, args.node_rank, trace=True)[0])
                    else:
                        wall, coll = job(python, env, scratch, n, args.nodes, f"{n}-{i}", args.node_rank)
                        walls.append(wall)
                        colls.append(coll)
            ratio = statistics.median(walls) / statistics.median(floors)
            line = (
                f"N = {n:5}: floor {seconds(floors)}  job {seconds(walls)}  ratio {ratio:.2f}x  "
                f"collectives after the last rank arrived {seconds(colls)}"
            )
            if n == RATIO_AT:
                ok = ratio <= RATIO_TARGET
                line += f"  target ratio <= {RATIO_TARGET:.0f}x: {'PASS' if ok else 'FAIL'}"
                failed += [] if ok else [f"ratio N={n}"]
            print(line, flush=True)
            if traced:
                # each round's traced job against the same round's untraced one (paired: the
                # machine's drift between rounds cancels), median and quartiles of those ratios
                paired = sorted(t / w - 1 for t, w in zip(traced, walls))
                cost = statistics.median(paired)
                q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [cost, cost, cost]
                line = (
                    f"          traced job {seconds(traced)}  tracing costs {cost * 100:+.1f} % of the job "
                    f"[{q[0] * 100:+.1f}..{q[2] * 100:+.1f}] (median of {len(paired)} paired rounds)"
                )
                cpu = sorted(CPU[f"{n}-{i}-traced"] / CPU[f"{n}-{i}"] - 1 for i in range(len(traced)))
                line += f", CPU of all its processes {statistics.median(cpu) * 100:+.1f} %"
                if n == TRACE_AT:
                    ok = cost <= TRACE_TARGET
                    line += f"  target <= {TRACE_TARGET * 100:.0f} %: {'PASS' if ok else 'FAIL'}"
                    failed += [] if ok else [f"trace cost N={n}"]
                print(line, flush=True)
    print(f"\nresult: {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
