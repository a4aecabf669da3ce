"""No other user gets in (issue 45): another local account attacks every listener of the victim's.

The victim (tests/lab/users.py) runs a plain ``pytest`` session - with a pseudo-terminal, or
without one - or ``pmsrun``, with ``ulimit -n 1024`` as users commonly have it; the attacker
(tests/lab/attacker.py) floods what it listens on: the ranks' debugger in the pytest controller,
a warm world's door, the control plane. The victim's run must end as if nobody had come, holding
a bounded number of descriptors meanwhile, and its logs must not grow with the attack.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import wait_for, wait_running
from test_second_user import HOLD, ONE_NODE, PYTEST, attack
from users import ATTACKER, FdWatch, UserLab, cmdline, environ, listening_ports, pids_of, stop, with_env

pytestmark = pytest.mark.users

NOFILE = 1024  # the victim's ulimit -n
FD_BOUND = 400  # descriptors a victim's process may hold while it is flooded

# A marked test that holds its ranks until the file ``release`` beside it exists (the attack
# happens meanwhile); then, in the same warm world, quick tests that need the control plane.
WAITS = """
import os, time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.msrun(worker_num=2)
def test_waits_for_the_attack(rank):
    deadline = time.monotonic() + 150
    while not os.path.exists(os.path.join(HERE, "release")):
        assert time.monotonic() < deadline, "never released"
        time.sleep(0.05)


@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", range({more}))
def test_after(msrun, rank, i):
    assert msrun.all_gather(rank) == [0, 1]
"""


def status_of(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


def plain(text: str) -> str:
    """Terminal output without its colours."""
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def settle(predicate, timeout: float) -> bool:
    """Wait until ``predicate()`` holds or ``timeout`` passed (not a failure: an attack may stall
    against a victim that stopped taking connections - what it holds is measured all the same)."""
    try:
        return bool(wait_for(predicate, timeout, 0.1))
    except AssertionError:
        return False


def release(victim_dir: Path) -> None:
    (victim_dir / "release").touch()


def ranks_env(lab: UserLab, key: str, timeout: float = 90) -> dict[str, str]:
    """The environment of one of the victim's ranks (``RANK_ID``) that has ``key`` (waits for them to start)."""
    found = wait_for(lambda: [e for _, e in with_env(lab.victim.uid, key) if "RANK_ID" in e], timeout, 0.1)
    return found[0]


def address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------- 2. the ranks' debugger
def test_a_flood_at_the_debuggers_port_costs_the_victims_session_nothing(user_lab, victim_dir):
    """The victim runs pytest on a terminal (its ranks' debugger then listens, ``MSRUN_DEBUG``);
    the attacker keeps 1,600 connections to that port open - most silent, some having sent junk
    with no end of line - and reopens each one that is closed. The victim's session passes (exit
    0, no INTERNALERROR) and its controller never holds more than a bounded number of descriptors
    (ulimit -n 1024: unbounded, it ran out of them and died with "Too many open files")."""
    victim, attacker = user_lab.victim, user_lab.attacker
    victim.write(victim_dir / "test_waits.py", WAITS.format(more=1))
    term = victim.on_terminal(
        [*PYTEST, "--msrun-timeout=240", "test_waits.py"], cwd=victim_dir, env={"COLUMNS": "200"}, nofile=NOFILE
    )
    flood = None
    watch = FdWatch([term.pid])
    try:
        debug = ranks_env(user_lab, "MSRUN_DEBUG")["MSRUN_DEBUG"]
        host, port = address(debug)
        status = attacker.home / "flood.json"
        flood = attacker.start(
            ["python", str(ATTACKER), "hold", host, str(port), "--connections", "1600", "--status", str(status)],
            cwd=attacker.home,
            nofile=8192,
        )
        # the flood is on - every connection tried at least once, many reopened - and goes on while
        # the controller serves the test and ends the session
        attempts = lambda: status_of(status).get("attempts", 0)  # noqa: E731
        settle(lambda: attempts() >= 2000 or flood.poll() is not None, 60)
        first = attempts()
        settle(lambda: attempts() >= first + 500 or flood.poll() is not None, 30)
        release(victim_dir)
        code = term.finish(timeout=150)
        stop(flood)
        flooded = status_of(status)
    finally:
        release(victim_dir)
        peak = watch.stop()
        if flood is not None:
            stop(flood)
        term.close()
    out = plain(term.text())
    assert "INTERNALERROR" not in out, tail(out)
    assert code == 0 and re.search(r"\b2 passed\b", out), f"exit {code}; the flood: {flooded}\n{tail(out)}"
    assert flooded.get("connected", 0) >= 1000, flooded  # the attack did take place
    assert peak[term.pid] <= FD_BOUND, f"the controller held {peak[term.pid]} descriptors; flood: {flooded}"


def test_without_a_terminal_the_debugger_does_not_listen(user_lab, victim_dir):
    """The victim's pytest without a terminal (stdin not a tty) serves no debugger: none of its
    processes listens at the ranks' ``MSRUN_DEBUG`` address (if they are given one at all), and
    the controller listens on nothing but its warm worlds' doors (the ports its worlds are told in
    ``MSRUN_WORLD``), looked at all through the session (no world is started ahead of its tests:
    ``--msrun-prefetch=off``)."""
    victim = user_lab.victim
    victim.write(victim_dir / "test_waits.py", WAITS.format(more=1))
    session = victim.start(
        [*PYTEST, "-q", "--msrun-timeout=240", "--msrun-prefetch=off", "test_waits.py"], cwd=victim_dir, nofile=NOFILE
    )
    seen = Seen(victim.uid, session.pid)
    try:
        ranks_env(user_lab, "MSRUN_WORLD")
        wait_for(lambda: seen.looks > 10, 30)  # a few looks at the running test
        release(victim_dir)
        out, err = session.communicate(timeout=150)
    finally:
        release(victim_dir)
        seen.stop()
        stop(session)
    assert session.returncode == 0, tail(out + err)
    served = {port: who for port, who in seen.listening.items() if port in seen.debug}
    assert not served, f"the debugger listens without a terminal: {served}"
    other = {port: who for port, who in seen.controller.items() if port not in seen.doors}
    assert not other, f"the controller listens besides its worlds' doors ({sorted(seen.doors)}): {other}"


class Seen:
    """What the victim's processes listen on and what its jobs are told, looked at on a thread
    until :meth:`stop`: ports the controller listened on, ports any process of the victim's listened
    on (with who), the worlds' doors and the debugger's address in the jobs' environments."""

    def __init__(self, uid: int, controller: int) -> None:
        import threading

        self.uid, self.pid = uid, controller
        self.controller: dict[int, str] = {}
        self.listening: dict[int, str] = {}
        self.doors: set[int] = set()
        self.debug: set[int] = set()
        self.looks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in pids_of(self.uid):
                ports = listening_ports(pid)
                if ports:
                    who = f"pid {pid}: {' '.join(cmdline(pid))[:160]}"
                    self.listening.update(dict.fromkeys(ports, who))
                    if pid == self.pid:
                        self.controller.update(dict.fromkeys(ports, who))
                env = environ(pid)
                if env.get("MSRUN_WORLD"):  # a world's msrun or rank
                    self.doors.add(address(env["MSRUN_WORLD"])[1])
                if env.get("MSRUN_DEBUG"):
                    self.debug.add(address(env["MSRUN_DEBUG"])[1])
            self.looks += 1
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# ---------------------------------------------------------------- 4. the control plane's log
def test_refused_connections_by_the_thousand_leave_the_scheduler_log_small(user_lab, victim_dir):
    """5,000 refused connections to a running job's scheduler port - garbage, hellos with a wrong
    token's proof, and hellos whose nonce is a lone surrogate (``"\\ud800"``: valid JSON text) - are
    summed up in ``scheduler.log`` (per peer and per minute), not logged one by one: it grows by less
    than 64 KiB, with no traceback, and the job ends with exit 0."""
    victim = user_lab.victim
    victim.write(victim_dir / "task.py", HOLD)
    job = victim.start(
        [*ONE_NODE, "--log_dir=logs", "task.py"],
        cwd=victim_dir,
        env={"RELEASE_FILE": str(victim_dir / "release")},
        nofile=NOFILE,
    )
    log = victim_dir / "logs" / "scheduler.log"
    try:
        wait_running(victim_dir / "logs", 2)
        port = int(ranks_env(user_lab, "MS_SCHED_PORT")["MS_SCHED_PORT"])
        wait_for(lambda: all("ready" in (victim_dir / "logs" / f"worker_{r}.log").read_text() for r in (0, 1)), 60)
        before = log.stat().st_size
        spammed = attack(
            user_lab,
            "spam",
            "127.0.0.1",
            str(port),
            "--count",
            "5000",
            "--kinds",
            "garbage,wrong_token,surrogate",
            "--concurrency",
            "64",
            timeout=240,
            nofile=8192,
        )
        grown = log.stat().st_size - before
        release(victim_dir)
        out, err = job.communicate(timeout=120)
    finally:
        release(victim_dir)
        stop(job)
    text = log.read_text(errors="replace")
    assert spammed["connected"] >= 4500, spammed
    assert job.returncode == 0, tail(err)
    assert "Traceback" not in text, "\n".join(text[text.index("Traceback") :].splitlines()[:12])
    assert grown < 64 * 1024, (
        f"scheduler.log grew by {grown} bytes for {spammed['connected']} connections:\n{tail(text, 5)}"
    )
    for r in (0, 1):
        assert "finished" in (victim_dir / "logs" / f"worker_{r}.log").read_text()


# ---------------------------------------------------------------- 7. every listener, fuzzed
def test_fuzzed_strangers_at_every_listener_cost_a_warm_session_nothing(user_lab, victim_dir):
    """While the victim's session runs warm worlds (several tests in one world), the attacker
    finds every TCP port the victim listens on (/proc/net/tcp names each socket's owner) - a warm
    world's door, its control plane, anything else - and holds 600 silent connections to each
    while hypothesis-generated streams (tests/test_hostile_input.py's strategies: frames and lines,
    nesting, sizes, encodings, lying lengths, fragments, hostile hellos, orderings) go to each in
    turn. Every test passes (exit 0) and no process of the victim's holds more than a bounded
    number of descriptors."""
    victim, attacker = user_lab.victim, user_lab.attacker
    victim.write(victim_dir / "test_waits.py", WAITS.format(more=4))
    session = victim.start(
        [*PYTEST, "-q", "--msrun-worlds=warm", "--msrun-timeout=240", "test_waits.py"], cwd=victim_dir, nofile=NOFILE
    )
    watch = FdWatch([session.pid])
    fuzz = None
    try:
        ranks_env(user_lab, "MSRUN_WORLD")
        wait_for(lambda: len([e for _, e in with_env(victim.uid, "MSRUN_WORLD") if "RANK_ID" in e]) >= 2, 60)
        names = {pid: " ".join(cmdline(pid))[:120] for pid in pids_of(victim.uid)}
        for pid in names:
            watch.add(pid)

        def targets() -> set[int] | None:  # what the attacker sees listening, once the world's control plane is
            ports = {s["port"] for s in attack(user_lab, "listening", str(victim.uid))}
            ranks = [e for _, e in with_env(victim.uid, "MS_SCHED_PORT") if "RANK_ID" in e]
            return ports if {int(e["MS_SCHED_PORT"]) for e in ranks} & ports else None

        ports = wait_for(targets, 60, 0.5)
        status = attacker.home / "fuzz.json"
        fuzz = attacker.start(
            ["python", str(ATTACKER), "fuzz", "--examples", "300", "--silent", "600", "--status", str(status)]
            + [f"127.0.0.1:{p}" for p in sorted(ports)],
            cwd=attacker.home,
            nofile=8192,
        )
        settle(lambda: status_of(status).get("examples", 0) >= 150 or fuzz.poll() is not None, 120)
        release(victim_dir)  # the other tests run while the attack goes on
        try:
            fuzz_out, fuzz_err = fuzz.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            stop(fuzz)
            fuzz_out, fuzz_err = fuzz.communicate()
        out, err = session.communicate(timeout=180)
    finally:
        release(victim_dir)
        peak = watch.stop()
        if fuzz is not None:
            stop(fuzz)
        stop(session)
    fuzzed = status_of(status)
    print(f"attacked ports {sorted(ports)}: {fuzzed}; descriptors at most: {peak}")
    assert fuzz.returncode == 0 and fuzzed.get("examples", 0) >= 300, f"the attack itself failed:\n{fuzz_err[-3000:]}"
    assert "INTERNALERROR" not in out + err, tail(out + err)
    assert session.returncode == 0 and re.search(r"\b5 passed\b", plain(out)), f"{fuzzed}\n{tail(out + err)}"
    heavy = {f"{pid} ({names.get(pid, 'the controller')})": n for pid, n in peak.items() if n > FD_BOUND}
    assert not heavy, f"descriptors held while flooded (bound {FD_BOUND}): {heavy}; attack: {fuzzed}"
