"""This node's link to the control plane: registration, heartbeats, failure notes, the finish.

An agent registers before it starts its workers when the control plane assigns their ranks
(several nodes without ``--node_rank``), else while they start. It heartbeats while the job
runs, reports each worker's exit and the first failure, and finishes with a handshake: its
``done`` is acknowledged (so a finished node never counts as lost), and it keeps heartbeating
until the whole job ends - the control plane's ``end`` when every node is done, or its abort when
another node fails - so every node exits with the job's verdict, not just its own workers'.
"""

from __future__ import annotations

import time

from pytest_msrun.control import wire
from pytest_msrun.netaddr import format_hostport

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
        self.channel: wire.Channel | None = None
        self.last_seen = time.monotonic()
        self.next_hb = 0.0
        self.deferred: list[dict[str, Any]] = []
        self.queued: list[dict[str, Any]] = []  # sent before this node registered
        self.joined = False
        self.done_sent_at = 0.0
        self.done_acked = False
        self.job_ended = False  # the control plane said every node is done

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
            self.channel.handshake(hello, self.token, timeout)
        except wire.AuthError:
            self.close()
            raise
        except (OSError, wire.ProtocolError) as exc:
            self.close()
            return str(exc) or type(exc).__name__
        self.last_seen = time.monotonic()
        self.joined = True
        return ""

    def flush_queued(self) -> None:
        """Send what was said before this node registered (workers may start first)."""
        queued, self.queued = self.queued, []
        for msg in queued:
            self.send(msg)

    def read(self) -> list[dict[str, Any]]:
        assert self.channel is not None
        messages = self.channel.poll()
        self.last_seen = time.monotonic()
        for msg in messages:
            if msg.get("t") == "done_ack":
                self.done_acked = True
            elif msg.get("t") == "end":
                self.job_ended = True
        return messages

    def send(self, msg: dict[str, Any]) -> None:
        if self.channel is None:
            if not self.joined:
                self.queued.append(msg)
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
        """Send a heartbeat when due; return why the scheduler counts as lost, if it went silent."""
        if self.channel is None:
            return None
        now = time.monotonic()
        if now >= self.next_hb:
            self.next_hb = now + self.hb_interval
            self.send({"t": "hb"})
        if self.node_timeout > 0 and now - self.last_seen > self.node_timeout:
            return f"no heartbeat from the scheduler for {self.node_timeout:g} s"
        return None

    def send_done(self) -> None:
        if not self.done_sent_at:
            self.done_sent_at = time.monotonic()
            self.send({"t": "done"})

    @property
    def finished(self) -> bool:
        """Every node is done (or the control plane cannot say so any more: gone, or silent about
        this node's ``done``)."""
        if self.channel is None or self.job_ended:
            return True
        return bool(self.done_sent_at) and not self.done_acked and time.monotonic() - self.done_sent_at > DONE_ACK_WAIT

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
