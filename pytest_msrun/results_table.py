"""``msrun pytest ...``: one table of every test's outcome on every rank, printed by msrun.

Each rank's pytest writes ``pytest_rank<N>.jsonl`` into the job's log directory (see
:mod:`pytest_msrun.plugin.records`); after the job msrun folds them into a table and names the
failed tests with their ranks. Nothing here imports pytest.
"""

from __future__ import annotations

import os

from pytest_msrun.plugin.records import read_records, records_path

ORDER = ("error", "failed", "xfailed", "xpassed", "skipped", "passed")  # worst first


def _severity(outcome: str) -> int:
    return ORDER.index(outcome) if outcome in ORDER else 0


def _phase_outcome(data: dict) -> str:
    outcome = data.get("outcome", "")
    when = data.get("when", "call")
    if "wasxfail" in data:
        return "xfailed" if outcome == "skipped" else "xpassed"
    if outcome == "failed":
        return "failed" if when == "call" else "error"
    return outcome


def rank_outcomes(path: str) -> tuple[dict[str, str], bool]:
    """Test outcome per node id for one rank, and whether its session finished."""
    out: dict[str, str] = {}
    finished = False
    for record in read_records(path):
        if record["kind"] == "finish":
            finished = True
        elif record["kind"] == "collect":
            nodeid = record.get("data", {}).get("nodeid", "?")
            out[nodeid or "<collection>"] = "error"
        elif record["kind"] == "report":
            data = record.get("data", {})
            nodeid = data.get("nodeid", "?")
            new = _phase_outcome(data)
            old = out.get(nodeid)
            if old is None or _severity(new) < _severity(old):
                out[nodeid] = new
    return out, finished


def render_table(log_dir: str, ranks: list[int], since: float = 0.0) -> str:
    """The table for ``ranks`` whose record files were written after ``since`` ("" if none)."""
    per_rank: dict[int, dict[str, str]] = {}
    unfinished: list[int] = []
    for rank in ranks:
        path = records_path(log_dir or ".", rank)
        try:
            if os.path.getmtime(path) < since:
                continue
        except OSError:
            continue
        outcomes, finished = rank_outcomes(path)
        per_rank[rank] = outcomes
        if not finished:
            unfinished.append(rank)
    if not per_rank:
        return ""
    tests: list[str] = []
    for outcomes in per_rank.values():
        for nodeid in outcomes:
            if nodeid not in tests:
                tests.append(nodeid)
    cols = sorted(per_rank)
    width = max([len("test"), *(len(t) for t in tests)])
    lines = [f"msrun: pytest results of {len(cols)} rank(s) (records in {os.path.abspath(log_dir or '.')})"]
    lines.append("test".ljust(width) + "".join(f"  rank {r:<4}" for r in cols))
    failed: dict[str, list[int]] = {}
    for nodeid in tests:
        cells = []
        for r in cols:
            outcome = per_rank[r].get(nodeid, "-" if r not in unfinished else "missing")
            cells.append(f"  {outcome:<9}")
            if outcome in ("failed", "error", "missing"):
                failed.setdefault(nodeid, []).append(r)
        lines.append(nodeid.ljust(width) + "".join(cells))
    for nodeid, bad in failed.items():
        lines.append(f"FAILED {nodeid} on rank(s) {', '.join(map(str, bad))}")
    for r in unfinished:
        lines.append(f"rank {r}: its pytest session did not finish (crashed or was killed)")
    lines.append(
        f"{len(tests) - len(failed)} of {len(tests)} test(s) failed on no rank; {len(failed)} failed on some rank"
    )
    return "\n".join(lines)
