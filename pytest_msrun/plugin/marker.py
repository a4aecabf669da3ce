"""The ``@pytest.mark.msrun(...)`` marker: every engine option a test may set, validated."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import pytest

from pytest_msrun.binding.flags import BindFlagError, parse_bind_value
from pytest_msrun.engine.config import SCHEDULER_MODES, SIM_LEVELS
from pytest_msrun.engine.simselect import SelectionError, select_ranks
from pytest_msrun.sizes import parse_size

MARKER = "msrun"
DEFAULT_TIMEOUT = 300.0
PARAM = "_msrun_worker_num"
MARKER_HELP = (
    "msrun(worker_num=2, local_worker_num=None, timeout=None, bind_core=False, bind_numa=False, "
    "sim_level=None, sim_rank_id=None, sim_ranks=None, sim_budget=None, scheduler='auto', env=None, devices=0, "
    "isolated=False): "
    "run the test as a multi-rank msrun job (worker_num=[2, 4] parametrizes; isolated=True: processes of "
    "its own, forked from a world's templates, never a warm world's)"
)


class MarkerError(ValueError):
    """An ``msrun`` marker with an invalid argument."""


@dataclass
class MsrunSpec:
    """A marked test's job, after parametrization picked one ``worker_num``."""

    worker_num: int = 2
    local_worker_num: int | None = None
    timeout: float | None = None
    bind_core: str = "False"
    bind_numa: str = "False"
    sim_level: int | None = None
    sim_rank_id: int | None = None
    sim_ranks: str = ""
    sim_budget: str = ""  # bytes a simulated rank may hold (pytest_msrun.dryrun.account), "24GiB"
    scheduler: str = "auto"
    env: dict[str, str] = field(default_factory=dict)
    devices: int = 0
    isolated: bool = False  # a fresh job of its own, never a warm world

    def node_sizes(self) -> list[int]:
        """Workers per msrun invocation (several invocations = a multi-node job on loopback).

        A dry run is one invocation: simulated ranks need no nodes, only a selection."""
        if self.sim_level is not None:
            return [self.worker_num]
        per_node = self.local_worker_num or self.worker_num
        return [min(per_node, self.worker_num - first) for first in range(0, self.worker_num, per_node)]


KNOWN = tuple(f.name for f in fields(MsrunSpec))  # the marker's arguments: the spec's fields, in order


def _positive_int(name: str, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MarkerError(f"{where}: msrun({name}=...) must be a positive int, got {value!r}")
    return value


def marker_kwargs(mark: pytest.Mark, where: str) -> dict[str, Any]:
    kwargs = dict(mark.kwargs)
    if mark.args:
        if len(mark.args) > 1 or "worker_num" in kwargs:
            raise MarkerError(f"{where}: msrun() takes worker_num as its only positional argument")
        kwargs["worker_num"] = mark.args[0]
    unknown = sorted(set(kwargs) - set(KNOWN))
    if unknown:
        raise MarkerError(f"{where}: unknown msrun() argument(s) {unknown}; known: {', '.join(KNOWN)}")
    return kwargs


def worker_nums(mark: pytest.Mark, where: str) -> list[int]:
    """``worker_num`` as a list (a list parametrizes the test)."""
    value = marker_kwargs(mark, where).get("worker_num", 2)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise MarkerError(f"{where}: msrun(worker_num=[]) is empty")
    return [_positive_int("worker_num", v, where) for v in values]


def spec_for(item: pytest.Item) -> MsrunSpec | None:
    """The validated job spec of ``item``, or None when it is not marked."""
    mark = item.get_closest_marker(MARKER)
    if mark is None:
        return None
    where = item.nodeid
    kwargs = marker_kwargs(mark, where)
    nums = worker_nums(mark, where)
    params = getattr(getattr(item, "callspec", None), "params", {})
    worker_num = int(params[PARAM]) if PARAM in params else nums[0]
    spec = MsrunSpec(worker_num=worker_num)
    if kwargs.get("local_worker_num") is not None:
        spec.local_worker_num = _positive_int("local_worker_num", kwargs["local_worker_num"], where)
        if spec.local_worker_num > worker_num:
            raise MarkerError(
                f"{where}: msrun(local_worker_num={spec.local_worker_num}) exceeds worker_num={worker_num}"
            )
    if kwargs.get("timeout") is not None:
        timeout = kwargs["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise MarkerError(f"{where}: msrun(timeout=...) must be a positive number of seconds, got {timeout!r}")
        spec.timeout = float(timeout)
    for flag in ("bind_core", "bind_numa"):
        value = kwargs.get(flag, False)
        if isinstance(value, (bool, str)):
            text = str(value)
        elif isinstance(value, dict):
            text = json.dumps(value)
        else:
            raise MarkerError(f"{where}: msrun({flag}=...) must be a bool, a dict or a string, got {value!r}")
        try:
            parse_bind_value(text, flag)
        except BindFlagError as exc:
            raise MarkerError(f"{where}: msrun({flag}=...): {exc}") from None
        setattr(spec, flag, text)
    if kwargs.get("sim_level") is not None:
        if kwargs["sim_level"] not in SIM_LEVELS:
            raise MarkerError(f"{where}: msrun(sim_level=...) must be one of {SIM_LEVELS}")
        spec.sim_level = int(kwargs["sim_level"])
    if kwargs.get("sim_rank_id") is not None:
        rid = kwargs["sim_rank_id"]
        if spec.sim_level is None or isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < worker_num:
            raise MarkerError(f"{where}: msrun(sim_rank_id=...) needs sim_level and 0 <= id < worker_num")
        spec.sim_rank_id = rid
    if kwargs.get("sim_ranks") is not None:
        sel = kwargs["sim_ranks"]
        if isinstance(sel, (list, tuple, range)):
            sel = ",".join(str(int(r)) for r in sel)
        if spec.sim_level is None or spec.sim_rank_id is not None or not isinstance(sel, str):
            raise MarkerError(
                f"{where}: msrun(sim_ranks=...) needs sim_level, excludes sim_rank_id, and is a selection "
                "such as 'first:8,last:8,sample:16' or a list of ranks"
            )
        try:
            select_ranks(sel, range(worker_num))
        except SelectionError as exc:
            raise MarkerError(f"{where}: msrun(sim_ranks={sel!r}): {exc}") from None
        spec.sim_ranks = sel
    if kwargs.get("sim_budget") is not None:
        budget = kwargs["sim_budget"]
        try:
            if spec.sim_level is None or isinstance(budget, bool) or not isinstance(budget, (int, str)):
                raise ValueError("needs sim_level, and is bytes or a size such as '24GiB'")
            parse_size(str(budget))
        except ValueError as exc:
            raise MarkerError(f"{where}: msrun(sim_budget={budget!r}): {exc}") from None
        spec.sim_budget = str(budget)
    scheduler = kwargs.get("scheduler", "auto")
    if scheduler not in SCHEDULER_MODES:
        raise MarkerError(f"{where}: msrun(scheduler={scheduler!r}) is not one of {SCHEDULER_MODES}")
    spec.scheduler = scheduler
    env = kwargs.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise MarkerError(f"{where}: msrun(env=...) must be a dict of str to str")
    spec.env = dict(env)
    devices = kwargs.get("devices", 0)
    if devices is True:
        devices = worker_num
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 0:
        raise MarkerError(f"{where}: msrun(devices=...) must be a device count (or True = one per rank)")
    spec.devices = devices
    isolated = kwargs.get("isolated", False)
    if not isinstance(isolated, bool):
        raise MarkerError(f"{where}: msrun(isolated=...) must be True or False, got {isolated!r}")
    spec.isolated = isolated
    return spec


def marked_specs(items: list[pytest.Item]) -> Iterator[tuple[pytest.Item, MsrunSpec]]:
    """``(item, spec)`` of every marked item whose marker is valid, in order."""
    for item in items:
        try:
            spec = spec_for(item)
        except MarkerError:
            continue
        if spec is not None:
            yield item, spec


def default_timeout(config: pytest.Config) -> float:
    """A marked test's timeout when its marker gives none: --msrun-timeout, else ini msrun_timeout (300 s)."""
    return float(config.getoption("msrun_timeout") or config.getini("msrun_timeout") or DEFAULT_TIMEOUT)
