"""One marked test's job: the msrun invocations, the timeout, every rank's status and stacks.

The controller drives the engine through its command line - the same ``msrun`` a user would
type, which is also the command printed to reproduce a failure. Each invocation runs in its
own session; a timeout first asks every rank for its Python stacks (SIGUSR1 -> faulthandler),
then stops msrun, whose teardown leaves nothing behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pytest_msrun.plugin.marker import MsrunSpec
from pytest_msrun.plugin.records import BASETEMP_ENV, REPORT_DIR_ENV, SHARED_TMP_ENV, stacks_path
from pytest_msrun.simselect import select_ranks
from pytest_msrun.status import STATUS_FILE, node_status_file, read_status

STACK_WAIT = 2.0


@dataclass
class RankStatus:
    """What msrun's status file says about one rank's process."""

    rank: int
    pid: int | None = None
    returncode: int | None = None
    ended: float | None = None
    log: str = ""
    terminated_by_msrun: bool = False


@dataclass
class JobRun:
    """The outcome of a test's job, before merging reports."""

    commands: list[list[str]]
    exit_codes: list[int | None]
    timed_out: bool
    timeout: float
    started: float
    ended: float
    ranks: dict[int, RankStatus] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    msrun_logs: list[str] = field(default_factory=list)
    launch_error: str = ""

    def reproduce(self, cwd: str) -> str:
        lines = [f"cd {shlex.quote(cwd)}"]
        lines += [shlex.join(["msrun", *cmd[3:]]) + (" &" if len(self.commands) > 1 else "") for cmd in self.commands]
        if len(self.commands) > 1:
            lines.append("wait")
        return "\n".join(lines)


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
    ) -> None:
        self.nodeid = nodeid
        self.spec = spec
        self.job_dir = job_dir
        self.log_dir = job_dir / "logs"
        self.report_dir = job_dir / "reports"
        self.shared_dir = job_dir / "shared"
        self.ports = ports
        self.rank_args = rank_args
        self.extra_env = extra_env
        self.live_output = live_output
        self.basetemp = job_dir / "basetemp"
        for d in (self.log_dir, self.report_dir, self.shared_dir, self.basetemp):
            d.mkdir(parents=True, exist_ok=True)

    def expected_ranks(self) -> list[int]:
        spec = self.spec
        if spec.sim_level is not None and spec.sim_rank_id is not None:
            return [spec.sim_rank_id]
        if spec.sim_level is not None:
            return select_ranks(spec.sim_ranks, range(spec.worker_num))
        return list(range(spec.worker_num))

    def commands(self, cluster_time_out: int) -> list[list[str]]:
        spec = self.spec
        sizes = spec.node_sizes()
        out = []
        for node, size in enumerate(sizes):
            cmd = [
                sys.executable,
                "-m",
                "pytest_msrun",
                f"--worker_num={spec.worker_num}",
                f"--local_worker_num={size}",
                f"--master_port={self.ports[0]}",
                f"--dist_port={self.ports[1]}",
                "--join=True",
                f"--log_dir={self.log_dir}",
                f"--cluster_time_out={cluster_time_out}",
                f"--scheduler={spec.scheduler}",
            ]
            if len(sizes) > 1:
                cmd.append(f"--node_rank={node}")
            if spec.bind_core != "False":
                cmd.append(f"--bind_core={spec.bind_core}")
            if spec.bind_numa != "False":
                cmd.append(f"--bind_numa={spec.bind_numa}")
            if spec.sim_level is not None:
                cmd.append(f"--sim_level={spec.sim_level}")
            if spec.sim_rank_id is not None:
                cmd.append(f"--sim_rank_id={spec.sim_rank_id}")
            if spec.sim_ranks:
                cmd.append(f"--sim_select={spec.sim_ranks}")
            cmd += [sys.executable, "-m", "pytest", *self.rank_args, self.nodeid]
            out.append(cmd)
        return out

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.spec.env)
        env.update(self.extra_env)
        env[REPORT_DIR_ENV] = str(self.report_dir)
        env[SHARED_TMP_ENV] = str(self.shared_dir)
        env[BASETEMP_ENV] = str(self.basetemp)
        env["MSRUN_JOB_TOKEN"] = os.urandom(16).hex()
        env.pop("PYTEST_ADDOPTS", None)
        for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST"):
            env.pop(name, None)
        return env

    def run(self, timeout: float) -> JobRun:
        cluster_time_out = max(1, min(600, int(timeout)))
        commands = self.commands(cluster_time_out)
        env = self.env()
        started = time.time()
        procs: list[subprocess.Popen] = []
        logs: list[str] = []
        pumps: list[threading.Thread] = []
        for node, cmd in enumerate(commands):
            log_path = str(self.job_dir / (f"msrun_node{node}.log" if len(commands) > 1 else "msrun.log"))
            logs.append(log_path)
            log_fh = open(log_path, "wb")  # noqa: SIM115 - handed to the child, closed below
            try:
                if self.live_output:
                    popen = subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=log_fh,
                        start_new_session=True,
                        stdin=subprocess.DEVNULL,
                    )
                    pump = threading.Thread(target=_pump_rank_lines, args=(popen.stdout, log_fh), daemon=True)
                    pump.start()
                    pumps.append(pump)
                else:
                    popen = subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=log_fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        stdin=subprocess.DEVNULL,
                    )
            finally:
                if not self.live_output:
                    log_fh.close()
            procs.append(popen)
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            for popen in procs:
                try:
                    popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        except BaseException:  # Ctrl+C or pytest.exit while waiting: leave nothing running
            self._stop(procs)
            raise
        stacks: dict[int, str] = {}
        if timed_out:
            stacks = self._collect_stacks(len(commands))
            self._stop(procs)
        for pump in pumps:
            pump.join(timeout=5)
        run = JobRun(
            commands=commands,
            exit_codes=[p.returncode for p in procs],
            timed_out=timed_out,
            timeout=timeout,
            started=started,
            ended=time.time(),
            stacks=stacks,
            msrun_logs=logs,
        )
        run.ranks = self._rank_statuses(len(commands))
        if not timed_out and any(code == 2 for code in run.exit_codes):
            run.launch_error = "\n".join(Path(p).read_text(errors="replace") for p in logs).strip()
        return run

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _status_names(nodes: int) -> list[str]:
        return [STATUS_FILE] if nodes == 1 else [node_status_file(i) for i in range(nodes)]

    def _rank_statuses(self, nodes: int) -> dict[int, RankStatus]:
        out: dict[int, RankStatus] = {}
        for name in self._status_names(nodes):
            data = read_status(str(self.log_dir), name)
            if data is None:
                continue
            for proc in data.get("processes", []):
                if proc.get("role") != "worker" or proc.get("rank") is None:
                    continue
                rank = int(proc["rank"])
                out[rank] = RankStatus(
                    rank=rank,
                    pid=proc.get("pid"),
                    returncode=proc.get("returncode"),
                    ended=proc.get("ended"),
                    log=proc.get("log", ""),
                    terminated_by_msrun=bool(proc.get("terminated_by_msrun")),
                )
        return out

    def _collect_stacks(self, nodes: int) -> dict[int, str]:
        """Ask every live rank for its Python stacks and wait briefly for them."""
        ranks = self._rank_statuses(nodes)
        asked = []
        for status in ranks.values():
            if status.pid and status.returncode is None:
                try:
                    os.kill(status.pid, signal.SIGUSR1)
                    asked.append(status.rank)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + STACK_WAIT
        stacks: dict[int, str] = {}
        while time.monotonic() < deadline:
            for rank in asked:
                try:
                    text = Path(stacks_path(str(self.report_dir), rank)).read_text(errors="replace")
                except OSError:
                    text = ""
                if text.strip():
                    stacks[rank] = text
            if len(stacks) == len(asked):
                time.sleep(0.05)  # let the last writer finish its dump
                for rank in asked:
                    stacks[rank] = Path(stacks_path(str(self.report_dir), rank)).read_text(errors="replace")
                break
            time.sleep(0.05)
        return stacks

    def _stop(self, procs: list[subprocess.Popen]) -> None:
        """msrun's own teardown on SIGTERM; SIGKILL of its session after a grace period."""
        for popen in procs:
            if popen.poll() is None:
                try:
                    os.killpg(popen.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + float(os.environ.get("MSRUN_TERM_TIMEOUT", "5")) + 5
        for popen in procs:
            try:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(popen.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                popen.wait()


def _pump_rank_lines(stream: IO[bytes], log_fh: IO[bytes]) -> None:
    """With ``-s``: show the ranks' tailed lines live, keep msrun's whole output in its log."""
    try:
        for line in iter(stream.readline, b""):
            log_fh.write(line)
            if line.startswith(b"[rank ") or line.startswith(b"[local "):
                try:
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()
                except (OSError, ValueError, AttributeError):
                    pass
    finally:
        log_fh.close()
