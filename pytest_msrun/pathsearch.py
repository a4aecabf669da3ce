"""``which``: find a program on a ``PATH``, as ``shutil.which`` does on POSIX.

Separate from :mod:`shutil`, whose import (``fnmatch``, compression modules) is a measurable
part of msrun's start-up, and which every launch needs: the task's interpreter, ``taskset``,
``numactl``, the programs children run.
"""

from __future__ import annotations

import os


def _runnable(path: str) -> bool:
    return os.access(path, os.F_OK | os.X_OK) and not os.path.isdir(path)


def which(program: str, path: str | None = None) -> str | None:
    """The file ``program`` names - itself when it contains a ``/``, else the first match on
    ``path`` (default ``$PATH``) - if it exists, is executable and is not a directory."""
    if os.sep in program:
        return program if _runnable(program) else None
    if path is None:
        path = os.environ.get("PATH", os.defpath)
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory or os.curdir, program)
        if _runnable(candidate):
            return candidate
    return None
