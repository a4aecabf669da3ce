"""Ports and devices leased to concurrent jobs on this machine (pytest-xdist workers, parallel sessions).

State lives in a JSON file in a per-user temp directory, guarded by a file lock; a lease whose
owner process died is reclaimed. Ports come from a range below the kernel's ephemeral ports
and are probed by binding before they are handed out; devices are handed out as disjoint sets.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from filelock import FileLock

from pytest_msrun.fileio import write_whole

DEFAULT_PORT_RANGE = (30000, 32767)


class DeviceShortage(Exception):
    """No disjoint device set became free in time."""


@dataclass
class DeviceInventory:
    """Devices jobs may use: ``kind`` picks the visibility variable set for the ranks."""

    kind: str = "none"  # cuda | ascend | none
    ids: list[str] = field(default_factory=list)

    @property
    def env_var(self) -> str:
        return "ASCEND_RT_VISIBLE_DEVICES" if self.kind == "ascend" else "CUDA_VISIBLE_DEVICES"

    def describe(self) -> str:
        return f"{self.kind}: {','.join(self.ids)}" if self.ids else "no devices"


def _split_ids(text: str) -> list[str]:
    out: list[str] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lo, dash, hi = item.partition("-")
        if dash and lo.isdigit() and hi.isdigit():
            out.extend(str(i) for i in range(int(lo), int(hi) + 1))
        else:
            out.append(item)
    return out


def _nvml_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library, no permission: no NVIDIA devices
        return 0


def inventory(setting: str, env: dict[str, str] | None = None) -> DeviceInventory:
    """Devices from ``--msrun-devices``: ``none``, ``cuda:0,1``, ``ascend:0-7`` or ``auto``
    (``ASCEND_RT_VISIBLE_DEVICES``, then ``CUDA_VISIBLE_DEVICES``, then NVML's count)."""
    env = dict(os.environ) if env is None else env
    setting = (setting or "auto").strip()
    if setting == "none":
        return DeviceInventory()
    if setting != "auto":
        kind, _, ids = setting.partition(":")
        if kind not in ("cuda", "ascend") or not ids:
            raise ValueError(f"--msrun-devices={setting!r}: use none, auto, cuda:<ids> or ascend:<ids>")
        return DeviceInventory(kind, _split_ids(ids))
    if env.get("ASCEND_RT_VISIBLE_DEVICES", "").strip():
        return DeviceInventory("ascend", _split_ids(env["ASCEND_RT_VISIBLE_DEVICES"]))
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return DeviceInventory("cuda", _split_ids(env["CUDA_VISIBLE_DEVICES"]))
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl"):
        count = _nvml_count()
        if count:
            return DeviceInventory("cuda", [str(i) for i in range(count)])
    return DeviceInventory()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _bindable(port: int) -> bool:
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


@dataclass
class Lease:
    lease_id: str
    ports: list[int]
    devices: list[str]


def default_pool_dir() -> str:
    """``msrun-pool`` in pytest's own per-user temp root (``/tmp/pytest-of-<user>``), which every
    pytest session of this user shares and pytest already keeps private (mode 0700)."""
    import getpass

    root = os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()
    try:
        user = getpass.getuser()
    except (ImportError, KeyError, OSError):
        user = "unknown"
    base = os.path.join(root, f"pytest-of-{user}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    return os.path.join(base, "msrun-pool")


class ResourcePool:
    """File-locked leases of ports and devices, shared by every pytest process of this user."""

    def __init__(self, directory: str | None = None, port_range: tuple[int, int] | None = None) -> None:
        self.dir = directory or default_pool_dir()
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.state_path = os.path.join(self.dir, "pool.json")
        self.lock = FileLock(os.path.join(self.dir, "pool.lock"))
        self.port_range = port_range or _env_range() or DEFAULT_PORT_RANGE

    def _load(self) -> dict:
        try:
            with open(self.state_path, encoding="utf-8") as fh:
                state = json.load(fh)
            if isinstance(state, dict) and isinstance(state.get("leases"), dict):
                if not isinstance(state.get("waiting"), dict):
                    state["waiting"] = {}
                return state
        except (OSError, ValueError):
            pass
        return {"leases": {}, "waiting": {}}

    def _save(self, state: dict) -> None:
        write_whole(self.state_path, json.dumps(state))

    def _live(self, state: dict) -> dict:
        for part in ("leases", "waiting"):
            state[part] = {k: v for k, v in state[part].items() if _alive(int(v.get("pid", 0)))}
        return state

    def _pick_ports(self, count: int, used: set[int]) -> list[int]:
        lo, hi = self.port_range
        span = hi - lo + 1
        start = random.randrange(span)
        picked: list[int] = []
        for i in range(span):
            port = lo + (start + i) % span
            if port in used or port in picked or not _bindable(port):
                continue
            picked.append(port)
            if len(picked) == count:
                return picked
        raise OSError(f"no {count} free ports in {lo}-{hi} (MSRUN_PORT_RANGE)")

    def lease(self, ports: int, devices: int, inv: DeviceInventory, wait: float) -> Lease:
        """Lease ``ports`` ports and ``devices`` devices, waiting up to ``wait`` s for devices.

        While it waits, the wait is on record (:meth:`contended`), so that a warm world holding
        devices in another process ends after its current test instead of keeping them."""
        if devices > len(inv.ids):
            raise DeviceShortage(f"needs {devices} devices; this machine has {len(inv.ids)} ({inv.describe()})")
        deadline = time.monotonic() + wait
        waiter = uuid.uuid4().hex
        since = time.time()
        try:
            while True:
                with self.lock:
                    state = self._live(self._load())
                    used_ports = {p for v in state["leases"].values() for p in v.get("ports", [])}
                    used_devices = {d for v in state["leases"].values() for d in v.get("devices", [])}
                    free = [d for d in inv.ids if d not in used_devices]
                    earlier = devices > 0 and any(  # first come, first served: nobody waits forever
                        key != waiter and float(w.get("ts", 0)) < since for key, w in state["waiting"].items()
                    )
                    if len(free) >= devices and not earlier:
                        picked = self._pick_ports(ports, used_ports)
                        lease = Lease(uuid.uuid4().hex, picked, free[:devices])
                        state["leases"][lease.lease_id] = {
                            "pid": os.getpid(),
                            "ports": lease.ports,
                            "devices": lease.devices,
                            "ts": time.time(),
                        }
                        state["waiting"].pop(waiter, None)
                        self._save(state)
                        return lease
                    if waiter not in state["waiting"]:
                        state["waiting"][waiter] = {"pid": os.getpid(), "devices": devices, "ts": since}
                        self._save(state)
                if time.monotonic() >= deadline:
                    raise DeviceShortage(
                        f"waited {wait:g} s for {devices} free devices of {inv.describe()} (others are leased)"
                    )
                time.sleep(0.1)
        finally:
            if devices:
                with self.lock:
                    state = self._load()
                    if state["waiting"].pop(waiter, None) is not None:
                        self._save(state)

    def contended(self, lease: Lease) -> bool:
        """Whether another process waits for devices while ``lease`` holds some."""
        if not lease.devices:
            return False
        with self.lock:
            state = self._live(self._load())
        return any(int(w.get("pid", 0)) != os.getpid() for w in state["waiting"].values())

    def release(self, lease: Lease) -> None:
        with self.lock:
            state = self._load()
            state["leases"].pop(lease.lease_id, None)
            self._save(self._live(state))


def _env_range() -> tuple[int, int] | None:
    text = os.environ.get("MSRUN_PORT_RANGE", "")
    lo, _, hi = text.partition("-")
    if lo.isdigit() and hi.isdigit() and 1024 <= int(lo) < int(hi) <= 65535:
        return int(lo), int(hi)
    return None
