"""No other user gets in (issue 45): another local account attacks what msrun and the plugin write.

The victim and the attacker are throwaway accounts (tests/lab/users.py, fixture ``user_lab``). The
victim runs ``pmsrun`` and plain ``pytest`` sessions in directories of its own; every attack is a
process of the attacker account (tests/lab/attacker.py) - the test process, root, only sets up
and looks at the results. This file: files the tools write (the port pool in pytest's per-user
temp root, ``--log_dir``, ``--trace``, ``--msrun-report`` in directories others can write) and
the job token (a weak one; what a stranger's hello gets back). The listeners are in
``test_second_user_listeners.py``, several nodes in ``test_second_user_nodes.py``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

import pytest
from conftest import wait_for, wait_running
from users import ATTACKER, UserLab, remove_paths, with_env

pytestmark = pytest.mark.users

# The victim's pytest. pytest-rerunfailures (installed with the test extra) listens on loopback in
# every session it is loaded in: not msrun's listener, so not loaded here.
PYTEST = ["python", "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:rerunfailures"]
MSRUN = ["python", "-m", "pytest_msrun"]
ONE_NODE = [*MSRUN, "--worker_num=2", "--local_worker_num=2", "--master_port=0", "--join=True"]  # a job on one node

# A marked test of the victim's: two ranks, nothing else.
TWO_RANKS = """
import pytest


@pytest.mark.msrun(worker_num=2)
def test_two_ranks(rank, world_size):
    assert world_size == 2 and rank in (0, 1)
"""

# The victim's job: each rank says it started, joins the control plane, says so, and - with
# RELEASE_FILE - holds until the test creates that file (the attack happens meanwhile); then a
# barrier (the control plane still serves every rank) and "finished".
HOLD = """
import os, sys, time
print("started", flush=True)
from pytest_msrun import cluster
cluster.init()
print("ready", flush=True)
release = os.environ.get("RELEASE_FILE")
if release:
    deadline = time.monotonic() + float(os.environ.get("HOLD_MAX", "150"))
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            sys.exit("never released")
        time.sleep(0.05)
cluster.barrier()
marker = os.environ.get("RAN_MARKER")
if marker:
    open(marker + os.environ["RANK_ID"], "w").close()
print("finished", flush=True)
"""

PRECIOUS = b"the victim's own data: must never change\n"


def precious(lab: UserLab, name: str) -> Path:
    """A victim-owned file (mode 0600, known content) in its home: what planted links point to."""
    return lab.victim.write(lab.victim.home / f"precious-{name}-{secrets.token_hex(3)}", PRECIOUS, 0o600)


def unchanged(path: Path) -> bool:
    st = path.lstat()
    return stat.S_ISREG(st.st_mode) and path.read_bytes() == PRECIOUS and stat.S_IMODE(st.st_mode) == 0o600


def attack(lab: UserLab, *args: str, timeout: float = 120, **kw) -> dict:
    """Run a subcommand of tests/lab/attacker.py as the attacker; its JSON answer."""
    got = lab.attacker.run(["python", str(ATTACKER), *args], cwd=lab.attacker.home, timeout=timeout, **kw)
    assert got.returncode == 0, f"the attack itself failed:\n{got.output}"
    return json.loads(got.stdout.strip().splitlines()[-1])


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("msrun: error:")]


def pytest_temp_root(lab: UserLab) -> Path:
    return Path("/tmp") / f"pytest-of-{lab.victim.name}"


@pytest.fixture
def shared_dir(user_lab: UserLab):
    """``/tmp/shared-<random>``, mode 0777 and not sticky: anyone may create, rename and remove there."""
    path = Path("/tmp") / f"shared-{secrets.token_hex(4)}"
    path.mkdir()
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sticky_dir(user_lab: UserLab):
    """``/tmp/sticky-<random>``, mode 1777, like /tmp itself."""
    path = Path("/tmp") / f"sticky-{secrets.token_hex(4)}"
    path.mkdir()
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- the lab itself
def test_the_accounts_are_strangers_to_each_other(user_lab, victim_dir):
    """What every attack here assumes: two unprivileged accounts with clean environments, the
    victim's home closed to the attacker, and the package importable by both."""
    victim, attacker = user_lab.victim, user_lab.attacker
    assert victim.uid != attacker.uid and 0 not in (victim.uid, attacker.uid)
    assert stat.S_IMODE(victim.home.stat().st_mode) == 0o700
    assert victim_dir.stat().st_uid == victim.uid
    probe = (
        "import json, os, tempfile, pytest_msrun; print(json.dumps({'uid': os.getuid(), 'euid': os.geteuid(), "
        "'groups': os.getgroups(), 'tmp': tempfile.gettempdir(), 'env': sorted(os.environ), 'cwd': os.getcwd()}))"
    )
    seen = json.loads(victim.python_code(probe, cwd=victim_dir).stdout)
    assert seen["uid"] == seen["euid"] == victim.uid and 0 not in seen["groups"]
    assert seen["tmp"] == "/tmp" and seen["cwd"] == str(victim_dir)
    assert not {"TMPDIR", "MSRUN_TEST_MARK", "XDG_CONFIG_HOME", "SUDO_USER"} & set(seen["env"])
    peek = attacker.python_code(f"import os; os.listdir({str(victim.home)!r})")
    assert peek.returncode != 0 and "PermissionError" in peek.stderr
    assert attacker.python_code(f"import os; os.kill({os.getpid()}, 0)").returncode != 0  # root's: EPERM


# ---------------------------------------------------------------- 1. the port pool in pytest's temp root
@pytest.mark.parametrize("plant", ["links", "hostile state"])
def test_a_pool_directory_taken_first_by_another_user_changes_nothing_of_the_victims(user_lab, victim_dir, plant):
    """The attacker creates the victim's ``/tmp/pytest-of-<victim>`` (mode 0777) and msrun's pool
    directory in it before the victim's first session, and plants there either links named as the
    pool's temporary state files (``pool.json.<pid>.tmp`` for the next 5000 pids) to a file of the
    victim's, or a state file of its own (a lease that is not an object; every port leased to pid 1).

    The victim's plain ``pytest`` with one marked test must not write through the links (its file
    is unchanged) and must not crash: it passes, or ends with a clear error naming the directory
    (pytest's own "not owned by the current user", or msrun's) - never an INTERNALERROR."""
    victim = user_lab.victim
    root = pytest_temp_root(user_lab)
    remove_paths([str(root)])  # as after a reboot: the attacker comes first
    target = precious(user_lab, "pool")
    victim.write(victim_dir / "test_pool.py", TWO_RANKS)
    try:
        planted = attack(
            user_lab,
            "plant-pool",
            victim.name,
            str(target),
            "--ahead",
            "5000",
            *(["--hostile"] if "state" in plant else []),
        )
        assert planted["root"] == str(root) and root.stat().st_uid == user_lab.attacker.uid
        session = victim.run([*PYTEST, "-q", "test_pool.py"], cwd=victim_dir, timeout=240)
        assert unchanged(target), f"the victim's file was written through the attacker's link: {target.read_bytes()!r}"
        assert "INTERNALERROR" not in session.output, "\n".join(session.output.splitlines()[-12:])
        if session.returncode != 0:
            assert str(root) in session.output, f"the error does not name {root}:\n{session.output}"
            assert session.returncode in (1, 2, 3, 4), session.output
        else:
            assert re.search(r"\b1 passed\b", session.stdout), session.output
    finally:
        remove_paths([str(root)])


# ---------------------------------------------------------------- 5. links where msrun writes
@pytest.mark.parametrize("flag", ["log_dir", "trace"])
def test_links_planted_where_msrun_writes_are_not_followed(user_lab, victim_dir, shared_dir, flag):
    """``--log_dir`` or ``--trace`` in a directory anyone may write (mode 0777, not sticky): the
    attacker plants links at every name msrun writes there (worker and scheduler logs, the status
    file and its temporary names, the trace and its temporary names) to files of the victim's.

    None of the victim's files may change. msrun refuses (exit 2, one ``msrun: error:`` line naming
    the flag, nothing started) - or writes without following a link."""
    victim = user_lab.victim
    victim.write(victim_dir / "task.py", HOLD)
    marker = victim_dir / "ran"
    if flag == "log_dir":
        names = ["worker_0.log", "worker_1.log", "scheduler.log", "msrun_status.json", "msrun_status.json.{pid}.tmp"]
        args = [f"--log_dir={shared_dir}"]
    else:
        names = ["job.trace.json", "job.trace.json.{pid}.tmp"]
        args = ["--log_dir=logs", f"--trace={shared_dir / 'job.trace.json'}"]
    targets = {name: precious(user_lab, re.sub(r"\W", "", name)) for name in names}
    attack(user_lab, "plant-links", str(shared_dir), *(f"{n}={t}" for n, t in targets.items()), "--ahead", "3000")
    job = victim.run(
        [*ONE_NODE, *args, "task.py"],
        cwd=victim_dir,
        env={"RAN_MARKER": str(marker)},
        timeout=120,
    )
    changed = [n for n, t in targets.items() if not unchanged(t)]
    assert not changed, f"written through the attacker's links: {changed}\n{job.stderr}"
    assert job.returncode in (0, 2), job.stdout + job.stderr
    if job.returncode == 2:
        errors = error_lines(job.stderr)
        assert len(errors) == 1 and f"--{flag}" in errors[0], job.stderr
        assert "Start worker" not in job.stdout and not list(victim_dir.glob("ran*")), "something was started"


def test_a_log_dir_another_user_made_in_a_sticky_directory_is_refused(user_lab, victim_dir, sticky_dir):
    """In a sticky directory (like /tmp) the attacker creates the name the victim gives as
    ``--log_dir`` first (mode 0777, links to the victim's files inside): it is not the victim's, so
    msrun refuses it - exit 2, one ``msrun: error:`` naming ``--log_dir``, nothing started."""
    victim = user_lab.victim
    victim.write(victim_dir / "task.py", HOLD)
    logs = sticky_dir / f"{victim.name}-logs"
    targets = {n: precious(user_lab, n.split(".")[0]) for n in ("worker_0.log", "scheduler.log", "msrun_status.json")}
    made = user_lab.attacker.python_code(f"import os; os.mkdir({str(logs)!r}); os.chmod({str(logs)!r}, 0o777)")
    assert made.returncode == 0, made.output
    attack(user_lab, "plant-links", str(logs), *(f"{n}={t}" for n, t in targets.items()), "--ahead", "10")
    job = victim.run(
        [*ONE_NODE, f"--log_dir={logs}", "task.py"],
        cwd=victim_dir,
        env={"RAN_MARKER": str(victim_dir / "ran")},
        timeout=120,
    )
    assert all(unchanged(t) for t in targets.values()), "written through the attacker's links"
    assert job.returncode == 2, f"ran in a directory of the attacker's (exit {job.returncode}):\n{job.stderr}"
    errors = error_lines(job.stderr)
    assert len(errors) == 1 and "--log_dir" in errors[0], job.stderr
    assert "Start worker" not in job.stdout and not list(victim_dir.glob("ran*"))


def test_links_planted_where_the_html_report_goes_are_not_followed(user_lab, victim_dir, shared_dir):
    """``--msrun-report=<shared>/report.html``: the attacker plants the page's name and its
    temporary names as links to a file of the victim's, and the page's folder (``report_files``)
    as a link to a directory of the victim's. Nothing of the victim's changes: a usage error
    naming the option (exit 4), or a page written without following a link."""
    victim = user_lab.victim
    victim.write(victim_dir / "test_report.py", TWO_RANKS)
    page, folder = precious(user_lab, "page"), victim.mkdir(victim.home / f"precious-dir-{secrets.token_hex(3)}")
    victim.write(folder / "keep.txt", PRECIOUS)
    before = sorted(p.name for p in folder.rglob("*"))
    attack(
        user_lab,
        "plant-links",
        str(shared_dir),
        f"report.html={page}",
        f"report.html.{{pid}}.tmp={page}",
        f"report_files={folder}",
        "--ahead",
        "3000",
    )
    session = victim.run(
        [*PYTEST, "-q", f"--msrun-report={shared_dir / 'report.html'}", "test_report.py"], cwd=victim_dir, timeout=240
    )
    assert unchanged(page), "the page was written through the attacker's link"
    assert sorted(p.name for p in folder.rglob("*")) == before, "files were written into the victim's directory"
    assert "INTERNALERROR" not in session.output, "\n".join(session.output.splitlines()[-12:])
    assert session.returncode in (0, 4), session.output
    if session.returncode == 4:
        assert "--msrun-report" in session.stderr, session.output


# ---------------------------------------------------------------- 6. the job's token
def test_a_weak_job_token_is_a_usage_error(user_lab, victim_dir):
    """``MSRUN_JOB_TOKEN=summer2024``: a token anyone can guess is refused before anything starts."""
    victim = user_lab.victim
    victim.write(victim_dir / "task.py", HOLD)
    job = victim.run(
        [*ONE_NODE, "--log_dir=logs", "task.py"],
        cwd=victim_dir,
        env={"MSRUN_JOB_TOKEN": "summer2024", "RAN_MARKER": str(victim_dir / "ran")},
        timeout=120,
    )
    assert job.returncode == 2, f"a weak token was accepted (exit {job.returncode}):\n{job.stderr}"
    errors = error_lines(job.stderr)
    assert len(errors) == 1 and "MSRUN_JOB_TOKEN" in errors[0], job.stderr
    assert "Start worker" not in job.stdout and not list(victim_dir.glob("ran*"))


def test_a_strangers_hello_gets_nothing_to_guess_the_token_against(user_lab, victim_dir):
    """While the victim's job (one node: a random token) runs, the attacker finds its scheduler
    port (every listening socket's owner is public in /proc/net/tcp), sends a rank's hello and
    keeps the answer. That answer must carry nothing computed from the token - no proof to test
    guesses against offline: the client proves first. The job is not disturbed."""
    from pytest_msrun.control import wire

    victim = user_lab.victim
    victim.write(victim_dir / "task.py", HOLD)
    release = victim_dir / "release"
    job = victim.start(
        [*ONE_NODE, "--log_dir=logs", "task.py"],
        cwd=victim_dir,
        env={"RELEASE_FILE": str(release)},
    )
    try:
        wait_running(victim_dir / "logs", 2)
        ranks = wait_for(lambda: with_env(victim.uid, "MSRUN_JOB_TOKEN"), 30)
        token, port = ranks[0][1]["MSRUN_JOB_TOKEN"], int(ranks[0][1]["MS_SCHED_PORT"])
        seen = attack(user_lab, "listening", str(victim.uid))
        assert port in {s["port"] for s in seen}, seen  # what the attacker could find by itself
        got = attack(user_lab, "hello", "127.0.0.1", str(port))
        reply, nonce = got["reply"], got["nonce"]
        assert isinstance(reply, dict), got
        assert "proof" not in reply, f"the scheduler proves the token first: {reply}"
        values = {v for v in reply.values() if isinstance(v, str)}
        server_nonce = str(reply.get("nonce", ""))
        for role in ("scheduler", "rank", "agent", "observer"):
            assert wire.proof(token, role, nonce, server_nonce) not in values, reply
        release.touch()
        out, err = job.communicate(timeout=120)
    finally:
        release.touch()
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, err
