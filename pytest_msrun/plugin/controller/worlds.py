"""The controller's warm worlds: which world a test runs in, when one starts, is started ahead,
is kept for the next test, and ends.

A :class:`WorldPool` owns every live world of one pytest session and the resources they hold. It
hands out a test's :class:`~.attempts.WarmAttempt` (or says why the test runs as a fresh job), keeps
a world idle for the next test of its shape this process will run - within a budget of live ranks
and devices, :mod:`.keeping`'s policy deciding - or ends it, and ends worlds outside a test
(evicted, dead between tests, the session over). What such an end reveals about a
world's last test is returned as a :class:`LateEnd` for the controller to report; the pool never
calls back into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass

import pytest

from pytest_msrun.control.door import Tally
from pytest_msrun.plugin import envscope
from pytest_msrun.plugin.controller.attempts import WarmAttempt
from pytest_msrun.plugin.controller.job import JobRun, has_control_plane
from pytest_msrun.plugin.controller.jobs import Jobs, node_path, static_skip
from pytest_msrun.plugin.controller.keeping import NEVER, Budget, Schedule, survives, victims
from pytest_msrun.plugin.controller.pool import DeviceShortage, ResourcePool
from pytest_msrun.plugin.controller.world import FORKING, WarmTest, World, world_key, world_need
from pytest_msrun.plugin.marker import MarkerError, MsrunSpec, spec_for


@dataclass
class LateEnd:
    """A world ended after its last test was reported: ``run`` is how, ``why`` the reason."""

    item: pytest.Item
    world: World
    last: WarmTest
    run: JobRun
    why: str


@dataclass
class _Plan:
    """Tests this process will run, as world keys: ``own`` with statically skipped tests (a world
    kept for one still runs it), ``starts`` without them (they start no world)."""

    items: list[pytest.Item]
    own: Schedule[tuple]
    starts: Schedule[tuple]
    index: dict[str, int]


class WorldPool:
    """Every live world of one session (together within ``max_ranks`` ranks and the inventory's devices)."""

    def __init__(
        self,
        jobs: Jobs,
        resources: ResourcePool,
        *,
        mode: str,
        env_per_test: bool,
        prefetch: bool,
        max_ranks: int,
        memory: tuple[int, int] = (0, 0),
    ) -> None:
        self.jobs = jobs
        self.memory = memory  # --msrun-leak-rss, --msrun-max-rss (bytes, 0: off)
        self.resources = resources
        self.warm = mode == "warm"  # --msrun-worlds=warm: tests share worlds (fresh: each in a forked child)
        self.env_per_test = env_per_test  # tests differing only in env share a world
        self.prefetch = prefetch  # worlds, warm or forking
        self.live: dict[tuple, World] = {}
        self.strangers = Tally(time.monotonic())  # dropped at the worlds' doors, for the session's summary
        self.last_item: dict[tuple, pytest.Item] = {}  # each live world's last test
        self.expecting: dict[tuple, str | None] = {}  # the test each live world's fixtures were kept for
        self._keys: dict[str, tuple | None] = {}
        self.unforkable: dict[tuple, str] = {}  # forking worlds whose ranks cannot fork, and why
        self.budget = Budget(max_ranks, len(jobs.inventory.ids))
        self._plan: tuple[tuple[int, int, int], _Plan] | None = None  # the session's items as keys, cached
        self.late: list[LateEnd] = []  # worlds' ends to report on their last tests (the runner takes them)
        self.no_room: dict[str, str] = {}  # tests whose world's Slurm step found no room in time, and why

    def stop_all(self) -> None:
        """Stop every world now (an interrupted session: nothing is reported)."""
        worlds, self.live = list(self.live.values()), {}
        for world in worlds:
            world.stop()
            self.resources.release(world.lease)

    def end_all(self, why: str) -> None:
        for key in list(self.live):
            self.end_outside(key, why)

    def key_of(self, item: pytest.Item) -> tuple | None:
        """The world ``item`` runs in (None: a fresh job of its own)."""
        if item.nodeid not in self._keys:
            key = None
            try:
                spec = spec_for(item)
            except MarkerError:
                spec = None
            if spec is not None and has_control_plane(spec):
                # isolated: each test in processes of its own, forked from the world's ranks
                forking = spec.isolated or not self.warm
                key = world_key(self._world_spec(spec)) + ((FORKING,) if forking else ())
            self._keys[item.nodeid] = None if key in self.unforkable else key
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

    def _ahead(self, item: pytest.Item, nextitem: pytest.Item | None) -> tuple[_Plan, int]:
        """The tests this process will run, as far as it knows them, and the position after
        ``item``: the rest of ``session.items`` where pytest's own loop runs them, else (xdist hands
        them out one by one; another plugin's loop) only ``nextitem``."""
        if not hasattr(self.jobs.config, "workerinput"):  # not an xdist worker
            items = item.session.items
            stamp = (id(items), len(items), len(self.unforkable))
            if self._plan is None or self._plan[0] != stamp:
                self._plan = (stamp, self._plan_of(items))
            plan = self._plan[1]
            index = plan.index.get(item.nodeid)
            if index is not None and (items[index + 1] if index + 1 < len(items) else None) is nextitem:
                return plan, index + 1
        return self._plan_of([nextitem] if nextitem is not None else []), 0

    def _plan_of(self, items: list[pytest.Item]) -> _Plan:
        own = [self.key_of(it) for it in items]
        starts = [key if key is not None and static_skip(it) is None else None for key, it in zip(own, items)]
        return _Plan(items, Schedule(own), Schedule(starts), {it.nodeid: i for i, it in enumerate(items)})

    def _needs(self) -> dict[tuple, tuple[int, int]]:
        return {key: world_need(key) for key in self.live}

    def world_next(self, item: pytest.Item, nextitem: pytest.Item | None, key: tuple) -> str | None:
        """The next test the world of ``item`` will run in this process, or None to end it with
        ``item``: none follows, the session stops (``-x``, ``--maxfail``), another process waits
        for its devices, or the tests before it would start worlds that evict it (:mod:`.keeping`)."""
        session = item.session
        world = self.live.get(key)
        if world is None or world.dead or session.shouldfail or session.shouldstop:
            return None
        if self.resources.contended(world.lease):  # another process waits for its devices
            return None
        plan, start = self._ahead(item, nextitem)
        at = plan.own.next_use(key, start)
        while at != NEVER and self._read_at_collection(world, plan.items[int(at)]):
            at = plan.own.next_use(key, int(at) + 1)  # it runs as a fresh job
        if at == NEVER or not survives(key, self._needs(), world_need, plan.starts, start, int(at), self.budget):
            return None
        return plan.items[int(at)].nodeid

    def attempt(
        self, item: pytest.Item, spec: MsrunSpec, key: tuple, nextitem: pytest.Item | None
    ) -> tuple[WarmAttempt | None, str]:
        """The test in its world (None, and why, when it must run as a fresh job). A world found
        dying when the test reached it (its ranks left before they began it) is reported on the
        test it ran before, and the test gets a new world."""
        for _ in range(2):
            world, why = self._world_for(item, spec, key, nextitem)
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
            timeout = self.jobs.test_timeout(item, spec)
            attempt = WarmAttempt(item.nodeid, world, self.jobs.test_dir(item), timeout, self.jobs.exit_timeout)
            self.last_item[key] = item
            if attempt.called.absent:  # a rank did not collect it (it differs from this process's collection)
                attempt.finish(None, self.jobs.exit_timeout)
                self.after(item, key, None)
                why = attempt.called.unforkable
                if why:  # so are the ranks of every world of its shape: its tests run as fresh jobs
                    self.unforkable[key] = why
                    self._keys = {nodeid: k for nodeid, k in self._keys.items() if k != key}
                    return None, f"ran as a fresh job: {why}"
                return None, "ran as a fresh job: a rank of its warm world did not collect it"
            left = attempt.left_before()
            if not left or before is None or before_item is None:
                return attempt, ""
            why = f"rank(s) {', '.join(map(str, left))} ended between tests"
            self.late.append(LateEnd(before_item, world, before, attempt.record.run, why))
            self.after(item, key, None)
        return None, "ran as a fresh job: its warm world ended before the test reached it, twice"

    def _world_for(
        self, item: pytest.Item, spec: MsrunSpec, key: tuple, nextitem: pytest.Item | None
    ) -> tuple[World | None, str]:
        """The live world of ``key`` (connected now if it was started ahead), or a new one - room
        made for it by ending the live worlds needed farthest ahead - (None and why when it cannot
        start)."""
        world = self.live.get(key)
        if world is not None:
            why = world.check()
            if not why and not world.connected:
                why = self._connect(world, self.jobs.timeout(spec))
                if why:
                    self.live.pop(key)
                    return None, f"ran as a fresh job: its warm world did not start ({why})"
            if not why:
                return world, ""
            self.end_outside(key, why)  # never used for this test: its end is the last test's
        plan, start = self._ahead(item, nextitem)
        if self.jobs.cluster is not None:  # an idle world's step holds CPUs of the allocation the new one may need
            for other in list(self.live):
                self.end_outside(other, "ended: inside a Slurm allocation, a new world's step needed its CPUs")
        for victim in victims(self._needs(), world_need(key), self.budget, lambda k: plan.starts.next_use(k, start)):
            self.end_outside(victim, f"evicted: a {spec.worker_num}-rank world needed room ({self.budget.ranks} ranks)")
        timeout = self.jobs.timeout(spec)
        try:
            world = self._start_world(item, spec, key, timeout)
        except DeviceShortage:
            return None, ""
        problem = self._connect(world, timeout)
        if problem and not world.job.started():
            no_room = world.job.no_room(timeout, world.launched.logs)
            if no_room:  # its time is spent: a fresh job would only wait for room again
                self.no_room[item.nodeid] = no_room
                return None, no_room
        if problem:  # a fresh job of this test reports what went wrong, the way it always has
            return None, f"ran as a fresh job: its warm world did not start ({problem})"
        self.live[key] = world
        return world, ""

    def _start_world(self, item: pytest.Item, spec: MsrunSpec, key: tuple, wait: float) -> World:
        """Launch the world of ``key`` (its first test: ``item``) without waiting for it, its ports
        and devices leased within ``wait`` s (else :class:`DeviceShortage`)."""
        devices = self.jobs.pooled_devices(spec)
        lease = self.resources.lease(ports=2, devices=devices, inv=self.jobs.inventory, wait=wait)
        job = self.jobs.new(item, self._world_spec(spec), lease.ports, lease.devices)
        served = [i for i in item.session.items if self.key_of(i) == key]
        job.nodeids = [node_path(i) for i in served]
        specs = [(i.nodeid, spec_for(i)) for i in served] if self.env_per_test else []
        own = {nodeid: envscope.split(other.env)[1] for nodeid, other in specs if other is not None}
        test_envs = {nodeid: env for nodeid, env in own.items() if env}
        return World(key, job, lease, test_envs, memory=self.memory, strangers=self.strangers)

    def _connect(self, world: World, timeout: float) -> str:
        """Wait until every rank of ``world`` is there; "" or why not (the world is then stopped)."""
        problem = world.connect(time.monotonic() + timeout)
        if problem:
            world.dead = problem
            world.stop()
            self.resources.release(world.lease)
        return problem

    def _prefetch(self, item: pytest.Item, nextitem: pytest.Item | None, key: tuple) -> None:
        """Start the world of the next shape this process will need while ``item`` runs (its
        start-up then overlaps the test): only within the budget (nothing is evicted for it), when
        its ranks, the running world's and those of worlds still starting are no more than this
        host's CPUs (a world started beside busy ranks only slows them; idle worlds wait, costing
        no CPU), and with free devices now."""
        if not self.prefetch:
            return
        plan, start = self._ahead(item, nextitem)
        at = next((i for i in range(start, len(plan.starts.keys)) if plan.starts.keys[i] not in (None, key)), None)
        if at is None:
            return
        other, spec = plan.starts.keys[at], spec_for(plan.items[at])
        if other is None or other in self.live or spec is None:
            return
        if not self.budget.fits([*self._needs().values(), world_need(other)]):
            return
        busy = sum(w.job.spec.worker_num for k, w in self.live.items() if k == key or not w.connected)
        if busy + spec.worker_num > len(os.sched_getaffinity(0)):  # no CPU left to start it beside them
            return
        with contextlib.suppress(DeviceShortage):
            self.live[other] = self._start_world(plan.items[at], spec, other, 0)

    def after(self, item: pytest.Item, key: tuple, next_id: str | None) -> None:
        world = self.live.get(key)
        if world is not None and world.dead:
            self._drop(key)
            self.resources.release(world.lease)
        elif world is not None:
            self.expecting[key] = next_id

    def _drop(self, key: tuple) -> tuple[World, pytest.Item | None]:
        self.expecting.pop(key, None)
        return self.live.pop(key), self.last_item.pop(key, None)

    def end_outside(self, key: tuple, why: str) -> None:
        """End a world outside a test; whatever its end reveals (fixture finalizers that failed, a
        rank that died or does not exit) is a late teardown error of the last test it ran."""
        world, item = self._drop(key)
        last, run = world.last, None
        try:
            if world.dead or last is None:
                world.stop()
            else:
                world.retire(why)
                run = world.end(last, self.jobs.exit_timeout)
        finally:
            self.resources.release(world.lease)
        if item is not None and last is not None:
            run = run or world.ended_run(last, [], self.jobs.exit_timeout, {})
            self.late.append(LateEnd(item, world, last, run, why))
