"""Ports and devices leased to concurrent jobs on this machine (pytest-xdist workers, parallel sessions).

State lives in a JSON file in a per-user temp directory, guarded by a file lock; a lease whose
owner process died is reclaimed. Ports come from a range below the kernel's ephemeral ports
and are probed by binding before they are handed out; devices are handed out as disjoint sets.

The directory is this user's alone - made new, or checked before anything is read or written
there (:func:`~pytest_msrun.fileio.private_dir`) - and what is read back from it is still taken as
a stranger's input: a bounded read, a total parser, every entry checked (:func:`clean_state`); what
does not pass is dropped, so the pool never raises for what it finds in its file.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from filelock import FileLock

from pytest_msrun.boundedjson import Rejected, loads
from pytest_msrun.fileio import private_dir, read_limited, write_whole
from pytest_msrun.proc import running

DEFAULT_PORT_RANGE = (30000, 32767)
STATE_LIMIT = 1 << 20  # bytes of pool.json read at most: a larger one is taken as empty
PID_LIMIT = 1 << 22  # Linux's largest pid_max


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
    for item in filter(None, (part.strip() for part in text.split(","))):
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


def inventory(setting: str) -> DeviceInventory:
    """Devices from ``--msrun-devices``: ``none``, ``cuda:0,1``, ``ascend:0-7`` or ``auto``
    (``ASCEND_RT_VISIBLE_DEVICES``, then ``CUDA_VISIBLE_DEVICES``, then NVML's count)."""
    setting = (setting or "auto").strip()
    if setting == "none":
        return DeviceInventory()
    if setting != "auto":
        kind, _, ids = setting.partition(":")
        if kind not in ("cuda", "ascend") or not ids:
            raise ValueError(f"--msrun-devices={setting!r}: use none, auto, cuda:<ids> or ascend:<ids>")
        return DeviceInventory(kind, _split_ids(ids))
    if os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").strip():
        return DeviceInventory("ascend", _split_ids(os.environ["ASCEND_RT_VISIBLE_DEVICES"]))
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return DeviceInventory("cuda", _split_ids(os.environ["CUDA_VISIBLE_DEVICES"]))
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl"):
        count = _nvml_count()
        if count:
            return DeviceInventory("cuda", [str(i) for i in range(count)])
    return DeviceInventory()


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
    pytest session of this user shares. That root is checked here as pytest checks it (it may be
    used before pytest looks): made new, or this user's and not a link - its mode then tightened
    to 0700 - else :class:`~pytest_msrun.fileio.UnsafePath`."""
    import getpass

    root = os.path.realpath(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir())
    try:
        user = getpass.getuser()
    except (ImportError, KeyError, OSError):
        user = "unknown"
    base = os.path.join(root, f"pytest-of-{user}")
    try:
        private_dir(base, tighten=True)
    except PermissionError:  # another user's, a link (UnsafePath), or no right to make it
        raise
    except OSError:  # a user name the file system refuses: pytest's own fallback
        base = private_dir(os.path.join(root, "pytest-of-unknown"), tighten=True)
    return os.path.join(base, "msrun-pool")


def _entry(part: str, entry: object) -> dict[str, Any] | None:
    """An entry of ``part`` as the pool writes it, or None: its owner's pid and a time, then a
    lease's TCP ports and device names, or a wait's count of devices."""
    if not isinstance(entry, dict):
        return None
    pid, ts = entry.get("pid"), entry.get("ts", 0)
    if type(pid) is not int or not 0 < pid <= PID_LIMIT:  # (no Linux pid is larger)
        return None
    if type(ts) not in (int, float) or not math.isfinite(ts):
        return None
    if part == "waiting":
        count = entry.get("devices", 0)
        return {"pid": pid, "devices": count, "ts": ts} if type(count) is int and count >= 0 else None
    ports, devices = entry.get("ports", []), entry.get("devices", [])
    if not isinstance(ports, list) or not all(type(p) is int and 0 < p <= 65535 for p in ports):
        return None  # (any TCP port: a session with another MSRUN_PORT_RANGE shares the file)
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        return None
    return {"pid": pid, "ports": ports, "devices": devices, "ts": ts}


def clean_state(data: object) -> dict[str, dict[str, dict[str, Any]]]:
    """The pool's state from what its file held: each lease and waiter that is one as the pool
    writes it; anything else (another shape, another type, a number out of range) is dropped."""
    state: dict[str, dict[str, dict[str, Any]]] = {"leases": {}, "waiting": {}}
    if not isinstance(data, dict):
        return state
    for part in state:
        entries = data.get(part)
        goods = {key: _entry(part, entry) for key, entry in entries.items()} if isinstance(entries, dict) else {}
        state[part] = {key: good for key, good in goods.items() if good is not None and isinstance(key, str)}
    return state


class ResourcePool:
    """File-locked leases of ports and devices, shared by every pytest process of this user.

    Raises :class:`~pytest_msrun.fileio.UnsafePath` when its directory is not this user's alone."""

    def __init__(self, directory: str | None = None, port_range: tuple[int, int] | None = None) -> None:
        self.dir = private_dir(directory or default_pool_dir())
        self.state_path = os.path.join(self.dir, "pool.json")
        self.lock = FileLock(os.path.join(self.dir, "pool.lock"))
        self.port_range = port_range or _env_range() or DEFAULT_PORT_RANGE

    def _load(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The state in the pool's file: a file that cannot be read, is larger than
        :data:`STATE_LIMIT` or is not JSON is an empty pool; a bad entry is dropped."""
        try:
            raw = read_limited(self.state_path, STATE_LIMIT)
            data = loads(raw, max_depth=4) if raw is not None else None
        except (OSError, Rejected):
            data = None
        return clean_state(data)

    def _save(self, state: dict[str, dict[str, dict[str, Any]]]) -> None:
        write_whole(self.state_path, json.dumps(state), mode=0o600)

    def _live(self, state: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
        for part in ("leases", "waiting"):
            state[part] = {k: v for k, v in state[part].items() if running(v["pid"])}
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
                    used_ports = {p for v in state["leases"].values() for p in v["ports"]}
                    used_devices = {d for v in state["leases"].values() for d in v["devices"]}
                    free = [d for d in inv.ids if d not in used_devices]
                    earlier = devices > 0 and any(  # first come, first served: nobody waits forever
                        key != waiter and w["ts"] < since for key, w in state["waiting"].items()
                    )
                    if len(free) >= devices and not earlier:
                        lease = Lease(uuid.uuid4().hex, self._pick_ports(ports, used_ports), free[:devices])
                        entry = {"pid": os.getpid(), "ports": lease.ports, "devices": lease.devices, "ts": time.time()}
                        state["leases"][lease.lease_id] = entry
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
        return any(w["pid"] != os.getpid() for w in state["waiting"].values())

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
