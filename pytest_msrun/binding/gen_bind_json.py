"""``msrun-gen-bind-json`` (the manual's ``gen_bind_json.py``): write a unified bind JSON file.

Per device: its CPU list, exactly as ``--bind_core=True`` would give it (whole physical cores,
an equal share per device, taken from the device's NUMA node first), in ascending order.
Modules are *relative index ranges* inside that list (defaults: runtime 4-8, minddata 9-12,
main 13-19, pynative off); the scheduler gets ``--scheduler-range`` of the CPUs unused by the
devices (``free``, falling back to ``global`` when too few), of every allowed CPU (``global``)
or of device 0's list (``device0``), and CPUs only. Memory: each device's NUMA node.

    msrun-gen-bind-json -o bind.json [--device-ids 0,1] [--device-count 8] [--topology snap.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pytest_msrun.binding.devices import VISIBLE_VARS
from pytest_msrun.binding.flags import BindSpec
from pytest_msrun.binding.strategies import Planner
from pytest_msrun.binding.topology import Topology
from pytest_msrun.cpulist import format_id_list, parse_id_list
from pytest_msrun.fileio import open_output

DEFAULTS = {"runtime": "4-8", "minddata": "9-12", "main": "13-19", "scheduler": "20-23"}


class GenError(ValueError):
    """The requested layout does not fit the machine."""


def device_ids(args: argparse.Namespace, topology: Topology, env: dict[str, str]) -> list[int]:
    if args.device_ids:
        return parse_id_list(args.device_ids, "device")
    if topology.devices:
        return sorted(d.index for d in topology.devices)
    for var in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        text = env.get(var, "").strip()
        if text and all(t.strip().isdigit() for t in text.split(",")):
            return [int(t) for t in text.split(",")]
    if args.device_count:
        return list(range(args.device_count))
    raise GenError("no devices found: give --device-ids or --device-count")


def _pick(base: list[int], rel: str, what: str) -> str:
    idx = parse_id_list(rel, what)
    if idx and idx[-1] >= len(base):
        raise GenError(
            f"--{what}-range {rel} needs {idx[-1] + 1} CPUs but the list has {len(base)}: "
            f"{format_id_list(base) or 'none'}"
        )
    return format_id_list(base[i] for i in idx)


def generate(args: argparse.Namespace, topology: Topology, env: dict[str, str]) -> dict[str, Any]:
    ids = device_ids(args, topology, env)
    # Each device's CPU list: the automatic ``--bind_core`` split, one worker per device.
    var = VISIBLE_VARS.get(topology.device_kind or "", "CUDA_VISIBLE_DEVICES")
    visible = {var: ",".join(map(str, ids))} if topology.devices else {}
    planner = Planner(topology, BindSpec(kind="auto"), BindSpec(), len(ids), visible, tools={})
    cpus = dict(zip(ids, planner.auto_cores()))
    ranges = {"runtime": args.runtime_range, "minddata": args.minddata_range, "main": args.main_range}
    if args.pynative_range:
        ranges["pynative"] = args.pynative_range
    bind_cpu: dict[str, Any] = {}
    bind_memory: dict[str, Any] = {}
    for i in ids:
        bind_cpu[f"device{i}"] = {mod: _pick(cpus[i], rel, mod) for mod, rel in ranges.items()}
        dev = topology.device(topology.device_kind, i) if topology.device_kind else None
        node = dev.numa_node if dev is not None and dev.numa_node is not None else topology.node_of_cpu(cpus[i][0])
        if node is not None:
            bind_memory[f"device{i}"] = node
    used = {c for lst in cpus.values() for c in lst}
    if args.scheduler_base == "device0":
        base = cpus[ids[0]]
    elif args.scheduler_base == "free":
        base = [c for c in topology.cpus_allowed if c not in used]
        if len(base) <= parse_id_list(args.scheduler_range)[-1]:
            base = list(topology.cpus_allowed)
    else:
        base = list(topology.cpus_allowed)
    bind_cpu["scheduler"] = {"main": _pick(base, args.scheduler_range, "scheduler")}
    return {
        "bind_config": {"bind_cpu_mode": "cpu", "bind_memory_mode": "numa", "actor_thread_fix_bind": True},
        "bind_cpu": bind_cpu,
        "bind_memory": bind_memory,
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="msrun-gen-bind-json", description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default="bind_config.json", help="output file (default bind_config.json)")
    ap.add_argument("--device-ids", help="device ids, e.g. 0,1,2 or 0-7")
    ap.add_argument("--device-count", type=int, help="number of devices when none can be detected")
    ap.add_argument("--runtime-range", default=DEFAULTS["runtime"], help="runtime CPUs, relative (default 4-8)")
    ap.add_argument("--minddata-range", default=DEFAULTS["minddata"], help="minddata CPUs, relative (default 9-12)")
    ap.add_argument("--main-range", default=DEFAULTS["main"], help="main CPUs, relative (default 13-19)")
    ap.add_argument("--pynative-range", default=None, help="pynative CPUs, relative (default: none)")
    ap.add_argument("--scheduler-range", default=DEFAULTS["scheduler"], help="scheduler CPUs, relative (default 20-23)")
    ap.add_argument(
        "--scheduler-base",
        choices=("free", "global", "device0"),
        default="free",
        help="the CPU list the scheduler range indexes (default free)",
    )
    ap.add_argument("--topology", help="a topology snapshot instead of this machine (also MSRUN_TOPOLOGY)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    env = dict(os.environ)
    try:
        if args.topology:
            topology = Topology.load(args.topology)
        else:
            from pytest_msrun.binding.discover import load_topology

            topology = load_topology(env)
        data = generate(args, topology, env)
    except (OSError, ValueError) as exc:  # GenError, BindingError, RangeSyntaxError among them
        ap.error(str(exc))
    text = json.dumps(data, indent=2) + "\n"
    try:
        with open_output(args.output) as fh:  # not through a link or into a file someone put there
            fh.write(text)
    except OSError as exc:
        ap.error(f"--output: {exc}")
    print(f"wrote {args.output}: {len(data['bind_cpu']) - 1} device(s) + scheduler", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
