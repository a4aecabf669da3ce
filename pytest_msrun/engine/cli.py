"""``msrun``: MindSpore's launcher flags, parsed and validated before anything starts."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import pytest_msrun
from pytest_msrun.binding.flags import BindingError
from pytest_msrun.engine import console, timeline
from pytest_msrun.engine.argv import DEFAULTS, UNSET, parse_plain
from pytest_msrun.engine.config import ConfigError, LaunchConfig, check_environment, trace_path, validate
from pytest_msrun.engine.containment import JobGuard
from pytest_msrun.engine.jobtoken import TokenError, job_token
from pytest_msrun.engine.kinds import SchedulerMode
from pytest_msrun.engine.plan import LaunchPlan, NodeFacts, ProcessSpec, build_plan
from pytest_msrun.engine.taskcmd import task_argv, task_python
from pytest_msrun.netaddr import AddressError, is_local_address, resolve_master_addr, source_ip_towards
from pytest_msrun.pathsearch import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from types import SimpleNamespace
    from typing import Union

    from pytest_msrun.binding.topology import Topology
    from pytest_msrun.engine.slurm import Inferred

    Namespace = Union[SimpleNamespace, argparse.Namespace]

# The directory that holds the pytest_msrun package (the scheduler runs with -S, without site).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pytest_msrun.__file__)))


def parse_args(argv: Sequence[str]) -> Namespace:
    """The command line as msrun reads it: plain ones without argparse, the rest with it (which
    exits 2 on a usage error, as ``--help`` exits 0)."""
    plain = parse_plain(argv)
    if plain is not None:
        return plain
    from pytest_msrun.engine.cliparser import build_parser  # argparse: only when a command line needs it

    parser = build_parser()
    ns = parser.parse_args(argv)
    for name in DEFAULTS:
        if isinstance(getattr(ns, name, None), list):  # argparse turns "--flag=--" into []
            parser.error(f"argument --{name}: expected one value")
    return ns


def config_from_args(ns: Namespace, env: dict[str, str]) -> tuple[LaunchConfig, list[str]]:
    notes: list[str] = []
    given = frozenset(name for name in DEFAULTS if getattr(ns, name, UNSET) is not UNSET)
    for name, default in DEFAULTS.items():  # the defaults of flags not given
        if name not in given:
            setattr(ns, name, default)
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
    flags = {name: getattr(ns, name) for name in DEFAULTS}  # LaunchConfig's fields of the same names
    flags.update(sim_level=sim_level, trace=trace_path(ns.trace, env))
    cfg = LaunchConfig(
        **flags,
        task_script=ns.task_script,
        task_script_args=list(ns.task_script_args),
        sim_from_env=sim_from_env,
        print_plan=ns.print_plan,
        given=given,
        slurm=slurm,
    )
    return cfg, notes


def infer_from_slurm(ns: Namespace, given: frozenset[str], env: Mapping[str, str]) -> Inferred | None:
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
        raise ConfigError("", f"--master_addr={cfg.master_addr}: {exc}") from None
    argv = task_argv(cfg.task_script, cfg.task_script_args, must_exist=not cfg.print_plan)
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
        hostname=os.uname().nodename,  # gethostname(2) reads the same, without importing socket
        source_ip=source_ip_towards(master_ip, cfg.master_port),
        task_argv=argv,
        task_python=task_python(argv),
        python=sys.executable,
        scheduler_mode=mode,
        job_id=job_id,
        launcher_id=job_id,
        job_token=token.token,
        token_source=token.source,
        master_port=cfg.master_port,
        dist_port=cfg.dist_port,
        base_env=env,
        package_root=PACKAGE_ROOT,
        topology=topology,
        tools=tools,
    )


def plan_from_args(argv: list[str], env: dict[str, str], job_id: str) -> tuple[LaunchConfig, NodeFacts, LaunchPlan]:
    """Everything msrun decides before it starts anything: flags, validation, facts, the plan.

    Bad input ends here: one ``msrun: error: argument --flag: ...`` line and ``SystemExit(2)``.
    """
    ns = parse_args(argv)
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
        from pytest_msrun.engine.cliparser import build_parser

        # msrun's usage line and ``msrun: error: message`` on stderr; exit status 2
        build_parser().error(str(exc) if isinstance(exc, ConfigError) else f"argument --{exc.flag}: {exc}")
    return cfg, facts, plan


def main(argv: list[str], guard: JobGuard | None, job_id: str) -> int:
    """msrun. ``guard``: the job's watchdog and cgroup, started before this module was imported
    (see :mod:`pytest_msrun.entry`); started here when not."""
    env = dict(os.environ)
    try:
        cfg, facts, plan = plan_from_args(argv, env, job_id)
        timeline.mark("planned")
        if cfg.print_plan:
            sys.stdout.write(plan.dumps() + "\n")
            return 0
        if guard is None:  # the entry point guessed "not a launch"
            guard = JobGuard(job_id, env)
        if not cfg.join:
            from pytest_msrun.engine.detach import launch_detached

            return launch_detached(cfg, facts, guard)
        from pytest_msrun.engine.agent import Agent

        return Agent(cfg, facts, guard=guard).run().exit_code
    finally:
        if guard is not None:
            guard.release()  # idempotent: the agent has already released it after its teardown
