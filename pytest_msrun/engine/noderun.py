"""``NodeRun``: what one node's run holds - its inputs, the processes and connections it made -
shared by the :class:`~.agent.Agent` and the parts it owns (starting, ending), each of which reads
and sets it explicitly rather than inheriting another's attributes."""

from __future__ import annotations

import time

from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.containment import JobGuard
from pytest_msrun.engine.loop import EventLoop
from pytest_msrun.engine.plan import LaunchPlan, NodeFacts, RankAssignment
from pytest_msrun.engine.policy import Policy
from pytest_msrun.engine.processes import ProcessGroup, term_grace
from pytest_msrun.engine.progress import StatusLine

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from pytest_msrun.engine import ranknotes
    from pytest_msrun.engine.earlystart import FirstStarted
    from pytest_msrun.engine.link import ControlLink
    from pytest_msrun.engine.observers import JobEvent, Observer
    from pytest_msrun.engine.tail import LogTailer
    from pytest_msrun.engine.trace import TraceObserver


class NodeRun:
    """One node's run: the launch's inputs and everything started for it so far."""

    def __init__(self, cfg: LaunchConfig, facts: NodeFacts, guard: JobGuard, detached: bool) -> None:
        self.cfg = cfg
        self.facts = facts  # (with the ports msrun claimed, once it has)
        self.detached = detached
        # The watchdog and the job's cgroup: nothing the job starts outlives it (see containment).
        self.guard = guard
        self.loop = EventLoop()
        self.group = ProcessGroup(self.loop, guard)
        self.policy = Policy()
        self.term_grace = term_grace()
        self.started = time.time()
        self.status_line = StatusLine(enabled=None if cfg.join and not detached else False)
        self.observers: list[Observer] = []
        self.notices: list[str] = []  # what the control plane said to every node
        self.plan: LaunchPlan | None = None
        self.assignment: RankAssignment | None = None  # the ranks the control plane gave this node
        self.link: ControlLink | None = None  # this node's connection to the control plane
        self.trace: TraceObserver | None = None
        self.first: FirstStarted | None = None  # workers started before the control plane
        self.tailer: LogTailer | None = None
        self.control_sock: Any = None  # this end of a socketpair to the control plane msrun forked
        self.deadlines: ranknotes.DeadlineWatch | None = None  # the workers' own deadlines, watched

    def emit(self, event: JobEvent, payload: Any = None) -> None:
        """Tell every observer of the run what happened."""
        for observer in self.observers:
            observer.notify(event, payload)

    @property
    def several_nodes(self) -> bool:
        """Whether the control plane put this node in a job of more than one node."""
        return self.assignment is not None and (self.assignment.node_count or 1) > 1
