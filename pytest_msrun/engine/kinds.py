"""The engine's named types: scheduler modes, process roles, job states.

String enums: their values are what msrun prints, writes to status files and exports to children
(``MSRUN_SCHEDULER``), so ``str(mode)`` is its value.
"""

from __future__ import annotations

from enum import Enum


class _Named(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


class SchedulerMode(_Named):
    """What the scheduler process is (``--scheduler``; ``NONE`` in a dry run)."""

    AUTO = "auto"  # the builtin control plane, plus a MindSpore scheduler when a MindSpore worker connects
    BUILTIN = "builtin"  # the builtin control plane only
    MINDSPORE = "mindspore"  # the builtin control plane with a MindSpore scheduler from the start
    TASK = "task"  # the task itself with MS_ROLE=MS_SCHED, as MindSpore's msrun
    NONE = "none"  # a dry run: no scheduler

    @property
    def has_control_plane(self) -> bool:
        return self in (SchedulerMode.AUTO, SchedulerMode.BUILTIN, SchedulerMode.MINDSPORE)


class Role(_Named):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class JobState(_Named):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TERMINATED = "terminated"  # msrun got a signal
    ERROR = "error"  # it could not start
