"""``msrun pytest tests/``: after the job, one table of every test on every rank - and the job's verdict.

Each rank's pytest registers this reporter with msrun (:mod:`pytest_msrun.engine.hooks`) and writes its
records into the job's log directory; when the job ends msrun calls :func:`job_report` with the
job's status. Verdicts come from :mod:`.verdict` - the rule plugin mode uses - fed with how every
rank's process ended: a rank that died inside a test failed that test (with its signal or exit
status), a rank that died or hung after its last test failed that test's teardown, a rank msrun
stopped is shown as stopped, a test a rank never began did not run there. A test that ran out of
time is shown with where every rank was. msrun's exit status is the table's: 0 exactly when every
test passed, skipped or xfailed on every rank (and the job itself did not fail), else msrun's own
status if it has one, else 1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pytest_msrun.engine.hooks import JobReport
from pytest_msrun.engine.status import JobStatus
from pytest_msrun.fileio import make_dirs, write_whole
from pytest_msrun.plugin.reports.extras import suite_lines
from pytest_msrun.plugin.reports.hang import diagnosis, grouped
from pytest_msrun.plugin.reports.tracetests import lanes, rank_rows, tally, test_events
from pytest_msrun.plugin.rule.outcomes import PASSING, RankEnd, TestVerdict, ranks_text, was
from pytest_msrun.plugin.rule.records import (
    CACHE_FILE,
    LASTFAILED,
    STEPWISE,
    STEPWISE_FILE,
    RankLog,
    load_rank_log,
    records_path,
    stacks_path,
)
from pytest_msrun.plugin.rule.testrecord import suite_records
from pytest_msrun.plugin.stdstreams import read_log
from pytest_msrun.waiting import wait_until


def job_report(status: JobStatus) -> JobReport | None:
    """The table of the job's ranks and the exit status it decides, or None when no rank of this job
    ran pytest.

    On several nodes sharing the log directory (a cluster's shared filesystem, or loopback
    invocations), node 0 prints one table of every node's ranks, after waiting briefly for the
    other nodes' final status; the other nodes print one line saying so (and keep msrun's status)."""
    directory = os.path.abspath(status.log_dir or ".")
    dry_run = status.extra.get("dry_run") if isinstance(status.extra, dict) else None
    if isinstance(dry_run, dict):
        return _dry_run_report(directory, status, dry_run)
    statuses = [status]
    local = [p.rank for p in status.workers if p.rank is not None]
    several = bool(status.worker_num) and len(local) < (status.worker_num or 0)
    if several:
        if status.node_index != 0:
            mine, _ = _pytest_ranks(directory, [status])
            if not mine:
                return None
            text = (
                f"msrun: node 0 prints the pytest results of every node (this node: ranks {ranks_text(sorted(mine))})"
            )
            return JobReport(text)
        statuses = _sibling_statuses(directory, status)
    logs, ends = _pytest_ranks(directory, statuses)
    if not logs:
        return None
    table = render(directory, logs, ends)
    update_cache(directory, table.outcomes)
    text = table.text
    passed = table.passed
    missing: list[int] = []
    if several:
        missing = sorted(set(range(status.worker_num or 0)) - {p.rank for n in statuses for p in n.workers})
        if missing:
            passed = False
            text += (
                f"\nmsrun: no final status from the nodes of ranks {ranks_text(missing)} in {directory} within "
                f"{SIBLING_WAIT:g} s (every node must write its logs into a directory node 0 can read)"
            )
    code = status.exit_code or 0
    if passed and code != 0 and status.state != "succeeded" and not _explained(status, ends):
        passed = False
        text += f"\nmsrun: the job itself failed ({status.stop_reason or status.state}) although every test passed"
    verdict = 0 if passed else (code or 1)
    if table.none_ran and not missing and code in (0, NO_TESTS_COLLECTED):
        verdict = NO_TESTS_COLLECTED  # pytest's status when it ran nothing (every rank skipped at collection)
    if verdict != code:
        text += f"\nmsrun: exit status {verdict}, as the pytest results above decide (the processes' own: {code})"
    return JobReport(text, verdict, f"tests: {tally(table.outcomes.values())}", _trace(table.verdicts, logs))


def _trace(judged: list[TestVerdict], logs: dict[int, RankLog]) -> Callable[[], list[dict[str, Any]]]:
    """The suite's tests in the job's trace (built only when the job is traced)."""

    def events() -> list[dict[str, Any]]:
        until = time.time()
        out = [*lanes(), *rank_rows(sorted(logs))]
        for v in judged:
            out += test_events(v, v.outcome, logs, until)
        return out

    return events


def update_cache(directory: str, outcomes: dict[str, str]) -> None:
    """pytest's last-failed set (``--lf``, ``--ff``) from the job's verdicts, and ``--sw``'s state:
    in a suite no rank writes them (one that ended first would change what a later one selects),
    msrun does, once, as pytest's own cache plugins would from these results: the stepwise state
    is that of the rank whose failure comes first in the suite's order (as that rank wrote it)."""
    import json

    try:
        with open(os.path.join(directory, CACHE_FILE), encoding="utf-8") as fh:
            held = json.load(fh)
        cache_dir, lastfailed = str(held["cache_dir"]), dict(held["lastfailed"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # no cache in this suite (-p no:cacheprovider), or not rank 0's records
    for nodeid, outcome in outcomes.items():
        if outcome in PASSING:
            lastfailed.pop(nodeid, None)
        elif outcome != "not run":
            lastfailed[nodeid] = True
    values: dict[str, Any] = {LASTFAILED: lastfailed}
    stepwise = _first_stepwise(directory, list(outcomes))
    if stepwise is not None:
        values[STEPWISE] = stepwise[0]
    try:  # pytest's cache directory, in the project: made as pytest makes it, written whole
        new = not os.path.isdir(cache_dir)
        for key, value in values.items():
            path = os.path.join(cache_dir, "v", *key.split("/"))
            make_dirs(os.path.dirname(path))
            write_whole(path, json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True))
        if new:
            write_whole(os.path.join(cache_dir, ".gitignore"), "# Created by pytest automatically.\n*\n")
    except OSError:
        pass


def _first_stepwise(directory: str, order: list[str]) -> tuple[Any] | None:
    """The ``--sw`` state a rank would have written (None: no rank wrote one) - of the rank whose
    last failed test comes first in ``order``, else any rank's (none failed)."""
    import glob
    import json

    states = []
    for path in sorted(glob.glob(os.path.join(directory, STEPWISE_FILE.format(rank="*")))):
        try:
            with open(path, encoding="utf-8") as fh:
                states.append(json.load(fh))
        except (OSError, ValueError):
            continue
    if not states:
        return None
    place = {nodeid: i for i, nodeid in enumerate(order)}

    def failed_at(state: Any) -> int:
        nodeid = state.get("last_failed") if isinstance(state, dict) else state  # (older pytest: the node id)
        return place.get(nodeid, len(place)) if isinstance(nodeid, str) else len(place) + 1

    return (min(states, key=failed_at),)


def _dry_run_report(directory: str, status: JobStatus, summary: dict[str, Any]) -> JobReport | None:
    """A dry run's table: its simulated ranks ran in waves and were forgotten as they ended (the
    status lists none), so they are found by their records; those the summary lists failed."""
    import glob

    from pytest_msrun.cpulist import parse_id_list

    try:
        failed = set(parse_id_list(str(summary.get("failed_ranks") or ""), "rank", 1 << 30))
    except ValueError:
        failed = set()
    logs: dict[int, RankLog] = {}
    ends: dict[int, RankEnd] = {}
    for path in glob.glob(os.path.join(directory, "pytest_rank*.jsonl")):
        digits = os.path.basename(path)[len("pytest_rank") : -len(".jsonl")]
        if not digits.isdigit():
            continue
        rank = int(digits)
        log = load_rank_log(path, rank)
        if not log.started or log.start_ts < status.started - 1:
            continue  # records of an earlier job
        logs[rank] = log
        ends[rank] = RankEnd(returncode=1 if rank in failed else 0, pid=log.pid, log=log.log, host=status.host)
    if not logs:
        return None
    table = render(directory, logs, ends)
    return JobReport(table.text, 0 if table.passed else (status.exit_code or 1))


def _explained(status: JobStatus, ends: dict[int, RankEnd]) -> bool:
    """Whether msrun's failure is only ranks' exits the table already judged (a rank's pytest exit 1)."""
    labels = {f"rank {rank}" for rank in ends}
    return bool(status.failures) and all(isinstance(f, dict) and f.get("label") in labels for f in status.failures)


NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED (msrun's side imports no pytest)
SIBLING_WAIT = 10.0  # how long node 0 waits for the other nodes' final status


def _pytest_ranks(directory: str, statuses: list[JobStatus]) -> tuple[dict[int, RankLog], dict[int, RankEnd]]:
    """The records and ends of the ranks of ``statuses`` that ran pytest in this job."""
    logs: dict[int, RankLog] = {}
    ends: dict[int, RankEnd] = {}
    for node in statuses:
        for proc in node.workers:
            if proc.rank is None:
                continue
            late = proc.late if isinstance(proc.late, dict) else None
            cutoff = float(late.get("due") or 0.0) if late else None  # frozen at its deadline
            log = load_rank_log(records_path(directory, proc.rank), proc.rank, cutoff_ts=cutoff)
            earlier = log.start_ts < node.started - 1 or (log.job and node.job_id and log.job != node.job_id)
            if log.started and earlier:
                log = RankLog(proc.rank)  # records of an earlier job (in a log directory used again)
            elif late:
                log.past_deadline(late)
            logs[proc.rank] = log
            ends[proc.rank] = RankEnd.of(proc, node.stop_reason, node.host)
    if not any(log.started for log in logs.values()):
        return {}, {}  # no rank of this job ran pytest
    return logs, ends  # a rank stopped before its pytest began is in the table: it ran nothing


def _sibling_statuses(directory: str, status: JobStatus) -> list[JobStatus]:
    """This node's status and every other node's final one (same job), once all ranks are covered
    or after :data:`SIBLING_WAIT`."""
    import glob

    from pytest_msrun.engine.status import read_status

    want = set(range(status.worker_num or 0))
    found: dict[int, JobStatus] = {}

    def covered() -> bool:
        found.clear()
        found[status.node_index] = status
        for path in glob.glob(os.path.join(directory, "msrun_status_node*.json")):
            other = read_status(directory, os.path.basename(path))
            if other is not None and other.job_id == status.job_id and other.state != "running":
                found.setdefault(other.node_index, other)
        return want <= {p.rank for n in found.values() for p in n.workers if p.rank is not None}

    wait_until(covered, SIBLING_WAIT, 0.05)
    return [found[k] for k in sorted(found)]


@dataclass
class Table:
    """The suite's table and whether it passed (every test passed, skipped or xfailed on every rank)."""

    text: str
    passed: bool
    none_ran: bool = False  # no test ran on any rank and nothing failed: pytest's exit status 5
    outcomes: dict[str, str] = field(default_factory=dict)  # nodeid -> the test's verdict
    verdicts: list[TestVerdict] = field(default_factory=list)


def render(directory: str, logs: dict[int, RankLog], ends: dict[int, RankEnd]) -> Table:
    ranks = sorted(logs)
    judged = [record.verdict for record in suite_records(logs, ends, time.time())]  # in the order ranks ran them
    collect_errors = {r: len(logs[r].collect_errors) for r in ranks if logs[r].collect_errors}

    rows = [("test", *(f"rank {r}" for r in ranks), "verdict")]
    if collect_errors:
        rows.append(("<collection>", *("error" if r in collect_errors else "ok" for r in ranks), "error"))
    for v in judged:
        rows.append((v.nodeid, *(v.cells[r] for r in ranks), v.outcome))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"msrun: pytest results of {len(ranks)} rank(s) (records in {directory})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]

    for v in judged:
        lines += _explain(v, directory, logs, ends)
    for rank, count in collect_errors.items():
        lines.append(f"ERROR collecting on rank {rank}: {count} collection error(s), see its log")
    unfinished = [r for r in ranks if not logs[r].finished]
    for rank in unfinished:
        end = ends.get(rank) or RankEnd()
        where = logs[rank].last_test
        did = "finish" if logs[rank].started else "start"
        lines.append(
            f"rank {rank}: its pytest session did not {did} - it {was(end.describe(False))}"
            + (f" in {where}" if where else "")
        )
    never = [r for r in unfinished if not logs[r].tests]  # died before its first test (not in any row)
    hosts = grouped({r: ends[r].host for r in ranks if r in ends and ends[r].host})
    if len(hosts) > 1:
        lines.append("msrun: hosts: " + "; ".join(f"{h}: ranks {ranks_text(r)}" for h, r in hosts.items()))
    lines += suite_lines((v.nodeid for v in judged), logs)
    lines.append(f"msrun: {len(judged)} test(s): {tally(v.outcome for v in judged)}")
    passed = bool(judged) and all(v.passing for v in judged) and not collect_errors and not never
    none_ran = not judged and not collect_errors and not never
    return Table("\n".join(lines), passed, none_ran, {v.nodeid: v.outcome for v in judged}, judged)


def _explain(v: TestVerdict, directory: str, logs: dict[int, RankLog], ends: dict[int, RankEnd]) -> list[str]:
    if v.outcome == "incomplete":
        why = []
        if v.not_run:
            why.append(f"not run on ranks {ranks_text(v.not_run)}")
        stopped = [r for r, cell in v.cells.items() if cell == "stopped"]
        if stopped:
            reason = (ends.get(stopped[0]) or RankEnd()).stop_reason
            why.append(f"stopped by msrun on ranks {ranks_text(stopped)}" + (f" ({reason})" if reason else ""))
        if v.note:
            why.append(v.note)
        return [f"INCOMPLETE {v.nodeid}: {'; '.join(why)}"]
    if v.outcome not in ("failed", "error"):
        return []
    first = v.first_issue
    failing = v.failing_ranks
    head = f"FAILED {v.nodeid}" + (f" on rank(s) {ranks_text(failing)}" if failing else "")
    out = [head + (f": {first.summary}" if first is not None else "")]
    for phase in v.phases:
        if phase.message:
            out.append(f"  {phase.message}")
    timed = [r for r in logs if logs[r].test(v.nodeid).timeout is not None]
    if timed:
        record = logs[timed[0]].test(v.nodeid).timeout or {}
        # a rank that timed out recorded its stack then; the others dumped theirs when msrun stopped them
        dumps = {
            r: (logs[r].test(v.nodeid).timeout or {}).get("stack") or read_log(stacks_path(directory, r), 0)
            for r in logs
        }
        threads = {r: logs[r].main_thread for r in logs}
        here = [r for r in logs if logs[r].test(v.nodeid).started]
        no_stack = {r: (ends.get(r) or RankEnd()).describe(False) for r in here}
        text = diagnosis(dumps, threads, sorted(here), record.get("state"), no_stack)
        out += ["  " + line for line in text.splitlines()]
    return out
