"""A row-sharding strategy for one weight matrix, checked rank by rank in a dry run.

The weight has ROWS x COLS fp16 elements; each of ``world`` ranks holds a contiguous block of
rows. A correct plan spreads the remainder one row at a time over the first ranks; the broken
plan (``STRATEGY=broken``) gives the whole remainder to the last rank - which then exceeds the
per-rank memory budget - and drops a row after rank ``world // 2 - 1``.
"""

from __future__ import annotations

import os

ROWS = 1_000_000 + 3_900  # not a multiple of 4096: there is a remainder to place
COLS = 8192
BYTES = 2  # fp16
BUDGET = 4_100_000  # bytes per rank for this weight (250 rows)


def shard_rows(rank: int, world: int, rows: int = ROWS, broken: bool | None = None) -> tuple[int, int]:
    """Rows ``[start, end)`` that ``rank`` holds."""
    if broken is None:
        broken = os.environ.get("STRATEGY") == "broken"
    if not broken:
        base, extra = divmod(rows, world)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)
    base = rows // world
    start = rank * base + (1 if rank >= world // 2 else 0)  # off by one from the middle on
    end = rows if rank == world - 1 else (rank + 1) * base + (1 if rank + 1 >= world // 2 else 0)
    if rank == world // 2 - 1:
        end -= 1  # the row in between belongs to nobody
    return start, end


def check(rank: int, world: int) -> None:
    """Raise AssertionError unless ``rank``'s shard fits the budget and meets its neighbours."""
    start, end = shard_rows(rank, world)
    size = (end - start) * COLS * BYTES
    assert size <= BUDGET, f"rank {rank} holds {end - start} rows = {size} bytes > budget {BUDGET}"
    if rank == 0:
        assert start == 0, f"rank 0 starts at row {start}, not 0"
    if rank + 1 < world:
        nxt = shard_rows(rank + 1, world)[0]
        assert end == nxt, f"rows {end}..{nxt} between rank {rank} and rank {rank + 1} belong to nobody"
    else:
        assert end == ROWS, f"the last rank ends at row {end}, not {ROWS}"
