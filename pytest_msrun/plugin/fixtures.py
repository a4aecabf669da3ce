"""Fixtures for tests that run as ranks: ``rank``, ``world_size``, ``local_rank``, ``msrun``,
``msrun_tmp_path``. Outside a job (a plain test, or ``--msrun-inprocess``) they describe a
world of one rank.

``rank``, ``world_size``, ``local_rank`` and ``msrun`` are session-scoped - a rank's identity
does not change while its process lives - so fixtures of any scope can use them (a module
fixture of a warm world, say); ``msrun.tmp_path`` is the current test's shared directory."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_msrun.fileio import private_dir
from pytest_msrun.plugin.env import RANK, current_local_rank, current_local_world, current_rank, current_world, role
from pytest_msrun.plugin.rule.records import SHARED_TMP_ENV

# pytest leaves these thin wrappers out of a failure's traceback (``--full-trace`` shows them)
__tracebackhide__ = True

ENV_PREFIXES = ("MS_", "RANK", "DEVICE_ID", "LOCAL_", "WORLD_SIZE", "GROUP_", "MASTER_", "MSRUN_")


@dataclass(repr=False)
class MsrunContext:
    """The job as seen from one rank; collectives go through :mod:`pytest_msrun.control.cluster`.

    Its repr is short (``<msrun rank 1/2>``): pytest shows it in every failure that names the
    fixture (arguments, ``--showlocals``, assertion introspection); the fields hold the rest."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    shared_dir: Callable[[], Path]
    log_dir: Path | None
    env: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"<msrun rank {self.rank}/{self.world_size}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """As :meth:`__repr__` where a pretty printer would list the fields (hypothesis's
        falsifying example printed the whole environment)."""
        printer.text(repr(self))

    @property
    def tmp_path(self) -> Path:
        """A directory shared by every rank for the test running now (see ``msrun_tmp_path``)."""
        return self.shared_dir()

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


@pytest.fixture(scope="session")
def rank() -> int:
    """This process's global rank (0 outside a job)."""
    return current_rank()


@pytest.fixture(scope="session")
def world_size() -> int:
    """Number of ranks in the job (1 outside a job)."""
    return current_world()


@pytest.fixture(scope="session")
def local_rank() -> int:
    """This rank's index on its node."""
    return current_local_rank()


def _job_shared_dir(nodeid: str, name: str) -> Path:
    """In a rank: the directory every rank of this job sees for test ``nodeid``."""
    shared = os.environ.get(SHARED_TMP_ENV)
    if shared:
        path = Path(shared)
    else:  # suite mode (msrun ... pytest): one per test under the job's log directory
        digest = hashlib.sha1(nodeid.encode()).hexdigest()[:12]
        base = os.path.abspath(os.environ.get("MSRUN_LOG_DIR") or ".")
        path = Path(base) / "msrun_shared" / f"{name[:40]}-{digest}"
    private_dir(str(path))  # every rank makes it or finds it: made new, or checked as this user's alone
    return path


@pytest.fixture
def msrun_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A directory shared by every rank of the job running this test (``tmp_path`` outside a job)."""
    if role() != RANK:
        return tmp_path
    return _job_shared_dir(request.node.nodeid, request.node.name)


@pytest.fixture(scope="session")
def msrun(tmp_path_factory: pytest.TempPathFactory) -> MsrunContext:
    """Rank, sizes, environment, log dir, shared tmp dir and collectives of this test's job."""
    in_job = role() == RANK
    outside: list[Path] = []

    def shared_dir() -> Path:
        if in_job:  # the test running now: pytest's PYTEST_CURRENT_TEST
            nodeid = os.environ.get("PYTEST_CURRENT_TEST", "session").rsplit(" (", 1)[0]
            return _job_shared_dir(nodeid, nodeid.rsplit("::", 1)[-1])
        if not outside:  # a world of one: a directory of this session
            outside.append(tmp_path_factory.mktemp("msrun_shared"))
        return outside[0]

    return MsrunContext(
        rank=current_rank(),
        world_size=current_world(),
        local_rank=current_local_rank(),
        local_world_size=current_local_world(),
        shared_dir=shared_dir,
        log_dir=Path(os.path.abspath(os.environ.get("MSRUN_LOG_DIR") or ".")) if in_job else None,
        env={k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) and k != "MSRUN_JOB_TOKEN"}
        if in_job
        else {},
    )
