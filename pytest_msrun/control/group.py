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
* a collective fails at once when it can no longer complete - every rank missing from it is gone,
  is waiting in another collective, is past it, or has left the test call it was entered in
  (:mod:`.calls`) - naming each of those ranks and where it is;
* :meth:`RankGroup.snapshot` is what observers see on a timeout.
"""

from __future__ import annotations

from pytest_msrun.control.calls import CallStates, op_name, short

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    Sends = list[tuple[list[int], dict[str, Any]]]

COLLECTIVE_OPS = ("barrier", "gather", "bcast")


class Collective:
    """Contributions to one collective operation, by rank."""

    __slots__ = ("op", "src", "parts", "missing", "test")

    def __init__(self, op: str, src: int, world: int, test: str | None) -> None:
        self.op = op
        self.src = src
        self.parts: dict[int, Any] = {}
        self.missing = set(range(world))  # ranks not in it yet
        self.test = test  # the test whose call it was entered in (None: outside a call)


class RankGroup:
    """The ranks of one job and their collectives."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.connected: set[int] = set()  # ranks joined and still here
        self.joined: set[int] = set()  # every rank that ever joined
        self.gone: dict[int, str] = {}  # rank -> why it is gone
        self.exit_how: dict[int, str] = {}  # rank -> how its process ended (reported by its agent)
        self.last: dict[int, str] = {}  # rank -> the last collective it entered ("barrier #3")
        self.high: dict[int, int] = {}  # rank -> the highest sequence number it entered
        self.calls = CallStates()
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
        return out + self.fail_collectives(f"rank {rank} left the job ({why})", named=True)

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
        return out + self.fail_collectives(f"rank {rank} left the job ({why})", named=True)

    def bye(self, rank: int) -> Sends:
        """``rank`` called ``finalize()``."""
        self.connected.discard(rank)
        self.gone[rank] = "it called finalize()"
        return self.fail_collectives(f"rank {rank} left the job (it called finalize())", named=True)

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
                out += self.fail_collectives(f"rank {rank} left the test ({why})", waiting, named=True)
        return out

    def fail_collectives(self, reason: str, seqs: list[int] | None = None, named: bool = False) -> Sends:
        """Fail these collectives (all: None) for the ranks in them; ``named``: each reason says
        which collective cannot complete."""
        out: Sends = []
        for seq in list(self.collectives) if seqs is None else seqs:
            coll = self.collectives.pop(seq, None)
            if coll is not None:
                peers = sorted(r for r in coll.parts if r in self.connected)
                text = f"{op_name(coll.op)} #{seq} cannot complete: {reason}" if named else reason
                out.append((peers, {"t": "error", "seq": seq, "reason": text}))
        return out

    # ---------------------------------------------------------------- collectives
    def contribute(
        self, rank: int, op: str, seq: int, src: int, data: str | None, where: tuple[str, str] | None = None
    ) -> Sends:
        """``rank`` entered collective ``seq`` (in test phase ``where``); when it completes,
        everyone gets the result."""
        call = where[0] if where is not None and where[1] == "call" else None
        if call is not None:
            self.calls.enter(rank, call)
        coll = self.collectives.get(seq)
        if coll is None:
            coll = self.collectives[seq] = Collective(op, src, self.world, call)
        if coll.op != op or coll.src != src:
            first = coll.op if coll.op != "bcast" else f"bcast(src={coll.src})"
            this = op if op != "bcast" else f"bcast(src={src})"
            coll.parts[rank] = None
            return self.fail_collectives(
                f"collective #{seq} mismatch: rank {rank} called {this}, another rank called {first}", [seq]
            )
        if call is not None and coll.test is not None and call != coll.test:
            coll.parts[rank] = None
            return self.fail_collectives(
                f"{op_name(op)} #{seq} mismatch: rank {rank} entered it in {short(call)}'s call, "
                f"another rank in {short(coll.test)}'s call",
                [seq],
            )
        coll.test = coll.test or call
        coll.parts[rank] = data
        coll.missing.discard(rank)
        self.last[rank] = f"{op} #{seq}"
        self.high[rank] = max(seq, self.high.get(rank, seq))
        if self.gone:
            # Worded as when the rank leaves during a collective, whichever happens first.
            gone = ", ".join(f"rank {r} left the job ({why})" for r, why in sorted(self.gone.items()))
            return self.fail_collectives(gone, [seq], named=True)
        if coll.missing:
            return self.stuck(rank)
        del self.collectives[seq]
        if op == "barrier":
            reply: dict[str, Any] = {"t": "coll", "seq": seq}
        elif op == "gather":
            reply = {"t": "coll", "seq": seq, "data": [coll.parts[r] for r in range(self.world)]}
        else:
            reply = {"t": "coll", "seq": seq, "data": coll.parts.get(src)}
        return [(sorted(self.connected), reply)]

    # ---------------------------------------------------------------- collectives that cannot complete
    def call_notice(self, rank: int, state: str, test: str, outcome: str) -> Sends:
        """``rank`` entered (``in``) or left (``out``) ``test``'s call phase."""
        if state == "in":
            self.calls.enter(rank, test)
            return []
        self.calls.leave(rank, test, outcome)
        return self.stuck(rank)

    def stuck(self, moved: int) -> Sends:
        """Fail the pending collectives that can no longer complete now that rank ``moved`` is
        where it is: every rank missing from one is gone, waits in another collective, is past
        it, or has left the test call it was entered in. Decided on the state before any fails
        (two ranks waiting in different collectives each name the other)."""
        doomed = []
        for seq, coll in self.collectives.items():
            if moved in coll.missing or moved in coll.parts:
                reasons = self._blockers(seq, coll)
                if reasons:
                    doomed.append((seq, reasons, self._rewind(seq, coll)))
        out: Sends = []
        for seq, reasons, rewind in doomed:
            for peers, msg in self.fail_collectives(reasons, [seq], named=True):
                out.append((peers, msg if rewind is None else {**msg, "rewind": rewind}))
        return out

    def _rewind(self, seq: int, coll: Collective) -> int | None:
        """The sequence number the ranks in ``coll`` go back to when it fails because the ranks
        missing from it left its call, all at the same one before it: none of them will ever
        enter it, so the failed collective counts for no one and the ranks stay in step."""
        if any(rank in self.gone or self.high.get(rank, 0) != seq - 1 for rank in coll.missing):
            return None
        return seq - 1

    def _blockers(self, seq: int, coll: Collective) -> str:
        """Why every rank missing from ``coll`` will not join it, or "" if one still may."""
        first = next(iter(coll.missing))  # usually on its way: decided in O(1)
        if not self._blocker(first, seq, coll):
            return ""
        reasons = []
        for rank in sorted(coll.missing):
            why = self._blocker(rank, seq, coll)
            if not why:
                return ""
            reasons.append(why)
        if len(reasons) > 8:
            reasons[8:] = [f"and {len(reasons) - 8} more rank(s)"]
        return "; ".join(reasons)

    def _blocker(self, rank: int, seq: int, coll: Collective) -> str:
        if rank in self.gone:
            return f"rank {rank} left the job ({self.gone[rank]})"
        high = self.high.get(rank)
        if high is not None and high != seq:
            other = self.collectives.get(high)
            if other is not None and rank in other.parts:
                return f"rank {rank} is in {op_name(other.op)} #{high}"
            if high > seq:
                return f"rank {rank} is past it (its last collective: {self.last.get(rank, '?')})"
        return self.calls.away(rank, coll.test) if coll.test is not None else ""

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
            "in_call": self.calls.snapshot(),
            "collectives": [
                {"seq": seq, "op": c.op, "src": c.src, "ranks": sorted(c.parts)}
                for seq, c in sorted(self.collectives.items())
            ],
        }
