"""What the simulated ranks of a dry run hold, side by side: one table for msrun's summary and a test's report.

Each simulated rank that called ``pytest_msrun.dryrun.account`` / ``collectives`` left a record
(``control/torchdry.py``). :func:`compact` keeps what the table needs of one (a dry run of
thousands of ranks holds one small tuple each); :func:`table` shows every rank when there are
few, else the largest, the smallest and the farthest from the median, with one line for the
rest.
"""

from __future__ import annotations

import statistics

from pytest_msrun import boundedjson
from pytest_msrun.record import record
from pytest_msrun.sizes import format_size

ROWS = 12  # ranks shown one per row at most; beyond, the ends and the outliers
ENDS = 4  # the largest and the smallest shown of many


@record(frozen=True)
class Held:
    """One simulated rank's holdings (bytes) and one step's collectives."""

    rank: int
    dims: tuple[str, ...]  # of the mesh its parameters are placed on
    coordinate: tuple[int, ...]
    params: int
    grads: int
    optimizer: int
    collectives: tuple[tuple[str, int, int], ...]  # (name, count, bytes put in)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def compact(path: str, rank: int) -> Held | None:
    """The record at ``path`` (written by rank ``rank``'s own code), or None: none, or not one."""
    try:
        with open(path, "rb") as fh:
            data = boundedjson.loads(fh.read(1 << 20), max_depth=8)
        mesh = data.get("mesh") or {}
        ops = data.get("collectives") or {}
        return Held(
            rank=rank,
            dims=tuple(str(d) for d in mesh.get("dims") or ()),
            coordinate=tuple(int(c) for c in mesh.get("coordinate") or ()),
            params=int(data.get("params") or 0),
            grads=int(data.get("grads") or 0),
            optimizer=int(data.get("optimizer") or 0),
            collectives=tuple(sorted((str(name), int(n), int(size)) for name, (n, size) in ops.items())),
        )
    except (OSError, ValueError, TypeError, AttributeError, OverflowError):
        return None


def _row(h: Held) -> list[str]:
    ops = ", ".join(f"{name} {n}" for name, n, _ in h.collectives)
    sent = sum(size for _, _, size in h.collectives)
    step = f"{sum(n for _, n, _ in h.collectives)} ({ops}; {format_size(sent)} in)" if h.collectives else "-"
    where = ",".join(map(str, h.coordinate)) if h.coordinate else "-"
    sizes = [format_size(v) for v in (h.params, h.grads, h.optimizer, h.total)]
    return [str(h.rank), where, *sizes, step]


def table(held: list[Held], of: int, budget: int = 0) -> list[str]:
    """Lines: the ranks of ``held`` (``of`` ranks in the job) side by side, and who holds most."""
    if not held:
        return []
    held = sorted(held, key=lambda h: h.rank)
    median = statistics.median_low(h.total for h in held)
    shown, rest = held, []
    if len(held) > ROWS:  # the ends, then the farthest from the median
        by_total = sorted(held, key=lambda h: h.total)
        keep = {*by_total[:ENDS], *by_total[-ENDS:]}
        for h in sorted(held, key=lambda h: -abs(h.total - median)):
            if len(keep) == ROWS:
                break
            keep.add(h)
        shown, rest = [h for h in held if h in keep], [h for h in held if h not in keep]
    dims = next((h.dims for h in held if h.dims), ())
    head = ["rank", f"mesh ({','.join(dims)})" if dims else "mesh", "params", "grads", "optimizer", "total"]
    rows = [[*head, "collectives per step"], *map(_row, shown)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    cells = [[c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))] for r in rows]
    lines = ["  ".join([*row, r[-1]]) for row, r in zip(cells, rows)]
    if rest:
        spread = max(abs(h.total - median) for h in rest)
        lines.append(f"... {len(rest)} other rank(s), each within {format_size(spread)} of the median")
    most, least = max(held, key=lambda h: h.total), min(held, key=lambda h: h.total)
    limit = f"; budget {format_size(budget)}" if budget else ""
    lines.append(
        f"{len(held)} of {of} ranks: most rank {most.rank} ({format_size(most.total)}), least rank {least.rank} "
        f"({format_size(least.total)}), median {format_size(median)}{limit}"
    )
    return lines
