"""The controller: each marked test runs as a real msrun job - a warm world shared with the tests of
its shape (:mod:`.world`), or a fresh job of its own - and its ranks' results become one report."""

from __future__ import annotations

import os
import re
import time
import warnings

import pytest

from pytest_msrun.engine.slurm import allocation
from pytest_msrun.pathsearch import which
from pytest_msrun.plugin import options
from pytest_msrun.plugin.job import TestJob
from pytest_msrun.plugin.marker import MARKER, MarkerError, default_timeout, marked_specs, spec_for
from pytest_msrun.plugin.merge import Merger, load_logs
from pytest_msrun.plugin.pool import DeviceShortage, ResourcePool, inventory
from pytest_msrun.plugin.world import MAX_WORLDS, World, eligible, world_key


class MsrunLeakWarning(pytest.PytestWarning):
    """A test in a warm world left something behind on a rank (thread, process, file, environment)."""


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
        self.warm = (config.getoption("msrun_worlds") or config.getini("msrun_worlds") or "warm") == "warm"
        self.leaks = config.getoption("msrun_leaks") or config.getini("msrun_leaks") or "warn"
        self.worlds: dict[tuple, World] = {}
        self.planned: dict[tuple, list[pytest.Item]] = {}  # each world's tests, in collection order
        self.key_of: dict[str, tuple] = {}
        self.next_in_world: dict[str, str | None] = {}  # the test its world runs after it, if any

    # ---------------------------------------------------------------- warm worlds
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Which tests share a world, in the order they will run."""
        if not self.warm:
            return
        for item, spec in marked_specs(items):
            if not self._warm_fits(spec):
                continue
            key = world_key(spec, spec.devices)
            self.key_of[item.nodeid] = key
            planned = self.planned.setdefault(key, [])
            if planned:
                self.next_in_world[planned[-1].nodeid] = item.nodeid
            planned.append(item)
            self.next_in_world[item.nodeid] = None

    def _warm_fits(self, spec) -> bool:
        return eligible(spec) and not (self.cluster is not None and len(spec.node_sizes()) > 1)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop_worlds()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.stop_worlds()

    def stop_worlds(self) -> None:
        worlds, self.worlds = list(self.worlds.values()), {}
        for world in worlds:
            self._end_world(world)

    def _end_world(self, world: World) -> None:
        world.stop()
        self.pool.release(world.lease)

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
        key = self.key_of.get(item.nodeid)
        if key is not None:
            reports = self._run_warm(item, spec, key)
            if reports is not None:
                return reports
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
        job = self._new_job(item, spec, ports, extra_env)
        run = job.run(self._timeout(spec))
        ranks = job.expected_ranks()
        logs = load_logs(str(job.report_dir), ranks)
        reproduce = run.reproduce(str(self.config.invocation_params.dir))
        merger = Merger(item, run, logs, ranks, self.style, reproduce, str(job.log_dir))
        return merger.merged_reports()

    def _new_job(self, item: pytest.Item, spec, ports: list[int], extra_env: dict[str, str]) -> TestJob:
        factory = self.config._tmp_path_factory  # type: ignore[attr-defined]
        job_dir = factory.mktemp(f"msrun-{_safe_name(item.nodeid)}", numbered=True)
        return TestJob(
            nodeid=_node_path(item),
            spec=spec,
            job_dir=job_dir,
            ports=ports,
            rank_args=self.args,
            extra_env={**extra_env, **options.ship(self.config, str(job_dir / "pytest-options.json"))},
            live_output=getattr(self.config.option, "capture", "fd") == "no",
            cluster=self.cluster,
        )

    def _world_for(self, item: pytest.Item, spec, key: tuple) -> World | None:
        """The live world of ``key``, or a new one (None when it cannot start: run fresh instead)."""
        world = self.worlds.get(key)
        if world is not None and not world.dead:
            return world
        if world is not None:
            self._end_world(self.worlds.pop(key))
        while len(self.worlds) >= MAX_WORLDS:
            oldest = min(self.worlds.values(), key=lambda w: w.last_used)
            self._end_world(self.worlds.pop(oldest.key))
        try:
            lease = self.pool.lease(ports=2, devices=spec.devices, inv=self.inventory, wait=self._timeout(spec))
        except DeviceShortage:
            return None
        job = self._new_job(item, spec, lease.ports, self._device_env(lease.devices))
        job.nodeids = [_node_path(i) for i in self.planned[key]]
        timeout = self._timeout(spec)
        world = World(key, job, lease, max(1, min(600, int(timeout))))
        problem = world.connect(time.monotonic() + timeout)
        if problem:  # a fresh job of this test reports what went wrong, the way it always has
            world.dead = problem
            self._end_world(world)
            return None
        self.worlds[key] = world
        return world

    def _run_warm(self, item: pytest.Item, spec, key: tuple) -> list[pytest.TestReport] | None:
        world = self._world_for(item, spec, key)
        if world is None:
            return None
        nextid = self.next_in_world.get(item.nodeid)
        test = self._new_job(item, spec, world.lease.ports, self._device_env(world.lease.devices))
        result = world.run_test(test, item.nodeid, nextid, self._timeout(spec))
        if world.dead:
            self._end_world(self.worlds.pop(key))
        if result.missing:
            return None
        if nextid is None and key in self.worlds:  # its last planned test: the world is done
            self._end_world(self.worlds.pop(key))
        ranks = test.expected_ranks()
        logs = load_logs(str(test.report_dir), ranks)
        reproduce = result.run.reproduce(str(self.config.invocation_params.dir))
        reports = Merger(item, result.run, logs, ranks, self.style, reproduce, str(world.job.log_dir)).merged_reports()
        if result.leaks and self.leaks != "off":
            self._report_leaks(item, reports, result.leaks)
        return reports

    def _report_leaks(self, item: pytest.Item, reports: list[pytest.TestReport], leaks: dict[int, list[str]]) -> None:
        lines = [f"rank {rank}: {what}" for rank, items in sorted(leaks.items()) for what in items]
        text = f"{item.nodeid} left behind in its warm world:\n  " + "\n  ".join(lines)
        if self.leaks == "warn":  # attributed to the test, as a warning it raised would be
            path = str(getattr(item, "path", item.location[0]))
            warnings.warn_explicit(MsrunLeakWarning(text), MsrunLeakWarning, path, (item.location[1] or 0) + 1)
            return
        teardown = next((r for r in reports if r.when == "teardown"), None)
        if teardown is not None and teardown.outcome == "passed":
            teardown.outcome = "failed"
            teardown.longrepr = text + "\n(--msrun-leaks=error; isolated=True runs the test in a fresh job)"

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
