"""The launch plan: a pure function of config + node facts -> every process to start.

Nothing here touches the OS. ``msrun --print_plan`` prints :meth:`LaunchPlan.to_json`; the
agent spawns exactly what the plan says, so tests can assert on the plan alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pytest_msrun.binding.strategies import Placement, plan_bindings
from pytest_msrun.binding.topology import Topology
from pytest_msrun.cpulist import format_id_list
from pytest_msrun.engine import childenv
from pytest_msrun.engine.config import CONTROL_PLANE_MODES, LaunchConfig
from pytest_msrun.engine.simselect import select_ranks

SIM_PLAN_PREVIEW = 256  # a dry run's plan lists at most this many processes; the agent builds the rest


@dataclass
class NodeFacts:
    """What the launcher learned about this node and job before planning."""

    master_ip: str
    address_is_local: bool
    hostname: str
    source_ip: str
    task_argv: list[str]
    task_python: str
    python: str
    scheduler_mode: str  # auto | builtin | mindspore | task
    job_id: str
    job_token: str
    master_port: int
    dist_port: int
    base_env: Mapping[str, str] = field(default_factory=dict)
    token_source: str = ""  # where the job token came from (jobtoken), never the token
    package_root: str = ""  # the directory holding pytest_msrun, for the builtin scheduler
    topology: Topology | None = None  # read only when a binding flag is set
    tools: Mapping[str, str | None] = field(default_factory=dict)  # taskset / numactl paths


@dataclass
class RankAssignment:
    """Where this node's workers sit in the job (from the control plane or from the flags)."""

    rank_offset: int
    node_index: int
    node_count: int | None


@dataclass
class ProcessSpec:
    """One process the agent starts."""

    name: str
    role: str  # "scheduler" | "worker"
    local_index: int  # -1 for the scheduler
    rank: int | None
    argv: list[str]
    env: dict[str, str]
    exported: dict[str, str]
    log_path: str
    tail: bool = False
    cpus: list[int] | None = None
    mems: list[int] | None = None
    bind_prefix: list[str] = field(default_factory=list)
    in_child_cpus: list[int] | None = None
    device: str = ""
    bind_how: str = ""

    def place(self, placement: Placement) -> None:
        """Apply a binding placement (prefix, expected CPUs/nodes, extra variables)."""
        self.cpus, self.mems = placement.cpus, placement.mems
        self.bind_prefix = list(placement.prefix)
        self.in_child_cpus = placement.in_child_cpus
        self.device = placement.device
        self.bind_how = placement.how
        self.env.update(placement.env)
        self.exported.update(placement.env)

    @property
    def command(self) -> list[str]:
        return [*self.bind_prefix, *self.argv]

    @property
    def label(self) -> str:
        if self.role == "scheduler":
            return "scheduler"
        return f"rank {self.rank}" if self.rank is not None else f"local worker {self.local_index}"


@dataclass
class LaunchPlan:
    """Every process of this node's share of the job, plus what the agent needs to run it."""

    job_id: str
    scheduler_mode: str  # auto | builtin | mindspore | task | none (dry run)
    master_ip: str
    master_port: int
    dist_port: int
    hosts_scheduler: bool
    worker_num: int
    local_worker_num: int
    node_rank: int
    dry_run: bool
    sim_level: int
    ranks_pending: bool
    log_dir: str
    join: bool
    cluster_time_out: int
    processes: list[ProcessSpec]
    warnings: list[str] = field(default_factory=list)
    infos: list[str] = field(default_factory=list)
    bind_core: Any = False
    bind_numa: Any = False
    sim_ranks: list[int] = field(default_factory=list)  # a dry run's selected ranks (all, not just the preview)
    sim_concurrency: int = 0
    auth: str = ""  # how the control plane authenticates this job's processes
    worker_factory: Callable[[int], ProcessSpec] | None = field(default=None, repr=False, compare=False)  # by rank

    def dry_run_workers(self) -> Iterator[ProcessSpec]:
        """Every selected simulated rank's spec, built one at a time (memory stays flat)."""
        assert self.worker_factory is not None
        return map(self.worker_factory, self.sim_ranks)

    @property
    def workers(self) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == "worker"]

    @property
    def scheduler(self) -> ProcessSpec | None:
        return next((p for p in self.processes if p.role == "scheduler"), None)

    def to_json(self) -> dict[str, Any]:
        factory, self.worker_factory = self.worker_factory, None
        try:
            out = asdict(self)
        finally:
            self.worker_factory = factory
        out.pop("worker_factory", None)
        if len(self.sim_ranks) > SIM_PLAN_PREVIEW:
            out["sim_ranks"] = format_id_list(self.sim_ranks)
            out["sim_plan_preview"] = f"processes shows the first {SIM_PLAN_PREVIEW} of {len(self.sim_ranks)} ranks"
        for proc in out["processes"]:
            proc.pop("env")
            proc["exported"] = {k: v for k, v in proc["exported"].items() if k not in childenv.INTERNAL_VARS}
            proc["command"] = [*proc["bind_prefix"], *proc["argv"]]
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)


def effective_dist_port(master_port: int, dist_port: int) -> int:
    """The torch-style ``MASTER_PORT``: ``--dist_port``, else ``--master_port + 1`` (0 = pick at start)."""
    if dist_port != -1:
        return dist_port
    return master_port + 1 if master_port else 0


def _log_base(cfg: LaunchConfig, facts: NodeFacts) -> str:
    if not cfg.worker_log_name:
        return "worker"
    return cfg.worker_log_name.replace("{ip}", facts.source_ip).replace("{hostname}", facts.hostname)


def _join(log_dir: str, name: str) -> str:
    return f"{log_dir.rstrip('/')}/{name}" if log_dir else name


def build_plan(
    cfg: LaunchConfig,
    facts: NodeFacts,
    *,
    hosts_scheduler: bool | None = None,
    assignment: RankAssignment | None = None,
) -> LaunchPlan:
    """Plan this node's processes.

    ``hosts_scheduler`` defaults to "the master address is local" (the agent passes False when
    another agent on this host already holds the scheduler port). ``assignment`` comes from
    the builtin control plane on multi-node jobs; without it such a plan has pending ranks.
    """
    warnings: list[str] = []
    infos: list[str] = []
    dry = cfg.dry_run
    mode = "none" if dry else facts.scheduler_mode
    control_plane = mode in CONTROL_PLANE_MODES
    if hosts_scheduler is None:
        hosts_scheduler = facts.address_is_local
    hosts_scheduler = hosts_scheduler and not dry

    local = cfg.local_worker_num
    single_rank: int | None = None
    if dry and cfg.sim_rank_id != -1:
        infos.append(f"Simulation rank id is set to {cfg.sim_rank_id}, will dryrun a single process.")
        warnings.append(f"In dryrun case, RANK_ID is assigned to {cfg.sim_rank_id}.")
        local, single_rank = 1, cfg.sim_rank_id

    # Rank of each local worker, when known before start.
    multi = cfg.multi_node and single_rank is None
    node_index: int | None = 0
    node_count: int | None = 1
    offset: int | None = 0
    if single_rank is not None:
        offset, node_index, node_count = single_rank, None, None
    elif multi:
        if assignment is not None:
            offset, node_index, node_count = assignment.rank_offset, assignment.node_index, assignment.node_count
        elif control_plane:
            offset = node_index = node_count = None
        elif cfg.node_rank >= 0:
            offset, node_index, node_count = cfg.node_rank * local, cfg.node_rank, None
        elif dry:
            offset, node_index, node_count = 0, None, None
            warnings.append(
                "Dry run on several nodes without '--node_rank': ranks are this node's local indices "
                "(a dry run has no scheduler to assign them)."
            )
        else:
            offset = node_index = node_count = None
            warnings.append(
                "You are running distributed job with multiple nodes but not setting '--node_rank'. So 'rank_id' "
                "of each process will be assigned after cluster is successfully built.\nYou can access 'RANK_ID' "
                "environment variable after calling 'mindspore.communication.init()'"
            )
    ranks_pending = multi and offset is None and control_plane

    rank_size = str(cfg.worker_num)
    if cfg.sim_from_env and facts.base_env.get("RANK_SIZE"):
        rank_size = facts.base_env["RANK_SIZE"]
    bind_file = cfg.bind_numa.file if cfg.bind_numa.kind == "unified" else ""
    common = childenv.common_vars(
        worker_num=cfg.worker_num,
        rank_size=rank_size,
        job_id=facts.job_id,
        job_token=facts.job_token if control_plane else "",
        scheduler_mode=mode,
        log_dir=cfg.log_dir,
        rank_table_file=cfg.rank_table_file,
        sim_level=cfg.sim_level if dry else -1,
        bind_file=bind_file,
        bind_file_hash=cfg.bind_numa.file_hash if bind_file else "",
    )
    keep = ("MS_SIMULATION_LEVEL",) if cfg.sim_from_env else ()
    base = childenv.inherited(facts.base_env, keep=keep)
    if not dry:
        base.pop("MS_SIMULATION_LEVEL", None)

    processes: list[ProcessSpec] = []
    if hosts_scheduler:
        sched_env: dict[str, str] = {}
        if control_plane:
            # -S: the control plane needs the standard library and this package only, so skip
            # site-packages processing (.pth files) - it is on the launch's critical path.
            argv = [facts.python, "-S", "-m", "pytest_msrun.control.scheduler"]
            if facts.package_root:
                sched_env["PYTHONPATH"] = os.pathsep.join(filter(None, [facts.package_root, base.get("PYTHONPATH")]))
                sched_env["MSRUN_ORIG_PYTHONPATH"] = base.get("PYTHONPATH", "")
            if mode != "builtin":  # the MindSpore scheduler it may start runs with the task's interpreter
                sched_env["MSRUN_TASK_PYTHON"] = facts.task_python
        else:
            argv = list(facts.task_argv)
        exported = {
            **common,
            **childenv.cluster_vars("MS_SCHED", facts.master_ip, facts.master_port, cfg.cluster_time_out),
            "RANK_ID": "0",
            childenv.PLUGIN_ROLE_VAR: "scheduler",
        }
        processes.append(
            ProcessSpec(
                name="scheduler",
                role="scheduler",
                local_index=-1,
                rank=None,
                argv=argv,
                env={**base, **exported, **sched_env},
                exported=exported,
                log_path=_join(cfg.log_dir, "scheduler.log"),
            )
        )

    tail_list = cfg.tail_ranks()
    log_base = _log_base(cfg, facts)

    def make_worker(i: int) -> ProcessSpec:
        rank = None if offset is None else offset + i
        exported = dict(common)
        if dry:
            node_id = rank if single_rank is None else None  # msrun sets no MS_NODE_ID for --sim_rank_id
            exported.update(childenv.dry_run_rank_vars(local_index=i, rank=rank, node_id=node_id))
        else:
            exported.update(
                childenv.cluster_vars("MS_WORKER", facts.master_ip, facts.master_port, cfg.cluster_time_out)
            )
            exported.update(
                childenv.rank_vars(
                    local_index=i,
                    rank=rank,
                    world_size=cfg.worker_num,
                    local_world_size=local,
                    node_index=node_index,
                    node_count=node_count,
                    master_ip=facts.master_ip,
                    dist_port=effective_dist_port(facts.master_port, facts.dist_port),
                )
            )
        exported[childenv.PLUGIN_ROLE_VAR] = "worker"
        suffix = 0 if single_rank is not None else (i if rank is None else rank)
        spec = ProcessSpec(
            name=f"worker_{suffix}",
            role="worker",
            local_index=i,
            rank=rank,
            argv=list(facts.task_argv),
            env={**base, **exported},
            exported=exported,
            log_path=_join(cfg.log_dir, f"{log_base}_{suffix}.log"),
            tail=cfg.join and (tail_list is None or (rank is not None and rank in tail_list)),
        )
        if binding is not None:
            spec.place(binding.workers[i])
        return spec

    binding = None
    if cfg.bind_core.enabled or cfg.bind_numa.enabled:
        if facts.topology is None:
            raise ValueError("binding needs the node's topology in NodeFacts")
        binding = plan_bindings(
            facts.topology, cfg.bind_core, cfg.bind_numa, local, facts.base_env, facts.tools, dry_run=dry
        )
        if binding is not None:
            warnings.extend(binding.warnings)
            for spec in processes:
                if spec.role == "scheduler":
                    spec.place(binding.scheduler)

    sim_ranks: list[int] = []
    dry_worker: Callable[[int], ProcessSpec] | None = None
    if dry:
        first = offset if offset is not None else 0  # a single simulated rank is its own offset

        def dry_worker(rank: int) -> ProcessSpec:
            return make_worker(rank - first)

        sim_ranks = select_ranks(cfg.sim_select, range(first, first + local))
        processes.extend(dry_worker(r) for r in sim_ranks[:SIM_PLAN_PREVIEW])
        if len(sim_ranks) > 1:
            infos.append(
                f"Dry run of {len(sim_ranks)} simulated rank(s), "
                f"at most {cfg.sim_concurrency or 'CPU count'} at a time."
            )
    else:
        for i in range(local):
            processes.append(make_worker(i))
            rank = processes[-1].rank
            if cfg.join and not processes[-1].tail:
                warnings.append(
                    f"The '--tail_worker_log' is:{cfg.tail_worker_log}, which doesn't contain this worker {rank}. So "
                    f"this worker {rank}'s log will not be output to console. Reset '--tail_worker_log', if you want "
                    "to output this worker's log to console."
                )
            if rank is None and not ranks_pending:
                warnings.append(
                    "Rank ids will be assigned automatically, please use 'grep -rn 'rank id:' command to check "
                    "each worker log's rank id."
                )

    return LaunchPlan(
        job_id=facts.job_id,
        scheduler_mode=mode,
        master_ip=facts.master_ip,
        master_port=facts.master_port,
        dist_port=effective_dist_port(facts.master_port, facts.dist_port),
        hosts_scheduler=hosts_scheduler,
        worker_num=cfg.worker_num,
        local_worker_num=local,
        node_rank=cfg.node_rank,
        dry_run=dry,
        sim_level=cfg.sim_level,
        ranks_pending=ranks_pending,
        log_dir=cfg.log_dir,
        join=cfg.join,
        cluster_time_out=cfg.cluster_time_out,
        processes=processes,
        warnings=warnings,
        infos=infos,
        bind_core=cfg.bind_core.to_json(),
        bind_numa=cfg.bind_numa.to_json(),
        sim_ranks=sim_ranks,
        sim_concurrency=cfg.sim_concurrency,
        auth=(f"job token: {facts.token_source}" if facts.job_token else "none") if control_plane else "",
        worker_factory=dry_worker,
    )
