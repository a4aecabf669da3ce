"""The job status file ``<log_dir>/msrun_status.json``: PIDs, ranks, state, exit code, why it stopped.

Written when the job starts and again when it ends (atomically), for ``--join=True`` and for
the detached supervisor of ``--join=False`` alike. :class:`JobStatus` is the one typed form of
it: the launcher writes it, job-end reporters receive it, the pytest plugin reads it back.
"""

from __future__ import annotations

import os
import time

from pytest_msrun.engine import suppress
from pytest_msrun.fileio import write_whole
from pytest_msrun.record import asdict, field, fields, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

STATUS_FILE = "msrun_status.json"


def node_status_file(node_index: int) -> str:
    """The status file of one node of a multi-node job (nodes may share a log directory)."""
    return f"msrun_status_node{node_index}.json"


def status_path(log_dir: str, name: str = STATUS_FILE) -> str:
    return os.path.join(log_dir or ".", name)


@record
class ProcessStatus:
    """One process of the job on this node."""

    name: str
    role: str  # scheduler | worker
    rank: int | None
    pid: int
    log: str
    returncode: int | None = None  # None while it runs; negative: killed by that signal
    started: float = 0.0
    ended: float | None = None
    terminated_by_msrun: bool = False
    settled: str = ""  # its non-zero exit is its own result (it stopped nobody): how, and why
    late: dict[str, Any] | None = None  # it was found past the deadline it set (a Failure's JSON)


@record
class JobStatus:
    """This node's share of a job, as the launcher saw it."""

    job_id: str
    state: str  # running | succeeded | failed | terminated | error
    exit_code: int | None
    supervisor_pid: int
    host: str
    join: bool
    started: float
    node_index: int
    log_dir: str = ""
    processes: list[ProcessStatus] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = ""  # why msrun tore the job down ("" when it ended by itself)
    containment: str = ""  # what keeps the job's processes killable as one (its cgroup, or the sweep)
    notices: list[str] = field(default_factory=list)  # what the control plane told every node (drops, refusals)
    worker_num: int | None = None
    scheduler_mode: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. a dry run's summary

    @property
    def workers(self) -> list[ProcessStatus]:
        return [p for p in self.processes if p.role == "worker"]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobStatus:
        known = {f for f in fields(cls) if f not in ("processes", "extra")}
        procs = [
            ProcessStatus(**{k: v for k, v in p.items() if k in fields(ProcessStatus)})
            for p in data.get("processes", [])
            if isinstance(p, dict)
        ]
        extra = {k: v for k, v in data.items() if k not in known and k not in ("processes", "updated")}
        base: dict[str, Any] = dict(job_id="", state="unknown", exit_code=None, supervisor_pid=0, host="", join=False)
        base.update(started=0.0, node_index=0)
        base.update({k: data.get(k) for k in known if k in data})
        base["stop_reason"] = base.get("stop_reason") or ""
        return cls(processes=procs, extra=extra, **base)


def encode_status(doc: dict[str, Any]) -> str:
    """``doc`` as JSON a person can read - one top-level key per line, one process per line -
    written by the C encoder: ``indent=2`` costs ~1.5 ms per write, on msrun's critical path."""
    import json  # (and re) once the first status is written: after the workers have started

    _encode = json.JSONEncoder().encode  # the C encoder (json.dump with indent runs in pure Python)
    lines = []
    for key, value in doc.items():
        if key == "processes" and isinstance(value, list) and value:
            inner = ",\n    ".join(map(_encode, value))
            lines.append(f"  {_encode(key)}: [\n    {inner}\n  ]")
        else:
            lines.append(f"  {_encode(key)}: {_encode(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_status(log_dir: str, status: JobStatus, name: str = STATUS_FILE) -> None:
    with suppress(OSError):
        write_whole(status_path(log_dir, name), encode_status({**status.to_json(), "updated": time.time()}))


def read_status(log_dir: str, name: str = STATUS_FILE) -> JobStatus | None:
    import json

    try:
        with open(status_path(log_dir, name), encoding="utf-8") as fh:
            data = json.load(fh)
        return JobStatus.from_json(data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None
