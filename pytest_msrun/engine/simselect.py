"""``--sim_select``: which simulated ranks a dry run runs.

A comma-separated union of items: ``N``, ``A-B``, ``first:K``, ``last:K`` and ``sample:K[:SEED]``
(K ranks drawn at random with a fixed seed, default 0, so a CI run is reproducible). The
empty selection means every rank this node runs.
"""

from __future__ import annotations


class SelectionError(ValueError):
    """A ``--sim_select`` item is malformed or outside the job."""


def _count(text: str, item: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise SelectionError(f"{item!r}: the count must be a positive integer")
    return int(text)


def select_ranks(text: str, candidates: range) -> list[int]:
    """The selected ranks among ``candidates`` (this node's ranks), ascending and unique."""
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
                if seed_text and not seed_text.lstrip("-").isdigit():
                    raise SelectionError(f"{item!r}: the seed must be an integer")
                import random  # only for samples

                rng = random.Random(int(seed_text) if seed_text else 0)
                chosen.update(rng.sample(candidates, min(k, len(candidates))))
            else:
                raise SelectionError(f"{item!r}: use N, A-B, first:K, last:K or sample:K[:SEED]")
            continue
        a, dash, b = item.partition("-")
        if not a.isdigit() or (dash and not b.isdigit()):
            raise SelectionError(f"{item!r}: use N, A-B, first:K, last:K or sample:K[:SEED]")
        start, end = int(a), int(b) if dash else int(a)
        if start > end:
            raise SelectionError(f"{item!r}: the range runs backwards")
        if start < lo or end >= hi:
            raise SelectionError(f"{item!r} is outside this node's ranks {lo}..{hi - 1}")
        chosen.update(range(start, end + 1))
    return sorted(chosen)
