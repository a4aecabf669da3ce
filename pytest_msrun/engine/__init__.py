"""The launch engine: flags -> config -> plan (pure) -> agent (processes, supervision) -> result.

Imports go one way: the engine uses the control plane's wire format, binding and the base
modules (``pytest_msrun.cpulist``, ``pytest_msrun.netaddr``); it never imports the pytest plugin.
Its modules share one helper, :class:`suppress`.
"""

from __future__ import annotations


class suppress:
    """``contextlib.suppress``, without importing :mod:`contextlib` on msrun's start path."""

    def __init__(self, *exceptions: type[BaseException]) -> None:
        self.exceptions = exceptions

    def __enter__(self) -> None:
        return None

    def __exit__(self, etype: type[BaseException] | None, value: object, tb: object) -> bool:
        return etype is not None and issubclass(etype, self.exceptions)
