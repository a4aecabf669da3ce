"""What the kernel applied: each process's CPUs and memory policy, read back from ``/proc``.

``Cpus_allowed_list`` (``/proc/<pid>/status``) is the CPU affinity; a ``numactl --membind``
policy shows in ``/proc/<pid>/numa_maps`` as ``bind:<nodes>`` (``Mems_allowed_list`` is the
cpuset's limit, reported too). Reads wait until the process has exec'd past the binding tools.
"""

from __future__ import annotations

import contextlib
import os

from pytest_msrun.cpulist import RangeSyntaxError, format_id_list, parse_id_list
from pytest_msrun.record import record
from pytest_msrun.waiting import wait_until

WRAPPERS = ("taskset", "numactl", "setpriv")


@record
class KernelBinding:
    cpus: list[int] | None
    mem_policy: str  # "default", "bind", "interleave", ... ("?" when unreadable)
    mem_nodes: list[int] | None
    mems_allowed: list[int] | None


def _status_field(text: str, name: str) -> list[int] | None:
    for line in text.splitlines():
        if line.startswith(name + ":"):
            try:
                return parse_id_list(line.split(":", 1)[1].strip())
            except RangeSyntaxError:
                return None
    return None


def past_wrappers(pid: int) -> bool:
    """Wait (up to a second) until ``pid`` runs the task itself rather than taskset/numactl/setpriv."""

    def past() -> bool:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv0 = fh.read().split(b"\0", 1)[0].decode(errors="replace")
        return bool(argv0) and os.path.basename(argv0) not in WRAPPERS  # empty while an exec is in progress

    try:
        return wait_until(past, 1.0, 0.005)
    except OSError:  # gone
        return False


def read_binding(pid: int) -> KernelBinding | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            status = fh.read()
    except OSError:
        return None
    policy, nodes = "?", None
    with contextlib.suppress(OSError, RangeSyntaxError):
        with open(f"/proc/{pid}/numa_maps") as fh:
            first = fh.readline().split()
        if len(first) > 1:
            policy, _, rest = first[1].partition(":")
            nodes = parse_id_list(rest) if rest else None
    return KernelBinding(
        cpus=_status_field(status, "Cpus_allowed_list"),
        mem_policy=policy,
        mem_nodes=nodes,
        mems_allowed=_status_field(status, "Mems_allowed_list"),
    )


def mismatch(expected_cpus: list[int] | None, expected_mems: list[int] | None, got: KernelBinding) -> list[str]:
    """What differs between the plan and the kernel (empty when they agree)."""
    out = []
    if expected_cpus is not None and got.cpus is not None and sorted(expected_cpus) != sorted(got.cpus):
        out.append(f"runs on CPUs {format_id_list(got.cpus)}, the plan says {format_id_list(expected_cpus)}")
    if expected_mems is not None and (got.mem_policy != "bind" or sorted(got.mem_nodes or []) != sorted(expected_mems)):
        out.append(f"has memory policy {_policy(got)}, the plan says bind:{format_id_list(expected_mems)}")
    return out


def _ids(ids: list[int] | None) -> str:
    return "-" if ids is None else format_id_list(ids)


def _policy(got: KernelBinding) -> str:
    return got.mem_policy + (f":{format_id_list(got.mem_nodes)}" if got.mem_nodes else "")


def report_table(
    rows: list[tuple[str, int, str, list[int] | None, list[int] | None, KernelBinding | None, str]], header: str
) -> str:
    """``mpirun --report-bindings`` style: plan and kernel side by side for every process."""
    table = [("process", "pid", "device", "cpus plan", "cpus kernel", "memory plan", "memory kernel", "via")]
    for label, pid, device, cpus, mems, got, how in rows:
        table.append(
            (
                label,
                str(pid),
                device or "-",
                _ids(cpus),
                _ids(got.cpus) if got else "?",
                "-" if mems is None else f"bind:{format_id_list(mems)}",
                _policy(got) if got else "?",
                how or "-",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [header] + ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines)
