"""One way to wait for a condition with a deadline: polling, every wait of the package alike."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # nothing more on msrun's start path
    from collections.abc import Callable


def wait_until(done: Callable[[], bool], seconds: float, interval: float = 0.01) -> bool:
    """Whether ``done()`` held within ``seconds`` (asked at once, then every ``interval`` s)."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
