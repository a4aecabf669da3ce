"""Nothing is written where another user can write: what another account plants in a directory the
tool writes to - a symbolic link, a hard link, a FIFO, a file of its own, a whole directory - is
refused with an error naming it, and the file it points at is left as it was.

The attacks run as this user (a second account is not needed to plant a link or a FIFO); the cases
that need a file or directory of another user are made with ``os.chown`` and skip where this is not
root.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import runpy
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import job_args
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pytest_msrun import fileio
from pytest_msrun.engine.errorfile import hook_dir
from pytest_msrun.fileio import UnsafePath, open_output, open_output_fd, private_dir, unsafe_output_dir, write_whole
from pytest_msrun.plugin.controller import pool as poolmod
from pytest_msrun.plugin.controller.pool import ResourcePool

REPO = Path(__file__).resolve().parents[1]
SECRET = "the victim's file\n"
OTHER_UID = 65534  # nobody: a user that is not this one
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root (os.chown)")


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_text(SECRET)
    return victim


def _open_to_others(path: Path, mode: int = 0o777) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


# ---------------------------------------------------------------- whole files
def test_a_link_planted_at_the_old_temporary_name_is_not_followed(tmp_path):
    """The temporary name was ``<file>.<pid>.tmp``: a link planted there had the file's text written
    through it. Now it is unpredictable, and made with O_EXCL: what is planted is never opened."""
    victim = _victim(tmp_path)
    target = tmp_path / "status.json"
    (tmp_path / f"status.json.{os.getpid()}.tmp").symlink_to(victim)
    write_whole(str(target), "{}\n")
    assert victim.read_text() == SECRET
    assert target.read_text() == "{}\n" and not target.is_symlink()


def test_a_link_at_the_name_itself_is_replaced_not_followed(tmp_path):
    victim = _victim(tmp_path)
    target = tmp_path / "page.html"
    target.symlink_to(victim)
    write_whole(str(target), "<html>", mode=0o600)
    assert victim.read_text() == SECRET
    assert target.read_text() == "<html>" and not target.is_symlink()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_a_whole_write_that_fails_leaves_nothing(tmp_path):
    class Boom(Exception):
        pass

    with pytest.raises(Boom), fileio.WholeFile(str(tmp_path / "out")) as fh:
        fh.write(b"half")
        raise Boom
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- files opened for writing
def test_a_log_name_that_is_a_link_is_refused(tmp_path):
    victim = _victim(tmp_path)
    log = tmp_path / "worker_0.log"
    log.symlink_to(victim)
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        open_output(str(log))
    assert victim.read_text() == SECRET


def test_a_log_name_that_is_a_hard_link_is_refused(tmp_path):
    victim = _victim(tmp_path)
    log = tmp_path / "worker_0.log"
    os.link(victim, log)
    with pytest.raises(UnsafePath, match="hard links"):
        open_output(str(log))
    with pytest.raises(UnsafePath, match="hard links"):
        open_output(str(log), append=True)
    assert victim.read_text() == SECRET  # not truncated before the check


def test_a_fifo_at_a_log_name_is_refused_without_blocking(tmp_path):
    """O_WRONLY on a FIFO no one reads blocks forever; the check runs in a child so that a block
    fails the test at its timeout instead of hanging the session."""
    fifo = tmp_path / "worker_0.log"
    os.mkfifo(fifo)
    code = "import sys\nfrom pytest_msrun.fileio import open_output_fd\nopen_output_fd(sys.argv[1])\n"
    proc = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"{fifo} is a FIFO, not a regular file" in proc.stderr, proc.stderr


@as_root
def test_a_log_of_another_user_is_refused(tmp_path):
    log = tmp_path / "worker_0.log"
    log.write_text(SECRET)
    os.chown(log, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match=f"belongs to another user \\(uid {OTHER_UID}\\)"):
        open_output_fd(str(log))
    assert log.read_text() == SECRET


def test_an_own_file_is_truncated_or_appended_to(tmp_path):
    log = tmp_path / "log"
    log.write_text("old\n")
    with open_output(str(log), append=True) as fh:
        fh.write("more\n")
    assert log.read_text() == "old\nmore\n"
    with open_output(str(log), binary=True) as fh:
        fh.write(b"new\n")
    assert log.read_text() == "new\n"


def test_the_rank_hook_writes_through_no_planted_link(tmp_path, monkeypatch):
    """The rank hook (standard library only) has its own copy of both rules: its error record and
    the trace spool's line."""
    hook = runpy.run_path(os.path.join(hook_dir(str(REPO)), "sitecustomize.py"), run_name="msrun_rankhook")
    victim = _victim(tmp_path)
    record = tmp_path / "worker_0.error.json"
    (tmp_path / f"worker_0.error.json.{os.getpid()}.tmp").symlink_to(victim)
    try:
        raise ValueError("rank 0 failed")
    except ValueError as exc:
        hook["_write"](str(record), os.getpid(), ValueError, exc, exc.__traceback__)
    assert json.loads(record.read_text())["type"] == "ValueError"
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "ranks.jsonl").symlink_to(victim)
    monkeypatch.setenv("MSRUN_TRACE_SPOOL", str(spool))
    monkeypatch.setenv("RANK_ID", "0")
    with pytest.raises(OSError):
        hook["_trace_start"]()
    assert victim.read_text() == SECRET


# ---------------------------------------------------------------- directories
def test_a_private_directory_is_made_new_or_refused(tmp_path):
    made = tmp_path / "a" / "b"
    private_dir(str(made))
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and stat.S_IMODE(made.parent.stat().st_mode) == 0o700
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="is a symbolic link, not a directory"):
        private_dir(str(tmp_path / "link"))
    with pytest.raises(UnsafePath, match="is writable by others \\(mode 777\\)"):
        private_dir(str(_open_to_others(tmp_path / "open")))


def test_the_rule_for_directories_the_user_chose(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    assert unsafe_output_dir(str(mine)) == ""
    assert unsafe_output_dir(str(mine / "not" / "made")) == ""  # made by this user
    shared = _open_to_others(tmp_path / "shared")
    problem = unsafe_output_dir(str(shared / "logs"))
    assert problem.startswith(f"its directory {shared} is writable by others (mode 777)"), problem
    assert f"chmod go-w {shared}" in problem
    sticky = _open_to_others(tmp_path / "sticky", 0o1777)
    assert unsafe_output_dir(str(sticky / "logs")) == ""
    (tmp_path / "via").symlink_to(shared)  # as the link resolves, too
    assert "is writable by others" in unsafe_output_dir(str(tmp_path / "via" / "logs"))


@as_root
def test_a_directory_of_another_user_above_the_output_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    assert f"its directory {theirs} belongs to another user (uid {OTHER_UID})" in unsafe_output_dir(str(theirs / "x"))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    os.lchown(link, OTHER_UID, OTHER_UID)
    assert f"goes through {link}, a symbolic link of another user's" in unsafe_output_dir(str(link / "logs"))


# ---------------------------------------------------------------- the port and device pool
def _pool_in(directory: Path) -> ResourcePool:
    return ResourcePool(str(directory), port_range=(41000, 41399))


def test_the_pool_writes_through_no_link_planted_at_its_temporary_name(tmp_path):
    victim = _victim(tmp_path)
    directory = tmp_path / "msrun-pool"
    pool = _pool_in(directory)
    (directory / f"pool.json.{os.getpid()}.tmp").symlink_to(victim)
    lease = pool.lease(ports=2, devices=0, inv=poolmod.DeviceInventory(), wait=5)
    pool.release(lease)
    assert victim.read_text() == SECRET


def test_a_pool_directory_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "msrun-pool").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="is a symbolic link, not a directory"):
        _pool_in(tmp_path / "msrun-pool")
    assert list(elsewhere.iterdir()) == []


def test_a_pool_directory_others_can_write_is_refused(tmp_path):
    with pytest.raises(UnsafePath, match="is writable by others"):
        _pool_in(_open_to_others(tmp_path / "msrun-pool"))


@as_root
def test_a_pool_directory_of_another_user_is_refused(tmp_path):
    directory = tmp_path / "msrun-pool"
    directory.mkdir(mode=0o700)
    os.chown(directory, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match=f"belongs to another user \\(uid {OTHER_UID}\\)"):
        _pool_in(directory)


def _temproot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "temproot"
    root.mkdir()
    monkeypatch.setenv("PYTEST_DEBUG_TEMPROOT", str(root))
    return root / f"pytest-of-{getpass.getuser()}"


def test_pytests_own_root_is_checked_as_pytest_checks_it(tmp_path, monkeypatch):
    """``pytest-of-<user>`` may be used before pytest looks at it: this user's, not a link -
    its mode then tightened to 0700 as pytest does."""
    base = _temproot(tmp_path, monkeypatch)
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    assert poolmod.default_pool_dir() == str(base / "msrun-pool")
    assert stat.S_IMODE(base.stat().st_mode) == 0o700
    base.rmdir()
    base.symlink_to(tmp_path)
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        poolmod.default_pool_dir()


@as_root
def test_pytests_own_root_of_another_user_is_refused(tmp_path, monkeypatch):
    base = _temproot(tmp_path, monkeypatch)
    base.mkdir(mode=0o700)
    os.chown(base, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match="belongs to another user"):
        poolmod.default_pool_dir()


# A pool file as another program (or a stranger, or a bug) may have left it: JSON of every shape
# and type, numbers too big for a pid, floats that are not finite, bytes that are not UTF-8.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from([0, 1, 65535, 65536, 2**22, 2**22 + 1, 2**64, math.inf, -1])
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
)
ports = st.lists(st.integers(min_value=40990, max_value=41410) | values, max_size=4) | values
entry = st.fixed_dictionaries(
    {},
    optional={
        "pid": st.sampled_from([os.getpid(), 1, 0, -5, 2**40, True]) | values,
        "ports": ports,
        "devices": st.lists(st.text(max_size=3) | values, max_size=3) | values,
        "ts": scalars,
    },
)
good_lease = st.builds(
    lambda p: {"pid": os.getpid(), "ports": p, "devices": [], "ts": 1.0},
    st.lists(st.integers(min_value=41000, max_value=41399), min_size=1, max_size=6),
)
section = st.dictionaries(st.text(max_size=4), entry | good_lease | values, max_size=4) | values
state = st.fixed_dictionaries({}, optional={"leases": section, "waiting": section, "x": values}) | values
raw = (
    state.map(lambda v: json.dumps(v).encode())  # NaN and Infinity included: not JSON
    | st.binary(max_size=64)
    | st.sampled_from([b"[" * 100_000, b"1" * 5000, b'{"leases": {"a": {"pid": 1e999}}}', b"\xff\xfe{}"])
)


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _depth(value: object) -> int:
    """How deeply ``value``'s arrays and objects nest (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@example(data=b'{"leases": {"": {"pid": %d, "ports": [41197], "devices": [], "ts": 1.0}}, "x": Infinity}' % os.getpid())
@example(data=b'{"leases": {"": {"pid": %d, "ports": [41388], "devices": [], "ts": 1.0}}, "x": [[[[]]]]}' % os.getpid())
@given(raw)
def test_a_malformed_pool_file_never_breaks_the_pool_nor_hands_a_port_out_twice(tmp_path, data):
    directory = tmp_path / uuid.uuid4().hex
    pool = _pool_in(directory)
    (directory / "pool.json").write_bytes(data)
    held = set()  # ports of leases this process holds in the planted file, as the pool writes them
    try:  # a file that is not JSON (Infinity, NaN) or nests deeper than the pool's own is an empty pool
        planted = json.loads(data, parse_constant=_not_json)
        if _depth(planted) > 4:
            raise ValueError("deeper than a pool file")
        for lease in planted["leases"].values():
            if lease.get("pid") == os.getpid() and lease.get("devices") == [] and lease.get("ts") == 1.0:
                held.update(lease["ports"])
    except Exception:
        pass
    leases = [pool.lease(ports=2, devices=0, inv=poolmod.DeviceInventory(), wait=5) for _ in range(3)]
    given_out = [p for lease in leases for p in lease.ports]
    assert len(set(given_out)) == len(given_out)
    assert not set(given_out) & held
    assert pool.contended(leases[0]) is False
    for lease in leases:
        pool.release(lease)
    left = json.loads((directory / "pool.json").read_text())["leases"]
    assert not set(left) & {lease.lease_id for lease in leases}


# ---------------------------------------------------------------- msrun
TASK = """
import os
open(os.path.join(os.environ["DUMP_DIR"], f"ran-{os.environ['RANK_ID']}"), "w").close()
"""


def _refused(job, needle: str, flag: str) -> None:
    assert job.returncode == 2, job.stdout + job.stderr
    errors = [line for line in job.stderr.splitlines() if line.startswith("msrun: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"msrun: error: {flag}") and needle in errors[0], job.stderr
    assert "Traceback" not in job.stderr and "Start worker" not in job.stdout + job.stderr


@pytest.mark.parametrize("where", ["a directory in it", "it"])
def test_a_log_dir_others_can_write_is_refused_before_anything_starts(msrun, where):
    shared = _open_to_others(msrun.cwd / "shared")
    log_dir = shared / "logs" if where == "a directory in it" else shared
    msrun.script("task.py", TASK)
    job = msrun.run([*job_args(2)[:3], f"--log_dir={log_dir}", "--join=True", "task.py"])
    _refused(job, f"its directory {shared} is writable by others (mode 777)", f"--log_dir={log_dir}:")
    assert f"chmod go-w {shared}" in job.stderr
    assert sorted(p.name for p in shared.iterdir()) == [] and list(msrun.dump.iterdir()) == []


def test_a_trace_where_others_can_write_is_refused(msrun):
    shared = _open_to_others(msrun.cwd / "shared")
    msrun.script("task.py", TASK)
    job = msrun.run(job_args(2, "--trace", str(shared / "job.trace.json"), "task.py"))
    _refused(job, f"its directory {shared} is writable by others", f"--trace={shared / 'job.trace.json'}:")
    assert list(msrun.dump.iterdir()) == []


def test_a_sticky_shared_log_dir_is_used(msrun):
    sticky = _open_to_others(msrun.cwd / "sticky", 0o1777)
    msrun.script("task.py", TASK)
    job = msrun.run([*job_args(2)[:3], f"--log_dir={sticky / 'logs'}", "--join=True", "task.py"])
    assert job.returncode == 0, job.stderr
    assert stat.S_IMODE((sticky / "logs").stat().st_mode) == 0o700


def _planted(msrun, tmp_path: Path, plant) -> tuple:
    """A job whose ``logs/worker_1.log`` is what ``plant`` put there; (job, victim)."""
    victim = _victim(tmp_path)
    logs = msrun.cwd / "logs"
    logs.mkdir()
    plant(logs / "worker_1.log", victim)
    msrun.script("task.py", TASK)
    return msrun.run(job_args(2, "task.py"), timeout=60), victim


@pytest.mark.parametrize(
    "what, plant, said",
    [
        ("symlink", lambda at, victim: at.symlink_to(victim), "is a symbolic link"),
        ("hard link", lambda at, victim: os.link(victim, at), "has 2 names (hard links)"),
        ("fifo", lambda at, victim: os.mkfifo(at), "is a FIFO, not a regular file"),  # once: msrun hung there
    ],
)
def test_what_is_planted_at_a_log_name_is_refused_before_anything_starts(msrun, tmp_path, what, plant, said):
    job, victim = _planted(msrun, tmp_path, plant)
    assert job.returncode == 2, job.stderr
    assert job.stderr.count("msrun: error: --log_dir=logs: ") == 1 and "Start " not in job.stdout
    assert f"{msrun.cwd / 'logs' / 'worker_1.log'} {said}" in job.stderr or f"logs/worker_1.log {said}" in job.stderr
    assert victim.read_text() == SECRET
    assert "Traceback" not in job.stderr


def test_a_link_planted_at_the_status_file_is_replaced(msrun, tmp_path):
    victim = _victim(tmp_path)
    logs = msrun.cwd / "logs"
    logs.mkdir()
    (logs / "msrun_status.json").symlink_to(victim)
    msrun.script("task.py", TASK)
    job = msrun.run(job_args(2, "task.py"))
    assert job.returncode == 0, job.stderr
    assert victim.read_text() == SECRET
    assert job.status()["state"] == "succeeded" and not (logs / "msrun_status.json").is_symlink()


# ---------------------------------------------------------------- the plugin
MARKED = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_ranks(rank):
    assert rank in (0, 1)
"""


def _usage_error(result: pytest.RunResult, needle: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    errors = [line for line in result.stderr.lines if line.startswith("ERROR:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_a_report_page_where_others_can_write_is_a_usage_error(pytester):
    pytester.makepyfile(test_marked=MARKED)
    shared = _open_to_others(pytester.path / "shared")
    result = pytester.runpytest_subprocess(f"--msrun-report={shared / 'report.html'}")
    _usage_error(result, f"--msrun-report={shared / 'report.html'}: its directory {shared} is writable by others")


def test_a_trace_directory_where_others_can_write_is_a_usage_error(pytester):
    pytester.makepyfile(test_marked=MARKED)
    shared = _open_to_others(pytester.path / "shared")
    result = pytester.runpytest_subprocess(f"--msrun-trace={shared / 'traces'}")
    _usage_error(result, f"--msrun-trace={shared / 'traces'}: its directory {shared} is writable by others")
    assert list(shared.iterdir()) == []


def test_a_planted_pool_directory_is_a_usage_error_not_an_internal_error(pytester, monkeypatch, tmp_path):
    """After a reboot another user made ``/tmp/pytest-of-<user>/msrun-pool`` a link to a directory
    of theirs: the session stops at once, naming it and the fix."""
    root = tmp_path / "temproot"
    base = root / f"pytest-of-{getpass.getuser()}"
    base.mkdir(parents=True, mode=0o700)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (base / "msrun-pool").symlink_to(theirs)
    monkeypatch.setenv("PYTEST_DEBUG_TEMPROOT", str(root))
    pytester.makepyfile(test_marked=MARKED)
    result = pytester.runpytest_subprocess()
    _usage_error(result, f"{base / 'msrun-pool'} is a symbolic link, not a directory")
    assert list(theirs.iterdir()) == []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
