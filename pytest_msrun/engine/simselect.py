"""``--sim_select``: which simulated ranks a dry run runs.

A comma-separated union of items: ``N``, ``A-B``, ``first:K``, ``last:K`` and ``sample:K[:SEED]``
(K ranks drawn at random with a fixed seed, default 0, so a CI run is reproducible) and
``mesh:D0xD1[x...]``: the seams of a row-major device mesh over the whole job (rank = c0*D1 + c1,
as torch's ``init_device_mesh`` lays ranks out) - the diagonal ranks ``(k mod D0, k mod D1, ...)``
for k < max(D), so every coordinate of every dimension runs, plus every corner, so each
dimension's first and last group member run: 66 ranks of a 64x64 mesh. The empty selection
means every rank this node runs.
"""

from __future__ import annotations

import itertools
import math

_FORMS = "use N, A-B, first:K, last:K, sample:K[:SEED] or mesh:D0xD1[x...]"


class SelectionError(ValueError):
    """A ``--sim_select`` item is malformed or outside the job."""


def _number(text: str) -> bool:
    """Whether ``text`` is a plain decimal number int() reads (ASCII digits, a sane length)."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def _count(text: str, item: str) -> int:
    if not _number(text) or int(text) < 1:
        raise SelectionError(f"{item!r}: the count must be a positive integer")
    return int(text)


def _mesh(rest: str, item: str, world: int) -> set[int]:
    """The seams of the mesh ``rest`` (``D0xD1...``) over ranks ``0..world-1``."""
    parts = rest.split("x")
    if not 1 <= len(parts) <= 8 or not all(_number(p) and int(p) > 0 for p in parts):
        raise SelectionError(f"{item!r}: use mesh:D0xD1 (1 to 8 positive dims), e.g. mesh:64x64")
    dims = [int(p) for p in parts]
    if math.prod(dims) != world:
        raise SelectionError(f"{item} has {math.prod(dims)} ranks; this job has {world}")
    diagonal = [[k % d for d in dims] for k in range(max(dims))]
    corners = itertools.product(*[(0, d - 1) for d in dims])
    return {sum(c * math.prod(dims[i + 1 :]) for i, c in enumerate(co)) for co in [*diagonal, *corners]}


def select_ranks(text: str, candidates: range, *, world: int | None = None) -> list[int]:
    """The selected ranks among ``candidates`` (this node's ranks), ascending and unique; ``world``
    (default ``candidates.stop``) is the job's size, which a ``mesh:`` item spans."""
    text = text.strip()
    if not text:
        return list(candidates)
    lo, hi = candidates.start, candidates.stop
    chosen: set[int] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise SelectionError(f"{text!r} has an empty item")
        kind, colon, rest = item.partition(":")
        if colon:
            if kind == "first":
                chosen.update(range(lo, min(hi, lo + _count(rest, item))))
            elif kind == "last":
                chosen.update(range(max(lo, hi - _count(rest, item)), hi))
            elif kind == "sample":
                k_text, _, seed_text = rest.partition(":")
                k = _count(k_text, item)
                if seed_text and not _number(seed_text.removeprefix("-")):
                    raise SelectionError(f"{item!r}: the seed must be an integer")
                import random  # only for samples

                rng = random.Random(int(seed_text) if seed_text else 0)
                chosen.update(rng.sample(candidates, min(k, len(candidates))))
            elif kind == "mesh":
                chosen.update(r for r in _mesh(rest, item, hi if world is None else world) if r in candidates)
            else:
                raise SelectionError(f"{item!r}: {_FORMS}")
            continue
        a, dash, b = item.partition("-")
        if not _number(a) or (dash and not _number(b)):
            raise SelectionError(f"{item!r}: {_FORMS}")
        start, end = int(a), int(b) if dash else int(a)
        if start > end:
            raise SelectionError(f"{item!r}: the range runs backwards")
        if start < lo or end >= hi:
            raise SelectionError(f"{item!r} is outside this node's ranks {lo}..{hi - 1}")
        chosen.update(range(start, end + 1))
    return sorted(chosen)
