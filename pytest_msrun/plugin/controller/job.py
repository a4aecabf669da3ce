"""One marked test's job: the msrun invocations, the timeout, every rank's end and stacks.

The controller drives the engine through its command line - the same msrun a user would type,
which is also the command printed to reproduce a failure. A job of several nodes runs as several
msrun invocations on this host (loopback), or - inside a Slurm allocation - as one ``srun`` step
of its own with an msrun on each node Slurm picks where the step's CPUs are free (they take the
node rank and master address from the step). Each invocation runs in its own
session with a parent-death signal, so however the controller ends (Ctrl+C, SIGTERM, SIGHUP,
``kill -9``) msrun tears its job down. A timeout first asks the control plane who is where and
every rank for its Python stacks (SIGUSR1 -> faulthandler), then stops msrun, whose teardown
leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_msrun.binding.flags import parse_bind_value
from pytest_msrun.control.observer import query_state
from pytest_msrun.engine import holdings
from pytest_msrun.engine.argv import flags_of
from pytest_msrun.engine.config import TRACE_ENV, LaunchConfig
from pytest_msrun.engine.plan import job_ranks, sim_record_for
from pytest_msrun.engine.processes import term_grace
from pytest_msrun.engine.slurm import Allocation
from pytest_msrun.engine.status import STATUS_FILE, JobStatus, node_status_file, read_status
from pytest_msrun.engine.summary import log_text
from pytest_msrun.fileio import private_dir
from pytest_msrun.plugin.controller.debugserver import DebugServer, paused_clock
from pytest_msrun.plugin.controller.forkserver import SESSION_VARS, ForkServer
from pytest_msrun.plugin.controller.msrunproc import Process, start_msrun
from pytest_msrun.plugin.marker import MsrunSpec
from pytest_msrun.plugin.rule import records
from pytest_msrun.plugin.rule.outcomes import RankEnd
from pytest_msrun.plugin.rule.records import BASETEMP_ENV, REPORT_DIR_ENV, SHARED_TMP_ENV, records_path, stacks_path
from pytest_msrun.plugin.rule.testrecord import JobRun
from pytest_msrun.proc import STOPPED_WORDS, running, stopped
from pytest_msrun.record import replace
from pytest_msrun.waiting import wait_until

STACK_WAIT = 2.0
CLI = "pmsrun"  # how a user types this project's msrun


@dataclass
class TestPaths:
    """One marked test's directories: its ranks' records and shared files, and its job's logs."""

    __test__ = False  # not a pytest test class

    job_dir: Path
    log_dir: Path  # msrun's logs (a warm world's: the world job's)

    @property
    def report_dir(self) -> Path:
        return self.job_dir / "reports"

    @property
    def shared_dir(self) -> Path:
        return self.job_dir / "shared"

    @property
    def basetemp(self) -> Path:
        return self.job_dir / "basetemp"

    def make(self) -> None:
        """Each directory made new, this user's alone - or checked, when there (a world's logs)."""
        for d in (self.log_dir, self.report_dir, self.shared_dir, self.basetemp):
            private_dir(str(d))


@dataclass
class Launched:
    """A job's running msrun invocations: processes, their console logs, output pumps."""

    procs: list[Process] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)
    relayed: dict[int, int] | None = None  # with -s: each rank's bytes of log its msrun has shown (msrunproc)

    def exited(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def ended(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def wait_ended(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every process to end (woken by their ends, not by a poll
        interval); whether they all did."""
        deadline = time.monotonic() + seconds
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return self.ended()


def has_control_plane(spec: MsrunSpec) -> bool:
    """Whether ``spec``'s job has msrun's control plane - and so may run in a world, warm or forking
    (dry runs and ``scheduler='task'`` jobs are fresh jobs)."""
    return spec.sim_level is None and spec.scheduler != "task"


RANK_CLOCK = 86400  # seconds: the job's --cluster_time_out, far beyond any test's timeout


class TestJob:
    """Builds and runs the msrun invocations for one test."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        *,
        nodeid: str,
        spec: MsrunSpec,
        job_dir: Path,
        ports: list[int],
        rank_args: list[str],
        extra_env: dict[str, str],
        live_output: bool,
        cluster: Allocation | None = None,
        debug: DebugServer,
        forks: ForkServer | None = None,
    ) -> None:
        self.forks = forks  # the session's fork server (None: msrun is spawned)
        self.debug = debug
        self.nodeids = [nodeid]  # what each rank's pytest collects (a warm world: every test it may run)
        self.spec = spec
        # the marker's binding, read once (a --bind_numa file is read and hashed)
        self.binding = (parse_bind_value(spec.bind_core, "bind_core"), parse_bind_value(spec.bind_numa, "bind_numa"))
        self.paths = TestPaths(job_dir, job_dir / "logs")
        self.ports = ports
        self.rank_args = rank_args
        self.extra_env = extra_env
        self.trace = extra_env.get(TRACE_ENV, "")  # the trace file its msrun writes ("": not traced)
        self.live_output = live_output
        self.token = os.urandom(16).hex()
        sizes = spec.node_sizes()
        self.nodes = len(sizes)
        # inside an allocation every job is a step of its own, placed by Slurm; srun places the same
        # msrun on every node: equal node sizes, and enough nodes to hold them
        self.cluster = (
            cluster if cluster is not None and len(set(sizes)) == 1 and len(cluster.nodes) >= self.nodes else None
        )
        # the ranks whose results the job owes, as msrun plans its invocations
        self.expected_ranks = sorted({rank for cfg in self.configs() for rank in job_ranks(cfg)})
        self.paths.make()

    def configs(self, nodeids: list[str] | None = None) -> list[LaunchConfig]:
        """The one translation of the marker: each msrun invocation's configuration, typed as msrun
        reads it (its ranks run pytest on ``nodeids``, default the job's). The command lines - the
        one spawned and the one printed to reproduce the test - are rendered from it (:meth:`commands`)."""
        spec = self.spec
        sizes = spec.node_sizes()
        task = ["-m", "pytest", *self.rank_args, *(self.nodeids if nodeids is None else nodeids)]
        return [
            LaunchConfig(
                task_script=sys.executable,
                task_script_args=task,
                worker_num=spec.worker_num,
                local_worker_num=size,
                master_port=self.ports[0],
                dist_port=self.ports[1],
                node_rank=node if len(sizes) > 1 else -1,
                log_dir=str(self.paths.log_dir),
                join=True,
                # time is kept by the controller (re-run by hand: by ``timeout``), never raced by a
                # rank's own init() deadline, which fired with the test's and pre-empted the stacks
                cluster_time_out=RANK_CLOCK,
                bind_core=self.binding[0],
                bind_numa=self.binding[1],
                scheduler=spec.scheduler,
                sim_level=spec.sim_level if spec.sim_level is not None else -1,
                sim_rank_id=spec.sim_rank_id if spec.sim_rank_id is not None else -1,
                sim_select=spec.sim_ranks or "",
                sim_budget=spec.sim_budget,
            )
            for node, size in enumerate(sizes)
        ]

    @property
    def master_host(self) -> str:
        """Where the job's control plane listens: this host, or - a Slurm step - the step's first
        node, which Slurm picked (known from its msrun's status file once it started)."""
        if self.cluster is None:
            return "127.0.0.1"
        status = self._statuses()[0]
        return status.host if status is not None and status.host else self.cluster.nodes[0]

    def commands(self, nodeids: list[str] | None = None, *, for_user: bool = False) -> list[list[str]]:
        """The job's msrun command lines (of ``nodeids``): as started, or ``for_user`` as a person
        re-runs them - any free port on one node, and no port of this session's. Under ``srun``
        msrun takes the node rank and the master address from the step."""
        msrun = [CLI] if for_user else [sys.executable, "-m", "pytest_msrun"]
        changes: dict[str, Any] = {"node_rank": -1} if self.cluster is not None else {}
        if for_user:
            changes["dist_port"] = -1
            if self.nodes == 1:
                changes["master_port"] = 0
        configs = [replace(cfg, **changes) for cfg in self.configs(nodeids)]
        if self.cluster is not None:
            label = "" if for_user else "msrun-test"
            srun = self.cluster.srun(self.nodes, configs[0].local_worker_num, label=label, devices=self.spec.devices)
            return [[*srun, *msrun, *flags_of(configs[0])]]
        return [[*msrun, *flags_of(cfg)] for cfg in configs]

    def reproduce_lines(
        self,
        timeout: float,
        nodeids: list[str] | None = None,
        test_env: dict[str, str] | None = None,
    ) -> list[str]:
        """What a user types to run the same job (of ``nodeids``: default, the job's own, with
        ``test_env`` too) with the same time limit (``timeout`` sends SIGTERM, which msrun answers
        by tearing the job down)."""
        variables = {**self.spec.env, **(test_env or {}), **self.extra_env}
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(variables.items()))
        prefix = (env + " ") if env else ""
        limit = ["timeout", "-s", "TERM", f"{timeout:g}"]
        return [prefix + shlex.join([*limit, *cmd]) for cmd in self.commands(nodeids, for_user=True)]

    def env(self) -> dict[str, str]:
        env = {**os.environ, **self.spec.env, **self.extra_env}
        env[REPORT_DIR_ENV] = str(self.paths.report_dir)
        env[SHARED_TMP_ENV] = str(self.paths.shared_dir)
        env[BASETEMP_ENV] = str(self.paths.basetemp)
        env["MSRUN_JOB_TOKEN"] = self.token
        env.update(self.debug.env())  # never in the reproduce lines: the session's own server
        if self.cluster is None:  # every flag is given: a Slurm step this session runs in changes nothing
            env["MSRUN_SLURM"] = "0"
        for name in SESSION_VARS:
            env.pop(name, None)
        return env

    def launch(self, extra_env: dict[str, str] | None = None) -> Launched:
        """Start the job's msrun invocations (nothing waits for them)."""
        commands = self.commands()
        env = {**self.env(), **(extra_env or {})}
        out = Launched(relayed={} if self.live_output else None)
        forks = self.forks if self.cluster is None else None  # a step's msruns start on its nodes
        try:
            for node, cmd in enumerate(commands):
                log_path = str(self.paths.job_dir / (f"msrun_node{node}.log" if len(commands) > 1 else "msrun.log"))
                out.logs.append(log_path)
                popen, pump = start_msrun(cmd, env, log_path, relayed=out.relayed, forks=forks)
                out.procs.append(popen)
                if pump is not None:
                    out.pumps.append(pump)
        except BaseException:
            self.stop(out)
            raise
        return out

    def run(self, timeout: float, exit_timeout: float) -> JobRun:
        """Run the job to its end: every msrun exited, the timeout, or - once every rank's pytest
        session ended - ``exit_timeout`` seconds more without every process gone (a hang at exit)."""
        started = time.time()
        launched = self.launch()
        timed_out = False
        hung: list[int] = []
        try:
            clock = paused_clock(self.debug)  # time in the debugger does not count
            deadline = clock() + timeout
            # the ranks whose records do not yet end with ``finish`` (their pytest session), looked at every 0.25 s
            unfinished = [records_path(str(self.paths.report_dir), rank) for rank in self.expected_ranks]
            look = 0.0
            exit_deadline: float | None = None
            while True:
                alive = [p for p in launched.procs if p.poll() is None]  # one look: a process may end any time
                if not alive:
                    break
                now = clock()
                if now >= deadline:
                    timed_out = True
                    break
                if exit_deadline is None and time.monotonic() >= look:
                    look = time.monotonic() + 0.25
                    unfinished = [path for path in unfinished if not _ends_with_finish(path)]
                    exit_deadline = None if unfinished else now + exit_timeout
                if exit_deadline is not None and now >= exit_deadline:
                    hung = self.running_ranks()
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    alive[0].wait(timeout=min(0.1, max(0.0, deadline - now)))
        except BaseException:  # Ctrl+C or pytest.exit while waiting: leave nothing running
            self.stop(launched)
            raise
        facts = self.at_deadline(str(self.paths.report_dir), self.expected_ranks) if timed_out else {}
        if hung:
            facts = {"stacks": self.collect_stacks()}
        self.stop(launched)  # (every msrun ended: its output pumps joined)
        facts.update(timed_out=timed_out, exit_hung=hung, exit_timeout=exit_timeout, ranks=self.rank_ends())
        run = self.outcome(launched, timeout, started, self.reproduce_lines(timeout), **facts)
        if not timed_out and not hung:
            return dataclasses.replace(run, launch_error=self.launch_error(run.exit_codes, launched.logs))
        if timed_out and not self.started():
            return dataclasses.replace(run, launch_error=self.no_room(timeout, launched.logs))
        return run

    def outcome(self, launched: Launched, timeout: float, started: float, reproduce: list[str], **facts: Any) -> JobRun:
        """The run of a test started at ``started`` in ``launched``, as far as it went (``facts``:
        the rest of its :class:`JobRun`)."""
        return JobRun(
            reproduce_lines=reproduce,
            exit_codes=[p.returncode for p in launched.procs],
            timeout=timeout,
            started=started,
            ended=time.time(),
            msrun_logs=list(launched.logs),
            stacks_dir=str(self.paths.report_dir),
            holdings=self.holdings(),
            **facts,
        )

    def holdings(self) -> tuple[str, ...]:
        """A dry run's ranks side by side: what each holds (those that said, ``pytest_msrun.dryrun``)."""
        spec = self.spec
        if spec.sim_level is None:
            return ()
        logs = {r: f"worker_{0 if spec.sim_rank_id is not None else r}.log" for r in self.expected_ranks}
        held = [holdings.compact(sim_record_for(str(self.paths.log_dir / log)), r) for r, log in logs.items()]
        budget = self.configs()[0].budget
        return tuple(holdings.table([h for h in held if h is not None], spec.worker_num, budget))

    def started(self) -> bool:
        """Whether any msrun of the job started (wrote its status file)."""
        return any(status is not None for status in self._statuses())

    def no_room(self, timeout: float, logs: list[str]) -> str:
        """Why a Slurm step of this job never started within ``timeout`` s: srun waited all along
        for room in the allocation ("" outside an allocation)."""
        if self.cluster is None:
            return ""
        said = ""
        for path in logs:
            said = next((line.strip() for line in _read(path).splitlines() if "step creation" in line), said)
        cpus = self.cluster.cpus_for(self.spec.node_sizes()[0])
        return (
            f"no room in Slurm allocation {self.cluster.job_id} within the test's timeout ({timeout:g} s): its "
            f"step needs {self.nodes} node(s) with {cpus} free CPU(s) each, and other steps held them"
            + (f" (srun: {said.removeprefix('srun: ')})" if said else "")
        )

    def launch_error(self, exit_codes: list[int | None], logs: list[str]) -> str:
        """msrun's console output when it could not start the job - judged from its status files
        (none written, or one saying so), never from an exit status a rank may share."""
        if all(code == 0 for code in exit_codes) or all(s is not None and s.state != "error" for s in self._statuses()):
            return ""
        return "\n".join(Path(p).read_text(errors="replace") for p in logs).strip()

    # ---------------------------------------------------------------- helpers
    def _statuses(self) -> list[JobStatus | None]:
        """msrun's status file(s), one per node (None: not written)."""
        names = [STATUS_FILE] if self.nodes == 1 else [node_status_file(i) for i in range(self.nodes)]
        return [read_status(str(self.paths.log_dir), name) for name in names]

    def rank_ends(self) -> dict[int, RankEnd]:
        """How each rank's process ended, from msrun's status file(s)."""
        return {
            proc.rank: RankEnd.of(proc, status.stop_reason, status.host)
            for status in self._statuses()
            if status is not None
            for proc in status.workers
            if proc.rank is not None
        }

    def at_deadline(self, report_dir: str, ranks: list[int]) -> dict[str, Any]:
        """Where every rank is at a test's deadline, as facts of its :class:`JobRun`: the ranks still
        running, then where each rank's record file in ``report_dir`` stands (in this order, a rank
        that reports and ends between the two looks counts as running - never as having ended
        without the report it wrote), the control plane's view, every rank's stacks."""
        running = self.running_ranks()
        cutoff = records.sizes(report_dir, ranks)
        state = query_state(self.master_host, self.ports[0], self.token) if has_control_plane(self.spec) else None
        return {"running": running, "cutoff": cutoff, "state": state, "stacks": self.collect_stacks()}

    def running_ranks(self) -> list[int]:
        """The ranks whose processes still run (msrun's status file is written at the job's start and
        end only: a rank on this host is looked up by its PID, one elsewhere counts as running)."""
        return [
            rank
            for rank, end in sorted(self.rank_ends().items())
            if end.returncode is None and (end.elsewhere or (end.pid and running(end.pid)))
        ]

    def collect_stacks(self) -> dict[int, str]:
        """Ask every live rank on this host for its Python stacks and wait briefly for them
        (a rank's PID means nothing on another host)."""
        asked = []
        stacks: dict[int, str] = {}
        for rank, end in self.rank_ends().items():
            if not end.pid or end.returncode is not None or end.elsewhere:
                continue  # ended, or on another host
            if stopped(end.pid, or_its_child=True):
                stacks[rank] = f"msrun: {STOPPED_WORDS}\n"  # it cannot answer: why it has no stack
            elif _catches(end.pid, signal.SIGUSR1):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(end.pid, signal.SIGUSR1)
                    asked.append(rank)

        def dump(rank: int) -> str:
            return _read(stacks_path(str(self.paths.report_dir), rank))

        if wait_until(lambda: all(dump(rank).strip() for rank in asked), STACK_WAIT, 0.05):
            time.sleep(0.05)  # let the last writer finish its dump
        return {**stacks, **{rank: text for rank in asked if (text := dump(rank)).strip()}}

    def stop(self, launched: Launched) -> None:
        """Tear a launched job down: msrun's own teardown on SIGTERM, SIGKILL of its session after
        msrun's grace."""
        for popen in launched.procs:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + term_grace() + 5  # msrun's own grace, then its teardown
        for popen in launched.procs:
            try:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
        for pump in launched.pumps:
            pump.join(timeout=5)


def _ends_with_finish(path: str) -> bool:
    tail = log_text(path, 4096).splitlines()
    return bool(tail) and '"kind": "finish"' in tail[-1]


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` handles ``sig`` now (``SigCgt`` in its status): a rank still starting
    up has not registered its stack dump yet, and SIGUSR1's default action would kill it."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False
