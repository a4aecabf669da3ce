"""Per-rank error files: each rank's uncaught exception, as a small JSON record.

msrun names a file in every worker's environment (``MSRUN_ERROR_FILE``, beside the worker's log:
``worker_3.log`` -> ``worker_3.error.json``) and puts a one-file directory first on its
``PYTHONPATH`` whose ``sitecustomize`` records an uncaught exception there (type, message,
traceback, time, pid), then restores ``PYTHONPATH`` and ``sys.path`` and runs the user's own
``sitecustomize``. The root-cause summary reads the record; a rank that died without one
(a signal, ``os._exit``, ``sys.exit``, ``python -I``) is explained from its log instead.

``MSRUN_ERROR_FILES=0`` in msrun's environment turns this off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pytest_msrun.engine import suppress
from pytest_msrun.record import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ERROR_FILE_VAR = "MSRUN_ERROR_FILE"
SWITCH_VAR = "MSRUN_ERROR_FILES"
HOOK_DIR_NAME = "rankhook"
MAX_RECORD_BYTES = 256 * 1024


@record(frozen=True)
class RankError:
    """One rank's uncaught exception."""

    type: str  # "ValueError", "mypkg.errors.Broken"
    message: str
    traceback: str
    time: float
    pid: int

    @property
    def headline(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type}: {first}" if first else self.type


def enabled(env: Mapping[str, str]) -> bool:
    return env.get(SWITCH_VAR, "1").strip().lower() not in ("0", "off", "false", "no")


def beside_log(log_path: str, suffix: str) -> str:
    """A file of the process that logs to ``log_path``: its name without ``.log``, then ``suffix``."""
    return (log_path[: -len(".log")] if log_path.endswith(".log") else log_path) + suffix


def error_file_for(log_path: str) -> str:
    """The error file of the process that logs to ``log_path``."""
    return beside_log(log_path, ".error.json")


def hook_dir(package_root: str) -> str:
    return os.path.join(package_root, "pytest_msrun", "engine", HOOK_DIR_NAME)


def hook_env(package_root: str, base_env: Mapping[str, str], error_file: str) -> dict[str, str]:
    """What a rank's environment needs for its error file (``{}`` when off or not installable)."""
    if not package_root or not enabled(base_env):
        return {}
    path = os.pathsep.join(filter(None, [hook_dir(package_root), base_env.get("PYTHONPATH")]))
    return {ERROR_FILE_VAR: os.path.abspath(error_file), "PYTHONPATH": path}


def clear(path: str) -> None:
    """Remove a previous run's record, so a rank is never blamed for an old exception."""
    with suppress(OSError):
        os.unlink(path)


def read_error(path: str) -> RankError | None:
    """The record at ``path``, or ``None`` when there is none or it is not one."""
    if not path:
        return None
    import json  # not on msrun's start path

    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_RECORD_BYTES + 1)
        data = json.loads(raw.decode("utf-8", errors="replace")) if len(raw) <= MAX_RECORD_BYTES else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    text: dict[str, Any] = {k: data.get(k) for k in ("type", "message", "traceback")}
    if not all(isinstance(v, str) for v in text.values()):
        return None
    when, pid = data.get("time"), data.get("pid")
    return RankError(
        **text, time=float(when) if isinstance(when, (int, float)) else 0.0, pid=pid if isinstance(pid, int) else 0
    )
