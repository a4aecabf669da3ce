"""The job status file ``<log_dir>/msrun_status.json``: PIDs, ranks, state, exit code.

Written when the job starts and again when it ends (atomically), for ``--join=True`` and for
the detached supervisor of ``--join=False`` alike.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

STATUS_FILE = "msrun_status.json"


def node_status_file(node_index: int) -> str:
    """The status file of one node of a multi-node job (nodes may share a log directory)."""
    return f"msrun_status_node{node_index}.json"


def status_path(log_dir: str, name: str = STATUS_FILE) -> str:
    return os.path.join(log_dir or ".", name)


def write_status(log_dir: str, data: dict[str, Any], name: str = STATUS_FILE) -> None:
    path = status_path(log_dir, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({**data, "updated": time.time()}, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def read_status(log_dir: str, name: str = STATUS_FILE) -> dict[str, Any] | None:
    try:
        with open(status_path(log_dir, name), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None
