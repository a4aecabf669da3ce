"""Per-rank error files: the root cause from the rank's own record, its log only as a fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import job_args

from pytest_msrun.engine import errorfile
from pytest_msrun.engine.errorfile import error_file_for, read_error

RAISER = """
import json, os, sys, time
rank = int(os.environ["RANK_ID"])
dump = os.path.join(os.environ["DUMP_DIR"], f"rank{rank}.json")
with open(dump + ".part", "w") as fh:
    json.dump({"PYTHONPATH": os.environ.get("PYTHONPATH"), "ERROR_FILE": os.environ.get("MSRUN_ERROR_FILE"),
               "hook_on_path": [p for p in sys.path if "rankhook" in p],
               "user_site": getattr(sys.modules.get("sitecustomize"), "USER_MARK", None)}, fh)
os.replace(dump + ".part", dump)  # whole or absent
mode = os.environ.get("MODE", "")
if rank == 1:
    # fail only once rank 0 has said what it saw: the failure ends the job, rank 0 with it
    first = os.path.join(os.environ["DUMP_DIR"], "rank0.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(first) and time.monotonic() < deadline:
        time.sleep(0.01)
    if mode == "custom":
        import errs
        raise errs.Broken("custom failure\\nsecond line")
    if mode == "exit":
        print("dying without a record", flush=True)
        os._exit(3)
    if mode == "fork":
        pid = os.fork()
        if pid == 0:
            raise KeyError("in a forked child")  # not the rank: no record
        os.waitpid(pid, 0)
        sys.exit(4)
    raise ValueError("boom on rank 1")
"""


@pytest.fixture
def raiser(msrun):
    msrun.script("errs.py", "class Broken(Exception):\n    pass\n")
    return msrun.script("raiser.py", RAISER)


def _dumps(msrun) -> dict[int, dict]:
    dumps = {int(p.stem[4:]): json.loads(p.read_text()) for p in msrun.dump.glob("rank*.json")}
    assert sorted(dumps) == [0, 1], "each rank wrote what it saw before rank 1 failed"
    return dumps


def test_the_root_cause_comes_from_the_error_file(msrun, raiser):
    job = msrun.run(job_args(2, "raiser.py"))
    assert job.returncode == 1, job.stderr
    summary = job.stderr[job.stderr.index("Root cause") :]
    assert "error: ValueError: boom on rank 1" in summary
    assert "traceback (from its error file):" in summary and 'raise ValueError("boom on rank 1")' in summary
    assert "lines of its log" not in summary, "a rank that raised is not explained by scraping its log"
    failure = job.status()["failures"][0]
    assert failure["label"] == "rank 1" and failure["error"]["type"] == "ValueError"
    assert failure["error"]["pid"] == failure["pid"]
    assert (job.log_dir / "worker_1.error.json").exists() and not (job.log_dir / "worker_0.error.json").exists()


def test_the_hook_leaves_no_trace_in_the_rank(msrun, raiser):
    """PYTHONPATH and sys.path are what msrun's caller had; the caller's sitecustomize still runs."""
    user = msrun.cwd / "usersite"
    user.mkdir()
    (user / "sitecustomize.py").write_text("USER_MARK = 'ran'\n")
    job = msrun.run(job_args(2, "raiser.py"), env={"PYTHONPATH": f"{user}{os.pathsep}{msrun.cwd}"})
    assert job.returncode == 1, job.stderr
    dumps = _dumps(msrun)
    for rank in (0, 1):
        assert dumps[rank]["PYTHONPATH"] == f"{user}{os.pathsep}{msrun.cwd}"
        assert dumps[rank]["hook_on_path"] == []
        assert dumps[rank]["user_site"] == "ran"
        assert dumps[rank]["ERROR_FILE"] == str(job.log_dir / f"worker_{rank}.error.json")
    assert "error: ValueError: boom on rank 1" in job.stderr


def test_no_pythonpath_stays_none(msrun, raiser):
    """Without PYTHONPATH in msrun's environment the rank has none either (the package is installed)."""
    env = msrun.env()
    env.pop("PYTHONPATH")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_msrun", *job_args(2, "raiser.py")],
        cwd=msrun.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert all(d["PYTHONPATH"] is None for d in _dumps(msrun).values())


def test_custom_exception_type_is_qualified(msrun, raiser):
    job = msrun.run(job_args(2, "raiser.py"), env={"MODE": "custom"})
    assert job.returncode == 1
    assert "error: errs.Broken: custom failure" in job.stderr
    assert "second line" in job.stderr  # the whole message is in the traceback


@pytest.mark.parametrize("mode,code", [("exit", 3), ("fork", 4)])
def test_no_record_falls_back_to_the_log(msrun, raiser, mode, code):
    stale = msrun.cwd / "logs"
    stale.mkdir()
    (stale / "worker_1.error.json").write_text(
        json.dumps({"type": "OldError", "message": "a previous run", "traceback": "", "time": 0, "pid": 1})
    )
    job = msrun.run(job_args(2, "raiser.py"), env={"MODE": mode})
    assert job.returncode == code, job.stderr
    assert "OldError" not in job.stderr, "a previous run's record is never blamed"
    assert "error:" not in job.stderr[job.stderr.index("Root cause") :]
    assert job.status()["failures"][0]["error"] is None
    if mode == "exit":
        assert "dying without a record" in job.stderr  # from its log


def test_error_files_can_be_turned_off(msrun, raiser):
    job = msrun.run(job_args(2, "raiser.py"), env={"MSRUN_ERROR_FILES": "0"})
    assert job.returncode == 1
    assert not list(job.log_dir.glob("*.error.json"))
    assert all(d["ERROR_FILE"] is None for d in _dumps(msrun).values())
    assert "  traceback:" in job.stderr and "ValueError: boom on rank 1" in job.stderr  # scraped from the log


def test_task_scheduler_records_too(msrun, raiser):
    """--scheduler=task runs the task as the scheduler; its exceptions are recorded as well."""
    script = msrun.script("sched_raise.py", "import os\nif os.environ['MS_ROLE'] == 'MS_SCHED':\n    1 / 0\n")
    assert script.exists()
    job = msrun.run(job_args(1, "--scheduler=task", "sched_raise.py"))
    assert job.returncode == 1, job.stderr
    assert "scheduler (scheduler.log" in job.stderr and "error: ZeroDivisionError: division by zero" in job.stderr


def test_a_dry_run_reports_each_failed_rank_from_its_record(msrun, raiser):
    script = msrun.script("sim.py", "import os\nif os.environ['RANK_ID'] in ('2', '5'):\n    raise OSError('no')\n")
    assert script.exists()
    job = msrun.run(job_args(8, "--sim_level=0", "sim.py"))
    assert job.returncode == 1, job.stderr
    assert "rank 2 (worker_2.log) exited with code 1: OSError: no" in job.stdout + job.stderr


def test_read_error_rejects_what_is_not_a_record(tmp_path):
    path = tmp_path / "e.json"
    assert read_error(str(path)) is None
    for junk in (b"", b"not json", b"[]", b'{"type": 1, "message": "m", "traceback": ""}', b"\xff\xfe"):
        path.write_bytes(junk)
        assert read_error(str(path)) is None
    path.write_bytes(b'{"type": "E", "message": "m", "traceback": "' + b"x" * errorfile.MAX_RECORD_BYTES + b'"}')
    assert read_error(str(path)) is None, "an oversized file is not read"
    path.write_text(json.dumps({"type": "E", "message": "", "traceback": "tb", "time": "later", "pid": "1"}))
    rec = read_error(str(path))
    assert rec is not None and rec.headline == "E" and rec.time == 0.0 and rec.pid == 0


def test_error_file_names():
    assert error_file_for("logs/worker_3.log") == "logs/worker_3.error.json"
    assert error_file_for("scheduler.log") == "scheduler.error.json"
    assert error_file_for("odd_name") == "odd_name.error.json"
    assert errorfile.hook_env("", {}, "x") == {}
    assert errorfile.hook_env("/pkg", {"MSRUN_ERROR_FILES": "off"}, "x") == {}
