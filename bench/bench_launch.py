"""Launch overhead and failure latency, against baselines measured in the same run.

    python bench/bench_launch.py [--runs 15] [--sizes 2,8,32,256] [--no-mpirun] [--torchrun] [--here]

Everything runs with one interpreter: by default a fresh virtual environment with this checkout
installed as users install it (``pip install .``); ``--here`` uses the running interpreter and
the checkout instead (an editable install there adds its import hook to every process's start).

For each N, in shuffled order every round:

* floor: N bare concurrent ``python trivial.py`` spawns, waited for (what any launcher pays);
* ``pmsrun --join=True`` with N such workers (its scheduler, logs, supervision included);
* the same with ``MSRUN_CGROUP=off`` (containment by the environment sweep alone: what the
  job's cgroup costs - moving into a new cgroup waits for a kernel RCU grace period);
* ``mpirun -np N python trivial.py`` (Open MPI, when installed: ``apt-get install openmpi-bin``).

Overhead = the median of each round's (launcher - floor), with its 25th-75th percentile.
Targets: overhead <= 30 ms for N <= 32; msrun / floor <= 1.10 for N = 256; and, where mpirun is
installed, pmsrun's median at or below mpirun's for N <= 32 (with each round's difference).
``pmsrun`` is the installed console script, as users run it (``python -m`` adds runpy).

Failure latency: rank 0 records a timestamp and exits 3 while the others sleep; measured until
msrun has exited, which it does only after every process of the job is gone.

``--torchrun``: ``torchrun --standalone`` with the same workers; most of its time is the
launcher's own ``import torch`` and the c10d rendezvous, so a bare ``python -c "import torch"``
is measured beside it.

``--instructions``: what msrun's own process executes for a 2-worker job, counted by valgrind
(``apt-get install valgrind``) - the same on a loaded machine as on a quiet one, so start-up
work can be compared where wall times cannot. Beside it: a bare ``python`` (the floor of any
Python launcher) and the first line of pip's console-script template (``import re``), which
``pmsrun`` (``scripts/pmsrun``, a plain script) no longer pays before msrun's own first line.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bare_spawns,
    bench_env,
    installed_python,
    interleaved,
    machine,
    ms,
    pmsrun,
    quartiles,
    run_timed,
)

TRIVIAL = "import os\nos.environ.get('RANK_ID')\n"
FAILING = (
    "import os, sys, time\n"
    "if os.environ.get('RANK_ID', os.environ.get('RANK')) == '0':\n"
    "    time.sleep(0.3)\n"
    "    open(os.environ['STAMP'], 'w').write(repr(time.time()))\n"
    "    sys.exit(3)\n"
    "time.sleep(60)\n"
)
OVERHEAD_TARGET = 0.030
RATIO_TARGET = 1.10


def msrun_cmd(python: str, n: int, log_dir: Path, script: Path) -> list[str]:
    return [
        *pmsrun(python),
        f"--worker_num={n}",
        f"--local_worker_num={n}",
        "--master_port=0",
        "--join=True",
        f"--log_dir={log_dir}",
        str(script),
    ]


def mpirun_cmd(python: str, n: int, script: Path) -> list[str]:
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n), python, str(script)]


def failure_latency(cmd: list[str], env: dict[str, str], stamp: Path) -> float:
    if stamp.exists():
        stamp.unlink()
    rc = subprocess.run(cmd, env={**env, "STAMP": str(stamp)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = time.time()
    if rc.returncode == 0:
        raise SystemExit("the failing job succeeded?")
    return done - float(stamp.read_text())


def instructions(cmd: list[str], env: dict[str, str], scratch: Path) -> int:
    """Instructions executed by ``cmd``'s own process (not its children or forks), by callgrind."""
    out = scratch / "callgrind"
    out.mkdir(exist_ok=True)
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p", *cmd],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = re.search(r"^==(\d+)==", proc.stderr, re.M)
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"valgrind {cmd[:3]}... exited {proc.returncode}: {proc.stderr[-500:]}")
    got = re.search(rf"^=={first.group(1)}== Collected : (\d+)", proc.stderr, re.M)
    shutil.rmtree(out)
    if got is None:
        raise SystemExit("valgrind printed no count")
    return int(got.group(1))


def instruction_counts(python: str, env: dict[str, str], scratch: Path, trivial: Path) -> None:
    if shutil.which("valgrind") is None:
        print("\ninstructions: valgrind is not installed (apt-get install valgrind) - left out")
        return
    first_line = "import re; re.sub(r'(-script\\.pyw|\\.exe)?$', '', 'pmsrun')"
    job = msrun_cmd(python, 2, scratch / "ir-logs", trivial)
    for _ in range(2):  # bytecode caches written
        subprocess.run(job, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    rows = {
        "python (bare interpreter, the floor)": instructions([python, str(trivial)], env, scratch),
        "python + a console-script template's import re": instructions([python, "-c", first_line], env, scratch),
        "pmsrun --join=True, 2 workers (msrun's own process)": instructions(job, env, scratch),
    }
    print("\ninstructions executed (valgrind callgrind; independent of load):")
    floor = rows["python (bare interpreter, the floor)"]
    for what, count in rows.items():
        extra = f"  (+{(count - floor) / 1e6:.1f} M over a bare python)" if count > floor else ""
        print(f"  {what:<52} {count / 1e6:8.1f} M{extra}")


def diffs(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--sizes", default="2,8,32,256")
    ap.add_argument("--no-mpirun", action="store_true")
    ap.add_argument("--torchrun", action="store_true")
    ap.add_argument("--failure-workers", type=int, default=8)
    ap.add_argument("--here", action="store_true", help="this interpreter and checkout, not a fresh install")
    ap.add_argument("--instructions", action="store_true", help="count msrun's instructions with valgrind")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    mpirun = None if args.no_mpirun else shutil.which("mpirun")
    print(machine())
    print(f"rounds: {args.runs} per size, shuffled order; medians [25th-75th percentile]")
    if mpirun is None and not args.no_mpirun:
        print("mpirun: not installed (apt-get install openmpi-bin) - its rows are left out")
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if args.here:
            python, env = sys.executable, bench_env(scratch)
            print(f"interpreter: {python} with this checkout on PYTHONPATH")
        else:
            python, env = installed_python(scratch), bench_env(scratch, checkout=False)
            print(f"interpreter: {python} (a fresh venv, this checkout installed with pip install .)")
        trivial, failing = scratch / "trivial.py", scratch / "failing.py"
        trivial.write_text(TRIVIAL)
        failing.write_text(FAILING)
        for n in sizes:
            logs = scratch / f"logs{n}"
            contenders = {
                "floor": lambda i, n=n: bare_spawns([python, str(trivial)], n, env),
                "msrun": lambda i, n=n, logs=logs: run_timed(msrun_cmd(python, n, logs / str(i), trivial), env),
                "msrun-nocg": lambda i, n=n, logs=logs: run_timed(
                    msrun_cmd(python, n, logs / f"n{i}", trivial), {**env, "MSRUN_CGROUP": "off"}
                ),
            }
            if mpirun:
                contenders["mpirun"] = lambda i, n=n: run_timed(mpirun_cmd(python, n, trivial), env)
            interleaved(2, contenders)  # warm: bytecode caches, page cache
            t = interleaved(args.runs, contenders)
            floor = t["floor"]
            print(f"\nN = {n}")
            print(f"  {'floor: ' + str(n) + ' bare python spawns':<32} {ms(floor)}")
            for name in ("msrun", "msrun-nocg", "mpirun"):
                if name not in t:
                    continue
                over = diffs(t[name], floor)
                ratio = statistics.median(t[name]) / statistics.median(floor)
                what = {
                    "msrun": f"pmsrun --join=True, {n} workers",
                    "msrun-nocg": "  the same, MSRUN_CGROUP=off",
                    "mpirun": f"mpirun -np {n}",
                }[name]
                line = f"  {what:<32} {ms(t[name])}  overhead {ms(over)}  ratio {ratio:.2f}x"
                if name == "msrun":
                    if n <= 32:
                        ok = quartiles(over)[1] <= OVERHEAD_TARGET
                        line += f"  target overhead <= {OVERHEAD_TARGET * 1000:.0f} ms: {'PASS' if ok else 'FAIL'}"
                        failed += [] if ok else [f"overhead N={n}"]
                    elif n >= 256:
                        ok = ratio <= RATIO_TARGET
                        line += f"  target ratio <= {RATIO_TARGET:.2f}x: {'PASS' if ok else 'FAIL'}"
                        failed += [] if ok else [f"ratio N={n}"]
                print(line)
            if mpirun and n <= 32:  # like with like: two launchers of the same N workers, same rounds
                ours, theirs = statistics.median(t["msrun"]), statistics.median(t["mpirun"])
                paired = sorted(a - b for a, b in zip(t["msrun"], t["mpirun"]))
                ok = ours <= theirs
                print(
                    f"  pmsrun - mpirun, per round: {ms(paired)}  target pmsrun <= mpirun: {'PASS' if ok else 'FAIL'}"
                )
                failed += [] if ok else [f"slower than mpirun N={n}"]
        if args.instructions:
            instruction_counts(python, env, scratch, trivial)
        k = args.failure_workers
        fail = [
            failure_latency(msrun_cmd(python, k, scratch / f"f{i}", failing), env, scratch / "stamp")
            for i in range(args.runs)
        ]
        print(f"\nfailure -> every process gone and msrun exited ({k} workers): {ms(fail)}")
        torchrun = shutil.which("torchrun") or shutil.which("torchrun", path=str(Path(sys.executable).parent))
        if args.torchrun and not torchrun:
            print("\ntorchrun: not installed here - its rows are left out")
        if args.torchrun and torchrun:
            k, here = 8, bench_env(scratch)  # torch lives in the running interpreter's environment
            t = interleaved(
                max(3, args.runs // 3),
                {
                    "import torch": lambda i: run_timed([sys.executable, "-c", "import torch"], here),
                    "torchrun": lambda i: run_timed(
                        [torchrun, "--standalone", f"--nproc-per-node={k}", str(trivial)], here
                    ),
                    "floor": lambda i: bare_spawns([sys.executable, str(trivial)], k, here),
                },
            )
            print(f"\ntorchrun --standalone, {k} workers: {ms(t['torchrun'])}")
            print(f"  of which the launcher's python -c 'import torch': {ms(t['import torch'])}")
            print(f"  floor ({k} bare spawns): {ms(t['floor'])}")
    print(f"\nresult: {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
