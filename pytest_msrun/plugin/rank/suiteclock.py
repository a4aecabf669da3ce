"""A suite's clock in a rank: each marked test run in place has its timeout, kept twice.

Inside ``msrun pytest tests/`` no controller times a marked test: the rank does, with a timer
thread that records where it was (its stacks, what the control plane knew) and ends the rank with
:data:`TIMEOUT_EXIT` - and msrun does too, from the deadline the rank declares
(:mod:`pytest_msrun.engine.ranknotes`), for a rank that cannot run its own timer (stopped, or
holding the interpreter's lock in native code). After the session, a rank that does not exit
within the timeout records so and ends itself (and msrun keeps that deadline as well).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from os import _exit  # taken now: a test that replaces os._exit does not change how a rank ends
from typing import Any

import pytest

from pytest_msrun.engine import ranknotes
from pytest_msrun.plugin.marker import MARKER, MarkerError, spec_for
from pytest_msrun.plugin.rule.records import RecordWriter
from pytest_msrun.plugin.stdstreams import read_log

TIMEOUT_EXIT = ranknotes.TIMEOUT_EXIT  # a rank that ran out of time ends with timeout(1)'s status
WAITER_GRACE = 3.0  # s a rank that timed out waiting for others gives them to end first


class SuiteClock:
    """The timeouts of one rank's suite (``plugin``: its :class:`~.rank.RankPlugin`)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.timer: threading.Timer | None = None

    def arm(self, item: pytest.Item) -> None:
        """A marked test run in place gets its marker's timeout (else --msrun-timeout / ini)."""
        if self.plugin.controlled or self.plugin.writer is None or item.get_closest_marker(MARKER) is None:
            return
        try:
            spec = spec_for(item)
        except MarkerError as exc:  # an error at setup, as in plugin mode (not a test run without it)
            pytest.fail(str(exc), pytrace=False)
        seconds = (spec.timeout if spec is not None else None) or self.plugin.default_timeout
        if not seconds:
            return
        self.timer = threading.Timer(seconds, self.timed_out, args=(item.nodeid, seconds))
        self.timer.daemon = True
        self.timer.start()
        # msrun keeps the time too: a rank that cannot run its timer (stopped, or holding the
        # interpreter's lock in native code) is found late by msrun, which names it
        ranknotes.set_deadline(seconds, f"{item.nodeid} (timeout {seconds:g} s)", int(signal.SIGUSR1))
        # A backstop that needs no Python: if the main thread never lets the timer run, dump and exit.
        faulthandler.dump_traceback_later(seconds + 30, exit=True, file=self.plugin.stacks)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            faulthandler.cancel_dump_traceback_later()
            ranknotes.clear_deadline()

    def timed_out(self, nodeid: str, seconds: float) -> None:
        """Record where this rank was and what the control plane knew, then end the rank."""
        from pytest_msrun.control.observer import query_from_env, waiting_for_others

        when = self.plugin.current[1] if self.plugin.current and self.plugin.current[0] == nodeid else "setup"
        stack = _dump_stacks(self.plugin.stacks)
        state = query_from_env(dict(os.environ))
        self.plugin._write("timeout", nodeid=nodeid, when=when, timeout=seconds, state=state, stack=stack)
        say(
            f"\nmsrun: {nodeid} timed out after {seconds:g} s on rank {self.plugin.rank} in its {when} phase; "
            f"this rank ends with exit status {TIMEOUT_EXIT}\n"
        )
        # Waiting for ranks that have not come (in a suite: a rank stuck in an earlier test, whose
        # own clock runs out about now): let them end first - the first to end is the job's root
        # cause, and it is theirs. msrun's teardown ends this rank meanwhile if they do. This rank
        # kept its own time: msrun need not (it looks for the ranks that cannot).
        ranknotes.clear_deadline()
        time.sleep(WAITER_GRACE if waiting_for_others(state, self.plugin.rank, self.plugin.world) else 0.05)
        _exit(TIMEOUT_EXIT)

    def arm_exit_watchdog(self, path: str, seconds: float) -> None:
        rank, world, stacks = self.plugin.rank, self.plugin.world, self.plugin.stacks

        def fire() -> None:
            time.sleep(seconds)
            stack = _dump_stacks(stacks)
            try:
                RecordWriter(path, rank, world, append=True).write("exit_hang", grace=seconds, stack=stack)
            except (OSError, ValueError):
                pass
            else:
                say(
                    f"\nmsrun: rank {rank} did not exit within {seconds:g} s of its pytest session's end "
                    f"(--msrun-timeout); it ends with exit status {TIMEOUT_EXIT}\n"
                )
            _exit(TIMEOUT_EXIT)

        threading.Thread(target=fire, name="msrun-exit-watchdog", daemon=True).start()
        ranknotes.set_deadline(seconds, "its exit after its pytest session ended", int(signal.SIGUSR1))
        # A backstop that needs no Python (a hang in the interpreter's own finalization).
        faulthandler.dump_traceback_later(seconds + 5, exit=True, file=stacks)


def _dump_stacks(stacks: Any) -> str:
    """Every thread's stack, appended to the rank's stacks file and returned."""
    stacks.flush()
    start = os.lseek(stacks.fileno(), 0, os.SEEK_END)
    faulthandler.dump_traceback(stacks, all_threads=True)
    stacks.flush()
    return read_log(stacks.name, start)


def say(text: str) -> None:
    """``text`` into the rank's log (its stderr), unless that is closed or broken."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
