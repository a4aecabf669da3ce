"""What the HTML page shows around its tests: the session's environment, and the files it links to.

Each test's rank logs and its job's trace are linked with relative links into a folder beside the
page (``report.html`` -> ``report_files/``): logs are copied there when the page is written, traces
are written there (or copied, when ``--msrun-trace`` keeps them elsewhere), so the page and its
folder can be moved, archived or opened from disk together.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import socket
import sys
from typing import Any

import pytest

from pytest_msrun.fileio import WholeFile, private_dir
from pytest_msrun.plugin.options import plugin_loaded

LOG_LIMIT = 16 * 1024 * 1024  # bytes of a rank log copied beside the page (its end, when longer)


def files_dir(page: str) -> str:
    """The folder beside ``page`` its linked files live in."""
    stem, _ = os.path.splitext(os.path.abspath(page))
    return stem + "_files"


def traces_dir(page: str) -> str:
    return os.path.join(files_dir(page), "traces")


def environment(config: pytest.Config) -> dict[str, str]:
    """The session's environment, as the page shows it: versions, the seed, the command, the host."""
    import pytest_msrun

    plugins = sorted(
        {f"{dist.project_name}-{dist.version}" for _, dist in config.pluginmanager.list_plugin_distinfo()},
        key=str.lower,
    )
    env = {
        "python": f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
        "pytest": pytest.__version__,
        "pytest-msrun": pytest_msrun.__version__,
        "plugins": ", ".join(plugins),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "command": shlex.join(["pytest", *config.invocation_params.args]),
        "directory": str(config.invocation_params.dir),
    }
    seed = getattr(config.option, "randomly_seed", None)
    if plugin_loaded(config, "randomly") and isinstance(seed, int):
        env["random seed"] = f"{seed} (pytest-randomly: --randomly-seed={seed} repeats this order)"
    return env


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:80] or "test"


def _copy(source: str, target: str, limit: int | None = None) -> bool:
    """Copy ``source`` to ``target`` (its last ``limit`` bytes), whole or not at all: False when
    ``source`` cannot be read; an error writing ``target`` (a full disk) is raised, and no part of
    the copy is left."""
    try:
        src = open(source, "rb")  # noqa: SIM115 - closed below
    except OSError:
        return False
    with src:
        private_dir(os.path.dirname(target))
        with WholeFile(target) as dst:
            size = os.fstat(src.fileno()).st_size
            if limit is not None and size > limit:
                src.seek(-limit, os.SEEK_END)
                dst.write(f"[msrun: the first bytes of {source} are left out: its last {limit} are kept]\n".encode())
            shutil.copyfileobj(src, dst)
    return True


def _href(path: str, page_dir: str) -> str:
    """``path`` relative to the page's folder, as a URL path (``/`` separated, quoted)."""
    from urllib.parse import quote

    return quote(os.path.relpath(path, page_dir).replace(os.sep, "/"))


def link_files(entries: list[dict[str, Any]], page: str) -> None:
    """Put each test's rank logs and trace beside ``page`` and set their relative links in the
    entries (``log_href`` per rank, ``trace_href`` per test): a trace already in the page's folder
    (or below it) stays where it is."""
    page_dir = os.path.dirname(os.path.abspath(page))
    files = files_dir(page)
    try:  # an earlier session's tests (its traces stay: this session's may be among them)
        stale = [name for name in os.listdir(files) if re.match(r"\d{3}-", name)]
    except OSError:
        stale = []
    for name in stale:
        shutil.rmtree(os.path.join(files, name), ignore_errors=True)
    copied: dict[str, str] = {}  # a world's trace serves several tests: copied once
    for index, entry in enumerate(entries):
        folder = os.path.join(files, f"{index:03d}-{_safe(str(entry.get('nodeid', '')).split('::', 1)[-1])}")
        for rank in entry.get("ranks") or []:
            log = rank.get("log") if isinstance(rank, dict) else None
            if isinstance(log, str) and log:
                target = os.path.join(folder, f"rank{rank.get('rank')}.log")
                if _copy(log, target, LOG_LIMIT):
                    rank["log_href"] = _href(target, page_dir)
        trace = entry.get("trace")
        if not isinstance(trace, str) or not trace or not os.path.isfile(trace):
            continue
        if trace not in copied:
            inside = os.path.abspath(trace).startswith(page_dir + os.sep)
            target = trace if inside else os.path.join(traces_dir(page), os.path.basename(trace))
            copied[trace] = target if inside or _copy(trace, target) else ""
        if copied[trace]:
            entry["trace_href"] = _href(copied[trace], page_dir)
