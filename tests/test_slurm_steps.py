"""The suite across an allocation: inside ``salloc``/``sbatch`` each marked test's job or world is a
Slurm step of its own, placed by Slurm on nodes with room for it (the lab's two namespaced nodes,
tests/lab/slurmlab.py).

Each allocation holds two CPUs per node (``--ntasks-per-node=2``), whatever the machine's CPUs, so
a 2-rank world needs a whole node. Where tests ran and when comes from the session's own reports:
a conftest in the scratch directory writes, on the controller, each report's phase, hosts
(``msrun_hosts``) and time span.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, wait_for, wait_gone

pytestmark = pytest.mark.slurm

PER_NODE = ["--ntasks-per-node=2"]  # two CPUs of each node: a 2-rank world needs a whole one

SPANS = """
import json, os

import pytest


def pytest_runtest_logreport(report):
    # on the controller only (not in a rank, nor in an xdist worker: the xdist controller gets them all)
    if "RANK_ID" in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
        return
    hosts = dict(report.user_properties).get("msrun_hosts", {})
    line = {"test": report.nodeid.split("::")[-1], "when": report.when, "outcome": report.outcome, "hosts": hosts,
            "start": report.start, "stop": report.stop}
    with open(os.environ["SPANS_FILE"], "a") as fh:
        fh.write(json.dumps(line) + "\\n")
"""

SPREAD = """
import json, os, socket, time
from pathlib import Path

import pytest

MET = Path(os.environ["MEET_DIR"])


def meet(name):
    # each world waits (with a deadline) until the other one runs too
    (MET / name).write_text(socket.gethostname())
    deadline = time.monotonic() + 60
    while len(list(MET.iterdir())) < 2:
        assert time.monotonic() < deadline, "the other world never ran at the same time"
        time.sleep(0.05)


@pytest.mark.msrun(worker_num=2)
def test_a(rank):
    if rank == 0:
        meet("a")


@pytest.mark.msrun(worker_num=2)
def test_b(rank):
    if rank == 0:
        meet("b")


@pytest.mark.msrun(worker_num=4, local_worker_num=2)
def test_across(rank, msrun):
    assert sorted(set(msrun.all_gather(socket.gethostname()))) == ["node1", "node2"]
"""


PYTEST = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:randomly"]


def _scratch(msrun, slurm_lab, tests: str) -> dict[str, str]:
    """Write ``tests`` (as test_steps.py) and the spans conftest in the scratch directory; the
    environment a session runs with in the lab."""
    (msrun.cwd / "test_steps.py").write_text(textwrap.dedent(tests))
    (msrun.cwd / "conftest.py").write_text(textwrap.dedent(SPANS))
    (msrun.cwd / "met").mkdir(exist_ok=True)
    env = slurm_lab.env(msrun.env({"SPANS_FILE": str(msrun.cwd / "spans.jsonl"), "MEET_DIR": str(msrun.cwd / "met")}))
    env["PYTHONPATH"] = str(REPO)
    return env


def _session(
    msrun, slurm_lab, tests: str, salloc: list[str], pytest_args: list[str], before: str = "", timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """``salloc SALLOC sh -c 'BEFORE; python -m pytest PYTEST_ARGS test_steps.py'`` in the lab: the
    session's exit status and output, and each test's call report (hosts and time span; ``lifetime``:
    its phases' together)."""
    env = _scratch(msrun, slurm_lab, tests)
    script = f"{before}\n{' '.join(PYTEST)} {' '.join(pytest_args)} test_steps.py"
    proc = subprocess.run(
        ["salloc", *salloc, "sh", "-c", script], cwd=msrun.cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    spans = msrun.cwd / "spans.jsonl"
    lines = spans.read_text().splitlines() if spans.exists() else []
    reports = [json.loads(line) for line in lines]
    calls = [r for r in reports if r["when"] == "call"]
    for call in calls:
        mine = [r for r in reports if r["test"] == call["test"]]
        call["lifetime"] = {"start": min(r["start"] for r in mine), "stop": max(r["stop"] for r in mine)}
    return proc, calls


def _parked(msrun, slurm_lab, tests: str, name: str, pytest_args: list[str]) -> subprocess.Popen[str]:
    """``salloc -N2 --job-name=NAME python -m pytest PYTEST_ARGS test_steps.py`` in the lab, in the
    background, once four ranks of its tests wrote their file in ``met/`` (they park there)."""
    env = _scratch(msrun, slurm_lab, tests)
    argv = ["salloc", "-N2", *PER_NODE, f"--job-name={name}", *PYTEST, *pytest_args, "test_steps.py"]
    popen = subprocess.Popen(argv, cwd=msrun.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    msrun.popens.append(popen)
    met = msrun.cwd / "met"
    assert wait_for(lambda: len(list(met.iterdir())) == 4, timeout=120), list(met.iterdir())
    return popen


def _by_test(spans: list[dict]) -> dict[str, dict]:
    return {s["test"]: s for s in spans}


def _overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["stop"] and b["start"] < a["stop"]


def test_two_whole_node_worlds_run_at_once_on_different_nodes_and_a_multi_node_test_beside(msrun, slurm_lab):
    """``-n 2`` in ``salloc -N2``: xdist hands test_a and test_b to different workers; each world's
    step takes a whole node, Slurm puts them on different nodes, and they run at the same time (each
    waits until the other runs). The 2-node test waits for both nodes and runs across them."""
    proc, spans = _session(msrun, slurm_lab, SPREAD, ["-N2", *PER_NODE], ["-n", "2"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "3 passed" in out, out
    runs = _by_test(spans)
    a, b, across = runs["test_a"], runs["test_b"], runs["test_across"]
    assert {tuple(set(a["hosts"].values())), tuple(set(b["hosts"].values()))} == {("node1",), ("node2",)}, spans
    # a merged phase starts when its last rank left the phase before (the phases add up to the job's
    # time), so the test's lifetime - every moment any of its ranks spent on it - is what overlaps
    assert _overlap(a["lifetime"], b["lifetime"]), spans
    assert across["hosts"] == {"0": "node1", "1": "node1", "2": "node2", "3": "node2"}, spans
    assert re.search(r"msrun hosts -+\s+rank 0: node[12]\s+rank 1: node[12]", out), out
    assert not wait_gone(msrun.mark, timeout=10)


WHOLE_NODE = """
import time

import pytest


@pytest.mark.msrun(worker_num=2, timeout=120)
@pytest.mark.parametrize("i", [0, 1])
def test_whole_node(rank, i):
    time.sleep(0.5)
"""


def test_a_world_that_does_not_fit_waits_for_room_then_runs(msrun, slurm_lab):
    """One node, two workers: the second whole-node world's step waits until the first ended."""
    proc, spans = _session(msrun, slurm_lab, WHOLE_NODE, ["-N1", *PER_NODE], ["-n", "2"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "2 passed" in out, out
    first, second = sorted(spans, key=lambda s: s["start"])
    assert not _overlap(first, second), spans
    assert set(first["hosts"].values()) == set(second["hosts"].values()) == {"node1"}, spans
    assert not wait_gone(msrun.mark, timeout=10)


NO_ROOM = """
import pytest


@pytest.mark.msrun(worker_num=2, timeout=4)
def test_world(rank):
    pass


@pytest.mark.msrun(worker_num=2, timeout=4, scheduler="task")
def test_fresh_job(rank):
    pass
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_a_step_with_no_room_within_the_timeout_fails_clearly(msrun, slurm_lab, worlds):
    """Another step holds the only node's CPUs all along: each test (in a world, and a fresh job)
    fails at its setup after its own timeout, saying so - once, not after a second wait."""
    ready = msrun.cwd / "held"
    hold = f"srun -n1 -c2 --exact sh -c 'touch {ready}; sleep 120' & while [ ! -e {ready} ]; do sleep 0.05; done"
    proc, _ = _session(
        msrun, slurm_lab, NO_ROOM, ["-N1", *PER_NODE], [f"--msrun-worlds={worlds}"], before=hold, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert "2 errors" in out, out
    for test in ("test_world", "test_fresh_job"):
        assert re.search(rf"ERROR test_steps.py::{test} - msrun(: no room| could not start)", out), out
    assert out.count("no room in Slurm allocation") >= 2, out
    assert "its step needs 1 node(s) with 2 free CPU(s) each" in out, out
    took = re.search(r"2 errors in ([\d.]+)s", out)
    assert took and float(took.group(1)) < 4 * 2 + 6, out  # each test waited its own 4 s, once
    assert not wait_gone(msrun.mark, timeout=10)


NODE_LOST = """
import os, signal, time

import pytest


@pytest.mark.msrun(worker_num=4, local_worker_num=2, timeout=60)
def test_node2_is_lost(rank, msrun):
    msrun.barrier()
    if rank == 2:
        os.kill(os.getppid(), signal.SIGKILL)  # node2's msrun, the step's task there: gone at once
    time.sleep(30)


@pytest.mark.msrun(worker_num=2)
def test_later(rank):
    pass
"""


def test_a_node_lost_mid_test_fails_that_test_naming_the_node(msrun, slurm_lab):
    proc, spans = _session(msrun, slurm_lab, NODE_LOST, ["-N2", *PER_NODE], [])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert re.search(r"rank 2 left no record during the call phase .*msrun on node2 recorded none", out), out
    assert "lost node node2" in out, out
    assert _by_test(spans)["test_later"]["outcome"] == "passed"
    assert not wait_gone(msrun.mark, timeout=10)


PARKED = """
import os, time

import pytest


@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", [0, 1])
def test_parked(rank, i):
    open(os.path.join(os.environ["MEET_DIR"], f"{i}-{rank}"), "w").close()
    time.sleep(120)
"""


def test_scancel_of_the_allocation_leaves_nothing_on_any_node(msrun, slurm_lab):
    """Two workers' worlds parked on both nodes; ``scancel`` of the allocation: the session ends
    (not with success) and no process of it is left anywhere."""
    popen = _parked(msrun, slurm_lab, PARKED, "msrun-scancel", ["-n", "2"])
    job = subprocess.run(
        ["squeue", "-h", "-o", "%i", "-n", "msrun-scancel"], env=slurm_lab.env(), capture_output=True, text=True
    ).stdout.strip()
    assert job.isdigit(), job
    subprocess.run(["scancel", job], env=slurm_lab.env(), check=True, timeout=30)
    out, _ = popen.communicate(timeout=60)
    assert popen.returncode != 0, out
    assert not wait_gone(msrun.mark, timeout=20), out  # the lab's nodes share this machine's processes


def test_more_gpus_than_the_allocation_has_per_node_is_a_skip_and_starts_nothing(pytester, monkeypatch, slurm_lab):
    """Where Slurm hands steps their GPUs, a test asking more per node than the allocation holds
    skips, saying so, as on a host without them; no step is started for it."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.msrun(worker_num=2, devices=4)
        def test_four(rank):
            pass
        """
    )
    for name, value in {"SLURM_JOB_ID": "999999", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_GPUS_ON_NODE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    result = pytester.runpytest_subprocess("-rs", "-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs 4 GPUs on each of 1 node(s); Slurm allocation 999999 has 2 per node*"])


def test_a_breakpoint_in_a_rank_on_a_node_reaches_the_controllers_terminal(msrun, slurm_lab):
    """The rank runs in a step on a lab node; its pdb session is on the terminal of the session
    that runs in ``salloc`` on this host (the debug server listens where srun's host is reached)."""
    from test_debugger import BREAKS, Terminal

    (msrun.cwd / "test_breaks.py").write_text(BREAKS.format(extra="", ranks="(1,)", body="breakpoint()"))
    env = slurm_lab.env(msrun.env())
    env["PYTHONPATH"] = str(REPO)
    salloc = ("setsid", "--ctty", "salloc", "-N1", *PER_NODE)  # salloc wants its terminal as its own
    term = Terminal(msrun.cwd, "-p", "no:randomly", "-p", "no:cacheprovider", "test_breaks.py", before=salloc, env=env)
    try:
        term.expect(r"breakpoint\(\) in rank 1 at test_breaks.py:\d+")
        term.expect(r"\(Pdb rank 1\) ")
        term.send("import socket; print(socket.gethostname(), local_value)")
        term.expect(r"\r\nnode1 17\r\n")
        term.send("c")
        code = term.finish()
    finally:
        term.close()
    assert code == 0 and "1 passed" in term.text(), term.text()
    assert not wait_gone(msrun.mark, timeout=10)


STEP_CANCELLED = """
import os, time

import pytest


@pytest.mark.msrun(worker_num=4, local_worker_num=2, timeout=120)
def test_its_step_is_cancelled(rank):
    open(os.path.join(os.environ["MEET_DIR"], str(rank)), "w").close()
    time.sleep(120)


@pytest.mark.msrun(worker_num=2)
def test_later(rank):
    pass
"""


def test_a_step_cancelled_mid_test_fails_that_test_and_the_next_runs(msrun, slurm_lab):
    """``scancel JOB.STEP`` of the step a 2-node test runs in (an operator, a node's health check):
    that test fails at once, saying what ended it; the next test gets a step of its own."""
    popen = _parked(msrun, slurm_lab, STEP_CANCELLED, "msrun-stepcancel", [])
    steps = subprocess.run(
        ["squeue", "-h", "-s", "-o", "%i %j", "-n", "msrun-stepcancel"],
        env=slurm_lab.env(),
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    step = next(line.split()[0] for line in steps if line.endswith(" msrun-test"))
    subprocess.run(["scancel", step], env=slurm_lab.env(), check=True, timeout=30)
    out, _ = popen.communicate(timeout=120)
    assert popen.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "FAILED test_steps.py::test_its_step_is_cancelled" in out, out
    assert not wait_gone(msrun.mark, timeout=20), out


GPUS = """
import os

import pytest


@pytest.mark.msrun(worker_num=2, devices=2)
def test_two(rank):
    assert sorted(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]


@pytest.mark.msrun(worker_num=2, devices=1)
def test_one(rank, msrun):
    seen = msrun.all_gather(os.environ["CUDA_VISIBLE_DEVICES"])
    assert len(set(seen)) == 1 and seen[0] in ("0", "1"), seen


@pytest.mark.msrun(worker_num=2, devices=3)
def test_three(rank):
    pass
"""


def test_gpus_come_from_slurm_where_the_allocation_has_them(msrun, slurm_lab):
    """The lab's nodes declare two GPUs each (gres.conf): a step asks its test's devices per node
    and Slurm makes them visible; more than a node holds is a skip, as on a host without them."""
    proc, spans = _session(msrun, slurm_lab, GPUS, ["-N1", *PER_NODE, "--gpus-per-node=2"], ["-rs"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "2 passed, 1 skipped" in out, out
    assert "needs 3 GPUs on each of 1 node(s)" in out and "has 2 per node" in out, out
    assert {s["test"] for s in spans if s["outcome"] == "passed"} == {"test_one", "test_two"}


FAILS_ON_RANK_1 = """
import pytest


@pytest.mark.msrun(worker_num=2)
def test_fails_on_rank_1(rank):
    assert rank != 1, "rank 1 fails"
"""


def test_the_reproduce_line_reruns_that_test_as_a_step(msrun, slurm_lab):
    """The failure's reproduce lines, typed in an allocation of the same shape: the same test, in a
    step of as many nodes, failing the same way."""
    proc, _ = _session(msrun, slurm_lab, FAILS_ON_RANK_1, ["-N1", *PER_NODE], [])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    section = re.search(r"-+ reproduce -+\n(.*?)\n(?:-+ |=+ )", out, re.S)
    assert section, out
    lines = section.group(1).strip()
    assert re.search(r"srun --nodes=1 .*--exact .* pmsrun .*test_steps.py::test_fails_on_rank_1$", lines), lines
    env = slurm_lab.env(msrun.env())
    env["PYTHONPATH"] = str(REPO)
    again = subprocess.run(
        ["salloc", "-N1", *PER_NODE, "sh", "-c", lines], env=env, capture_output=True, text=True, timeout=120
    )
    redo = again.stdout + again.stderr
    assert again.returncode == 1, redo
    assert "rank 1 fails" in redo, redo
    assert not wait_gone(msrun.mark, timeout=10)
