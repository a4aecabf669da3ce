"""Time for the control plane's deadlines: a loop's clock that does not count time the process
could not run, and durations read from the environment. Standard library ``time`` only: msrun
imports this on its start path, without the transport (sockets, selectors)."""

from __future__ import annotations

import time


class ConfigError(ValueError):
    """A control-plane setting (an environment variable) that cannot be used."""


def env_seconds(env: dict[str, str], name: str, default: float, *, allow_negative: bool = False) -> float:
    """A duration from ``env[name]``, or ``default``; :class:`ConfigError` naming the variable if malformed."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds") from None
    if value != value or value in (float("inf"), float("-inf")) or (value < 0 and not allow_negative):
        raise ConfigError(f"{name}={text!r} must be a finite number of seconds >= 0")
    return value


class LoopClock:
    """Time as an event loop saw it pass. A gap between two ticks longer than ``step`` - the loop
    could not run at all: a loaded machine - counts as ``step``, so a deadline does not expire on a
    peer because this process was starved (a peer that is really gone stays gone: time goes on)."""

    def __init__(self, step: float = 1.0) -> None:
        self.step = step
        self.real = time.monotonic()
        self.now = self.real

    def tick(self) -> float:
        real = time.monotonic()
        self.now += min(real - self.real, self.step)
        self.real = real
        return self.now
