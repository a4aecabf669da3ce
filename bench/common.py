"""What the benches share: the machine line, a bytecode cache outside the checkout, statistics.

Every bench measures its baseline in the same invocation, interleaved with the measured
command in a shuffled order each round, and reports medians with their spread (25th-75th
percentile), so load on the machine hits both alike and shows.
"""

from __future__ import annotations

import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a test module's head for torch benches: a gloo process group per module (env:// from the job)
GLOO_GROUP = """
import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()
"""


def bench_env(scratch: Path, checkout: bool = True, **extra: str) -> dict[str, str]:
    """The environment every measured command runs with: bytecode cached under ``scratch``
    (never in the source tree), as an installed package has it; ``checkout``: this checkout
    first on ``PYTHONPATH`` (else the interpreter's own install is used)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    env.pop("PYTHONPATH", None)
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def installed_python(scratch: Path) -> str:
    """A fresh virtual environment (from the base interpreter, no site packages) with this
    checkout installed as users install it - ``pip install .``, not editable - built from a copy,
    so nothing is written into the source tree. Returns its ``python``."""
    venv = scratch / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    src = scratch / "src"
    shutil.copytree(REPO / "pytest_msrun", src / "pytest_msrun", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "scripts", src / "scripts")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", site, str(src)],
        check=True,
        env={**os.environ, "PIP_NO_WARN_SCRIPT_LOCATION": "1"},
    )
    # ``--target`` puts no scripts in the venv: install ``pmsrun`` as pip does (its ``#!`` line rewritten)
    script = venv / "bin" / "pmsrun"
    body = (REPO / "scripts" / "pmsrun").read_text().split("\n", 1)[1]
    script.write_text(f"#!{python}\n{body}")
    script.chmod(0o755)
    return str(python)


def pmsrun(python: str) -> list[str]:
    """The command users type: the installed ``pmsrun`` script beside ``python`` when there is one
    (a fresh install), else ``python -m pytest_msrun`` (``--here``)."""
    script = Path(python).parent / "pmsrun"
    return [str(script)] if script.exists() else [python, "-m", "pytest_msrun"]


def job_port() -> int:
    """A free port for a job's scheduler that every node is given: from below the kernel's
    ephemeral range, so no client socket on the machine can take it between this check and the
    scheduler's bind (a port from ``bind(0)`` can be, and then no node hosts the scheduler)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise SystemExit("no free port between 20000 and 32000")


def interpreter(scratch: Path, here: bool) -> tuple[str, dict[str, str]]:
    """The Python to bench with and its environment: this interpreter and checkout (``--here``), or
    a fresh venv with this checkout installed as a user would (``pip install .``)."""
    if here:
        return sys.executable, bench_env(scratch)
    return installed_python(scratch), bench_env(scratch, checkout=False)


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cpus = len(os.sched_getaffinity(0))
    return (
        f"machine: {cpus} CPUs ({model or platform.machine()}), Linux {platform.release()}, "
        f"Python {sys.version.split()[0]}, load average {load}"
    )


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def ms(values: list[float]) -> str:
    """``median [p25-p75] ms``."""
    lo, mid, hi = quartiles(values)
    return f"{mid * 1000:8.1f} ms [{lo * 1000:.1f}-{hi * 1000:.1f}]"


def seconds(values: list[float]) -> str:
    lo, mid, hi = quartiles(values)
    return f"{mid:7.2f} s [{lo:.2f}-{hi:.2f}]"


def interleaved(runs: int, contenders: dict[str, Callable[[int], float]], seed: int = 1) -> dict[str, list[float]]:
    """Each round runs every contender once, in a shuffled order; returns each one's times."""
    rng = random.Random(seed)
    out: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for i in range(runs):
        rng.shuffle(names)
        for name in names:
            out[name].append(contenders[name](i))
    return out


def run_timed(cmd: list[str], env: dict[str, str], cwd: Path | None = None, ok: tuple[int, ...] = (0,)) -> float:
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    took = time.perf_counter() - t0
    if rc not in ok:
        raise SystemExit(f"{cmd[:6]}... exited {rc}")
    return took


def bare_spawns(cmd: list[str], n: int, env: dict[str, str], cwd: Path | None = None) -> float:
    """``n`` concurrent copies of ``cmd``, started and waited for: the floor of any launcher."""
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)
    ]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0
