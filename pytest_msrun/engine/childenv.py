"""Per-child environment dicts (msrun's variables per role, plus torch-style ones).

Every child starts from a *copy* of the launcher's environment with every variable this
launcher owns removed, so nothing stale leaks in (as it does under MindSpore's msrun): no scheduler
``RANK_ID=0`` in a worker, no ``MS_ROLE`` in a dry run, no ``MSRUN_CPU_LIST`` of another worker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pytest_msrun.engine.config import LaunchConfig
    from pytest_msrun.engine.kinds import SchedulerMode
    from pytest_msrun.engine.plan import NodeFacts

# The torch-style variables workers get beside msrun's (so torch.distributed env:// works).
TORCH_STYLE_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_RANK_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# Internal variables that are not part of msrun's interface and never shown as "exported".
INTERNAL_VARS = frozenset(
    {
        "MSRUN_JOB_TOKEN",
        "MSRUN_LISTEN_FD",
        "MSRUN_PLUGIN_ROLE",
        "MSRUN_TASK_PYTHON",
        "MSRUN_ORIG_PYTHONPATH",
        "MSRUN_TRACE",  # a traced job's processes are not traced jobs themselves (a nested msrun)
        "MSRUN_TRACE_SPOOL",
        "MSRUN_SIM_RECORD",  # a simulated rank's holdings (control/torchdry.py)
        "MSRUN_SIM_BUDGET",
        "MSRUN_SIM_THREADS",  # a simulated rank's share of the CPUs (its framework's intra-op threads)
    }
)
# Variables msrun (ours or MindSpore's) sets; all removed from the inherited environment.
OWNED_VARS = (
    "MS_ROLE",
    "MS_SCHED_HOST",
    "MS_SCHED_PORT",
    "MS_WORKER_NUM",
    "MS_TOPO_TIMEOUT",
    "MS_NODE_ID",
    "RANK_ID",
    "RANK_SIZE",
    "DEVICE_ID",
    "MSRUN_CPU_LIST",
    "MSRUN_BIND_FILE",
    "MSRUN_BIND_FILE_HASH",
    *TORCH_STYLE_VARS,
    "MSRUN_JOB_ID",
    "MSRUN_LAUNCHER_ID",
    "MSRUN_SCHEDULER",
    "MSRUN_LOG_DIR",
    "MSRUN_ERROR_FILE",
    *sorted(INTERNAL_VARS),
)
# The role variable this launcher sets for the pytest plugin in each child (and nobody else sets):
# a pytest process is one of this launcher's ranks only when it finds "worker" here.
PLUGIN_ROLE_VAR = "MSRUN_PLUGIN_ROLE"


def inherited(base: Mapping[str, str], keep: tuple[str, ...] = ()) -> dict[str, str]:
    """A copy of ``base`` without the launcher-owned variables (except those in ``keep``)."""
    env = dict(base)
    for name in OWNED_VARS:
        if name not in keep:
            env.pop(name, None)
    return env


def common_vars(cfg: LaunchConfig, facts: NodeFacts, mode: SchedulerMode, rank_size: str) -> dict[str, str]:
    """Variables every child of the job gets."""
    out = {
        "RANK_SIZE": rank_size,
        "MS_WORKER_NUM": str(cfg.worker_num),
        "PYTHONUNBUFFERED": "1",
        "MSRUN_JOB_ID": facts.job_id,
        "MSRUN_LAUNCHER_ID": facts.launcher_id or facts.job_id,  # this node's launcher (MSRUN_JOB_ID: every node's)
        "MSRUN_SCHEDULER": str(mode),
        "MSRUN_LOG_DIR": cfg.log_dir,
    }
    if facts.job_token and mode.has_control_plane:
        out["MSRUN_JOB_TOKEN"] = facts.job_token
    if cfg.rank_table_file:
        out["RANK_TABLE_FILE"] = cfg.rank_table_file
    if cfg.sim_level >= 0:  # a dry run
        out["MS_SIMULATION_LEVEL"] = str(cfg.sim_level)
        # ranks run side by side, --sim_concurrency of them: each computes on its share of the CPUs
        # (torch's pool on every CPU in each rank oversubscribes them: 3-4x slower on 2 CPUs)
        cpus = len(os.sched_getaffinity(0)) or 1
        out["MSRUN_SIM_THREADS"] = str(max(1, cpus // (cfg.sim_concurrency or cpus)))
        if cfg.budget:
            out["MSRUN_SIM_BUDGET"] = str(cfg.budget)
    if cfg.bind_numa.kind == "unified" and cfg.bind_numa.file:
        out["MSRUN_BIND_FILE"] = cfg.bind_numa.file
        out["MSRUN_BIND_FILE_HASH"] = cfg.bind_numa.file_hash
    return out


def cluster_vars(role: str, master_ip: str, master_port: int, topo_timeout: int) -> dict[str, str]:
    """MindSpore's dynamic-cluster variables (absent in dry runs)."""
    return {
        "MS_ROLE": role,
        "MS_SCHED_HOST": master_ip,
        "MS_SCHED_PORT": str(master_port),
        "MS_TOPO_TIMEOUT": str(topo_timeout),
    }


def rank_vars(
    *,
    local_index: int,
    rank: int | None,
    world_size: int,
    local_world_size: int,
    node_index: int | None,
    node_count: int | None,
    master_ip: str,
    dist_port: int,
) -> dict[str, str]:
    """Per-worker rank variables, msrun-style and torch-style."""
    out = {"DEVICE_ID": str(local_index), "LOCAL_RANK": str(local_index), "WORLD_SIZE": str(world_size)}
    out.update(dict.fromkeys(("LOCAL_WORLD_SIZE", "LOCAL_RANK_SIZE"), str(local_world_size)))
    if rank is not None:
        out.update(dict.fromkeys(("RANK_ID", "MS_NODE_ID", "RANK"), str(rank)))
    if node_index is not None:
        out["GROUP_RANK"] = str(node_index)
    if node_count is not None:
        out["GROUP_WORLD_SIZE"] = str(node_count)
    out["MASTER_ADDR"] = master_ip
    out["MASTER_PORT"] = str(dist_port)
    return out
