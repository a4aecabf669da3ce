"""This node's link to the control plane: registration, heartbeats, failure notes, the finish.

An agent registers before it starts its workers when the control plane assigns their ranks
(several nodes without ``--node_rank``), else while they start. It heartbeats while the job
runs - while it starts its workers too - reports each worker's exit and the first failure, and
finishes with a handshake: its ``done`` is acknowledged (so a finished node never counts as
lost), and it keeps heartbeating until the whole job ends - the control plane's ``end`` when
every node is done, or its abort when another node fails - so every node exits with the job's
verdict, not just its own workers'.

The scheduler counts as lost after ``MS_NODE_TIMEOUT`` seconds of silence, measured on this
loop's clock (:class:`~pytest_msrun.control.transport.LoopClock`: time this process could not run
does not count) - and never while it runs on this host: a live process with an open connection
is slow, not gone.
"""

from __future__ import annotations

import time

from pytest_msrun.control import wire
from pytest_msrun.control.clock import LoopClock
from pytest_msrun.control.tracelog import ClockOffset
from pytest_msrun.netaddr import format_hostport
from pytest_msrun.proc import running

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DONE_ACK_WAIT = 5.0  # how long a finished node waits for the control plane to record it


class ControlLink:
    def __init__(self, host: str, port: int, token: str, node_timeout: float) -> None:
        self.host, self.port, self.token = host, port, token
        self.where = format_hostport(host, port)
        self.node_timeout = node_timeout
        self.hb_interval = max(0.05, min(1.0, node_timeout / 3 if node_timeout > 0 else 1.0))
        self.clock = LoopClock(step=max(2.0, 2 * self.hb_interval))
        self.channel: wire.Channel | None = None
        self.last_seen = self.clock.now
        self.scheduler_pid = 0  # from its welcome, when it runs on this host
        self.next_hb = 0.0
        self.deferred: list[dict[str, Any]] = []
        self.joined = False
        self.done_sent_at = 0.0
        self.done_acked = False
        self.job_ended = False  # the control plane said every node is done
        self.offset = ClockOffset()  # this host's clock against the control plane's (traces)

    @property
    def up(self) -> bool:
        return self.channel is not None

    def fileno(self) -> int:
        assert self.channel is not None
        return self.channel.fileno()

    def try_register(self, hello: dict[str, Any], timeout: float) -> str | None:
        """One attempt: connect and authenticate. Returns "" on success, an error to retry on,
        or raises :class:`wire.AuthError` (another job's scheduler, or another token)."""
        try:
            self.channel = wire.Channel.connect(self.host, self.port, timeout=timeout)
            sent = time.time()
            welcome = self.channel.handshake(hello, self.token, timeout)
            theirs = welcome.get("now")
            if isinstance(theirs, float):
                self.offset.sample(sent, theirs, time.time())
        except wire.AuthError:
            self.close()
            raise
        except (OSError, wire.ProtocolError) as exc:
            self.close()
            return str(exc) or type(exc).__name__
        import socket

        pid = welcome.get("pid")
        if welcome.get("host") == socket.gethostname() and isinstance(pid, int):
            self.scheduler_pid = pid
        self.last_seen = self.clock.tick()
        self.joined = True
        return ""

    def adopt(self, sock: Any, hello: dict[str, Any], scheduler_pid: int) -> None:
        """Registered over the socketpair msrun made when it forked the control plane: nothing
        to authenticate (only the two processes hold its ends) and no welcome to wait for - the
        hello is sent, and what the control plane answers is read in the event loop."""
        self.channel = wire.Channel(sock)
        self.channel.send({**hello, "nonce": ""})
        now = time.time()
        self.offset.sample(now, now, now)  # one host, one clock
        self.scheduler_pid = scheduler_pid
        self.last_seen = self.clock.tick()
        self.joined = True

    def buffered(self) -> bool:
        """Whether messages were read from the socket but not yet returned by :meth:`read`."""
        return self.channel is not None and bool(self.channel.pending)

    def read(self) -> list[dict[str, Any]]:
        assert self.channel is not None
        messages = [m for m in self.channel.poll() if m.get("t") != "welcome"]  # (a socketpair's)
        self.last_seen = self.clock.now
        for msg in messages:
            if msg.get("t") == "hb":
                echo, theirs = msg.get("echo"), msg.get("now")
                if isinstance(echo, float) and isinstance(theirs, float):
                    self.offset.sample(echo, theirs, time.time())
            elif msg.get("t") == "done_ack":
                self.done_acked = True
            elif msg.get("t") == "end":
                self.job_ended = True
        return messages

    def send(self, msg: dict[str, Any]) -> None:
        if self.channel is None:
            return
        try:
            self.channel.send(msg)
        except OSError:
            self.close()

    def defer(self, msg: dict[str, Any]) -> None:
        """Send later (:meth:`flush`): news of a failing rank waits until this node's processes
        were signalled, so they are caught where they were, not woken by the news."""
        self.deferred.append(msg)

    def flush(self) -> None:
        for msg in self.deferred:
            self.send(msg)
        self.deferred.clear()

    def beat(self) -> str | None:
        """Send a heartbeat when due; return why the scheduler counts as lost, if it went silent.
        Called once per turn of the agent's loop (it ticks the loop's clock)."""
        if self.channel is None:
            return None
        now = self.clock.tick()
        if now >= self.next_hb:
            self.next_hb = now + self.hb_interval
            self.send({"t": "hb", "at": time.time()})
        if self.node_timeout > 0 and now - self.last_seen > self.node_timeout:
            if self.scheduler_pid and running(self.scheduler_pid):
                return None  # on this host and alive, its connection open: slow, not gone
            return f"no heartbeat from the scheduler for {self.node_timeout:g} s (MS_NODE_TIMEOUT)"
        return None

    def send_done(self) -> None:
        if not self.done_sent_at:
            self.done_sent_at = self.clock.now
            self.send({"t": "done"})

    @property
    def finished(self) -> bool:
        """Every node is done (or the control plane cannot say so any more: gone, or silent about
        this node's ``done``)."""
        if self.channel is None or self.job_ended:
            return True
        return bool(self.done_sent_at) and not self.done_acked and self.clock.now - self.done_sent_at > DONE_ACK_WAIT

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
