"""A rank's memory around each test of a warm or forking world, and the pure rules that judge it.

In the rank, a :class:`Watch` samples the resident set (``/proc/self/statm``: one read) when a test
starts and when it ends, and the device memory of a framework the rank has already initialised
(``torch.cuda``; nothing is imported to look). What grows while a module is imported for the first
time, or while a fixture broader than the test is set up, is theirs - it stays on purpose, as the
threads and files they start do (:mod:`.serve`) - and is not counted; neither is the host memory of
a test that first initialised a device runtime (a CUDA context is hundreds of MB). Only a growth
past the bound is checked again, after a garbage collection and ``malloc_trim``, so a test that
left garbage cycles or freed memory the allocator kept is not named: the common path is two reads.

In the controller, :func:`judge` turns a rank's sample into leak items (``--msrun-leak-rss``,
judged as ``--msrun-leaks`` says) and :func:`past_max` says when a world must end
(``--msrun-max-rss``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import Any

from pytest_msrun.sizes import format_size

DEFAULT_LEAK = "100MiB"  # a test growing a rank by more is named (imports and caches excused)
DEFAULT_MAX = "0"  # off
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- in the rank
def rss() -> int:
    """This process's resident set in bytes (0 where ``/proc`` cannot tell)."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)  # no buffered file object: a few microseconds
        try:
            return int(os.read(fd, 256).split()[1]) * PAGE
        finally:
            os.close(fd)
    except (OSError, IndexError, ValueError):
        return 0


def devices(modules: Any = None) -> dict[str, list[int]]:
    """Device memory of a framework already initialised here: ``{"cuda:0": [allocated, reserved]}``."""
    torch = (sys.modules if modules is None else modules).get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return {}
        return {f"cuda:{i}": [cuda.memory_allocated(i), cuda.memory_reserved(i)] for i in range(cuda.device_count())}
    except Exception:  # noqa: BLE001 - a broken runtime is not a test's leak
        return {}


def _trim() -> None:
    """Give freed heap back to the system (glibc), so that what the allocator keeps is not counted."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)


class Watch:
    """One test's memory: sampled at its start and end, less what imports and broader fixtures grew."""

    def __init__(self) -> None:
        self.before = rss()
        self.devices = devices()
        self.owned = 0  # grown inside imports of new modules and broader fixtures' setup
        self._at = 0

    def enter(self) -> None:
        """An import or a broader fixture begins (outermost only)."""
        self._at = rss()

    def exit(self) -> None:
        self.owned += rss() - self._at

    def end(self, bound: int) -> dict[str, Any]:
        """The sample after the test; a growth past ``bound`` is measured again after collecting."""
        sample = self._sample()
        if bound > 0 and (counted(sample) > bound or any(g > bound for g in device_growths(sample).values())):
            gc.collect()
            _trim()
            sample = self._sample()
        return sample

    def _sample(self) -> dict[str, Any]:
        after = devices()
        sample: dict[str, Any] = {"before": self.before, "after": rss(), "owned": self.owned}
        if after:
            sample["devices"] = {name: [*self.devices.get(name, [0, 0]), *now] for name, now in after.items()}
            sample["runtime"] = not self.devices  # first initialised in this test
        return sample


# ---------------------------------------------------------------- in the controller
def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def counted(sample: Any) -> int:
    """The host growth a test is judged by: after - before - what imports and broader fixtures grew
    (0 when the test first initialised a device runtime)."""
    if not isinstance(sample, dict) or sample.get("runtime") is True:
        return 0
    return _int(sample.get("after")) - _int(sample.get("before")) - max(0, _int(sample.get("owned")))


def device_growths(sample: Any) -> dict[str, int]:
    """Each device's growth of allocated memory: ``{"cuda:0": bytes}``."""
    found = sample.get("devices") if isinstance(sample, dict) else None
    if not isinstance(found, dict):
        return {}
    return {str(k): _int(v[2]) - _int(v[0]) for k, v in found.items() if isinstance(v, list) and len(v) == 4}


def judge(sample: Any, bound: int) -> list[str]:
    """The leak items of one rank's sample: each growth past ``bound`` (0: none)."""
    if bound <= 0 or not isinstance(sample, dict):
        return []
    out = []
    growth = counted(sample)
    if growth > bound:
        before, after = _int(sample.get("before")), _int(sample.get("after"))
        owned = max(0, _int(sample.get("owned")))
        excused = f"; {format_size(owned)} of it imports and broader fixtures, not counted" if owned else ""
        out.append(
            f"resident memory grew by {format_size(growth)} ({format_size(before)} -> {format_size(after)}"
            f"{excused}; --msrun-leak-rss={format_size(bound)})"
        )
    for name, grew in sorted(device_growths(sample).items()):
        if grew > bound:
            values = sample["devices"][name]
            out.append(
                f"{name} memory allocated grew by {format_size(grew)} ({format_size(_int(values[0]))} -> "
                f"{format_size(_int(values[2]))}, reserved {format_size(_int(values[3]))}; "
                f"--msrun-leak-rss={format_size(bound)})"
            )
    return out


def past_max(resident: Any, maximum: int) -> bool:
    """Whether a rank's resident set after a test passed ``--msrun-max-rss`` (0: never)."""
    return maximum > 0 and _int(resident) > maximum
