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
* a rank is in at most one collective at a time (a rank's collectives are sequential): one that
  enters another - or the same one again - before the one it is in completed or failed breaks the
  protocol (:meth:`RankGroup.entry_refusal`); the scheduler drops its connection, which fails that
  rank with the reason, and the collectives waiting for it as if it had left. So at most ``world``
  collectives are pending, holding at most one part per rank: pending data is bounded by
  ``world`` x the message limit, and every step below costs O(pending collectives), never O(history);
* an all-gather whose result would exceed the message limit fails for every rank in it, naming the
  size, the limit and ``MSRUN_MAX_MESSAGE_BYTES`` (sending it would end each rank's connection);
* :meth:`RankGroup.snapshot` is what observers see on a timeout.
"""

from __future__ import annotations

from pytest_msrun.control.calls import CallStates, op_name, short
from pytest_msrun.control.wire import LIMIT_ENV, is_int
from pytest_msrun.record import field, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    Sends = list[tuple[list[int], dict[str, Any]]]

COLLECTIVE_OPS = ("barrier", "gather", "bcast")


def json_bytes(part: str | None) -> int:
    """The bytes ``part`` takes in a JSON frame: exact for plain ASCII (base64, what ranks send),
    an upper bound for text JSON escapes (at most 12 bytes a character: a surrogate pair)."""
    if part is None:
        return 4  # null
    plain = part.isascii() and part.isprintable() and '"' not in part and "\\" not in part
    return len(part) + 2 if plain else 12 * len(part) + 2


def gather_reply_bytes(seq: int, parts_bytes: int, world: int) -> int:
    """The size of an all-gather's result frame (its body, as the limit counts it) whose ``world``
    parts take ``parts_bytes`` (:func:`json_bytes`) together."""
    return len(f'{{"t":"coll","seq":{seq},"data":[]}}') + parts_bytes + max(0, world - 1)


def process_text(hello: dict[str, Any], peer: str) -> str:
    """Which process a rank's hello comes from, as it says: ``pid 12 on host 'n1' (from 10.0.0.2:4711)``
    (what it leaves out or gets wrong is left out)."""
    pid, host = hello.get("pid"), hello.get("host")
    words = ["the process"]
    if is_int(pid, 1, (1 << 31) - 1):
        words = [f"pid {pid}"]
    if isinstance(host, str) and host:
        words.append(f"on host {host[:255]!r}")
    return " ".join([*words, f"(from {peer})"])


@record(eq=False)
class Collective:
    """Contributions to one collective operation, by rank."""

    op: str
    src: int
    missing: set[int]  # ranks not in it yet
    test: str | None  # the test whose call it was entered in (None: outside a call)
    parts: dict[int, Any] = field(default_factory=dict)
    where: tuple[str, str] | None = None  # the test phase it was first entered in
    order: int | None = None  # that test's place in the session
    size: int = 0  # the parts' bytes in its result (json_bytes)


class RankGroup:
    """The ranks of one job and their collectives.

    Bounds: at most ``world`` pending collectives, one part per rank (:meth:`entry_refusal`); so
    the data they hold is at most ``world`` x ``limit`` (each part came in one frame), and no
    result frame larger than ``limit`` bytes is sent (``None``: no limit)."""

    def __init__(self, world: int, limit: int | None = None) -> None:
        self.world = world
        self.limit = limit
        self.connected: set[int] = set()  # ranks joined and still here
        self.joined: set[int] = set()  # every rank that ever joined
        self.gone: dict[int, str] = {}  # rank -> why it is gone
        self.finalized_in: dict[int, str | None] = {}  # rank gone by finalize() -> the test it was in
        self.exit_how: dict[int, str] = {}  # rank -> how its process ended (reported by its agent)
        self.last: dict[int, str] = {}  # rank -> the last collective it entered ("barrier #3")
        self.high: dict[int, int] = {}  # rank -> the highest sequence number it entered
        self.latest: dict[int, int] = {}  # rank -> the sequence number it entered last
        self.holders: dict[int, str] = {}  # rank -> who joined as it (its process, as its hello says)
        self.calls = CallStates()
        self.ready = False
        self.collectives: dict[int, Collective] = {}

    # ---------------------------------------------------------------- joining
    def refusal(self, rank: int, newcomer: str = "") -> str:
        """Why ``rank`` may not join now ("" when it may): another process holds it - which one
        (as :meth:`join` was told), who asks (``newcomer``), and what probably happened."""
        if rank not in self.connected:
            return ""
        text = f"rank {rank} already joined: {self.holders.get(rank) or 'another process'} holds it"
        if newcomer:
            text += f"; this is {newcomer}"
        return (
            f"{text}. Probably two jobs share one MSRUN_JOB_TOKEN and --master_port, two processes have "
            f"RANK_ID={rank}, or rank {rank} was restarted while its first process still runs: end that process, "
            "or give this one its own port and token, or its own RANK_ID"
        )

    def join(self, rank: int, holder: str = "") -> Sends:
        """``rank`` joins (``holder``: its process, said when another asks for the rank); the group
        forms when every rank is in."""
        # The group can never form once a rank's process ended before it joined.
        never = "; ".join(f"rank {r} {self.gone[r]}" for r in sorted(self.gone) if r not in self.joined)
        if never and not self.ready:
            return [([rank], {"t": "error", "seq": -1, "reason": never})]
        self.connected.add(rank)
        self.joined.add(rank)
        self.holders[rank] = holder
        self.gone.pop(rank, None)
        self.finalized_in.pop(rank, None)
        ready = {"t": "ready", "world": self.world}
        if self.ready:
            return [([rank], ready)]
        if len(self.connected) == self.world:
            self.ready = True
            return [(sorted(self.connected), ready)]
        return []

    # ---------------------------------------------------------------- leaving
    def exited(self, rank: int, how: str) -> Sends:
        """``rank``'s process ended (its agent saw it): nobody may wait for it any more."""
        self.exit_how[rank] = how
        if rank in self.connected or rank in self.gone:
            return []  # joined and connected: its connection closes too; or it already left
        why = f"exited without joining the group: its process {how}"
        self.gone[rank] = why
        unformed = self._unformed(f"rank {rank} {why}")
        return unformed + self.fail_collectives(f"rank {rank} left the job ({why})", named=True)

    def left(self, rank: int, why: str) -> Sends:
        """``rank``'s connection is gone."""
        self.connected.discard(rank)
        if rank in self.exit_how:
            why = f"its process {self.exit_how[rank]}"
        self.gone[rank] = why
        unformed = self._unformed(f"rank {rank} left before the group formed ({why})")
        return unformed + self.fail_collectives(f"rank {rank} left the job ({why})", named=True)

    def _unformed(self, reason: str) -> Sends:
        """The group cannot form: the ranks waiting for it hear why (none once it formed)."""
        return [] if self.ready else [(sorted(self.connected), {"t": "error", "seq": -1, "reason": reason})]

    def bye(self, rank: int, test: str | None = None) -> Sends:
        """``rank`` called ``finalize()`` (in ``test``, when a test's: a later test may init() it again)."""
        self.connected.discard(rank)
        self.gone[rank] = "it called finalize()"
        self.finalized_in[rank] = test
        seqs = [seq for seq, coll in self.collectives.items() if self._blocks(rank, coll)]
        return self.fail_collectives(f"rank {rank} left the job (it called finalize())", seqs, named=True)

    def _blocks(self, rank: int, coll: Collective) -> bool:
        """Whether ``rank``, gone, can never enter ``coll``: always, unless it called ``finalize()``
        in one test and ``coll`` is another's - a rank may ``init()`` again in a later test of a warm
        world or a suite (if it never does, it leaves that test's call, which fails ``coll``)."""
        if rank not in self.gone:
            return False
        test = self.finalized_in.get(rank)
        return test is None or coll.test is None or test == coll.test

    def finished(self, ranks: list[int], why: str) -> Sends:
        """These ranks finished their test while still connected (a warm world): whoever waits for
        them - to form the group, or in a collective - gets an error now, worded as if they had
        exited (a fresh job's ranks exit when their test ends)."""
        out: Sends = []
        for rank in sorted(set(ranks)):
            if rank not in self.connected:
                out += self._unformed(f"rank {rank} {why} without joining the group")
            waiting = [seq for seq, coll in self.collectives.items() if rank not in coll.parts]
            out += self.fail_collectives(f"rank {rank} left the test ({why})", waiting, named=True)
        return out

    def expel(self, rank: int, refusal: str) -> Sends:
        """``rank`` broke the protocol (``refusal``: :meth:`entry_refusal`'s words); its connection is
        dropped, and whoever waits for it hears why."""
        return self.left(rank, f"its connection was dropped: {refusal}")

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
    def entry_refusal(self, rank: int, op: str, seq: int) -> str:
        """Why ``rank`` may not enter collective ``seq`` now ("" when it may): it is still in another
        one - or in this one already. A rank's collectives are sequential, so this is its protocol
        error, in O(1): its only pending part can be in the collective it entered last."""
        latest = self.latest.get(rank)
        coll = None if latest is None else self.collectives.get(latest)
        if coll is None or rank not in coll.parts:
            return ""
        this = f"{op_name(op)} #{seq}"
        what = f"{this} again" if seq == latest else this
        return (
            f"rank {rank} entered {what} while still in {op_name(coll.op)} #{latest}: a rank is in one collective "
            "at a time (one that timed out on the rank still counts it in until it completes or fails)"
        )

    def contribute(
        self,
        rank: int,
        op: str,
        seq: int,
        src: int,
        data: str | None,
        where: tuple[str, str] | None = None,
        order: int | None = None,
    ) -> Sends:
        """``rank`` entered collective ``seq`` (in test phase ``where``); when it completes,
        everyone gets the result. An entry :meth:`entry_refusal` refuses expels the rank (the
        caller drops its connection)."""
        refusal = self.entry_refusal(rank, op, seq)
        if refusal:
            return self.expel(rank, refusal)
        self.latest[rank] = seq
        call = where[0] if where is not None and where[1] == "call" else None
        if call is not None:
            self.calls.enter(rank, call)
        coll = self.collectives.get(seq)
        stale: Sends = []
        if coll is not None and where is not None and coll.where is not None and where[0] != coll.where[0]:
            # Entered in two tests. One side's test is one the other side has left the call of:
            # that side's entry can never complete (a teardown's collective one rank alone
            # entered): it fails alone, rewound, and the other side's stays; else both fail below.
            left = self.calls.away(rank, coll.where[0]) or self._past(rank, order, coll.order, coll.where[0])
            if left:
                stale = self._stale(seq, coll, sorted(coll.parts), left)
                del self.collectives[seq]
                coll = None
            else:
                behind = next((why for r in coll.parts if (why := self.calls.away(r, where[0]))), "")
                behind = behind or self._past(min(coll.parts), coll.order, order, where[0])
                if behind:
                    self.latest.pop(rank, None)
                    return self._stale(seq, Collective(op, src, set(range(self.world)), call), [rank], behind)
        if coll is None:
            coll = self.collectives[seq] = Collective(op, src, set(range(self.world)), call)
        if coll.order is None:
            coll.order = order
        # ``rank``'s part of ``coll``: the collective completes, fails, or waits.
        mismatch = ""
        if coll.op != op or coll.src != src:
            first = coll.op if coll.op != "bcast" else f"bcast(src={coll.src})"
            this = op if op != "bcast" else f"bcast(src={src})"
            mismatch = f"collective #{seq} mismatch: rank {rank} called {this}, another rank called {first}"
        elif where is not None and coll.where is not None and where[0] != coll.where[0]:
            # one collective is entered in one test, whatever the phase: a teardown's that a rank
            # alone entered must not pair with its peers' in a later test
            mismatch = (
                f"{op_name(op)} #{seq} mismatch: rank {rank} entered it in {short(where[0])}'s {where[1]}, "
                f"another rank in {short(coll.where[0])}'s {coll.where[1]}"
            )
        if mismatch:
            coll.parts[rank] = None
            return stale + self.fail_collectives(mismatch, [seq])
        coll.test = coll.test or call
        coll.where = coll.where or where
        coll.parts[rank] = data
        coll.size += json_bytes(data)
        coll.missing.discard(rank)
        self.last[rank] = f"{op} #{seq}"
        self.high[rank] = max(seq, self.high.get(rank, seq))
        blocking = sorted(r for r in self.gone if self._blocks(r, coll))
        if coll.missing and not blocking:
            return stale + self.stuck(rank)
        # Worded as when the rank leaves during a collective, whichever happens first.
        failed = ", ".join(f"rank {r} left the job ({self.gone[r]})" for r in blocking) or self._too_big(seq, coll)
        if failed:
            return stale + self.fail_collectives(failed, [seq], named=True)
        del self.collectives[seq]
        if op == "barrier":
            reply: dict[str, Any] = {"t": "coll", "seq": seq}
        elif op == "gather":
            reply = {"t": "coll", "seq": seq, "data": [coll.parts[r] for r in range(self.world)]}
        else:
            reply = {"t": "coll", "seq": seq, "data": coll.parts.get(src)}
        return stale + [(sorted(self.connected), reply)]

    @staticmethod
    def _past(rank: int, order: int | None, other: int | None, test: str) -> str:
        """Why ``rank``, in the test at place ``order``, is past ``test`` (at place ``other``): every rank
        runs the session's tests in one order ("" when unknown, or not past it)."""
        if order is None or other is None or order <= other:
            return ""
        return f"rank {rank} is past {short(test)} (it is in a later test)"

    def _stale(self, seq: int, coll: Collective, ranks: list[int], why: str) -> Sends:
        """``ranks``' entries of ``coll`` (#``seq``) can never complete (``why``): they fail, and the
        ranks go back to the collective before it, in step with their peers."""
        for rank in ranks:
            self.high[rank] = seq - 1
        text = f"{op_name(coll.op)} #{seq} cannot complete: {why}"
        peers = [r for r in ranks if r in self.connected]
        return [(peers, {"t": "error", "seq": seq, "reason": text, "rewind": seq - 1})] if peers else []

    def _too_big(self, seq: int, coll: Collective) -> str:
        """Why a complete all-gather's result cannot be sent: its frame exceeds the limit ("" if not).
        (A broadcast's result is smaller than the frame its source sent.)"""
        if coll.op != "gather" or self.limit is None:
            return ""
        size = gather_reply_bytes(seq, coll.size, self.world)
        if size <= self.limit:
            return ""
        return (
            f"its result, every rank's object together, is a message of {size} bytes, over the limit of "
            f"{self.limit} bytes ({LIMIT_ENV}); gather less, or raise {LIMIT_ENV} in msrun's environment"
        )

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
        doomed = [
            (seq, reasons, self._rewind(seq, coll))
            for seq, coll in self.collectives.items()
            if (moved in coll.missing or moved in coll.parts) and (reasons := self._blockers(seq, coll))
        ]
        return [
            (peers, msg if rewind is None else {**msg, "rewind": rewind})
            for seq, reasons, rewind in doomed
            for peers, msg in self.fail_collectives(reasons, [seq], named=True)
        ]

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
        reasons = [self._blocker(rank, seq, coll) for rank in sorted(coll.missing)]
        if not all(reasons):
            return ""
        if len(reasons) > 8:
            reasons[8:] = [f"and {len(reasons) - 8} more rank(s)"]
        return "; ".join(reasons)

    def _blocker(self, rank: int, seq: int, coll: Collective) -> str:
        if self._blocks(rank, coll):
            return f"rank {rank} left the job ({self.gone[rank]})"
        latest = self.latest.get(rank)
        other = None if latest is None or latest == seq else self.collectives.get(latest)
        if other is not None and rank in other.parts:  # the one collective it can be in
            return f"rank {rank} is in {op_name(other.op)} #{latest}"
        if self.high.get(rank, seq) > seq:
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
