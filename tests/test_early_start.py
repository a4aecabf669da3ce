"""Workers started before the control plane, and held while msrun still enters the job's cgroup
(``engine/earlystart.py``): which commands can be held, that a held worker runs none of its own
code outside the cgroup, and that one whose msrun dies while it is held ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import wait_for, wait_gone
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.engine.earlystart import holdable, runs_hook_first

PYTHON = os.path.realpath(sys.executable)
ELF_PYTHON = Path(PYTHON).read_bytes()[:4] == b"\x7fELF" and os.path.basename(PYTHON).startswith("python3")
needs_elf_python = pytest.mark.skipif(not ELF_PYTHON, reason=f"{PYTHON} is not a CPython ELF binary named python3*")

# -------------------------------------------------------------- which interpreter options hold

# Interpreter options, alone or as clusters, then what runs. Options that exit or go interactive
# (-h, -V, -i) are not generated: the oracle runs them.
FLAGS = ["-S", "-I", "-E", "-s", "-u", "-B", "-b", "-O", "-q", "-P", "-d"]
WITH_VALUE = [["-X", "importtime"], ["-Xdev"], ["-W", "ignore"], ["-Wignore"]]


@st.composite
def option_lists(draw: st.DrawFn) -> list[str]:
    out: list[str] = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flag", "cluster", "value"]))
        if kind == "flag":
            out.append(draw(st.sampled_from(FLAGS)))
        elif kind == "cluster":
            letters = draw(st.lists(st.sampled_from([f[1] for f in FLAGS]), min_size=2, max_size=3))
            out.append("-" + "".join(letters))
        else:
            out.extend(draw(st.sampled_from(WITH_VALUE)))
    return out


def hook_ran_first(options: list[str], tmp: Path) -> bool:
    """The oracle: does this interpreter, given ``options``, import a ``sitecustomize`` from
    ``PYTHONPATH`` before the program runs? (The program prints PROGRAM, the hook HOOK.)"""
    hook = tmp / "hookdir"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text("print('HOOK', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(hook)
    out = subprocess.run(
        [PYTHON, *options, "-c", "print('PROGRAM')"], env=env, capture_output=True, text=True, timeout=60
    ).stdout.split()
    return out[:2] == ["HOOK", "PROGRAM"]


@settings(max_examples=40, deadline=None)
@given(options=option_lists())
def test_options_said_to_hold_do_run_the_hook_first(options: list[str], tmp_path_factory) -> None:
    """Soundness against the interpreter itself: whenever msrun would hold a worker, the
    interpreter runs the hook before the program (else the worker would run unheld, outside the
    cgroup); and for the options that do not touch start-up, it holds."""
    said = runs_hook_first([*options, "-c", "print('PROGRAM')"])
    real = hook_ran_first(options, tmp_path_factory.mktemp("oracle"))
    if said:
        assert real, options
    plain = [opt for opt in options if opt.startswith("-") and not opt.startswith(("-X", "-W"))]
    if not any(ch in "SIE" for opt in plain for ch in opt):
        assert said, options


@pytest.mark.parametrize(
    ("options", "held"),
    [
        (["train.py", "-S"], True),  # the script's own arguments
        (["-m", "pytest", "-S"], True),
        (["-mpytest"], True),
        (["-c", "pass", "-I"], True),
        (["-X", "importtime", "-c", "pass"], True),
        (["-XS", "x.py"], True),  # -X's value, attached
        (["-W", "S", "x.py"], True),  # -W's value
        (["-", "x"], True),
        (["--check-hash-based-pycs", "never", "x.py"], True),
        (["-uS", "x.py"], False),
        (["-E", "x.py"], False),
        (["-I", "-c", "pass"], False),
        (["--help"], False),
        (["-V"], False),
        (["-i", "x.py"], True),
        (["-Z", "x.py"], False),  # unknown: not held
    ],
)
def test_interpreter_options(options: list[str], held: bool) -> None:
    assert runs_hook_first(options) is held


@needs_elf_python
def test_commands_that_can_be_held(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    assert holdable([PYTHON, "train.py"], env)
    assert not holdable([PYTHON, "-S", "train.py"], env)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(PYTHON)
    path_env = {"PATH": f"{bindir}{os.pathsep}{env['PATH']}"}
    assert holdable(["python3", "-m", "pytest"], path_env)

    def script(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o755)
        return str(path)

    assert holdable([script("direct", f"#!{PYTHON}\nprint(1)\n")], env)
    assert holdable([script("via_env", "#!/usr/bin/env python3\nprint(1)\n")], path_env)
    assert not holdable([script("no_site", f"#!{PYTHON} -S\nprint(1)\n")], env)
    assert not holdable([script("shell", '#!/bin/sh\nexec python3 "$@"\n')], path_env)
    # a wrapper named like Python (a pyenv shim) could start other processes first
    wrapper = bindir / "python3.99"
    wrapper.write_text(f'#!/bin/sh\nexec {PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    assert not holdable([str(wrapper), "x.py"], env)
    assert not holdable(["no-such-program"], env)
    assert not holdable([], env)


# ------------------------------------------------------------------------ jobs with held workers

# msrun whose move into the job's cgroup waits until the test opens a FIFO (as the kernel's grace
# period would, on a loaded machine), or a given number of seconds.
DRIVER = """
import os, sys, time
from pytest_msrun.engine import containment

create = containment.create
def slow_create(*args, **kw):
    gate = os.environ["CREATE_GATE"]
    if os.path.exists(gate):
        open(gate).close()  # a FIFO: blocks until the test opens it for writing
    else:
        time.sleep(float(gate))
    return create(*args, **kw)

containment.create = slow_create
from pytest_msrun.entry import main
sys.exit(main(sys.argv[1:]))
"""

# What a worker sees once its own code runs.
WORKER = """
import json, os
rank = os.environ["RANK_ID"]
facts = {
    "cgroup": open("/proc/self/cgroup").read(),
    "hold": os.environ.get("MSRUN_HOLD_FD"),
    "job": os.environ["MSRUN_JOB_ID"],
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
}
with open(os.path.join(os.environ["DUMP_DIR"], f"worker_{rank}.json"), "w") as fh:
    json.dump(facts, fh)
"""

READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(os.uname().machine)


def _reading_a_pipe(pid: int) -> bool:
    """Whether ``pid`` sleeps reading a pipe: its wait channel (``pipe_read``, ``anon_pipe_read``,
    ``pipe_wait``), or - where the kernel hides it - the system call it is in."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        if wchan not in ("", "0"):
            return "pipe" in wchan
        return Path(f"/proc/{pid}/syscall").read_text().split()[:1] == [str(READ_SYSCALL)]
    except OSError:
        return False


ARGS = ["--worker_num=2", "--local_worker_num=2", "--master_port=0", "--join=True", "--log_dir=logs"]


def _order(stderr: str, first: str, then: str) -> bool:
    marks = [line.strip().split(None, 1)[-1] for line in stderr.splitlines() if line.startswith("   ")]
    return first in marks and then in marks and marks.index(first) < marks.index(then)


def _run(msrun, options: list[str], gate: str) -> subprocess.CompletedProcess:
    msrun.script("worker.py", WORKER)
    driver = msrun.script("driver.py", DRIVER)
    return subprocess.run(
        [sys.executable, str(driver), *ARGS, sys.executable, *options, "worker.py"],
        cwd=msrun.cwd,
        env=msrun.env({"CREATE_GATE": gate, "MSRUN_TIMELINE": "1"}),
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_elf_python
@pytest.mark.cgroup("v2")
def test_held_workers_start_during_the_wait_and_run_inside_the_cgroup(msrun) -> None:
    proc = _run(msrun, [], "0.5")
    assert proc.returncode == 0, proc.stderr
    assert _order(proc.stderr, "started rank 0", "in the job's cgroup"), proc.stderr
    # msrun's lines keep its order: the scheduler first
    lines = [line.split(",")[0] for line in proc.stdout.splitlines() if line.startswith("Start ")]
    assert lines == [
        "Start scheduler process",
        "Start worker process with rank id:0",
        "Start worker process with rank id:1",
    ], proc.stdout
    for rank in (0, 1):
        facts = json.loads((msrun.dump / f"worker_{rank}.json").read_text())
        assert f"msrun-{facts['job']}" in facts["cgroup"], facts["cgroup"]
        assert facts["hold"] is None  # the hook took its variable ...
        assert facts["fds"] == [0, 1, 2, 3]  # ... and closed the pipe (3: listdir's own)
    status = json.loads((msrun.cwd / "logs" / "msrun_status.json").read_text())
    assert [p["name"] for p in status["processes"]] == ["scheduler", "worker_0", "worker_1"]


@needs_elf_python
@pytest.mark.cgroup("v2")
def test_a_worker_that_cannot_be_held_starts_only_inside(msrun) -> None:
    proc = _run(msrun, ["-S"], "0.5")  # no site: no hook to hold it
    assert proc.returncode == 0, proc.stderr
    assert _order(proc.stderr, "in the job's cgroup", "started rank 0"), proc.stderr
    assert _order(proc.stderr, "started scheduler", "started rank 0"), proc.stderr
    for rank in (0, 1):
        facts = json.loads((msrun.dump / f"worker_{rank}.json").read_text())
        assert f"msrun-{facts['job']}" in facts["cgroup"], facts["cgroup"]


@needs_elf_python
@pytest.mark.cgroup("v2")
def test_kill_9_while_workers_are_held_leaves_nothing(msrun) -> None:
    """msrun SIGKILLed while its workers wait to be moved into the job's cgroup: the pipe they
    wait on closes, so they end without running any code of their own."""
    gate = msrun.cwd / "gate.fifo"
    os.mkfifo(gate)
    msrun.script("worker.py", WORKER)
    driver = msrun.script("driver.py", DRIVER)
    popen = subprocess.Popen(
        [sys.executable, str(driver), *ARGS, sys.executable, "worker.py"],
        cwd=msrun.cwd,
        env=msrun.env({"CREATE_GATE": str(gate)}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    msrun.popens.append(popen)
    me = psutil.Process(popen.pid)

    def held_workers() -> list[psutil.Process]:
        """Both workers, once each sleeps in the hook's read of msrun's pipe."""
        found = []
        for child in me.children():
            try:
                if "worker.py" in child.cmdline() and _reading_a_pipe(child.pid):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found if len(found) == 2 else []

    workers = wait_for(held_workers, timeout=60)
    popen.kill()
    assert popen.wait(timeout=60) == -signal.SIGKILL
    wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), timeout=30)
    assert not list(msrun.dump.glob("worker_*.json")), "a held worker ran its own code"
    assert not wait_gone(msrun.mark, timeout=10)
