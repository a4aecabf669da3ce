"""Real "hosts" on one machine: each node a network + UTS + mount namespace on a private bridge.

A node is held open by a long-lived holder process (``unshare --net --uts --mount`` running
``sleep``); commands enter it with ``nsenter`` into the holder's namespaces, never with
``ip netns exec`` (which remounts ``/sys`` and hides ``/sys/fs/cgroup``). Every node has its own
hostname (``node1``, ``node2``, ...), an address on a /24 in ``10.x`` that clashes with no route or
address of this machine (the bridge in the host namespace gets ``.1``, node K gets ``.10+K``), a
per-node ``/etc/hosts`` naming every node and the bridge host, and no default route: it reaches
only its loopback and the lab's addresses.

    with NetLab(nodes=2) as lab:
        subprocess.run([*lab.prefix(1), "hostname"])        # prints node1
        lab.address(2)                                      # "10.213.0.12"
        lab.set_link(2, up=False)                           # partition node2 (packets dropped)

:meth:`NetLab.down` kills every process left in a node, removes the veths, the bridge, the holders
and the lab's files, and raises :class:`LabLeak` if anything is still there afterwards. The lab's
state is in ``<directory>/netlab.json``, so another process can take it down
(:meth:`NetLab.attach`). Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE = "netlab.json"
PREFIX = "mlb"  # every interface a lab creates starts with this
HOST_NAME = "labhost"  # the bridge address's name in every node's /etc/hosts
FIRST_NET = ipaddress.IPv4Network("10.213.0.0/24")
CANDIDATES = 2048  # /24s tried from FIRST_NET on
COMMANDS = ("ip", "nsenter", "unshare")


class LabError(RuntimeError):
    """The lab could not be built or used."""


class LabLeak(LabError):
    """Teardown left something behind (listed in the message)."""


def _lock_dir() -> Path:
    run_lock = Path("/run/lock")
    return run_lock if run_lock.is_dir() and os.access(run_lock, os.W_OK) else Path(tempfile.gettempdir())


@contextlib.contextmanager
def exclusive(name: str = "pytest-msrun-netlab.lock", timeout: float = 60.0) -> Iterator[None]:
    """Hold a host-wide flock while labs pick subnets and interface names; the file goes away after.

    The file is unlinked while still locked; a waiter that then locks the unlinked inode notices
    (the path no longer names its inode) and retries, so exactly one holder exists at a time.
    """
    path = _lock_dir() / name
    deadline = time.monotonic() + timeout
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LabError(f"timed out waiting for {path}") from None
                    time.sleep(0.02)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                return
        finally:
            os.close(fd)


def lab_directory(directory: str | None, prefix: str) -> tuple[str, bool]:
    """A lab's directory (a new temporary one when ``None``), world-readable; (path, created here)."""
    created = False
    if directory is None:
        directory, created = tempfile.mkdtemp(prefix=prefix), True
    elif not os.path.exists(directory):
        os.makedirs(directory)
        created = True
    os.chmod(directory, 0o755)
    return directory, created


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _ns_inode(pid: int | str, kind: str = "net") -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def pids_in_netns(inode: int) -> list[int]:
    """Live processes whose network namespace is ``inode``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_inode(entry) == inode and _alive(int(entry)):
            found.append(int(entry))
    return found


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine routes or holds an address in (any table, not defaults)."""
    nets: list[ipaddress.IPv4Network] = []
    kinds = {"unicast", "local", "broadcast", "multicast", "anycast", "blackhole", "unreachable", "prohibit", "throw"}
    for line in _run(["ip", "-4", "-o", "route", "show", "table", "all"]).stdout.splitlines():
        words = line.split()
        if words and words[0] in kinds:
            words = words[1:]
        if not words or words[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(words[0], strict=False))
    for line in _run(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            with contextlib.suppress(ValueError, IndexError):
                nets.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
    return nets


def _interfaces() -> set[str]:
    return set(os.listdir("/sys/class/net"))


def unusable_reason() -> str | None:
    """Why a lab cannot be built here, or None. Cheap enough to call once per session."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"missing command(s): {', '.join(missing)} (apt-get install iproute2 util-linux)"
    probe = (
        "ip link add name p0 type veth peer name p1 && ip link add name br0 type bridge && ip link set p0 master br0"
    )
    try:
        proc = _run(["unshare", "--net", "--uts", "--mount", "--", "sh", "-c", probe], check=False, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"namespaces unusable: {exc}"
    if proc.returncode != 0:
        return f"namespaces, veth or bridges unusable: {proc.stderr.strip() or proc.returncode}"
    return None


@dataclass
class Node:
    index: int  # 1-based, as in the hostname
    name: str
    address: str
    holder: int  # pid of the holder process
    netns: int  # inode of its network namespace
    veth: str  # host-side end of its link
    dir: str


@dataclass
class NetLab:
    """A lab of ``nodes`` namespaced hosts; :meth:`up` builds it, :meth:`down` removes it.

    ``private_dirs``: absolute paths that get a per-node directory bind-mounted over them inside
    each node (e.g. a Slurm ``TmpFS``); created on the host if missing, removed at teardown if created.
    """

    nodes: int = 2
    directory: str | None = None
    private_dirs: Sequence[str] = ()
    network: str = ""
    bridge: str = ""
    members: list[Node] = field(default_factory=list)
    owns_dir: bool = False
    created_paths: list[str] = field(default_factory=list)
    up_seconds: float = 0.0

    def __post_init__(self) -> None:
        self._holders: dict[int, subprocess.Popen[bytes]] = {}  # only when built by this process

    # ---------- building ----------
    def up(self) -> NetLab:
        reason = unusable_reason()
        if reason:
            raise LabError(reason)
        t0 = time.monotonic()
        self.directory, owns = lab_directory(self.directory, "msrun-netlab-")
        self.owns_dir = self.owns_dir or owns
        try:
            with exclusive():
                self._pick_network()
                self._make_bridge()
            for k in range(1, self.nodes + 1):
                self._make_node(k)
            self._save()
        except BaseException:
            with contextlib.suppress(Exception):
                self.down()
            raise
        self.up_seconds = time.monotonic() - t0
        return self

    def _pick_network(self) -> None:
        used = _used_networks()
        names = _interfaces()
        base = int(FIRST_NET.network_address)
        for i in range(CANDIDATES):
            net = ipaddress.IPv4Network((base + 256 * i, 24))
            tag = f"{((base >> 8) + i) & 0xFFFF:04x}"
            bridge = f"{PREFIX}{tag}"
            if any(net.overlaps(u) for u in used) or any(n.startswith(bridge) for n in names):
                continue
            if self.nodes + 10 > 254:
                raise LabError(f"too many nodes for a /24: {self.nodes}")
            self.network, self.bridge = str(net), bridge
            return
        raise LabError("no free 10.x /24 for a lab")

    def _addr(self, host: int) -> str:
        return str(ipaddress.IPv4Network(self.network)[host])

    def _make_bridge(self) -> None:
        _run(["ip", "link", "add", "name", self.bridge, "type", "bridge"])
        with contextlib.suppress(OSError):
            Path(f"/proc/sys/net/ipv6/conf/{self.bridge}/disable_ipv6").write_text("1")
        _run(["ip", "addr", "add", f"{self._addr(1)}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])

    def hosts_text(self) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{self._addr(1)}\t{HOST_NAME}"]
        lines += [f"{self._addr(10 + k)}\tnode{k}" for k in range(1, self.nodes + 1)]
        return "\n".join(lines) + "\n"

    def _make_node(self, k: int) -> None:
        assert self.directory is not None
        name, address = f"node{k}", self._addr(10 + k)
        node_dir = Path(self.directory) / name
        node_dir.mkdir(mode=0o755)
        (node_dir / "hosts").write_text(self.hosts_text())
        (node_dir / "hostname").write_text(name + "\n")
        holder = subprocess.Popen(
            ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._holders[holder.pid] = holder
        node = Node(k, name, address, holder.pid, 0, f"{self.bridge}v{k}", str(node_dir))
        self.members.append(node)
        deadline = time.monotonic() + 10
        while True:  # unshare has execed sleep once the command name says so
            try:
                comm = Path(f"/proc/{holder.pid}/comm").read_text().strip()
            except OSError:
                comm = ""
            if comm == "sleep":
                break
            if holder.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"the holder of {name} did not start (exit {holder.poll()})")
            time.sleep(0.002)
        inode = _ns_inode(holder.pid)
        if inode is None or inode == _ns_inode("self"):
            raise LabError(f"the holder of {name} has no network namespace of its own")
        node.netns = inode
        _run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", str(holder.pid)])
        with contextlib.suppress(OSError):
            Path(f"/proc/sys/net/ipv6/conf/{node.veth}/disable_ipv6").write_text("1")
        _run(["ip", "link", "set", node.veth, "master", self.bridge, "up"])
        binds = []
        for i, target in enumerate(self.private_dirs):
            if not os.path.isdir(target):
                os.makedirs(target)
                self.created_paths.append(target)
            source = node_dir / f"private{i}"
            source.mkdir(mode=0o1777)
            os.chmod(source, 0o1777)
            binds.append(f"mount --bind {source} {target}")
        script = " && ".join(
            [
                f"hostname {name}",
                f"mount --bind {node_dir / 'hosts'} /etc/hosts",
                f"mount --bind {node_dir / 'hostname'} /etc/hostname",
                *binds,
                "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6",
                "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6",
                "ip link set lo up",
                f"ip addr add {address}/24 dev eth0",
                "ip link set eth0 up",
            ]
        )
        _run([*self.prefix(k, wd=False), "sh", "-c", script])

    def _save(self) -> None:
        assert self.directory is not None
        data = asdict(self)
        data["private_dirs"] = list(self.private_dirs)
        (Path(self.directory) / STATE).write_text(json.dumps(data, indent=2))

    @classmethod
    def attach(cls, directory: str | os.PathLike[str]) -> NetLab:
        """The lab whose state is in ``directory`` (built by another process)."""
        data = json.loads((Path(directory) / STATE).read_text())
        data["members"] = [Node(**m) for m in data["members"]]
        return cls(**data)

    # ---------- using ----------
    def node(self, k: int | str) -> Node:
        """Node ``k`` (1-based, like its hostname) or by name."""
        for n in self.members:
            if k in (n.index, n.name):
                return n
        raise KeyError(k)

    def prefix(self, k: int | str, wd: bool = True) -> list[str]:
        """argv prefix that runs a command inside node ``k`` (its network, hostname and mounts).

        With ``wd`` the command keeps the caller's working directory (``nsenter --wd=.`` opens it
        before entering), so ``Popen([*lab.prefix(1), ...], cwd=X)`` runs in ``X`` on node1.
        """
        argv = ["nsenter", "-t", str(self.node(k).holder), "--net", "--uts", "--mount"]
        if wd:
            argv.append("--wd=.")
        return [*argv, "--"]

    def run(self, k: int | str, argv: Sequence[str], **kw: object) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside node ``k`` to completion (text output captured unless given)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run([*self.prefix(k), *argv], **kw)  # type: ignore[call-overload]

    def address(self, k: int | str) -> str:
        return self.node(k).address

    def hostname(self, k: int | str) -> str:
        return self.node(k).name

    @property
    def host_address(self) -> str:
        """The bridge's address: the host namespace as seen from the nodes (named ``labhost``)."""
        return self._addr(1)

    def set_link(self, k: int | str, up: bool) -> None:
        """Bring node ``k``'s link to the bridge down (a partition: its packets are dropped) or up."""
        _run(["ip", "link", "set", self.node(k).veth, "up" if up else "down"])

    def processes(self, k: int | str) -> list[int]:
        """Live processes inside node ``k``, its holder excluded."""
        node = self.node(k)
        return [p for p in pids_in_netns(node.netns) if p != node.holder]

    # ---------- removing ----------
    def kill_node_processes(self, timeout: float = 5.0) -> None:
        """SIGKILL everything running in the nodes except their holders, and wait until it is gone."""
        deadline = time.monotonic() + timeout
        while True:
            left = [p for n in self.members if n.netns for p in self.processes(n.index)]
            if not left or time.monotonic() > deadline:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._reap()
            time.sleep(0.02)

    def down(self, timeout: float = 10.0) -> None:
        """Remove everything this lab created; raise :class:`LabLeak` if anything remains."""
        self.kill_node_processes(timeout / 2)
        names = _interfaces()
        for n in self.members:
            if n.veth in names:
                _run(["ip", "link", "del", n.veth], check=False)
        if self.bridge and self.bridge in _interfaces():
            _run(["ip", "link", "del", self.bridge], check=False)
        for n in self.members:
            if n.netns and _ns_inode(n.holder) == n.netns:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(n.holder, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self._live_leftovers() and time.monotonic() < deadline:
            self._reap()
            self.kill_node_processes(0.1)
            time.sleep(0.02)
        self._reap()
        for path in reversed(self.created_paths):
            shutil.rmtree(path, ignore_errors=True)
        if self.directory:
            if self.owns_dir:
                shutil.rmtree(self.directory, ignore_errors=True)
            else:
                for n in self.members:
                    shutil.rmtree(n.dir, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(Path(self.directory) / STATE)
        left = self.leftovers()
        if left:
            raise LabLeak("lab teardown left: " + "; ".join(left))

    def _live_leftovers(self) -> list[str]:
        left = []
        names = _interfaces()
        left += [f"interface {i}" for i in sorted(names) if self.bridge and i.startswith(self.bridge)]
        for n in self.members:
            if n.netns:
                pids = pids_in_netns(n.netns)
                if pids:
                    left.append(f"processes in {n.name}'s namespace: {pids}")
        return left

    def leftovers(self) -> list[str]:
        """What of this lab still exists: interfaces, processes in its namespaces, files."""
        left = self._live_leftovers()
        left += [f"path {p}" for p in self.created_paths if os.path.exists(p)]
        if self.directory:
            if self.owns_dir and os.path.exists(self.directory):
                left.append(f"directory {self.directory}")
            left += [f"directory {n.dir}" for n in self.members if os.path.exists(n.dir)]
        return left

    def _reap(self) -> None:
        """Collect this process's exited holders (never other children: their Popen needs them)."""
        for pid, popen in list(self._holders.items()):
            if popen.poll() is not None:
                del self._holders[pid]

    def __enter__(self) -> NetLab:
        return self.up() if not self.members else self

    def __exit__(self, *exc: object) -> None:
        self.down()


@contextlib.contextmanager
def netlab(nodes: int = 2, **kw: object) -> Iterator[NetLab]:
    """``with netlab(2) as lab:`` - built on entry, removed (verified) on exit."""
    lab = NetLab(nodes, **kw)  # type: ignore[arg-type]
    lab.up()
    try:
        yield lab
    finally:
        lab.down()


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/lab/netlab.py up --nodes 2 --dir DIR`` (prints JSON, leaves it up) / ``down --dir DIR``."""
    parser = argparse.ArgumentParser(description="namespaced hosts on a private bridge")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a lab and leave it up; prints JSON")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--dir", required=True)
    down = sub.add_parser("down", help="remove the lab in --dir")
    down.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            lab = NetLab(args.nodes, directory=os.path.abspath(args.dir)).up()
            nodes = [{"name": n.name, "address": n.address, "prefix": lab.prefix(n.index)} for n in lab.members]
            print(json.dumps({"dir": lab.directory, "network": lab.network, "bridge": lab.bridge, "nodes": nodes}))
        else:
            NetLab.attach(args.dir).down()
    except (LabError, OSError) as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
