"""Shared helpers: run the real ``msrun`` as a subprocess and prove nothing is left behind."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, settings

# CI machines are loaded: a property test's examples may be slow to draw or to run there, which is
# no failure of the property. Tests that give their own settings list too_slow among theirs.
settings.register_profile("loaded", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("loaded")

REPO = Path(__file__).resolve().parents[1]
MARK = "MSRUN_TEST_MARK"

# tests/lab: namespaced hosts and a Slurm cluster on this machine (netlab, slurmlab), and their
# tier probes and session fixtures (labfixtures: ``netlab2``, ``slurm_lab``).
sys.path.insert(0, str(Path(__file__).resolve().parent / "lab"))
pytest_plugins = ["pytester", "labfixtures"]
collect_ignore = ["examples"]  # example test files for pytester runs, not tests of their own

# Tiers: a test marked ``torch``, ``mindspore`` or ``numactl`` skips with the reason where that
# framework or tool is missing (a user's machine), and fails instead when MSRUN_TEST_REQUIRE names
# the tier (CI sets MSRUN_TEST_REQUIRE to every tier: see .ci/run).
TIERS = {
    "torch": ("module", "torch", "pip install torch==2.13.0 numpy"),
    "mindspore": ("module", "mindspore", 'pip install mindspore==2.10.0 "numpy<2"'),
    "numactl": ("command", "numactl", "apt-get install numactl"),
    "browser": ("command", "chromium", "apt-get install chromium"),
}
# ``cgroup``: every cgroup containment mode the suite tests (``@pytest.mark.cgroup("v2")``,
# ``@pytest.mark.cgroup("freezer")``) must be available; a test of a mode this host lacks is
# collected and skips with the reason, or fails when MSRUN_TEST_REQUIRE names ``cgroup``.
CGROUP_TIER = "cgroup"
CGROUP_MODES = {"v2": "cgroup v2", "freezer": "cgroup v1 freezer"}
REQUIRE_ENV = "MSRUN_TEST_REQUIRE"
# ``plugins``: the compatibility matrix's plugins (.ci/compat.txt; tests/test_compat_matrix.py).
COMPAT_TIER = "plugins"


def known_tiers() -> list[str]:
    from labfixtures import LAB_TIERS

    return [*TIERS, *LAB_TIERS, CGROUP_TIER, COMPAT_TIER]


def required_tiers() -> set[str]:
    return {t.strip() for t in os.environ.get(REQUIRE_ENV, "").split(",") if t.strip()}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cgroup(mode): needs that cgroup containment mode (v2, freezer) on this host "
        "(skips cleanly when absent; fails under MSRUN_TEST_REQUIRE=cgroup)",
    )
    unknown = sorted(required_tiers() - set(known_tiers()))
    if unknown:  # a misspelt tier would otherwise require nothing, silently
        raise pytest.UsageError(
            f"{REQUIRE_ENV} names unknown tier(s) {', '.join(unknown)}; known tiers: {', '.join(known_tiers())}"
        )


def _present(kind: str, name: str) -> bool:
    if kind == "command":
        import shutil

        return shutil.which(name) is not None
    import importlib.util

    return importlib.util.find_spec(name) is not None


@functools.cache
def cgroup_reason(mode: str) -> str | None:
    """Why msrun cannot contain a job with ``MSRUN_CGROUP=mode`` here, or None when it can: the
    probe creates a cgroup as msrun does (this process moves in), then moves back and removes it."""
    from pytest_msrun.engine import containment

    if mode not in CGROUP_MODES:
        raise ValueError(f"unknown cgroup mode {mode!r} (known: {', '.join(CGROUP_MODES)})")
    probe = containment.create(f"probe{os.getpid()}{mode}", env={containment.CGROUP_ENV: mode})
    if probe is None:
        mounts = containment._mounts()
        where = "no cgroup2 mount" if mode == "v2" else "no v1 freezer hierarchy"
        if (mode == "v2" and "cgroup2" in mounts) or (mode == "freezer" and "freezer" in mounts):
            where = "its hierarchy is mounted but not writable here (no root, no delegation)"
        return f"{CGROUP_MODES[mode]} is not available ({where}); msrun would fall back to the environment sweep"
    probe.leave()
    probe.remove(1)
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    required = required_tiers()
    for tier, (kind, name, install) in TIERS.items():
        if item.get_closest_marker(tier) is None or _present(kind, name):
            continue
        reason = f"{name} is not installed ({install})"
        if tier in required:
            pytest.fail(f"{REQUIRE_ENV}={tier}: {reason}", pytrace=False)
        pytest.skip(reason)
    # Lab tiers: ``netns`` (root, ip/nsenter/unshare, working namespaces) and ``slurm`` (also
    # slurmctld/slurmd/munged/srun...); CI requires them with MSRUN_TEST_REQUIRE=netns,slurm.
    from labfixtures import LAB_TIERS

    for tier, probe in LAB_TIERS.items():
        if item.get_closest_marker(tier) is None:
            continue
        lab_reason = probe()
        if lab_reason is None:
            continue
        if tier in required:
            pytest.fail(f"{REQUIRE_ENV}={tier}: {lab_reason}", pytrace=False)
        pytest.skip(lab_reason)
    for marker in item.iter_markers(CGROUP_TIER):
        cg_reason = cgroup_reason(*marker.args)
        if cg_reason is None:
            continue
        if CGROUP_TIER in required:
            pytest.fail(f"{REQUIRE_ENV}={CGROUP_TIER}: {cg_reason}", pytrace=False)
        pytest.skip(cg_reason)


# The ecosystem plugins of the test extra (pytest-randomly, -timeout, -rerunfailures, -cov) are
# installed for tests/test_ecosystem.py, which asks for them in its pytest sessions. Every other
# pytest these tests start (pytester sessions, ranks) runs in file order, as written: pytest-randomly,
# the one of them active by default, is off there unless a session turns it back on (-p randomly).
NO_RANDOMLY = "-p no:randomly"
os.environ["PYTEST_ADDOPTS"] = " ".join([os.environ.get("PYTEST_ADDOPTS", ""), NO_RANDOMLY]).strip()


# pytester's sessions lay out their output for the terminal's width (COLUMNS): a wide CI terminal
# printed each failure's message once more, in full, in the short summary a narrow one cuts. Every
# pytester session gets one width, so what a test reads does not depend on where it runs.
PYTESTER_COLUMNS = "80"


@pytest.fixture(autouse=True)
def _pytester_in_file_order(request: pytest.FixtureRequest) -> None:
    """pytester clears PYTEST_ADDOPTS for its sessions: put the file order back; fix the width."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv("PYTEST_ADDOPTS", NO_RANDOMLY)
        monkeypatch.setenv("COLUMNS", PYTESTER_COLUMNS)


_next_port = [0]


def free_port() -> int:
    """A free port (and the one above it, for MASTER_PORT) from a range owned by this xdist worker.

    Ports come from below the kernel's ephemeral range, so client sockets never take them, and
    each xdist worker has its own slice, so parallel tests never hand out the same port.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = 20000 + (index % 10) * 1000
    for _ in range(500):
        port = base + (_next_port[0] % 500) * 2
        _next_port[0] += 1
        if all(_bindable(p) for p in (port, port + 1)):
            return port
    raise RuntimeError("no free port pair")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def marked_processes(mark: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment carries ``MSRUN_TEST_MARK=mark``."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get(MARK) == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def wait_empty(find, timeout: float = 5.0, interval: float = 0.05) -> list[psutil.Process]:
    """Poll ``find()`` until it returns no process or ``timeout`` passed; what it last returned."""
    deadline = time.monotonic() + timeout
    while True:
        left = find()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(interval)


def wait_gone(mark: str, timeout: float = 5.0) -> list[psutil.Process]:
    return wait_empty(lambda: marked_processes(mark), timeout)


@pytest.fixture
def tracked(monkeypatch, request):
    """Every process the test's controller starts is gone when the test ends (they carry a mark
    of this test in their environment)."""
    mark = f"{request.node.module.__name__}-{request.node.name}"
    monkeypatch.setenv(MARK, mark)
    yield mark
    left = wait_gone(mark)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not left, [p.cmdline() for p in left if p.is_running()]


def msrun_cgroups() -> set[str]:
    """Every ``msrun-<job id>`` cgroup on this host, in each hierarchy msrun uses (v2, v1 freezer)."""
    from pytest_msrun.engine import containment

    found: set[str] = set()
    for mount in containment._mounts().values():
        for root, dirs, _files in os.walk(mount):
            found.update(os.path.join(root, d) for d in dirs if d.startswith("msrun-"))
    return found


def _cgroup_empty(path: str) -> bool:
    for root, _dirs, _files in os.walk(path):
        try:
            with open(os.path.join(root, "cgroup.procs"), encoding="ascii") as fh:
                if fh.read().strip():
                    return False
        except OSError:
            continue
    return True


def empty_cgroups_left(before: set[str], timeout: float = 10.0) -> list[str]:
    """The msrun cgroups made since ``before`` that are still there, empty, after ``timeout``: a
    live job's cgroup has members, a finished job's must be gone (another job's, running beside
    the test, is not mistaken for a leak)."""
    return wait_empty(lambda: sorted(p for p in msrun_cgroups() - before if _cgroup_empty(p)), timeout)


@dataclass
class Job:
    """A finished (or started) msrun invocation."""

    returncode: int
    stdout: str
    stderr: str
    log_dir: Path

    def log(self, name: str) -> str:
        return (self.log_dir / name).read_text()

    def status(self, name: str = "msrun_status.json") -> dict:
        return json.loads((self.log_dir / name).read_text())


class Msrun:
    """Runs ``python -m pytest_msrun`` in a scratch directory with a leak-tracking mark."""

    def __init__(self, tmp_path: Path) -> None:
        self.cwd = tmp_path
        self.mark = uuid.uuid4().hex
        self.dump = tmp_path / "dump"
        self.dump.mkdir(exist_ok=True)
        self.popens: list[subprocess.Popen] = []
        self.cgroups_before = msrun_cgroups()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env[MARK] = self.mark
        env["DUMP_DIR"] = str(self.dump)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        # a job's "pytest" and "python" are this interpreter's, as in its activated virtual
        # environment - the suite may run from one that is not activated (PATH finds another pytest)
        env["PATH"] = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), env.get("PATH", "")]))
        for name in ("RANK_ID", "MS_ROLE", "MS_SIMULATION_LEVEL", "RANK_SIZE", "MSRUN_JOB_TOKEN"):
            env.pop(name, None)
        for name in [k for k in env if k.startswith("SLURM_")]:  # the suite itself may run under srun
            env.pop(name)
        env.update(extra or {})
        return env

    def script(self, name: str, body: str) -> Path:
        path = self.cwd / name
        path.write_text(textwrap.dedent(body))
        return path

    def argv(self, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "pytest_msrun", *args]

    def start(self, args: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        popen = subprocess.Popen(
            self.argv(args),
            cwd=self.cwd,
            env=self.env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kw,
        )
        self.popens.append(popen)
        return popen

    def run(
        self, args: list[str], env: dict[str, str] | None = None, timeout: float = 60, log_dir: str = "logs"
    ) -> Job:
        proc = subprocess.run(
            self.argv(args), cwd=self.cwd, env=self.env(env), capture_output=True, text=True, timeout=timeout
        )
        return Job(proc.returncode, proc.stdout, proc.stderr, self.cwd / log_dir)

    def finish(self, popen: subprocess.Popen, log_dir: str = "logs", timeout: float = 60) -> Job:
        out, err = popen.communicate(timeout=timeout)
        return Job(popen.returncode, out, err, self.cwd / log_dir)

    def dumps(self) -> list[dict[str, str]]:
        """Environments written by the ``env_dump`` script, sorted by role then rank."""
        out = [json.loads(p.read_text()) for p in sorted(self.dump.glob("*.json"))]
        return sorted(out, key=lambda e: (e.get("MS_ROLE", ""), int(e.get("RANK_ID", "-1") or -1)))

    def cleanup(self) -> list[psutil.Process]:
        for popen in self.popens:
            if popen.poll() is None:
                popen.send_signal(signal.SIGKILL)
                popen.wait()
        left = wait_gone(self.mark)
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        return left


@pytest.fixture
def msrun(tmp_path: Path):
    """An :class:`Msrun` runner; the test fails if any process of its jobs outlives it."""
    runner = Msrun(tmp_path)
    yield runner
    left = runner.cleanup()
    assert not left, f"leftover processes: {[(p.pid, p.cmdline()) for p in left if p.is_running()]}"
    cgroups = empty_cgroups_left(runner.cgroups_before)
    assert not cgroups, f"empty job cgroups left behind: {cgroups}"


ENV_DUMP = """
import json, os, sys, time
role = os.environ.get("MS_ROLE", "none")
rank = os.environ.get("RANK_ID", "x")
path = os.path.join(os.environ["DUMP_DIR"], f"{role}_{rank}_{os.getpid()}.json")
with open(path + ".part", "w") as fh:
    json.dump({**os.environ, "_argv": json.dumps(sys.argv), "_executable": sys.executable}, fh)
os.replace(path + ".part", path)  # whole or absent: a test reads it while the job runs
release = os.environ.get("RELEASE_FILE")
if release:  # held until the test creates this file (it inspects the running job meanwhile)
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)
time.sleep(float(os.environ.get("SLEEP", "0")))
"""


@pytest.fixture
def env_dump(msrun: Msrun) -> Path:
    """A task script that writes its environment to ``DUMP_DIR``."""
    return msrun.script("env_dump.py", ENV_DUMP)


def wait_child(pid: int, timeout: float = 60.0) -> int:
    """The exit code of this process's child ``pid`` (polled; SIGKILLed and failed past ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"child {pid} did not end within {timeout:g} s")


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")


def rank_dumps(directory: Path) -> dict[int, dict]:
    """``rank<N>.json`` files written by ranks, by rank; one still being written is left out."""
    out: dict[int, dict] = {}
    for path in directory.glob("rank*.json"):
        try:
            out[int(path.stem[4:])] = json.loads(path.read_text())
        except ValueError:
            continue
    return out


def read_status(log_dir: Path, name: str = "msrun_status.json") -> dict | None:
    try:
        return json.loads((log_dir / name).read_text())
    except (OSError, ValueError):
        return None


def wait_running(log_dir: Path, workers: int, name: str = "msrun_status.json") -> dict:
    """Wait until the job's status file lists ``workers`` running workers whose task has started."""

    def ready():
        st = read_status(log_dir, name)
        if not st or st["state"] != "running":
            return None
        procs = [p for p in st["processes"] if p["role"] == "worker"]
        if len(procs) != workers:
            return None
        for p in procs:
            try:
                if not Path(p["log"]).read_text().startswith("started"):
                    return None
            except OSError:
                return None
        return st

    return wait_for(ready)


# A task whose ranks print "started", then behave as FAIL_MODE says for rank FAIL_RANK: after
# FAIL_AFTER seconds, or - ordered by an event instead of a delay - once the file FAIL_WHEN exists.
# The other ranks hold SLEEP seconds (the workload), or until the file RELEASE_FILE exists.
FAULTY = """
import ctypes, os, signal, subprocess, sys, time
rank = int(os.environ.get("RANK_ID", "0"))
print("started", flush=True)
mode = os.environ.get("FAIL_MODE", "")


def wait_file(path, seconds=120.0):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


if os.environ.get("GRANDCHILD"):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
if os.environ.get("DAEMON"):
    ready = os.path.join(os.environ["DUMP_DIR"], f"daemon{rank}")
    subprocess.Popen([sys.executable, "-c",
        "import os, sys, time\\nif os.fork() == 0:\\n    os.setsid()\\n    open(sys.argv[1], 'w').close()\\n"
        "    time.sleep(120)\\n", ready])
    wait_file(ready)  # the daemon exists before this rank can end
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if rank == int(os.environ.get("FAIL_RANK", "-1")):
    if os.environ.get("FAIL_WHEN"):
        wait_file(os.environ["FAIL_WHEN"])
    else:
        time.sleep(float(os.environ.get("FAIL_AFTER", "0.3")))
    if mode == "exit3":
        print("rank failing on purpose", flush=True)
        sys.exit(3)
    if mode == "raise":
        raise RuntimeError(f"boom on rank {rank}")
    if mode == "segv":
        ctypes.string_at(0)
    if mode == "exit0":
        os._exit(0)
if os.environ.get("RELEASE_FILE"):
    wait_file(os.environ["RELEASE_FILE"])
else:
    time.sleep(float(os.environ.get("SLEEP", "120")))
"""


def job_args(workers: int, *rest: str, local: int | None = None, port: int = 0, join: bool = True) -> list[str]:
    """The usual msrun flags for a test job (logs in ``logs/``), then ``rest`` (flags, task, args)."""
    args = [
        f"--worker_num={workers}",
        f"--local_worker_num={local or workers}",
        f"--master_port={port}",
        "--log_dir=logs",
    ]
    if join:
        args.append("--join=True")
    return [*args, *rest]


# Figures measured by the reliability tier, printed as one table at the end of the session.
RELIABILITY: list[tuple[str, str, str]] = []


def record(scenario: str, result: str, figure: str = "") -> None:
    RELIABILITY.append((scenario, result, figure))


def pytest_terminal_summary(terminalreporter) -> None:
    if not RELIABILITY:
        return
    rows = [("scenario", "result", "measured"), *RELIABILITY]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    terminalreporter.section("msrun reliability")
    for row in rows:
        terminalreporter.write_line("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


@pytest.fixture(autouse=True, scope="session")
def private_config_home(tmp_path_factory):
    """Multi-node jobs create an msrun secret in XDG_CONFIG_HOME: the session's own, never the user's."""
    old = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config-home"))
    yield
    if old is None:
        os.environ.pop("XDG_CONFIG_HOME", None)
    else:
        os.environ["XDG_CONFIG_HOME"] = old
