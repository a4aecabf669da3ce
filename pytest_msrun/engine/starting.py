"""Starting one node's processes: workers (early, held while msrun enters the job's cgroup,
or in slices between turns of the event loop), the control plane (forked from msrun or spawned),
and what is said once they are started. A part the :class:`~.agent.Agent` owns."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections.abc import Callable

from pytest_msrun.control import torchdry, wire
from pytest_msrun.engine import console, errorfile, timeline
from pytest_msrun.engine.kinds import Role
from pytest_msrun.engine.noderun import NodeRun
from pytest_msrun.engine.observers import BindingsObserver, JobEvent
from pytest_msrun.engine.plan import SCHEDULER_MODULE, LaunchPlan, ProcessSpec, build_plan
from pytest_msrun.engine.ports import EXIT_USAGE, LaunchError, claim_again
from pytest_msrun.engine.processes import Child, Launch
from pytest_msrun.engine.tail import LogTailer, prefix_for
from pytest_msrun.fileio import make_dirs
from pytest_msrun.record import replace

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _template() -> Any:
    """The fork server's module when this msrun is a fork of one (None: a plain msrun, which then
    never imports it - it is not on ``pmsrun``'s start path)."""
    module = sys.modules.get("pytest_msrun.engine.template")
    return module if module is not None and module.is_template() else None


SPAWN_SLICE = 0.05  # s of starting workers between two turns of the event loop


def collect_from_now() -> None:
    """msrun has started its job: the cyclic GC, held off while it started (see ``entry.main``),
    runs again - supervision may last days. What start-up allocated is long-lived: frozen, so no
    collection walks it again."""
    gc.freeze()
    gc.enable()


class Starter:
    """Starting this node's processes: a part the :class:`~.agent.Agent` owns. ``node``: the run
    it starts them for; ``ranks_known``: told once the ranks are."""

    def __init__(self, node: NodeRun, ranks_known: Callable[[LaunchPlan], None]) -> None:
        self.node = node
        self.ranks_known = ranks_known
        self._spawn_said = False
        self._fork_refusals: set[str] = set()  # why workers were spawned rather than forked (each said once)

    def start(
        self,
        spec: ProcessSpec,
        extra_env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        call: str = "",
        *,
        held: bool = False,
        announce: bool = True,
    ) -> Child:
        """Start one process of the plan (``call``: in a fork of msrun, see :meth:`start_scheduler`;
        ``held``: before msrun is in the job's cgroup; ``announce=False`` or ``held``: its line
        comes later - see :meth:`start_first`)."""
        for record in (spec.error_file, spec.exported.get(torchdry.RECORD_ENV, "")):
            if record:
                errorfile.clear(record)  # a previous run's
        trace_env = self.node.trace.child_env if self.node.trace is not None else {}
        env = {**spec.env, **trace_env, **(extra_env or {})}
        call_args = None
        cpus, mems = spec.in_child_cpus, None
        if not call and not held and spec.role == Role.WORKER and not self._fork_refusal(spec, env):
            call, call_args = "worker", list(spec.argv)
            if spec.bind_prefix:  # what the binding command in front would set, set on the fork
                cpus, mems = _template().binding_in_place(spec.bind_prefix) or (None, None)
        launch = Launch(
            argv=spec.command,
            env=env,
            log_path=spec.log_path,
            stdin_devnull=spec.role == Role.SCHEDULER or self.node.detached,
            pass_fds=pass_fds,
            in_child_cpus=cpus,
            in_child_mems=mems,
            call=call,
            call_args=call_args,
        )
        child = self.node.group.start(launch, spec, held=held)
        timeline.mark(f"started {spec.label}")
        if announce and not held:
            self.node.emit(JobEvent.PROCESS_STARTED, child)
        return child

    def _fork_refusal(self, spec: ProcessSpec, env: dict[str, str]) -> str:
        """Why a worker is spawned rather than forked from this msrun ("" when it is forked):
        only an msrun forked from a fork server forks workers (:mod:`.template`), each one that
        a fork stands for exactly, and only while no other thread runs here. Said once."""
        template = _template()
        if template is None:
            return "not a fork server's msrun"  # said nowhere: the usual way
        import _thread

        bound = template.binding_in_place(spec.bind_prefix) if spec.bind_prefix else (None, None)
        if bound is None:
            why = f"a binding command ({os.path.basename(spec.bind_prefix[0])}) runs in front"
        elif bound[0] is not None and template.frameworks() and set(bound[0]) != os.sched_getaffinity(0):
            # (libgomp, OpenBLAS: a pool's size is the CPUs a process may use as the library loads)
            why = f"a framework the fork server preloaded ({template.frameworks()[0]}) sized its threads for its CPUs"
        elif self.node.guard.ready() is None and not template.shows_itself():
            # without a cgroup the watchdog's last resort finds a job's processes by MSRUN_LAUNCHER_ID
            # in /proc/PID/environ, which shows a fork's template's where it cannot show its own
            why = "the job has no cgroup, and a fork cannot show its own environment here"
        elif _thread._count():
            why = "another thread runs in msrun"
        else:
            why = template.why_not_python(spec.argv, env, template.rank_hook_dir())
        if why and why not in self._fork_refusals:
            self._fork_refusals.add(why)
            console.warning(f"workers start as new processes, not forked from the fork server: {why}")
        return why

    def start_first(self, plan: LaunchPlan, listener: Any) -> bool:
        """Start workers before the control plane, for up to :data:`SPAWN_SLICE` s, so that their
        interpreters start up while msrun still prepares the control plane (announced after it,
        in msrun's order of lines: :meth:`announce_first`). Only when the ranks are known and the
        control plane is msrun's own, on a port msrun already listens on (a worker that connects
        first waits in the listener's queue). While msrun still waits to be inside the job's
        cgroup, only workers that can be held until then (Python ones: :mod:`.earlystart`), only
        during the wait. Whether any started."""
        scheduler = plan.scheduler
        if (
            scheduler is None
            or listener is None
            or scheduler.argv[1:] != ["-S", "-m", SCHEDULER_MODULE]
            or plan.layout.pending
            or not plan.workers
        ):
            return False
        from pytest_msrun.engine.earlystart import HOLD_ENV, FirstStarted, holdable

        entering = self.node.guard.entering
        waiting = entering is not None and entering.done.locked()
        spec = plan.workers[0]  # every worker of the plan shares its command: can they start held?
        if waiting and (not spec.error_file or spec.bind_prefix or not holdable(spec.argv, spec.env)):
            return False
        if waiting and _template() is not None:  # forked once msrun is in the cgroup (no thread runs)
            return False
        self.ranks_known(plan)  # before any of them starts
        first = self.node.first = FirstStarted(held=waiting)
        until = time.monotonic() + SPAWN_SLICE
        try:
            for spec in plan.workers:
                if self.node.loop.signal_received is not None or time.monotonic() >= until:
                    break
                if not waiting:
                    first.children.append(self.start(spec, announce=False))
                elif entering is not None and entering.done.locked():
                    child = self.start(spec, {HOLD_ENV: str(first.read_fd)}, (first.read_fd,), held=True)
                    first.children.append(child)
                else:
                    break
        finally:
            first.spawned()
        return True

    def _move_held_in(self) -> None:
        """Move the held workers into the job's cgroup, which msrun is inside (:meth:`JobGuard.ready`);
        any that cannot be moved is killed, still held: it ends as a worker killed by SIGKILL."""
        first = self.node.first
        cgroup = self.node.guard.ready()
        if first is None or not first.held or first.moved or cgroup is None:
            return
        for child, why in first.move_in(cgroup.procs_file):
            console.warning(f"could not move {child.tag.label} into the job's {cgroup.describe()}: {why}")
            child.signal(signal.SIGKILL)

    def announce_first(self) -> None:
        """The workers started first run on (held ones moved in, then let go) and are announced:
        after the scheduler, in msrun's order of lines."""
        first = self.node.first
        if first is None:
            return
        self._move_held_in()
        self.node.first = None
        first.let_go()
        scheduler = self.scheduler_child
        if scheduler is not None:  # listed (status, summary) first, in msrun's order too
            self.node.group.children.remove(scheduler)
            self.node.group.children.insert(0, scheduler)
        for child in first.children:
            self.node.emit(JobEvent.PROCESS_STARTED, child)

    def start_slice(self, todo: list[ProcessSpec]) -> bool:
        """Start workers for up to :data:`SPAWN_SLICE` s (at least one); whether any are left.
        Starting 128 workers on a loaded machine can take a minute: the loop turns between slices."""
        total = len(self.node.plan.workers) if self.node.plan is not None else len(todo)
        until = time.monotonic() + SPAWN_SLICE
        while todo and self.node.loop.signal_received is None:
            self.start(todo.pop(0))
            self.node.status_line.show(f"started {total - len(todo)}/{total} workers on this node")
            if time.monotonic() >= until:
                break
        return bool(todo) and self.node.loop.signal_received is None

    def spawned(self, plan: LaunchPlan) -> None:
        """Every worker of this node was started (or starting stopped): say so once."""
        if self._spawn_said:
            return
        self._spawn_said = True
        collect_from_now()
        if self.node.cfg.bind_core.enabled or self.node.cfg.bind_numa.enabled:
            self.node.observers.append(BindingsObserver(self.node.facts.hostname, self.node.facts.topology))
        self.node.emit(JobEvent.SPAWNED, list(self.node.group.children))
        workers = {
            c.tag.rank: c.pid for c in self.node.group.children if c.tag.role == Role.WORKER and c.tag.rank is not None
        }
        from pytest_msrun.engine.ranknotes import DeadlineWatch  # (notes an earlier job left name other pids)

        self.node.deadlines = DeadlineWatch(self.node.cfg.log_dir, workers)
        if self.node.cfg.join and not self.node.detached:
            tailed = [(prefix_for(s.rank, s.local_index), s.log_path) for s in plan.workers if s.tail]
            if tailed:
                self.node.tailer = LogTailer(tailed)
                self.node.tailer.start()

    def make_log_dir(self) -> None:
        """The log directory, made before anything starts: one that cannot be is a usage error."""
        log_dir = self.node.cfg.log_dir
        if log_dir and not os.path.isdir(log_dir):
            old = os.umask(0o077)
            try:
                make_dirs(log_dir)
            except OSError as exc:
                raise LaunchError(
                    f"--log_dir: cannot create {log_dir!r} ({exc.strerror or exc}); choose a directory you can write",
                    EXIT_USAGE,
                ) from None
            finally:
                os.umask(old)

    def start_scheduler(self, spec: ProcessSpec, listener: Any) -> None:
        env: dict[str, str] = {}
        fds: tuple[int, ...] = ()
        if listener is not None:  # the port msrun bound is handed to the scheduler process
            env["MSRUN_LISTEN_FD"] = str(listener.fileno())
            fds += (listener.fileno(),)
        theirs = None
        # The builtin control plane runs in a fork of msrun (its code is already imported here) rather
        # than a second interpreter: ready ~20 ms sooner, and that much less CPU taken from the workers
        # starting beside it. Not when a binding wraps it in a command (numactl), the interpreter
        # differs, or (checked at the fork) a thread runs here: a fork copies only the calling thread.
        forkable = (
            not spec.bind_prefix
            and spec.argv[1:] == ["-S", "-m", SCHEDULER_MODULE]
            and os.path.realpath(spec.argv[0]) == os.path.realpath(sys.executable)
        )
        if forkable:
            # Its code (and json, which msrun needs too) loaded here, where both processes share it,
            # while msrun may still wait to be inside the job's cgroup or the workers start up.
            import importlib

            importlib.import_module(SCHEDULER_MODULE)
            wire.load_json()
        self.node.guard.ready()  # in the job's cgroup first: the thread that moves msrun there has ended
        self._move_held_in()  # (let go once the fork is done)
        import _thread

        call = "scheduler" if forkable and _thread._count() == 0 else ""
        if call:  # this node registers over a socketpair: no connect, no challenge
            import _socket  # not socket: its import is a cost on msrun's start path

            self.node.control_sock, theirs = _socket.socketpair()
            env[wire.AGENT_FD_ENV] = str(theirs.fileno())
            fds += (theirs.fileno(),)
        try:
            self.start(spec, env, fds, call)
        except BaseException:
            if self.node.control_sock is not None:
                self.node.control_sock.close()
                self.node.control_sock = None
            raise
        finally:
            for sock in (listener, theirs):
                if sock is not None:
                    sock.close()

    def host_if_free(self, plan: LaunchPlan) -> LaunchPlan:
        """No scheduler answers at the port another process held on this host when this node
        started: if the port is free now, this node starts the scheduler there (and registers over
        its fork's socketpair next) - else every node of the job on this host could wait for a
        scheduler none of them hosts. The plan, with the scheduler when it started."""
        listener = claim_again(self.node.facts)  # the port's listeners are made in ports.py (the door table)
        if listener is None:
            return plan
        hosting = build_plan(self.node.cfg, self.node.facts, hosts_scheduler=True)
        assert hosting.scheduler is not None
        self.start_scheduler(hosting.scheduler, listener)
        return replace(plan, hosts_scheduler=True, processes=(hosting.scheduler, *plan.processes))

    @property
    def scheduler_child(self) -> Child | None:
        """The scheduler process this node started (None: another node hosts it, or none runs)."""
        return next((c for c in self.node.group.children if c.tag.role == Role.SCHEDULER), None)

    @property
    def workers_started(self) -> bool:
        return any(c.tag.role == Role.WORKER for c in self.node.group.children)
