"""``msrun-numa-wrap``: seed 002's ``numa-set.sh`` for any launcher.

    torchrun --nproc_per_node=8 --no-python msrun-numa-wrap python train.py
    msrun --worker_num=8 --local_worker_num=8 --join=True msrun-numa-wrap python train.py

Reads ``LOCAL_RANK``, maps it through ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` to
the physical device (by index or UUID, never assuming rank = device), finds the device's NUMA
node (NVML, else sysfs by PCI bus id) and execs ``numactl --cpunodebind=N --membind=N <command>``.
Without numactl it binds the node's CPUs with ``sched_setaffinity`` and says memory is unbound;
without a known node it runs the command unbound, and says so.
"""

from __future__ import annotations

import os
import shutil
import sys


def _say(text: str) -> None:
    sys.stderr.write(f"msrun-numa-wrap: {text}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(__doc__ or "")
        return 0 if args else 2
    local = os.environ.get("LOCAL_RANK", "").strip()
    if not local.isdigit():
        _say("LOCAL_RANK is not set: run me under torchrun, msrun or another launcher that sets it")
        return 2
    rank = int(local)
    from pytest_msrun.binding.devices import worker_devices
    from pytest_msrun.binding.discover import load_topology

    topology = load_topology()
    dev = worker_devices(topology, os.environ, rank + 1)[rank].device
    node = dev.numa_node if dev is not None else None
    if node is None or not topology.node_allowed_cpus(node):
        what = f"{dev.label} ({dev.pci_bus_id})" if dev is not None else "no device"
        _say(f"local rank {rank}: {what} has no usable NUMA node here; running unbound")
        os.execvp(args[0], args)
    assert dev is not None  # a NUMA node comes from a device
    numactl = shutil.which("numactl")
    _say(f"Starting local rank {rank} ({dev.label} {dev.pci_bus_id}) on NUMA node {node}")
    if numactl:
        os.execv(numactl, [numactl, f"--cpunodebind={node}", f"--membind={node}", *args])
    cpus = topology.node_allowed_cpus(node)
    _say(f"numactl is not installed: binding CPUs {cpus[0]}..{cpus[-1]} only; memory is NOT bound")
    os.sched_setaffinity(0, cpus)
    os.execvp(args[0], args)


if __name__ == "__main__":
    raise SystemExit(main())
