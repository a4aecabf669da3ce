"""``msrun``: MindSpore's launcher flags, parsed and validated before anything starts."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Mapping, Sequence

import pytest_msrun
from pytest_msrun.binding.flags import BindFlagError, BindingError, BindSpec, parse_bind_value
from pytest_msrun.engine import console, timeline
from pytest_msrun.engine.config import (
    SCHEDULER_MODES,
    ConfigError,
    LaunchConfig,
    check_environment,
    parse_join,
    trace_path,
    validate,
)
from pytest_msrun.engine.containment import JobGuard
from pytest_msrun.engine.jobtoken import TokenError, job_token
from pytest_msrun.engine.kinds import SchedulerMode
from pytest_msrun.engine.plan import LaunchPlan, NodeFacts, ProcessSpec, build_plan
from pytest_msrun.engine.taskcmd import task_argv, task_python
from pytest_msrun.netaddr import AddressError, is_local_address, resolve_master_addr, source_ip_towards
from pytest_msrun.pathsearch import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

    from pytest_msrun.binding.topology import Topology
    from pytest_msrun.engine.slurm import Inferred

# The directory that holds the pytest_msrun package (the scheduler runs with -S, without site).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pytest_msrun.__file__)))


def _join_type(value: str) -> bool:
    try:
        return parse_join(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bind_type(flag: str):
    def parse(value: str) -> BindSpec:
        try:
            return parse_bind_value(value, flag)
        except BindFlagError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = flag
    return parse


_UNSET = object()  # the default of every flag in the parser: tells given flags from defaults

# msrun's defaults (and this launcher's extensions'), applied after parsing.
DEFAULTS: dict[str, object] = {
    "worker_num": 8,
    "local_worker_num": 8,
    "master_addr": "127.0.0.1",
    "master_port": 8118,
    "node_rank": -1,
    "log_dir": "",
    "join": False,
    "cluster_time_out": 600,
    "bind_core": BindSpec(),
    "bind_numa": BindSpec(),
    "sim_level": None,
    "sim_rank_id": -1,
    "rank_table_file": "",
    "worker_log_name": "",
    "tail_worker_log": "-1",
    "sim_select": "",
    "sim_concurrency": 0,
    "scheduler": "auto",
    "dist_port": -1,
    "trace": "",
}


class _Parser(argparse.ArgumentParser):
    """``usage: pmsrun`` (this command's name), but errors in MindSpore's words - ``msrun: error:``
    - so scripts that look for msrun's error lines find ours."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"msrun: error: {message}\n")


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, sized without :mod:`shutil`: argparse builds one per flag while the
    parser is set up, and importing ``shutil`` for the terminal width is a cost on every start."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None):
        if width is None:
            try:
                width = int(os.environ.get("COLUMNS", "")) or os.get_terminal_size(1).columns
            except (ValueError, OSError):
                width = 80
            width -= 2
        super().__init__(prog, indent_increment, max_help_position, width)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pmsrun",
        formatter_class=_Formatter,
        description="Start a distributed job: one scheduler plus N workers per node (MindSpore msrun compatible).",
    )
    p.add_argument("--worker_num", type=int, default=_UNSET, help="total number of workers (ranks) (default 8)")
    p.add_argument("--local_worker_num", type=int, default=_UNSET, help="workers started on this node (default 8)")
    p.add_argument(
        "--master_addr", default=_UNSET, help="scheduler address: IPv4, [IPv6] or host name (default 127.0.0.1)"
    )
    p.add_argument(
        "--master_port", type=int, default=_UNSET, help="scheduler port (default 8118; 0 = a free one, single node)"
    )
    p.add_argument("--node_rank", type=int, default=_UNSET, help="this node's index (default -1: assign automatically)")
    p.add_argument("--log_dir", default=_UNSET, help="directory for scheduler.log and worker_<rank>.log (default: cwd)")
    p.add_argument(
        "--join",
        type=_join_type,
        default=_UNSET,
        metavar="{True,False}",
        help="wait for the job, tail logs and return its exit status (default False: detach)",
    )
    p.add_argument(
        "--cluster_time_out",
        type=int,
        default=_UNSET,
        help="seconds to wait for every node (default 600; negative: forever)",
    )
    p.add_argument("--bind_core", type=_bind_type("bind_core"), default=_UNSET, help="True, False or a JSON dict")
    p.add_argument(
        "--bind_numa", type=_bind_type("bind_numa"), default=_UNSET, help="True, False, a JSON dict or a JSON file"
    )
    p.add_argument("--sim_level", type=int, default=_UNSET, choices=[0, 1, 2, 3], help="dry-run simulation level")
    p.add_argument("--sim_rank_id", type=int, default=_UNSET, help="dry-run a single rank with this id")
    p.add_argument("--rank_table_file", default=_UNSET, help="rank table file (exported as RANK_TABLE_FILE)")
    p.add_argument("--worker_log_name", default=_UNSET, help="worker log prefix; {ip} and {hostname} are replaced")
    p.add_argument("--tail_worker_log", default=_UNSET, help="ranks whose logs are shown with --join=True (-1 = all)")
    p.add_argument(
        "--sim_select",
        default=_UNSET,
        help="dry run: the simulated ranks to run (N, A-B, first:K, last:K, sample:K[:SEED]; default all)",
    )
    p.add_argument(
        "--sim_concurrency", type=int, default=_UNSET, help="dry run: simulated ranks running at once (0 = CPU count)"
    )
    p.add_argument(
        "--scheduler",
        default=_UNSET,
        choices=SCHEDULER_MODES,
        help="the scheduler process: the builtin control plane (auto: plus a MindSpore scheduler when a MindSpore "
        "worker connects; mindspore: from the start), or the task itself (task, as MindSpore's msrun)",
    )
    p.add_argument("--print_plan", action="store_true", help="print the launch plan as JSON and start nothing")
    p.add_argument(
        "--dist_port",
        type=int,
        default=_UNSET,
        help="port exported as MASTER_PORT for torch env:// (default master_port+1)",
    )
    p.add_argument(
        "--trace",
        default=_UNSET,
        metavar="FILE",
        help="write the job's timeline to FILE in the Chrome trace format (Perfetto); also MSRUN_TRACE=FILE",
    )
    p.add_argument("task_script", help="a .py script, python, python3, pytest, or another command")
    p.add_argument("task_script_args", nargs=argparse.REMAINDER, help="arguments passed to the task")
    return p


def apply_defaults(ns: argparse.Namespace) -> frozenset[str]:
    """Fill in the defaults of flags not given; return the names of those that were given."""
    given = frozenset(name for name in DEFAULTS if getattr(ns, name, _UNSET) is not _UNSET)
    for name, default in DEFAULTS.items():
        if name not in given:
            setattr(ns, name, default)
    return given


def config_from_args(ns: argparse.Namespace, env: dict[str, str]) -> tuple[LaunchConfig, list[str]]:
    notes: list[str] = []
    given = apply_defaults(ns)
    slurm = infer_from_slurm(ns, given, env)
    sim_level, sim_from_env = ns.sim_level, False
    if sim_level is None:
        sim_level = -1
        raw = env.get("MS_SIMULATION_LEVEL", "").strip()
        if raw:
            if raw not in ("0", "1", "2", "3"):
                raise ConfigError("sim_level", f"MS_SIMULATION_LEVEL={raw!r} in the environment is not 0, 1, 2 or 3")
            sim_level, sim_from_env = int(raw), True
    if sim_level != -1 and ns.sim_rank_id == -1 and env.get("RANK_ID", "").strip():
        notes.append(
            f"RANK_ID={env['RANK_ID']} in the environment is ignored for this dry run; "
            "use --sim_rank_id to dry-run a single rank."
        )
    cfg = LaunchConfig(
        task_script=ns.task_script,
        task_script_args=list(ns.task_script_args),
        worker_num=ns.worker_num,
        local_worker_num=ns.local_worker_num,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        node_rank=ns.node_rank,
        log_dir=ns.log_dir,
        join=ns.join,
        cluster_time_out=ns.cluster_time_out,
        bind_core=ns.bind_core,
        bind_numa=ns.bind_numa,
        sim_level=sim_level,
        sim_rank_id=ns.sim_rank_id,
        sim_from_env=sim_from_env,
        sim_select=ns.sim_select,
        sim_concurrency=ns.sim_concurrency,
        rank_table_file=ns.rank_table_file,
        worker_log_name=ns.worker_log_name,
        tail_worker_log=ns.tail_worker_log,
        scheduler=ns.scheduler,
        print_plan=ns.print_plan,
        dist_port=ns.dist_port,
        trace=trace_path(ns.trace, env),
        given=given,
        slurm=slurm,
    )
    return cfg, notes


def infer_from_slurm(ns: argparse.Namespace, given: frozenset[str], env: Mapping[str, str]) -> Inferred | None:
    """Inside an ``srun`` step, set the flags not given from the step (see :mod:`.slurm`)."""
    if "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
        return None
    from pytest_msrun.engine.slurm import HostlistError, Inferred, slurm_step  # noqa: F811 - lazily

    try:
        step = slurm_step(env)
    except (HostlistError, ValueError) as exc:
        raise ConfigError(
            "", f"cannot read the Slurm step ({exc}); give the flags yourself, or set MSRUN_SLURM=0"
        ) from None
    if step is None:
        return None
    if any(n > 1 for n in step.tasks):
        raise ConfigError(
            "",
            f"Slurm started {max(step.tasks)} msrun tasks on one node (SLURM_STEP_TASKS_PER_NODE); msrun runs once "
            "per node and starts --local_worker_num workers itself: run srun --ntasks-per-node=1 msrun "
            "--local_worker_num=<workers per node> ... (or set MSRUN_SLURM=0 and give every flag)",
        )
    flags: dict[str, object] = {}
    nodes = step.num_nodes
    if "node_rank" not in given:
        flags["node_rank"] = step.node_id
    if "worker_num" not in given:
        flags["worker_num"] = ns.local_worker_num * nodes
    elif "local_worker_num" not in given:
        if ns.worker_num % nodes:
            raise ConfigError(
                "local_worker_num",
                f"--worker_num={ns.worker_num} does not divide over the Slurm step's {nodes} nodes; give "
                "--local_worker_num (workers per node) too",
            )
        flags["local_worker_num"] = ns.worker_num // nodes
    if "master_addr" not in given and nodes > 1:
        flags["master_addr"] = step.nodes[0]
    if "master_port" not in given:
        flags["master_port"] = step.master_port
    for name, value in flags.items():
        setattr(ns, name, value)
    return Inferred(step=step, flags=flags)


def config_of(argv: list[str], env: dict[str, str]) -> LaunchConfig:
    """The configuration an msrun command line (flags, task, its arguments) describes, as msrun
    reads it, without looking at the machine. Invalid input raises :class:`ConfigError` or exits 2."""
    cfg, _ = config_from_args(build_parser().parse_args(argv), env)
    return cfg


def binding_facts(cfg: LaunchConfig, env: dict[str, str]) -> tuple[Topology | None, dict[str, str | None]]:
    """Topology (``MSRUN_TOPOLOGY`` snapshot, else live) and tool paths - read only when binding."""
    if not (cfg.bind_core.enabled or cfg.bind_numa.enabled):
        return None, {}
    from pytest_msrun.binding.discover import load_topology

    try:
        topology = load_topology(env)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "bind_numa" if cfg.bind_numa.enabled else "bind_core",
            f"cannot read the topology snapshot in MSRUN_TOPOLOGY: {exc}",
        ) from None
    tools = {name: which(name, path=env.get("PATH")) for name in ("taskset", "numactl")}
    if cfg.print_plan and getattr(topology, "source", "live") != "live":
        # A plan for the recorded machine, started nowhere: its commands are that machine's.
        tools = {name: path or name for name, path in tools.items()}
    return topology, tools


def probe_numactl(plan_processes: Sequence[ProcessSpec], topology: Topology | None) -> None:
    """A numactl that cannot set a memory policy here (containers without CAP_SYS_NICE) fails now."""
    prefix = next((p.bind_prefix for p in plan_processes if p.bind_prefix[:1] == ["numactl"]), None)
    if prefix is None or getattr(topology, "source", "") != "live":
        return
    import subprocess

    node = next((p.mems[0] for p in plan_processes if p.mems), 0)
    try:
        proc = subprocess.run(["numactl", f"--membind={node}", "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError("bind_numa", f"numactl does not run here: {exc}") from None
    if proc.returncode != 0:
        raise ConfigError(
            "bind_numa",
            f"numactl cannot bind memory here ({proc.stderr.strip() or 'exit ' + str(proc.returncode)}); "
            "containers need CAP_SYS_NICE - drop the memory binding or run with that capability",
        )


def gather_facts(cfg: LaunchConfig, env: dict[str, str], job_id: str) -> NodeFacts:
    try:
        master_ip = resolve_master_addr(cfg.master_addr)
    except AddressError as exc:
        raise ConfigError("master_addr", f"{exc}; give an IP address or a resolvable host name") from None
    argv = task_argv(cfg.task_script, cfg.task_script_args, must_exist=not cfg.print_plan)
    python = task_python(argv)
    topology, tools = binding_facts(cfg, env)
    mode = SchedulerMode.NONE if cfg.dry_run else SchedulerMode(cfg.scheduler)
    try:
        token = job_token(
            multi_node=cfg.multi_node,
            master_ip=master_ip,
            master_port=cfg.master_port,
            worker_num=cfg.worker_num,
            env=env,
            scope=f"slurm {cfg.slurm.step.job_id}.{cfg.slurm.step.step_id}" if cfg.slurm is not None else "",
        )
    except TokenError as exc:
        raise ConfigError("", str(exc)) from None
    if token.warning and mode.has_control_plane:
        console.warning(token.warning)
    return NodeFacts(
        master_ip=master_ip,
        address_is_local=is_local_address(master_ip),
        hostname=socket.gethostname(),
        source_ip=source_ip_towards(master_ip, cfg.master_port),
        task_argv=argv,
        task_python=python,
        python=sys.executable,
        scheduler_mode=mode,
        job_id=job_id,
        job_token=token.token,
        token_source=token.source,
        master_port=cfg.master_port,
        dist_port=cfg.dist_port,
        base_env=env,
        package_root=PACKAGE_ROOT,
        topology=topology,
        tools=tools,
    )


def plan_from_args(
    argv: list[str] | None, env: dict[str, str], job_id: str
) -> tuple[LaunchConfig, NodeFacts, LaunchPlan]:
    """Everything msrun decides before it starts anything: flags, validation, facts, the plan.

    Bad input ends here: one ``msrun: error: argument --flag: ...`` line and ``SystemExit(2)``.
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    for name in DEFAULTS:
        if isinstance(getattr(ns, name, None), list):  # argparse turns "--flag=--" into []
            parser.error(f"argument --{name}: expected one value")
    try:
        check_environment(env)
        cfg, notes = config_from_args(ns, env)
        for text in validate(cfg) + notes:
            console.warning(text)
        if cfg.slurm is not None and not cfg.print_plan:
            console.out(cfg.slurm.line())
        facts = gather_facts(cfg, env, job_id)
        plan = build_plan(cfg, facts)  # every binding check happens here, before anything starts
        if not cfg.print_plan:
            probe_numactl(plan.processes, facts.topology)
    except (ConfigError, BindingError) as exc:
        parser.error(str(exc) if isinstance(exc, ConfigError) else f"argument --{exc.flag}: {exc}")
    return cfg, facts, plan


def main(argv: list[str] | None = None, guard: JobGuard | None = None, job_id: str = "") -> int:
    """msrun. ``guard``: the job's watchdog and cgroup, started before this module was imported
    (see :mod:`pytest_msrun.entry`); started here when not."""
    job_id = job_id or os.urandom(8).hex()
    env = dict(os.environ)
    try:
        cfg, facts, plan = plan_from_args(argv, env, job_id)
        timeline.mark("planned")
        if cfg.print_plan:
            sys.stdout.write(plan.dumps() + "\n")
            return 0
        if guard is None:  # the entry point guessed "not a launch" (or was not used)
            guard = JobGuard(job_id, env)
        if not cfg.join:
            from pytest_msrun.engine.detach import launch_detached

            return launch_detached(cfg, facts, guard)
        from pytest_msrun.engine.agent import Agent

        return Agent(cfg, facts, guard=guard).run().exit_code
    finally:
        if guard is not None:
            guard.release()  # idempotent: the agent has already released it after its teardown
