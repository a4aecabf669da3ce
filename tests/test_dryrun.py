"""Dry runs: msrun's simulation environment, exactly, and at scale (every rank, in bounded waves)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import REPO, read_status, wait_for, wait_gone

from pytest_msrun.engine.dryrun import reason_lines

POLLUTED = {
    "MS_ROLE": "MS_SCHED",
    "MS_SCHED_HOST": "10.9.9.9",
    "MS_SCHED_PORT": "1234",
    "MS_TOPO_TIMEOUT": "5",
    "MS_NODE_ID": "99",
    "RANK_ID": "7",
    "DEVICE_ID": "6",
    "MSRUN_CPU_LIST": "[0]",
    "MASTER_ADDR": "10.9.9.9",
}


def test_dry_run_env_matches_spec_with_a_polluted_caller(msrun, env_dump):
    job = msrun.run(
        [
            "--worker_num=4",
            "--local_worker_num=4",
            "--sim_level=2",
            "--join=True",
            "--log_dir=logs",
            "--master_port=0",
            "env_dump.py",
        ],
        env=POLLUTED,
    )
    assert job.returncode == 0, job.stderr
    assert "Start scheduler" not in job.stdout and not (job.log_dir / "scheduler.log").exists()
    dumps = msrun.dumps()
    assert sorted(d["RANK_ID"] for d in dumps) == ["0", "1", "2", "3"]
    for d in dumps:
        assert d["MS_SIMULATION_LEVEL"] == "2" and d["RANK_SIZE"] == "4" and d["MS_WORKER_NUM"] == "4"
        assert d["DEVICE_ID"] == d["RANK_ID"]
        for gone in ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_TOPO_TIMEOUT", "MSRUN_CPU_LIST"):
            assert gone not in d, gone
        assert d["MASTER_ADDR"] == "127.0.0.1" and d["RANK"] == d["RANK_ID"]  # torchrun's, never the caller's
    assert "RANK_ID=7 in the environment is ignored" in job.stderr


def test_sim_rank_id_runs_exactly_one_rank(msrun, env_dump):
    job = msrun.run(
        [
            "--worker_num=4096",
            "--local_worker_num=4096",
            "--sim_level=1",
            "--sim_rank_id=4095",
            "--join=True",
            "--log_dir=logs",
            "env_dump.py",
        ],
        env=POLLUTED,
    )
    assert job.returncode == 0, job.stderr
    (d,) = msrun.dumps()
    assert (d["RANK_ID"], d["RANK_SIZE"], d["DEVICE_ID"]) == ("4095", "4096", "0")
    assert "MS_ROLE" not in d and "MS_NODE_ID" not in d  # msrun exports RANK_ID only for --sim_rank_id
    assert sorted(p.name for p in job.log_dir.glob("worker_*.log")) == ["worker_0.log"]


RANK_TIMES = """
import json, os, sys, time
rank = int(os.environ["RANK_ID"])
start = time.time()
if os.environ.get("STARTED_DIR"):  # tells the test that this rank runs
    open(os.path.join(os.environ["STARTED_DIR"], str(rank)), "w").close()
time.sleep(float(os.environ.get("HOLD", "0.05")))
out = os.path.join(os.environ["DUMP_DIR"], f"t_{rank}.json")
with open(out + ".part", "w") as fh:
    json.dump([rank, start, time.time(), os.environ["RANK_SIZE"]], fh)
os.replace(out + ".part", out)  # whole or absent
if rank in [int(r) for r in os.environ.get("FAIL", "").split(",") if r]:
    raise AssertionError(f"strategy broken on rank {rank}")
"""


def _max_overlap(intervals):
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    cur = best = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def test_every_rank_runs_in_bounded_waves(msrun):
    msrun.script("ranks.py", RANK_TIMES)
    job = msrun.run(
        [
            "--worker_num=200",
            "--local_worker_num=200",
            "--sim_level=0",
            "--sim_concurrency=3",
            "--join=True",
            "--log_dir=logs",
            "ranks.py",
        ],
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-2000:]
    recs = [json.loads(p.read_text()) for p in msrun.dump.glob("t_*.json")]
    assert sorted(r[0] for r in recs) == list(range(200)), "msrun ran every simulated rank (not 1 for > 128)"
    assert {r[3] for r in recs} == {"200"}
    assert _max_overlap([(r[1], r[2]) for r in recs]) <= 3
    assert len(list(job.log_dir.glob("worker_*.log"))) == 200
    assert "msrun: dry run: 200/200 simulated ranks finished, 0 failed" in job.stdout
    assert "msrun: dry run: all 200 simulated rank(s) passed" in job.stdout
    status = read_status(job.log_dir)
    assert status["state"] == "succeeded" and status["dry_run"]["finished"] == 200
    assert status["processes"] == [], "nothing is kept of the ranks that finished"


def test_failing_ranks_are_all_reported_and_fail_the_run(msrun):
    msrun.script("ranks.py", RANK_TIMES)
    job = msrun.run(
        ["--worker_num=64", "--local_worker_num=64", "--sim_level=0", "--join=True", "--log_dir=logs", "ranks.py"],
        env={"FAIL": "5,40", "HOLD": "0"},
        timeout=300,
    )
    assert job.returncode == 1, job.stderr
    assert len(list(msrun.dump.glob("t_*.json"))) == 64, "one failure does not stop the other simulated ranks"
    assert "62 of 64 simulated rank(s) passed; 2 failed: 5,40" in job.stdout
    assert "rank 5 (worker_5.log) exited with code 1: AssertionError: strategy broken on rank 5" in job.stdout
    assert "rank 40 (worker_40.log) exited with code 1: AssertionError: strategy broken on rank 40" in job.stdout
    assert read_status(job.log_dir)["dry_run"]["failed_ranks"] == "5,40"


def test_mindspore_refusing_dry_runs_is_said_once():
    refused = "exited with code 1: RuntimeError: Dryrun is not supported on CPU device for a distributed job."
    reasons = [f"rank {r} (worker_{r}.log) {refused}" for r in (0, 1, 63)]
    other = "rank 5 (worker_5.log) exited with code 1: AssertionError: strategy broken on rank 5"
    assert reason_lines([*reasons[:2], other, reasons[2]]) == [
        'msrun: MindSpore refuses dry runs on this machine ("Dryrun is not supported on CPU device for a '
        'distributed job."): its dry run needs an Ascend build and device; 3 simulated rank(s) failed for that alone',
        f"  {other}",
    ]
    assert reason_lines([other]) == [f"  {other}"] and reason_lines([]) == []


def test_selected_ranks_only(msrun):
    msrun.script("ranks.py", RANK_TIMES)
    job = msrun.run(
        [
            "--worker_num=1024",
            "--local_worker_num=1024",
            "--sim_level=1",
            "--sim_select=first:2,511-512,last:1,sample:3:42",
            "--join=True",
            "--log_dir=logs",
            "ranks.py",
        ],
        env={"HOLD": "0"},
    )
    assert job.returncode == 0, job.stderr
    ran = sorted(json.loads(p.read_text())[0] for p in msrun.dump.glob("t_*.json"))
    assert {0, 1, 511, 512, 1023} <= set(ran) and len(ran) in (6, 7, 8)
    import random

    assert set(ran) == {0, 1, 511, 512, 1023} | set(random.Random(42).sample(range(1024), 3))


def test_selection_errors_are_usage_errors(msrun, env_dump):
    for select, text in [("2000", "outside this node's ranks"), ("last:x", "positive integer"), ("9-3", "backwards")]:
        job = msrun.run(
            ["--worker_num=1024", "--local_worker_num=1024", "--sim_level=0", f"--sim_select={select}", "env_dump.py"]
        )
        assert job.returncode == 2 and "--sim_select" in job.stderr and text in job.stderr, job.stderr
    job = msrun.run(["--worker_num=4", "--local_worker_num=4", "--sim_select=0", "env_dump.py"])
    assert job.returncode == 2 and "needs --sim_level" in job.stderr


def test_ctrl_c_stops_a_dry_run(msrun):
    msrun.script("ranks.py", RANK_TIMES)
    started = msrun.cwd / "started"
    started.mkdir()
    popen = msrun.start(
        ["--worker_num=64", "--local_worker_num=64", "--sim_level=0", "--join=True", "--log_dir=logs", "ranks.py"],
        env={"HOLD": "30", "STARTED_DIR": str(started)},
        start_new_session=True,
    )
    wait_for(lambda: (st := read_status(msrun.cwd / "logs")) and st["state"] == "running" and st["processes"])
    wait_for(lambda: any(started.iterdir()), timeout=60)  # a simulated rank is running its task
    os.killpg(popen.pid, signal.SIGINT)
    job = msrun.finish(popen, timeout=30)
    assert job.returncode == 130, job.stderr
    assert read_status(job.log_dir)["state"] == "terminated"
    assert not wait_gone(msrun.mark)


def test_plugin_dry_run_names_exactly_the_bad_ranks(pytester, monkeypatch):
    sample = REPO / "sample_code" / "dryrun"
    for name in ("strategy.py", "test_strategy.py", "conftest.py"):
        pytester.path.joinpath(name).write_text((sample / name).read_text())
    good = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    good.assert_outcomes(passed=1)
    monkeypatch.setenv("STRATEGY", "broken")
    bad = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    bad.assert_outcomes(failed=1)
    text = bad.stdout.str()
    assert "[rank 2047] failed first; also failed on ranks 4095" in text
    assert "rows 501760..501761 between rank 2047 and rank 2048 belong to nobody" in text
    assert "rank 4095: AssertionError: rank 4095 holds 624 rows" in text
    import re

    failing = set(re.findall(r"\[rank (\d+)\] failed first", text)) | set(re.findall(r"^rank (\d+): ", text, re.M))
    assert failing == {"2047", "4095"}


@pytest.mark.parametrize("level", ["0", "3"])
def test_dry_run_activated_by_the_environment(msrun, env_dump, level):
    job = msrun.run(
        ["--worker_num=2", "--local_worker_num=2", "--join=True", "--log_dir=logs", "env_dump.py"],
        env={"MS_SIMULATION_LEVEL": level, "RANK_SIZE": "512"},
    )
    assert job.returncode == 0, job.stderr
    dumps = msrun.dumps()
    assert {d["MS_SIMULATION_LEVEL"] for d in dumps} == {level}
    assert {d["RANK_SIZE"] for d in dumps} == {"512"}, "an env-activated dry run keeps the caller's RANK_SIZE"
