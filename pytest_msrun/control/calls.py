"""Where each rank is in its tests, as the control plane knows it (no sockets).

A rank that has joined the group tells the control plane when it enters and leaves a test's call
phase (``{"t": "call", "test": nodeid, "state": "in"|"out", "outcome": ...}``), and tags each
collective with the test phase it runs in (``"test"``, ``"when"``, from pytest's
``PYTEST_CURRENT_TEST``) and the test's place in the session (``"order"``: every rank runs its
tests in one order, so a rank in a later test is past an earlier one's collectives). From that,
:class:`CallStates` says of a rank missing from a collective entered during a test's call whether
it has left that call (so it will never join it). The state is kept per test: entering a test's
call again (a warm world running it again) clears what was known of it; at most
:data:`REMEMBERED` left calls are kept per rank.

Frames are parsed totally: anything malformed is ``None`` (the scheduler then drops that rank's
connection), never an exception.
"""

from __future__ import annotations

from pytest_msrun.control.wire import is_int

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

OP_NAMES = {"barrier": "barrier", "gather": "all_gather", "bcast": "broadcast"}
REMEMBERED = 256  # left calls remembered per rank (a suite's ranks may be a few tests apart)
MAX_TEST = 4096  # characters of a node id kept
MAX_OUTCOME = 200
PHASES = ("setup", "call", "teardown")
# This rank's current test's place in its session (its pytest plugin sets it; 0: none): every
# rank runs its tests in one order, and its collectives say it (``"order"``).
place = 0


def op_name(op: str) -> str:
    """The in-rank API's name of a wire operation (``gather`` -> ``all_gather``)."""
    return OP_NAMES.get(op, op)


def short(test: str) -> str:
    """A test's name as a message says it: the last part of its node id."""
    return test.rsplit("::", 1)[-1] or test


def parse_order(msg: dict[str, Any]) -> int | None:
    """A collective's test's place in the session (``"order"``), or None when absent or malformed."""
    order = msg.get("order")
    return order if is_int(order, 0, (1 << 40) - 1) else None


def parse_notice(msg: dict[str, Any]) -> tuple[str, str, str] | None:
    """``(state, test, outcome)`` of a call notice, or None when it is malformed."""
    state, test, outcome = msg.get("state"), msg.get("test"), msg.get("outcome", "")
    if state not in ("in", "out") or not isinstance(test, str) or not test or not isinstance(outcome, str):
        return None
    return state, test[:MAX_TEST], outcome[:MAX_OUTCOME]


def parse_where(msg: dict[str, Any]) -> tuple[str, str] | None | bool:
    """The test phase a collective was entered in: ``(test, when)``, None when untagged (outside
    a test, or not under pytest), False when the tag is malformed."""
    test, when = msg.get("test"), msg.get("when")
    if test is None and when is None:
        return None
    if not isinstance(test, str) or not test or when not in PHASES:
        return False
    return test[:MAX_TEST], str(when)


class CallStates:
    """Each rank's test call: the one it is in, and the ones it has left (with their outcome)."""

    def __init__(self) -> None:
        self.in_call: dict[int, str] = {}
        self.left: dict[int, dict[str, str]] = {}

    def enter(self, rank: int, test: str) -> None:
        self.in_call[rank] = test
        self.left.get(rank, {}).pop(test, None)

    def leave(self, rank: int, test: str, outcome: str) -> None:
        if self.in_call.get(rank) == test:
            del self.in_call[rank]
        left = self.left.setdefault(rank, {})
        left.pop(test, None)
        left[test] = outcome or "ended"
        while len(left) > REMEMBERED:
            del left[next(iter(left))]

    def away(self, rank: int, test: str) -> str:
        """Why ``rank`` will not join a collective entered in ``test``'s call ("" when it may)."""
        outcome = self.left.get(rank, {}).get(test)
        if self.in_call.get(rank) == test or outcome is None:
            return ""
        text = f"rank {rank} has left {short(test)}'s call ({outcome})"
        now = self.in_call.get(rank)
        return f"{text} and is in {short(now)}'s call" if now is not None else text

    def snapshot(self) -> dict[str, Any]:
        return {str(r): t for r, t in sorted(self.in_call.items())}
