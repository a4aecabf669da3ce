"""The one registry of functions a process has another run by name (``module:function``).

A fork of msrun (its control plane, a forked worker), a fork server's msrun, a template's
preparation and a job-end reporter name their function by a key of :data:`TARGETS`;
:func:`resolve` imports only what the table names, so no request, file or environment can make a
process call anything else.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

TARGETS = {
    "msrun": "pytest_msrun.entry:main",  # `python -m pytest_msrun`, called with its arguments
    "scheduler": "pytest_msrun.control.scheduler:main",  # the control plane, forked from msrun
    "worker": "pytest_msrun.engine.template:run_module",  # a Python worker forked from a fork server's msrun
    "rewriting-hook": "pytest_msrun.plugin.controller.forkserver:rewriting_hook",  # a rank template's plugin imports
    "suite-report": "pytest_msrun.plugin.reports.suite:job_report",  # a suite's table, when its job ends
}


class UnknownTarget(LookupError):
    """A name that is not a key of :data:`TARGETS`."""


def resolve(key: str) -> Callable[..., Any]:
    """The function registered as ``key`` (its module imported); :class:`UnknownTarget` else."""
    import importlib

    if key not in TARGETS:
        raise UnknownTarget(f"{key!r} is not a registered target (pytest_msrun.targets.TARGETS)")
    module, _, function = TARGETS[key].partition(":")
    return getattr(importlib.import_module(module), function)
