"""Seed 002's in-process helper: bind this process to the CPUs near its GPU.

``set_numa_affinity(gpu_index)`` takes the *logical* GPU index (``LOCAL_RANK`` under torchrun or
msrun), maps it through ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) to the physical GPU, reads
that GPU's CPU-affinity mask from NVML (sysfs ``local_cpulist`` / its NUMA node's CPUs as
fallback), keeps the CPUs this process may use, and calls ``sched_setaffinity``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pytest_msrun.binding.devices import worker_devices
from pytest_msrun.binding.topology import Topology


def set_numa_affinity(
    gpu_index: int, verbose: bool = False, topology: Topology | None = None, env: Mapping[str, str] | None = None
) -> list[int]:
    """Bind the calling process to the CPUs affine to logical GPU ``gpu_index``; return them."""
    if topology is None:
        from pytest_msrun.binding.discover import load_topology

        topology = load_topology()
    env = os.environ if env is None else env
    dev = worker_devices(topology, env, gpu_index + 1)[gpu_index].device
    if dev is None:
        raise ValueError(
            f"no GPU for logical index {gpu_index} (visible: {env.get('CUDA_VISIBLE_DEVICES', 'all')}, "
            f"GPUs here: {len(topology.devices)})"
        )
    allowed = topology.allowed
    cpus = [c for c in dev.cpu_affinity if c in allowed]
    if not cpus and dev.numa_node is not None:
        cpus = topology.node_allowed_cpus(dev.numa_node)
    if not cpus:
        raise ValueError(f"{dev.label} ({dev.pci_bus_id}) has no CPU affinity this process may use")
    if verbose:
        before = sorted(os.sched_getaffinity(0))
        print(f"before: {len(before)} visible cpu cores: {before}")
    os.sched_setaffinity(0, cpus)
    if verbose:
        after = sorted(os.sched_getaffinity(0))
        print(f"after: {len(after)} visible cpu cores: {after}")
    return cpus
