"""The one door of every listener (control plane, warm worlds, the ranks' debugger).

Invariants, each checked here against real sockets:

* a connection gets in only by proving the token; whatever a stranger sends - fragmented,
  malformed, deeply nested, not UTF-8, out of order - ends with that connection dropped and
  counted, never an exception out of the door and never an admission;
* the door never holds more than ``max_pending`` strangers, nor more than half of them from one
  address; a client whose answer is waiting is read before anyone is shed, so it gets in;
* a stranger learns nothing computed from the token (the challenge is a bare nonce);
* strangers are summed up at most once per address per window, never a line each;
* descriptors numbered 1024 and above are served like any other.
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_input import bodies, deep, hostile_fields, streams

from pytest_msrun.control import door as door_module
from pytest_msrun.control import wire
from pytest_msrun.control.door import Door

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def door():
    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    d = Door(listener, token=TOKEN, kinds=("world",), timeout=5.0)
    yield d
    d.close()


def _port(d: Door) -> int:
    return int(d.listener.getsockname()[1])


def _join(port: int, token: str = TOKEN, rank: int = 0, result: list | None = None) -> None:
    """A client that proves ``token`` (on a thread: the door is served by the test)."""
    try:
        ch = wire.Channel.connect("127.0.0.1", port, timeout=10)
        ch.handshake({"t": "hello", "kind": "world", "rank": rank}, token, 10)
        ch.send({"t": "after", "rank": rank})
        out = ("in", ch)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = ("error", exc)
    if result is not None:
        result.append(out)


def _serve_until(d: Door, admitted: list, predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        admitted += d.serve(0.02)


def _close_all(admitted) -> None:
    for a in admitted:
        a.sock.close()


@settings(
    max_examples=200,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(strangers=st.lists(streams(), min_size=1, max_size=4))
def test_strangers_never_get_in_and_the_owner_still_does(door, strangers):
    """Fuzzed frames from several strangers, then a client with the token: only the client gets
    in, with what it sent after its handshake; nothing a stranger sent raised or blocked."""
    port = _port(door)
    socks, admitted, result = [], [], []
    try:
        for pieces in strangers:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            socks.append(s)
            for piece in pieces:
                try:
                    s.sendall(piece)
                except OSError:
                    break
                admitted += door.serve(0)
        client = threading.Thread(target=_join, args=(port, TOKEN, 3, result))
        client.start()
        _serve_until(door, admitted, lambda: bool(admitted) and not client.is_alive())
        client.join()
        assert [a.hello.get("rank") for a in admitted] == [3]
        assert result[0][0] == "in", result
        after = admitted[0].messages + wire.FrameBuffer(wire.message_limit()).feed(admitted[0].rest)
        if not after:  # its first message may come with a later read
            admitted[0].sock.settimeout(5)
            after = wire.FrameBuffer(wire.message_limit()).feed(admitted[0].sock.recv(1 << 16))
        assert after == [{"t": "after", "rank": 3}]
        result[0][1].close()
    finally:
        _close_all(admitted)
        for s in socks:
            s.close()


@settings(
    max_examples=100,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    lines=st.lists(
        st.one_of(
            bodies,
            hostile_fields.map(lambda f: json.dumps({"t": "hello", "kind": "world", **f}).encode()),
            deep().map(lambda d: ('{"t":"hello","kind":"world","nonce":' + d + "}").encode()),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_hostile_hellos_are_counted_by_the_doors_words_only(door, lines):
    """Hellos with hostile fields (lone surrogates, deep nesting, huge numbers, wrong types):
    dropped and counted under reasons the door chose - never text the stranger sent."""
    port = _port(door)
    socks = []
    try:
        for line in lines:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(struct.pack(">I", len(line)) + line)
            s.shutdown(socket.SHUT_WR)
            socks.append(s)
        admitted: list = []
        _serve_until(door, admitted, lambda: not door.strangers or all(x.hello for x in door.strangers))
        assert not admitted
        allowed = {
            "a malformed frame",
            "its first message is not a hello",
            "a hello whose nonce is not hex digits",
            "closed before it proved the token",
        }
        assert set(door.tally.totals) <= allowed, door.tally.totals
    finally:
        for s in socks:
            s.close()


def test_the_challenge_carries_nothing_computed_from_the_token(door):
    """What a stranger gets for a valid hello is a bare nonce: nothing to test guesses against."""
    port = _port(door)
    s = wire.Channel.connect("127.0.0.1", port, timeout=5)
    s.send({"t": "hello", "kind": "world", "nonce": "ab" * 16})
    replies: list = []
    t = threading.Thread(target=lambda: replies.append(s.recv(10)))
    t.start()
    admitted: list = []
    _serve_until(door, admitted, lambda: not t.is_alive())
    assert set(replies[0]) == {"t", "nonce"} and replies[0]["t"] == "challenge"
    s.close()


def test_a_wrong_token_is_told_so_and_counted(door):
    result: list = []
    t = threading.Thread(target=_join, args=(_port(door), "f" * 16 + "0123456789abcdef", 0, result))
    t.start()
    admitted: list = []
    _serve_until(door, admitted, lambda: not t.is_alive())
    assert result[0][0] == "error" and isinstance(result[0][1], wire.AuthError), result
    assert "bad token" in str(result[0][1])
    assert door.tally.totals == {"refused: bad token": 1} and not admitted


def test_a_client_that_answered_is_read_before_anyone_is_shed():
    """More silent strangers than the door keeps: a client whose answer waits in its socket gets in."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    d = Door(listener, token=TOKEN, kinds=("world",), timeout=30.0, max_pending=0)
    port = _port(d)
    socks, admitted = [], []
    try:
        result: list = []
        client = threading.Thread(target=_join, args=(port, TOKEN, 0, result))
        client.start()
        _serve_until(d, admitted, lambda: any(s.hello for s in d.strangers) or admitted)
        for _ in range(d.max_pending * 2):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            admitted += d.serve(0)
        _serve_until(d, admitted, lambda: not client.is_alive())
        assert [a.hello["rank"] for a in admitted] == [0] and result[0][0] == "in"
        assert len(d.strangers) <= d.max_pending
        assert d.tally.totals.get("shed (more than 128 strangers from one address)", 0) >= d.max_pending // 2
        result[0][1].close()
    finally:
        _close_all(admitted)
        for s in socks:
            s.close()
        d.close()


def test_one_address_holds_at_most_half_of_the_door():
    """A flood from one address fills at most half of the door: the other half stays for others."""
    listener = socket.create_server(("0.0.0.0", 0), backlog=4096)
    d = Door(listener, token=TOKEN, kinds=("world",), timeout=30.0)
    port = _port(d)
    socks, admitted = [], []
    try:
        for _ in range(d.max_pending):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            admitted += d.serve(0)
        _serve_until(d, admitted, lambda: len(d.strangers) >= d.per_peer)
        assert len(d.by_ip["127.0.0.1"]) == d.per_peer
        others = []
        for _ in range(10):  # another address of this host: 127.0.0.2
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", port))
            others.append(s)
        socks += others
        _serve_until(d, admitted, lambda: len(d.by_ip.get("127.0.0.2", {})) == 10)
        assert len(d.strangers) <= d.max_pending and not admitted
    finally:
        for s in socks:
            s.close()
        d.close()


def test_strangers_are_summed_up_once_per_address_per_window(door, monkeypatch):
    """A thousand refused strangers make one line per address, in the door's words; a lone
    surrogate in a nonce is one of them."""
    port = _port(door)
    bad = json.dumps({"t": "hello", "kind": "world", "nonce": "\ud800"}).encode()
    admitted: list = []
    for i in range(1000):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(struct.pack(">I", len(bad)) + bad if i % 2 else b"GET / HTTP/1.1\r\n\r\n")
        s.close()
        if i % 50 == 0:
            admitted += door.serve(0)
    _serve_until(door, admitted, lambda: sum(door.tally.totals.values()) >= 1000)
    assert door.tally.summary(door.now()) == []  # the window is still open
    lines = door.tally.summary(door.now(), force=True)
    assert len(lines) == 1 and lines[0].startswith("dropped 1000 connection(s) from 127.0.0.1"), lines
    assert "500 a hello whose nonce is not hex digits" in lines[0] and "500 a malformed frame" in lines[0]
    assert door.tally.summary(door.now(), force=True) == []


def test_an_unauthenticated_door_welcomes_a_hello(door):
    """A job without a token (msrun warned loudly): a hello is welcomed as it comes."""
    listener = socket.create_server(("127.0.0.1", 0))
    d = Door(listener, token="", kinds=("world",), timeout=5.0)
    result: list = []
    t = threading.Thread(target=_join, args=(_port(d), "", 2, result))
    t.start()
    admitted: list = []
    try:
        _serve_until(d, admitted, lambda: not t.is_alive() and bool(admitted))
        assert result[0][0] == "in" and [a.hello["rank"] for a in admitted] == [2]
        result[0][1].close()
    finally:
        _close_all(admitted)
        d.close()


def test_descriptors_past_1024_are_served():
    """``selectors``, not ``select``: a door whose process holds more than 1024 descriptors works."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard limit on open files is {hard} here; this test needs 2048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    ballast = [socket.socket() for _ in range(1100)]
    listener = socket.create_server(("127.0.0.1", 0))
    d = Door(listener, token=TOKEN, kinds=("world",), timeout=5.0)
    assert listener.fileno() >= 1024
    result: list = []
    admitted: list = []
    try:
        t = threading.Thread(target=_join, args=(_port(d), TOKEN, 1, result))
        t.start()
        _serve_until(d, admitted, lambda: not t.is_alive() and bool(admitted))
        assert result[0][0] == "in" and admitted[0].sock.fileno() >= 1024
        result[0][1].close()
    finally:
        _close_all(admitted)
        d.close()
        for s in ballast:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_summaries_name_at_most_a_few_addresses():
    tally = door_module.Tally(0.0)
    for i in range(50):
        tally.add(f"10.0.0.{i}", "a malformed frame")
    lines = tally.summary(door_module.SUMMARY_EVERY + 1, force=False)
    assert len(lines) == door_module.SUMMARY_ADDRESSES + 1
    assert lines[-1].startswith(f"dropped {50 - door_module.SUMMARY_ADDRESSES} connection(s) from 42 other")
