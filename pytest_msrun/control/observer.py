"""Read the builtin control plane's state from outside the job (an authenticated observer).

The state says which ranks joined the group, which collective each rank entered last, which
collectives are waiting for whom, and which ranks left or whose process exited - what a hang
diagnosis needs besides the ranks' stacks.
"""

from __future__ import annotations

from typing import Any

from pytest_msrun.control import wire


def query_state(
    host: str, port: int, token: str, timeout: float = 2.0, msg: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The scheduler's state (its answer to ``msg``, else to asking for it) as an authenticated
    observer, or None when it cannot be reached in ``timeout`` seconds."""
    try:
        channel = wire.Channel.connect(host, port, timeout=timeout)
    except OSError:
        return None
    try:
        channel.handshake({"t": "hello", "kind": "observer"}, token, timeout)
        channel.send(msg or {"t": "state"})
        reply = channel.recv(timeout)
    except (OSError, wire.ProtocolError):  # socket.timeout is an OSError
        return None
    finally:
        channel.close()
    return reply if reply.get("t") == "state" else None


def declare_finished(host: str, port: int, token: str, ranks: list[int], why: str, timeout: float = 2.0) -> bool:
    """Tell the control plane these ranks finished their test (waits on them fail at once)."""
    return query_state(host, port, token, timeout, {"t": "finished", "ranks": ranks, "why": why}) is not None


def query_from_env(env: dict[str, str]) -> dict[str, Any] | None:
    """The state of the job this process belongs to (its ``MS_SCHED_*`` and token variables)."""
    if env.get("MSRUN_SCHEDULER") not in ("auto", "builtin", "mindspore"):
        return None
    try:
        host, port = env["MS_SCHED_HOST"], int(env["MS_SCHED_PORT"])
    except (KeyError, ValueError):
        return None
    return query_state(host, port, env.get("MSRUN_JOB_TOKEN", ""))


def waiting_for_others(state: Any, rank: int, world: int) -> bool:
    """Whether the control plane's ``state`` shows ``rank`` waiting for ranks not there yet: to
    form the group, or in a collective."""
    if not isinstance(state, dict):
        return False
    everyone = set(range(world))
    joined = set(state.get("joined") or [])
    if not state.get("ready") and rank in joined and everyone - joined:
        return True
    return any(
        isinstance(c, dict) and rank in (c.get("ranks") or []) and everyone - set(c.get("ranks") or [])
        for c in state.get("collectives") or []
    )
