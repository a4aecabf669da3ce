"""The job's nodes as a plain state machine: registration, rank assignment, done, lost.

No sockets: a node is a :class:`NodeInfo` with an opaque ``handle`` the scheduler uses to reach
it; methods return what to send as ``(handles, message)`` pairs, or a refusal.

* ``registering``: every ``msrun`` registers its worker count (and ``--node_rank`` if given)
  before its workers need their ranks; extra nodes, too many workers and a taken node rank are
  refused with the reason; a node that leaves now is simply forgotten.
* once ``worker_num`` ranks are registered the job is ``running``: nodes are ordered (explicit
  node ranks first, then the scheduler's host, then by address) and each gets its rank offset.
* ``running``: each node reports ``done``; the job succeeds when all have. A node lost before its
  ``done`` aborts the job.
"""

from __future__ import annotations

import sys

from pytest_msrun.record import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


@record(eq=False)
class NodeInfo:
    """A registered node agent."""

    handle: Any
    node_rank: int
    local: int
    host: str
    ip: str
    pid: int
    hosts_scheduler: bool
    seq: int
    offset: int = -1
    done: bool = False

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


class NodeRegistry:
    """Nodes of one job of ``worker_num`` ranks."""

    def __init__(self, worker_num: int, job_id: str = "") -> None:
        self.worker_num = worker_num
        self.job_id = job_id
        self.nodes: list[NodeInfo] = []
        self.state = "registering"  # -> running -> ended
        self.seq = 0

    def registered(self) -> int:
        return sum(n.local for n in self.nodes)

    def summary(self) -> str:
        return "; ".join(n.describe() for n in self.nodes) or "none"

    def refusal(self, node_rank: int, local: int) -> str:
        """Why a node of ``local`` workers (``--node_rank=node_rank``, -1: none) cannot join ("" if it can)."""
        if self.state != "registering":
            return (
                f"extra node: the job already has all {self.worker_num} ranks (--worker_num={self.worker_num}) "
                f"from {self.summary()}"
            )
        have = self.registered()
        if have + local > self.worker_num:
            return (
                f"extra node: this node's {local} worker(s) would exceed --worker_num={self.worker_num}; "
                f"{have} rank(s) are already registered from {self.summary()}"
            )
        other = next((n for n in self.nodes if node_rank >= 0 and n.node_rank == node_rank), None)
        return f"--node_rank={node_rank} is already taken by {other.describe()}" if other is not None else ""

    def register(
        self, handle: Any, node_rank: int, local: int, host: str, ip: str, pid: int, hosts_scheduler: bool
    ) -> NodeInfo:
        """Add a node (after :meth:`refusal` said it may join)."""
        self.seq += 1
        node = NodeInfo(handle, node_rank, local, host[:256], ip[:64], pid, hosts_scheduler, self.seq)
        self.nodes.append(node)
        return node

    @property
    def complete(self) -> bool:
        return self.state == "registering" and self.registered() == self.worker_num

    def assign(self) -> list[tuple[NodeInfo, dict[str, Any]]]:
        """Every rank registered: each node's offset (its ``assign`` message), in node order."""
        self.state = "running"
        ordered = sorted(self.nodes, key=NodeInfo.sort_key)
        offset = 0
        table = []
        for node in ordered:
            node.offset = offset
            table.append({"host": node.host, "ip": node.ip, "local": node.local, "offset": offset})
            offset += node.local
        rest = {"node_count": len(ordered), "nodes": table, "job_id": self.job_id}
        return [
            (node, {"t": "assign", "offset": node.offset, "node_index": index, **rest})
            for index, node in enumerate(ordered)
        ]

    def done(self, node: NodeInfo) -> bool:
        """``node`` finished; whether every node has (the job succeeded)."""
        node.done = True
        return self.state == "running" and all(n.done for n in self.nodes)

    def lost(self, node: NodeInfo) -> bool:
        """``node``'s connection is gone; whether that fails the job (forgotten while registering)."""
        if node in self.nodes and self.state == "registering":
            self.nodes.remove(node)
            return False
        return self.state == "running" and not node.done

    def waiting_text(self, joined: set[int]) -> str:
        """Progress while the job forms: ranks registered, or joined and who is still missing."""
        have = self.registered()
        if self.state == "registering":
            return f"{have}/{self.worker_num} ranks registered from {len(self.nodes)} node(s)"
        nodes = enumerate(sorted(self.nodes, key=lambda n: n.offset))
        counts = [(sum(r not in joined for r in range(n.offset, n.offset + n.local)), i, n.host) for i, n in nodes]
        missing = sorted((m for m in counts if m[0]), key=lambda m: (-m[0], m[1]))
        text = f"{len(joined)}/{self.worker_num} ranks joined"
        if not missing:
            return text
        count, index, host = missing[0]
        text += f"; waiting for {count} on node {index} ({host})"
        if len(missing) > 1:
            others = sum(m[0] for m in missing[1:])
            text += f" and {others} on {len(missing) - 1} other node(s)"
        return text
