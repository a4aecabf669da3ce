"""Where this pytest process runs: a controller, a rank inside an msrun job, or the scheduler."""

from __future__ import annotations

import os
from collections.abc import Mapping

CONTROLLER, RANK, SCHEDULER = "controller", "rank", "scheduler"


def role(env: Mapping[str, str] | None = None) -> str:
    """``scheduler`` for ``MS_ROLE=MS_SCHED``; ``rank`` inside any msrun job (ours or MindSpore's,
    dry runs included); else ``controller``."""
    env = os.environ if env is None else env
    ms_role = env.get("MS_ROLE", "")
    if ms_role == "MS_SCHED":
        return SCHEDULER
    if ms_role == "MS_WORKER" or env.get("MSRUN_JOB_ID") or env.get("MS_SIMULATION_LEVEL", "").strip():
        return RANK
    return CONTROLLER


def env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    value = (os.environ if env is None else env).get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        return default


def current_rank() -> int:
    return env_int("RANK_ID", env_int("RANK", 0)) if role() == RANK else 0


def current_world() -> int:
    return env_int("RANK_SIZE", env_int("WORLD_SIZE", 1)) if role() == RANK else 1


def current_local_rank() -> int:
    return env_int("LOCAL_RANK", env_int("DEVICE_ID", 0)) if role() == RANK else 0


def current_local_world() -> int:
    return env_int("LOCAL_WORLD_SIZE", env_int("LOCAL_RANK_SIZE", 1)) if role() == RANK else 1
