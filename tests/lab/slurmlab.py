"""A real Slurm cluster on one machine, on top of :mod:`netlab` (see shared/reference/slurm-lab.md).

One ``slurmctld`` in the host namespace on the lab bridge's address, one ``slurmd`` per node
namespace (``node1``, ``node2``, ...), its own ``munged`` (key and socket in the lab directory);
clients (``srun``, ``sbatch``, ``salloc``, ``scontrol``, ``sinfo``, ``scancel``) run from the host
with :meth:`SlurmLab.env`, which points ``SLURM_CONF`` at the lab's configuration.

    with SlurmLab(nodes=2) as lab:
        subprocess.run(["srun", "-N2", "hostname"], env=lab.env())   # node1, node2

From a shell (the lab stays up until ``down``)::

    python tests/lab/slurmlab.py up --nodes 2 --dir /tmp/lab [--install]   # prints JSON
    SLURM_CONF=/tmp/lab/etc/slurm.conf srun -N2 hostname
    python tests/lab/slurmlab.py down --dir /tmp/lab

Packages: ``slurm-wlm`` and ``munge``; installed with apt-get only when asked (``--install``,
``install=True`` or ``MSRUN_LAB_INSTALL=1``). Needs root. One controller port per lab (picked free),
so two labs can run on one host.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import FIRST_NET, LabError, LabLeak, NetLab, lab_directory, unusable_reason  # noqa: E402

STATE = "slurmlab.json"
INSTALL_ENV = "MSRUN_LAB_INSTALL"
PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("srun", "sbatch", "salloc", "scontrol", "sinfo", "scancel")
STOP_WAIT = 5.0  # seconds between SIGTERM and SIGKILL for the daemons
GPUS = 2  # GPUs per node in the gres.conf (device files without devices: Slurm only names them)


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def missing_commands() -> list[str]:
    return [c for c in (*DAEMONS, *CLIENTS) if _which(c) is None]


def install_requested() -> bool:
    return os.environ.get(INSTALL_ENV, "").strip().lower() in ("1", "true", "yes")


def unusable_slurm_reason() -> str | None:
    """Why a Slurm lab cannot run here (packages, root, namespaces), or None."""
    if os.geteuid() != 0:
        return "a Slurm lab needs root"
    missing = missing_commands()
    if missing:
        return f"missing {', '.join(missing)} (apt-get install {' '.join(PACKAGES)}, or set {INSTALL_ENV}=1)"
    return unusable_reason()


def ensure_packages(install: bool) -> None:
    """Install slurm-wlm and munge with apt-get when missing and ``install`` (else raise)."""
    if not missing_commands():
        return
    if not install:
        raise LabError(f"missing {', '.join(missing_commands())}: pass --install or set {INSTALL_ENV}=1")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    argv = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if subprocess.run(argv, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=True)
        subprocess.run(argv, env=env, capture_output=True, check=True)
    if missing_commands():
        raise LabError(f"still missing after apt-get: {', '.join(missing_commands())}")


def _free_port(start: int = 6817) -> int:
    for port in range(start, start + 400):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise LabError("no free port for slurmctld")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int, comm: str) -> bool:
    """``pid`` runs ``comm`` and is not a zombie (a recycled pid does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            head, tail = fh.read().rsplit(")", 1)
    except OSError:
        return False
    return tail.split()[0] not in ("Z", "X") and head.split("(", 1)[1].startswith(comm[:15])


@dataclass
class Daemon:
    name: str  # slurmctld, slurmd-node1, munged
    comm: str
    pid: int


@dataclass
class SlurmLab:
    """``nodes`` Slurm nodes in network namespaces; :meth:`up` builds, :meth:`down` removes (verified)."""

    nodes: int = 2
    directory: str | None = None
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    partition: str = "lab"
    port: int = 0
    net_dir: str = ""
    daemons: list[Daemon] = field(default_factory=list)
    owns_dir: bool = False
    up_seconds: float = 0.0

    def __post_init__(self) -> None:
        self._popens: dict[int, subprocess.Popen[bytes]] = {}
        self.net: NetLab | None = None

    # ---------- paths ----------
    @property
    def root(self) -> Path:
        assert self.directory is not None
        return Path(self.directory)

    @property
    def slurm_conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def node_names(self) -> list[str]:
        return [f"node{k}" for k in range(1, self.nodes + 1)]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for Slurm clients: ``base`` (os.environ) without SLURM_* plus SLURM_CONF."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.slurm_conf)
        return env

    # ---------- building ----------
    def up(self, install: bool = False, timeout: float = 30.0) -> SlurmLab:
        t0 = time.monotonic()
        ensure_packages(install or install_requested())
        reason = unusable_slurm_reason()
        if reason:
            raise LabError(reason)
        self.directory, owns = lab_directory(self.directory, "msrun-slurmlab-")
        self.owns_dir = self.owns_dir or owns
        try:
            for sub in ("etc", "munge", "state", "log", "run", "spool"):
                (self.root / sub).mkdir(mode=0o755)
            self.net_dir = str(self.root / "net")
            self.net = NetLab(self.nodes, directory=self.net_dir, private_dirs=[str(self.root / "tmpfs")])
            self.net.up()
            # One port per lab: derived from its subnet (unique while the lab exists), so labs built
            # at the same time do not pick the same one; the first lab gets Slurm's 6817.
            index = (int(ipaddress.IPv4Network(self.net.network).network_address) - int(FIRST_NET.network_address)) >> 8
            self.port = _free_port(6817 + 3 * (index % 200))
            self._write_config()
            self._save()
            self._start_munge()
            self._start("slurmctld", "slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.slurm_conf)])
            for name in self.node_names:
                (self.root / "spool" / name).mkdir(mode=0o755)
                argv = [*self.net.prefix(name), "slurmd", "-D", "-N", name, "-f", str(self.slurm_conf)]
                self._start(f"slurmd-{name}", "slurmd", argv)
            self._save()
            self.wait_idle(timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.down()
            raise
        self.up_seconds = time.monotonic() - t0
        self._save()
        return self

    def _write_config(self) -> None:
        root = self.root
        ctld_host = socket.gethostname().split(".")[0]
        assert self.net is not None
        lines = [
            "# written by tests/lab/slurmlab.py",
            "ClusterName=msrunlab",
            f"SlurmctldHost={ctld_host}({self.net.host_address})",
            f"SlurmctldPort={self.port}",
            "SlurmdPort=6818",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool' / '%n'}",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
            f"PlugStackConfig={root / 'etc' / 'plugstack.conf'}",
            f"TmpFS={root / 'tmpfs'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "KillWait=2",
            "MinJobAge=2",
            "InactiveLimit=0",
            "WaitTime=0",
            "MessageTimeout=10",
            "SlurmctldTimeout=10",
            "SlurmdTimeout=10",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "GresTypes=gpu",
        ]
        for k, name in enumerate(self.node_names, start=1):
            addr = self.net.address(k)
            lines.append(
                f"NodeName={name} NodeAddr={addr} NodeHostname={name} CPUs={self.cpus} Gres=gpu:{GPUS} State=UNKNOWN"
            )
        nodes = ",".join(self.node_names)
        lines.append(f"PartitionName={self.partition} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP")
        self.slurm_conf.write_text("\n".join(lines) + "\n")
        (root / "etc" / "plugstack.conf").write_text("")
        # GPUs Slurm hands to steps: device files it only names (index from the name), no hardware
        (root / "dev").mkdir(exist_ok=True)
        for k in range(GPUS):  # character devices (gres.conf refuses anything else): /dev/null's
            os.mknod(root / "dev" / f"nvidia{k}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        (root / "etc" / "gres.conf").write_text(f"Name=gpu File={root / 'dev'}/nvidia[0-{GPUS - 1}]\n")
        (root / "etc" / "mpi.conf").write_text(f"PMIxCliTmpDirBase={root / 'tmpfs'}\n")

    def _start(self, name: str, comm: str, argv: Sequence[str]) -> Daemon:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )
        self._popens[popen.pid] = popen
        daemon = Daemon(name, comm, popen.pid)
        self.daemons.append(daemon)
        return daemon

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))
        m = self.root / "munge"
        argv = [
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--log-file={m / 'munged.log'}",
            f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}",
        ]
        daemon = self._start("munged", "munged", argv)
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            popen = self._popens[daemon.pid]
            if popen.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"munged did not start: {self._tail('munged.out')}")
            time.sleep(0.005)

    def _tail(self, name: str, size: int = 2000) -> str:
        try:
            return (self.root / "log" / name).read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def node_states(self) -> list[str]:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True, timeout=10
        )
        return proc.stdout.split() if proc.returncode == 0 else []

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until ``sinfo`` shows every node idle (no jobs left on them)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if len(states) == self.nodes and all(s == "idle" for s in states):
                return
            for d in self.daemons:
                popen = self._popens.get(d.pid)
                if popen is not None and popen.poll() is not None:
                    log = self._tail(f"{d.name}.out") or self._tail(d.name + ".log")
                    raise LabError(f"{d.name} exited {popen.returncode}: {log}")
            if time.monotonic() > deadline:
                raise LabError(f"nodes not idle after {timeout} s: {states}; {self._tail('slurmctld.log')}")
            time.sleep(0.05)

    def _save(self) -> None:
        (self.root / STATE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def attach(cls, directory: str | os.PathLike[str]) -> SlurmLab:
        """The lab whose state is in ``directory`` (started by another process, e.g. the CLI)."""
        data = json.loads((Path(directory) / STATE).read_text())
        data["daemons"] = [Daemon(**d) for d in data["daemons"]]
        lab = cls(**data)
        if lab.net_dir and (Path(lab.net_dir) / "netlab.json").exists():
            lab.net = NetLab.attach(lab.net_dir)
        return lab

    def describe(self) -> dict[str, object]:
        assert self.net is not None
        return {
            "dir": self.directory,
            "SLURM_CONF": str(self.slurm_conf),
            "controller": f"{self.net.host_address}:{self.port}",
            "partition": self.partition,
            "network": self.net.network,
            "bridge": self.net.bridge,
            "nodes": [{"name": n.name, "address": n.address, "holder": n.holder} for n in self.net.members],
            "daemons": {d.name: d.pid for d in self.daemons},
            "up_seconds": round(self.up_seconds, 3),
        }

    # ---------- removing ----------
    def stop_daemons(self, wait: float = STOP_WAIT) -> None:
        """SIGTERM every daemon (by pid), SIGKILL those still there after ``wait`` seconds."""
        live = [d for d in self.daemons if _alive(d.pid, d.comm)]
        for d in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.pid, signal.SIGTERM)
        deadline = time.monotonic() + wait
        killed = False
        while True:
            self._reap()
            live = [d for d in live if _alive(d.pid, d.comm)]
            if not live:
                return
            if time.monotonic() > deadline:
                if killed:
                    return
                for d in live:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(d.pid, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + wait
            time.sleep(0.02)

    def _reap(self) -> None:
        for pid, popen in list(self._popens.items()):
            if popen.poll() is not None:
                del self._popens[pid]

    def down(self) -> None:
        """Stop the daemons, kill what is left on the nodes, remove every file; raise LabLeak if anything remains."""
        self.stop_daemons()
        problems: list[str] = []
        if self.net is not None:
            try:
                self.net.down()
            except LabLeak as exc:
                problems.append(str(exc))
        if self.directory:
            if self.owns_dir:
                shutil.rmtree(self.directory, ignore_errors=True)
            else:
                for sub in ("etc", "munge", "state", "log", "run", "spool", "tmpfs", "net", STATE):
                    path = self.root / sub
                    if path.is_dir():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
        problems += self.leftovers()
        if problems:
            raise LabLeak("slurm lab teardown left: " + "; ".join(problems))

    def leftovers(self) -> list[str]:
        left = [f"{d.name} (pid {d.pid})" for d in self.daemons if _alive(d.pid, d.comm)]
        if self.net is not None:
            left += self.net.leftovers()
        if self.directory and self.owns_dir and os.path.exists(self.directory):
            left.append(f"directory {self.directory}")
        return left

    def __enter__(self) -> SlurmLab:
        return self.up() if not self.daemons else self

    def __exit__(self, *exc: object) -> None:
        self.down()


@contextlib.contextmanager
def slurmlab(nodes: int = 2, install: bool = False, **kw: object) -> Iterator[SlurmLab]:
    """``with slurmlab(2) as lab:`` - up on entry, down (verified) on exit."""
    lab = SlurmLab(nodes, **kw)  # type: ignore[arg-type]
    lab.up(install=install)
    try:
        yield lab
    finally:
        lab.down()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a lab and leave it running; prints JSON")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--dir", required=True, help="the lab's directory (created; removed by down if created)")
    up.add_argument("--install", action="store_true", help=f"apt-get install {' '.join(PACKAGES)} if missing")
    down = sub.add_parser("down", help="stop the lab in --dir and remove everything it created")
    down.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "up":
        if (Path(args.dir) / STATE).exists():
            parser.error(f"{args.dir} already holds a lab (down it first)")
        lab = SlurmLab(args.nodes, directory=os.path.abspath(args.dir))
        try:
            lab.up(install=args.install)
        except LabError as exc:
            print(f"slurmlab: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(lab.describe(), indent=2))
        return 0
    if not (Path(args.dir) / STATE).exists():
        print(f"slurmlab: no lab in {args.dir}", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    try:
        SlurmLab.attach(args.dir).down()
    except LabError as exc:
        print(f"slurmlab: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"down_seconds": round(time.monotonic() - t0, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
