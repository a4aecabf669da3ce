"""The launch plan: a pure function of config + node facts -> every process to start.

Nothing here touches the OS, and a plan is a value: building it mutates nothing, and the
multi-node rank assignment (which arrives from the control plane after registration) yields a
new plan (:func:`assign`). ``msrun --print_plan`` prints :meth:`LaunchPlan.to_json`; the agent
starts exactly what the plan says, so tests can assert on the plan alone.

The pieces: :func:`rank_layout` (where this node's workers sit in the job), :func:`job_context`
(what every process shares: environment, binding, log names), :func:`scheduler_spec` and
:func:`worker_spec` (one process each), :func:`dry_run_ranks` (which simulated ranks run).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from pytest_msrun.control import torchdry
from pytest_msrun.cpulist import format_id_list
from pytest_msrun.engine import childenv, errorfile
from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.kinds import Role, SchedulerMode
from pytest_msrun.engine.simselect import select_ranks
from pytest_msrun.record import field, fields, record, replace

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from pytest_msrun.binding.strategies import BindingPlan, Placement
    from pytest_msrun.binding.topology import Topology

SIM_PLAN_PREVIEW = 256  # a dry run's plan lists at most this many processes; the agent builds the rest
SCHEDULER_MODULE = "pytest_msrun.control.scheduler"


@record(frozen=True)
class NodeFacts:
    """What the launcher learned about this node and job before planning."""

    master_ip: str
    address_is_local: bool
    hostname: str
    source_ip: str
    task_argv: list[str]
    task_python: str
    python: str
    scheduler_mode: SchedulerMode
    job_id: str  # the job's (the scheduler's: one across its nodes)
    job_token: str
    master_port: int
    dist_port: int
    base_env: Mapping[str, str] = field(default_factory=dict)
    token_source: str = ""  # where the job token came from (jobtoken), never the token
    package_root: str = ""  # the directory holding pytest_msrun, for the builtin scheduler
    topology: Topology | None = None  # read only when a binding flag is set
    tools: Mapping[str, str | None] = field(default_factory=dict)  # taskset / numactl paths
    launcher_id: str = ""  # this launcher's own (its children carry it: its watchdog's sweep key)


@record(frozen=True)
class RankAssignment:
    """Where the control plane put this node's workers in a multi-node job."""

    rank_offset: int
    node_index: int
    node_count: int | None


@record(frozen=True)
class Layout:
    """Where this node's workers sit in the job."""

    local: int  # workers this node runs (1 for --sim_rank_id)
    offset: int | None  # rank of local worker 0; None: assigned later (control plane, or MindSpore)
    node_index: int | None
    node_count: int | None
    single_rank: int | None = None  # --sim_rank_id
    pending: bool = False  # the control plane assigns the ranks before the workers start
    warnings: tuple[str, ...] = ()
    infos: tuple[str, ...] = ()


@record(frozen=True, eq=False)
class ProcessSpec:
    """One process the agent starts (placement applied)."""

    name: str
    role: Role
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
    error_file: str = ""  # where the rank's uncaught exception is recorded ("" when not)

    @property
    def command(self) -> list[str]:
        return [*self.bind_prefix, *self.argv]

    @property
    def label(self) -> str:
        if self.role == Role.SCHEDULER:
            return "scheduler"
        return f"rank {self.rank}" if self.rank is not None else f"local worker {self.local_index}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in fields(self) if k != "env"}  # in their order
        out.update(role=str(self.role), argv=list(self.argv), bind_prefix=list(self.bind_prefix))
        out["exported"] = {k: v for k, v in self.exported.items() if k not in childenv.INTERNAL_VARS}
        out["command"] = self.command
        return out


@record(frozen=True, eq=False)
class JobContext:
    """What every process of this node's job shares."""

    base_env: dict[str, str]  # the launcher's environment without the variables msrun owns
    common: dict[str, str]  # variables every child gets
    binding: BindingPlan | None
    log_base: str  # worker log names: <log_base>_<n>.log
    tail: tuple[int, ...] | None  # ranks to tail (None: all)


@record(frozen=True, eq=False)
class LaunchPlan:
    """Every process of this node's share of the job, plus what the agent needs to run it: the
    inputs it was planned from (what it prints of the job is read from them) and the shared context."""

    config: LaunchConfig
    facts: NodeFacts
    layout: Layout
    context: JobContext
    scheduler_mode: SchedulerMode
    hosts_scheduler: bool
    processes: tuple[ProcessSpec, ...]
    warnings: tuple[str, ...] = ()
    infos: tuple[str, ...] = ()
    sim_ranks: tuple[int, ...] = ()  # a dry run's selected ranks (all, not just the preview)

    @property
    def workers(self) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == Role.WORKER]

    @property
    def scheduler(self) -> ProcessSpec | None:
        return next((p for p in self.processes if p.role == Role.SCHEDULER), None)

    def dry_run_workers(self) -> Iterator[ProcessSpec]:
        """Every selected simulated rank's spec, built one at a time (memory stays flat)."""
        first = self.layout.offset or 0
        cfg, facts, layout, ctx = self.config, self.facts, self.layout, self.context
        return (worker_spec(cfg, facts, layout, ctx, rank - first) for rank in self.sim_ranks)

    def to_json(self) -> dict[str, Any]:
        cfg, facts, mode = self.config, self.facts, self.scheduler_mode
        out: dict[str, Any] = dict(
            job_id=facts.job_id,
            scheduler_mode=str(mode),
            master_ip=facts.master_ip,
            master_port=facts.master_port,
            dist_port=effective_dist_port(facts.master_port, facts.dist_port),
            hosts_scheduler=self.hosts_scheduler,
            worker_num=cfg.worker_num,
            local_worker_num=self.layout.local,
            node_rank=cfg.node_rank,
            dry_run=cfg.dry_run,
            sim_level=cfg.sim_level,
            ranks_pending=self.layout.pending,
            log_dir=cfg.log_dir,
            join=cfg.join,
            cluster_time_out=cfg.cluster_time_out,
            bind_core=cfg.bind_core.to_json(),
            bind_numa=cfg.bind_numa.to_json(),
            sim_concurrency=cfg.sim_concurrency,
            auth=(f"job token: {facts.token_source}" if facts.job_token else "none") if mode.has_control_plane else "",
            slurm=cfg.slurm.to_json() if cfg.slurm is not None else None,
        )
        out["processes"] = [p.to_json() for p in self.processes]
        out["warnings"], out["infos"] = list(self.warnings), list(self.infos)
        out["sim_ranks"] = list(self.sim_ranks)
        if len(self.sim_ranks) > SIM_PLAN_PREVIEW:
            out["sim_ranks"] = format_id_list(self.sim_ranks)
            out["sim_plan_preview"] = f"processes shows the first {SIM_PLAN_PREVIEW} of {len(self.sim_ranks)} ranks"
        return out

    def dumps(self) -> str:
        import json  # --print_plan only: not on msrun's start path

        return json.dumps(self.to_json(), indent=2, sort_keys=False)


def effective_dist_port(master_port: int, dist_port: int) -> int:
    """The torch-style ``MASTER_PORT``: ``--dist_port``, else ``--master_port + 1`` (0 = pick at start)."""
    if dist_port != -1:
        return dist_port
    return master_port + 1 if master_port else 0


def _join(log_dir: str, name: str) -> str:
    return f"{log_dir.rstrip('/')}/{name}" if log_dir else name


def rank_layout(cfg: LaunchConfig, mode: SchedulerMode, assignment: RankAssignment | None = None) -> Layout:
    """Where this node's workers sit: known now (one node, --node_rank, a dry run, an assignment),
    to be assigned by the control plane before they start, or left to MindSpore."""
    if cfg.dry_run and cfg.sim_rank_id != -1:
        rank = cfg.sim_rank_id
        infos = (f"Simulation rank id is set to {rank}, will dryrun a single process.",)
        warnings = (f"In dryrun case, RANK_ID is assigned to {rank}.",)
        return Layout(1, rank, None, None, single_rank=rank, warnings=warnings, infos=infos)
    local = cfg.local_worker_num
    if not cfg.multi_node:
        return Layout(local, 0, 0, 1)
    if assignment is not None:
        return Layout(local, assignment.rank_offset, assignment.node_index, assignment.node_count)
    if mode.has_control_plane:
        return Layout(local, None, None, None, pending=True)
    if cfg.node_rank >= 0:
        return Layout(local, cfg.node_rank * local, cfg.node_rank, None)
    if cfg.dry_run:
        note = (
            "Dry run on several nodes without '--node_rank': ranks are this node's local indices "
            "(a dry run has no scheduler to assign them)."
        )
        return Layout(local, 0, None, None, warnings=(note,))
    note = (
        "You are running distributed job with multiple nodes but not setting '--node_rank'. So 'rank_id' "
        "of each process will be assigned after cluster is successfully built.\nYou can access 'RANK_ID' "
        "environment variable after calling 'mindspore.communication.init()'"
    )
    return Layout(local, None, None, None, warnings=(note,))


def job_context(cfg: LaunchConfig, facts: NodeFacts, mode: SchedulerMode, layout: Layout) -> JobContext:
    """The environment, binding and log names every process of this node shares."""
    rank_size = str(cfg.worker_num)
    if cfg.sim_from_env and facts.base_env.get("RANK_SIZE"):
        rank_size = facts.base_env["RANK_SIZE"]
    common = childenv.common_vars(cfg, facts, mode, rank_size)
    base = childenv.inherited(facts.base_env, keep=("MS_SIMULATION_LEVEL",) if cfg.sim_from_env else ())
    if not cfg.dry_run:
        base.pop("MS_SIMULATION_LEVEL", None)
    binding = None
    if cfg.bind_core.enabled or cfg.bind_numa.enabled:
        if facts.topology is None:
            raise ValueError("binding needs the node's topology in NodeFacts")
        from pytest_msrun.binding.strategies import Planner  # binding only: not on every start path

        binding = Planner(
            facts.topology,
            cfg.bind_core,
            cfg.bind_numa,
            layout.local,
            facts.base_env,
            facts.tools,
            dry_run=cfg.dry_run,
        ).plan()
    log_base = "worker"
    if cfg.worker_log_name:
        log_base = cfg.worker_log_name.replace("{ip}", facts.source_ip).replace("{hostname}", facts.hostname)
    tail = cfg.tail_ranks()
    return JobContext(base, common, binding, log_base, None if tail is None else tuple(tail))


def _spec(
    ctx: JobContext, placement: Placement | None, exported: dict[str, str], extra: dict[str, str], **fields: Any
) -> ProcessSpec:
    """One process: ``exported`` (what msrun shows it exports) gets its placement's variables and
    its error file (``extra``'s, which its environment alone gets too) added."""
    error_file = extra.get(errorfile.ERROR_FILE_VAR, "")
    if placement is not None:
        exported.update(placement.env)
        fields.update(cpus=placement.cpus, mems=placement.mems, bind_prefix=list(placement.prefix))
        fields.update(in_child_cpus=placement.in_child_cpus, device=placement.device, bind_how=placement.how)
    if error_file:
        exported[errorfile.ERROR_FILE_VAR] = error_file
    return ProcessSpec(env={**ctx.base_env, **exported, **extra}, exported=exported, error_file=error_file, **fields)


def scheduler_spec(cfg: LaunchConfig, facts: NodeFacts, mode: SchedulerMode, ctx: JobContext) -> ProcessSpec:
    log_path = _join(cfg.log_dir, "scheduler.log")
    extra: dict[str, str] = {}
    if mode.has_control_plane:
        # -S: the control plane needs the standard library and this package only, so skip
        # site-packages processing (.pth files) - it is on the launch's critical path.
        argv = [facts.python, "-S", "-m", SCHEDULER_MODULE]
        if facts.package_root:
            extra["PYTHONPATH"] = os.pathsep.join(filter(None, [facts.package_root, ctx.base_env.get("PYTHONPATH")]))
            extra["MSRUN_ORIG_PYTHONPATH"] = ctx.base_env.get("PYTHONPATH", "")
        if mode != SchedulerMode.BUILTIN:  # the MindSpore scheduler it may start runs with the task's interpreter
            extra["MSRUN_TASK_PYTHON"] = facts.task_python
    else:  # the task itself: its exceptions are recorded like a worker's
        argv = list(facts.task_argv)
        extra = errorfile.hook_env(facts.package_root, ctx.base_env, errorfile.error_file_for(log_path))
    exported = {
        **ctx.common,
        **childenv.cluster_vars("MS_SCHED", facts.master_ip, facts.master_port, cfg.cluster_time_out),
        "RANK_ID": "0",
        childenv.PLUGIN_ROLE_VAR: "scheduler",
    }
    placement = ctx.binding.scheduler if ctx.binding is not None else None
    what = dict(name="scheduler", role=Role.SCHEDULER, local_index=-1, rank=None, argv=argv, log_path=log_path)
    return _spec(ctx, placement, exported, extra, **what)


def worker_spec(cfg: LaunchConfig, facts: NodeFacts, layout: Layout, ctx: JobContext, i: int) -> ProcessSpec:
    """Local worker ``i``: its rank (if known), environment, log, binding."""
    rank = None if layout.offset is None else layout.offset + i
    exported = dict(ctx.common)
    if cfg.dry_run:  # a dry run's ranks are known: msrun's variables, and torch's as torchrun sets them
        # (a strategy's init_process_group() reads them); no LOCAL_RANK_SIZE, which msrun never sets
        port, local = effective_dist_port(facts.master_port, facts.dist_port), cfg.local_worker_num
        exported.update(DEVICE_ID=str(i), RANK_ID=str(rank), RANK=str(rank), WORLD_SIZE=str(cfg.worker_num))
        exported.update(LOCAL_RANK=str(int(rank or 0) % local), LOCAL_WORLD_SIZE=str(local))
        exported.update(MASTER_ADDR=facts.master_ip, MASTER_PORT=str(port))
        if layout.single_rank is None:  # msrun sets no MS_NODE_ID for --sim_rank_id
            exported["MS_NODE_ID"] = str(rank)
    else:
        exported.update(childenv.cluster_vars("MS_WORKER", facts.master_ip, facts.master_port, cfg.cluster_time_out))
        exported.update(
            childenv.rank_vars(
                local_index=i,
                rank=rank,
                world_size=cfg.worker_num,
                local_world_size=layout.local,
                node_index=layout.node_index,
                node_count=layout.node_count,
                master_ip=facts.master_ip,
                dist_port=effective_dist_port(facts.master_port, facts.dist_port),
            )
        )
    exported[childenv.PLUGIN_ROLE_VAR] = "worker"
    suffix = 0 if layout.single_rank is not None else (i if rank is None else rank)
    log_path = _join(cfg.log_dir, f"{ctx.log_base}_{suffix}.log")
    if cfg.dry_run:
        exported[torchdry.RECORD_ENV] = sim_record_for(log_path)
    return _spec(
        ctx,
        ctx.binding.workers[i] if ctx.binding is not None else None,
        exported,
        errorfile.hook_env(facts.package_root, ctx.base_env, errorfile.error_file_for(log_path)),
        name=f"worker_{suffix}",
        role=Role.WORKER,
        local_index=i,
        rank=rank,
        argv=list(facts.task_argv),
        log_path=log_path,
        tail=cfg.join and (ctx.tail is None or (rank is not None and rank in ctx.tail)),
    )


def sim_record_for(log_path: str) -> str:
    """Where the simulated rank that logs to ``log_path`` records what it holds (JSON)."""
    return errorfile.beside_log(log_path, ".sim.json")


def dry_run_ranks(cfg: LaunchConfig, layout: Layout) -> list[int]:
    """The simulated ranks this node runs (``--sim_select`` of its ranks; all by default)."""
    first = layout.offset or 0
    return select_ranks(cfg.sim_select, range(first, first + layout.local), world=cfg.worker_num)


def job_ranks(cfg: LaunchConfig) -> list[int]:
    """The ranks an invocation's job runs: in a dry run the simulated ranks this invocation runs
    (``--sim_rank_id``, ``--sim_select``, this node's share); otherwise every rank of the job."""
    if cfg.dry_run:
        return dry_run_ranks(cfg, rank_layout(cfg, SchedulerMode.NONE))
    return list(range(cfg.worker_num))


def _worker_notes(cfg: LaunchConfig, layout: Layout, workers: list[ProcessSpec]) -> list[str]:
    notes = []
    for spec in workers:
        if cfg.join and not spec.tail:
            notes.append(
                f"The '--tail_worker_log' is:{cfg.tail_worker_log}, which doesn't contain this worker {spec.rank}. So "
                f"this worker {spec.rank}'s log will not be output to console. Reset '--tail_worker_log', if you "
                "want to output this worker's log to console."
            )
        if spec.rank is None and not layout.pending:
            notes.append(
                "Rank ids will be assigned automatically, please use 'grep -rn 'rank id:' command to check "
                "each worker log's rank id."
            )
    return notes


def build_plan(cfg: LaunchConfig, facts: NodeFacts, *, hosts_scheduler: bool | None = None) -> LaunchPlan:
    """Plan this node's processes.

    ``hosts_scheduler`` defaults to "the master address is local" (the agent passes False when
    another agent on this host already holds the scheduler port). Multi-node jobs with a control
    plane have pending ranks until :func:`assign`.
    """
    mode = SchedulerMode.NONE if cfg.dry_run else SchedulerMode(facts.scheduler_mode)
    layout = rank_layout(cfg, mode)
    ctx = job_context(cfg, facts, mode, layout)
    hosts = (facts.address_is_local if hosts_scheduler is None else hosts_scheduler) and not cfg.dry_run
    processes = [scheduler_spec(cfg, facts, mode, ctx)] if hosts else []
    warnings = [*layout.warnings, *(ctx.binding.warnings if ctx.binding is not None else ())]
    infos = list(layout.infos)
    sim_ranks: list[int] = []
    if cfg.dry_run:
        sim_ranks = dry_run_ranks(cfg, layout)
        first = layout.offset or 0
        processes += [worker_spec(cfg, facts, layout, ctx, r - first) for r in sim_ranks[:SIM_PLAN_PREVIEW]]
        if len(sim_ranks) > 1:
            infos.append(
                f"Dry run of {len(sim_ranks)} simulated rank(s), "
                f"at most {cfg.sim_concurrency or 'CPU count'} at a time."
            )
    else:
        workers = [worker_spec(cfg, facts, layout, ctx, i) for i in range(layout.local)]
        warnings += _worker_notes(cfg, layout, workers)
        processes += workers
    return LaunchPlan(
        cfg, facts, layout, ctx, mode, hosts, tuple(processes), tuple(warnings), tuple(infos), tuple(sim_ranks)
    )


def assign(plan: LaunchPlan, assignment: RankAssignment, job_id: str | None = None) -> LaunchPlan:
    """The plan once the control plane placed this node's workers (a new plan; the scheduler stays)."""
    cfg = plan.config
    facts = replace(plan.facts, job_id=job_id) if job_id else plan.facts
    layout = rank_layout(cfg, plan.scheduler_mode, assignment)
    ctx = job_context(cfg, facts, plan.scheduler_mode, layout) if job_id else plan.context
    workers = [worker_spec(cfg, facts, layout, ctx, i) for i in range(layout.local)]
    keep = [p for p in plan.processes if p.role == Role.SCHEDULER]
    return replace(
        plan,
        processes=(*keep, *workers),
        warnings=(*plan.warnings, *_worker_notes(cfg, layout, workers)),
        facts=facts,
        layout=layout,
        context=ctx,
    )
