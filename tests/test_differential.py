"""The same scripts under MindSpore 2.10's own msrun and under this one.

Compared: the environment of every role, log file names, console lines (pids, paths, times
normalised), exit codes, and the processes of dry runs. Every difference found must be a row of
the table in docs/launcher.md, "Differences from MindSpore's msrun"; anything else fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ENV_DUMP, MARK, REPO, free_port, wait_gone

from pytest_msrun.engine.childenv import TORCH_STYLE_VARS

pytestmark = pytest.mark.mindspore

BIN = Path(sysconfig.get_path("scripts"))
TORCH_STYLE = set(TORCH_STYLE_VARS)
OURS = {"PYTHONUNBUFFERED", "MSRUN_JOB_ID", "MSRUN_LAUNCHER_ID", "MSRUN_SCHEDULER", "MSRUN_LOG_DIR"}
OURS |= {"MSRUN_PLUGIN_ROLE", "MSRUN_JOB_TOKEN"}
OURS |= {"MSRUN_SIM_RECORD", "MSRUN_SIM_BUDGET", "MSRUN_SIM_THREADS"}  # a simulated rank's (record, budget, threads)
MINDSPORE_IMPORT = {
    "OMP_NUM_THREADS",
    "LD_LIBRARY_PATH",
    "HCCL_CONNECT_TIMEOUT",
    "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION",
}


def documented() -> set[str]:
    text = (REPO / "docs" / "launcher.md").read_text()
    section = text.split("## Differences from MindSpore's msrun", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", section, re.M))


class Differences:
    """Every difference found, by the documented row (docs/launcher.md) that should explain it."""

    def __init__(self) -> None:
        self.found: dict[str, list[str]] = {}

    def note(self, key: str, detail: str) -> None:
        self.found.setdefault(key, []).append(detail)

    def assert_documented(self) -> None:
        rows = documented()
        missing = {k: v[:3] for k, v in self.found.items() if k not in rows}
        assert not missing, f"differences from MindSpore's msrun that docs/launcher.md's table does not list: {missing}"


class Launchers:
    """Runs the real msrun (``msrun`` of this environment) and ours on the same task."""

    def __init__(self, tmp_path: Path, mark: str) -> None:
        self.tmp = tmp_path
        self.mark = mark
        self.parent = self.env()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "MSRUN_", "RANK", "PYTEST_"))}
        env.update({"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", MARK: self.mark})
        env.update(extra or {})
        return env

    def run(self, who: str, args: list[str], task: list[str], extra: dict[str, str] | None = None, timeout=120):
        cwd = self.tmp / who
        cwd.mkdir(exist_ok=True)
        (cwd / "dump").mkdir(exist_ok=True)
        env = self.env({"DUMP_DIR": str(cwd / "dump"), **(extra or {})})
        if who == "real":
            argv = [str(BIN / "msrun"), *args, *task]
        else:
            argv = [sys.executable, "-m", "pytest_msrun", *args, *task]
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        return proc, cwd

    def dumps(self, cwd: Path) -> dict[str, dict[str, str]]:
        """role:rank -> the environment that launcher gave that process (its own changes only)."""
        out = {}
        for path in sorted((cwd / "dump").glob("*.json")):
            env = json.loads(path.read_text())
            key = f"{env.get('MS_ROLE', 'none')}:{env.get('RANK_ID', '-')}"
            parent = self.env({"DUMP_DIR": str(cwd / "dump")})
            out.setdefault(key, {})
            out[key] = {k: v for k, v in env.items() if not k.startswith("_") and parent.get(k) != v}
        return out


@pytest.fixture
def both(tmp_path, request):
    mark = f"differential-{request.node.name}"
    yield Launchers(tmp_path, mark)
    left = wait_gone(mark)
    assert not left, [p.cmdline() for p in left]


def compare_env(
    diff: Differences, real: dict[str, dict[str, str]], ours: dict[str, dict[str, str]], because: str = ""
) -> None:
    """``because``: the row of docs/launcher.md that explains any other difference (documented)."""
    assert sorted(real) == sorted(ours), (sorted(real), sorted(ours))
    for role in real:
        theirs, mine = real[role], ours[role]
        for key in sorted(set(theirs) - set(mine)):
            diff.note(
                "env: MindSpore import side effects" if key in MINDSPORE_IMPORT else because or f"env: {key}", role
            )
        for key in sorted(set(mine) - set(theirs)):
            if because and key not in TORCH_STYLE | OURS:
                diff.note(because, f"{role} {key}")
            elif key in TORCH_STYLE:
                diff.note("env: torch-style variables", f"{role} {key}")
            elif key in OURS:
                diff.note("env: MSRUN_* and PYTHONUNBUFFERED", f"{role} {key}")
            else:
                diff.note(f"env: {key}", role)
        for key in sorted(set(theirs) & set(mine)):
            if theirs[key] != mine[key]:
                diff.note(f"env value: {key}", f"{role}: {theirs[key]!r} vs {mine[key]!r}")


LOGGER = re.compile(r"^\[(DEBUG|INFO|WARNING|ERROR)\] ME\(\d+:\d+,MainProcess\):\S+ \[([^\]]+)\] (.*)$")


def console(proc: subprocess.CompletedProcess, cwd: Path) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(stdout lines, logger (level, message) pairs, other stderr lines), normalised."""

    def norm(text: str) -> str:
        text = text.replace(str(cwd), "<cwd>")
        text = re.sub(r"process \d+", "process <pid>", text)
        return text

    out = [norm(line) for line in proc.stdout.splitlines()]
    logger, other = [], []
    for line in proc.stderr.splitlines():
        m = LOGGER.match(line)
        if m:
            logger.append((m.group(1), norm(m.group(3))))
        elif line.strip():
            other.append(norm(line))
    return out, logger, other


def compare_console(diff: Differences, real, ours) -> None:
    (r_out, r_log, r_other), (o_out, o_log, o_other) = real, ours
    r_start = [line for line in r_out if line.startswith("Start ")]
    o_start = [line for line in o_out if line.startswith("Start ")]
    assert len(r_start) == len(o_start)
    for a, b in zip(r_start, o_start):
        if a != b:
            a2 = re.sub(r"Execute command: python(3)? ", "Execute command: <python> ", a)
            b2 = re.sub(r"Execute command: \S*python\S* ", "Execute command: <python> ", b)
            diff.note("console: interpreter in Execute command" if a2 == b2 else "console: Start lines", f"{a} | {b}")
    r_task = [line for line in r_out if not line.startswith("Start ")]
    o_task = [re.sub(r"^\[rank \d+\] ", "", line) for line in o_out if line.startswith("[rank ")]
    o_rest = [line for line in o_out if not line.startswith(("Start ", "[rank "))]
    if sorted(r_task) != sorted(o_task):
        diff.note("console: tailed lines", f"{r_task} | {o_task}")
    elif o_task and o_task != [line for line in o_out if line.startswith("[rank ")]:
        diff.note("console: tailed lines carry [rank N]", o_task[0])
    assert not o_rest, o_rest
    if sorted(r_log) != sorted(o_log):
        only_real = [m for m in r_log if m not in o_log]
        only_ours = [m for m in o_log if m not in r_log]
        final = "Distributed job exited with exception. Please check logs in directory"
        if only_real or any(not m.startswith(final) for _, m in only_ours):
            diff.note("console: logger messages", f"{only_real} | {only_ours}")
    if r_other or o_other:  # their traceback, our root-cause summary
        diff.note("exit status of a failed job", f"{r_other[-1:]} | {o_other[:1]}")


# Ordered by events, never by delays: rank 1 fails once every process of the job (the workers
# and the scheduler) has printed its line - the consoles compare those lines - while rank 0 still
# runs, so each launcher stops it; MindSpore's msrun then waits for its scheduler (it stops only the
# workers), which ends once rank 0 is gone (ours stops the scheduler with rank 0).
FAILING = """
import os, sys, time
role, rank = os.environ.get("MS_ROLE"), os.environ.get("RANK_ID")
print("role", role, "rank", rank, flush=True)
dump = os.environ["DUMP_DIR"]
open(os.path.join(dump, f"printed-{role}-{rank}-{os.getpid()}"), "w").close()


def printed():
    return [name.split("-") for name in os.listdir(dump) if name.startswith("printed-")]


def wait_for(predicate, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


if not os.environ.get("FAIL"):
    sys.exit(0)
if role == "MS_WORKER" and rank == "1":
    wait_for(lambda: len(printed()) == int(os.environ["MS_WORKER_NUM"]) + 1)
    sys.exit(3)
if role == "MS_WORKER":
    time.sleep(60)  # the workload: still running when rank 1 fails
wait_for(lambda: any(p[1:3] == ["MS_WORKER", "0"] and gone(int(p[3])) for p in printed()))
"""


def test_environment_logs_console_and_exit_codes(both, tmp_path):
    diff = Differences()
    for who in ("real", "ours"):
        (tmp_path / who).mkdir()
        (tmp_path / who / "env_dump.py").write_text(ENV_DUMP)
        (tmp_path / who / "task.py").write_text(FAILING)
    common = ["--worker_num=2", "--local_worker_num=2", "--join=True", "--log_dir=logs"]
    runs = {}
    port = free_port()  # the same for both (one after the other), so the variables can be compared
    for who, extra in (("real", []), ("ours", ["--scheduler=task"])):
        runs[who] = both.run(who, [*common, f"--master_port={port}", *extra], ["env_dump.py"])
        assert runs[who][0].returncode == 0, runs[who][0].stderr
    compare_env(diff, both.dumps(runs["real"][1]), both.dumps(runs["ours"][1]))
    real_files = {p.name for p in (runs["real"][1] / "logs").iterdir()}
    our_files = {p.name for p in (runs["ours"][1] / "logs").iterdir()}
    assert real_files == {"scheduler.log", "worker_0.log", "worker_1.log"}
    for name in our_files - real_files:
        diff.note(f"files: {name}", name)
    assert real_files <= our_files
    compare_console(diff, console(*runs["real"]), console(*runs["ours"]))
    # a failing rank: both stop the job; the exit status differs as documented
    for who, extra in (("real", []), ("ours", ["--scheduler=task"])):
        runs[who] = both.run(who, [*common, f"--master_port={free_port()}", *extra], ["task.py"], {"FAIL": "1"})
    assert runs["real"][0].returncode == 1
    assert runs["ours"][0].returncode == 3
    diff.note("exit status of a failed job", "1 vs 3")
    compare_console(diff, console(*runs["real"]), console(*runs["ours"]))
    diff.assert_documented()


@pytest.mark.parametrize(
    "args,real_procs,our_procs",
    [
        (["--worker_num=4", "--local_worker_num=4", "--sim_level=1"], 4, 4),
        (["--worker_num=8", "--local_worker_num=8", "--sim_level=0", "--sim_rank_id=5"], 1, 1),
        (["--worker_num=4", "--local_worker_num=2", "--node_rank=1", "--sim_level=2"], 2, 2),
        (["--worker_num=130", "--local_worker_num=130", "--sim_level=1"], 1, 130),
    ],
    ids=["four", "sim_rank_id", "node_rank", "over128"],
)
def test_dry_runs(both, tmp_path, args, real_procs, our_procs):
    diff = Differences()
    runs = {}
    for who in ("real", "ours"):
        (tmp_path / who).mkdir()
        (tmp_path / who / "env_dump.py").write_text(ENV_DUMP)
        runs[who] = both.run(who, [*args, "--join=True", "--log_dir=logs"], ["env_dump.py"])
        assert runs[who][0].returncode == 0, runs[who][0].stderr
    real, ours = both.dumps(runs["real"][1]), both.dumps(runs["ours"][1])
    assert (len(real), len(ours)) == (real_procs, our_procs)
    because = ""
    if real_procs != our_procs:  # msrun turns this into a one-rank run of rank 0 (its --sim_rank_id=0)
        because = "dry run over 128 local workers"
        diff.note(because, f"{real_procs} vs {our_procs} processes")
        ours = {k: v for k, v in ours.items() if k in real}
    compare_env(diff, real, ours, because)
    diff.assert_documented()


MS_QUERIES = """
import json, os, sys
from mindspore.communication import get_group_size, get_local_rank, get_local_rank_size, get_rank
out = {"rank": get_rank(), "size": get_group_size(), "local": get_local_rank(), "local_size": get_local_rank_size()}
with open(os.path.join(os.environ["DUMP_DIR"], f"ms_{os.environ['RANK_ID']}.json"), "w") as fh:
    json.dump(out, fh)
"""


def test_mindspore_sees_the_same_dry_run(both, tmp_path):
    """What MindSpore's rank queries return before init() in a dry run is the same under both launchers,
    but get_local_rank(): LOCAL_RANK, torch's variable, is set in our dry runs (documented)."""
    got = {}
    for who in ("real", "ours"):
        (tmp_path / who).mkdir()
        (tmp_path / who / "q.py").write_text(MS_QUERIES)
        proc, cwd = both.run(
            who,
            [
                "--worker_num=4",
                "--local_worker_num=2",
                "--node_rank=1",
                "--sim_level=1",
                "--join=True",
                "--log_dir=logs",
            ],
            ["q.py"],
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr
        got[who] = {p.name: json.loads(p.read_text()) for p in (cwd / "dump").glob("ms_*.json")}
    # documented (docs/launcher.md): LOCAL_RANK, torch's, is set in a dry run too - and MindSpore reads it
    local = {name: {**q, "local": 0} for name, q in got["ours"].items()}
    assert got["real"] == local and len(got["ours"]) == 2, got
    assert {q["rank"]: q["local"] for q in got["ours"].values()} == {2: 0, 3: 1}, got


SUITE = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_marked(rank, world_size):
    assert world_size == 2 and rank in (0, 1)

def test_plain():
    pass
"""


def test_pytest_under_the_real_msrun_is_not_one_of_our_ranks(both, tmp_path):
    """MindSpore's msrun runs pytest as scheduler and as workers: nothing of ours is written."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "test_s.py").write_text(SUITE)
    proc, cwd = both.run(
        "real",
        ["--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}", "--join=True", "--log_dir=logs"],
        ["pytest", "-p", "no:cacheprovider", "-rs", "test_s.py"],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert "2 passed" in (cwd / "logs" / f"worker_{rank}.log").read_text()
    sched = (cwd / "logs" / "scheduler.log").read_text()
    assert "1 passed, 1 skipped" in sched and "scheduler (MS_ROLE=MS_SCHED) of another launcher" in sched
    assert not list(cwd.rglob("pytest_rank*")) and not list(cwd.rglob("msrun_hooks"))
