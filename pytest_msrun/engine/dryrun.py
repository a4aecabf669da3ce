"""Dry runs at scale: every selected simulated rank, at most ``--sim_concurrency`` at a time.

Simulated ranks are independent (no scheduler, no collectives), so a failing rank does not stop
the others: the job runs to the end and reports every failed rank. Only what is running is kept
in memory, plus one compact record per failure. Uses the agent's public API only.
"""

from __future__ import annotations

import itertools
import os
import time
from array import array
from collections.abc import Sequence

from pytest_msrun.control.torchdry import RECORD_ENV
from pytest_msrun.cpulist import format_id_list
from pytest_msrun.engine import console, errorfile, holdings
from pytest_msrun.engine.errorfile import RankError
from pytest_msrun.engine.kinds import JobState
from pytest_msrun.engine.loop import EventKind
from pytest_msrun.engine.observers import JobEvent, JobResult
from pytest_msrun.engine.plan import LaunchPlan
from pytest_msrun.engine.policy import Ending
from pytest_msrun.engine.processes import Child, describe_returncode
from pytest_msrun.engine.summary import extract_traceback, log_text
from pytest_msrun.engine.tail import LogTailer, prefix_for

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from pytest_msrun.engine.agent import Agent


class DryRunSupervisor:
    DETAILED = 100  # failures kept with their reason; beyond that only the rank numbers
    PROGRESS_SECONDS = 5.0

    def __init__(self, agent: Agent, plan: LaunchPlan) -> None:
        self.agent = agent
        self.plan = plan
        self.total = len(plan.sim_ranks)
        self.limit = plan.config.sim_concurrency or len(os.sched_getaffinity(0)) or 1
        self.finished = 0
        self.failed_ranks = array("i")
        self.reasons: list[str] = []
        self.held: list[holdings.Held] = []  # what the ranks that said so hold (pytest_msrun.dryrun)
        self.next_progress = time.monotonic() + self.PROGRESS_SECONDS
        self.tailer = LogTailer([]) if agent.node.cfg.join and not agent.node.detached else None

    def _reason(self, child: Child, error: RankError | None) -> str:
        assert child.returncode is not None
        spec = child.tag
        if error is not None:
            last = error.headline
        else:  # no record (a signal, os._exit): the last line of the traceback in its log, if any
            tb = extract_traceback(log_text(spec.log_path, 16 * 1024))
            last = tb.strip().splitlines()[-1].strip() if tb else ""
        how = describe_returncode(child.returncode)
        return f"rank {spec.rank} ({os.path.basename(spec.log_path)}) {how}" + (f": {last}" if last else "")

    def _reap(self, child: Child) -> None:
        agent = self.agent
        self.finished += 1
        if self.tailer is not None and child.tag.tail:
            self.tailer.finish(child.tag.log_path)
        agent.node.emit(JobEvent.PROCESS_EXITED, child)
        held = holdings.compact(child.tag.exported.get(RECORD_ENV, ""), child.tag.rank or 0)
        if held is not None:
            self.held.append(held)
        if child.returncode != 0:
            self.failed_ranks.append(child.tag.rank if child.tag.rank is not None else -1)
            if len(self.reasons) < self.DETAILED:
                error = errorfile.read_error(child.tag.error_file)
                self.reasons.append(self._reason(child, error))
                agent.node.policy.exited(child, error)
        agent.node.group.children.remove(child)  # memory stays flat however many ranks run
        now, line = time.monotonic(), agent.node.status_line
        text = f"dry run: {self.finished}/{self.total} simulated ranks finished, {len(self.failed_ranks)} failed"
        if line.enabled and self.finished < self.total:  # a terminal: one live line
            line.show(text)
        elif now >= self.next_progress or self.finished == self.total:  # a log: a line now and then
            self.next_progress = now + self.PROGRESS_SECONDS
            console.out(f"msrun: {text}")

    def _fork_from_here(self, argv: list[str]) -> None:
        """A torch task whose ranks run in more than one round: import, once, the installed modules
        its script imports (torch, the plan's torch modules: :func:`preloadrule.script_imports`),
        under the fork server's rule, and fork each simulated rank from this process (each would
        otherwise import them again, ~1 s of CPU). A task whose imports the rule refuses, or a
        command that is not ``python SCRIPT`` / ``python -m MODULE`` run by this interpreter,
        starts its ranks as new processes, as before."""
        import sys

        from pytest_msrun.engine import preloadrule, template

        if self.total <= self.limit or template.is_template() or len(argv) < 2:
            return
        if os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
            return
        script = argv[1]
        if script == "-m" and len(argv) > 2:
            import importlib.util

            try:
                spec = importlib.util.find_spec(argv[2])
            except (ImportError, ValueError):
                return
            script = getattr(spec, "origin", None) or ""
        if not os.path.isfile(script):
            return
        modules = preloadrule.script_imports(script)
        if "torch" in modules:  # (the framework whose dry run msrun's rank hook knows)
            template.hold(modules, dict(os.environ))

    def run(self) -> JobResult:
        agent = self.agent
        agent.node.tailer = self.tailer
        agent.ending.console_done(0)
        specs = self.plan.dry_run_workers()
        first = next(specs, None)
        if first is not None:
            self._fork_from_here(list(first.argv))
            specs = itertools.chain([first], specs)
        exhausted, announced = False, False
        signalled: int | None = None
        while True:
            while (
                not exhausted and len(agent.node.group.alive()) < self.limit and agent.node.loop.signal_received is None
            ):
                spec = next(specs, None)
                if spec is None:
                    exhausted = True
                    break
                agent.starter.start(spec)
                if self.tailer is not None and spec.tail:
                    self.tailer.add(prefix_for(spec.rank, spec.local_index), spec.log_path)
            if not announced:
                announced = True
                agent.node.emit(JobEvent.SPAWNED, list(agent.node.group.children))
            if agent.node.loop.signal_received is not None:
                signalled = agent.node.loop.signal_received
                break
            if not agent.node.group.alive():
                break
            tailing = self.tailer is not None and bool(self.tailer.files)
            for event in agent.node.loop.poll(LogTailer.INTERVAL if tailing else 1.0):
                if event.kind is EventKind.EXITED and event.child is not None:
                    self._reap(event.child)
            if tailing and self.tailer is not None:
                self.tailer.pump()  # (here, not on a thread: the next ranks are forked from this process)
        shown = holdings.table(self.held, self.plan.config.worker_num, self.plan.config.budget)
        if shown:
            console.out("\n".join(["msrun: dry run: what each simulated rank holds", *(f"  {x}" for x in shown)]))
        if signalled is None and not self.failed_ranks:
            console.out(f"msrun: dry run: all {self.total} simulated rank(s) passed")
            ending = Ending(0, JobState.SUCCEEDED)
        else:
            self._print_summary()
            policy = agent.node.policy
            ending = policy.signalled(signalled) if signalled is not None else policy.first_failure()
        return agent.ending.conclude(ending, self.summary())

    def summary(self) -> dict[str, Any]:
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
        failed = len(self.failed_ranks)
        lines = [
            f"msrun: dry run: {self.finished - failed} of {self.total} simulated rank(s) passed; {failed} failed: "
            f"{format_id_list(self.failed_ranks)}"
        ]
        lines += reason_lines(self.reasons)
        if failed > len(self.reasons):
            lines.append(f"  ... and {failed - len(self.reasons)} more (see their logs)")
        console.out("\n".join(lines))


REFUSAL = "RuntimeError: Dryrun is not supported on "  # what MindSpore's init() raises in a dry run on CPU


def refusal_line(reasons: Sequence[str]) -> str:
    """MindSpore's refusal of dry runs on this machine, said once for every reason that is it ("" if none)."""
    refused = [r for r in reasons if REFUSAL in r]
    if not refused:
        return ""
    words = refused[0][refused[0].index(REFUSAL) + len("RuntimeError: ") :]
    return (
        f'msrun: MindSpore refuses dry runs on this machine ("{words}"): its dry run needs an Ascend build and '
        f"device; {len(refused)} simulated rank(s) failed for that alone"
    )


def reason_lines(reasons: Sequence[str]) -> list[str]:
    """The failed ranks' reasons as printed: MindSpore's refusal in one line, any other reason one per rank."""
    refusal = refusal_line(reasons)
    return ([refusal] if refusal else []) + [f"  {reason}" for reason in reasons if REFUSAL not in reason]
