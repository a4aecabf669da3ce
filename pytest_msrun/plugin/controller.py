"""The controller: each marked test becomes a real msrun job; its ranks' results, one report."""

from __future__ import annotations

import os
import re

import pytest

from pytest_msrun.engine.slurm import allocation
from pytest_msrun.pathsearch import which
from pytest_msrun.plugin import options
from pytest_msrun.plugin.job import TestJob
from pytest_msrun.plugin.marker import MARKER, MarkerError, default_timeout, spec_for
from pytest_msrun.plugin.merge import Merger, load_logs
from pytest_msrun.plugin.pool import DeviceShortage, ResourcePool, inventory


def _safe_name(nodeid: str) -> str:
    name = nodeid.split("::", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60] or "test"


def _node_path(item: pytest.Item) -> str:
    """The item's node id with an absolute file path, so ranks find it from any directory."""
    path = getattr(item, "path", None)
    rest = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
    return f"{path}::{rest}" if path is not None and rest else item.nodeid


class Controller:
    """Registered in a normal pytest session: runs marked tests as jobs."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.style = config.getoption("msrun_report") or config.getini("msrun_report") or "first"
        self.timeout = default_timeout(config)
        devices = config.getoption("msrun_devices") or config.getini("msrun_devices") or "auto"
        try:
            self.inventory = inventory(devices)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        self.pool = ResourcePool()
        self.args = options.command_line(config)
        self.cluster = allocation(os.environ) if which("srun") else None

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        if getattr(config.option, "usepdb", False):
            return (
                "msrun: --pdb cannot enter ranks in other processes; add --msrun-inprocess to debug marked tests here"
            )
        if self.cluster is not None:
            return (
                f"msrun: Slurm allocation {self.cluster.job_id} ({len(self.cluster.nodes)} nodes): tests of several "
                "nodes run their msruns on its nodes through srun"
            )
        return None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if item.get_closest_marker(MARKER) is None:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        try:
            reports = self.run_item(item)
        finally:
            ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        for report in reports:
            ihook.pytest_runtest_logreport(report=report)
        # Collectors this item shares with the next one stay; the others are torn down now,
        # as pytest's own protocol would have done.
        item.session._setupstate.teardown_exact(nextitem)
        return True

    def run_item(self, item: pytest.Item) -> list[pytest.TestReport]:
        try:
            spec = spec_for(item)
        except MarkerError as exc:
            return [self._simple(item, "setup", "failed", str(exc))]
        assert spec is not None
        skip = self._static_skip(item)
        if skip is not None:
            return [self._simple(item, "setup", "skipped", skip)]
        try:
            lease = self.pool.lease(ports=2, devices=spec.devices, inv=self.inventory, wait=self._timeout(spec))
        except DeviceShortage as exc:
            if spec.devices > len(self.inventory.ids):
                return [self._simple(item, "setup", "skipped", f"msrun: {exc}")]
            return [self._simple(item, "setup", "failed", f"msrun: {exc}")]
        try:
            return self._run_job(item, spec, lease.ports, self._device_env(lease.devices))
        finally:
            self.pool.release(lease)

    def _timeout(self, spec) -> float:
        return spec.timeout or self.timeout

    def _device_env(self, devices: list[str]) -> dict[str, str]:
        if not devices:
            return {}
        return {self.inventory.env_var: ",".join(devices)}

    def _run_job(self, item: pytest.Item, spec, ports: list[int], extra_env: dict[str, str]) -> list[pytest.TestReport]:
        factory = self.config._tmp_path_factory  # type: ignore[attr-defined]
        job_dir = factory.mktemp(f"msrun-{_safe_name(item.nodeid)}", numbered=True)
        live = getattr(self.config.option, "capture", "fd") == "no"
        job = TestJob(
            nodeid=_node_path(item),
            spec=spec,
            job_dir=job_dir,
            ports=ports,
            rank_args=self.args,
            extra_env={**extra_env, **options.ship(self.config, str(job_dir / "pytest-options.json"))},
            live_output=live,
            cluster=self.cluster,
        )
        run = job.run(self._timeout(spec))
        ranks = job.expected_ranks()
        logs = load_logs(str(job.report_dir), ranks)
        reproduce = run.reproduce(str(self.config.invocation_params.dir))
        merger = Merger(item, run, logs, ranks, self.style, reproduce, str(job.log_dir))
        return merger.merged_reports()

    def _static_skip(self, item: pytest.Item) -> str | None:
        """A skip/skipif mark that already applies here: no job is started for it."""
        try:
            from _pytest.skipping import evaluate_skip_marks
        except ImportError:  # pragma: no cover - private API moved
            return None
        try:
            skipped = evaluate_skip_marks(item)
        except Exception:  # evaluation errors surface in the ranks, with their traceback
            return None
        return skipped.reason if skipped is not None else None

    def _simple(self, item: pytest.Item, when: str, outcome: str, text: str) -> pytest.TestReport:
        path = str(getattr(item, "path", item.location[0]))
        lineno = item.location[1] or 0
        longrepr = (path, lineno, text) if outcome == "skipped" else text
        return pytest.TestReport(
            nodeid=item.nodeid,
            location=item.location,
            keywords={k: 1 for k in item.keywords},
            outcome=outcome,  # type: ignore[arg-type]
            longrepr=longrepr,
            when=when,  # type: ignore[arg-type]
        )
