"""Where this pytest process runs, decided once at start-up.

* ``rank`` - a worker this project's msrun started (it sets ``MSRUN_PLUGIN_ROLE=worker`` for the
  plugin and nobody else does); ``scheduler`` - its scheduler (``--scheduler=task``).
* ``foreign`` - a process of another launcher's job (MindSpore's own msrun, torchrun, mpirun):
  marked tests run in place with that job's ranks, and nothing is written.
* ``controller`` - everything else: marked tests become jobs.

The role variable is removed from this process's environment once read, so a pytest started
from inside a rank (``pytester.runpytest_subprocess``, say) is a controller again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pytest_msrun.engine.childenv import PLUGIN_ROLE_VAR

CONTROLLER, RANK, SCHEDULER, FOREIGN = "controller", "rank", "scheduler", "foreign"

# Another launcher's job: a variable it sets, then (rank, world size) variables in preference order.
FOREIGN_LAUNCHERS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("MS_ROLE", ("RANK_ID",), ("RANK_SIZE", "MS_WORKER_NUM")),  # MindSpore's msrun
    ("MS_SIMULATION_LEVEL", ("RANK_ID",), ("RANK_SIZE",)),  # MindSpore's msrun, dry run
    ("TORCHELASTIC_RUN_ID", ("RANK",), ("WORLD_SIZE",)),  # torchrun
    ("OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",)),  # Open MPI
    ("PMI_SIZE", ("PMI_RANK",), ("PMI_SIZE",)),  # MPICH, Intel MPI
)

_claimed: str | None = None
_active = 0  # sessions of this process that claimed a role and have not ended


def detect(env: Mapping[str, str]) -> str:
    """The role ``env`` describes (without claiming it)."""
    ours = env.get(PLUGIN_ROLE_VAR, "")
    if ours == "scheduler":
        return SCHEDULER
    if ours == "worker":
        return RANK
    if any(env.get(marker, "").strip() for marker, _, _ in FOREIGN_LAUNCHERS):
        return FOREIGN
    return CONTROLLER


def claim() -> str:
    """Decide this process's role once (at pytest start-up) and consume the launcher's variable.
    A session started inside a rank's (``pytest.main()`` in a test) is not the rank: its marked
    tests run in place and it writes nothing, as in another launcher's job (:func:`release` at
    each session's end)."""
    global _claimed, _active
    if _claimed is None:
        _claimed = detect(os.environ)
    os.environ.pop(PLUGIN_ROLE_VAR, None)
    _active += 1
    return FOREIGN if _claimed == RANK and _active > 1 else _claimed


def release() -> None:
    """A session that claimed its role ended."""
    global _active
    _active = max(0, _active - 1)


def role() -> str:
    """This process's role (claimed at start-up; detected now if the plugin never started)."""
    return _claimed if _claimed is not None else detect(os.environ)


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        return default


def in_job() -> bool:
    """Whether this process is a rank of a job (ours or another launcher's)."""
    return role() in (RANK, FOREIGN)


def _current(which: int, default: int) -> int:
    """This process's rank (``which`` 0) or world size (1) in its job; ``default`` outside one."""
    if role() == RANK:
        first, second = (("RANK_ID", "RANK"), ("RANK_SIZE", "WORLD_SIZE"))[which]
        return env_int(first, env_int(second, default))
    if role() != FOREIGN:
        return default
    launcher = next(
        (f for f in FOREIGN_LAUNCHERS if os.environ.get(f[0], "").strip()), ("", ("RANK_ID",), ("RANK_SIZE",))
    )
    for name in launcher[1 + which]:
        if os.environ.get(name, "").strip():
            return env_int(name, default)
    return default


def current_rank() -> int:
    return _current(0, 0)


def current_world() -> int:
    return _current(1, 1)


def current_local_rank() -> int:
    return env_int("LOCAL_RANK", env_int("DEVICE_ID", 0)) if in_job() else 0


def current_local_world() -> int:
    return env_int("LOCAL_WORLD_SIZE", env_int("LOCAL_RANK_SIZE", 1)) if in_job() else 1
