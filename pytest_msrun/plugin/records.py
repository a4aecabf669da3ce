"""Per-rank result records: one JSON object per line, appended and flushed as they happen.

A rank (re)creates its file, writes ``start``, then one ``report`` per test phase (pytest's own serializable report)
and per failed collection, then ``finish``. A rank that dies mid-test leaves every completed
phase on disk, and the reader tolerates a torn last line. Importing this module does not
import pytest (the ``msrun`` launcher reads these files too).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import IO, Any

REPORT_DIR_ENV = "MSRUN_PYTEST_REPORT_DIR"
SHARED_TMP_ENV = "MSRUN_PYTEST_SHARED_TMP"
BASETEMP_ENV = "MSRUN_PYTEST_BASETEMP"


def records_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"pytest_rank{rank}.jsonl")


def stacks_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"pytest_rank{rank}.stacks")


class RecordWriter:
    """Appends records for one rank; every line is flushed before the call returns."""

    def __init__(self, path: str, rank: int, world: int) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.fh: IO[str] = open(path, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the session
        self.rank = rank
        self.world = world

    def write(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "rank": self.rank, "world": self.world, "ts": time.time(), **fields}
        self.fh.write(json.dumps(record, default=str) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def read_records(path: str) -> Iterator[dict[str, Any]]:
    """Every complete record in ``path`` (a torn or garbled line is skipped)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    break
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "kind" in record:
                    yield record
    except OSError:
        return
