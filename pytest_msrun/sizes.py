"""Sizes as people write them (``200MB``, ``100MiB``, ``4096``) and as they read them (``200.0 MiB``).

Memory bounds (``--msrun-leak-rss``, ``--msrun-max-rss``) and a dry run's budget per rank
(``--sim_budget``) read sizes one way: a bare unit or ``*iB`` is binary, ``*B`` decimal.
"""

from __future__ import annotations

import re

UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})
UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
SIZE = re.compile(r"\s*(\d{1,15}(?:\.\d{1,9})?)\s*([a-zA-Z]{0,3})\s*")
USAGE = "use a size such as 200MB, 100MiB, 1GiB or a number of bytes (0: off)"


def parse_size(text: str) -> int:
    """Bytes from ``200MB`` (10**6), ``100MiB``/``100M`` (2**20), ``4096``: ValueError otherwise."""
    match = SIZE.fullmatch(text) if isinstance(text, str) else None
    unit = UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(f"{text!r} is not a size: {USAGE}")
    number, _, fraction = match.group(1).partition(".")
    return (int(number + fraction) * unit) // 10 ** len(fraction)


def format_size(n: int) -> str:
    """``n`` bytes for people: ``200.0 MiB`` (signed when negative)."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{n} B"
