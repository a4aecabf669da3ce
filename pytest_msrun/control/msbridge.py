"""A MindSpore scheduler behind the builtin control plane (``--scheduler=auto`` and ``mindspore``).

MindSpore workers (``mindspore.communication.init()``) talk to the address in ``MS_SCHED_HOST`` /
``MS_SCHED_PORT``, which the builtin scheduler owns. Their connections open with MindSpore's RPC
magic (``RPC``); the builtin scheduler hands each such connection to this bridge, which starts a
MindSpore scheduler process (``MS_ROLE=MS_SCHED`` + ``init()``) on a private port of the same
address and relays bytes both ways. So a job that never calls MindSpore's ``init()`` pays nothing,
a job that does is served, and the builtin control plane (ranks before start, cross-node aborts,
:mod:`pytest_msrun.control.cluster`) keeps working beside it.

The MindSpore scheduler waits for its workers without a topology timeout of its own (the workers
apply ``MS_TOPO_TIMEOUT``); it is stopped when the job ends, and if it exits with an error while the
job runs, the job is aborted with its reason.

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
MAGIC = b"RPC"  # every MindSpore RPC message starts with it
MAX_BUFFERED = 64 * 1024 * 1024


def looks_like_mindspore(first_bytes: bytes) -> bool:
    """Whether a connection's first bytes are a MindSpore RPC message (not one of our frames)."""
    return first_bytes[: len(MAGIC)] == MAGIC


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


class MindSporeBridge:
    """Owns the MindSpore scheduler process and the relayed connections to it."""

    def __init__(self, env: dict[str, str], log: Any) -> None:
        self.env = env
        self.log = log
        self.host = env.get("MS_SCHED_HOST", "127.0.0.1")
        self.python = env.get("MSRUN_TASK_PYTHON") or sys.executable
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.waiting: list[Any] = []  # client Conns whose upstream is not connected yet
        self.stopping = False
        self.started_at = 0.0

    # ---------------------------------------------------------------- the process
    def _free_port(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((self.host.split("%", 1)[0], 0))
            return int(sock.getsockname()[1])

    def start(self) -> None:
        """Start the MindSpore scheduler (once; again if a previous one finished cleanly)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.port = self._free_port()
        env = dict(self.env)
        for name in ("MSRUN_LISTEN_FD", "MSRUN_PLUGIN_ROLE"):
            env.pop(name, None)
        env.update({"MS_ROLE": "MS_SCHED", "MS_SCHED_PORT": str(self.port), "MS_TOPO_TIMEOUT": "-1"})
        if env.get("MSRUN_ORIG_PYTHONPATH") is not None:
            env["PYTHONPATH"] = env.pop("MSRUN_ORIG_PYTHONPATH")
            if not env["PYTHONPATH"]:
                del env["PYTHONPATH"]
        sys.stdout.flush()
        self.proc = subprocess.Popen(
            [self.python, "-c", MS_SCHED_STUB],
            env=env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
            preexec_fn=_pdeathsig_setter(),
        )
        self.started_at = time.monotonic()
        self.log(
            f"started the MindSpore scheduler (pid {self.proc.pid}, {self.python}) on port {self.port} "
            "for MindSpore workers; their connections are relayed"
        )

    def failure(self) -> str | None:
        """Why the MindSpore scheduler ended badly, or None (running, not started, stopped by us, or 0)."""
        if self.proc is None or self.stopping:
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
        conn.kind = "foreign"
        self.waiting.append(conn)

    def connect_waiting(self, make_conn: Any) -> None:
        """Connect the waiting clients to the MindSpore scheduler once it listens."""
        if not self.waiting or self.proc is None or self.proc.poll() is not None:
            return
        still = []
        for conn in self.waiting:
            if conn.sock.fileno() < 0:
                continue
            try:
                sock = socket.create_connection((self.host.split("%", 1)[0], self.port), timeout=0.2)
            except OSError:
                still.append(conn)
                continue
            make_conn(conn, sock)
        self.waiting = still

    @property
    def serving(self) -> bool:
        """Whether a MindSpore scheduler is running (MindSpore workers are in this job)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def busy(self) -> bool:
        """True while clients wait for the MindSpore scheduler to listen (poll faster then)."""
        return bool(self.waiting)
