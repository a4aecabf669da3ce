"""The builtin control plane: ``python -m pytest_msrun.control.scheduler`` (``MS_ROLE=MS_SCHED``).

One single-threaded event loop, in parts: the transport (:mod:`.transport`: connections, frames,
authentication, deadlines, shedding), the nodes (:mod:`.registry`), the ranks' group
(:mod:`.group`), the MindSpore relay (:mod:`.msbridge`) - and here, one handler per kind of
authenticated client:

* **agents** (one per ``msrun`` invocation) register *before* spawning; once ``MS_WORKER_NUM``
  ranks are registered every agent gets its rank offset, so each worker starts with its final
  ``RANK_ID``. Agents heartbeat and report failures, which are broadcast so every node tears
  down at once.
* **ranks** (``pytest_msrun.control.cluster.init()`` in a worker) join, then run collectives
  (barrier, all-gather, broadcast) relayed here as opaque bytes; a rank that leaves, fails, or
  whose process exits (agents report every worker exit) turns every blocked ``init()`` or
  collective into an error instead of a hang. Ranks under pytest say when they enter and leave a
  test's call phase: a collective that can no longer complete fails at once (:mod:`.group`).
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

import _socket  # not socket: see transport
import os
import signal
import sys
import time

from pytest_msrun.control import calls, tracelog
from pytest_msrun.control.clock import ConfigError, env_seconds
from pytest_msrun.control.group import COLLECTIVE_OPS, RankGroup, process_text
from pytest_msrun.control.registry import NodeInfo, NodeRegistry
from pytest_msrun.control.transport import CLIENT_KINDS, DEFAULT_AUTH_TIMEOUT, Conn, Transport
from pytest_msrun.control.wire import AGENT_FD_ENV, is_int
from pytest_msrun.proc import running

# This module is the scheduler process's whole start-up: it imports no typing, dataclasses,
# contextlib or hashlib, so the control plane is up while the workers are still starting.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from pytest_msrun.control.group import Sends

TIMER_INTERVAL = 0.05  # how often deadlines are checked (seconds)
PROGRESS_INTERVAL = 0.25  # how often the nodes hear how far the job has formed (for a live status line)
MAX_LOOP_FAULTS = 20  # the loop's own work failing this many turns in a row ends the job, naming the error


LOG_FAILURE: list[OSError] = []  # the first write to this process's log that failed (a full disk)


def log(msg: str) -> None:
    """A line on standard output (``scheduler.log``). It never raises: a log that cannot be
    written (a full disk) is noted once in :data:`LOG_FAILURE`, which the loop tells the nodes."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    data = f"[msrun scheduler {stamp}] {msg}\n".encode("utf-8", "backslashreplace")
    try:
        while data:
            data = data[os.write(1, data) :]
    except OSError as exc:
        if not LOG_FAILURE:
            LOG_FAILURE.append(exc)


class Agents:
    """The handler of node agents: registration, heartbeats, exits and failures, done."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.registry = NodeRegistry(sched.worker_num, sched.job_id)
        self.by_conn: dict[Conn, NodeInfo] = {}
        self.left_early: list[int] = []  # ranks that left before their node was assigned them

    def hello(self, conn: Conn, msg: dict[str, Any]) -> None:
        node_rank, local = msg.get("node_rank"), msg.get("local")
        host, ip, pid = msg.get("host"), msg.get("ip"), msg.get("pid")
        hosts_sched = msg.get("hosts_scheduler")
        transport = self.sched.transport
        if not (
            is_int(node_rank, -1, 1 << 20)
            and is_int(local, 1, 1 << 20)
            and isinstance(host, str)
            and isinstance(ip, str)
            and is_int(pid, 0, 1 << 31)
            and isinstance(hosts_sched, bool)
        ):
            log(f"dropped client {conn.peer}: malformed agent registration")
            transport.drop(conn, "malformed agent registration")
            return
        refusal = self.registry.refusal(node_rank, local)
        if refusal:
            transport.refuse(conn, refusal)
            self.sched.notice(f"refused a node ({host}, pid {pid}): {refusal}")
            return
        node = self.registry.register(conn, node_rank, local, host, ip, pid, hosts_sched)
        self.by_conn[conn] = node
        registered = self.registry.registered()
        self.sched.progress_due = True
        log(f"agent registered: {node.describe()} ({registered}/{self.sched.worker_num} ranks)")
        self.sched.event(f"node registered: {node.describe()}", {"ranks registered": registered})
        if self.registry.complete:
            for index, (each, assignment) in enumerate(self.registry.assign()):
                log(f"node {index}: {each.describe()} -> ranks {each.offset}..{each.offset + each.local - 1}")
                transport.send(each.handle, assignment)
            self.sched.event("every node registered: ranks assigned", {"nodes": len(self.registry.nodes)})
            for rank in self.left_early:
                self.left(rank)

    def message(self, conn: Conn, msg: dict[str, Any]) -> None:
        """A registered agent's message (one refused or malformed at its hello is closing: it sends none)."""
        node, kind, sched = self.by_conn[conn], msg["t"], self.sched
        if kind == "hb":  # echoed with this clock's time: the node estimates its clock's offset
            at = msg.get("at")
            reply: dict[str, Any] = {"t": "hb"}
            if isinstance(at, float):
                reply.update(echo=at, now=time.time())
            sched.transport.send(conn, reply)
        elif kind == "trace":  # a node that does not write the trace: its events, on this clock, encoded
            lines = msg.get("lines")
            if sched.trace is not None and isinstance(lines, str):
                sched.trace.add_lines(lines)
        elif kind == "done":
            log(f"agent done: {node.describe()}")
            sched.transport.send(conn, {"t": "done_ack"})  # it may close now: it will not count as lost
            if self.registry.done(node):
                sched.finish(0)
        elif kind == "exit":
            rank, how = msg.get("rank"), msg.get("how")
            if is_int(rank, 0, sched.worker_num - 1) and isinstance(how, str):
                sched.ranks.deliver(sched.ranks.group.exited(rank, how[:200]))
        elif kind == "vouched":  # whether a MindSpore-protocol client on that node is of this job
            if sched.foreign is not None:
                sched.foreign.answer(conn, msg)
        elif kind == "failed":
            reason = msg.get("reason")
            if not isinstance(reason, str):
                reason = "a process failed"
            code = msg.get("code")
            sched.abort(f"{reason[:4096]} (on {node.host})", code if is_int(code, 0, 255) else None)
        else:
            sched.transport.drop(conn, f"unexpected agent message {kind!r}")

    def lost(self, conn: Conn, why: str) -> None:
        node = self.by_conn.pop(conn, None)
        if node is None:
            return
        registering = self.registry.state == "registering"
        if self.registry.lost(node):
            self.sched.abort(f"lost node {node.describe()}: {why}", None)
        elif registering:
            log(f"agent left before the job started: {node.describe()} ({why})")

    def left(self, rank: int) -> None:
        """``rank``'s connection closed: its node's agent hears that the process is ending (once
        its node has its ranks: a node's workers may start, and leave, before it registers)."""
        nodes = [conn for conn, node in self.by_conn.items() if node.offset <= rank < node.offset + node.local]
        if not nodes:
            self.left_early.append(rank)
        for conn in nodes:
            self.sched.transport.send(conn, {"t": "left", "rank": rank})

    def silent(self, now: float) -> None:
        """Nodes silent past ``MS_NODE_TIMEOUT`` are lost - unless on this host and alive (a node
        busy starting its workers on a loaded machine is late with its heartbeats, not gone)."""
        timeout = self.sched.node_timeout
        if timeout <= 0:
            return
        for conn, node in list(self.by_conn.items()):
            if now - conn.last_seen > timeout and not (self.sched.local_peer(conn) and running(node.pid)):
                self.sched.transport.drop(conn, f"no heartbeat for {timeout:g} s (MS_NODE_TIMEOUT)")

    def at(self, ip: str) -> list[Conn]:
        """The agents of the node at ``ip`` (as their connections come from it)."""
        return [conn for conn in self.by_conn if not conn.local and _peer_ip(conn) == ip]


class Ranks:
    """The handler of ranks (``cluster.init()``): joining, collectives, leaving."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.group = RankGroup(sched.worker_num, sched.transport.limit)
        self.conn_of: dict[int, Conn] = {}
        self.rank_of: dict[Conn, int] = {}
        # traced: collective seq -> (its operation, rank -> when it entered)
        self.entered: dict[int, tuple[str, dict[int, float]]] = {}
        self.first_join = 0.0

    def deliver(self, sends: Sends) -> None:
        for ranks, msg in sends:
            conns = [self.conn_of[r] for r in ranks if r in self.conn_of]
            if conns:
                self.sched.transport.broadcast(conns, msg)
            if self.sched.trace is not None and msg.get("t") in ("coll", "error"):
                self._trace_end(msg)  # after the release: tracing never delays a collective

    def _trace_end(self, msg: dict[str, Any]) -> None:
        """A collective completed or failed: a span on every rank in it, from its entry to now,
        and one on the control plane's lane naming the ranks the others waited for."""
        trace, seq = self.sched.trace, msg.get("seq")
        if trace is None or not isinstance(seq, int):
            return
        op, entered = self.entered.pop(seq, ("collective", {}))
        if not entered:
            return
        now = time.time()
        name = f"{op} #{seq}"
        last = max(entered.values())
        waited_for = sorted(r for r, t in entered.items() if t == last)
        missing = sorted(set(range(self.group.world)) - set(entered))
        args: dict[str, Any] = {"seq": seq, "op": op, "waited for": waited_for}
        if msg["t"] == "error":
            args = {**args, "error": msg.get("reason", ""), "not there": missing}
        trace.add_lines(tracelog.spans(name, {tracelog.RANK_PID + r: at for r, at in entered.items()}, 0, now, args))
        trace.add(tracelog.span(name, tracelog.CONTROL_PID, 1, min(entered.values()), now, args))

    def hello(self, conn: Conn, msg: dict[str, Any]) -> None:
        rank, world = msg.get("rank"), msg.get("world")
        sched = self.sched
        if not (is_int(rank, 0, sched.worker_num - 1) and world == sched.worker_num):
            sched.transport.refuse(
                conn, f"rank {rank!r} / world {world!r} do not fit this job of {sched.worker_num} ranks"
            )
            return
        who = process_text(msg, conn.peer)
        refusal = self.group.refusal(rank, who)
        if refusal:
            sched.transport.refuse(conn, refusal)
            return
        if sched.abort_msg is not None:
            sched.transport.send(conn, sched.abort_msg)
            return
        was_ready = self.group.ready
        sends = self.group.join(rank, f"{who}, joined at {time.strftime('%H:%M:%S')}")
        if rank not in self.group.connected:  # refused: the group can never form
            sched.transport.send(conn, sends[0][1])
            return
        self.conn_of[rank] = conn
        self.rank_of[conn] = rank
        if sched.trace is not None:
            now = time.time()
            self.first_join = self.first_join or now
            sched.trace.add(tracelog.instant("init() joined", tracelog.RANK_PID + rank, 0, now))
            if self.group.ready and not was_ready:
                sched.trace.add(tracelog.span("forming the group", tracelog.CONTROL_PID, 1, self.first_join, now))
        if not was_ready:
            sched.progress_due = True
        if self.group.ready and not was_ready:
            log(f"all {sched.worker_num} ranks joined the communication group")
            sched.event(f"all {sched.worker_num} ranks joined the group")
            sched.tell_progress(now_or_never=True)
        self.deliver(sends)

    def message(self, conn: Conn, msg: dict[str, Any]) -> None:
        rank = self.rank_of.get(conn)
        if rank is None:
            return
        transport, kind = self.sched.transport, msg["t"]
        if kind == "bye":
            self._forget(conn, rank)
            where = calls.parse_where(msg)
            self.deliver(self.group.bye(rank, where[0] if isinstance(where, tuple) else None))
            transport.close(conn)
            return
        if kind == "call":  # the rank entered or left a test's call phase
            notice = calls.parse_notice(msg)
            if notice is None:
                transport.drop(conn, "malformed call notice")
                return
            self.deliver(self.group.call_notice(rank, *notice))
            return
        if kind != "coll":
            transport.drop(conn, f"unexpected rank message {kind!r}")
            return
        op, seq, src = msg.get("op"), msg.get("seq"), msg.get("src", 0)
        data, where = msg.get("data"), calls.parse_where(msg)
        if op not in COLLECTIVE_OPS or not is_int(seq, 0, 1 << 62) or not is_int(src, 0, self.sched.worker_num - 1):
            transport.drop(conn, "malformed collective")
            return
        if (data is not None and not isinstance(data, str)) or where is False:
            transport.drop(conn, "malformed collective data")
            return
        refusal = self.group.entry_refusal(rank, op, seq)
        if refusal:  # its protocol error: it fails, the job goes on
            self._forget(conn, rank)
            self.deliver(self.group.expel(rank, refusal))
            transport.refuse(conn, refusal)
            return
        if self.sched.trace is not None:
            self.entered.setdefault(seq, (op, {}))[1][rank] = time.time()
        place = (where, calls.parse_order(msg)) if isinstance(where, tuple) else ()
        self.deliver(self.group.contribute(rank, op, seq, src, data, *place))

    def _forget(self, conn: Conn, rank: int) -> None:
        self.rank_of.pop(conn, None)
        if self.conn_of.get(rank) is conn:
            del self.conn_of[rank]

    def lost(self, conn: Conn, why: str) -> None:
        rank = self.rank_of.get(conn)
        if rank is None:
            return
        self._forget(conn, rank)
        self.sched.agents.left(rank)  # before its peers hear of it: a failure of theirs comes after
        self.deliver(self.group.left(rank, why))


class Scheduler:
    """The control plane: the transport's handler, dispatching to one handler per client kind."""

    def __init__(self, env: dict[str, str]) -> None:
        """Its settings from ``env`` (the process's); :class:`ConfigError`, ``KeyError``, ``ValueError``
        or ``OSError`` when they cannot be used."""
        self.worker_num = int(env["MS_WORKER_NUM"])
        self.topo_timeout = env_seconds(env, "MS_TOPO_TIMEOUT", 600.0, allow_negative=True)
        self.node_timeout = env_seconds(env, "MS_NODE_TIMEOUT", 30.0, allow_negative=True)
        auth_timeout = env_seconds(env, "MSRUN_AUTH_TIMEOUT", DEFAULT_AUTH_TIMEOUT)
        fd = env.get("MSRUN_LISTEN_FD")
        if fd:
            listener = _socket.socket(fileno=int(fd))
        else:
            from pytest_msrun.netaddr import listen_socket

            listener = listen_socket(env["MS_SCHED_HOST"], int(env["MS_SCHED_PORT"]))
        self.job_id = env.get("MSRUN_JOB_ID", "")
        self.mode = env.get("MSRUN_SCHEDULER", "builtin")  # builtin | auto | mindspore: are MindSpore clients served
        self.env = env
        token = env.get("MSRUN_JOB_TOKEN", "")
        self.transport = Transport(
            listener, self, token=token, auth_timeout=auth_timeout, max_pending=2 * self.worker_num, log=log
        )
        self.agents = Agents(self)
        self.ranks = Ranks(self)
        self.handlers: dict[str, Agents | Ranks] = {"agent": self.agents, "rank": self.ranks}  # by client kind
        self.relay: Any = None  # msbridge.MindSporeBridge, created when first needed
        self.foreign: Any = None  # foreign.ForeignClients: MindSpore-protocol clients being attributed
        self.next_timers = 0.0
        self.started = self.transport.clock.now
        self.exit_code: int | None = None
        self.abort_msg: dict[str, Any] | None = None
        self.terminated_by: int | None = None
        self.trace = tracelog.recorder_from_env(self.env, "scheduler")
        self.progress_due = False
        self.next_progress = 0.0
        self.told_log_failure = self.told_trace_failure = False
        if self.trace is not None:
            where = f"{_socket.gethostname()}, pid {os.getpid()}"
            self.trace.extend(tracelog.lane(tracelog.CONTROL_PID, f"control plane ({where})", 1))
            self.trace.add(tracelog.thread(tracelog.CONTROL_PID, 0, "nodes and clients"))
            self.trace.add(tracelog.thread(tracelog.CONTROL_PID, 1, "ranks and collectives"))

    # ---------------------------------------------------------------- what the nodes hear
    def event(self, name: str, args: dict[str, Any] | None = None, scope: str = "t") -> None:
        """An instant on the control plane's lane of the trace (when traced)."""
        if self.trace is not None:
            self.trace.add(tracelog.instant(name, tracelog.CONTROL_PID, 0, time.time(), args, scope))

    def notice(self, text: str) -> None:
        """Something every node's console and status file must say (not only this log)."""
        log(text)
        self.event(text)
        self.transport.broadcast(list(self.agents.by_conn), {"t": "notice", "text": text[:2000]})

    def tell_progress(self, now_or_never: bool = False) -> None:
        """How far the job has formed, to every node (at most every ``PROGRESS_INTERVAL``)."""
        now = self.transport.clock.now
        if not self.progress_due or (now < self.next_progress and not now_or_never):
            return
        self.progress_due = False
        self.next_progress = now + PROGRESS_INTERVAL
        group = self.ranks.group
        msg = {"t": "progress", "text": self.agents.registry.waiting_text(group.joined), "done": group.ready}
        self.transport.broadcast(list(self.agents.by_conn), msg)

    def tell_drops(self, now_or_never: bool = False) -> None:
        """Strangers dropped at the door, summed up per address at most once a minute (and before
        the job ends), on every node's console: never a line per connection."""
        for line in self.transport.door.tally.summary(self.transport.clock.now, force=now_or_never):
            self.notice(f"{line}; this job's own clients retry")

    # ---------------------------------------------------------------- the transport's handler
    def on_hello(self, conn: Conn, hello: dict[str, Any]) -> None:
        if hello["kind"] in self.handlers:  # an observer says hello only
            self.handlers[hello["kind"]].hello(conn, hello)

    def on_message(self, conn: Conn, msg: dict[str, Any]) -> None:
        if LOG_FAILURE and not self.told_log_failure:  # said before whatever this message leads to
            self.tell_write_failures()
        if conn.kind in self.handlers:
            self.handlers[conn.kind].message(conn, msg)
        elif conn.kind == "observer":
            self.observer_message(conn, msg)

    def observer_message(self, conn: Conn, msg: dict[str, Any]) -> None:
        """An observer (the pytest controller) asks for the state, or says ranks finished their test."""
        ranks = self.ranks
        if msg["t"] == "finished":
            listed, why = msg.get("ranks"), msg.get("why")
            if isinstance(listed, list) and all(is_int(r, 0, self.worker_num - 1) for r in listed):
                text = (why if isinstance(why, str) and why else "finished its test")[:200]
                ranks.deliver(ranks.group.finished(listed, text))
        elif msg["t"] != "state":
            self.transport.drop(conn, f"unexpected observer message {msg['t']!r}")
            return
        self.transport.send(conn, ranks.group.snapshot())

    def on_lost(self, conn: Conn, why: str) -> None:
        if conn.kind in self.handlers:
            self.handlers[conn.kind].lost(conn, why)
        if conn.kind in ("agent", "foreign") and self.foreign is not None:
            self.foreign.gone(conn)
        if conn.kind in ("foreign", "upstream") and self.relay is not None:
            self.relay.unpair(conn)

    def on_relay(self, conn: Conn, data: bytes) -> None:
        if self.foreign is not None and conn in self.foreign.by_conn:
            self.foreign.keep(conn, data)
        elif self.relay is not None:
            self.relay.relay(conn, data)

    def on_foreign(self, conn: Conn) -> None:
        """A MindSpore-protocol client: served once shown to be this job's (:mod:`.foreign`)."""
        if self.foreign is None:
            from pytest_msrun.control.foreign import ForeignClients

            self.foreign = ForeignClients(self.transport, self.agents.at, self._foreign_accepted)
        self.foreign.arrive(conn)

    def _foreign_accepted(self, conn: Conn) -> None:
        """A MindSpore process of this job: relayed to a MindSpore scheduler, or the job fails."""
        if self.mode not in ("auto", "mindspore"):
            reason = (
                f"a MindSpore process ({conn.peer}) called mindspore.communication.init() against the builtin "
                "scheduler, which cannot serve it; run msrun with --scheduler=mindspore "
                "(or --scheduler=auto, the default, which starts a MindSpore scheduler when one is needed)"
            )
            self.transport.drop(conn, "MindSpore client refused")
            self.abort(reason, None)
            return
        self._relay().adopt(conn)

    def _relay(self) -> Any:
        if self.relay is None:
            from pytest_msrun.control.msbridge import MindSporeBridge

            self.relay = MindSporeBridge(self.transport, self.env, log)
        return self.relay

    def local_peer(self, conn: Conn) -> bool:
        if conn.local:
            return True
        from pytest_msrun.netaddr import is_local_address

        ip = _peer_ip(conn)
        return ip is not None and is_local_address(ip)

    # ---------------------------------------------------------------- the job's end
    def abort(self, reason: str, code: int | None) -> None:
        if self.exit_code is not None:
            return
        log(f"aborting the job: {reason}")
        self.tell_drops(now_or_never=True)
        self.tell_write_failures()
        self.event(f"abort: {reason}"[:200], {"reason": reason, "code": code}, scope="g")
        self.abort_msg = {"t": "abort", "reason": reason, "code": code}
        clients = [c for c in self.transport.conns.values() if c.kind in CLIENT_KINDS]
        self.transport.broadcast(clients, self.abort_msg)
        self.finish(1)

    def finish(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
            self.agents.registry.state = "ended"
            self.tell_drops(now_or_never=True)
            self.tell_write_failures()  # before the end: a short job must hear of them too
            if code == 0:
                log("every node reported success")
                self.transport.broadcast(list(self.agents.by_conn), {"t": "end", "code": 0})

    # ---------------------------------------------------------------- deadlines
    def check_timers(self) -> None:
        """Deadlines (authentication, heartbeats, the cluster timeout), looked at every
        ``TIMER_INTERVAL`` of the loop's clock: not per event, which costs O(connections) each time."""
        now = self.transport.clock.now
        if now < self.next_timers:
            return
        self.next_timers = now + TIMER_INTERVAL
        relay = self.relay
        failure = None if relay is None else relay.failure()
        if failure is not None:
            self.abort(failure, None)  # (nothing once the job ended)
        # MindSpore clients open connections they use later (its scheduler never speaks first);
        # ours send their hello at once: a silent one is a foreign client once one is relayed.
        self.transport.expire(silent=lambda: relay is not None and relay.serving)
        if self.foreign is not None:
            self.foreign.expire(now)
        self.agents.silent(now)
        registry = self.agents.registry
        if registry.state == "registering" and self.topo_timeout >= 0 and now - self.started > self.topo_timeout:
            reason = (
                f"cluster time out after {self.topo_timeout:g} s (--cluster_time_out): {registry.registered()} of "
                f"{self.worker_num} ranks registered, from {registry.summary()}; "
                f"missing {self.worker_num - registry.registered()}. "
                "Start msrun on the remaining nodes with the same --master_addr, --master_port and --worker_num, "
                "or lower --worker_num."
            )
            log(reason)
            self.event("cluster time out (--cluster_time_out)", {"reason": reason}, scope="g")
            for node in registry.nodes:
                self.transport.send(node.handle, {"t": "timeout", "reason": reason})
            self.finish(1)
        self.tell_drops()
        self.tell_progress()
        if self.trace is not None:
            self.trace.flush()
        self.tell_write_failures()

    def tell_write_failures(self) -> None:
        """Once each: this process's log or trace could not be written (a full disk) - the job
        goes on, and every node's console says what failed, where, and what to do (once a node
        is there to hear it)."""
        if not self.agents.by_conn:
            return
        if LOG_FAILURE and not self.told_log_failure:
            self.told_log_failure = True
            self.notice(write_failure("the control plane's log", _own_log(), LOG_FAILURE[0], "--log_dir"))
        trace = self.trace
        if trace is not None and trace.error is not None and not self.told_trace_failure:
            self.told_trace_failure = True
            self.notice(write_failure("the control plane's trace", trace.path, trace.error, "--trace"))

    # ---------------------------------------------------------------- the loop
    def _turn(self) -> None:
        """One turn of the loop: serve what is ready, answer a signal, look at the deadlines."""
        busy = self.relay is not None and self.relay.busy
        if busy:
            self.relay.connect_waiting()
        self.transport.poll(0.02 if busy else 0.25, self._wake)
        if self.terminated_by is not None and self.exit_code is None:
            # What arrived before the signal (msrun's notes of a failed rank, sent before it
            # signals the control plane) is served first, so a broadcast abort carries the real
            # cause - the signal may have come while an earlier event was being served.
            self.transport.poll(0, self._wake)
            if self.exit_code is None:  # what was served may have ended the job already
                self.abort(f"the scheduler was stopped by {signal.Signals(self.terminated_by).name}", None)
        self.check_timers()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.terminated_by = signum

    def _wake(self, data: Any) -> None:
        try:
            os.read(self._wake_r, 64)
        except OSError:
            pass

    def run(self) -> int:
        self._wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        import selectors

        self.transport.sel.register(self._wake_r, selectors.EVENT_READ, "signal")
        log(f"listening on {self.transport.listener.getsockname()[:2]} for {self.worker_num} ranks ({self.mode} mode)")
        if self.mode == "mindspore":
            self._relay().start()
        faults = 0  # turns of the loop in a row that raised
        while self.exit_code is None:
            try:
                self._turn()
                faults = 0
            except Exception as exc:  # a bug in this process's own work (connections have their own boundary)
                faults += 1
                from pytest_msrun.control.transport import format_error

                log(f"error in the control plane's loop ({faults} in a row):\n{format_error(exc)}")
                if faults >= MAX_LOOP_FAULTS:
                    self.abort(f"the control plane failed {faults} times in a row, last: {exc!r}", None)
        self.transport.drain(1.0)
        if self.relay is not None:
            self.relay.stop()
        if self.trace is not None:
            self.event(f"the control plane ends ({self.exit_code})")
            self.trace.close()
        return self.exit_code


def _peer_ip(conn: Conn) -> str | None:
    """The address ``conn`` comes from (no IPv6 zone), or None when its socket has none."""
    try:
        return str(conn.sock.getpeername()[0]).split("%", 1)[0]
    except OSError:
        return None


def _own_log() -> str:
    try:
        return os.readlink("/proc/self/fd/1")
    except OSError:
        return "standard output"


def write_failure(what: str, path: str, exc: OSError, flag: str) -> str:
    """One line for a write that failed: what, where, why, and what to do (the job goes on)."""
    from pytest_msrun.fsinfo import describe_write_error

    return f"cannot write {what}: {describe_write_error(path, exc, flag)}; the job goes on without it"


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
        sched = Scheduler(env)
    except ConfigError as exc:
        log(f"cannot start: {exc}")
        return 1
    except (KeyError, ValueError, OSError) as exc:
        log(f"cannot start: {exc!r}")
        return 1
    agent_fd = env.get(AGENT_FD_ENV)
    if agent_fd:  # msrun forked this process and kept the other end (see engine/agent.py)
        try:  # only msrun holds that end: it bypasses the door; its hello is welcomed without a challenge
            sched.transport.adopt(_socket.socket(fileno=int(agent_fd)), "msrun (socketpair)", "", local=True)
        except (ValueError, OSError) as exc:
            log(f"cannot use {AGENT_FD_ENV}={agent_fd}: {exc!r}")
            return 1
    return sched.run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # nothing left to clean up; skip interpreter teardown
