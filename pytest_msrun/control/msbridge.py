"""A MindSpore scheduler behind the builtin control plane (``--scheduler=auto`` and ``mindspore``).

MindSpore workers (``mindspore.communication.init()``) talk to the address in ``MS_SCHED_HOST`` /
``MS_SCHED_PORT``, which the builtin scheduler owns. Their connections open with MindSpore's RPC
magic (``RPC``); the builtin scheduler hands each such connection to this bridge, which starts a
MindSpore scheduler process (``MS_ROLE=MS_SCHED`` + ``init()``) that only the bridge can reach -
in a private network namespace, else on loopback - and relays bytes both ways. So a job that never
calls MindSpore's ``init()`` pays nothing, a job that does is served, and the builtin control plane
(ranks before start, cross-node aborts, :mod:`pytest_msrun.control.cluster`) keeps working beside it.

The MindSpore scheduler waits for its workers without a topology timeout of its own (the workers
apply ``MS_TOPO_TIMEOUT``); it is stopped when the job ends, and if it exits with an error while the
job runs, the job is aborted with its reason.

:class:`MindSporeBridge` pairs each MindSpore-protocol client - once shown to be this job's own
process (:mod:`.foreign`: MindSpore's protocol has no authentication) - with its own connection
upstream (``kind`` ``foreign`` <-> ``upstream``).

Imported by the scheduler process only when needed; standard library only.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MS_SCHED_STUB = "import sys; from mindspore.communication import init; init(); sys.exit(0)"
MAX_BUFFERED = 64 * 1024 * 1024


def _pdeathsig_setter() -> Any:
    """A pre-exec function giving the child ``PR_SET_PDEATHSIG=SIGKILL`` (libc is loaded here, not in it)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None

    def setup() -> None:  # runs in the forked child before exec
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG

    return setup


# Run by the task's interpreter (standard library only): enter a private network namespace (as
# root, or through a user namespace), bring its loopback up, start the MindSpore scheduler there,
# then, for each request on the inherited socket (argv[1]), open a connection to it and send the
# descriptor back (SCM_RIGHTS). Nothing outside that namespace can reach the scheduler: the relay's
# connections are the only way in. Its first line says "ok <port>" or "no <why>".
PRIVATE_NET_HELPER = r"""
import ctypes, fcntl, os, select, signal, socket, struct, subprocess, sys
chan = socket.socket(fileno=int(sys.argv[1]))
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)
def say(text):
    chan.sendall((text + "\n").encode())
uid, gid = os.getuid(), os.getgid()
flags = 0x40000000 if os.geteuid() == 0 else 0x40000000 | 0x10000000
if libc.unshare(flags) != 0:
    say("no unshare: " + os.strerror(ctypes.get_errno()))
    sys.exit(3)
try:
    if flags & 0x10000000:
        for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
            with open("/proc/self/" + name, "w") as fh:
                fh.write(text)
    with socket.socket() as s:
        ifr = fcntl.ioctl(s, 0x8913, struct.pack("16sh14x", b"lo", 0))
        fcntl.ioctl(s, 0x8914, struct.pack("16sh14x", b"lo", struct.unpack("16sh14x", ifr)[1] | 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
except OSError as exc:
    say("no private loopback: %s" % exc)
    sys.exit(3)
env = dict(os.environ, MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port))
stub = subprocess.Popen([sys.executable, "-c", sys.argv[2]], env=env, stdin=subprocess.DEVNULL,
                        preexec_fn=lambda: libc.prctl(1, int(signal.SIGKILL), 0, 0, 0))
signal.signal(signal.SIGTERM, lambda *a: stub.terminate())
say("ok %d" % port)
poller = select.poll()
poller.register(chan, select.POLLIN)
while stub.poll() is None:
    try:
        ready = poller.poll(100)
    except InterruptedError:
        continue
    if not ready:
        continue
    if not chan.recv(1):
        stub.terminate()
        break
    try:
        up = socket.create_connection(("127.0.0.1", port), timeout=1)
    except OSError:
        chan.sendall(b"e")
        continue
    socket.send_fds(chan, [b"k"], [up.fileno()])
    up.close()
sys.exit(stub.wait())
"""


class MindSporeBridge:
    """Owns the MindSpore scheduler process and the relayed connections to it.

    Where a private network namespace can be made (root, or unprivileged user namespaces), the
    MindSpore scheduler runs in one: unreachable except through this relay, whose connections
    are opened inside it and handed over. Elsewhere it listens on loopback only (so no other host
    can reach it, but other local users could - said in ``scheduler.log``)."""

    def __init__(self, transport: Any, env: dict[str, str], log: Any) -> None:
        self.transport = transport
        self.env = env
        self.log = log
        self.host = "127.0.0.1"  # where the MindSpore scheduler listens when it has no namespace
        self.python = env.get("MSRUN_TASK_PYTHON") or sys.executable
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.waiting: list[Any] = []  # client Conns whose upstream is not connected yet
        self.stopping = False
        self.started_at = 0.0
        self.chan: socket.socket | None = None  # to the private network's helper
        self.private = ""  # "" starting, "yes" in its own namespace, "no" on loopback
        self.asked = 0  # connections asked of the helper and not answered yet
        self.status = b""

    # ---------------------------------------------------------------- the process
    def _env(self) -> dict[str, str]:
        env = dict(self.env)
        for name in ("MSRUN_LISTEN_FD", "MSRUN_PLUGIN_ROLE"):
            env.pop(name, None)
        env.update({"MS_ROLE": "MS_SCHED", "MS_TOPO_TIMEOUT": "-1"})
        if env.get("MSRUN_ORIG_PYTHONPATH") is not None:
            env["PYTHONPATH"] = env.pop("MSRUN_ORIG_PYTHONPATH")
            if not env["PYTHONPATH"]:
                del env["PYTHONPATH"]
        return env

    def _spawn(self, args: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        """Run ``self.python -c args`` (killed when this process dies)."""
        return subprocess.Popen(
            [self.python, "-c", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=pass_fds,
            preexec_fn=_pdeathsig_setter(),
        )

    def start(self) -> None:
        """Start the MindSpore scheduler (once; again if a previous one finished cleanly), in a
        private network namespace where one can be made."""
        if self.serving:
            return
        sys.stdout.flush()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = self._spawn(
                [PRIVATE_NET_HELPER, str(theirs.fileno()), MS_SCHED_STUB], self._env(), (theirs.fileno(),)
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        self.chan, self.private, self.status, self.asked = ours, "", b"", 0
        self.started_at = time.monotonic()

    def _on_loopback(self, why: str) -> None:
        """No private namespace here: the MindSpore scheduler listens on loopback."""
        if self.chan is not None:
            self.chan.close()
            self.chan = None
        if self.proc is not None:
            self.proc.wait()
        with socket.socket() as sock:
            sock.bind((self.host, 0))
            self.port = int(sock.getsockname()[1])
        self.proc = self._spawn(
            [MS_SCHED_STUB], {**self._env(), "MS_SCHED_HOST": self.host, "MS_SCHED_PORT": str(self.port)}
        )
        self.private = "no"
        self.log(
            f"started the MindSpore scheduler (pid {self.proc.pid}, {self.python}) on {self.host}:{self.port} for "
            f"MindSpore workers, whose connections are relayed; no private network namespace here ({why}): "
            "other local users could reach that port"
        )

    def _settle(self) -> None:
        """Read the helper's first line: the scheduler runs privately, or falls back to loopback."""
        if self.private or self.chan is None:
            return
        try:
            data = self.chan.recv(256)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self.status += data
        if b"\n" not in self.status and data:
            return
        line = self.status.split(b"\n", 1)[0].decode(errors="replace")
        if line.startswith("ok "):
            self.private, self.port = "yes", int(line.split()[1])
            self.log(
                f"started the MindSpore scheduler (pid {self.proc.pid if self.proc else '?'}, {self.python}) in a "
                "private network namespace for MindSpore workers: only their relayed connections reach it"
            )
        else:
            self._on_loopback(line[3:] if line.startswith("no ") else "its helper ended")

    def failure(self) -> str | None:
        """Why the MindSpore scheduler ended badly, or None (running, not started, stopped by us, or 0)."""
        if self.proc is None or self.stopping or not self.private:
            return None
        code = self.proc.poll()
        if code is None or code == 0:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        hint = ""
        if time.monotonic() - self.started_at < 30 and code == 1:
            hint = f" (can {self.python} import mindspore?)"
        return f"the MindSpore scheduler {how}{hint}; its output is in scheduler.log"

    def stop(self) -> None:
        self.stopping = True
        proc = self.proc
        if self.chan is not None:
            self.chan.close()
            self.chan = None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # ---------------------------------------------------------------- relaying
    def adopt(self, conn: Any) -> None:
        """Relay ``conn`` (a MindSpore client whose first bytes are in ``conn.pending``)."""
        self.start()
        self.waiting.append(conn)
        self.connect_waiting()

    def connect_waiting(self) -> None:
        """Connect the waiting clients to the MindSpore scheduler once it listens."""
        self._settle()
        if not self.waiting or not self.serving or not self.private:
            return
        self.waiting = [c for c in self.waiting if c.sock.fileno() >= 0]
        if self.private == "yes":
            self._connect_private()
            return
        still = []
        for conn in self.waiting:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=0.2)
            except OSError:
                still.append(conn)
                continue
            self._pair(conn, sock)
        self.waiting = still

    def _connect_private(self) -> None:
        """Ask the helper for a connection per waiting client; pair the answers in order."""
        assert self.chan is not None
        try:
            while self.asked < len(self.waiting):
                self.chan.send(b"c")
                self.asked += 1
            while self.asked:
                msg, fds, _flags, _addr = socket.recv_fds(self.chan, 1, 1)
                if not msg:
                    return
                self.asked -= 1
                conn = self.waiting.pop(0)
                if fds:
                    self._pair(conn, socket.socket(fileno=fds[0]))
                else:
                    self.waiting.append(conn)  # it does not listen yet: ask again
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.log(f"the MindSpore scheduler's helper went away: {exc}")

    @property
    def serving(self) -> bool:
        """Whether a MindSpore scheduler is running (MindSpore workers are in this job)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def busy(self) -> bool:
        """True while clients wait for the MindSpore scheduler to listen (poll faster then)."""
        return bool(self.waiting) or (self.proc is not None and not self.private)

    def _pair(self, client: Any, sock: socket.socket) -> None:
        up = self.transport.adopt(sock, "MindSpore scheduler", "upstream")
        up.pair, client.pair = client, up
        up.out += client.pending
        client.pending = bytearray()
        self.transport.flush(up)

    def relay(self, conn: Any, data: bytes) -> None:
        other = conn.pair
        target = other.out if other is not None else conn.pending
        target += data
        if len(target) > MAX_BUFFERED:
            self.transport.drop(conn, "relayed MindSpore traffic backed up")
            return
        if other is not None:
            self.transport.flush(other)

    def unpair(self, conn: Any) -> None:
        other, conn.pair = conn.pair, None
        if conn in self.waiting:
            self.waiting.remove(conn)
        if other is not None:
            other.pair = None
            other.closing = True  # send what it still has, then close
            self.transport.flush(other)
