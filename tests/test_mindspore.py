"""Real MindSpore 2.10 next to this msrun: scheduler modes, jobs that use MindSpore and jobs that do not.

MindSpore jobs are slow to start (seconds of import per process), so each test here runs one job.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import psutil
import pytest
from conftest import job_args, wait_for

pytestmark = pytest.mark.mindspore

PLAIN = """
import os
print("plain task on rank", os.environ["RANK_ID"], flush=True)
"""

MS_INIT = """
import os, sys
import mindspore as ms
from mindspore.communication import get_group_size, get_rank, init
ms.set_device("CPU")
init()
print(f"mindspore rank {get_rank()}/{get_group_size()}", flush=True)
if os.environ.get("ALSO_CLUSTER"):
    from pytest_msrun import cluster
    cluster.init()
    print("cluster gather", cluster.all_gather_object(get_rank()), flush=True)
"""


@pytest.mark.parametrize("mode", ["auto", "mindspore"])
def test_task_without_mindspore_init_ends_with_its_workers(msrun, mode):
    """MindSpore is importable, the task never calls init(): the job ends when its workers do."""
    msrun.script("plain.py", PLAIN)
    t0 = time.monotonic()
    job = msrun.run(job_args(2, f"--scheduler={mode}", "--cluster_time_out=60", "plain.py"), timeout=90)
    elapsed = time.monotonic() - t0
    assert job.returncode == 0, job.stdout + job.stderr
    assert "[rank 1] plain task on rank 1" in job.stdout
    assert elapsed < 20, f"msrun waited {elapsed:.1f} s for a scheduler nobody used"


def test_auto_serves_mindspore_and_the_cluster_api_in_one_job(msrun):
    msrun.script("ms_init.py", MS_INIT)
    job = msrun.run(job_args(2, "ms_init.py"), env={"ALSO_CLUSTER": "1"}, timeout=240)
    assert job.returncode == 0, job.stdout + job.stderr + job.log("scheduler.log")[-3000:]
    for rank in (0, 1):
        assert f"mindspore rank {rank}/2" in job.log(f"worker_{rank}.log")
        assert "cluster gather [0, 1]" in job.log(f"worker_{rank}.log")
    assert "MindSpore scheduler" in job.log("scheduler.log")


def test_builtin_scheduler_names_the_fix_for_a_mindspore_client_at_once(msrun):
    msrun.script("ms_init.py", MS_INIT)
    t0 = time.monotonic()
    job = msrun.run(job_args(2, "--scheduler=builtin", "--cluster_time_out=120", "ms_init.py"), timeout=240)
    elapsed = time.monotonic() - t0
    assert job.returncode != 0
    assert "--scheduler=mindspore" in job.stderr, job.stderr
    assert "MindSpore" in job.log("scheduler.log")
    assert elapsed < 60, f"failed only after {elapsed:.0f} s"


def test_mindspore_keeps_its_msrun_and_ours_is_pmsrun():
    """Both installed in one environment: `msrun` is MindSpore's launcher, `pmsrun` is ours."""
    import subprocess
    import sysconfig
    from pathlib import Path

    bindir = Path(sysconfig.get_path("scripts"))
    theirs = (bindir / "msrun").read_text()
    assert "mindspore.parallel.cluster.run" in theirs
    ours = subprocess.run([str(bindir / "pmsrun"), "--help"], capture_output=True, text=True)
    assert ours.returncode == 0 and "--scheduler" in ours.stdout


DRY_INIT = """
import os
import mindspore as ms
from mindspore.communication import init
if os.environ["RANK_ID"] == "63":
    raise AssertionError("strategy broken on rank 63")
ms.set_context(mode=ms.GRAPH_MODE)
init()
"""


def test_a_dry_run_on_a_cpu_build_says_mindspore_refuses_it_once(msrun):
    """MindSpore's init() refuses a dry run without Ascend: msrun says so in one line, not per rank."""
    msrun.script("dry_init.py", DRY_INIT)
    args = ["--worker_num=64", "--local_worker_num=64", "--sim_level=1", "--sim_select=first:2,last:2"]
    job = msrun.run([*args, "--join=True", "--log_dir=logs", "dry_init.py"], timeout=240)
    assert job.returncode == 1, job.stdout + job.stderr
    said = (
        'msrun: MindSpore refuses dry runs on this machine ("Dryrun is not supported on CPU device for a '
        'distributed job."): its dry run needs an Ascend build and device; 3 simulated rank(s) failed for that alone'
    )
    own = [line for line in (job.stdout + job.stderr).splitlines() if not line.startswith("[rank ")]  # not a log
    assert own.count(said) == 1, job.stdout
    assert "  rank 63 (worker_63.log) exited with code 1: AssertionError: strategy broken on rank 63" in own
    assert not [line for line in own if "code 1: RuntimeError: Dryrun" in line], "no reason line per refused rank"
    assert sum("Traceback (most recent call last)" in line for line in own) == 1, "the root cause's alone"


def test_a_marked_dry_run_on_a_cpu_build_says_mindspore_refuses_it_first(pytester):
    pytester.makepyfile(
        test_dry="import pytest\n\n@pytest.mark.msrun(worker_num=64, sim_level=1, sim_ranks='first:2')\n"
        "def test_init(rank):\n    from mindspore.communication import init\n    init()\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(failed=1)
    refused = 'msrun: MindSpore refuses dry runs on this machine ("Dryrun is not supported on CPU*): its dry run needs'
    failed = "[[]rank ?[]] failed first; also failed on ranks ?"
    result.stdout.fnmatch_lines([f"{refused}*2 simulated rank(s) failed for that alone", failed], consecutive=True)


HOLD = """
import os, time
import mindspore as ms
from mindspore.communication import init
ms.set_device("CPU")
init()
open(os.path.join(os.environ["DUMP_DIR"], "inited-" + os.environ["RANK_ID"]), "w").close()
while not os.path.exists(os.environ["STOP_FILE"]):
    time.sleep(0.05)  # pacing: hold the job open while the test probes the MindSpore scheduler
"""


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on, as its own network namespace sees them."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_mindspore_scheduler_is_reachable_only_through_the_relay(msrun):
    """Another user (or anyone) connecting straight to the MindSpore scheduler's port fails: it
    listens in a private network namespace that only the relay's connections enter."""
    msrun.script("hold.py", HOLD)
    stop = msrun.cwd / "stop"
    popen = msrun.start(job_args(2, "--scheduler=mindspore", "hold.py"), env={"STOP_FILE": str(stop)})
    try:
        wait_for(lambda: len(list(msrun.dump.glob("inited-*"))) == 2, timeout=180)
        from pytest_msrun.control.msbridge import MS_SCHED_STUB

        sched = next(
            p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[1:3] == ["-c", MS_SCHED_STUB]
        )
        ports = _listening_ports(sched.pid)
        assert ports, "the MindSpore scheduler listens somewhere"
        for port in ports:
            with socket.socket() as sock:
                sock.settimeout(2)
                assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is reachable from outside"
        assert os.readlink(f"/proc/{sched.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    finally:
        stop.touch()
    job = msrun.finish(popen, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr + job.log("scheduler.log")[-3000:]
    assert "in a private network namespace" in job.log("scheduler.log")


def test_a_mindspore_ranks_own_servers_are_exposed_as_documented(msrun):
    """docs/security.md states what msrun cannot guard: each MindSpore rank's own RPC servers, in
    the host's network namespace, which any local process can reach. This checks the statement
    against the real MindSpore, so the page changes if MindSpore does."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    assert "What stays exposed: a MindSpore rank's own servers" in page
    msrun.script("hold.py", HOLD)
    stop = msrun.cwd / "stop"
    popen = msrun.start(job_args(2, "--scheduler=mindspore", "hold.py"), env={"STOP_FILE": str(stop)})
    try:
        wait_for(lambda: len(list(msrun.dump.glob("inited-*"))) == 2, timeout=180)
        status = msrun.cwd / "logs" / "msrun_status.json"
        import json

        workers = [p["pid"] for p in json.loads(status.read_text())["processes"] if p["role"] == "worker"]
        for pid in workers:
            assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
            ports = _listening_ports(pid)
            assert ports, f"rank pid {pid} listens nowhere: update docs/security.md"
            for port in ports:
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    pass  # reachable from any process of this host, as the page says
    finally:
        stop.touch()
    job = msrun.finish(popen, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
