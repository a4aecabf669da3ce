"""A rank's ``env://`` (and ``tcp://``) rendezvous waits for rank 0's store to listen before it connects.

``init_process_group`` makes rank 0 the ``TCPStore`` server and every other rank a client. A client
that connects before rank 0 listens is refused, and torch retries after a randomized back-off:
0.3-0.7 s whenever rank 1 gets there first - which is a coin toss for ranks that start together
(a world's, a forking world's children, a fresh job's). torchrun avoids it by hosting the store in
its agent before the workers start; here each client rank waits, on this host, until the store's
port has a listening socket (``/proc/net/tcp``, ``/proc/net/tcp6``: nothing connects, so the
store sees nothing more), polling every 2 ms, then connects as torch would. A store on another
host, or a wait past the rendezvous's timeout, is torch's own as before.

Installed by msrun's rank hook once torch is imported (:func:`install`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

POLL = 0.002  # s between two looks at the listening sockets
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"


def listening(port: int) -> bool:
    """Whether a socket of this network namespace listens on TCP ``port`` (any address)."""
    want = f":{port:04X}"
    for table in _TABLES:
        try:
            with open(table, encoding="ascii") as fh:
                next(fh, None)
                for line in fh:
                    fields = line.split(None, 4)
                    if len(fields) > 3 and fields[3] == _LISTEN and fields[1].endswith(want):
                        return True
        except OSError:
            continue
    return False


def _local(host: str) -> bool:
    from pytest_msrun.netaddr import is_local_address, resolve_master_addr

    if host in ("localhost", os.uname().nodename):
        return True
    try:
        return is_local_address(resolve_master_addr(host))
    except (OSError, ValueError):  # (AddressError is a ValueError)
        return False


def await_listener(host: str, port: int, seconds: float) -> bool:
    """Wait (at most ``seconds``) until ``port`` listens here, where ``host`` is this host; whether it does."""
    if not 0 < port < 65536 or not _local(host):
        return False
    deadline = time.monotonic() + max(0.0, seconds)
    while not listening(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)
    return True


def install() -> None:
    """Wrap ``torch.distributed.rendezvous._create_c10d_store``: a client rank waits for the
    listener first (a torch without it, or with another signature, is left as it is)."""
    module = sys.modules.get("torch.distributed.rendezvous")
    create = getattr(module, "_create_c10d_store", None)
    if module is None or create is None or getattr(create, "_msrun_waits", False):
        return

    def _create_c10d_store(
        hostname: Any, port: Any, rank: Any, world_size: Any, timeout: Any, *args: Any, **kwargs: Any
    ) -> Any:
        agent = getattr(module, "_torchelastic_use_agent_store", lambda: False)()
        if rank != 0 and not agent and isinstance(port, int) and isinstance(hostname, str):
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else 0.0
            await_listener(hostname, port, seconds)
        return create(hostname, port, rank, world_size, timeout, *args, **kwargs)

    _create_c10d_store._msrun_waits = True  # type: ignore[attr-defined]
    _create_c10d_store.__wrapped__ = create  # type: ignore[attr-defined]
    setattr(module, "_create_c10d_store", _create_c10d_store)  # noqa: B010 - a module of torch
