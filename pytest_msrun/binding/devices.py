"""Which physical accelerator each local worker drives, from the visible-device variables.

``CUDA_VISIBLE_DEVICES`` may list indices, ``GPU-<uuid>`` prefixes or MIG ids;
``ASCEND_RT_VISIBLE_DEVICES`` lists npu-smi logical ids. Devices are matched by index or UUID
in the user's order (MindSpore's msrun sorts the Ascend list and ignores the CUDA one).
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_msrun.binding.topology import Device, Topology
from pytest_msrun.record import record

VISIBLE_VARS = {"cuda": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES"}


class VisibleDevicesError(ValueError):
    """A visible-device variable names a device this machine does not have."""


@record
class WorkerDevice:
    """The device a local worker drives (``device`` None when unknown)."""

    physical_id: int | None
    device: Device | None


def worker_devices(topology: Topology, env: Mapping[str, str], count: int, logical: bool = False) -> list[WorkerDevice]:
    """Device of each of ``count`` local workers. ``logical``: dry run - worker i is device i."""
    devices = topology.devices
    if logical:
        return [WorkerDevice(i, None) for i in range(count)]
    kind = topology.device_kind
    wanted = (VISIBLE_VARS[kind],) if kind else ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    var = next((v for v in wanted if v in env), None)
    tokens: list[str] | None = None
    if var is not None:
        text = env[var].strip()
        tokens = [t.strip() for t in text.split(",")] if text else []
        if any(not t for t in tokens):
            raise VisibleDevicesError(f"{var}={env[var]!r} has an empty item")
    out = []
    for i in range(count):
        if tokens is None:
            dev = next((d for d in devices if d.index == i), None)
            out.append(WorkerDevice(i if (dev is not None or not devices) else None, dev))
            continue
        if i >= len(tokens):
            out.append(WorkerDevice(None, None))  # more workers than visible devices
            continue
        tok = tokens[i]
        if tok.isdigit():
            idx = int(tok)
            dev = next((d for d in devices if d.index == idx), None)
            if devices and dev is None:
                raise VisibleDevicesError(
                    f"{var}={env.get(var or '')!r}: device {idx} does not exist here (devices: "
                    f"{', '.join(str(d.index) for d in devices)})"
                )
            out.append(WorkerDevice(idx, dev))
        elif tok.startswith("GPU-") and var == "CUDA_VISIBLE_DEVICES":
            matches = [d for d in devices if d.uuid and d.uuid.startswith(tok)]
            if devices and len(matches) != 1:
                raise VisibleDevicesError(f"CUDA_VISIBLE_DEVICES item {tok!r} matches {len(matches)} GPUs by UUID")
            dev = matches[0] if matches else None
            out.append(WorkerDevice(dev.index if dev else None, dev))
        elif tok.startswith("MIG-") and var == "CUDA_VISIBLE_DEVICES":
            out.append(WorkerDevice(None, None))  # a MIG slice: its parent GPU is not known here
        else:
            raise VisibleDevicesError(f"{var} item {tok!r} is neither a device index nor a GPU UUID")
    return out
