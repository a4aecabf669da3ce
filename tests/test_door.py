"""The one door of every listener (control plane, warm worlds, the ranks' debugger).

Invariants, each checked here against real sockets:

* a connection gets in only by proving the token; whatever a stranger sends - fragmented,
  malformed, deeply nested, not UTF-8, out of order - ends with that connection dropped and
  counted, never an exception out of the door and never an admission;
* the door never holds more than ``max_pending`` strangers, never sheds one within its grace
  (after it connected, after its challenge), and reads one before it sheds it: a client that
  answers gets in, however many strangers crowd the door, from its own address or another;
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


class Clock:
    """The door's clock, moved by the test alone."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _flood(port: int, count: int, hello: bool, source: str = "127.0.0.1") -> list[socket.socket]:
    """``count`` strangers that never answer: silent, or with a whole hello."""
    frame = wire.encode({"t": "hello", "kind": "world", "nonce": "ab" * 16})
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        if hello:
            s.sendall(frame)
        socks.append(s)
    return socks


def _watch_sheds(d: Door) -> list[tuple[float, float]]:
    """(when, since) of each stranger shed: the test's oracle for "never within its grace"."""
    sheds: list[tuple[float, float]] = []
    drop = d._drop

    def watched(stranger, why):
        if why.startswith("shed"):
            sheds.append((d.now(), stranger.since))
        drop(stranger, why)

    d._drop = watched  # type: ignore[method-assign]
    return sheds


@pytest.fixture(scope="module")
def many_fds():
    """Room for a few thousand sockets (a flood and the door's side of it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_client_whose_answer_waits_is_read_before_it_could_be_shed():
    """Past its grace, with more strangers behind it than the door keeps: a client whose answer
    waits in its socket gets in - it is read before it is shed."""
    clock = Clock()
    d = Door(
        socket.create_server(("127.0.0.1", 0), backlog=4096), token=TOKEN, kinds=("world",), timeout=30.0, now=clock
    )
    port = _port(d)
    socks, admitted = [], []
    try:
        client = wire.Channel.connect("127.0.0.1", port, timeout=5)
        client.send({"t": "hello", "kind": "world", "rank": 0, "nonce": "cd" * 8})
        _serve_until(d, admitted, lambda: any(s.hello for s in d.strangers))
        challenge = client.recv(5)
        client.send({"t": "auth", "proof": wire.proof(TOKEN, "world", "cd" * 8, challenge["nonce"])})
        clock.t += d.grace  # its answer is sent but not read, and its grace is over
        socks = _flood(port, d.max_pending, hello=False)
        _serve_until(d, admitted, lambda: bool(admitted))
        assert [a.hello["rank"] for a in admitted] == [0] and client.recv(5)["t"] == "welcome"
        assert len(d.strangers) <= d.max_pending and not d.tally.totals
        client.close()
    finally:
        _close_all(admitted)
        for s in socks:
            s.close()
        d.close()


@settings(
    max_examples=12,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(
                st.just("flood"), st.integers(1, 300), st.booleans(), st.sampled_from(["127.0.0.1", "127.0.0.2"])
            ),
            st.tuples(st.just("client"), st.sampled_from(["127.0.0.1", "127.0.0.2"])),
            st.tuples(st.just("tick"), st.floats(0.0, 0.6)),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_a_flood_never_keeps_a_client_out_nor_sheds_within_a_grace(many_fds, steps):
    """Floods of silent strangers and of hellos that never answer, from the clients' address or
    another, clients among them, time moving on: the door never holds more than ``max_pending``
    strangers, never sheds one within its grace, and every client gets in."""
    clock = Clock()
    d = Door(
        socket.create_server(("127.0.0.1", 0), backlog=4096), token=TOKEN, kinds=("world",), timeout=30.0, now=clock
    )
    sheds = _watch_sheds(d)
    port = _port(d)
    socks: list[socket.socket] = []
    admitted: list = []
    clients: list[tuple[threading.Thread, list]] = []

    def serve() -> None:
        admitted.extend(d.serve(0))
        assert len(d.strangers) <= d.max_pending

    def client(source: str, rank: int, result: list) -> None:
        def connect() -> wire.Channel:
            s = socket.socket()
            s.bind((source, 0))
            s.settimeout(60)
            s.connect(("127.0.0.1", port))
            return wire.Channel(s)

        try:  # as wire.Channel.join: dropped before its welcome, it tries again
            while True:
                ch = connect()
                try:
                    ch.handshake({"t": "hello", "kind": "world", "rank": rank}, TOKEN, 60)
                    result.append(ch)
                    return
                except (OSError, wire.ProtocolError) as exc:
                    ch.close()
                    if isinstance(exc, wire.AuthError):
                        raise
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result.append(exc)

    try:
        for step in steps:
            if step[0] == "flood":
                for s in _flood(port, step[1], step[2], step[3]):
                    socks.append(s)
                    if len(socks) % 50 == 0:
                        serve()
            elif step[0] == "client":
                result: list = []
                t = threading.Thread(target=client, args=(step[1], len(clients), result), daemon=True)
                t.start()
                clients.append((t, result))
            else:
                clock.t += step[1]
            serve()
        deadline = time.monotonic() + 60
        while any(t.is_alive() for t, _ in clients):  # the flood stays; time moves on
            assert time.monotonic() < deadline, "a client did not get in"
            serve()
            clock.t += 0.01
        assert all(isinstance(r[0], wire.Channel) for _, r in clients), [r for _, r in clients]
        assert sorted(a.hello["rank"] for a in admitted) == list(range(len(clients)))
        assert all(when >= since + d.grace for when, since in sheds), sheds
    finally:
        for _, r in clients:
            if r and isinstance(r[0], wire.Channel):
                r[0].close()
        _close_all(admitted)
        for s in socks:
            s.close()
        d.close()


def test_a_flood_is_made_to_wait_in_the_kernels_queue():
    """More strangers than the door keeps, all within their grace: accepting pauses (the owner is
    told how long it may wait), nobody is shed early, and the door takes the rest in turn."""
    clock = Clock()
    d = Door(
        socket.create_server(("127.0.0.1", 0), backlog=4096), token=TOKEN, kinds=("world",), timeout=30.0, now=clock
    )
    sheds = _watch_sheds(d)
    socks = []
    try:
        socks = _flood(_port(d), d.max_pending + 50, hello=True)
        admitted: list = []
        full = lambda: len(d.strangers) == d.max_pending and all(s.hello for s in d.strangers)  # noqa: E731
        _serve_until(d, admitted, lambda: full() and d.paused_until)  # every one challenged
        assert d.paused_until == clock.t + d.grace and d.wait(5.0) == pytest.approx(d.grace) and not sheds
        clock.t += d.grace
        assert d.wait(5.0) == 5.0 and not d.paused_until  # the pause is over
        _serve_until(d, admitted, lambda: len(sheds) == 50)
        assert len(d.strangers) == d.max_pending and not admitted
        assert all(when >= since + d.grace for when, since in sheds)
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
