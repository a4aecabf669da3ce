"""A client rank's rendezvous waits for rank 0's store to listen (pytest_msrun/control/torchstore.py).

torch's ``TCPStore`` client that connects before its server listens is refused and retries after
a randomized back-off (0.3-0.7 s); a rank of a local job connects only once the port listens.
The rule is checked against a stand-in for torch's ``_create_c10d_store`` (what it saw when it was
called); the torch tier runs it in real ranks.
"""

from __future__ import annotations

import socket
import sys
import threading
import types
from datetime import timedelta

import pytest

from pytest_msrun.control import torchstore

MODULE = "torch.distributed.rendezvous"


@pytest.fixture
def rendezvous(monkeypatch):
    """A stand-in ``torch.distributed.rendezvous`` whose ``_create_c10d_store`` records, per call,
    whether its port listened when it was called; the wrapper installed on it."""
    calls: list[tuple[int, bool]] = []
    module = types.ModuleType(MODULE)

    def create(hostname, port, rank, world_size, timeout, use_libuv=True):
        calls.append((rank, torchstore.listening(port)))
        return "store"

    module._create_c10d_store = create  # type: ignore[attr-defined]
    module._torchelastic_use_agent_store = lambda: False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MODULE, module)
    torchstore.install()
    torchstore.install()  # (once: a second install wraps nothing more)
    assert module._create_c10d_store.__wrapped__ is create  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_listening_sees_a_listening_socket_and_only_that(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    assert not torchstore.listening(port)  # bound, not listening
    server.listen()
    assert torchstore.listening(port)
    server.close()
    assert not torchstore.listening(port)


def test_a_client_rank_connects_only_once_the_store_listens(rendezvous, monkeypatch):
    port = _free_port()
    polling = threading.Event()
    look = torchstore.listening

    def watched(p: int) -> bool:
        polling.set()
        return look(p)

    monkeypatch.setattr(torchstore, "listening", watched)
    result: list[object] = []
    client = threading.Thread(
        target=lambda: result.append(rendezvous._create_c10d_store("127.0.0.1", port, 1, 2, timedelta(seconds=60)))
    )
    client.start()
    assert polling.wait(30), "the client rank did not wait for the store"
    assert rendezvous.calls == []  # not connected while nothing listens
    server = socket.socket()
    server.bind(("127.0.0.1", port))
    server.listen()
    try:
        client.join(30)
        assert result == ["store"] and rendezvous.calls == [(1, True)]
    finally:
        server.close()


@pytest.mark.parametrize(
    "host, rank, agent",
    [("127.0.0.1", 0, False), ("192.0.2.1", 1, False), ("127.0.0.1", 1, True)],
    ids=["rank 0 hosts the store", "the store on another host", "torchelastic's agent hosts it"],
)
def test_nothing_waits_where_the_store_is_not_this_host_s_rank_0_s(rendezvous, host, rank, agent):
    rendezvous._torchelastic_use_agent_store = lambda: agent
    port = _free_port()
    assert rendezvous._create_c10d_store(host, port, rank, 2, timedelta(seconds=60)) == "store"
    assert rendezvous.calls == [(rank, False)]


def test_a_store_that_never_listens_is_torch_s_own_timeout(rendezvous):
    port = _free_port()
    assert rendezvous._create_c10d_store("localhost", port, 1, 2, timedelta(seconds=0.05)) == "store"
    assert rendezvous.calls == [(1, False)]  # torch then times out as it always did


TORCH_JOB = """
import os, sys, time
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
if rank == 0:  # rank 0's store comes late: rank 1 asks first
    while not os.path.exists(os.environ["ASKED"]):
        time.sleep(0.01)
else:
    open(os.environ["ASKED"], "w").close()
dist.init_process_group("gloo")
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
assert t.item() == 3.0
waits = getattr(sys.modules["torch.distributed.rendezvous"]._create_c10d_store, "_msrun_waits", False)
print(f"rank {rank} waits={waits}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.torch
def test_a_torch_job_s_client_rank_asks_first_and_the_group_forms(msrun):
    """Rank 1 reaches ``init_process_group`` before rank 0's store exists: it waits for it (the
    rank hook's wrapper is in place), and the group forms."""
    script = msrun.script("late_store.py", TORCH_JOB)
    args = ["--worker_num=2", "--local_worker_num=2", "--join=True", "--log_dir=logs", str(script)]
    job = msrun.run(args, env={"ASKED": str(msrun.cwd / "asked")})
    assert job.returncode == 0, job.stderr
    logs = "".join((msrun.cwd / "logs" / f"worker_{r}.log").read_text() for r in (0, 1))
    assert "rank 0 waits=True" in logs and "rank 1 waits=True" in logs, logs
