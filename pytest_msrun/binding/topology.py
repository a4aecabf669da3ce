"""One machine's topology: CPUs (allowed, cores, packages), NUMA nodes, accelerators.

Live discovery (:mod:`.discover`) and JSON snapshots (``fixtures/*.json``, ``msrun-topology``)
produce the same structure, so every placement strategy can be tested against machines this
one is not. CPU lists are stored in the kernel's range syntax (``"0-51,104-155"``).
"""

from __future__ import annotations

import json
import os

from pytest_msrun.cpulist import format_id_list, parse_id_list
from pytest_msrun.record import asdict, field, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SCHEMA = "pytest-msrun/topology/1"
TOPOLOGY_ENV = "MSRUN_TOPOLOGY"


def _id_text(ids: list[int] | None) -> str | None:
    return None if ids is None else format_id_list(ids)


@record
class NumaNode:
    id: int
    cpus: list[int]
    memory_mb: int | None = None
    has_memory: bool = True
    distances: list[int] = field(default_factory=list)


@record
class Device:
    """An accelerator, numbered as its vendor tool numbers it (NVML index, npu-smi logical id)."""

    kind: str  # "cuda" | "ascend"
    index: int
    pci_bus_id: str = ""
    uuid: str = ""
    name: str = ""
    numa_node: int | None = None
    cpu_affinity: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{'GPU' if self.kind == 'cuda' else 'NPU'}{self.index}"


@record
class CgroupInfo:
    version: int
    path: str
    cpus: list[int] | None = None
    mems: list[int] | None = None


@record
class Topology:
    """What placement needs to know about a machine."""

    cpus_online: list[int]
    cpus_allowed: list[int]
    numa_nodes: list[NumaNode]
    cores: list[list[int]] = field(default_factory=list)
    packages: dict[int, list[int]] = field(default_factory=dict)
    devices: list[Device] = field(default_factory=list)
    mems_allowed: list[int] = field(default_factory=list)
    cgroup: CgroupInfo | None = None
    hostname: str = ""
    source: str = "live"
    description: str = ""
    raw: dict[str, str] = field(default_factory=dict)  # tool outputs kept for re-parsing (npu-smi)

    # ------------------------------------------------------------------ queries
    @property
    def allowed(self) -> set[int]:
        return set(self.cpus_allowed)

    def node_of_cpu(self, cpu: int) -> int | None:
        return next((n.id for n in self.numa_nodes if cpu in n.cpus), None)

    def node_allowed_cpus(self, node_id: int) -> list[int]:
        allowed = self.allowed
        return [c for n in self.numa_nodes if n.id == node_id for c in n.cpus if c in allowed]

    def usable_nodes(self) -> list[int]:
        """Nodes numactl can bind: some allowed CPU, local memory, allowed by the cpuset."""
        mems = set(self.mems_allowed) if self.mems_allowed else None
        return [
            n.id
            for n in self.numa_nodes
            if n.has_memory and self.node_allowed_cpus(n.id) and (mems is None or n.id in mems)
        ]

    def allowed_cores(self) -> list[list[int]]:
        """Physical cores (their allowed hardware threads), ordered by lowest thread id."""
        allowed = self.allowed
        cores = [[c for c in core if c in allowed] for core in self.cores]
        cores = [c for c in cores if c]
        covered = {c for core in cores for c in core}
        cores += [[c] for c in self.cpus_allowed if c not in covered]  # CPUs no core lists
        return sorted(cores, key=min)

    def device(self, kind: str, index: int) -> Device | None:
        return next((d for d in self.devices if d.kind == kind and d.index == index), None)

    @property
    def device_kind(self) -> str | None:
        return self.devices[0].kind if self.devices else None

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        cg = self.cgroup
        return {
            "schema": SCHEMA,
            "source": self.source,
            "hostname": self.hostname,
            "description": self.description,
            "cpus_online": format_id_list(self.cpus_online),
            "cpus_allowed": format_id_list(self.cpus_allowed),
            "mems_allowed": format_id_list(self.mems_allowed),
            "cgroup": None if cg is None else {**asdict(cg), "cpus": _id_text(cg.cpus), "mems": _id_text(cg.mems)},
            "numa_nodes": [{**asdict(n), "cpus": format_id_list(n.cpus)} for n in self.numa_nodes],
            "packages": {str(k): format_id_list(v) for k, v in sorted(self.packages.items())},
            "cores": [format_id_list(c) for c in self.cores],
            "devices": [{**asdict(d), "cpu_affinity": format_id_list(d.cpu_affinity)} for d in self.devices],
            "raw": self.raw,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def load(cls, path: str) -> Topology:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a topology snapshot (schema {data.get('schema')!r}, expected {SCHEMA!r})")
        cg = data.get("cgroup")
        return cls(
            cpus_online=parse_id_list(data.get("cpus_online", "")),
            cpus_allowed=parse_id_list(data.get("cpus_allowed", "")),
            mems_allowed=parse_id_list(data.get("mems_allowed", "")),
            cgroup=None
            if not cg
            else CgroupInfo(
                version=int(cg["version"]),
                path=str(cg.get("path", "")),
                cpus=None if cg.get("cpus") is None else parse_id_list(cg["cpus"]),
                mems=None if cg.get("mems") is None else parse_id_list(cg["mems"]),
            ),
            numa_nodes=[
                NumaNode(
                    id=int(n["id"]),
                    cpus=parse_id_list(n.get("cpus", "")),
                    memory_mb=n.get("memory_mb"),
                    has_memory=bool(n.get("has_memory", True)),
                    distances=list(n.get("distances") or []),
                )
                for n in data.get("numa_nodes", [])
            ],
            packages={int(k): parse_id_list(v) for k, v in (data.get("packages") or {}).items()},
            cores=[parse_id_list(c) for c in data.get("cores", [])],
            devices=[
                Device(
                    kind=d["kind"],
                    index=int(d["index"]),
                    pci_bus_id=d.get("pci_bus_id", ""),
                    uuid=d.get("uuid", ""),
                    name=d.get("name", ""),
                    numa_node=d.get("numa_node"),
                    cpu_affinity=parse_id_list(d.get("cpu_affinity", "")),
                )
                for d in data.get("devices", [])
            ],
            hostname=data.get("hostname", ""),
            source=f"snapshot:{os.path.basename(path)}",
            description=data.get("description", ""),
            raw=dict(data.get("raw") or {}),
        )
