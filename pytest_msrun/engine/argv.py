"""msrun's flags as a table, and its command line read without :mod:`argparse` when it is plain.

Importing ``argparse`` and building its parser is ~6% of msrun's start-up. Nearly every command
line is plain: exact ``--flag=value`` / ``--flag value`` pairs, then the task and its arguments.
:func:`parse_plain` reads those and declines (returns None) anything else - an abbreviated or
unknown flag, a value that starts with ``-``, ``--``, ``-h``, ``--print_plan``, a value the flag
does not accept, a task argument argparse finds ambiguous - which :mod:`.cliparser`
(``argparse``) then reads, with its errors and help.
The invariant, tested against ``argparse`` itself: whatever this accepts, argparse accepts and
reads the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

from pytest_msrun.binding.flags import BindSpec, parse_bind_value
from pytest_msrun.engine.config import SCHEDULER_MODES, SIM_LEVELS, LaunchConfig, parse_join

UNSET = object()  # a flag's value before defaults are applied: tells given flags from defaults


def _one_of(choices: Sequence[object], convert: Callable[[str], object]) -> Callable[[str], object]:
    def parse(value: str) -> object:
        result = convert(value)
        if result not in choices:
            raise ValueError(f"{value!r} is not one of {list(choices)}")
        return result

    return parse


# Every flag that takes a value: how its value is read (argparse's ``type`` and ``choices``).
CONVERTERS: dict[str, Callable[[str], object]] = {
    "worker_num": int,
    "local_worker_num": int,
    "master_addr": str,
    "master_port": int,
    "node_rank": int,
    "log_dir": str,
    "join": parse_join,
    "cluster_time_out": int,
    "bind_core": lambda value: parse_bind_value(value, "bind_core"),
    "bind_numa": lambda value: parse_bind_value(value, "bind_numa"),
    "sim_level": _one_of(SIM_LEVELS, int),
    "sim_rank_id": int,
    "rank_table_file": str,
    "worker_log_name": str,
    "tail_worker_log": str,
    "sim_select": str,
    "sim_concurrency": int,
    "sim_budget": str,
    "scheduler": _one_of(SCHEDULER_MODES, str),
    "dist_port": int,
    "trace": str,
}


# msrun's defaults (and this launcher's extensions'), applied after parsing: LaunchConfig's, but
# --sim_level's None (MS_SIMULATION_LEVEL may stand for a flag not given).
_CONFIG = LaunchConfig()
DEFAULTS: dict[str, object] = {**{name: getattr(_CONFIG, name) for name in CONVERTERS}, "sim_level": None}

# Every option string of msrun's argparse parser.
OPTION_STRINGS = ("-h", "--help", "--print_plan", *(f"--{name}" for name in CONVERTERS))


def _ambiguous(arg: str) -> bool:
    """Whether argparse stops at ``arg`` as an ambiguous abbreviation of its options - which it
    does even among the task's arguments (it classifies every argument before it assigns any)."""
    if not arg.startswith("--") or arg in OPTION_STRINGS:
        return False
    prefix = arg.split("=", 1)[0]
    return prefix not in OPTION_STRINGS and sum(o.startswith(prefix) for o in OPTION_STRINGS) > 1


def parse_plain(argv: Sequence[str]) -> SimpleNamespace | None:
    """The command line read as ``argparse`` would read it - an attribute per flag (``UNSET``
    where not given), ``task_script``, ``task_script_args`` and ``print_plan`` - or None when it
    is not plain."""
    if "--" in argv:
        return None
    values: dict[str, object] = dict.fromkeys(CONVERTERS, UNSET)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            if not arg or arg.startswith("-") or any(map(_ambiguous, argv[i + 1 :])):
                return None
            return SimpleNamespace(**values, print_plan=False, task_script=arg, task_script_args=list(argv[i + 1 :]))
        name, eq, value = arg[2:].partition("=")
        convert = CONVERTERS.get(name)
        if convert is None:
            return None
        if not eq:
            if i + 1 == len(argv):
                return None
            value = argv[i + 1]
        if value.startswith("-"):
            return None
        try:
            values[name] = convert(value)
        except Exception:  # argparse says why, in its words
            return None
        i += 1 if eq else 2
    return None  # no task: a usage error argparse reports


def bind_text(spec: BindSpec) -> str:
    """A ``--bind_core``/``--bind_numa`` value that parses back to ``spec``."""
    if spec.kind in ("off", "auto"):
        return str(spec.kind == "auto")
    if spec.file:
        return spec.file
    import json

    return json.dumps(spec.entries if spec.kind == "dict" else spec.unified, separators=(",", ":"))


def flags_of(cfg: LaunchConfig) -> list[str]:
    """The msrun command line of ``cfg``: its flags - worker
    counts always, every other flag whose value is not msrun's default - then the task and its
    arguments. msrun reads it back as ``cfg`` (tested in tests/test_argv.py)."""
    out = [f"--worker_num={cfg.worker_num}", f"--local_worker_num={cfg.local_worker_num}"]
    for name, default in DEFAULTS.items():
        value = getattr(cfg, name)
        if name in ("worker_num", "local_worker_num") or value == default or (name == "sim_level" and value == -1):
            continue
        if isinstance(value, BindSpec):
            value = bind_text(value)
        out.append(f"--{name}={value}")
    if cfg.print_plan:
        out.append("--print_plan")
    return [*out, cfg.task_script, *cfg.task_script_args]
