"""A full disk for logs or traces never kills the control plane; the job goes on, or ends naming
the disk, the path and the fix - and no half-written file is left. The plugin's sessions likewise:
a full basetemp is the test's error, a full report directory one clear error, a full trace
directory said once - never an internal error, never silence.

Each job runs in a private mount namespace (``unshare -m``, part of the ``netns`` tier: root and
util-linux) on a 64 KiB tmpfs mounted there, which vanishes with the job: nothing to unmount.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from conftest import job_args

pytestmark = pytest.mark.netns

BIG = """
from pytest_msrun import cluster
cluster.init()
for i in range(1500):  # 1.5 MB a rank, into a 64 KiB file system
    print("x" * 1000)
cluster.barrier()
print("done", flush=True)
"""

QUIET = """
from pytest_msrun import cluster
cluster.init()
for i in range(40):  # the control plane serves every one of these while its log cannot be written
    cluster.barrier()
"""


def run_on_small_disk(msrun, args: list[str], fill: int = 0, timeout: float = 120):
    """msrun ``args`` with ``small/`` a fresh 64 KiB tmpfs (``fill`` bytes taken already); returns
    the job and what ``small/`` held at its end (``find``'s listing, from inside the namespace)."""
    small = msrun.cwd / "small"
    small.mkdir()
    listing = msrun.cwd / "listing"
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {small} && "
        + (f"head -c {fill} /dev/zero > {small}/fill && " if fill else "")
        + f"{shlex.join(msrun.argv(args))}; rc=$?; (cd {small} && find . | sort) > {listing}; exit $rc"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=msrun.cwd,
        env=msrun.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, listing.read_text().split()


def test_ranks_filling_the_log_disk_end_the_job_naming_the_disk(msrun):
    msrun.script("big.py", BIG)
    proc, left = run_on_small_disk(msrun, [*job_args(2, "big.py")[:3], "--log_dir=small/logs", "--join=True", "big.py"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = proc.stderr[proc.stderr.index("msrun: the job failed") :]
    root = summary.splitlines()[1]
    assert root.lstrip().startswith("rank "), summary[:2000]  # a rank, not the control plane
    assert "disk full: the log directory" in summary and "(tmpfs)" in summary
    assert "give --log_dir on another file system" in summary
    assert not [name for name in left if name.endswith(".tmp") or ".tmp" in name], left


def test_the_control_plane_serves_on_when_its_log_cannot_be_written(msrun):
    msrun.script("quiet.py", QUIET)
    proc, _ = run_on_small_disk(
        msrun, [*job_args(2, "quiet.py")[:3], "--log_dir=small/logs", "--join=True", "quiet.py"], fill=65536
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot write the control plane's log" in proc.stderr and "is full" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_disk_that_fills_with_the_trace_leaves_the_job_and_no_partial_file(msrun):
    msrun.script("quiet.py", QUIET)
    args = [*job_args(2, "quiet.py")[:3], "--log_dir=logs", "--join=True", "--trace", "small/job.trace.json"]
    proc, left = run_on_small_disk(msrun, [*args, "quiet.py"], fill=60000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "msrun: could not write the trace" in proc.stderr and "give --trace on another file system" in proc.stderr
    assert left == [".", "./fill"], left  # no partial trace, no spool
    for rank in (0, 1):  # the rank hook failed to record its start, and said nothing: it went on
        text = (msrun.cwd / "logs" / f"worker_{rank}.log").read_text()
        assert "Error in sitecustomize" not in text and "RecursionError" not in text, text


MARKED = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_one(rank):
    print("rank", rank, "ran", flush=True)

@pytest.mark.msrun(worker_num=2)
def test_two(rank):
    print("rank", rank, "ran", flush=True)
"""


def session_on_small_disk(pytester, args: list[str], timeout: float = 300):
    """``pytest args`` on ``test_marked.py`` with ``small/`` a fresh 64 KiB tmpfs, full; returns
    the session's output and what ``small/`` held at its end."""
    pytester.makepyfile(test_marked=MARKED)
    small = pytester.path / "small"
    small.mkdir()
    listing = pytester.path / "listing"
    pytest_argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", *args]
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {small} && (head -c 65536 /dev/zero > {small}/fill 2>/dev/null; true) && "
        f"{shlex.join(pytest_argv)}; rc=$?; (cd {small} && find . | sort) > {listing}; exit $rc"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, listing.read_text().split()


def test_a_full_basetemp_is_the_tests_error_not_an_internal_error(pytester, tracked):
    proc, _ = session_on_small_disk(pytester, ["--basetemp=small/bt", "-rf"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    assert "2 errors" in out, out[-3000:]  # at setup: no job started
    line = next(line for line in out.splitlines() if "msrun: cannot make the test's files" in line)
    assert "No space left on device" in line and "(tmpfs) is full" in line and "bytes free" in line, line
    assert "give --basetemp on another file system" in line, line


def test_a_full_report_directory_is_one_clear_error_and_leaves_no_half_copy(pytester, tracked):
    proc, left = session_on_small_disk(pytester, ["--basetemp=bt", "--msrun-report=small/report.html"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    assert "2 passed" in out, out[-3000:]
    errors = [line for line in out.splitlines() if "could not write the HTML report" in line]
    assert len(errors) == 1 and "is full" in errors[0] and "give --msrun-report on another file system" in errors[0]
    assert not [name for name in left if name.endswith((".tmp", ".log", ".html"))], left


def test_a_full_trace_directory_is_said_once(pytester, tracked):
    proc, left = session_on_small_disk(pytester, ["--basetemp=bt", "--msrun-trace=small/traces"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    said = [line for line in out.splitlines() if "trace was not written" in line]
    assert len(said) == 1, out[-3000:]
    assert "small/traces" in said[0] and "is full" in said[0] and "give --msrun-trace on another file system" in said[0]
    assert not [name for name in left if ".tmp" in name or "spool" in name], left


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
