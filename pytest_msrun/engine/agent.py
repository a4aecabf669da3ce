"""Run this node's share of a job: spawn, supervise, tear down, report.

Supervision rules (design §4): exits are seen the moment they happen (pidfds, or SIGCHLD
where pidfds are missing); the first failure, a signal to msrun, or an abort from the control
plane tears the whole job down along one path (SIGTERM to every process group, bounded grace,
SIGKILL, a sweep of re-parented descendants); the exit status is the first failed process's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import signal
import socket
import subprocess
import time
from array import array
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from pytest_msrun.control import wire
from pytest_msrun.engine import console, procs
from pytest_msrun.engine.config import CONTROL_PLANE_MODES, LaunchConfig
from pytest_msrun.engine.containment import JobGuard
from pytest_msrun.engine.plan import LaunchPlan, NodeFacts, ProcessSpec, RankAssignment, build_plan, effective_dist_port
from pytest_msrun.engine.status import STATUS_FILE, JobStatus, ProcessStatus, node_status_file, write_status
from pytest_msrun.engine.summary import Failure, failure_of, render
from pytest_msrun.engine.tail import LogTailer, prefix_for
from pytest_msrun.netaddr import format_hostport, free_port, listen_socket, port_is_free

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_LAUNCH_ERROR = 1
EXIT_USAGE = 2
DONE_ACK_WAIT = 5.0  # how long a finished node waits for the control plane to record it


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class LaunchError(Exception):
    """The job cannot start; nothing was left running."""

    def __init__(self, message: str, exit_code: int = EXIT_LAUNCH_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Prepared:
    """Ports and the scheduler's listening socket, settled before the plan is built."""

    facts: NodeFacts
    hosts_scheduler: bool
    listener: socket.socket | None = None


def prepare(cfg: LaunchConfig, facts: NodeFacts) -> Prepared:
    """Resolve ports (``0`` = free) and claim the scheduler port on the master node.

    With the builtin scheduler the port is bound here and handed to the scheduler process, so
    agents can register at once and a busy port is reported before anything starts. Another
    agent of a multi-node job on this host may already hold it: this node then joins as a
    worker-only node.
    """
    hosts = facts.address_is_local and not cfg.dry_run
    port, dist = facts.master_port, facts.dist_port
    listener: socket.socket | None = None
    if hosts and facts.scheduler_mode in CONTROL_PLANE_MODES:
        try:
            listener = listen_socket(facts.master_ip, port)
            port = int(listener.getsockname()[1])
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise LaunchError(
                    f"--master_addr/--master_port: cannot listen on {format_hostport(facts.master_ip, port)}: {exc}",
                    EXIT_USAGE,
                ) from None
            if not cfg.multi_node:
                raise LaunchError(
                    f"--master_port: {format_hostport(facts.master_ip, port)} is already in use (another job?); "
                    "choose a free port or use --master_port=0 to pick one",
                    EXIT_USAGE,
                ) from None
            hosts = False
            console.info(f"{format_hostport(facts.master_ip, port)} is taken on this host: joining as a worker node.")
    elif hosts:
        if port == 0:
            port = free_port(facts.master_ip)
        elif not port_is_free(facts.master_ip, port):
            raise LaunchError(
                f"--master_port: {format_hostport(facts.master_ip, port)} is already in use; choose a free port "
                "or use --master_port=0",
                EXIT_USAGE,
            )
    dist = effective_dist_port(facts.master_port and port, dist)
    if hosts and not cfg.multi_node and (dist == 0 or not port_is_free(facts.master_ip, dist)):
        dist = free_port(facts.master_ip, avoid=(port,))
    return Prepared(replace(facts, master_port=port, dist_port=dist), hosts, listener)


@dataclass
class JobResult:
    exit_code: int
    state: str  # succeeded | failed | terminated | error
    failures: list[Failure] = field(default_factory=list)


class Agent:
    """Runs one node's processes for one job."""

    def __init__(
        self,
        cfg: LaunchConfig,
        facts: NodeFacts,
        *,
        detached: bool = False,
        on_console_done: Callable[[int], None] | None = None,
        guard: JobGuard | None = None,
    ) -> None:
        self.cfg = cfg
        self.facts = facts
        # The watchdog and the job's cgroup: nothing the job starts outlives it (see containment).
        self.guard = guard if guard is not None else JobGuard(facts.job_id, dict(os.environ))
        self.detached = detached
        self.on_console_done = on_console_done
        self.sel = selectors.DefaultSelector()
        self.children: list[procs.Child] = []
        self.watchdog = self.guard.watchdog
        self.plan: LaunchPlan | None = None
        self.link: wire.Channel | None = None
        self.link_last_seen = time.monotonic()
        self.link_next_hb = 0.0
        self.assignment: RankAssignment | None = None
        self.failures: list[Failure] = []
        self.remote_code: int | None = None
        self.signal_received: int | None = None
        self.tailer: LogTailer | None = None
        self.sent_done = False
        self.done_sent_at = 0.0
        self.done_acked = False
        self.sent_failed = False
        self._wake_r = self._wake_w = -1
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1
        self.use_pidfd = True
        self.term_grace = _env_float("MSRUN_TERM_TIMEOUT", 5.0)
        self.node_timeout = _env_float("MS_NODE_TIMEOUT", 30.0)
        self.hb_interval = max(0.05, min(1.0, self.node_timeout / 3 if self.node_timeout > 0 else 1.0))
        self.status_name: str | None = STATUS_FILE
        if cfg.multi_node:
            # Nodes may share a log directory: one status file per node, named once known.
            self.status_name = node_status_file(cfg.node_rank) if cfg.node_rank >= 0 else None
        self.started = time.time()
        self.stop_reason = ""  # why msrun tore the job down (empty: it ended by itself)
        self.pending_notes: list[dict[str, Any]] = []  # for the control plane once this node is signalled

    # ------------------------------------------------------------------ signals
    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (*HANDLED_SIGNALS, signal.SIGCHLD):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "signal")

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum != signal.SIGCHLD and self.signal_received is None:
            self.signal_received = signum

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._old_wakeup)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------------ events
    def _drain_wakeup(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 512):
                pass

    def _poll_events(self, timeout: float | None) -> list[tuple[str, Any]]:
        """Wait for something to happen; return ``(kind, payload)`` events."""
        events: list[tuple[str, Any]] = []
        for key, _ in self.sel.select(timeout):
            if key.data == "signal":
                self._drain_wakeup()
                if not self.use_pidfd:
                    events.extend(("exit", c) for c in self.children if c.alive and c.reap())
            elif key.data == "link":
                self._read_link(events)
            elif isinstance(key.data, procs.Child):
                child = key.data
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(child.pidfd)
                if child.reap():
                    events.append(("exit", child))
        if self.signal_received is not None:
            events.append(("signal", self.signal_received))
        # Messages first: an abort that the scheduler sent before exiting explains that exit.
        events.sort(key=lambda e: e[0] != "link")
        return events

    def _read_link(self, events: list[tuple[str, Any]]) -> None:
        assert self.link is not None
        try:
            msgs = self.link.poll()
        except (wire.PeerClosed, OSError, wire.ProtocolError) as exc:
            self._close_link()
            events.append(("link_closed", str(exc)))
            return
        self.link_last_seen = time.monotonic()
        events.extend(("link", m) for m in msgs)

    def _close_link(self) -> None:
        if self.link is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(self.link.sock)
            self.link.close()
            self.link = None

    def _link_send(self, msg: dict[str, Any]) -> None:
        if self.link is None:
            return
        try:
            self.link.send(msg)
        except OSError:
            self._close_link()

    def _heartbeat(self) -> str | None:
        """Send a heartbeat when due; return a reason if the scheduler went silent."""
        if self.link is None:
            return None
        now = time.monotonic()
        if now >= self.link_next_hb:
            self.link_next_hb = now + self.hb_interval
            self._link_send({"t": "hb"})
        if self.node_timeout > 0 and now - self.link_last_seen > self.node_timeout:
            return f"no heartbeat from the scheduler for {self.node_timeout:g} s"
        return None

    # ------------------------------------------------------------------ spawning
    def _spawn(self, spec: ProcessSpec, pass_fds: tuple[int, ...] = ()) -> procs.Child:
        self.guard.ready()  # every process starts inside the job's cgroup
        if spec.role == "scheduler":
            console.out(console.start_scheduler_line(spec.log_path, spec.command))
            stdin: Any = subprocess.DEVNULL
        else:
            console.out(console.start_worker_line(spec.rank, spec.log_path, spec.command))
            stdin = subprocess.DEVNULL if self.detached else None
        child = procs.spawn(spec, stdin=stdin, pass_fds=pass_fds)
        self.watchdog.guard(child.pid)
        self.children.append(child)
        if child.pidfd is not None:
            self.sel.register(child.pidfd, selectors.EVENT_READ, child)
        else:
            self.use_pidfd = False
            child.reap()  # it may have exited before SIGCHLD could be watched for
        return child

    def _make_log_dir(self) -> None:
        log_dir = self.cfg.log_dir
        if log_dir and not os.path.isdir(log_dir):
            old = os.umask(0o077)
            try:
                os.makedirs(log_dir, mode=0o700, exist_ok=True)
            finally:
                os.umask(old)

    def _register(self, plan: LaunchPlan, deadline: float) -> str | None:
        """Connect to the builtin scheduler and register this node; return an error or None."""
        host, port = self.facts.master_ip, self.facts.master_port
        hello = {
            "t": "hello",
            "kind": "agent",
            "node_rank": self.cfg.node_rank if self.cfg.multi_node else 0,
            "local": plan.local_worker_num,
            "host": self.facts.hostname,
            "ip": self.facts.source_ip,
            "pid": os.getpid(),
            "hosts_scheduler": plan.hosts_scheduler,
        }
        last = ""
        while True:
            try:
                wait = max(0.2, min(5.0, deadline - time.monotonic()))
                self.link = wire.Channel.connect(host, port, timeout=wait)
                self.link.handshake(hello, self.facts.job_token, wait)
                break
            except wire.AuthError as exc:
                self._close_link()
                return f"the scheduler at {format_hostport(host, port)} refused this node: {exc}"
            except (OSError, wire.ProtocolError) as exc:
                self._close_link()
                last = str(exc)
            if time.monotonic() >= deadline:
                return (
                    f"cannot reach the scheduler at {format_hostport(host, port)} within --cluster_time_out="
                    f"{self.cfg.cluster_time_out}: {last}"
                )
            for kind, payload in self._poll_events(0.2):
                if kind == "signal":
                    return f"interrupted by {signal.Signals(payload).name} while waiting for the scheduler"
                if kind == "exit":
                    how = procs.describe_returncode(payload.returncode)
                    return f"the scheduler process {how} before this node registered"
        self.link_last_seen = time.monotonic()
        self.sel.register(self.link.sock, selectors.EVENT_READ, "link")
        return None

    def _await_assignment(self) -> str | None:
        """Wait for the control plane to hand this node its ranks; return an error or None."""
        while self.assignment is None:
            silent = self._heartbeat()
            if silent:
                return silent
            for kind, payload in self._poll_events(self.hb_interval):
                if kind == "signal":
                    return f"interrupted by {signal.Signals(payload).name} while waiting for the other nodes"
                if kind == "exit":
                    return f"the scheduler process {procs.describe_returncode(payload.returncode)}"
                if kind == "link_closed":
                    return f"the scheduler closed the connection ({payload})"
                if kind == "link":
                    err = self._on_link_message(payload)
                    if err:
                        return err
        return None

    def _on_link_message(self, msg: dict[str, Any]) -> str | None:
        kind = msg.get("t")
        if kind == "assign":
            offset, index, count = msg.get("offset"), msg.get("node_index"), msg.get("node_count")
            if not all(isinstance(v, int) for v in (offset, index, count)):
                return "the scheduler sent a malformed assignment"
            self.assignment = RankAssignment(offset, index, count)
            job_id = msg.get("job_id")
            if isinstance(job_id, str) and job_id:
                self.facts = replace(self.facts, job_id=job_id[:64])
                self.watchdog.job(self.facts.job_id)  # the workers will carry the job's id
            return None
        if kind == "done_ack":
            self.done_acked = True
            return None
        if kind == "refused":
            return f"the scheduler refused this node: {msg.get('reason')}"
        if kind == "timeout":
            return str(msg.get("reason"))
        if kind == "abort":
            code = msg.get("code")
            self.remote_code = code if isinstance(code, int) and code > 0 else 1
            return f"job aborted by the scheduler: {msg.get('reason')}"
        return None

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        self._install_signals()
        try:
            return self._run().exit_code
        finally:
            self._restore_signals()

    def _launch_error(self, message: str, code: int) -> JobResult:
        console.err_block(f"msrun: error: {message}")
        self._teardown(graceful=False)
        self._write_status("error", code)
        self._console_done(code)
        return JobResult(code, "error")

    def _run(self) -> JobResult:
        cfg = self.cfg
        procs.become_subreaper()
        try:
            prepared = prepare(cfg, self.facts)
        except LaunchError as exc:
            console.err_block(f"msrun: error: {exc}")
            self._console_done(exc.exit_code)
            return JobResult(exc.exit_code, "error")
        self.facts = prepared.facts
        plan = build_plan(cfg, self.facts, hosts_scheduler=prepared.hosts_scheduler)
        self.plan = plan
        for text in plan.warnings:
            console.warning(text)
        for text in plan.infos:
            console.info(text)
        self._make_log_dir()

        listener = prepared.listener
        try:
            sched = plan.scheduler
            if sched is not None:
                fds: tuple[int, ...] = ()
                if listener is not None:
                    sched.env["MSRUN_LISTEN_FD"] = str(listener.fileno())
                    fds = (listener.fileno(),)
                    os.set_inheritable(listener.fileno(), True)
                self._spawn(sched, fds)
        finally:
            if listener is not None:
                listener.close()

        if plan.scheduler_mode in CONTROL_PLANE_MODES:
            deadline = time.monotonic() + (cfg.cluster_time_out if cfg.cluster_time_out >= 0 else 10**9)
            err = self._register(plan, deadline)
            if err is None and plan.ranks_pending:
                if self.detached:
                    self._console_done(0)
                err = self._await_assignment()
            if err is not None:
                code = 128 + self.signal_received if self.signal_received else EXIT_LAUNCH_ERROR
                return self._launch_error(err, self.remote_code or code)
            if plan.ranks_pending:
                assert self.assignment is not None
                plan = build_plan(cfg, self.facts, hosts_scheduler=plan.hosts_scheduler, assignment=self.assignment)
                sched_child = self._scheduler_child()
                self.plan = plan
                if sched_child is not None:
                    sched_child.spec = plan.scheduler or sched_child.spec
            if self._several_nodes:
                self.status_name = node_status_file(self.assignment.node_index)
        if self.status_name is None:
            self.status_name = f"msrun_status_{self.facts.hostname}_{os.getpid()}.json"

        if plan.dry_run:
            return DryRun(self, plan).run()

        for spec in plan.workers:
            if self.signal_received is not None:
                break
            self._spawn(spec)
        self._write_status("running", None)
        if cfg.bind_core.enabled or cfg.bind_numa.enabled:
            self._report_bindings()
        if cfg.join and not self.detached:
            console.warning("Distributed job is spawned. Waiting all processes to exit...")
            tailed = [(prefix_for(s.rank, s.local_index), s.log_path) for s in plan.workers if s.tail]
            if tailed:
                self.tailer = LogTailer(tailed)
                self.tailer.start()
        self._console_done(0)
        return self._supervise()

    def _report_bindings(self) -> None:
        """Read back what the kernel applied to every process, warn on any mismatch, print the table."""
        from pytest_msrun.binding.verify import mismatch, past_wrappers, read_binding, report_table

        rows = []
        for child in self.children:
            spec = child.spec
            got = read_binding(child.pid) if past_wrappers(child.pid) else None
            if got is not None:
                for problem in mismatch(spec.cpus, spec.mems, got):
                    console.warning(f"Binding of {spec.label} (pid {child.pid}) {problem}.")
            rows.append((spec.label, child.pid, spec.device, spec.cpus, spec.mems, got, spec.bind_how))
        topo = self.facts.topology
        source = getattr(topo, "source", "live")
        console.out(report_table(rows, f"msrun: bindings on {self.facts.hostname} (topology: {source})"))

    def _announce_signal(self) -> int:
        """msrun's message for the signal it got; returns the exit status it implies."""
        assert self.signal_received is not None
        sig = signal.Signals(self.signal_received)
        label = "SIGINT (Ctrl+C)" if sig == signal.SIGINT else sig.name
        console.warning(f"msrun process received {label}, terminating all workers.")
        self.stop_reason = f"msrun received {sig.name}"
        return 128 + int(sig)

    def _report_failure(self) -> None:
        """msrun's closing error line, then the root-cause summary (stderr)."""
        console.error(
            f"Distributed job exited with exception. Please check logs in directory: {self.cfg.log_dir or '.'}."
        )
        terminated = [c.spec.label for c in self.children if c.terminated_by_us]
        text = render(self.failures, terminated, self.cfg.log_dir)
        if text:
            console.err_block(text)

    def _console_done(self, code: int) -> None:
        if self.on_console_done is not None:
            callback, self.on_console_done = self.on_console_done, None
            callback(code)

    # ------------------------------------------------------------------ supervision
    @property
    def _several_nodes(self) -> bool:
        """Whether the control plane put this node in a job of more than one node."""
        return self.assignment is not None and (self.assignment.node_count or 1) > 1

    def _workers(self) -> list[procs.Child]:
        return [c for c in self.children if c.spec.role == "worker"]

    def _scheduler_child(self) -> procs.Child | None:
        return next((c for c in self.children if c.spec.role == "scheduler"), None)

    def _record_failure(self, child: procs.Child) -> None:
        assert child.returncode is not None
        self.failures.append(
            failure_of(
                child.spec.label,
                child.returncode,
                child.ended or time.time(),
                child.spec.log_path,
                child.pid,
                self.facts.hostname if self._several_nodes else "",
            )
        )

    def _supervise(self) -> JobResult:
        reason = ""
        code = 0
        while True:
            workers = self._workers()
            if self.signal_received is not None:
                code, reason = self._announce_signal(), "signal"
                break
            if workers and all(c.returncode == 0 for c in workers):
                if not self.sent_done:
                    self.sent_done = True
                    self.done_sent_at = time.monotonic()
                    console.info("All workers successfully exit!")
                    self._link_send({"t": "done"})
                sched = self._scheduler_child()
                # Finishing is a handshake: this node closes its link only once the control plane
                # has recorded its "done", so it can never count as a lost node.
                acked = self.link is None or self.done_acked or time.monotonic() - self.done_sent_at > DONE_ACK_WAIT
                if (sched is None or not sched.alive) and acked:
                    break
            silent = self._heartbeat()
            if silent and not self.sent_done:
                console.error(f"Lost the scheduler: {silent}.")
                code, reason = EXIT_LAUNCH_ERROR, "lost"
                self.stop_reason = f"lost the scheduler: {silent}"
                break
            failed = False
            for kind, payload in self._poll_events(self.hb_interval if self.link is not None else None):
                if kind == "exit":
                    child: procs.Child = payload
                    rc = child.returncode
                    if child.spec.role == "worker" and child.spec.rank is not None and rc is not None:
                        # Peers blocked in init() or a collective must not wait for a rank that is gone.
                        # A failing rank is reported after this node's processes were signalled, so
                        # they are caught where they were, not woken by the news first.
                        note = {"t": "exit", "rank": child.spec.rank, "how": procs.describe_returncode(rc)}
                        if rc == 0:
                            self._link_send(note)
                        else:
                            self.pending_notes.append(note)
                    if child.spec.role == "worker" and rc != 0:
                        console.error(f"Worker process {child.pid} exit with exception. Error code: {rc}.")
                        self._record_failure(child)
                        failed = True
                    elif child.spec.role == "scheduler" and rc != 0:
                        console.error(f"Scheduler process {child.pid} exit with exception.")
                        if self.remote_code is None:  # not just the end of an abort it broadcast
                            self._record_failure(child)
                        failed = True
                elif kind == "link":
                    err = self._on_link_message(payload)
                    if err and payload.get("t") == "abort":
                        console.error(err)
                        code, reason = self.remote_code or 1, "abort"
                        self.stop_reason = err
                        failed = True
                    elif err:
                        console.error(err)
                        code, reason = EXIT_LAUNCH_ERROR, "lost"
                        self.stop_reason = err
                        failed = True
                elif kind == "link_closed" and not self.sent_done:
                    sched = self._scheduler_child()
                    if sched is None:
                        console.error(f"Lost the connection to the scheduler ({payload}).")
                        code, reason = EXIT_LAUNCH_ERROR, "lost"
                        self.stop_reason = f"lost the connection to the scheduler ({payload})"
                        failed = True
            if failed:
                if self.failures:
                    first = min(self.failures, key=lambda f: f.at)
                    code, reason = first.exit_status or 1, "failure"
                    self.stop_reason = self.stop_reason or f"{first.label} {first.description}"
                    if any(f.label != "scheduler" for f in self.failures):
                        console.warning("There's worker exits with exception, kill all other workers.")
                    if not self.sent_failed:
                        self.sent_failed = True
                        self.pending_notes.append(
                            {
                                "t": "failed",
                                "reason": f"{first.label} {first.description}",
                                "code": min(255, first.exit_status or 1),
                            }
                        )
                elif code == 0:
                    code, reason = EXIT_LAUNCH_ERROR, "failure"
                break
        if reason == "" and code == 0:
            self._teardown(graceful=True)
            self._finish_console("succeeded", 0)
            self._write_status("succeeded", 0)
            self._close_link()
            return JobResult(0, "succeeded")
        self._teardown(graceful=False)
        state = "terminated" if reason == "signal" else "failed"
        self._finish_console(state, code)
        self._report_failure()
        self._write_status(state, code)
        self._close_link()
        return JobResult(code, state, self.failures)

    def _finish_console(self, state: str, code: int) -> None:
        """Drain the tails, then print what the job's registered reporters have to say."""
        if self.tailer is not None:
            self.tailer.stop()
            self.tailer = None
        if self.cfg.join and not self.detached:
            from pytest_msrun.engine.hooks import run_job_end

            for text in run_job_end(self.status(state, code)):
                console.out(text)

    # ------------------------------------------------------------------ teardown
    def _wait_children(self, deadline: float) -> None:
        while any(c.alive for c in self.children):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if self.use_pidfd:
                for key, _ in self.sel.select(min(remaining, 0.5)):
                    if isinstance(key.data, procs.Child):
                        with contextlib.suppress(KeyError, ValueError):
                            self.sel.unregister(key.data.pidfd)
                        key.data.reap()
                    elif key.data == "signal":
                        self._drain_wakeup()
                    elif key.data == "link" and self.link is not None:
                        try:
                            self.link.poll()
                        except (wire.PeerClosed, OSError, wire.ProtocolError):
                            self._close_link()
            else:
                time.sleep(min(remaining, 0.01))
                for c in self.children:
                    c.reap()

    def _teardown(self, graceful: bool) -> None:
        """Stop every process of this node's job and sweep what they left behind."""
        live = [c for c in self.children if c.alive]
        if live and not graceful:
            sched = self._scheduler_child()
            workers_first = sched is not None and sched.alive and self.sent_failed and self._several_nodes
            for child in live:
                if workers_first and child is sched:
                    continue
                child.terminated_by_us = True
                procs.signal_group(child.pid, signal.SIGTERM)
        if not graceful:
            for note in self.pending_notes:  # now the other nodes may hear of it
                self._link_send(note)
            self.pending_notes.clear()
        if live and not graceful:
            if workers_first and sched is not None:
                # Let the control plane broadcast the failure to the other nodes first.
                self._wait_children(time.monotonic() + min(self.term_grace, 2.0))
                if sched.alive:
                    sched.terminated_by_us = True
                    procs.signal_group(sched.pid, signal.SIGTERM)
            self._wait_children(time.monotonic() + self.term_grace)
            for child in self.children:
                if child.alive:
                    procs.signal_group(child.pid, signal.SIGKILL)
            self._wait_children(time.monotonic() + 10.0)
        # Leftovers: members of the children's process groups, and descendants re-parented to us.
        for child in self.children:
            procs.signal_group(child.pid, signal.SIGKILL)
        exclude = [p for p in (self.watchdog.pid,) if p]
        hit = procs.sweep_descendants(exclude=exclude)
        hit += [p for p in self.guard.kill_members() if p not in hit]  # whatever left our process tree
        if hit:
            if graceful:
                console.warning(f"Killed {len(hit)} leftover process(es) started by the job: {hit}.")
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and procs.descendants_of(os.getpid()) != exclude:
                procs.reap_orphans(exclude=exclude)
                time.sleep(0.005)
        procs.reap_orphans(exclude=exclude)
        self.guard.release()

    # ------------------------------------------------------------------ status
    def status(self, state: str, code: int | None, extra: dict[str, Any] | None = None) -> JobStatus:
        """This node's share of the job, as it stands."""
        plan = self.plan
        return JobStatus(
            job_id=self.facts.job_id,
            state=state,
            exit_code=code,
            supervisor_pid=os.getpid(),
            host=self.facts.hostname,
            join=self.cfg.join,
            started=self.started,
            node_index=self.assignment.node_index if self.assignment else 0,
            log_dir=self.cfg.log_dir,
            processes=[
                ProcessStatus(
                    name=c.spec.name,
                    role=c.spec.role,
                    rank=c.spec.rank,
                    pid=c.pid,
                    log=os.path.abspath(c.spec.log_path),
                    returncode=c.returncode,
                    started=c.started,
                    ended=c.ended,
                    terminated_by_msrun=c.terminated_by_us,
                )
                for c in self.children
            ],
            failures=[f.__dict__ for f in sorted(self.failures, key=lambda f: f.at)],
            stop_reason=self.stop_reason,
            containment=self.guard.describe(),
            worker_num=plan.worker_num if plan is not None else None,
            scheduler_mode=plan.scheduler_mode if plan is not None else None,
            extra=dict(extra or {}),
        )

    def _write_status(self, state: str, code: int | None, extra: dict[str, Any] | None = None) -> None:
        if self.status_name is None or (
            self.cfg.multi_node and self.assignment is None and self.facts.scheduler_mode in CONTROL_PLANE_MODES
        ):
            return  # a node that never joined the job writes nothing into a shared log directory
        write_status(self.cfg.log_dir, self.status(state, code, extra), self.status_name)


class DryRun:
    """Runs every selected simulated rank, at most ``--sim_concurrency`` at a time.

    Simulated ranks are independent (no scheduler, no collectives), so a failing rank does not
    stop the others: the job runs to the end and reports every failed rank. Only what is running
    is kept in memory, plus one compact record per failure.
    """

    DETAILED = 100  # failures kept with their reason; beyond that only the rank numbers
    PROGRESS_SECONDS = 5.0

    def __init__(self, agent: Agent, plan: LaunchPlan) -> None:
        self.agent = agent
        self.plan = plan
        self.total = len(plan.sim_ranks)
        self.limit = plan.sim_concurrency or len(os.sched_getaffinity(0)) or 1
        self.finished = 0
        self.failed_ranks = array("i")
        self.reasons: list[str] = []
        self.next_progress = time.monotonic() + self.PROGRESS_SECONDS

    def _reason(self, child: procs.Child) -> str:
        from pytest_msrun.engine.summary import extract_traceback, log_text

        assert child.returncode is not None
        how = procs.describe_returncode(child.returncode)
        tb = extract_traceback(log_text(child.spec.log_path, 16 * 1024))
        last = tb.strip().splitlines()[-1].strip() if tb else ""
        return f"rank {child.spec.rank} ({os.path.basename(child.spec.log_path)}) {how}" + (f": {last}" if last else "")

    def _reap(self, child: procs.Child) -> None:
        agent = self.agent
        self.finished += 1
        if agent.tailer is not None and child.spec.tail:
            agent.tailer.finish(child.spec.log_path)
        if child.returncode != 0:
            console.error(f"Worker process {child.pid} exit with exception. Error code: {child.returncode}.")
            self.failed_ranks.append(child.spec.rank if child.spec.rank is not None else -1)
            if len(self.reasons) < self.DETAILED:
                self.reasons.append(self._reason(child))
                agent._record_failure(child)
        agent.children.remove(child)  # memory stays flat however many ranks run
        now = time.monotonic()
        if now >= self.next_progress or self.finished == self.total:
            self.next_progress = now + self.PROGRESS_SECONDS
            console.out(
                f"msrun: dry run: {self.finished}/{self.total} simulated ranks finished, "
                f"{len(self.failed_ranks)} failed"
            )

    def run(self) -> JobResult:
        agent, cfg = self.agent, self.agent.cfg
        if cfg.join and not agent.detached:
            agent.tailer = LogTailer([])
        agent._console_done(0)
        specs = self.plan.dry_run_workers()
        exhausted, announced, code = False, False, 0
        while True:
            while not exhausted and len(agent.children) < self.limit and agent.signal_received is None:
                spec = next(specs, None)
                if spec is None:
                    exhausted = True
                    break
                agent._spawn(spec)
                if agent.tailer is not None and spec.tail:
                    agent.tailer.add(prefix_for(spec.rank, spec.local_index), spec.log_path)
            if not announced:
                announced = True
                agent._write_status("running", None, self._summary())
                if cfg.join and not agent.detached:
                    console.warning("Distributed job is spawned. Waiting all processes to exit...")
            if agent.signal_received is not None:
                code = agent._announce_signal()
                break
            if not agent.children:
                break
            for kind, payload in agent._poll_events(1.0):
                if kind == "exit":
                    self._reap(payload)
        state = "terminated" if code else ("failed" if self.failed_ranks else "succeeded")
        agent._teardown(graceful=not code)
        agent._finish_console(state, code)
        if self.failed_ranks and not code:
            first = min(agent.failures, key=lambda f: f.at)
            code = first.exit_status or 1
        if self.failed_ranks or code:
            self._print_summary()
            agent._report_failure()
        else:
            console.info("All workers successfully exit!")
            console.out(f"msrun: dry run: all {self.total} simulated rank(s) passed")
        agent._write_status(state, code, self._summary())
        return JobResult(code, state, agent.failures)

    def _summary(self) -> dict[str, Any]:
        from pytest_msrun.cpulist import format_id_list

        return {
            "dry_run": {
                "selected": len(self.plan.sim_ranks),
                "finished": self.finished,
                "failed": len(self.failed_ranks),
                "failed_ranks": format_id_list(self.failed_ranks),
                "failures": self.reasons,
            }
        }

    def _print_summary(self) -> None:
        from pytest_msrun.cpulist import format_id_list

        failed = len(self.failed_ranks)
        lines = [
            f"msrun: dry run: {self.finished - failed} of {self.total} simulated rank(s) passed; {failed} failed: "
            f"{format_id_list(self.failed_ranks)}"
        ]
        lines += [f"  {reason}" for reason in self.reasons]
        if failed > len(self.reasons):
            lines.append(f"  ... and {failed - len(self.reasons)} more (see their logs)")
        console.out("\n".join(lines))
