"""Fixtures for tests that run as ranks: ``rank``, ``world_size``, ``local_rank``, ``msrun``,
``msrun_tmp_path``. Outside a job (a plain test, or ``--msrun-inprocess``) they describe a
world of one rank."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_msrun.plugin.env import RANK, current_local_rank, current_local_world, current_rank, current_world, role
from pytest_msrun.plugin.records import SHARED_TMP_ENV

ENV_PREFIXES = ("MS_", "RANK", "DEVICE_ID", "LOCAL_", "WORLD_SIZE", "GROUP_", "MASTER_", "MSRUN_")


@dataclass
class MsrunContext:
    """The job as seen from one rank; collectives go through :mod:`pytest_msrun.control.cluster`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    tmp_path: Path
    log_dir: Path | None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def is_dryrun(self) -> bool:
        from pytest_msrun import cluster

        return cluster.is_dryrun()

    def _group(self) -> Any:
        from pytest_msrun import cluster

        cluster.init()
        return cluster

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every rank of the job reached this point."""
        self._group().barrier(timeout)

    def all_gather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's ``obj``, indexed by rank."""
        return self._group().all_gather_object(obj, timeout)

    def broadcast(self, obj: Any = None, src: int = 0, timeout: float | None = None) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        return self._group().broadcast_object(obj, src, timeout)


@pytest.fixture
def rank() -> int:
    """This process's global rank (0 outside a job)."""
    return current_rank()


@pytest.fixture
def world_size() -> int:
    """Number of ranks in the job (1 outside a job)."""
    return current_world()


@pytest.fixture
def local_rank() -> int:
    """This rank's index on its node."""
    return current_local_rank()


@pytest.fixture
def msrun_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A directory shared by every rank of the job running this test (``tmp_path`` outside a job)."""
    shared = os.environ.get(SHARED_TMP_ENV)
    if shared and role() == RANK:
        path = Path(shared)
    elif role() == RANK:
        digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]
        base = os.path.abspath(os.environ.get("MSRUN_LOG_DIR") or ".")
        path = Path(base) / "msrun_shared" / f"{request.node.name[:40]}-{digest}"
    else:
        return tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def msrun(msrun_tmp_path: Path) -> MsrunContext:
    """Rank, sizes, environment, log dir, shared tmp dir and collectives of this test's job."""
    in_job = role() == RANK
    log_dir = os.environ.get("MSRUN_LOG_DIR") if in_job else None
    return MsrunContext(
        rank=current_rank(),
        world_size=current_world(),
        local_rank=current_local_rank(),
        local_world_size=current_local_world(),
        tmp_path=msrun_tmp_path,
        log_dir=Path(os.path.abspath(log_dir or ".")) if in_job else None,
        env={k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) and k != "MSRUN_JOB_TOKEN"}
        if in_job
        else {},
    )
