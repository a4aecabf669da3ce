"""What the controller and its ranks share across the process boundary: the variables that name
the controller's doors (a warm world's, the debugger's), the channel a world speaks both ways, and
a rank joining its world.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pytest_msrun.control import wire

WORLD_ENV = "MSRUN_WORLD"  # host:port of the controller's world door
WORLD_TOKEN_ENV = "MSRUN_WORLD_TOKEN"
FORK_ENV = "MSRUN_WORLD_FORK"  # set in a forking world's ranks
DEBUG_ENV = "MSRUN_DEBUG"  # host:port of the controller's debug server
DEBUG_TOKEN_ENV = "MSRUN_DEBUG_TOKEN"
DEBUG_PDB_ENV = "MSRUN_DEBUG_PDB"  # "1": the controller runs --pdb (post-mortem on a failure)
DEBUG_NONE_ENV = "MSRUN_DEBUG_NONE"  # why no debugger serves the ranks (then MSRUN_DEBUG is unset)


class Channel(wire.Channel):
    """The world's connection, both ways: frames of :mod:`pytest_msrun.control.wire` (the door's
    handshake first). Messages read ahead stay pending (the peer may send two in a row - a forked
    child's ``done``, its template's ``ended``): a reader waiting on the socket must first look there."""

    def receive(self) -> dict[str, Any] | None:
        """The next message, waiting for it; None once the peer closed. A malformed frame is a
        :class:`ValueError`."""
        try:
            return self.recv()
        except wire.PeerClosed:
            return None
        except wire.ProtocolError as exc:
            raise ValueError(str(exc)) from None


def join_world(address: tuple[str, int], token: str, rank: int, timeout: float = 30.0) -> Channel:
    """Connect to the controller's world door and prove the world's token as ``rank``; tried again
    while the door sheds or drops this connection (strangers may crowd it), until ``timeout``."""
    hello = {"t": "hello", "kind": "world", "rank": rank, "pid": os.getpid()}
    channel = Channel.join(address[0], address[1], hello, token, time.monotonic() + timeout)
    channel.sock.settimeout(None)
    return channel
