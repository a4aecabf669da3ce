"""Placement: topology + binding flags -> each process's CPUs, memory nodes and command prefix.

Pure (no OS access): the caller passes the topology, the visible-device variables and which
of ``taskset``/``numactl`` exist. Command shapes are MindSpore's msrun's:

* ``taskset -c C`` / ``numactl --membind N --cpunodebind N`` / ``numactl --membind N --physcpubind C``
* unified JSON: ``numactl [--membind M] --cpunodebind C``, ``numactl --membind M``, ...

Fixed against MindSpore's msrun: shares are computed over the *local workers*, not
every device on the host; dict keys match workers by name (``deviceN`` = physical id); the
equal-split map is keyed consistently; exhausted pools and unknown nodes never crash; CUDA is
supported; and every CPU or node id is checked against what this process may use, before start.
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_msrun.binding.devices import VisibleDevicesError, WorkerDevice, worker_devices
from pytest_msrun.binding.flags import MODULES, BindingError, BindSpec
from pytest_msrun.binding.topology import Topology
from pytest_msrun.cpulist import format_id_list, parse_id_list
from pytest_msrun.record import field, record


@record
class Placement:
    """Where one process runs."""

    cpus: list[int] | None = None  # CPUs it may run on (None: not bound)
    mems: list[int] | None = None  # memory nodes it is bound to (None: not bound)
    prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    in_child_cpus: list[int] | None = None  # taskset missing: sched_setaffinity in the child
    device: str = ""
    how: str = ""


@record
class BindingPlan:
    workers: list[Placement]
    scheduler: Placement
    warnings: list[str] = field(default_factory=list)


def _cpu_list_text(cpus: list[int]) -> str:
    return "[" + ", ".join(str(c) for c in cpus) + "]"


class Planner:
    """Computes the placements for one node's processes."""

    def __init__(
        self,
        topology: Topology,
        core: BindSpec,
        numa: BindSpec,
        local_workers: int,
        env: Mapping[str, str],
        tools: Mapping[str, str | None],
        dry_run: bool = False,
    ) -> None:
        self.t = topology
        self.core = core
        self.numa = numa
        self.n = local_workers
        self.tools = tools
        self.dry_run = dry_run
        self.warnings: list[str] = []
        try:
            self.devs: list[WorkerDevice] = worker_devices(topology, env, local_workers, logical=dry_run)
        except VisibleDevicesError as exc:
            raise BindingError("bind_numa" if numa.enabled else "bind_core", str(exc)) from None

    def plan(self) -> BindingPlan:
        """Placements for the scheduler and the local workers."""
        return self.unified() if self.numa.kind == "unified" else self.legacy()

    # ------------------------------------------------------------------ checks
    def _check(self, flag: str, where: str, text: str, unit: str) -> list[int]:
        """The CPU or NUMA node ids ``text`` names; :class:`BindingError` naming those not usable here."""
        ids = parse_id_list(text, unit)
        usable = self.t.cpus_allowed if unit == "CPU" else self.t.usable_nodes()
        bad = format_id_list(i for i in ids if i not in usable)
        if bad and unit == "CPU":
            raise BindingError(
                flag,
                f"CPU {bad} in {where} is not available to this process (allowed CPUs: {format_id_list(usable)})",
            )
        if bad:
            raise BindingError(
                flag,
                f"NUMA node {bad} in {where} is not usable here "
                f"(usable nodes, with allowed CPUs and memory: {format_id_list(usable) or 'none'})",
            )
        return ids

    def _node_cpus(self, nodes: list[int]) -> list[int]:
        return sorted({c for n in nodes for c in self.t.node_allowed_cpus(n)})

    def key_of(self, i: int) -> str | None:
        pid = self.devs[i].physical_id
        return None if pid is None else f"device{pid}"

    def _affinity_node(self, i: int) -> int | None:
        dev = self.devs[i].device
        return dev.numa_node if dev is not None else None

    # ------------------------------------------------------------------ automatic strategies
    def auto_cores(self, within: dict[int, int] | None = None) -> list[list[int]]:
        """Equal shares of physical cores for the local workers, device-affine first.

        ``within`` (worker -> NUMA node) confines each worker to one node (both flags automatic).
        """
        cores = self.t.allowed_cores()
        ncpu = len(self.t.cpus_allowed)
        if self.n > ncpu:
            raise BindingError(
                "bind_core", f"{self.n} local workers but only {ncpu} allowed CPUs: every worker needs at least one"
            )
        if self.n > len(cores):  # fewer cores than workers: hand out hardware threads instead
            cores = [[c] for c in self.t.cpus_allowed]
        share = len(cores) // self.n
        nodes_known = not self.dry_run and all(self._affinity_node(i) is not None for i in range(self.n))
        if within is None and not nodes_known:
            extra = len(cores) % self.n
            out, start = [], 0
            for k in range(self.n):
                size = share + (1 if k < extra else 0)
                out.append(sorted(c for core in cores[start : start + size] for c in core))
                start += size
            if not self.dry_run and self.t.devices:
                self.warnings.append("Device NUMA affinity is unknown: CPUs are split equally without it.")
            return out
        target = within if within is not None else {i: self._affinity_node(i) for i in range(self.n)}
        pools: dict[int | None, list[list[int]]] = {}
        for core in cores:
            pools.setdefault(self.t.node_of_cpu(core[0]), []).append(core)
        members: dict[int | None, list[int]] = {}
        for i in range(self.n):
            members.setdefault(target[i], []).append(i)
        got: list[list[list[int]]] = [[] for _ in range(self.n)]
        # Pass 1: each node's cores are divided evenly among the workers whose device sits there.
        for node, workers in members.items():
            pool = pools.get(node, [])
            fair = min(share, len(pool) // len(workers)) if workers else 0
            for i in workers:
                got[i], pool[:] = pool[:fair], pool[fair:]
        if within is None:
            # Pass 2: top up to an equal share, from nodes hosting no local device first.
            spill = [core for node, pool in pools.items() if node not in members for core in pool]
            spill += [core for node, pool in pools.items() if node in members for core in pool]
            for i in range(self.n):
                need = share - len(got[i])
                if need > 0:
                    got[i] += spill[:need]
                    spill = spill[need:]
        return [sorted(c for core in g for c in core) for g in got]

    def auto_nodes(self) -> list[int] | None:
        """One NUMA node per local worker, its device's node first; None when there are too few."""
        usable = self.t.usable_nodes()
        if len(usable) < self.n:
            self.warnings.append(
                f"Available NUMA nodes count({usable}) is insufficient for device count({self.n}). To avoid "
                "performance degradation, will not launch process with numactl automatically. To enable numactl, "
                "please provide a custom binding configuration manually."
            )
            return None
        chosen: dict[int, int] = {}
        wanted = [] if self.dry_run else [self._affinity_node(i) for i in range(self.n)]
        missing = {w for w in wanted if w is not None and w not in usable}
        if missing:
            self.warnings.append(
                f"Device affinity NUMA nodes {sorted(missing)} are unavailable or memoryless. Only usable NUMA "
                f"nodes {usable} will be used for numactl binding."
            )
        for i, node in enumerate(wanted):
            if node is not None and node in usable and node not in chosen.values():
                chosen[i] = node
        affine = {w for w in wanted if w is not None}
        free = [n for n in usable if n not in chosen.values() and n not in affine]
        free += [n for n in usable if n not in chosen.values() and n not in free]
        for i in range(self.n):
            if i not in chosen:
                chosen[i] = free.pop(0)
        return [chosen[i] for i in range(self.n)]

    # ------------------------------------------------------------------ legacy flags
    def _dict_entry(self, spec: BindSpec, flag: str, key: str | None, unit: str) -> tuple[str | None, list[int] | None]:
        items = spec.entries.get(key, []) if spec.kind == "dict" and key is not None else []
        if not items:
            return None, None
        text = ",".join(items)
        return text, self._check(flag, f"--{flag}['{key}']", text, unit)

    def legacy(self) -> BindingPlan:
        core_parts: list[tuple[str | None, list[int] | None]] = [(None, None)] * self.n
        node_parts: list[tuple[str | None, list[int] | None]] = [(None, None)] * self.n
        env_lists: list[str | None] = [None] * self.n
        auto_nodes = self.auto_nodes() if self.numa.kind == "auto" else None
        if self.numa.kind == "dict":
            node_parts = [self._dict_entry(self.numa, "bind_numa", self.key_of(i), "NUMA") for i in range(self.n)]
        elif auto_nodes is not None:
            node_parts = [(str(n), [n]) for n in auto_nodes]
            env_lists = [_cpu_list_text(self.t.node_allowed_cpus(n)) for n in auto_nodes]
        if self.core.kind == "dict":
            core_parts = [self._dict_entry(self.core, "bind_core", self.key_of(i), "CPU") for i in range(self.n)]
        elif self.core.kind == "auto":
            within = dict(enumerate(auto_nodes)) if auto_nodes is not None else None
            split = self.auto_cores(within)
            core_parts = [(format_id_list(c), c) if c else (None, None) for c in split]
            env_lists = [_cpu_list_text(c) if c else env_lists[i] for i, c in enumerate(split)]
        for flag, spec in (("bind_core", self.core), ("bind_numa", self.numa)):
            if spec.kind == "dict":
                keys = {self.key_of(i) for i in range(self.n)}
                unknown = sorted(k for k in spec.entries if k != "scheduler" and k not in keys)
                unmatched = [i for i in range(self.n) if self.key_of(i) not in spec.entries]
                if unknown:
                    self.warnings.append(f"--{flag}: {', '.join(unknown)} match no local worker of this node.")
                if unmatched:
                    self.warnings.append(
                        f"--{flag}: no entry for local worker(s) {unmatched} "
                        f"(keys {[self.key_of(i) for i in unmatched]}); they are not bound."
                    )
        workers = []
        for i in range(self.n):
            place = self._compose(core_parts[i], node_parts[i], auto_numa=auto_nodes is not None)
            bound = place.prefix or place.in_child_cpus is not None
            if (cpu_list := env_lists[i]) is not None and bound:  # a list only where a flag is automatic
                place.env["MSRUN_CPU_LIST"] = cpu_list
            place.device = self._device_label(i)
            workers.append(place)
        core = self._dict_entry(self.core, "bind_core", "scheduler", "CPU")
        node = self._dict_entry(self.numa, "bind_numa", "scheduler", "NUMA")
        sched = self._compose(core, node, auto_numa=False)  # not bound without a dict entry
        return BindingPlan(workers, sched, self.warnings)

    def _device_label(self, i: int) -> str:
        wd = self.devs[i]
        if wd.device is not None:
            return f"{wd.device.label} {wd.device.pci_bus_id}".strip()
        return f"device{wd.physical_id}" if wd.physical_id is not None else ""

    def _compose(
        self,
        core: tuple[str | None, list[int] | None],
        node: tuple[str | None, list[int] | None],
        auto_numa: bool,
    ) -> Placement:
        c_text, c_ids = core
        n_text, n_ids = node
        if n_text is not None and c_text is not None:
            return self._numactl(["--membind", n_text, "--physcpubind", c_text], c_ids, n_ids, "numa+core", auto_numa)
        if n_text is not None:
            return self._numactl(
                ["--membind", n_text, "--cpunodebind", n_text], self._node_cpus(n_ids or []), n_ids, "numa", auto_numa
            )
        if c_text is not None:
            return self._taskset(c_text, c_ids or [])
        return Placement(how="not bound")

    def _taskset(self, text: str, cpus: list[int]) -> Placement:
        if self.tools.get("taskset"):
            return Placement(cpus=cpus, prefix=["taskset", "-c", text], how="taskset")
        self._warn_once("taskset was not found on PATH: CPUs are bound with sched_setaffinity() in each child instead.")
        return Placement(cpus=cpus, in_child_cpus=cpus, how="sched_setaffinity")

    def _numactl(
        self, args: list[str], cpus: list[int] | None, nodes: list[int] | None, how: str, fallback_ok: bool
    ) -> Placement:
        if self.tools.get("numactl"):
            return Placement(cpus=cpus, mems=nodes, prefix=["numactl", *args], how=how)
        if fallback_ok and cpus:
            self._warn_once(
                "numactl was not found on PATH: --bind_numa=True binds only CPUs (with sched_setaffinity in each "
                "child); memory is NOT bound. Install numactl to bind memory."
            )
            return Placement(cpus=cpus, in_child_cpus=cpus, how="sched_setaffinity (no memory binding)")
        raise BindingError(
            "bind_numa", "memory binding needs numactl, which is not on PATH: install the numactl package"
        )

    def _warn_once(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)

    # ------------------------------------------------------------------ unified JSON
    def unified(self) -> BindingPlan:
        data = self.numa.unified
        cfg = data["bind_config"]
        cpu_mode, mem_mode = cfg["bind_cpu_mode"], cfg["bind_memory_mode"]
        bind_cpu, bind_memory = data["bind_cpu"], data["bind_memory"]
        if self.core.enabled:
            self.warnings.append("--bind_core is ignored: the unified bind file given to --bind_numa decides.")
        if cpu_mode == "cpu":
            for key, mods in bind_cpu.items():
                for mod in MODULES:
                    if mod in mods:
                        self._check("bind_numa", f"bind_cpu.{key}.{mod}", mods[mod], "CPU")
        elif cpu_mode == "numa":
            for key, text in bind_cpu.items():
                self._check("bind_numa", f"bind_cpu.{key}", text, "NUMA")
        if mem_mode == "numa":
            for key, text in bind_memory.items():
                self._check("bind_numa", f"bind_memory.{key}", text, "NUMA")
        if self.t.devices:
            known = {d.index for d in self.t.devices}
            for key in [*bind_cpu, *bind_memory]:
                if key != "scheduler" and int(key[len("device") :]) not in known:
                    raise BindingError(
                        "bind_numa",
                        f"Device ID {key[len('device') :]} in key '{key}' exceeds the devices here "
                        f"(device ids: {', '.join(str(i) for i in sorted(known))})",
                    )
        local_keys = {self.key_of(i) for i in range(self.n)}
        unknown = sorted(k for k in set(bind_cpu) | set(bind_memory) if k != "scheduler" and k not in local_keys)
        if unknown:
            self.warnings.append(f"--bind_numa file: {', '.join(unknown)} match no local worker of this node.")
        workers = []
        for i in range(self.n):
            place = self._unified_one(self.key_of(i), cpu_mode, mem_mode, bind_cpu, bind_memory)
            place.device = self._device_label(i)
            workers.append(place)
        sched = self._unified_one("scheduler", cpu_mode, mem_mode, bind_cpu, bind_memory)
        return BindingPlan(workers, sched, self.warnings)

    def _unified_one(
        self, key: str | None, cpu_mode: str, mem_mode: str, bind_cpu: dict, bind_memory: dict
    ) -> Placement:
        if key is None:
            return Placement(how="not bound (no device)")
        mem = bind_memory.get(key) if mem_mode == "numa" else None
        mems = parse_id_list(mem, "NUMA") if mem is not None else None
        if cpu_mode == "cpu":
            main = (bind_cpu.get(key) or {}).get("main")
            cpus = parse_id_list(main) if main else None
            if mem is not None:
                args = ["--membind", mem] + (["--physcpubind", main] if main else [])
                return self._numactl(args, cpus, mems, "json cpu+numa", False)
            if main:
                return self._taskset(main, cpus or [])
            return Placement(how="not bound")
        if cpu_mode == "numa":
            node = bind_cpu.get(key)
            if node is not None:
                args = (["--membind", mem] if mem is not None else []) + ["--cpunodebind", node]
                return self._numactl(args, self._node_cpus(parse_id_list(node, "NUMA")), mems, "json numa", False)
        if mem is not None:
            return self._numactl(["--membind", mem], None, mems, "json memory", False)
        return Placement(how="not bound")
