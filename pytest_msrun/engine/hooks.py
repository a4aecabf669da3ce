"""Job-end reporters: a neutral extension point between the launcher and what runs inside a job.

Any process of a job may ask msrun to run a reporter when the job ends, by registering
``module:function`` under a name in ``<log_dir>/msrun_hooks/`` (:func:`register`). After a
``--join=True`` job, msrun calls each registered function with the job's :class:`JobStatus` and
prints what it returns - so, for example, ``msrun pytest tests/`` ends with one table of every
test on every rank, while msrun itself knows nothing about pytest. A reporter may also return
the job's verdict as an exit status (a :class:`JobReport`): the table of a suite decides whether
the suite failed, not only how the ranks' processes exited. Listing the directory is the whole
cost for jobs that register nothing. Only files owned by msrun's own user count.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pytest_msrun.engine.status import JobStatus
from pytest_msrun.fileio import private_dir, write_whole
from pytest_msrun.record import record
from pytest_msrun.targets import TARGETS, resolve

HOOK_DIR = "msrun_hooks"


@record
class JobReport:
    """What a job-end reporter says: its text, and the job's exit status as it judges it (None:
    msrun's own stands); for a traced job, a one-line ``summary`` said at the trace's end and
    ``trace``, what it adds to the trace (events; called only when the job is traced)."""

    text: str
    exit_code: int | None = None
    summary: str = ""
    trace: Callable[[], list[dict[str, Any]]] | None = None


def register(log_dir: str, name: str, target: str, job_id: str = "") -> None:
    """Ask msrun to call ``target`` (``module:function``) with the job's status when the job ends
    (``job_id``: the job asking, ``MSRUN_JOB_ID`` - a log directory may be used again)."""
    directory = private_dir(os.path.join(log_dir or ".", HOOK_DIR))
    write_whole(os.path.join(directory, name), f"{target}\n{job_id}\n")


def registered(log_dir: str, job_id: str = "") -> list[tuple[str, str]]:
    """``(name, target)`` of every reporter registered in ``log_dir`` by this user's processes -
    with ``job_id``, not those an earlier job registered there (its ranks' records would be read
    as this job's: a job whose ranks ended before registering printed the last job's table)."""
    directory = os.path.join(log_dir or ".", HOOK_DIR)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    out = []
    for name in names:
        if name.endswith(".tmp"):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(path, encoding="utf-8") as fh:
                target, _, theirs = fh.read().strip().partition("\n")
        except OSError:
            continue
        if target in TARGETS and not (job_id and theirs and theirs != job_id):
            out.append((name, target))
    return out


def run_job_end(status: JobStatus) -> list[JobReport]:
    """Call every registered reporter; return what they said (a broken reporter says so, in one line)."""
    out: list[JobReport] = []
    for name, target in registered(status.log_dir, status.job_id):
        try:
            reporter: Callable[[JobStatus], str | JobReport | None] = resolve(target)
            said = reporter(status)
        except Exception as exc:  # a reporter never breaks the launcher
            said = f"msrun: job-end reporter {name!r} ({target}) failed: {exc!r}"
        if isinstance(said, JobReport):
            out.append(said)
        elif said:
            out.append(JobReport(str(said)))
    return out
