"""SIGINT, SIGTERM and SIGHUP held from msrun's first line until its event loop answers them.

Before the loop's handlers are in place, such a signal would end msrun by its default action,
mid-import or mid-planning, when nothing runs yet but the job's cgroup and watchdog exist - and
where msrun's supervisor kills the watchdog too (the end of a Slurm step), the empty cgroup is
left behind. Held (blocked), the signal waits; the loop lets it in as soon as it can answer it,
and msrun ends as for any signal: nothing started, exit status 128+N, the job's cgroup removed.
Uses ``_signal`` only: it runs before msrun has imported anything.
"""

from __future__ import annotations

import _signal

HELD = frozenset((_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP))

_holding: frozenset[int] = frozenset()  # the signals this process blocked (and so must unblock)


def hold() -> None:
    """Block :data:`HELD` in this thread, and in every thread it starts from now on, until
    :func:`let_in` (msrun starts its child processes with an empty mask)."""
    global _holding
    if not _holding:
        before = _signal.pthread_sigmask(_signal.SIG_BLOCK, HELD)
        _holding = frozenset(HELD - set(before))  # one blocked already stays as it was


def let_in() -> None:
    """Unblock what :func:`hold` blocked: one that came meanwhile is delivered now. A no-op where
    nothing is held (msrun's engine run in-process, by the plugin)."""
    global _holding
    if _holding:
        held, _holding = _holding, frozenset()
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, held)
