"""Live progress of long work on a terminal: one status line on stderr, rewritten in place.

Shown only when stderr is a terminal, ``CI`` is not set, ``MSRUN_PROGRESS`` is not ``0`` and
msrun's verbosity (``GLOG_v``) shows warnings; elsewhere (pipes, CI logs) nothing at all. Every
other console line first clears the status line (:func:`pytest_msrun.engine.console.before_write`),
so the two never mix.
"""

from __future__ import annotations

import os
import sys
import time

from pytest_msrun.engine import console

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import TextIO

PROGRESS_ENV = "MSRUN_PROGRESS"
MIN_INTERVAL = 0.1  # s between two redraws
CLEAR = "\r\x1b[K"


def wanted(env: dict[str, str] | None = None, stream: TextIO | None = None) -> bool:
    """Whether a live status line belongs on this console."""
    env = dict(os.environ) if env is None else env
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        tty = False
    quiet = env.get(PROGRESS_ENV, "").strip() == "0" or bool(env.get("CI", "").strip())
    return tty and not quiet and console.threshold() <= 2


class StatusLine:
    """One line of progress; :meth:`show` redraws it (throttled), :meth:`clear` takes it away."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = wanted() if enabled is None else enabled
        self.shown = ""
        self.drawn_at = 0.0

    def show(self, text: str) -> None:
        if not self.enabled or text == self.shown:
            return
        at = time.monotonic()
        if at - self.drawn_at < MIN_INTERVAL:
            return
        self.drawn_at = at
        self.shown = text
        console.status(CLEAR + "msrun: " + text, self._clear_for_others)

    def clear(self) -> None:
        if self.shown:
            self.shown = ""
            console.status(CLEAR, None)

    def _clear_for_others(self) -> str:
        """What another console line writes first while this line is shown."""
        if not self.shown:
            return ""
        self.shown = ""
        return CLEAR
