"""Live topology discovery from sysfs, procfs, cgroups (v1 and v2), NVML and npu-smi.

Everything reads below ``root`` (``/`` on a real machine), so tests can point discovery at a
recorded tree. Allowed CPUs are ``sched_getaffinity(0)`` intersected with the cgroup's
effective cpuset - never a count of ``/proc/cpuinfo`` lines, which in a container or under
``taskset`` names CPUs this process may not use.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Callable
from typing import Any

from pytest_msrun.binding.npusmi import NpuSmiError, parse_board_pcie, parse_device_table, run_npu_smi
from pytest_msrun.binding.topology import TOPOLOGY_ENV, CgroupInfo, Device, NumaNode, Topology
from pytest_msrun.cpulist import RangeSyntaxError, parse_id_list
from pytest_msrun.fileio import open_output
from pytest_msrun.fsinfo import mounts

NVIDIA_VENDOR = "0x10de"
DISPLAY_CLASSES = ("0x0300", "0x0302")  # VGA / 3D controller


def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path.lstrip("/")), encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _ids(text: str | None) -> list[int] | None:
    if text is not None:
        with contextlib.suppress(RangeSyntaxError):
            return parse_id_list(text)
    return None


def cgroup_cpuset(root: str = "/") -> CgroupInfo | None:
    """This process's cpuset: cgroup v2 ``cpuset.cpus.effective`` or v1 ``cpuset.effective_cpus``."""
    cgroups = _read(root, "/proc/self/cgroup") or ""
    v2_mount = v1_mount = None
    for mount in mounts(_read(root, "/proc/self/mountinfo") or ""):
        if mount.fstype == "cgroup2" and v2_mount is None:
            v2_mount = mount.point
        elif mount.fstype == "cgroup" and "cpuset" in mount.options.split(","):
            v1_mount = mount.point
    v1_path = v2_path = None
    for line in cgroups.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2_path = path
        elif "cpuset" in controllers.split(","):
            v1_path = path
    if v1_mount and v1_path is not None:
        base = os.path.join(v1_mount, v1_path.lstrip("/"))
        cpus = _ids(_read(root, f"{base}/cpuset.effective_cpus")) or _ids(_read(root, f"{base}/cpuset.cpus"))
        mems = _ids(_read(root, f"{base}/cpuset.effective_mems")) or _ids(_read(root, f"{base}/cpuset.mems"))
        if cpus is not None:
            return CgroupInfo(1, v1_path, cpus, mems)
    if v2_mount and v2_path is not None:
        path = v2_path
        while True:  # the nearest ancestor with the cpuset controller enabled decides
            base = os.path.join(v2_mount, path.lstrip("/"))
            cpus = _ids(_read(root, f"{base}/cpuset.cpus.effective"))
            if cpus is not None:
                mems = _ids(_read(root, f"{base}/cpuset.mems.effective"))
                return CgroupInfo(2, v2_path, cpus, mems)
            if path in ("/", ""):
                break
            path = os.path.dirname(path.rstrip("/")) or "/"
        return CgroupInfo(2, v2_path, None, None)
    return None


def numa_nodes(root: str = "/") -> list[NumaNode]:
    base = "/sys/devices/system/node"
    try:
        names = sorted(
            (n for n in os.listdir(os.path.join(root, base.lstrip("/"))) if n.startswith("node") and n[4:].isdigit()),
            key=lambda n: int(n[4:]),
        )
    except OSError:
        return []
    has_memory = _ids(_read(root, f"{base}/has_memory"))
    nodes = []
    for name in names:
        nid = int(name[4:])
        cpus = _ids(_read(root, f"{base}/{name}/cpulist")) or []
        memory_mb = None
        meminfo = _read(root, f"{base}/{name}/meminfo") or ""
        for line in meminfo.splitlines():
            if "MemTotal:" in line:
                with contextlib.suppress(ValueError, IndexError):
                    memory_mb = int(line.split()[-2]) // 1024
        distances = [int(x) for x in (_read(root, f"{base}/{name}/distance") or "").split() if x.isdigit()]
        nodes.append(
            NumaNode(
                id=nid,
                cpus=cpus,
                memory_mb=memory_mb,
                has_memory=(nid in has_memory) if has_memory is not None else bool(memory_mb),
                distances=distances,
            )
        )
    return nodes


def cores_and_packages(cpus: list[int], root: str = "/") -> tuple[list[list[int]], dict[int, list[int]]]:
    cores: dict[tuple[int, ...], list[int]] = {}
    packages: dict[int, list[int]] = {}
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        siblings = _ids(_read(root, f"{topo}/thread_siblings_list")) or [cpu]
        cores.setdefault(tuple(siblings), siblings)
        pkg = _read(root, f"{topo}/physical_package_id")
        if pkg is not None and pkg.lstrip("-").isdigit():
            packages.setdefault(int(pkg), []).append(cpu)
    return sorted(cores.values(), key=min), packages


def normalise_bus_id(bus_id: str) -> str:
    """``00000000:18:00.0`` (NVML) -> ``0000:18:00.0`` (sysfs), lower case."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    if rest and len(domain) > 4:
        domain = domain[-4:]
    return f"{domain}:{rest}" if rest else bus_id


def _pci_numa_and_cpus(root: str, bus_id: str) -> tuple[int | None, list[int]]:
    base = f"/sys/bus/pci/devices/{normalise_bus_id(bus_id)}"
    node_text = _read(root, f"{base}/numa_node")
    node = int(node_text) if node_text and node_text.lstrip("-").isdigit() and int(node_text) >= 0 else None
    return node, _ids(_read(root, f"{base}/local_cpulist")) or []


def nvidia_devices(root: str = "/", nvml: Callable[[], Any] | None = None) -> list[Device]:
    """NVIDIA GPUs through NVML; sysfs PCI (vendor 0x10de) when NVML is not usable."""
    try:
        module: Any = nvml() if nvml is not None else __import__("pynvml")
        module.nvmlInit()
    except Exception:
        return _nvidia_from_sysfs(root)
    try:
        count = int(module.nvmlDeviceGetCount())
        words = max(1, math.ceil((os.cpu_count() or 64) / 64))
        out = []
        for i in range(count):
            handle = module.nvmlDeviceGetHandleByIndex(i)
            bus = module.nvmlDeviceGetPciInfo(handle).busId
            bus = bus.decode() if isinstance(bus, bytes) else str(bus)
            uuid = module.nvmlDeviceGetUUID(handle)
            name = module.nvmlDeviceGetName(handle)
            affinity: list[int] = []
            with contextlib.suppress(Exception):  # 64-bit words, lowest CPUs first
                mask = module.nvmlDeviceGetCpuAffinity(handle, words)
                affinity = [w * 64 + bit for w, word in enumerate(mask) for bit in range(64) if word >> bit & 1]
            node, local = _pci_numa_and_cpus(root, bus)
            with contextlib.suppress(Exception):
                node = int(module.nvmlDeviceGetNumaNodeId(handle))
            out.append(
                Device(
                    kind="cuda",
                    index=i,
                    pci_bus_id=normalise_bus_id(bus),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    numa_node=node if node is not None and node >= 0 else None,
                    cpu_affinity=affinity or local,
                )
            )
        return out
    finally:
        with contextlib.suppress(Exception):
            module.nvmlShutdown()


def _nvidia_from_sysfs(root: str) -> list[Device]:
    base = os.path.join(root, "sys/bus/pci/devices")
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    out: list[Device] = []
    for bdf in entries:
        vendor = _read(root, f"/sys/bus/pci/devices/{bdf}/vendor")
        cls = _read(root, f"/sys/bus/pci/devices/{bdf}/class") or ""
        if vendor != NVIDIA_VENDOR or not cls.startswith(DISPLAY_CLASSES):
            continue
        node, local = _pci_numa_and_cpus(root, bdf)
        out.append(Device(kind="cuda", index=len(out), pci_bus_id=bdf.lower(), numa_node=node, cpu_affinity=local))
    return out


def ascend_devices(root: str = "/", runner: Callable[[list[str]], str] = run_npu_smi) -> tuple[list[Device], dict]:
    """Ascend NPUs from npu-smi (raw outputs returned too, for snapshots)."""
    raw: dict[str, str] = {}
    try:
        table = runner(["info", "-m"])
    except (NpuSmiError, OSError, ValueError):
        return [], raw
    raw["info -m"] = table
    out = []
    for chip in parse_device_table(table):
        args = chip.board_args()
        text = runner(args)
        raw[" ".join(args)] = text
        bus = parse_board_pcie(text)
        node, local = _pci_numa_and_cpus(root, bus)
        out.append(
            Device(
                kind="ascend", index=chip.device_id, pci_bus_id=bus, name=chip.name, numa_node=node, cpu_affinity=local
            )
        )
    return sorted(out, key=lambda d: d.index), raw


def discover(root: str = "/", affinity: set[int] | None = None, devices: bool = True) -> Topology:
    """The topology of this machine (or of a recorded tree under ``root``)."""
    online = _ids(_read(root, "/sys/devices/system/cpu/online"))
    if affinity is None:
        affinity = set(os.sched_getaffinity(0)) if root == "/" else set(online or [])
    cg = cgroup_cpuset(root)
    allowed = sorted(affinity & set(cg.cpus)) if cg is not None and cg.cpus is not None else sorted(affinity)
    online = online or sorted(affinity)
    nodes = numa_nodes(root)
    if not nodes:  # no NUMA in sysfs: one node holding every CPU
        nodes = [NumaNode(id=0, cpus=list(online))]
    mems = cg.mems if cg is not None and cg.mems is not None else [n.id for n in nodes if n.has_memory]
    cores, packages = cores_and_packages(online, root)
    found: list[Device] = []
    raw: dict[str, str] = {}
    if devices:
        found = nvidia_devices(root)
        if not found:
            found, raw = ascend_devices(root)
    return Topology(
        cpus_online=list(online),
        cpus_allowed=allowed,
        mems_allowed=sorted(mems),
        numa_nodes=nodes,
        cores=cores,
        packages=packages,
        devices=found,
        cgroup=cg,
        hostname=socket.gethostname(),
        source="live",
        raw=raw,
    )


def load_topology(env: dict[str, str] | None = None) -> Topology:
    """``MSRUN_TOPOLOGY`` (a snapshot file) if set, else live discovery."""
    path = (env if env is not None else os.environ).get(TOPOLOGY_ENV, "")
    if path:
        return Topology.load(path)
    return discover()


def main(argv: list[str] | None = None) -> int:
    """``msrun-topology``: print this machine's topology as a snapshot."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="msrun-topology",
        description="Print this machine's topology as a JSON snapshot "
        "(use it with MSRUN_TOPOLOGY=<file> to plan for this machine elsewhere).",
    )
    ap.add_argument("-o", "--output", help="write to this file instead of stdout")
    ap.add_argument("--description", default="", help="a note stored in the snapshot")
    ap.add_argument("--no-devices", action="store_true", help="skip NVML / npu-smi")
    args = ap.parse_args(argv)
    topo = discover(devices=not args.no_devices)
    topo.description = args.description
    text = topo.dumps()
    if args.output:
        try:
            with open_output(args.output) as fh:  # not through a link or into a file someone put there
                fh.write(text)
        except OSError as exc:
            ap.error(f"--output: {exc}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
