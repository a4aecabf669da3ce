"""Which file system holds a path, whether it can hold logs, and how full it is.

From ``/proc/self/mountinfo`` (the mount that holds a path is the one with the longest mount
point that is a prefix of its real path) and ``statvfs``. Standard library only; used before a
job starts (``--log_dir`` on a pseudo file system is a usage error) and when a write fails (the
message names the file system, its free space and the fix).
"""

from __future__ import annotations

import errno
import os

from pytest_msrun.record import record

# File systems that hold no files of ours: the kernel's views of itself.
PSEUDO = frozenset(
    (
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "devpts",
        "debugfs",
        "tracefs",
        "securityfs",
        "configfs",
        "bpf",
        "pstore",
        "mqueue",
        "fusectl",
        "efivarfs",
        "binfmt_misc",
        "autofs",
        "hugetlbfs",
        "nsfs",
    )
)


@record
class Mount:
    point: str  # where it is mounted
    fstype: str  # proc, ext4, tmpfs ...
    source: str
    options: str = ""  # the file system's own ("super") options: rw,cpuset,...


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (a space is ``\\040``)."""
    head, *parts = field.split("\\")
    for part in parts:
        code = part[:3]
        head += chr(int(code, 8)) + part[3:] if len(code) == 3 and code.isdigit() else "\\" + part
    return head


def mounts(mountinfo: str | None = None) -> list[Mount]:
    """Every mount this process sees (or a mountinfo file's text lists), in the kernel's order
    (later ones cover earlier ones)."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
                mountinfo = fh.read()
        except OSError:
            return []
    out = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 2:
            continue
        out.append(Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]), rest[2] if len(rest) > 2 else ""))
    return out


def mount_of(path: str) -> Mount | None:
    """The mount that holds ``path`` (or its nearest existing ancestor), None when unknown."""
    probe = os.path.realpath(path or ".")
    best: Mount | None = None
    for mount in mounts():
        point = mount.point.rstrip("/") or "/"
        inside = probe == point or probe.startswith(point if point == "/" else point + "/")
        # the later of two mounts on one point covers the earlier: >=, not >
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = mount
    return best


KERNEL_TREES = ("/proc", "/sys")  # the kernel's own, whatever is mounted inside them


def log_dir_problem(path: str) -> str:
    """Why ``path`` cannot hold msrun's logs ("" when it can, or cannot be told)."""
    real = os.path.realpath(path or ".")
    tree = next((t for t in KERNEL_TREES if real == t or real.startswith(t + "/")), "")
    mount = mount_of(path)
    if tree or (mount is not None and mount.fstype in PSEUDO):
        where = f"{mount.point} ({mount.fstype})" if mount is not None else tree
        if tree and mount is not None and mount.fstype not in PSEUDO:
            where = f"{mount.point} ({mount.fstype}, under {tree})"
        return (
            f"{path!r} is on {where}, the kernel's view of itself, which holds no log files; choose a directory "
            "on a real file system"
        )
    return ""


def free_bytes(path: str) -> int | None:
    """Bytes this process may still write on ``path``'s file system (None when unknown)."""
    probe = path or "."
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip("/"))
    try:
        st = os.statvfs(probe or ".")
    except OSError:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def is_full(path: str) -> bool:
    """Whether ``path``'s file system has (next to) no room left: less than two blocks."""
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return False
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks < 2 or (st.f_files > 0 and st.f_ffree == 0)


def describe_write_error(path: str, exc: OSError, flag: str) -> str:
    """``path``: the error, and for a full file system (or quota) where it is and what to do
    (``flag``: the option that chose the path)."""
    from pytest_msrun.fileio import UnsafePath

    if isinstance(exc, UnsafePath):  # names the path, what is wrong and the fix already
        return str(exc)
    text = f"{path}: {exc.strerror or exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        mount = mount_of(os.path.dirname(path) or ".")
        where = f"the file system mounted at {mount.point} ({mount.fstype})" if mount else "its file system"
        free = free_bytes(os.path.dirname(path) or ".")
        left = f", {free} bytes free" if free is not None else ""
        text += f" - {where} is full{left}; free space there, or give {flag} on another file system"
    return text
