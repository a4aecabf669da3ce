"""Which warm worlds stay alive between tests: a budget of live ranks and devices, and Belady's rule -
when a world must make room, the live world whose next test is farthest away ends first.

Pure: worlds are keys with a :data:`Need` (ranks, devices), the tests to come a sequence of keys
(None: a test that starts no world), and :class:`Schedule` answers "where is the next test of this
key" by bisection, so a long session costs no quadratic scans. :func:`default_ranks` is the one
look at the machine: an idle world costs memory and processes, not CPU.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

Need = tuple[int, int]  # (ranks, devices) a world holds while it lives
K = TypeVar("K", bound=Hashable)  # a world's key
NEVER = math.inf  # the next use of a world no test to come needs
RANK_MEMORY = 512 << 20  # bytes an idle rank is assumed to hold (a pytest process with a framework imported)


@dataclass(frozen=True)
class Budget:
    """What the live worlds of one process may hold together."""

    ranks: int
    devices: int

    def fits(self, needs: Sequence[Need]) -> bool:
        return sum(n[0] for n in needs) <= self.ranks and sum(n[1] for n in needs) <= self.devices


def victims(live: Mapping[K, Need], new: Need, budget: Budget, next_use: Callable[[K], float]) -> list[K]:
    """The live worlds to end, farthest next use first, so that a world needing ``new`` fits beside
    the rest (every one of them when it fits beside none: a world larger than the budget runs alone)."""
    kept = dict(live)
    ended: list[K] = []
    for key in sorted(live, key=lambda k: (-next_use(k), -live[k][0], repr(k))):
        if budget.fits([*kept.values(), new]):
            break
        ended.append(key)
        del kept[key]
    return ended


class Schedule(Generic[K]):
    """The keys of the tests to come, in order, with each key's positions for :meth:`next_use`."""

    def __init__(self, keys: Sequence[K | None]) -> None:
        self.keys = list(keys)
        self.positions: dict[K, list[int]] = {}
        for i, key in enumerate(self.keys):
            if key is not None:
                self.positions.setdefault(key, []).append(i)

    def next_use(self, key: K, start: int) -> float:
        """The position of the first test of ``key`` at or after ``start`` (:data:`NEVER`: none)."""
        positions = self.positions.get(key, [])
        at = bisect.bisect_left(positions, start)
        return positions[at] if at < len(positions) else NEVER


def survives(
    key: K,
    live: Mapping[K, Need],
    need: Callable[[K], Need],
    schedule: Schedule[K],
    start: int,
    end: int,
    budget: Budget,
) -> bool:
    """Whether the live world of ``key`` is still alive at position ``end`` (its next test) when each
    test from ``start`` on starts its world if none is live, making room with :func:`victims`
    (``need``: a key's :data:`Need`)."""
    alive = dict(live)
    for i in range(start, end):
        other = schedule.keys[i]
        if other is None or other in alive:
            continue
        for ended in victims(alive, need(other), budget, partial(schedule.next_use, start=i)):
            if ended == key:
                return False
            del alive[ended]
        alive[other] = need(other)
    return True


def default_ranks(workers: int = 1) -> int:
    """The live ranks a process may keep by default: the memory available now at
    :data:`RANK_MEMORY` a rank, shared by ``workers`` processes (pytest-xdist's), at least 1."""
    available = _mem_available()
    if available is None:
        return max(1, 4 * (os.cpu_count() or 1) // max(1, workers))
    return max(1, available // RANK_MEMORY // max(1, workers))


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None
