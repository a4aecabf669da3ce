"""``processes.fork_call``: a function run in a fork of this process, as if a fresh interpreter
had been exec'd for it (the builtin control plane starts this way)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import wait_child, wait_for

from pytest_msrun import targets
from pytest_msrun.engine import processes


@pytest.fixture(autouse=True)
def _this_modules_targets(monkeypatch):
    """fork_call runs registered targets only: this module's functions, registered for its tests."""
    for name in ("report", "failing", "sleeps"):
        monkeypatch.setitem(targets.TARGETS, f"test_fork_call-{name}", f"{__name__}:{name}")


def report(env: dict[str, str]) -> int:
    """Run in the fork: write what the process looks like, exit with the status asked for."""
    keep = int(env["KEEP_FD"])
    facts = {
        "environ": dict(os.environ),
        "argument": env,
        "sid": os.getsid(0),
        "pid": os.getpid(),
        "handlers": {
            name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGTERM", "SIGINT", "SIGPIPE", "SIGCHLD")
        },
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ())),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "keep_inheritable": os.get_inheritable(keep),
        "comm": Path("/proc/self/comm").read_text().strip(),
    }
    print("to the log")
    with open(env["OUT"], "w") as fh:
        json.dump(facts, fh)
    return int(env["CODE"])


def failing(env: dict[str, str]) -> int:
    raise RuntimeError("fails on purpose")


def test_fork_call_gives_a_fresh_process(tmp_path):
    out, log = tmp_path / "facts.json", tmp_path / "child.log"
    keep_r, keep_w = os.pipe()
    stray = os.open(os.devnull, os.O_RDONLY)  # inheritable or not, it must not reach the child
    os.set_inheritable(stray, True)
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
    env = {"OUT": str(out), "CODE": "7", "KEEP_FD": str(keep_r), "ONLY_HERE": "yes"}
    old = signal.signal(signal.SIGTERM, lambda *_: None)  # a launcher's handler is not the child's
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        pid = processes.fork_call("test_fork_call-report", env, output_fd=log_fd, keep_fds=(keep_r,))
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        for fd in (keep_w, stray, log_fd):
            os.close(fd)
    try:
        assert wait_child(pid) == 7
    finally:
        os.close(keep_r)
    facts = json.loads(out.read_text())
    assert facts["environ"] == env == facts["argument"]
    assert "ONLY_HERE" not in os.environ  # the launcher's own environment is untouched
    assert facts["sid"] == facts["pid"] == pid
    assert facts["handlers"] == {
        "SIGTERM": str(signal.SIG_DFL),
        "SIGINT": str(signal.default_int_handler),
        "SIGPIPE": str(signal.SIG_IGN),  # as Python has it at start-up: EPIPE, not death
        "SIGCHLD": str(signal.SIG_DFL),
    }
    assert facts["blocked"] == []
    opened = set(facts["fds"]) - {0, 1, 2}
    assert opened - {keep_r} == {max(opened - {keep_r})}  # the one listdir itself had open
    assert keep_r in opened and facts["keep_inheritable"] is False
    assert facts["comm"] == "msrun-test_fork_call-report"[:15]
    assert log.read_text() == "to the log\n"


@pytest.mark.parametrize(
    "call,said",
    [
        ("test_fork_call-failing", "RuntimeError: fails on purpose"),
        # a name not in the registry is never imported
        ("os:system", "UnknownTarget: 'os:system' is not a registered target"),
    ],
    ids=["raises", "unregistered"],
)
def test_fork_call_reports_an_exception_in_the_log_and_exits_1(tmp_path, call, said):
    log = tmp_path / "child.log"
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        pid = processes.fork_call(call, {}, output_fd=log_fd)
    finally:
        os.close(log_fd)
    assert wait_child(pid) == 1
    wait_for(lambda: said in log.read_text())


def sleeps(env: dict[str, str]) -> int:
    time.sleep(60)
    return 0


def test_a_sigterm_the_instant_after_fork_call_ends_the_child():
    """Teardown the instant after the control plane's fork: the child may not lead its group yet
    (``setsid`` runs in it), so the signal goes to its pid, and its signals stay blocked until its
    defaults are set - it neither misses the signal nor runs the launcher's handler (caught under
    two CPU hogs: a killed pytest's msrun waited out its 5 s grace for the control plane)."""
    old = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        for _ in range(20):
            pid = processes.fork_call("test_fork_call-sleeps", {})
            child = processes.Child(tag=None, pid=pid, started=time.time())
            assert child.signal(signal.SIGTERM)
            assert wait_child(pid, timeout=20) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_child_not_leading_a_group_is_signalled_by_pid_until_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in our group
    child = processes.Child(tag=None, pid=proc.pid, started=time.time())
    try:
        assert child.signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    child.returncode = proc.returncode
    assert not child.signal(signal.SIGTERM)  # reaped: its pid may be anyone's by now


def test_once_in_the_cgroup_msrun_runs_one_thread_again():
    """The thread that moves msrun into the job's cgroup has ended when ``wait`` returns, even when
    it is held up on its way out after saying it is done: msrun forks its control plane only when it
    runs one thread (caught alive under load - 3 of 4 runs - it started a second interpreter)."""
    import _thread

    from pytest_msrun.engine import containment

    class Lagging(containment.Entering):
        def _run(self, *args) -> None:
            super()._run(*args)  # done: the main thread may go on
            time.sleep(0.005)  # ... while this one is descheduled before it ends

    before = _thread._count()
    for _ in range(5):
        Lagging("0" * 16, {"MSRUN_CGROUP": "off"}).wait()
        assert _thread._count() == before


DRIVER = """
import sys, time
from pytest_msrun.engine import containment

create = containment.create
def slow_create(*args, **kw):
    time.sleep(float(sys.argv[1]))  # a grace period as long as on a loaded machine
    return create(*args, **kw)

containment.create = slow_create
from pytest_msrun.entry import main
sys.exit(main(sys.argv[2:]))
"""

SIBLINGS = """
import os, time
from pathlib import Path

# A fork names itself (msrun-scheduler) just after it starts; this worker may start first.
deadline = time.monotonic() + 10
while True:
    comms = []
    for task in Path(f"/proc/{os.getppid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                comms.append(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:
                pass
    if "msrun-scheduler" in comms or time.monotonic() > deadline:
        break
    time.sleep(0.01)
Path(os.environ["DUMP_DIR"], "comms").write_text(" ".join(comms))
"""


@pytest.mark.parametrize("entry_delay", [0.0, 0.3])
def test_the_control_plane_is_a_fork_of_msrun(msrun, entry_delay):
    """With the builtin control plane, the scheduler process is msrun forked (``msrun-scheduler``
    in ps), not a second interpreter - also when entering the job's cgroup takes long (msrun had
    decided before it was inside, with the thread moving it there still running)."""
    msrun.script("siblings.py", SIBLINGS)
    driver = msrun.script("driver.py", DRIVER)
    args = ["--worker_num=1", "--local_worker_num=1", "--master_port=0", "--join=True", "siblings.py"]
    proc = subprocess.run(
        [sys.executable, str(driver), str(entry_delay), *args],
        cwd=msrun.cwd,
        env=msrun.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "msrun-scheduler" in (msrun.dump / "comms").read_text().split()


def test_wait_forwarding_lets_the_child_end_first_and_keeps_the_stack_dumps(tmp_path):
    """A template waiting for its forked child: SIGTERM to their process group ends the child
    first (the template only learns it arrived); afterwards SIGUSR1 still dumps the template's
    stacks (a handler set over ``faulthandler``'s would otherwise lose it for good)."""
    script = tmp_path / "template.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys, time
            from pytest_msrun.plugin.rank import forked

            out = {str(tmp_path)!r}
            stacks = open(os.path.join(out, "stacks"), "w")
            forked.dump_stacks_on_signals(stacks)
            pid = os.fork()
            if pid == 0:
                def on_term(signum, frame):
                    time.sleep(0.5)  # slower than the template would be to end
                    open(os.path.join(out, "child-ended"), "w").close()
                    os._exit(7)
                signal.signal(signal.SIGTERM, on_term)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # the template asleep: in its wait for this child
                    with open(f"/proc/{{os.getppid()}}/stat") as fh:
                        if fh.read().rsplit(")", 1)[1].split()[0] == "S":
                            break
                    time.sleep(0.01)
                os.killpg(os.getpgrp(), signal.SIGTERM)  # msrun ending the job
                while True:
                    time.sleep(1)
            code, terminated = forked.wait_forwarding(pid, stacks)
            assert os.path.exists(os.path.join(out, "child-ended"))
            print(code, int(terminated), flush=True)
            os.kill(os.getpid(), signal.SIGUSR1)  # dumped, not the end of the template
            stacks.flush()
            print(open(stacks.name).read().count("Current thread") >= 1, flush=True)
            forked.raise_again(terminated)
            print("not ended by its SIGTERM", flush=True)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, start_new_session=True
    )
    assert proc.stdout.split() == ["7", str(int(signal.SIGTERM)), "True"], proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGTERM
