"""CPU / NUMA id lists in the kernel's range syntax (``0-3,8``), both directions."""

from __future__ import annotations

from collections.abc import Iterable

# No CPU, NUMA node or device id reaches this (Linux caps CPUs at 8192 and NUMA nodes at
# 1024): every range is checked against it before it is expanded.
MAX_ID = 65535


class RangeSyntaxError(ValueError):
    """A range list such as ``0-3,8`` is malformed."""


def parse_id_list(text: str, what: str = "CPU", max_id: int = MAX_ID) -> list[int]:
    """``"0-3, 8"`` -> ``[0, 1, 2, 3, 8]`` (sorted, unique). Empty text -> ``[]``.

    Ids above ``max_id`` cannot exist and are refused before anything is expanded."""
    cleaned = "".join(str(text).split())
    if not cleaned:
        return []
    ids: set[int] = set()
    for seg in cleaned.split(","):
        if not seg:
            raise RangeSyntaxError(f"{what} range {text!r} has an empty segment")
        lo, dash, hi = seg.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise RangeSyntaxError(f"{what} range segment {seg!r} in {text!r} is not 'N' or 'N-M'")
        if len(lo) > 6 or len(hi) > 6 or int(lo) > max_id or (dash and int(hi) > max_id):
            raise RangeSyntaxError(f"{what} id in {seg!r} cannot exist: {what} ids go up to {max_id}")
        start, end = int(lo), int(hi) if dash else int(lo)
        if start > end:
            raise RangeSyntaxError(f"{what} range segment {seg!r} in {text!r}: start exceeds end")
        ids.update(range(start, end + 1))
    return sorted(ids)


def format_id_list(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (consecutive runs collapsed)."""
    runs: list[list[int]] = []  # [first, last] of each run
    for value in sorted({int(i) for i in ids}):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)
