"""How what ranks recorded beyond their reports folds into one (pure rules; no pytest here).

* warnings: each distinct one (category, message, place) once, with the ranks that raised it;
* subtests: failed where any rank failed it, else xfailed where any rank xfailed it, skipped where
  every rank skipped it, else passed;
* user properties: a pair every rank recorded once, as recorded; any other as ``name [rank r]``.

The controller's session shows them through pytest's hooks (:mod:`.replay`); a suite's table
(:mod:`.suite`) prints them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pytest_msrun.plugin.rule.outcomes import ranks_text

SUBTEST = "SubTestReport"


def rank_label(ranks: Iterable[int]) -> str:
    ranks = sorted(set(ranks))
    return f"[rank {ranks[0]}]" if len(ranks) == 1 else f"[ranks {ranks_text(ranks)}]"


def property_label(name: str, rank: int) -> str:
    return f"{name} [rank {rank}]"


def attribute_label(name: str, rank: int) -> str:
    """An XML attribute's name cannot hold spaces or brackets: ``name_rank1``."""
    return f"{name}_rank{rank}"


def merge_properties(
    per_rank: Mapping[int, Sequence[tuple[str, Any]]], label: Callable[[str, int], str] = property_label
) -> list[tuple[str, Any]]:
    """One list of ``(name, value)`` from every rank's: a pair every rank recorded appears once
    as it is; any other pair as ``name [rank r]`` (``label``) - so no rank's value is lost or
    misattributed."""
    ranks = sorted(per_rank)
    shared: list[tuple[str, Any]] = []
    for name, value in per_rank[ranks[0]] if ranks else []:
        if (name, value) not in shared and all((name, value) in per_rank[r] for r in ranks):
            shared.append((name, value))
    return shared + [(label(n, r), v) for r in ranks for n, v in per_rank[r] if (n, v) not in shared]


def subtest_key(data: Mapping[str, Any]) -> str:
    context = data.get("_subtest.context") or {}
    msg = context.get("msg") if isinstance(context, dict) else None
    kwargs = context.get("kwargs") if isinstance(context, dict) else None
    items = sorted((str(k), repr(v)) for k, v in kwargs.items()) if isinstance(kwargs, dict) else []
    return repr((msg, items))


@dataclasses.dataclass(frozen=True)
class MergedSubtest:
    outcome: str  # passed, failed, xfailed, skipped
    shown: int  # the rank whose report stands for it
    reports: dict[int, dict[str, Any]]  # rank -> its report of this subtest
    failed: list[int]


def merge_subtests(per_rank: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[MergedSubtest]:
    """Subtests in the order ranks ran them (the lowest rank's order first): failed where any rank
    failed it, else xfailed where any rank xfailed it, skipped where every rank skipped it, else
    passed."""
    reports: dict[str, dict[int, dict[str, Any]]] = {}
    for rank in sorted(per_rank):
        for data in per_rank[rank]:
            reports.setdefault(subtest_key(data), {}).setdefault(rank, dict(data))  # a context used twice: its first
    out = []
    for by_rank in reports.values():
        outcomes = {r: _subtest_outcome(d) for r, d in by_rank.items()}
        failed = sorted(r for r, o in outcomes.items() if o == "failed")
        xfailed = sorted(r for r, o in outcomes.items() if o == "xfailed")
        if failed:
            outcome, shown = "failed", failed[0]
        elif xfailed:  # failed where it was expected to: shown as pytest shows it (SUBXFAIL)
            outcome, shown = "xfailed", xfailed[0]
        elif all(o == "skipped" for o in outcomes.values()):
            outcome, shown = "skipped", min(outcomes)
        else:
            outcome, shown = "passed", min(r for r, o in outcomes.items() if o != "skipped")
        out.append(MergedSubtest(outcome, shown, by_rank, failed))
    return out


def _subtest_outcome(data: Mapping[str, Any]) -> str:
    outcome = str(data.get("outcome"))
    return "xfailed" if outcome == "skipped" and "wasxfail" in data else outcome


def group_warnings(per_rank: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[tuple[list[int], dict[str, Any]]]:
    """Each distinct warning (category, message, place) once, with the ranks that raised it."""
    groups: dict[tuple[Any, ...], tuple[list[int], dict[str, Any]]] = {}
    for rank in sorted(per_rank):
        for record in per_rank[rank]:
            key = tuple(record.get(k) for k in ("module", "category", "message", "filename", "lineno"))
            ranks, _ = groups.setdefault(key, ([], dict(record)))
            if rank not in ranks:
                ranks.append(rank)
    return list(groups.values())


def subtests_of(test: Any) -> list[dict[str, Any]]:
    """A rank's subtest reports of one test's call (``test``: its :class:`~.records.RankTest`)."""
    return [d for d in test.more.get("call", []) if d.get("_report_type") == SUBTEST]


def suite_lines(nodeids: Iterable[str], logs: Mapping[int, Any]) -> list[str]:
    """A suite's table's lines of what its ranks recorded beyond verdicts: each distinct warning
    of each test with the ranks that raised it, and how many subtests passed, failed, skipped."""
    warned: list[str] = []
    counts = {"passed": 0, "failed": 0, "xfailed": 0, "skipped": 0}
    for nodeid in nodeids:
        tests = {rank: log.test(nodeid) for rank, log in sorted(logs.items())}
        for ranks, rec in group_warnings({r: t.warnings for r, t in tests.items() if t.warnings}):
            where = f"{rec.get('filename')}:{rec.get('lineno')}"
            warned.append(f"  {nodeid} {rank_label(ranks)}: {where}: {rec.get('category')}: {rec.get('message')}")
        for entry in merge_subtests({r: s for r, t in tests.items() if (s := subtests_of(t))}):
            counts[entry.outcome] += 1
    out = []
    if warned:
        out.append(f"msrun: warnings ({len(warned)}):")
        out += warned
    if any(counts.values()):
        out.append("msrun: subtests: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    return out


# What pytest itself puts in a report's JSON; any other key is a plugin's (pytest-html's ``extras``,
# hypothesis's statistics, ...) and travels on as pytest-xdist carries it from its workers.
REPORT_KEYS = frozenset(
    {
        "nodeid", "location", "keywords", "outcome", "longrepr", "when", "user_properties", "sections",
        "duration", "start", "stop", "$report_type", "_report_type", "_subtest.context", "wasxfail", "_ts",
        # the controller's session's own: reruns (pytest-rerunfailures), distribution (pytest-xdist)
        "rerun", "node", "worker_id", "testrun_uid", "item_index",
    }
)  # fmt: skip


def carried_attributes(per_rank: Mapping[int, Mapping[str, Any]], shown: int | None) -> dict[str, Any]:
    """Plugins' attributes of the ranks' reports of one phase, for the merged report: ``extras``
    (pytest-html) from every rank, in rank order, each named with its rank; any other from the
    rank the report shows (its first failing rank, else the lowest)."""
    out: dict[str, Any] = {}
    extras: list[Any] = []
    for rank in sorted(per_rank):
        for extra in per_rank[rank].get("extras") or []:
            if isinstance(extra, dict):
                name = extra.get("name")
                extras.append({**extra, "name": f"{name} [rank {rank}]" if name else f"rank {rank}"})
    if extras:
        out["extras"] = extras
    if shown not in per_rank:
        shown = min(per_rank) if per_rank else None
    for key, value in (per_rank[shown] if shown is not None else {}).items():
        if key not in REPORT_KEYS and key != "extras" and not key.startswith("msrun_"):
            out[key] = value
    return out
