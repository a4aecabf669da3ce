"""The ranks' communication group as a plain state machine: who joined, collectives, who left.

No sockets: every method returns the messages to send as :data:`Sends` - ``(ranks, message)``
pairs - and the scheduler delivers them (a message to many ranks is encoded once). So the rules
can be tested directly, and read in one place:

* the group forms when all ``world`` ranks joined (``ready`` to each; a rank joining later, after
  reconnecting, gets ``ready`` at once);
* a collective (``barrier``, ``gather``, ``bcast``) completes when every rank contributed to the
  same sequence number with the same operation; a mismatch fails it for those in it;
* a rank that leaves (its connection closed, ``finalize()``) or whose process exits (its agent
  says so) turns every wait on it - forming the group, or a collective - into an error at once,
  naming the rank and how it ended; so does an observer saying ranks finished their test (a warm
  world's rank lives on after its test, where a fresh job's would have exited);
* :meth:`RankGroup.snapshot` is what observers see on a timeout.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    Sends = list[tuple[list[int], dict[str, Any]]]

COLLECTIVE_OPS = ("barrier", "gather", "bcast")


class Collective:
    """Contributions to one collective operation, by rank."""

    __slots__ = ("op", "src", "parts")

    def __init__(self, op: str, src: int) -> None:
        self.op = op
        self.src = src
        self.parts: dict[int, Any] = {}


class RankGroup:
    """The ranks of one job and their collectives."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.connected: set[int] = set()  # ranks joined and still here
        self.joined: set[int] = set()  # every rank that ever joined
        self.gone: dict[int, str] = {}  # rank -> why it is gone
        self.exit_how: dict[int, str] = {}  # rank -> how its process ended (reported by its agent)
        self.last: dict[int, str] = {}  # rank -> the last collective it entered ("barrier #3")
        self.ready = False
        self.collectives: dict[int, Collective] = {}

    # ---------------------------------------------------------------- joining
    def refusal(self, rank: int) -> str:
        """Why ``rank`` may not join now ("" when it may)."""
        if rank in self.connected:
            return f"rank {rank} already joined"
        return ""

    def join(self, rank: int) -> Sends:
        """``rank`` joins; the group forms when every rank is in."""
        never = self.never_joined_gone()
        if never and not self.ready:
            return [([rank], {"t": "error", "seq": -1, "reason": never})]
        self.connected.add(rank)
        self.joined.add(rank)
        self.gone.pop(rank, None)
        ready = {"t": "ready", "world": self.world}
        if self.ready:
            return [([rank], ready)]
        if len(self.connected) == self.world:
            self.ready = True
            return [(sorted(self.connected), ready)]
        return []

    def never_joined_gone(self) -> str:
        """Why the group can never form (a rank's process ended before it joined), or ""."""
        gone = sorted(r for r in self.gone if r not in self.joined)
        return "; ".join(f"rank {r} {self.gone[r]}" for r in gone)

    # ---------------------------------------------------------------- leaving
    def exited(self, rank: int, how: str) -> Sends:
        """``rank``'s process ended (its agent saw it): nobody may wait for it any more."""
        self.exit_how[rank] = how
        if rank in self.connected or rank in self.gone:
            return []  # joined and connected: its connection closes too; or it already left
        why = f"exited without joining the group: its process {how}"
        self.gone[rank] = why
        out: Sends = []
        if not self.ready:
            out.append((sorted(self.connected), {"t": "error", "seq": -1, "reason": f"rank {rank} {why}"}))
        return out + self.fail_collectives(f"rank {rank} left the job ({why})")

    def left(self, rank: int, why: str) -> Sends:
        """``rank``'s connection is gone."""
        self.connected.discard(rank)
        if rank in self.exit_how:
            why = f"its process {self.exit_how[rank]}"
        self.gone[rank] = why
        out: Sends = []
        if not self.ready:
            reason = f"rank {rank} left before the group formed ({why})"
            out.append((sorted(self.connected), {"t": "error", "seq": -1, "reason": reason}))
        return out + self.fail_collectives(f"rank {rank} left the job ({why})")

    def bye(self, rank: int) -> Sends:
        """``rank`` called ``finalize()``."""
        self.connected.discard(rank)
        self.gone[rank] = "it called finalize()"
        return self.fail_collectives(f"rank {rank} called finalize() while others wait in a collective")

    def finished(self, ranks: list[int], why: str) -> Sends:
        """These ranks finished their test while still connected (a warm world): whoever waits for
        them - to form the group, or in a collective - gets an error now, worded as if they had
        exited (a fresh job's ranks exit when their test ends)."""
        out: Sends = []
        for rank in sorted(set(ranks)):
            if not self.ready and rank not in self.connected:
                reason = f"rank {rank} {why} without joining the group"
                out.append((sorted(self.connected), {"t": "error", "seq": -1, "reason": reason}))
            waiting = [seq for seq, coll in self.collectives.items() if rank not in coll.parts]
            if waiting:
                out += self.fail_collectives(f"rank {rank} left the test ({why})", waiting)
        return out

    def fail_collectives(self, reason: str, seqs: list[int] | None = None) -> Sends:
        out: Sends = []
        for seq in list(self.collectives) if seqs is None else seqs:
            coll = self.collectives.pop(seq, None)
            if coll is not None:
                peers = sorted(r for r in coll.parts if r in self.connected)
                out.append((peers, {"t": "error", "seq": seq, "reason": reason}))
        return out

    # ---------------------------------------------------------------- collectives
    def contribute(self, rank: int, op: str, seq: int, src: int, data: str | None) -> Sends:
        """``rank`` entered collective ``seq``; when it completes, everyone gets the result."""
        coll = self.collectives.setdefault(seq, Collective(op, src))
        if coll.op != op or coll.src != src:
            first = coll.op if coll.op != "bcast" else f"bcast(src={coll.src})"
            this = op if op != "bcast" else f"bcast(src={src})"
            coll.parts[rank] = None
            return self.fail_collectives(
                f"collective #{seq} mismatch: rank {rank} called {this}, another rank called {first}", [seq]
            )
        coll.parts[rank] = data
        self.last[rank] = f"{op} #{seq}"
        if self.gone:
            # Worded as when the rank leaves during a collective, whichever happens first.
            gone = ", ".join(f"rank {r} left the job ({why})" for r, why in sorted(self.gone.items()))
            return self.fail_collectives(f"{op} #{seq} cannot complete: {gone}", [seq])
        if len(coll.parts) < self.world:
            return []
        del self.collectives[seq]
        if op == "barrier":
            reply: dict[str, Any] = {"t": "coll", "seq": seq}
        elif op == "gather":
            reply = {"t": "coll", "seq": seq, "data": [coll.parts[r] for r in range(self.world)]}
        else:
            reply = {"t": "coll", "seq": seq, "data": coll.parts.get(src)}
        return [(sorted(self.connected), reply)]

    # ---------------------------------------------------------------- observers
    def snapshot(self) -> dict[str, Any]:
        """What the control plane knows about the ranks: joined, in which collective, gone."""
        return {
            "t": "state",
            "world": self.world,
            "ready": self.ready,
            "joined": sorted(self.joined),
            "connected": sorted(self.connected),
            "gone": {str(r): why for r, why in sorted(self.gone.items())},
            "exited": {str(r): how for r, how in sorted(self.exit_how.items())},
            "last": {str(r): what for r, what in sorted(self.last.items())},
            "collectives": [
                {"seq": seq, "op": c.op, "src": c.src, "ranks": sorted(c.parts)}
                for seq, c in sorted(self.collectives.items())
            ],
        }
