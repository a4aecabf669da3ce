"""``LaunchConfig``: every launch option, validated before anything starts.

Validation never touches the OS beyond reading paths the user named (task script, rank table,
log dir); each failure is a :class:`ConfigError` naming the flag and the fix, which the CLI
prints as ``msrun: error: argument --flag: ...`` with exit status 2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pytest_msrun.binding.flags import BindSpec
from pytest_msrun.engine.kinds import SchedulerMode
from pytest_msrun.engine.simselect import SelectionError, select_ranks
from pytest_msrun.fileio import planted, unsafe_directory, unsafe_output_dir
from pytest_msrun.record import field, record
from pytest_msrun.sizes import parse_size

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pytest_msrun.engine.slurm import Inferred

# --scheduler's choices (SchedulerMode.NONE is what a dry run has, not a choice)
SCHEDULER_MODES = tuple(str(m) for m in SchedulerMode if m != SchedulerMode.NONE)
SIM_LEVELS = (0, 1, 2, 3)
MAX_WORKERS = 1 << 20  # more ranks than any job msrun can start (and ranges over them stay small)
MAX_LOCAL_WORKERS = 1 << 16  # processes one node may start (dry runs run theirs in waves: no limit)
COMMAND_TASKS = ("python", "python3", "pytest")


class ConfigError(ValueError):
    """An invalid option: ``flag`` is the option name without dashes ("": the message names it)."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument --{flag}: {message}" if flag else message)


def check_environment(env: dict[str, str]) -> None:
    """Every variable msrun reads, parsed once before anything starts: :class:`ConfigError` names
    the first malformed one and what it takes (so no part of the job dies of it later)."""

    def seconds(name: str, low: float, note: str = "") -> None:
        text = env.get(name, "").strip()
        if not text:
            return
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value == value and abs(value) != float("inf") and value >= low):
            limit = " > 0" if low > 0 else (" >= 0" if low == 0 else "")
            raise ConfigError("", f"{name}={text!r}: must be a number of seconds{limit}{note}; fix it or unset it")

    seconds("MSRUN_TERM_TIMEOUT", 0.0)
    seconds("MSRUN_AUTH_TIMEOUT", 1e-9)
    seconds("MS_NODE_TIMEOUT", float("-inf"), " (0 or less: no heartbeat timeout)")
    text = env.get("MSRUN_MAX_MESSAGE_BYTES", "").strip()
    if text and not (text.isdigit() and int(text) >= 16384):
        raise ConfigError("", f"MSRUN_MAX_MESSAGE_BYTES={text!r}: must be a byte count >= 16384; fix it or unset it")
    cgroup = env.get("MSRUN_CGROUP", "").strip().lower()
    if cgroup not in ("", "auto", "v2", "freezer", "off", "0", "no", "false"):
        raise ConfigError("", f"MSRUN_CGROUP={cgroup!r}: must be auto, v2, freezer or off")
    for name in ("MSRUN_ERROR_FILES", "MSRUN_SLURM"):
        value = env.get(name, "").strip().lower()
        if value not in ("1", "0", "on", "off", "true", "false", "yes", "no", ""):
            raise ConfigError("", f"{name}={value!r}: must be 1 or 0 (on/off)")


@record
class LaunchConfig:
    """The 15 msrun options plus this project's few extensions."""

    task_script: str = ""
    task_script_args: list[str] = field(default_factory=list)
    worker_num: int = 8
    local_worker_num: int = 8
    master_addr: str = "127.0.0.1"
    master_port: int = 8118
    node_rank: int = -1
    log_dir: str = ""
    join: bool = False
    cluster_time_out: int = 600
    bind_core: BindSpec = field(default_factory=BindSpec)
    bind_numa: BindSpec = field(default_factory=BindSpec)
    sim_level: int = -1
    sim_rank_id: int = -1
    sim_from_env: bool = False
    sim_select: str = ""
    sim_concurrency: int = 0
    sim_budget: str = ""  # bytes one simulated rank may hold (24GiB, 500MB; "" or 0: no budget)
    rank_table_file: str = ""
    worker_log_name: str = ""
    tail_worker_log: str = "-1"
    # extensions
    scheduler: str = "auto"
    print_plan: bool = False
    dist_port: int = -1
    trace: str = ""  # --trace / MSRUN_TRACE: the job's Chrome trace file, absolute ("" = not traced)
    # the flags given on the command line (the others hold their defaults)
    given: frozenset[str] = frozenset()
    # the flags taken from the Slurm step msrun runs in (pytest_msrun.engine.slurm.Inferred)
    slurm: Inferred | None = None

    @property
    def dry_run(self) -> bool:
        return self.sim_level != -1

    @property
    def budget(self) -> int:
        """``--sim_budget`` in bytes (0: none)."""
        return parse_size(self.sim_budget) if self.sim_budget else 0

    @property
    def multi_node(self) -> bool:
        return self.local_worker_num < self.worker_num

    def tail_ranks(self) -> list[int] | None:
        """Ranks whose logs are tailed; ``None`` = every local worker."""
        text = self.tail_worker_log.strip()
        if text in ("-1", ""):
            return None
        out: list[int] = []
        for item in text.split(","):
            item = item.strip()
            if not item.lstrip("-").isdigit():
                raise ValueError(f"{item!r} is not a rank number; use -1 (all) or a comma list such as 0,3")
            out.append(int(item))
        return out


def parse_join(value: str) -> bool:
    """``True``/``False`` in any case, ``1``/``0``, ``yes``/``no``."""
    low = value.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"invalid value {value!r}: use True or False")


TRACE_ENV = "MSRUN_TRACE"


def trace_path(flag: str, env: Mapping[str, str]) -> str:
    """The trace file asked for (``--trace`` wins over ``MSRUN_TRACE``), absolute; "" for none."""
    path = (flag or env.get(TRACE_ENV, "")).strip()
    return os.path.abspath(path) if path else ""


def validate(cfg: LaunchConfig) -> list[str]:
    """Check every option (what the parser's types and choices admit: a config read from a command
    line); return warnings. Raises :class:`ConfigError` on the first bad value."""
    warnings: list[str] = []
    if not cfg.task_script:
        raise ConfigError("", "the following arguments are required: task_script")
    if cfg.trace:
        where = os.path.dirname(cfg.trace) or "."
        if os.path.isdir(cfg.trace):
            problem = f"{cfg.trace} is a directory; name a file (job.trace.json)"
        elif not os.path.isdir(where):
            problem = f"the directory {where} does not exist; create it or name another file"
        elif not os.access(where, os.W_OK | os.X_OK):
            problem = f"the directory {where} is not writable; name another file"
        else:
            problem = ""
        if problem:
            raise ConfigError("trace", f"{problem} (the trace file: --trace or {TRACE_ENV})")
        problem = unsafe_directory(cfg.trace)  # a place someone else could replace: named, with the fix
        if problem:
            raise ConfigError("", f"--trace={cfg.trace}: {problem}")
    if cfg.worker_num <= 0:
        raise ConfigError("worker_num", f"must be greater than 0, got {cfg.worker_num}")
    if cfg.worker_num > MAX_WORKERS:
        raise ConfigError("worker_num", f"{cfg.worker_num} is more than msrun can start; use at most {MAX_WORKERS}")
    if cfg.local_worker_num <= 0:
        raise ConfigError("local_worker_num", f"must be at least 1, got {cfg.local_worker_num}")
    if cfg.local_worker_num > MAX_LOCAL_WORKERS and not cfg.dry_run:
        raise ConfigError(
            "local_worker_num",
            f"{cfg.local_worker_num} processes on one node is more than msrun starts; use at most "
            f"{MAX_LOCAL_WORKERS} per node (a dry run, --sim_level, runs any number in waves)",
        )
    if cfg.local_worker_num > cfg.worker_num:
        if "local_worker_num" not in cfg.given:
            raise ConfigError(
                "local_worker_num",
                f"{cfg.local_worker_num} (the default) exceeds --worker_num={cfg.worker_num}; pass "
                f"--local_worker_num={cfg.worker_num} to run every worker on this node (or fewer per node for a "
                "multi-node job)",
            )
        raise ConfigError(
            "local_worker_num",
            f"{cfg.local_worker_num} exceeds --worker_num={cfg.worker_num}: a node cannot run more workers than the "
            f"whole job; pass --local_worker_num={cfg.worker_num} or raise --worker_num",
        )
    if not 0 <= cfg.master_port <= 65535:
        raise ConfigError("master_port", f"{cfg.master_port} is not a TCP port (0-65535; 0 = pick a free port)")
    if cfg.master_port == 0 and cfg.multi_node and cfg.sim_level < 0:
        raise ConfigError(
            "master_port", "0 (auto) only works when one node runs the whole job; give every node the same port"
        )
    if cfg.dist_port != -1 and not 0 <= cfg.dist_port <= 65535:
        raise ConfigError("dist_port", f"{cfg.dist_port} is not a TCP port (0-65535; -1 = master_port+1)")
    if cfg.node_rank < -1:
        raise ConfigError("node_rank", f"{cfg.node_rank} is invalid; use -1 (assign automatically) or 0, 1, ...")
    if cfg.multi_node and cfg.node_rank >= 0 and cfg.node_rank + cfg.local_worker_num > cfg.worker_num:
        raise ConfigError(
            "node_rank",
            f"node {cfg.node_rank} with {cfg.local_worker_num} workers cannot fit in --worker_num={cfg.worker_num} "
            "(every lower node runs at least one worker)",
        )
    if not cfg.multi_node and cfg.node_rank not in (-1, 0):
        warnings.append(f"All workers will be spawned on this node, so 'node_rank': [{cfg.node_rank}] will be ignored.")
    if cfg.sim_rank_id != -1:
        if cfg.sim_level == -1:
            raise ConfigError("sim_rank_id", "needs --sim_level (a single simulated rank is a dry run)")
        if not 0 <= cfg.sim_rank_id < cfg.worker_num:
            raise ConfigError(
                "sim_rank_id", f"{cfg.sim_rank_id} is outside 0..{cfg.worker_num - 1} (--worker_num={cfg.worker_num})"
            )
    if cfg.sim_select:
        if not cfg.dry_run:
            raise ConfigError("sim_select", "needs --sim_level (it picks the simulated ranks of a dry run)")
        if cfg.sim_rank_id != -1:
            raise ConfigError("sim_select", "and --sim_rank_id both pick ranks; give one of them")
        try:
            select_ranks(cfg.sim_select, range(cfg.worker_num))
        except SelectionError as exc:
            raise ConfigError("sim_select", str(exc)) from None
    if cfg.sim_budget:
        if not cfg.dry_run:
            raise ConfigError("sim_budget", "needs --sim_level (it bounds what each simulated rank holds)")
        try:
            parse_size(cfg.sim_budget)
        except ValueError as exc:
            raise ConfigError("sim_budget", str(exc)) from None
    if cfg.sim_concurrency < 0:
        raise ConfigError("sim_concurrency", f"{cfg.sim_concurrency} is negative; use 0 (CPU count) or more")
    if cfg.rank_table_file and not os.path.isfile(cfg.rank_table_file):
        raise ConfigError("rank_table_file", f"{cfg.rank_table_file!r} does not exist or is not a file")
    try:
        tail = cfg.tail_ranks()
    except ValueError as exc:
        raise ConfigError("tail_worker_log", str(exc)) from None
    for rank in tail or ():
        if not 0 <= rank < cfg.worker_num:
            raise ConfigError(
                "tail_worker_log", f"rank {rank} is outside 0..{cfg.worker_num - 1} (--worker_num={cfg.worker_num})"
            )
    if "/" in cfg.worker_log_name.replace("{ip}", "").replace("{hostname}", ""):
        raise ConfigError("worker_log_name", "must be a file name prefix, not a path; use --log_dir for the directory")
    if cfg.log_dir:
        probe = cfg.log_dir
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe.rstrip("/"))
        probe = probe or "."
        if not os.path.isdir(probe):
            raise ConfigError("log_dir", f"{probe!r} exists and is not a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ConfigError("log_dir", f"{probe!r} is not writable")
        from pytest_msrun.fsinfo import log_dir_problem

        problem = log_dir_problem(cfg.log_dir)
        if problem:
            raise ConfigError("log_dir", problem)
    directory = cfg.log_dir or os.getcwd()
    where = (
        f"--log_dir={directory}"
        if cfg.log_dir
        else f"the log directory (no --log_dir: the current directory {directory})"
    )
    # planted: any of the logs msrun opens there (its status files are written whole: renamed over
    # whatever is at their name, never written through it)
    prefix = cfg.worker_log_name.split("{", 1)[0] or "worker_"
    ours = ("scheduler.log", "msrun.log")
    problem = unsafe_output_dir(directory) or planted(
        directory, lambda name: name in ours or (name.startswith(prefix) and name.endswith(".log"))
    )
    if problem:
        raise ConfigError("", f"{where}: {problem}")
    if cfg.task_script.endswith(".py") and not cfg.print_plan and not os.path.isfile(cfg.task_script):
        raise ConfigError("", f"task_script {cfg.task_script!r} not found (cwd {os.getcwd()})")
    return warnings
