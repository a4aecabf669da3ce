"""How the controller makes a marked test's job: its directory, its msrun invocations' settings,
its timeout, its devices - for a fresh job and a warm world alike.

Also the few facts about a pytest item a job needs: its node id with an absolute path (ranks find
it from any directory), a file-system-safe name, and whether a skip mark already applies (then no
job is started).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_msrun.engine.config import TRACE_ENV
from pytest_msrun.engine.slurm import Allocation
from pytest_msrun.plugin import covdata, options
from pytest_msrun.plugin.controller.debugserver import DebugServer
from pytest_msrun.plugin.controller.forkserver import ForkServer
from pytest_msrun.plugin.controller.job import TestJob
from pytest_msrun.plugin.controller.pool import DeviceInventory, DeviceShortage
from pytest_msrun.plugin.marker import MsrunSpec

PYTEST_TIMEOUT = pytest.StashKey[float]()  # pytest-timeout's timeout for a marked item


def safe_name(nodeid: str) -> str:
    name = nodeid.split("::", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60] or "test"


def node_path(item: pytest.Item) -> str:
    """The item's node id with an absolute file path, so ranks find it from any directory."""
    rest = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
    return f"{item.path}::{rest}" if rest else item.nodeid


def static_skip(item: pytest.Item) -> str | None:
    """A skip/skipif mark that already applies here: no job is started for it."""
    try:
        from _pytest.skipping import evaluate_skip_marks

        skipped = evaluate_skip_marks(item)
    except Exception:  # its private API moved; evaluation errors surface in the ranks, with their traceback
        return None
    return skipped.reason if skipped is not None else None


@dataclass
class Jobs:
    """Makes the jobs of one pytest session (``args``: the options every rank's pytest gets)."""

    config: pytest.Config
    args: list[str]
    trace_dir: str
    cluster: Allocation | None
    inventory: DeviceInventory
    default_timeout: float
    exit_timeout: float  # s the ranks may take to exit once their sessions ended
    debug: DebugServer  # the ranks' debugger (breakpoint(), --pdb)
    forks: ForkServer | None  # the session's fork server (None: every msrun is spawned)

    def timeout(self, spec: MsrunSpec) -> float:
        return spec.timeout or self.default_timeout

    def test_timeout(self, item: pytest.Item, spec: MsrunSpec) -> float:
        """The test's own timeout, the closest one set winning: the item's ``timeout`` mark
        (pytest-timeout), else its ``msrun(timeout=)``, else pytest-timeout's session-wide one
        (``--timeout``, ini), else ``--msrun-timeout``."""
        theirs = item.stash.get(PYTEST_TIMEOUT, None)
        if theirs and (spec.timeout is None or item.get_closest_marker("timeout") is not None):
            return theirs
        return self.timeout(spec)

    def pooled_devices(self, spec: MsrunSpec) -> int:
        """The devices of ``spec``'s job to take from this host's pool: none where Slurm hands a
        step its GPUs (it says which in the step); too many for the allocation's nodes is a shortage."""
        if self.cluster is None or not self.cluster.gpus or not spec.devices:
            return spec.devices
        nodes = len(spec.node_sizes())
        per_node = self.cluster.gpus_per_node(spec.devices, nodes)
        if per_node > self.cluster.gpus:
            raise DeviceShortage(
                f"needs {per_node} GPUs on each of {nodes} node(s); Slurm allocation {self.cluster.job_id} "
                f"has {self.cluster.gpus} per node"
            )
        return 0

    def test_dir(self, item: pytest.Item) -> Path:
        factory = self.config._tmp_path_factory  # type: ignore[attr-defined]
        return Path(factory.mktemp(f"msrun-{safe_name(item.nodeid)}", numbered=True))

    def trace_of(self, item: pytest.Item, tag: str) -> str:
        """The trace file of ``item``'s job ``tag`` (its directory's name, or ``refused``); "": none kept."""
        return os.path.join(self.trace_dir, f"{safe_name(item.nodeid)}-{tag}.trace.json") if self.trace_dir else ""

    def new(self, item: pytest.Item, spec: MsrunSpec, ports: list[int], devices: list[str]) -> TestJob:
        """The job of ``item`` (a fresh test's, or a warm world's named by its first test)."""
        extra_env = {self.inventory.env_var: ",".join(devices)} if devices else {}
        unused = options.unused_rank_plugins(self.config)  # -p no:NAME for each plugin the ranks need not load
        job_dir = self.test_dir(item)
        if self.trace_dir:  # one trace per job
            extra_env = {**extra_env, TRACE_ENV: self.trace_of(item, job_dir.name)}
        return TestJob(
            nodeid=node_path(item),
            spec=spec,
            job_dir=job_dir,
            ports=ports,
            rank_args=[*self.args, *(arg for name in unused for arg in ("-p", f"no:{name}"))],
            extra_env={
                **extra_env,
                **options.ship(self.config, str(job_dir / "pytest-options.json")),
                **covdata.rank_env(self.config),
            },
            live_output=getattr(self.config.option, "capture", "fd") == "no",
            cluster=self.cluster,
            debug=self.debug,
            forks=self.forks,
        )
