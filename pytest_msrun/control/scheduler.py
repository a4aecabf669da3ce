"""The builtin control plane: ``python -m pytest_msrun.control.scheduler`` (``MS_ROLE=MS_SCHED``).

One single-threaded event loop serves two kinds of authenticated clients:

* **agents** (one per ``msrun`` invocation) register *before* spawning; once ``MS_WORKER_NUM``
  ranks are registered every agent gets its rank offset, so each worker starts with its final
  ``RANK_ID``. Agents heartbeat and report failures, which are broadcast so every node tears
  down at once.
* **ranks** (``pytest_msrun.control.cluster.init()`` in a worker) join, then run collectives
  (barrier, all-gather, broadcast) relayed here as opaque bytes; a rank that leaves, fails, or
  whose process exits (agents report every worker exit) turns every blocked ``init()`` or
  collective into an error instead of a hang.
* **observers** (the pytest controller on a timeout) read the control plane's state: who joined,
  who entered which collective, who left.

A connection that opens with MindSpore's RPC magic is a MindSpore worker calling
``mindspore.communication.init()``: with ``--scheduler=auto`` or ``mindspore`` it is relayed to a
MindSpore scheduler this process starts (:mod:`pytest_msrun.control.msbridge`); with ``builtin`` the job
fails at once, naming the flag that fixes it. Any other client that sends garbage, an oversized
frame, a wrong token, or nothing at all is dropped; the job goes on. Exit status: 0 when every
agent reported success, 1 otherwise.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import time

from pytest_msrun.control import wire

# This module is the scheduler process's whole start-up: it imports no typing, dataclasses,
# contextlib or hashlib, so the control plane is up while the workers are still starting.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from typing_extensions import TypeGuard

AUTH_TIMEOUT = float(os.environ.get("MSRUN_AUTH_TIMEOUT", "5"))
TIMER_INTERVAL = 0.05  # how often deadlines are checked (seconds)
PENDING_FLOOR = 256  # unauthenticated connections kept at most: max(this, 2 x worker_num)
ACCEPT_PAUSE = 0.1  # out of file descriptors with nothing to shed: stop accepting this long
COLLECTIVE_OPS = ("barrier", "gather", "bcast")
MINDSPORE_MAGIC = b"RPC"  # the first bytes of every MindSpore RPC message (see msbridge)
CLIENT_KINDS = ("agent", "rank", "observer")  # authenticated clients of our own protocol


def log(msg: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stdout.write(f"[msrun scheduler {stamp}] {msg}\n")
    sys.stdout.flush()


class Conn:
    """One client connection and its buffers."""

    __slots__ = (
        "sock",
        "peer",
        "frames",
        "out",
        "kind",
        "opened",
        "last_seen",
        "closing",
        "head",
        "pair",
        "pending",
        "hello",
        "nonce",
        "broken",
        "draining",
        "writing",
    )

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.frames = wire.FrameBuffer()
        self.out = bytearray()
        # "" until authenticated, then "agent", "rank" or "observer"; relayed MindSpore
        # connections are "foreign" (the client) and "upstream" (to the MindSpore scheduler).
        self.kind = ""
        self.opened = self.last_seen = time.monotonic()
        self.closing = False
        self.head: bytes | None = b""  # first bytes until we know whose protocol this is, then None
        self.pair: Conn | None = None  # the other end of a relayed connection
        self.pending = bytearray()  # relayed bytes waiting for the other end to connect
        self.hello: dict[str, Any] | None = None  # the hello, until the client proved the token
        self.nonce = ""  # our challenge to it
        self.broken = False  # a send failed: it is dropped once what it already sent was handled
        self.draining = 0.0  # when closing: until then, read and discard (so the close is no RST)
        self.writing = False  # registered for EVENT_WRITE (output is waiting)


class AgentInfo:
    """A registered node agent."""

    __slots__ = (
        "conn",
        "node_rank",
        "local",
        "host",
        "ip",
        "pid",
        "hosts_scheduler",
        "seq",
        "offset",
        "done",
        "peer_ip",
    )

    def __init__(
        self, conn: Conn, node_rank: int, local: int, host: str, ip: str, pid: int, hosts_scheduler: bool, seq: int
    ) -> None:
        self.conn = conn
        self.node_rank = node_rank
        self.local = local
        self.host = host
        self.ip = ip
        self.pid = pid
        self.hosts_scheduler = hosts_scheduler
        self.seq = seq
        self.offset = -1
        self.done = False
        try:
            self.peer_ip = str(conn.sock.getpeername()[0])
        except OSError:
            self.peer_ip = ""

    def describe(self) -> str:
        nr = f"node_rank {self.node_rank}, " if self.node_rank >= 0 else ""
        return f"{self.host} ({self.ip}, {nr}pid {self.pid}): {self.local} worker(s)"

    def sort_key(self) -> tuple:
        import ipaddress

        try:
            addr = ipaddress.ip_address(self.ip.split("%", 1)[0])
            ip_key: tuple = (addr.version, int(addr))
        except ValueError:
            ip_key = (9, 0)
        explicit = self.node_rank if self.node_rank >= 0 else sys.maxsize
        return (explicit, not self.hosts_scheduler, ip_key, self.host, self.seq)


class Collective:
    """Contributions to one collective operation, by rank."""

    __slots__ = ("op", "src", "parts")

    def __init__(self, op: str, src: int) -> None:
        self.op = op
        self.src = src
        self.parts: dict[int, Any] = {}


def _is_int(value: Any, low: int, high: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


class Scheduler:
    """The control-plane state machine and its event loop."""

    def __init__(
        self,
        listener: socket.socket,
        *,
        worker_num: int,
        token: str,
        topo_timeout: float,
        node_timeout: float,
        job_id: str = "",
        mode: str = "builtin",
        env: dict[str, str] | None = None,
    ) -> None:
        self.listener = listener
        self.job_id = job_id
        self.mode = mode  # builtin | auto | mindspore: whether MindSpore clients are served
        self.env = env if env is not None else dict(os.environ)
        self.bridge: Any = None  # msbridge.MindSporeBridge, created when first needed
        self.worker_num = worker_num
        self.token = token
        self.topo_timeout = topo_timeout
        self.node_timeout = node_timeout
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, Conn] = {}
        self.agents: list[AgentInfo] = []
        self.agent_by_conn: dict[int, AgentInfo] = {}
        self.state = "registering"
        self.next_timers = 0.0
        self.started = time.monotonic()
        self.seq = 0
        self.ranks: dict[int, Conn] = {}
        self.rank_of_conn: dict[int, int] = {}
        self.rank_gone: dict[int, str] = {}
        self.joined: set[int] = set()  # every rank that ever joined the group
        self.exit_how: dict[int, str] = {}  # rank -> how its process ended (reported by its agent)
        self.rank_last: dict[int, str] = {}  # rank -> the last collective it entered ("barrier #3")
        self.ready_sent = False
        self.collectives: dict[int, Collective] = {}
        self.exit_code: int | None = None
        self.abort_msg: dict[str, Any] | None = None
        self.limit = wire.message_limit()
        self.terminated_by: int | None = None
        # Connections that have not authenticated yet, oldest first: at most max_pending of them
        # (a flood sheds the oldest), each holding at most one pre-auth frame, for AUTH_TIMEOUT.
        self.pending: dict[Conn, None] = {}
        self.max_pending = max(PENDING_FLOOR, 2 * worker_num)
        self.accept_paused_until = 0.0
        self.shed = 0

    # ---------- plumbing ----------
    def send(self, conn: Conn, msg: dict[str, Any] | bytes) -> None:
        """Queue ``msg`` (or an already encoded frame) for ``conn`` and send what the socket takes."""
        if conn.sock.fileno() < 0 or conn.broken:
            return
        conn.out += msg if isinstance(msg, bytes) else wire.encode(msg)
        self._flush(conn)

    def broadcast(self, conns: Iterable[Conn], msg: dict[str, Any]) -> None:
        """The same message to many: encoded once (an all-gather reply to N ranks is O(N), not O(N^2))."""
        frame = wire.encode(msg)
        for conn in conns:
            self.send(conn, frame)

    def _flush(self, conn: Conn) -> None:
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            # The peer is gone or going; the messages it sent before are still to be handled (a
            # node's "done" may follow the heartbeat whose reply failed), so its end is decided
            # by the read side.
            conn.out.clear()
            conn.broken = True
        if conn.writing != bool(conn.out):  # a system call only when the interest changes
            conn.writing = bool(conn.out)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
            try:
                self.sel.modify(conn.sock, events, conn)
            except (KeyError, ValueError):
                pass
        if conn.closing and not conn.out and not conn.draining:
            # A lingering close: our FIN now, then discard what the peer still sends until it
            # closes too - closing with unread data would send an RST that can destroy the
            # message just sent (a refusal, say) before the peer reads it.
            conn.draining = time.monotonic() + 2.0
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._close(conn)

    def _close(self, conn: Conn) -> None:
        self.pending.pop(conn, None)
        fd = conn.sock.fileno()
        if fd < 0:
            return
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self.conns.pop(fd, None)
        conn.sock.close()

    def drop(self, conn: Conn, why: str, quiet: bool = False) -> None:
        """Forget a client (after its pending output, if any, was sent)."""
        fd = conn.sock.fileno()
        self.pending.pop(conn, None)
        if fd < 0:
            return
        if conn.kind == "" and not quiet:
            log(f"dropped client {conn.peer}: {why}")
        if conn.kind in ("foreign", "upstream"):
            self._unpair(conn)
        agent = self.agent_by_conn.pop(fd, None)
        rank = self.rank_of_conn.pop(fd, None)
        self._close(conn)
        if agent is not None:
            self.agent_lost(agent, why)
        if rank is not None:
            self.rank_left(rank, why)

    def refuse(self, conn: Conn, reason: str) -> None:
        log(f"refused {conn.peer}: {reason}")
        conn.out += wire.encode({"t": "refused", "reason": reason})
        conn.closing = True
        self._flush(conn)

    # ---------- agents ----------
    def registered(self) -> int:
        return sum(a.local for a in self.agents)

    def summary(self) -> str:
        return "; ".join(a.describe() for a in self.agents) or "none"

    def on_agent_hello(self, conn: Conn, msg: dict[str, Any]) -> None:
        node_rank, local = msg.get("node_rank"), msg.get("local")
        host, ip, pid = msg.get("host"), msg.get("ip"), msg.get("pid")
        hosts_sched = msg.get("hosts_scheduler")
        if not (
            _is_int(node_rank, -1, 1 << 20)
            and _is_int(local, 1, 1 << 20)
            and isinstance(host, str)
            and isinstance(ip, str)
            and _is_int(pid, 0, 1 << 31)
            and isinstance(hosts_sched, bool)
        ):
            self.drop(conn, "malformed agent registration")
            return
        if self.state != "registering":
            self.refuse(
                conn,
                f"extra node: the job already has all {self.worker_num} ranks (--worker_num={self.worker_num}) "
                f"from {self.summary()}",
            )
            return
        have = self.registered()
        if have + local > self.worker_num:
            self.refuse(
                conn,
                f"extra node: this node's {local} worker(s) would exceed --worker_num={self.worker_num}; "
                f"{have} rank(s) are already registered from {self.summary()}",
            )
            return
        if node_rank >= 0:
            for other in self.agents:
                if other.node_rank == node_rank:
                    self.refuse(conn, f"--node_rank={node_rank} is already taken by {other.describe()}")
                    return
        self.seq += 1
        agent = AgentInfo(conn, node_rank, local, host[:256], ip[:64], pid, hosts_sched, self.seq)
        conn.kind = "agent"
        self.pending.pop(conn, None)
        conn.frames.limit = self.limit
        self.agents.append(agent)
        self.agent_by_conn[conn.sock.fileno()] = agent
        log(f"agent registered: {agent.describe()} ({self.registered()}/{self.worker_num} ranks)")
        if self.registered() == self.worker_num:
            self.assign()

    def assign(self) -> None:
        self.state = "running"
        ordered = sorted(self.agents, key=AgentInfo.sort_key)
        offset = 0
        nodes = []
        for agent in ordered:
            agent.offset = offset
            nodes.append({"host": agent.host, "ip": agent.ip, "local": agent.local, "offset": offset})
            offset += agent.local
        for index, agent in enumerate(ordered):
            log(f"node {index}: {agent.describe()} -> ranks {agent.offset}..{agent.offset + agent.local - 1}")
            self.send(
                agent.conn,
                {
                    "t": "assign",
                    "offset": agent.offset,
                    "node_index": index,
                    "node_count": len(ordered),
                    "nodes": nodes,
                    "job_id": self.job_id,
                },
            )

    def on_agent_msg(self, agent: AgentInfo, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "hb":
            self.send(agent.conn, {"t": "hb"})
            return
        if kind == "done":
            agent.done = True
            log(f"agent done: {agent.describe()}")
            self.send(agent.conn, {"t": "done_ack"})  # it may close now: it will not count as lost
            if self.state == "running" and all(a.done for a in self.agents):
                self.finish(0)
            return
        if kind == "exit":
            rank, how = msg.get("rank"), msg.get("how")
            if _is_int(rank, 0, self.worker_num - 1) and isinstance(how, str):
                self.rank_exited(rank, how[:200])
            return
        if kind == "failed":
            reason = msg.get("reason")
            if not isinstance(reason, str):
                reason = "a process failed"
            code = msg.get("code")
            self.abort(f"{reason[:4096]} (on {agent.host})", code if _is_int(code, 0, 255) else None)
            return
        self.drop(agent.conn, f"unexpected agent message {kind!r}")

    def agent_lost(self, agent: AgentInfo, why: str) -> None:
        if agent in self.agents and self.state == "registering":
            self.agents.remove(agent)
            log(f"agent left before the job started: {agent.describe()} ({why})")
            return
        if self.state == "running" and not agent.done:
            self.abort(f"lost node {agent.describe()}: {why}", None)

    def abort(self, reason: str, code: int | None) -> None:
        if self.state == "ended":
            return
        log(f"aborting the job: {reason}")
        self.abort_msg = {"t": "abort", "reason": reason, "code": code}
        self.broadcast([c for c in self.conns.values() if c.kind in CLIENT_KINDS], self.abort_msg)
        self.finish(1)

    def finish(self, code: int) -> None:
        if self.state != "ended":
            self.state = "ended"
            self.exit_code = code
            if code == 0:
                log("every node reported success")
                self.broadcast([a.conn for a in self.agents], {"t": "end", "code": 0})

    # ---------- ranks ----------
    def on_rank_hello(self, conn: Conn, msg: dict[str, Any]) -> None:
        rank, world = msg.get("rank"), msg.get("world")
        if not (_is_int(rank, 0, self.worker_num - 1) and world == self.worker_num):
            self.refuse(conn, f"rank {rank!r} / world {world!r} do not fit this job of {self.worker_num} ranks")
            return
        if rank in self.ranks:
            self.refuse(conn, f"rank {rank} already joined")
            return
        if self.abort_msg is not None:
            self.send(conn, self.abort_msg)
            return
        never = self.never_joined_gone()
        if never and not self.ready_sent:
            self.send(conn, {"t": "error", "seq": -1, "reason": never})
            return
        conn.kind = "rank"
        self.pending.pop(conn, None)
        self.joined.add(rank)
        conn.frames.limit = self.limit
        self.ranks[rank] = conn
        self.rank_of_conn[conn.sock.fileno()] = rank
        self.rank_gone.pop(rank, None)
        if self.ready_sent:
            self.send(conn, {"t": "ready", "world": self.worker_num})
        elif len(self.ranks) == self.worker_num:
            self.ready_sent = True
            log(f"all {self.worker_num} ranks joined the communication group")
            self.broadcast(self.ranks.values(), {"t": "ready", "world": self.worker_num})

    def rank_error(self, reason: str, seqs: list[int] | None = None) -> None:
        for seq in list(self.collectives) if seqs is None else seqs:
            coll = self.collectives.pop(seq, None)
            if coll is None:
                continue
            peers = [p for p in (self.ranks.get(r) for r in coll.parts) if p is not None]
            self.broadcast(peers, {"t": "error", "seq": seq, "reason": reason})

    def never_joined_gone(self) -> str:
        """Why the group can never form (a rank's process ended before it joined), or ""."""
        gone = sorted(r for r in self.rank_gone if r not in self.joined)
        return "; ".join(f"rank {r} {self.rank_gone[r]}" for r in gone)

    def rank_exited(self, rank: int, how: str) -> None:
        """A worker's process ended (its agent saw it): nobody may wait for it any more."""
        self.exit_how[rank] = how
        if rank in self.ranks or rank in self.rank_gone:
            return  # joined and connected: its connection closes too; or it already left
        why = f"exited without joining the group: its process {how}"
        self.rank_gone[rank] = why
        if not self.ready_sent:
            self.broadcast(self.ranks.values(), {"t": "error", "seq": -1, "reason": f"rank {rank} {why}"})
        if self.collectives:
            self.rank_error(f"rank {rank} left the job ({why})")

    def rank_left(self, rank: int, why: str) -> None:
        self.ranks.pop(rank, None)
        if rank in self.exit_how:
            why = f"its process {self.exit_how[rank]}"
        self.rank_gone[rank] = why
        if not self.ready_sent:
            reason = f"rank {rank} left before the group formed ({why})"
            self.broadcast(self.ranks.values(), {"t": "error", "seq": -1, "reason": reason})
        if self.collectives:
            self.rank_error(f"rank {rank} left the job ({why})")

    def ranks_finished(self, ranks: Any, why: Any) -> None:
        """An observer (a warm world's controller) says these ranks finished their test while still
        connected: whoever waits for them - to form the group, or in a collective - gets an error now,
        worded as if they had exited (a fresh job's ranks exit when their test ends)."""
        if not isinstance(ranks, list) or not all(_is_int(r, 0, self.worker_num - 1) for r in ranks):
            return
        text = (why if isinstance(why, str) and why else "finished its test")[:200]
        for rank in sorted(set(ranks)):
            if not self.ready_sent and rank not in self.ranks:
                reason = f"rank {rank} {text} without joining the group"
                self.broadcast(self.ranks.values(), {"t": "error", "seq": -1, "reason": reason})
            waiting = [seq for seq, coll in self.collectives.items() if rank not in coll.parts]
            if waiting:
                self.rank_error(f"rank {rank} left the test ({text})", waiting)

    def on_rank_msg(self, conn: Conn, rank: int, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "bye":
            self.rank_of_conn.pop(conn.sock.fileno(), None)
            self.ranks.pop(rank, None)
            self.rank_gone[rank] = "it called finalize()"
            if self.collectives:
                self.rank_error(f"rank {rank} called finalize() while others wait in a collective")
            self._close(conn)
            return
        if kind != "coll":
            self.drop(conn, f"unexpected rank message {kind!r}")
            return
        op, seq, src = msg.get("op"), msg.get("seq"), msg.get("src", 0)
        data = msg.get("data")
        if op not in COLLECTIVE_OPS or not _is_int(seq, 0, 1 << 62) or not _is_int(src, 0, self.worker_num - 1):
            self.drop(conn, "malformed collective")
            return
        if data is not None and not isinstance(data, str):
            self.drop(conn, "malformed collective data")
            return
        coll = self.collectives.setdefault(seq, Collective(op, src))
        if coll.op != op or coll.src != src:
            first = coll.op if coll.op != "bcast" else f"bcast(src={coll.src})"
            this = op if op != "bcast" else f"bcast(src={src})"
            coll.parts[rank] = None
            self.rank_error(
                f"collective #{seq} mismatch: rank {rank} called {this}, another rank called {first}", [seq]
            )
            return
        coll.parts[rank] = data
        self.rank_last[rank] = f"{op} #{seq}"
        if self.rank_gone:
            # Worded as when the rank leaves during a collective, whichever happens first.
            gone = ", ".join(f"rank {r} left the job ({why})" for r, why in sorted(self.rank_gone.items()))
            self.rank_error(f"{op} #{seq} cannot complete: {gone}", [seq])
            return
        if len(coll.parts) < self.worker_num:
            return
        del self.collectives[seq]
        if op == "barrier":
            reply: dict[str, Any] = {"t": "coll", "seq": seq}
        elif op == "gather":
            reply = {"t": "coll", "seq": seq, "data": [coll.parts[r] for r in range(self.worker_num)]}
        else:
            reply = {"t": "coll", "seq": seq, "data": coll.parts.get(src)}
        self.broadcast([p for p in (self.ranks.get(r) for r in range(self.worker_num)) if p is not None], reply)

    # ---------- observers ----------
    def snapshot(self) -> dict[str, Any]:
        """What the control plane knows about the ranks: joined, in which collective, gone."""
        return {
            "t": "state",
            "world": self.worker_num,
            "ready": self.ready_sent,
            "joined": sorted(self.joined),
            "connected": sorted(self.ranks),
            "gone": {str(r): why for r, why in sorted(self.rank_gone.items())},
            "exited": {str(r): how for r, how in sorted(self.exit_how.items())},
            "last": {str(r): what for r, what in sorted(self.rank_last.items())},
            "collectives": [
                {"seq": seq, "op": c.op, "src": c.src, "ranks": sorted(c.parts)}
                for seq, c in sorted(self.collectives.items())
            ],
        }

    # ---------- MindSpore clients ----------
    def foreign_refusal(self, conn: Conn) -> str:
        """Why a MindSpore-looking client is not one of this job's processes ("" if it may be).

        MindSpore's protocol has no authentication, so it is taken only from this user's processes
        on this host or from a node of this job; anyone else could otherwise abort a builtin job
        or talk to the MindSpore scheduler.
        """
        from pytest_msrun.netaddr import is_local_address, local_peer_uid

        try:
            peer_ip = conn.sock.getpeername()[0]
        except OSError:
            return "it is gone"
        if is_local_address(peer_ip.split("%", 1)[0]):
            uid = local_peer_uid(conn.sock)
            if uid is None:
                return "its owner cannot be told"
            return "" if uid == os.getuid() else f"it belongs to another user (uid {uid})"
        if peer_ip in {a.peer_ip for a in self.agents}:
            return ""
        return f"{peer_ip} is not one of this job's nodes"

    def on_foreign(self, conn: Conn) -> None:
        """A MindSpore worker connected: relay it to a MindSpore scheduler, or fail the job at once."""
        refusal = self.foreign_refusal(conn)
        if refusal:
            self.drop(conn, f"MindSpore-protocol client not of this job: {refusal}")
            return
        if self.mode not in ("auto", "mindspore"):
            reason = (
                f"a MindSpore process ({conn.peer}) called mindspore.communication.init() against the builtin "
                "scheduler, which cannot serve it; run msrun with --scheduler=mindspore "
                "(or --scheduler=auto, the default, which starts a MindSpore scheduler when one is needed)"
            )
            self.drop(conn, "MindSpore client refused")
            self.abort(reason, None)
            return
        conn.pending += conn.head or b""
        conn.head = None
        self.pending.pop(conn, None)
        self._bridge().adopt(conn)
        self.bridge.connect_waiting(self._pair)

    def _bridge(self) -> Any:
        if self.bridge is None:
            from pytest_msrun.control.msbridge import MindSporeBridge

            self.bridge = MindSporeBridge(self.env, log)
        return self.bridge

    def _pair(self, client: Conn, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        up = Conn(sock, "MindSpore scheduler")
        up.kind, up.head = "upstream", None
        up.pair, client.pair = client, up
        self.conns[sock.fileno()] = up
        self.sel.register(sock, selectors.EVENT_READ, up)
        up.out += client.pending
        client.pending = bytearray()
        self._flush(up)

    def relay(self, conn: Conn, data: bytes) -> None:
        other = conn.pair
        target = other.out if other is not None else conn.pending
        target += data
        if len(target) > 64 * 1024 * 1024:
            self.drop(conn, "relayed MindSpore traffic backed up")
            return
        if other is not None:
            self._flush(other)

    def _unpair(self, conn: Conn) -> None:
        other, conn.pair = conn.pair, None
        if self.bridge is not None and conn in self.bridge.waiting:
            self.bridge.waiting.remove(conn)
        if other is not None:
            other.pair = None
            other.closing = True  # send what it still has, then close
            self._flush(other)

    # ---------- authentication ----------
    def on_unauthenticated(self, conn: Conn, msg: dict[str, Any]) -> None:
        """hello -> challenge -> auth (see wire): only then is the hello acted upon."""
        if conn.hello is None:
            nonce = msg.get("nonce")
            if msg["t"] != "hello" or msg.get("kind") not in CLIENT_KINDS or not isinstance(nonce, str):
                self.drop(conn, "first message is not a hello")
                return
            conn.hello = msg
            if not self.token:  # an unauthenticated job (msrun warned loudly when it started)
                self.on_hello(conn, msg)
                return
            conn.nonce = wire.new_nonce()
            self.send(
                conn,
                {
                    "t": "challenge",
                    "nonce": conn.nonce,
                    "proof": wire.proof(self.token, "scheduler", nonce[:64], conn.nonce),
                },
            )
            return
        hello = conn.hello
        expected = wire.proof(self.token, str(hello.get("kind")), str(hello.get("nonce"))[:64], conn.nonce)
        if msg["t"] != "auth" or not wire.token_ok(msg.get("proof"), expected):
            self.refuse(conn, "bad job token (this client's MSRUN_JOB_TOKEN or secret differs from this job's)")
            return
        self.on_hello(conn, hello)

    def on_hello(self, conn: Conn, msg: dict[str, Any]) -> None:
        if msg["kind"] == "agent":
            self.on_agent_hello(conn, msg)
        elif msg["kind"] == "rank":
            self.on_rank_hello(conn, msg)
        else:
            conn.kind = "observer"
            self.pending.pop(conn, None)

    # ---------- dispatch ----------
    def on_message(self, conn: Conn, msg: dict[str, Any]) -> None:
        conn.last_seen = time.monotonic()
        fd = conn.sock.fileno()
        if conn.kind == "":
            self.on_unauthenticated(conn, msg)
            return
        if conn.kind == "observer":
            if msg["t"] == "state":
                self.send(conn, self.snapshot())
            elif msg["t"] == "finished":
                self.ranks_finished(msg.get("ranks"), msg.get("why"))
                self.send(conn, self.snapshot())
            else:
                self.drop(conn, f"unexpected observer message {msg['t']!r}")
            return
        if conn.kind == "agent":
            agent = self.agent_by_conn.get(fd)
            if agent is not None:
                self.on_agent_msg(agent, msg)
            return
        rank = self.rank_of_conn.get(fd)
        if rank is not None:
            self.on_rank_msg(conn, rank, msg)

    def on_readable(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(1 << 20 if conn.kind else wire.HELLO_LIMIT + wire.HEADER.size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if conn.draining:
                self._close(conn)
            else:
                self.drop(conn, f"connection error: {exc}")
            return
        if conn.draining:
            if not data:
                self._close(conn)
            return
        if not data:
            self.drop(conn, "connection closed")
            return
        if conn.kind in ("foreign", "upstream"):
            self.relay(conn, data)
            return
        if conn.head is not None:  # whose protocol is this? (MindSpore's, or ours)
            conn.head += data
            if conn.head.startswith(MINDSPORE_MAGIC):
                self.on_foreign(conn)
                return
            if MINDSPORE_MAGIC.startswith(conn.head):
                return  # too short to tell yet
            data, conn.head = conn.head, None
        try:
            msgs = conn.frames.feed(data)
        except wire.ProtocolError as exc:
            self.drop(conn, str(exc))
            return
        for msg in msgs:
            if conn.sock.fileno() < 0 or conn.closing:
                break
            try:
                self.on_message(conn, msg)
            except Exception as exc:  # a message we failed to handle costs its sender, not the job
                log(f"error handling a {msg.get('t')!r} message from {conn.peer}: {exc!r}")
                self.drop(conn, "message could not be handled")
        if conn.broken:  # everything it sent was handled; now it is gone
            self.drop(conn, "connection closed")

    def accept(self) -> None:
        import errno

        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self.shed_pending("out of file descriptors"):
                        continue  # one freed: take the waiting connection
                    self.pause_accepting()  # never spin on a listener we cannot serve
                return
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if len(self.pending) >= self.max_pending:
                self.shed_pending(f"more than {self.max_pending} unauthenticated connections")
            conn = Conn(sock, f"{addr[0]}:{addr[1]}")
            self.conns[sock.fileno()] = conn
            self.pending[conn] = None
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def shed_pending(self, why: str) -> bool:
        """Drop the oldest unauthenticated connection that has not even sent a whole hello (ours
        send one at once), else the oldest one waiting to answer our challenge; False if none."""
        victim = next((c for c in self.pending if c.hello is None), None) or next(iter(self.pending), None)
        for conn in [victim] if victim is not None else []:
            self.shed += 1
            if self.shed in (1, 10, 100, 1000, 10000) or self.shed % 100000 == 0:
                log(f"shedding unauthenticated connections ({why}): {self.shed} so far")
            self.drop(conn, why, quiet=True)
            return True
        return False

    def pause_accepting(self) -> None:
        try:
            self.sel.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE

    def resume_accepting(self) -> None:
        if self.accept_paused_until and time.monotonic() >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            self.sel.register(self.listener, selectors.EVENT_READ, None)

    def check_timers(self) -> None:
        """Deadlines (authentication, heartbeats, lingering closes, the cluster timeout), looked at
        every ``TIMER_INTERVAL``: not per event, which costs O(connections) each time."""
        now = time.monotonic()
        if now < self.next_timers:
            return
        self.next_timers = now + TIMER_INTERVAL
        for conn in [c for c in self.conns.values() if c.draining and now > c.draining]:
            self._close(conn)
        if self.bridge is not None:
            failure = self.bridge.failure()
            if failure is not None and self.state != "ended":
                self.abort(failure, None)
        for conn in list(self.conns.values()):
            if conn.kind == "" and not conn.closing and now - conn.opened > AUTH_TIMEOUT:
                if not conn.head and self.bridge is not None and self.bridge.serving:
                    # MindSpore clients open connections they use later (its scheduler never
                    # speaks first); ours send their hello at once. Relay the silent one.
                    self.on_foreign(conn)
                else:
                    self.drop(conn, f"no hello within {AUTH_TIMEOUT:g} s")
            elif conn.kind == "agent" and self.node_timeout > 0 and now - conn.last_seen > self.node_timeout:
                self.drop(conn, f"no heartbeat for {self.node_timeout:g} s")
        if self.state == "registering" and self.topo_timeout >= 0 and now - self.started > self.topo_timeout:
            reason = (
                f"cluster time out after {self.topo_timeout:g} s (--cluster_time_out): {self.registered()} of "
                f"{self.worker_num} ranks registered, from {self.summary()}; "
                f"missing {self.worker_num - self.registered()}. "
                "Start msrun on the remaining nodes with the same --master_addr, --master_port and --worker_num, "
                "or lower --worker_num."
            )
            log(reason)
            for agent in self.agents:
                self.send(agent.conn, {"t": "timeout", "reason": reason})
            self.finish(1)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.terminated_by = signum

    def run(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.sel.register(wake_r, selectors.EVENT_READ, "signal")
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        log(f"listening on {self.listener.getsockname()[:2]} for {self.worker_num} ranks ({self.mode} mode)")
        if self.mode == "mindspore":
            self._bridge().start()
        while self.exit_code is None:
            busy = self.bridge is not None and self.bridge.busy
            if busy:
                self.bridge.connect_waiting(self._pair)
            for key, events in self.sel.select(timeout=0.02 if busy else 0.25):
                if key.data == "signal":
                    try:
                        os.read(wake_r, 64)
                    except OSError:
                        pass
                    continue
                if key.data is None:
                    self.accept()
                    continue
                conn: Conn = key.data
                if events & selectors.EVENT_WRITE:
                    self._flush(conn)
                if events & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                    self.on_readable(conn)
            if self.terminated_by is not None and self.exit_code is None:
                # Messages already received (a failure report, say) were handled above, so a
                # broadcast abort carries the real cause; else tell every client why it ends.
                self.abort(f"the scheduler was stopped by {signal.Signals(self.terminated_by).name}", None)
            self.check_timers()
            self.resume_accepting()
        self.drain(1.0)
        if self.bridge is not None:
            self.bridge.stop()
        return self.exit_code

    def drain(self, seconds: float) -> None:
        """Give queued messages (abort, timeout) a bounded chance to leave."""
        deadline = time.monotonic() + seconds
        while any(c.out for c in self.conns.values()) and time.monotonic() < deadline:
            for key, events in self.sel.select(timeout=0.05):
                if isinstance(key.data, Conn) and events & selectors.EVENT_WRITE:
                    self._flush(key.data)


def _listener_from_env(env: dict[str, str]) -> socket.socket:
    fd = env.get("MSRUN_LISTEN_FD")
    if fd:
        return socket.socket(fileno=int(fd))
    from pytest_msrun.netaddr import listen_socket

    return listen_socket(env["MS_SCHED_HOST"], int(env["MS_SCHED_PORT"]))


def _more_file_descriptors() -> None:
    """Raise the soft limit on open files to the hard one: a rank or agent each holds one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def main(env: dict[str, str] | None = None) -> int:
    """Run the control plane until the job ends; its settings come from ``env`` (the process's)."""
    _more_file_descriptors()
    env = dict(os.environ) if env is None else env
    try:
        worker_num = int(env["MS_WORKER_NUM"])
        topo = float(env.get("MS_TOPO_TIMEOUT", "600"))
        node_timeout = float(env.get("MS_NODE_TIMEOUT", "30"))
        token = env.get("MSRUN_JOB_TOKEN", "")
        listener = _listener_from_env(env)
    except (KeyError, ValueError, OSError) as exc:
        log(f"cannot start: {exc!r}")
        return 1
    sched = Scheduler(
        listener,
        worker_num=worker_num,
        token=token,
        topo_timeout=topo,
        node_timeout=node_timeout,
        job_id=env.get("MSRUN_JOB_ID", ""),
        mode=env.get("MSRUN_SCHEDULER", "builtin"),
        env=env,
    )
    return sched.run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # nothing left to clean up; skip interpreter teardown
