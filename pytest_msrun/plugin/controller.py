"""The controller: each marked test runs as a real msrun job - a warm world shared with the tests of
its shape (:mod:`.world`), or a fresh job of its own - and its ranks' results become one report.

A marked test follows pytest's own protocol: its setup and call are run and reported, then its
teardown keeps exactly what pytest would keep for the next test - which, for a warm world, is the
next test of the same shape that *this process* will run (:meth:`Controller.world_next`: pytest's
``nextitem`` and, where the run loop is pytest's own, the rest of ``session.items`` - after
deselection, ``--lf``, reordering and xdist's distribution; ``-x`` and ``--maxfail`` have acted by
then). A world ends within its last test's protocol, so what its ranks' fixtures and processes do
at the end is reported on that test. What ends a world outside a test (a rank gone between tests,
a world the run loop never came back to) is reported as a late teardown error of the last test
that used it - never on a test that did not run there.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import time
import warnings
from collections.abc import Generator, Iterable
from typing import Any

import pytest

from pytest_msrun.engine.slurm import allocation
from pytest_msrun.pathsearch import which
from pytest_msrun.plugin import covdata, envscope, options
from pytest_msrun.plugin.job import TestJob, TestPaths
from pytest_msrun.plugin.marker import MARKER, MarkerError, MsrunSpec, default_timeout, spec_for
from pytest_msrun.plugin.merge import Merger
from pytest_msrun.plugin.outcomes import TestVerdict
from pytest_msrun.plugin.pool import DeviceShortage, ResourcePool, inventory
from pytest_msrun.plugin.runner import Attempt, FreshAttempt, TestRecord, WarmAttempt
from pytest_msrun.plugin.timeline import REPORT_ATTR, SessionReport, test_entry
from pytest_msrun.plugin.world import FORKING, MAX_WORLDS, World, eligible, world_key

DEFAULT_EXIT_TIMEOUT = 60.0


class MsrunLeakWarning(pytest.PytestWarning):
    """A test in a warm world left something behind on a rank (thread, process, file, environment)."""


class MsrunWorldWarning(pytest.PytestWarning):
    """A warm world ended outside a test, and its end could not be reported on the last test it ran."""


def _safe_name(nodeid: str) -> str:
    name = nodeid.split("::", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60] or "test"


def _cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _node_path(item: pytest.Item) -> str:
    """The item's node id with an absolute file path, so ranks find it from any directory."""
    path = getattr(item, "path", None)
    rest = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
    return f"{path}::{rest}" if path is not None and rest else item.nodeid


PYTEST_TIMEOUT = pytest.StashKey[float]()  # pytest-timeout's timeout for a marked item


def _report_options(config: pytest.Config) -> tuple[str, SessionReport | None]:
    """The failure detail (``--msrun-detail``; ``--msrun-report=first|all`` as before) and the HTML
    page ``--msrun-report=FILE.html`` asks for (written by the process that reports the session)."""
    report = config.getoption("msrun_report")
    detail = config.getoption("msrun_detail") or config.getini("msrun_report") or "first"
    if report in ("first", "all"):
        return (config.getoption("msrun_detail") or report), None
    if detail not in ("first", "all"):
        raise pytest.UsageError(f"msrun_report = {detail!r} in the ini file: use first or all")
    if report is None:
        return detail, None
    if not report.lower().endswith((".html", ".htm")) or os.path.isdir(report):
        raise pytest.UsageError(
            f"--msrun-report={report}: name an HTML file (report.html) for the page, or first/all for the "
            "failure detail (also --msrun-detail)"
        )
    where = os.path.dirname(os.path.abspath(report))
    if not os.path.isdir(where):
        raise pytest.UsageError(f"--msrun-report={report}: the directory {where} does not exist")
    if hasattr(config, "workerinput"):  # an xdist worker: the controller process writes the page
        return detail, None
    command = " ".join(["pytest", *config.invocation_params.args])
    return detail, SessionReport(report, command)


def _trace_dir(config: pytest.Config) -> str:
    value = config.getoption("msrun_trace")
    if not value:
        return ""
    path = os.path.abspath(value)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise pytest.UsageError(f"--msrun-trace={value}: cannot use it as a directory ({exc})") from None
    return path


def exit_timeout(config: pytest.Config) -> float:
    """Seconds the ranks may take to exit once every rank's pytest session ended."""
    value = config.getoption("msrun_exit_timeout") or config.getini("msrun_exit_timeout") or DEFAULT_EXIT_TIMEOUT
    return float(value)


class Controller:
    """Registered in a normal pytest session: runs marked tests as jobs."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.style, self.html = _report_options(config)
        self.trace_dir = _trace_dir(config)
        # each test's timeline rides on its teardown report (the HTML page, pytest-html's extras)
        self.timelines = self.html is not None or config.pluginmanager.hasplugin("html")
        self.timeout = default_timeout(config)
        self.exit_timeout = exit_timeout(config)
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
        prefetch = config.getoption("msrun_prefetch") or config.getini("msrun_prefetch") or "on"
        if prefetch not in ("on", "off"):
            raise pytest.UsageError(f"msrun_prefetch = {prefetch!r} in the ini file: use on or off")
        self.prefetch = prefetch == "on"  # worlds, warm or forking
        scope = config.getoption("msrun_env_scope") or config.getini("msrun_env_scope") or "job"
        if scope not in envscope.SCOPES:
            raise pytest.UsageError(f"msrun_env_scope = {scope!r} in the ini file: use job or test")
        self.env_per_test = scope == "test"  # tests differing only in env share a world
        self.xdist_worker = hasattr(config, "workerinput")  # xdist hands this process its items one by one
        self.worlds: dict[tuple, World] = {}
        self.last_item: dict[tuple, pytest.Item] = {}  # each live world's last test
        self.expecting: dict[tuple, str | None] = {}  # the test each live world's fixtures were kept for
        self._keys: dict[str, tuple | None] = {}
        self.unforkable: dict[tuple, str] = {}  # forking worlds whose ranks cannot fork, and why
        self._positions: tuple[int, int, dict[str, int]] | None = None

    # ---------------------------------------------------------------- the session
    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, Any]:
        """Worlds the loop leaves alive (``-x`` after a teardown error, say) end before the session's
        exit status is decided, their ends reported; an interrupted session just stops them."""
        try:
            outcome = yield
        except session.Failed:
            self._end_all("the session stopped")
            raise
        except BaseException:
            self.stop_worlds()
            raise
        self._end_all("no test of its shape was left")
        return outcome

    def _end_all(self, why: str) -> None:
        for key in list(self.worlds):
            self._end_outside(key, why)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop_worlds()
        if self.html is not None:
            path = self.html.write()
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_sep("-", f"msrun: HTML report of {len(self.html.entries)} marked test(s): {path}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.html is not None:
            self.html.add(report)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.stop_worlds()

    def stop_worlds(self) -> None:
        """Stop every world now (an interrupted session: nothing is reported)."""
        worlds, self.worlds = list(self.worlds.values()), {}
        for world in worlds:
            world.stop()
            self.pool.release(world.lease)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Under pytest-randomly, marked tests of one world shape run together (in their shuffled
        order): an order shuffled across shapes would start a world for nearly every test."""
        if not config.pluginmanager.hasplugin("randomly"):
            return
        blocks: dict[Any, list[pytest.Item]] = {}
        order: list[Any] = []
        for item in items:
            key = self.key_of(item)
            slot = ("shape", key) if key is not None else ("item", id(item))
            if slot not in blocks:
                blocks[slot] = []
                order.append(slot)
            blocks[slot].append(item)
        items[:] = [item for slot in order for item in blocks[slot]]

    def pytest_report_header(self, config: pytest.Config) -> str | list[str] | None:
        lines = []
        seed = getattr(config.option, "randomly_seed", None)
        if config.pluginmanager.hasplugin("randomly") and isinstance(seed, int):
            lines.append(
                f"msrun: pytest-randomly: marked tests run grouped by world shape; rank r of a job reseeds "
                f"with {seed} + r (every rank collects in the order of {seed})"
            )
        other = self._header_note(config)
        return [*lines, other] if other else (lines or None)

    def _header_note(self, config: pytest.Config) -> str | None:
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

    # ---------------------------------------------------------------- one marked test
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if item.get_closest_marker(MARKER) is None:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        try:
            self.run_item(item, nextitem)
        finally:
            ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        # Collectors this item shares with the next one stay; the others are torn down now,
        # as pytest's own protocol would have done.
        item.session._setupstate.teardown_exact(nextitem)
        return True

    def _log(self, item: pytest.Item, reports: Iterable[pytest.TestReport]) -> None:
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)

    def run_item(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Run ``item`` on its ranks and report it, phase by phase - again, as a whole job on a
        fresh world, while pytest-rerunfailures grants the failing test reruns."""
        reruns = self._reruns(item)
        for attempt_no in range(reruns + 1):
            if not self._run_once(item, nextitem, rerun=attempt_no < reruns, count=attempt_no):
                return

    def _reruns(self, item: pytest.Item) -> int:
        """How often pytest-rerunfailures reruns ``item`` when it fails (0 without the plugin)."""
        if not self.config.pluginmanager.hasplugin("rerunfailures"):
            return 0
        try:
            from pytest_rerunfailures import get_reruns_count  # type: ignore[import-untyped,import-not-found,unused-ignore]

            return int(get_reruns_count(item) or 0)
        except Exception:  # its internals moved: no reruns rather than a broken session
            return 0

    def _run_once(self, item: pytest.Item, nextitem: pytest.Item | None, rerun: bool, count: int) -> bool:
        """One run of ``item``; with ``rerun`` a failure is reported as pytest-rerunfailures does
        (outcome ``rerun``) and True returned: run it again. False: the test is reported."""
        try:
            spec = spec_for(item)
        except MarkerError as exc:
            self._log(item, [self._simple(item, "setup", "failed", str(exc))])
            return False
        assert spec is not None
        key = self.key_of(item)
        skip = self._static_skip(item)
        attempt: Attempt | None = None
        note = ""
        if key is not None and (skip is None or self.expecting.get(key) == item.nodeid):
            # a skipped test its world kept fixtures for still goes there: its ranks skip it and tear down
            attempt, note = self._warm_attempt(item, spec, key, nextitem)
        if attempt is None:
            if skip is not None:
                self._log(item, [self._simple(item, "setup", "skipped", skip)])
                return False
            attempt = self._fresh_attempt(item, spec, note)
            if attempt is None:
                return False
        cwd = str(self.config.invocation_params.dir)
        record = attempt.record
        first = record.verdict()
        setup_call = Merger(item, record, self.style, cwd).reports(first, ("setup", "call"))
        failed_early = any(r.failed for r in setup_call)
        if not rerun:
            self._log(item, setup_call)
        next_id = self.world_next(item, nextitem, key) if attempt.warm and key is not None else None
        if rerun and failed_early:
            next_id = None  # the rerun gets a fresh world
        record = attempt.finish(next_id, self.exit_timeout)
        final = record.verdict()
        merger = Merger(item, record, self.style, cwd)
        teardown = merger.reports(final, ("teardown",))
        if record.leaks and self.leaks != "off":
            self._report_leaks(item, teardown, record.leaks)
        if teardown:  # junitxml writes the properties of a test's last report: the earlier phases' too
            have = {name for name, _ in teardown[-1].user_properties}
            for report in setup_call:
                for name, value in report.user_properties:
                    if name.startswith("msrun_") and name not in have:
                        teardown[-1].user_properties.append((name, value))
                        have.add(name)
        if self.timelines and teardown:
            self._attach_timeline(teardown[-1], merger, record, final, [*setup_call, *teardown], attempt, key)
        again = False
        if rerun:
            reports = [*setup_call, *teardown]
            for report in reports:
                report.rerun = count  # type: ignore[attr-defined]
            failed = next((i for i, r in enumerate(reports) if r.failed), None)
            if failed is not None:  # as pytest-rerunfailures reports it: up to the failure, marked "rerun"
                reports[failed].outcome = "rerun"  # type: ignore[assignment]
                reports = reports[: failed + 1]
                again = True
            self._log(item, reports)
        else:
            self._log(item, teardown)
        if attempt.warm and key is not None:
            world = self.worlds.get(key)
            if world is not None and world.last is not None:  # a late judgement repeats none of them
                world.last.reported = _teardown_failures(final)
            self._after_warm(item, key, next_id)
        return again

    def _attach_timeline(
        self,
        report: pytest.TestReport,
        merger: Merger,
        record: TestRecord,
        verdict: Any,
        reports: list[pytest.TestReport],
        attempt: Attempt,
        key: tuple | None,
    ) -> None:
        """The test's timeline on its last report: for the HTML page, and pytest-html's extras."""
        entry = test_entry(merger, record, verdict, reports, "warm" if attempt.warm else "fresh")
        world = self.worlds.get(key) if key is not None else None
        entry["world"] = str(world.job.job_dir) if attempt.warm and world is not None else ""
        setattr(report, REPORT_ATTR, entry)
        if self.config.pluginmanager.hasplugin("html"):
            try:
                from pytest_html import extras  # type: ignore[import-untyped,import-not-found,unused-ignore]

                from pytest_msrun.plugin.htmlpage import render_test

                report.extras = [*getattr(report, "extras", []), extras.html(render_test(entry))]  # type: ignore[attr-defined]
            except ImportError:
                pass

    def _fresh_attempt(self, item: pytest.Item, spec: MsrunSpec, note: str) -> FreshAttempt | None:
        try:
            lease = self.pool.lease(ports=2, devices=spec.devices, inv=self.inventory, wait=self._timeout(spec))
        except DeviceShortage as exc:
            outcome = "skipped" if spec.devices > len(self.inventory.ids) else "failed"
            self._log(item, [self._simple(item, "setup", outcome, f"msrun: {exc}")])
            return None
        try:
            job = self._new_job(item, spec, lease.ports, self._device_env(lease.devices))
            return FreshAttempt(item.nodeid, job, self._test_timeout(item, spec), self.exit_timeout, note)
        finally:
            self.pool.release(lease)

    def _test_timeout(self, item: pytest.Item, spec: MsrunSpec) -> float:
        """The test's own timeout: pytest-timeout's for the item when it is active, else ours."""
        return item.stash.get(PYTEST_TIMEOUT, None) or self._timeout(spec)

    # pytest-timeout (when installed): a marked test's timeout is its job's, on the job's clock (from
    # the test's start, not its world's), ending in the grouped hang report; its own timer, which
    # would interrupt the controller, is not armed for marked tests.
    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        if item.get_closest_marker(MARKER) is None:
            return None
        timeout = getattr(settings, "timeout", None)
        if timeout:
            item.stash[PYTEST_TIMEOUT] = float(timeout)
        return True

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        return True if item.get_closest_marker(MARKER) is not None else None

    def _timeout(self, spec: MsrunSpec) -> float:
        return spec.timeout or self.timeout

    def _device_env(self, devices: list[str]) -> dict[str, str]:
        if not devices:
            return {}
        return {self.inventory.env_var: ",".join(devices)}

    def _new_job(self, item: pytest.Item, spec: MsrunSpec, ports: list[int], extra_env: dict[str, str]) -> TestJob:
        job_dir = self._test_dir(item)
        if self.trace_dir:  # one trace per job: a fresh test's, or a warm world's (named by its first test)
            name = f"{_safe_name(item.nodeid)}-{job_dir.name}.trace.json"
            extra_env = {**extra_env, "MSRUN_TRACE": os.path.join(self.trace_dir, name)}
        return TestJob(
            nodeid=_node_path(item),
            spec=spec,
            job_dir=job_dir,
            ports=ports,
            rank_args=[*self.args, *self._unused_plugins()],
            extra_env={
                **extra_env,
                **options.ship(self.config, str(job_dir / "pytest-options.json")),
                **covdata.rank_env(self.config),
            },
            live_output=getattr(self.config.option, "capture", "fd") == "no",
            cluster=self.cluster,
        )

    def _unused_plugins(self) -> list[str]:
        """Plugins the ranks need not load: hypothesis's, when no collected test module imported
        hypothesis (its plugin is installed with it and costs every rank ~0.3 s to start)."""
        import sys

        if "hypothesis" in sys.modules or not self.config.pluginmanager.has_plugin("hypothesispytest"):
            return []
        return ["-p", "no:hypothesispytest"]

    def _test_dir(self, item: pytest.Item):
        factory = self.config._tmp_path_factory  # type: ignore[attr-defined]
        return factory.mktemp(f"msrun-{_safe_name(item.nodeid)}", numbered=True)

    # ---------------------------------------------------------------- warm worlds
    def key_of(self, item: pytest.Item) -> tuple | None:
        """The world ``item`` runs in (None: a fresh job of its own)."""
        if item.nodeid not in self._keys:
            key = None
            if item.get_closest_marker(MARKER) is not None:
                try:
                    spec = spec_for(item)
                except MarkerError:
                    spec = None
                several_hosts = spec is not None and self.cluster is not None and len(spec.node_sizes()) > 1
                if spec is not None and eligible(spec) and not several_hosts:
                    # isolated: each test in processes of its own, forked from the world's ranks
                    forking = spec.isolated or not self.warm
                    key = world_key(self._world_spec(spec), spec.devices) + ((FORKING,) if forking else ())
                    if key in self.unforkable:
                        key = None
            self._keys[item.nodeid] = key
        return self._keys[item.nodeid]

    def _world_spec(self, spec: MsrunSpec) -> MsrunSpec:
        """The job a world serving ``spec`` runs: with ``--msrun-env-scope=test``, without the
        test's own variables (each test has them set when it starts)."""
        if not self.env_per_test:
            return spec
        return dataclasses.replace(spec, env=envscope.split(spec.env)[0])

    def _read_at_collection(self, world: World, item: pytest.Item) -> list[str]:
        """The variables of ``item`` that the ranks of ``world`` looked up while they collected
        (a test module or conftest read them at import): set per test they would differ from a job
        that has them from its start."""
        return sorted(set(world.test_envs.get(item.nodeid, {})) & world.env_read)

    def _future(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterable[pytest.Item]:
        """The items this process will run after ``item``, as far as it knows them: the rest of
        ``session.items`` where pytest's own loop runs them, else (xdist hands them out one by
        one) only ``nextitem``."""
        only_next = [nextitem] if nextitem is not None else []
        if self.xdist_worker:
            return only_next
        items = item.session.items
        if self._positions is None or self._positions[:2] != (id(items), len(items)):
            self._positions = (id(items), len(items), {it.nodeid: i for i, it in enumerate(items)})
        index = self._positions[2].get(item.nodeid)
        if index is None:
            return only_next
        following = items[index + 1] if index + 1 < len(items) else None
        if following is not nextitem:  # another plugin's loop: trust only its nextitem
            return only_next
        return itertools.islice(items, index + 1, None)

    def world_next(self, item: pytest.Item, nextitem: pytest.Item | None, key: tuple) -> str | None:
        """The next test the world of ``item`` will run in this process, or None to end it with
        ``item``: none follows, the session stops (``-x``, ``--maxfail``), another process waits
        for its devices, or :data:`MAX_WORLDS` other shapes come first (it would be evicted)."""
        session = item.session
        world = self.worlds.get(key)
        if world is None or world.dead or session.shouldfail or session.shouldstop:
            return None
        if self.pool.contended(world.lease):
            return None
        others: set[tuple] = set()
        for future in self._future(item, nextitem):
            other = self.key_of(future)
            if other == key:
                if self._read_at_collection(world, future):
                    continue  # it runs as a fresh job
                return future.nodeid
            if other is not None and self._static_skip(future) is None:
                others.add(other)
                if len(others) >= MAX_WORLDS:
                    return None
        return None

    def _warm_attempt(
        self, item: pytest.Item, spec: MsrunSpec, key: tuple, nextitem: pytest.Item | None
    ) -> tuple[WarmAttempt | None, str]:
        """The test in its world (None, and why, when it must run as a fresh job). A world found
        dying when the test reached it (its ranks left before they began it) is reported on the
        test it ran before, and the test gets a new world."""
        for _ in range(2):
            world, why = self._world_for(item, spec, key)
            if world is None:
                return None, why
            read = self._read_at_collection(world, item)
            if read:
                return None, (
                    f"ran as a fresh job: its world's ranks read {', '.join(read)} while collecting, and "
                    "--msrun-env-scope=test sets a test's variables only when it starts"
                )
            before, before_item = world.last, self.last_item.get(key)
            self._prefetch(item, nextitem, key)
            paths = TestPaths(self._test_dir(item), world.job.log_dir)
            paths.make()
            ranks = world.job.expected_ranks()
            timeout = self._test_timeout(item, spec)
            attempt = WarmAttempt(item.nodeid, world, paths, ranks, timeout, self.exit_timeout)
            self.last_item[key] = item
            if attempt.missing:  # a rank did not collect it (it differs from this process's collection)
                attempt.finish(None, self.exit_timeout)
                self._after_warm(item, key, None)
                why = attempt.test.unforkable
                if why:  # so are the ranks of every world of its shape: its tests run as fresh jobs
                    self.unforkable[key] = why
                    self._keys = {nodeid: k for nodeid, k in self._keys.items() if k != key}
                    return None, f"ran as a fresh job: {why}"
                return None, "ran as a fresh job: a rank of its warm world did not collect it"
            left = attempt.left_before()
            if not left or before is None or before_item is None:
                return attempt, ""
            why = f"rank(s) {', '.join(map(str, left))} ended between tests"
            self._report_late(before_item, world, before, attempt.record.run, why)
            self._after_warm(item, key, None)
        return None, "ran as a fresh job: its warm world ended before the test reached it, twice"

    def _world_for(self, item: pytest.Item, spec: MsrunSpec, key: tuple) -> tuple[World | None, str]:
        """The live world of ``key`` (connected now if it was started ahead), or a new one (None
        and why when it cannot start)."""
        world = self.worlds.get(key)
        if world is not None:
            why = world.check()
            if not why and not world.connected:
                why = self._connect(world, self._timeout(spec))
                if why:
                    self.worlds.pop(key)
                    return None, f"ran as a fresh job: its warm world did not start ({why})"
            if not why:
                return world, ""
            self._end_outside(key, why)  # never used for this test: its end is the last test's
        while len(self.worlds) >= MAX_WORLDS:
            oldest = min(self.worlds.values(), key=lambda w: w.last_used)
            self._end_outside(oldest.key, "evicted")
        try:
            lease = self.pool.lease(ports=2, devices=spec.devices, inv=self.inventory, wait=self._timeout(spec))
        except DeviceShortage:
            return None, ""
        world = self._start_world(item, spec, key, lease)
        problem = self._connect(world, self._timeout(spec))
        if problem:  # a fresh job of this test reports what went wrong, the way it always has
            return None, f"ran as a fresh job: its warm world did not start ({problem})"
        self.worlds[key] = world
        return world, ""

    def _start_world(self, item: pytest.Item, spec: MsrunSpec, key: tuple, lease: Any) -> World:
        """Launch the world of ``key`` (its first test: ``item``) without waiting for it."""
        job = self._new_job(item, self._world_spec(spec), lease.ports, self._device_env(lease.devices))
        served = [i for i in item.session.items if self.key_of(i) == key]
        job.nodeids = [_node_path(i) for i in served]
        test_envs: dict[str, dict[str, str]] = {}
        if self.env_per_test:
            for other in served:
                other_spec = spec_for(other)
                own = envscope.split(other_spec.env)[1] if other_spec is not None else {}
                if own:
                    test_envs[other.nodeid] = own
        return World(key, job, lease, max(1, min(600, int(self._timeout(spec)))), test_envs)

    def _connect(self, world: World, timeout: float) -> str:
        """Wait until every rank of ``world`` is there; "" or why not (the world is then stopped)."""
        problem = world.connect(time.monotonic() + timeout)
        if problem:
            world.dead = problem
            world.stop()
            self.pool.release(world.lease)
        return problem

    def _prefetch(self, item: pytest.Item, nextitem: pytest.Item | None, key: tuple) -> None:
        """Start the world of the next shape this process will need while ``item`` runs (its
        start-up then overlaps the test): only within :data:`MAX_WORLDS` (nothing is evicted for
        it), when its ranks and those of the live worlds are no more than this host's CPUs (a
        world started beside a busy one only slows both), and with free devices now."""
        if not self.prefetch or len(self.worlds) >= MAX_WORLDS:
            return
        for future in self._future(item, nextitem):
            other = self.key_of(future)
            if other is None or other == key or self._static_skip(future) is not None:
                continue
            if other in self.worlds:
                return
            spec = spec_for(future)
            busy = sum(world.job.spec.worker_num for world in self.worlds.values())
            if spec is None or busy + spec.worker_num > _cpus():  # no CPU left to start it beside them
                return
            try:
                lease = self.pool.lease(ports=2, devices=spec.devices, inv=self.inventory, wait=0)
            except DeviceShortage:
                return
            self.worlds[other] = self._start_world(future, spec, other, lease)
            return

    def _after_warm(self, item: pytest.Item, key: tuple, next_id: str | None) -> None:
        world = self.worlds.get(key)
        if world is None:
            return
        if world.dead:
            self.worlds.pop(key)
            self.expecting.pop(key, None)
            self.last_item.pop(key, None)
            self.pool.release(world.lease)
        else:
            self.expecting[key] = next_id

    def _end_outside(self, key: tuple, why: str) -> None:
        """End a world outside a test; whatever its end reveals (fixture finalizers that failed, a
        rank that died or does not exit) is a late teardown error of the last test it ran."""
        world = self.worlds.pop(key)
        self.expecting.pop(key, None)
        item = self.last_item.pop(key, None)
        last = world.last
        try:
            if world.dead or last is None:
                world.stop()
                hung: list[int] = []
                stacks: dict[int, str] = {}
            else:
                world.retire(why)
                hung, stacks = world.end(self.exit_timeout)
        finally:
            self.pool.release(world.lease)
        if item is None or last is None:
            return
        self._report_late(item, world, last, world.ended_run(last, hung, self.exit_timeout, stacks), why)

    def _report_late(self, item: pytest.Item, world: World, last: Any, run: Any, why: str) -> None:
        """Judge ``item`` - a world's last test, already reported - again with how the world ended
        (``run``) and report what failed now as a late teardown error of it."""
        late = dataclasses.replace(run, reproduce_lines=last.run.reproduce_lines, started=last.started)
        record = TestRecord.load(item.nodeid, world.job.expected_ranks(), last.paths, late)
        verdict = record.verdict()
        cwd = str(self.config.invocation_params.dir)
        if _teardown_failures(verdict) <= last.reported:
            return  # nothing the test's own teardown report did not say already
        reports = [r for r in Merger(item, record, self.style, cwd).reports(verdict, ("teardown",)) if r.failed]
        if not reports:
            return
        for report in reports:
            report.sections.append(("msrun world", f"reported after the test: its warm world ended later ({why})"))
        if self.xdist_worker:  # xdist accepts reports only of the item it is running
            text = f"{item.nodeid}: its warm world ended after it ({why}) and revealed:\n{reports[0].longreprtext}"
            warnings.warn(MsrunWorldWarning(text), stacklevel=1)
            return
        self._log(item, reports)

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
            teardown.longrepr = text + "\n(--msrun-leaks=error; isolated=True runs the test in processes of its own)"

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


def _teardown_failures(verdict: TestVerdict) -> set[tuple[int, str, str]]:
    """What failed a test's teardown, rank by rank: (rank, kind, summary)."""
    return {
        (issue.rank, issue.kind, issue.summary)
        for phase in verdict.phases
        if phase.phase == "teardown"
        for issue in [*phase.issues, *([phase.cause] if phase.cause else [])]
    } | {(-1, "rule", phase.message) for phase in verdict.phases if phase.phase == "teardown" and phase.message}
