"""Per-test cost of a 2-rank marked test, against baselines measured in the same run.

    python bench/bench_plugin.py [--tests 5] [--runs 5] [--real-msrun]

Sessions of ``--tests`` trivial tests each, in shuffled order every round:

* plain: the tests unmarked (pytest's own per-test cost);
* marked: ``@pytest.mark.msrun(worker_num=2)`` with ``--msrun-worlds=fresh``: per test a job of
  the builtin control plane and two rank pytest processes (warm worlds: ``bench_warm.py``);
* subprocess pattern, like for like: each test shells out to ``pmsrun ... python -m pytest
  file::case`` with the same control plane and two rank pytest processes, and checks the exit
  status - what people write by hand;
* subprocess pattern, ``--scheduler=task``: as MindSpore's own tests do it (the task also runs
  as the scheduler: three pytest processes per test);
* with ``--real-msrun`` (MindSpore installed): the same with MindSpore's own ``msrun``, which
  imports MindSpore in the launcher and runs the task as its scheduler;
* one rank's pytest start-up: ``python -m pytest file::case`` for one trivial test;
* isolated: ``@pytest.mark.msrun(worker_num=2, isolated=True)`` - each test in processes of its
  own, forked from its shape's world (``--msrun-worlds=fresh`` runs every test so);
* with Open MPI installed, the per-test MPI pattern like for like: each test shells out to
  ``mpirun -np 2 python -m pytest file::case`` (what pytest-isolate-mpi and mpi-pytest's forking
  mode pay for isolation).

Only this plugin is loaded (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` with ``-p``): every rank is a
fresh pytest and would pay for any other installed plugin too. Target: the marked per-test
overhead <= one rank's pytest start-up + 100 ms; with mpirun: an isolated test's per-test cost
<= 0.35 x the mpirun pattern's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_env, interleaved, machine, ms  # noqa: E402

PLUGIN = ["-p", "pytest_msrun.pytest_plugin"]
SHELL_OUT = """
import random, socket, subprocess, sys

LAUNCHER = {launcher!r}
PYTHON = {python!r}

def _port():  # below the ephemeral range: no client socket takes it before the scheduler binds
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port

def _mpirun(tmp_path):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", PYTHON, "-m", "pytest",
           "-p", "no:cacheprovider", "inner.py::test_inner"]
    assert subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0

def _job(tmp_path):
    cmd = [*LAUNCHER, "--worker_num=2", "--local_worker_num=2", f"--master_port={{_port()}}", "--join=True",
           {scheduler}f"--log_dir={{tmp_path}}", PYTHON, "-m", "pytest", "-p", "no:cacheprovider",
           "inner.py::test_inner"]
    assert subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
"""
OURS = [sys.executable, "-m", "pytest_msrun"]
REAL = [sys.executable, "-c", "import sys; from mindspore.parallel.cluster.run import main; sys.exit(main())"]


def write_files(d: Path, n: int, real: bool, mpi: bool) -> list[str]:
    (d / "inner.py").write_text("def test_inner():\n    pass\n")
    (d / "test_plain.py").write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(n)))
    (d / "test_marked.py").write_text(
        "import pytest\n\n"
        + "".join(f"@pytest.mark.msrun(worker_num=2)\ndef test_{i}(rank):\n    pass\n\n" for i in range(n))
    )
    (d / "test_isolated.py").write_text(
        "import pytest\n\n"
        + "".join(
            f"@pytest.mark.msrun(worker_num=2, isolated=True)\ndef test_{i}(rank):\n    pass\n\n" for i in range(n)
        )
    )
    if mpi:
        text = SHELL_OUT.format(launcher=OURS, scheduler="", python=sys.executable)
        tests = "".join(f"\ndef test_{i}(tmp_path):\n    _mpirun(tmp_path)\n" for i in range(n))
        (d / "test_sub_mpirun.py").write_text(textwrap.dedent(text) + tests)
    cases = {
        "test_sub_ours.py": (OURS, "", sys.executable),
        "test_sub_task.py": (OURS, '"--scheduler=task", ', sys.executable),
    }
    if real:  # MindSpore's msrun runs the words python/pytest as commands, anything else as "python <it>"
        cases["test_sub_real.py"] = (REAL, "", "python")
    tests = "".join(f"\ndef test_{i}(tmp_path):\n    _job(tmp_path)\n" for i in range(n))
    for name, (launcher, scheduler, python) in cases.items():
        text = SHELL_OUT.format(launcher=launcher, scheduler=scheduler, python=python)
        (d / name).write_text(textwrap.dedent(text) + tests)
    return list(cases)


def timed(args: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGIN, *args],
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
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--real-msrun", action="store_true", help="also MindSpore's msrun (needs MindSpore)")
    ap.add_argument("--no-mpirun", action="store_true", help="leave the mpirun pattern out")
    args = ap.parse_args()
    n = args.tests
    mpi = not args.no_mpirun and shutil.which("mpirun") is not None
    if not mpi and not args.no_mpirun:
        print("mpirun: not installed (apt-get install openmpi-bin) - its row and target are left out")
    real = False
    if args.real_msrun:
        probe = subprocess.run([sys.executable, "-c", "import mindspore.parallel.cluster.run"], capture_output=True)
        real = probe.returncode == 0
        if not real:
            print("--real-msrun: MindSpore is not installed here; its row is left out")
    print(machine())
    print(f"interpreter: {sys.executable}, this checkout; {n} tests per session, {args.runs} rounds, shuffled")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        # "python" on PATH is this interpreter (MindSpore's msrun looks it up there).
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        env = bench_env(d, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PATH=path)
        files = write_files(d, n, real, mpi)
        contenders = {
            "startup": lambda i: timed(["inner.py::test_inner"], d, env),
            "plain": lambda i: timed(["test_plain.py"], d, env),
            "marked": lambda i: timed(["test_marked.py", "--msrun-worlds=fresh"], d, env),
            "isolated": lambda i: timed(["test_isolated.py"], d, env),
        }
        if mpi:
            contenders["mpirun"] = lambda i: timed(["test_sub_mpirun.py"], d, env)
        for name in files:
            contenders[name] = lambda i, name=name: timed([name], d, env)
        interleaved(1, contenders)  # warm caches
        t = interleaved(args.runs, contenders)
    plain = t["plain"]

    def per_test(name: str) -> list[float]:
        return [(x - p) / n for x, p in zip(t[name], plain)]

    target = statistics.median(t["startup"]) + 0.1
    marked = statistics.median(per_test("marked"))
    rows = [
        ("one rank's pytest start-up (1 trivial test)", ms(t["startup"])),
        (f"session of {n} plain tests", ms(plain)),
        (f"session of {n} marked tests (worker_num=2)", ms(t["marked"])),
        ("per-test overhead, marked, --msrun-worlds=fresh (forked per test)", ms(per_test("marked"))),
        ("per-test overhead, isolated=True (forked per test)", ms(per_test("isolated"))),
        ("per-test overhead, shelling out to pmsrun (like for like)", ms(per_test("test_sub_ours.py"))),
        ("per-test overhead, shelling out to pmsrun --scheduler=task", ms(per_test("test_sub_task.py"))),
    ]
    if real:
        rows.append(("per-test overhead, shelling out to MindSpore's msrun", ms(per_test("test_sub_real.py"))))
    if mpi:
        rows.append(("per-test overhead, shelling out to mpirun -np 2 python -m pytest", ms(per_test("mpirun"))))
    for what, value in rows:
        print(f"  {what:<64} {value}")
    ok = marked <= target
    verdict = "PASS" if ok else "FAIL"
    print(f"\ntarget: marked per-test overhead <= start-up + 100 ms = {target * 1000:.0f} ms: {verdict}")
    if mpi:
        ratios = sorted(a / b for a, b in zip(per_test("isolated"), per_test("mpirun")))
        ratio = statistics.median(ratios)
        good = ratio <= 0.35
        ok = ok and good
        spread = f"[{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}]"
        print(
            f"target: isolated per-test cost <= 0.35 x the mpirun pattern's: {ratio:.2f}x {spread} per round: "
            + ("PASS" if good else "FAIL")
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
