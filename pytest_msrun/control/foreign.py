"""MindSpore-protocol clients at the control plane's port: served only once shown to be this job's.

MindSpore's RPC has no authentication, so a connection that speaks it proves nothing. Before its
bytes go anywhere, the control plane attributes it:

* **a peer on this host** - by the socket's owner (``/proc/net/tcp``): this user's processes only;
* **a peer on another node** - by that node's msrun (its agent, authenticated with the job's token),
  asked ``vouch`` with the connection's two ends: the agent finds the socket in its own
  ``/proc/net/tcp`` and answers yes only when a process of its job (a descendant of that msrun,
  running as its user) holds it. A host that runs no agent of this job is not asked: no.

Until then the client's bytes are kept (at most :data:`WAIT_BYTES`), for at most the handshake
timeout, and at most as many clients wait as strangers may at the door. A client that is not
shown to be this job's is dropped and counted with the strangers - never a reason to end the job.
One that is: relayed to a MindSpore scheduler (``--scheduler=auto|mindspore``), or, with
``builtin``, the job fails at once naming the flag that fixes it (it is the job's own process).

Standard library only; imported by the control plane at its first foreign connection.
"""

from __future__ import annotations

import os

from pytest_msrun.control.wire import is_int

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

WAIT_BYTES = 1 << 20  # bytes of a client kept while it is being attributed


class ForeignClients:
    """Foreign-protocol connections being attributed, and the answers of the nodes' agents."""

    def __init__(self, transport: Any, agents_at: Callable[[str], list[Any]], accept: Callable[[Any], None]) -> None:
        self.transport = transport
        self.agents_at = agents_at  # peer address -> the authenticated agent connections of that node
        self.accept = accept  # called with a client shown to be this job's
        self.timeout = transport.door.timeout  # the handshake's, as the door's strangers
        self.max_waiting = transport.door.max_pending
        # request id -> (client, agents still to answer, its peer address for the count of strangers)
        self.waiting: dict[int, tuple[Any, set[Any], str]] = {}
        self.by_conn: dict[Any, int] = {}  # the clients being attributed (their bytes are kept, not relayed)
        self.next_id = 0

    def arrive(self, conn: Any) -> None:
        """A foreign-protocol client: attribute it (at once on this host; else ask its node's agent)."""
        try:
            peer, here = conn.sock.getpeername(), conn.sock.getsockname()
        except OSError:
            self.transport.drop_stranger(conn, "MindSpore-protocol client gone before it was attributed", "unknown")
            return
        ip = str(peer[0]).split("%", 1)[0]
        from pytest_msrun.netaddr import is_local_address, local_peer_uid

        if is_local_address(ip):
            if local_peer_uid(conn.sock) == os.getuid():
                self.accept(conn)
            else:
                self.transport.drop_stranger(conn, "MindSpore-protocol client of another user (or of no one known)", ip)
            return
        agents = self.agents_at(ip)
        if not agents:
            self.transport.drop_stranger(conn, "MindSpore-protocol client on a host that is not this job's node", ip)
            return
        if len(self.waiting) >= self.max_waiting:
            self._fail(next(iter(self.waiting)), "shed (too many MindSpore-protocol clients being attributed)")
        self.next_id += 1
        request = {"t": "vouch", "id": self.next_id, "peer": [ip, int(peer[1])], "server": [here[0], int(here[1])]}
        self.transport.broadcast(agents, request)
        conn.deadline = self.transport.clock.now + self.timeout
        self.waiting[self.next_id] = (conn, set(agents), ip)
        self.by_conn[conn] = self.next_id

    def keep(self, conn: Any, data: bytes) -> None:
        """Bytes a client sent while it is being attributed: kept, within :data:`WAIT_BYTES`."""
        conn.pending += data
        if len(conn.pending) > WAIT_BYTES:
            self._fail(self.by_conn[conn], "MindSpore-protocol client sent too much before it was attributed")

    def answer(self, agent: Any, msg: dict[str, Any]) -> None:
        """An agent's ``vouched``: yes - the client is in; no from every agent asked - dropped."""
        request = msg.get("id")
        if not isinstance(request, int):
            return
        entry = self.waiting.get(request)
        if entry is None or agent not in entry[1]:
            return  # late, or not asked: nothing to do
        conn, asked, _ = entry
        if msg.get("ok") is True:
            self._forget(request)
            self.accept(conn)
            return
        asked.discard(agent)
        if not asked:
            self._fail(request, "MindSpore-protocol client its node's msrun does not know as this job's")

    def gone(self, conn: Any) -> None:
        """A client (or an agent asked about one) left."""
        request = self.by_conn.get(conn)
        if request is not None:
            ip = self._forget(request)[2]
            self.transport.door.tally.add(ip, "MindSpore-protocol client gone before it was attributed")
        for request, (_client, asked, _) in list(self.waiting.items()):
            if conn in asked:
                asked.discard(conn)
                if not asked:
                    self._fail(request, "MindSpore-protocol client whose node's msrun left")

    def expire(self, now: float) -> None:
        for request, (conn, _, _) in list(self.waiting.items()):
            if now > conn.deadline:
                self._fail(request, f"MindSpore-protocol client not attributed within {self.timeout:g} s")

    def _fail(self, request: int, why: str) -> None:
        conn, _, ip = self._forget(request)
        self.transport.drop_stranger(conn, why, ip)

    def _forget(self, request: int) -> tuple[Any, set[Any], str]:
        entry = self.waiting.pop(request)
        self.by_conn.pop(entry[0], None)
        return entry


def vouch(msg: dict[str, Any], root_pid: int) -> dict[str, Any]:
    """An agent's answer to ``vouch``: whether the client's socket (``peer``, connected to ``server``)
    is held by a process of this job on this node - a descendant of ``root_pid`` (this msrun) of this
    user. Whatever the request holds, the answer is a yes or a no."""
    answer: dict[str, Any] = {"t": "vouched", "id": msg.get("id"), "ok": False}
    peer, server = msg.get("peer"), msg.get("server")
    if not (isinstance(peer, list) and isinstance(server, list) and _endpoint(peer) and _endpoint(server)):
        return answer
    from pytest_msrun.netaddr import tcp_socket
    from pytest_msrun.proc import descendants, holds_socket

    found = tcp_socket((str(peer[0]), int(peer[1])), (str(server[0]), int(server[1])))
    if found is None or found[0] != os.getuid():
        return answer
    answer["ok"] = any(holds_socket(pid, found[1]) for pid in descendants(root_pid))
    return answer


def _endpoint(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and len(value[0]) <= 64
        and is_int(value[1], 1, 65535)
    )
