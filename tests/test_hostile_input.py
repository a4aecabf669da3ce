"""No stranger can end a job: whatever arrives before authentication is parsed totally.

Invariant: every byte sequence a stranger can send - to the control plane's port, or to a warm
world's door in the pytest controller - is either a valid message or rejected with
``ProtocolError`` / ``Rejected``; nothing else escapes, and a running job it is sent to ends
with exit 0 while its control plane's memory stays bounded.

The parsers are checked against a small independent oracle (``json.loads`` with no limits, and a
recursive depth count of what it returns), on structure-aware inputs: nesting of every JSON
container, huge numbers, invalid UTF-8, truncated and fragmented frames, valid hellos with
hostile fields, and messages out of order.
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import time

import psutil
import pytest
from conftest import free_port, job_args, record, wait_running
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pytest_msrun import boundedjson
from pytest_msrun.control import calls, wire
from pytest_msrun.control.group import RankGroup
from pytest_msrun.control.transport import Transport

# ---------------------------------------------------------------- strategies
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=40,
)


@st.composite
def deep(draw) -> str:
    """A value nested ``depth`` levels, each level an array or an object, closed or cut short."""
    depth = draw(st.one_of(st.integers(1, 12), st.integers(13, 3000)))
    kinds = draw(st.lists(st.sampled_from(["[", '{"k":']), min_size=1, max_size=3))
    opens = [kinds[i % len(kinds)] for i in range(depth)]
    closes = ["]" if o == "[" else "}" for o in reversed(opens)]
    cut = draw(st.sampled_from(["whole", "open only", "half"]))
    if cut == "open only":
        return "".join(opens)
    if cut == "half":
        return "".join(opens) + "1" + "".join(closes[: depth // 2])
    return "".join(opens) + "1" + "".join(closes)


numbers = st.one_of(
    st.integers(1, 20000).map(lambda n: "9" * n),
    st.integers(1, 5000).map(lambda n: "1e" + "9" * n),
    st.integers(1, 5000).map(lambda n: "-0." + "0" * n + "1"),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", "1E+2", "01", "1.", ".5"]),
)
bad_utf8 = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xef\xbb\xbf{}"]),
)


def hello(**fields) -> dict:
    return {"t": "hello", "kind": "rank", "nonce": "n" * 32, **fields}


hostile_fields = st.dictionaries(
    st.sampled_from(["t", "kind", "nonce", "rank", "world", "node_rank", "local", "pid", "proof", "host", "ip"]),
    st.one_of(values, st.text(max_size=3000), st.integers(-(2**80), 2**80)),
    max_size=5,
)
json_texts = st.one_of(
    values.map(json.dumps),
    deep(),
    numbers,
    numbers.map(lambda n: '{"t":"hello","kind":"agent","nonce":"x","pid":' + n + "}"),
    deep().map(lambda d: '{"t":"hello","kind":"rank","nonce":' + d + "}"),
    hostile_fields.map(lambda f: json.dumps(hello(**f))),
    st.sampled_from(["auth", "coll", "call", "bye", "hb", "done", "failed", "state", "finished"]).map(
        lambda t: json.dumps({"t": t, "proof": "0" * 64, "ranks": [0, 1], "test": "t::x", "state": "out"})
    ),
)
bodies = st.one_of(json_texts.map(lambda s: s.encode("utf-8", "surrogatepass")), bad_utf8)


@st.composite
def streams(draw) -> list[bytes]:
    """What one connection sends: frames (some lying about their length), cut into pieces."""
    frames = []
    for body in draw(st.lists(bodies, min_size=1, max_size=4)):
        how = draw(st.sampled_from(["honest", "honest", "honest", "short", "huge", "zero"]))
        if how == "short":  # announces more than it sends
            frames.append(struct.pack(">I", len(body) + draw(st.integers(1, 100))) + body)
        elif how == "huge":
            frames.append(struct.pack(">I", draw(st.integers(wire.HELLO_LIMIT + 1, 2**32 - 1))) + body[:64])
        elif how == "zero":
            frames.append(struct.pack(">I", 0))
        else:
            frames.append(struct.pack(">I", len(body)) + body)
    data = b"".join(frames)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    pieces, start = [], 0
    for cut in [*cuts, len(data)]:
        pieces.append(data[start:cut])
        start = cut
    return [p for p in pieces if p]


def depth_of(value) -> int:
    """The oracle's nesting depth: 0 for a scalar, 1 for a flat array or object (iterative: the
    values it measures may nest as deep as json.loads goes)."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (list, dict)):
            level += 1
            todo.extend((v, level) for v in (item.values() if isinstance(item, dict) else item))
        deepest = max(deepest, level)
    return deepest


def oracle(text: str):
    """json.loads with no limits, or None where it fails (any exception)."""
    try:
        return ("ok", json.loads(text))
    except Exception:
        return None


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


FAST = settings(max_examples=3000, database=None, deadline=None)


# ---------------------------------------------------------------- the parser, against the oracle
@FAST
@given(text=json_texts, max_depth=st.integers(1, 64))
def test_bounded_json_is_total_and_agrees_with_the_oracle(text, max_depth):
    """Accepted exactly when the oracle parses it within the depth and number bounds, and then to
    the same value; rejected (never another exception) otherwise."""
    expected = oracle(text)
    try:
        got = boundedjson.loads(text.encode("utf-8", "surrogatepass"), max_depth=max_depth)
    except boundedjson.Rejected:
        if expected is not None:
            value = expected[1]
            lone = any(0xD800 <= ord(c) <= 0xDFFF for c in text)
            long_number = any(len(tok) > boundedjson.MAX_NUMBER_CHARS for tok in _number_tokens(text))
            constant = any(c in text for c in ("NaN", "Infinity"))
            assert depth_of(value) > max_depth or lone or long_number or constant, (text[:200], max_depth)
        return
    assert expected is not None, text[:200]
    assert depth_of(expected[1]) <= max_depth
    assert same(got, expected[1])


def _number_tokens(text: str) -> list[str]:
    import re

    return re.findall(r"-?\d[\d.eE+-]*", re.sub(r'"(?:[^"\\]|\\.)*"', "", text))


@FAST
@given(data=st.one_of(st.binary(max_size=300), bodies), max_depth=st.integers(1, 8), strict=st.booleans())
def test_bounded_json_rejects_or_succeeds_for_any_bytes(data, max_depth, strict):
    try:
        boundedjson.loads(data, max_depth=max_depth, strict=strict)
    except boundedjson.Rejected:
        pass


def test_deep_nesting_is_rejected_before_the_parser_recurses():
    """The frame that ended every job (issue 34): ~1100 nested ``[`` before authenticating."""
    for body in (b"[" * 1100, b"[" * 16000, b'{"t":' * 5000, b'{"t":"hello","x":' + b"[" * 3000 + b"]" * 3000 + b"}"):
        with pytest.raises(wire.ProtocolError):
            wire.decode(body, strict=True)
    with pytest.raises(wire.ProtocolError):  # a trusted peer's frame: no depth bound, still total
        wire.decode(b"[" * 100000)


@FAST
@given(pieces=streams())
def test_a_strangers_byte_stream_yields_messages_or_a_protocol_error(pieces):
    frames = wire.FrameBuffer(strict=True)
    try:
        for piece in pieces:
            for msg in frames.feed(piece):
                assert isinstance(msg, dict) and isinstance(msg["t"], str)
                assert depth_of(msg) <= wire.HELLO_DEPTH
    except wire.ProtocolError:
        pass
    assert len(frames.buf) <= wire.HELLO_LIMIT + wire.HEADER.size + max(map(len, pieces))


# ---------------------------------------------------------------- the fault boundary
class Boom(Exception):
    pass


class Handler:
    """Records what the transport hands on; an observer's ``boom`` message raises."""

    def __init__(self) -> None:
        self.hellos: list[dict] = []
        self.lost: list[str] = []

    def on_hello(self, conn, hello) -> None:
        self.hellos.append(hello)

    def on_message(self, conn, msg) -> None:
        if msg["t"] == "boom":
            raise Boom("a bug in handling one message")
        self.transport.send(conn, {"t": "echo", "of": msg["t"]})

    def on_lost(self, conn, why) -> None:
        self.lost.append(why)
        if "boom" in why.lower():
            raise Boom("a bug in handling a loss, too")

    def on_foreign(self, conn) -> None:
        self.transport.drop(conn, "foreign")

    def on_relay(self, conn, data) -> None:
        pass


@pytest.fixture
def transport():
    listener = socket.create_server(("127.0.0.1", 0))
    handler = Handler()
    lines: list[str] = []
    t = Transport(listener, handler, token="tok", auth_timeout=5.0, max_pending=4, log=lines.append)
    handler.transport = t
    t.lines = lines  # type: ignore[attr-defined]
    yield t
    for conn in list(t.conns.values()):
        t.close(conn)
    listener.close()


def _serve_until(transport, predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        transport.poll(0.01, lambda data: None)


def _client(transport) -> wire.Channel:
    port = transport.listener.getsockname()[1]
    ch = wire.Channel.connect("127.0.0.1", port, timeout=5)
    return ch


def test_an_error_serving_one_client_costs_that_client_only(transport):
    """A handler that raises - on a message, and again when told of the loss - drops that
    connection, logs the traceback, and the transport goes on serving everyone else."""
    import threading

    good, bad = _client(transport), _client(transport)
    done = threading.Event()

    def handshakes():
        for ch in (good, bad):
            ch.handshake({"t": "hello", "kind": "observer"}, "tok", 10)
        done.set()

    thread = threading.Thread(target=handshakes)
    thread.start()
    _serve_until(transport, lambda: done.is_set() and len(transport.handler.hellos) == 2)
    thread.join()
    bad.send({"t": "boom"})
    _serve_until(transport, lambda: any("Boom" in line for line in transport.lines))
    log = "\n".join(transport.lines)
    assert "Traceback (most recent call last)" in log and "a bug in handling one message" in log
    assert "a bug in handling a loss, too" in log  # the loss's own error, logged too
    assert len(transport.conns) == 1  # the bad one is closed all the same
    good.send({"t": "ping"})
    replies: list[dict] = []

    def answered() -> bool:
        good.sock.setblocking(False)
        try:
            replies.extend(good.poll())
        except (BlockingIOError, wire.PeerClosed):
            pass
        finally:
            good.sock.setblocking(True)
        return bool(replies)

    _serve_until(transport, answered)
    assert replies == [{"t": "echo", "of": "ping"}]
    good.close()
    bad.close()


@settings(
    max_examples=400,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(pieces=streams())
def test_a_transport_serves_any_stranger_without_raising(transport, pieces):
    """Each stranger's bytes, fragmented as drawn, end with its connection dropped (or waiting
    for a challenge's answer); ``poll`` never raises and no unauthenticated hello is handed on."""
    port = transport.listener.getsockname()[1]
    before = len(transport.handler.hellos)
    door = transport.door
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        _serve_until(transport, lambda: len(door.strangers) >= 1)
        for piece in pieces:
            try:
                sock.sendall(piece)
            except OSError:
                break
            transport.poll(0, lambda data: None)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        _serve_until(
            transport,
            lambda: all(s.lingering for s in door.strangers) and all(c.closing for c in transport.conns.values()),
        )
    finally:
        sock.close()
    for conn in list(transport.conns.values()):
        transport.close(conn)
    for stranger in list(door.strangers):
        door._close(stranger)
    assert len(transport.handler.hellos) == before  # no one authenticated without the token
    assert not any("Traceback" in line for line in transport.lines), transport.lines[-3:]


# ---------------------------------------------------------------- against a running job
SLOW = """
import os, time
print("started", flush=True)
from pytest_msrun import cluster
cluster.init()
stop = os.environ["STOP_FILE"]
while True:
    cluster.barrier()
    seen = cluster.get_rank() == 0 and os.path.exists(stop)
    if cluster.broadcast_object(seen, src=0):
        break
    time.sleep(0.02)
print("finished", flush=True)
"""


def _attack(port: int, pieces: list[bytes]) -> None:
    """One stranger: connect, send, half-close, read what comes until the scheduler closes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        for piece in pieces:
            sock.sendall(piece)
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready and not sock.recv(65536):
                return
    except OSError:
        return
    finally:
        sock.close()


def test_hostile_frames_against_a_running_job_end_no_job(msrun):
    """A thousand generated connections (a few thousand frames) from strangers while a job runs
    barriers in a loop: it ends with exit 0, no traceback anywhere, its control plane's memory
    bounded."""
    msrun.script("slow.py", SLOW)
    port = free_port()
    stop = msrun.cwd / "stop"
    popen = msrun.start(job_args(2, "slow.py", port=port), env={"STOP_FILE": str(stop)})
    status = wait_running(msrun.cwd / "logs", 2)
    sched = psutil.Process(next(p["pid"] for p in status["processes"] if p["role"] == "scheduler"))
    before = sched.memory_info().rss
    sent = {"bytes": 0, "connections": 0}

    @settings(max_examples=1000, database=None, deadline=None)
    @given(pieces=streams())
    def attack(pieces):
        assume(pieces)
        _attack(port, pieces)
        sent["connections"] += 1
        sent["bytes"] += sum(map(len, pieces))

    attack()
    _attack(port, [struct.pack(">I", 1100) + b"[" * 1100])  # issue 34's frame, once more at the end
    peak = sched.memory_info().rss
    stop.touch()
    job = msrun.finish(popen, timeout=120)
    assert job.returncode == 0, job.stderr
    for name in ("worker_0.log", "worker_1.log"):
        assert "finished" in job.log(name)
    scheduler_log = job.log("scheduler.log")
    assert "Traceback" not in scheduler_log and "error serving" not in scheduler_log
    assert "Traceback" not in job.stderr
    grew = (peak - before) / 2**20
    assert grew < 16, f"the control plane grew by {grew:.1f} MiB"
    record(
        "hypothesis-generated hostile connections during a job",
        "job exit 0, no traceback",
        f"{sent['connections']} connections, {sent['bytes'] / 2**20:.1f} MiB, control plane RSS +{grew:.1f} MiB",
    )


def test_a_recorded_handshake_replayed_through_a_proxy_opens_nothing(msrun):
    """A proxy between a rank and the control plane records the rank's handshake; replayed on a
    new connection, it is refused: the proof is bound to nonces the scheduler draws afresh."""
    import threading

    msrun.script("slow.py", SLOW)
    port = free_port()
    stop = msrun.cwd / "stop"
    popen = msrun.start(job_args(2, "slow.py", port=port), env={"STOP_FILE": str(stop)})
    wait_running(msrun.cwd / "logs", 2)
    token = msrun_token(popen.pid)
    listener = socket.create_server(("127.0.0.1", 0))
    proxy_port = listener.getsockname()[1]
    recorded = bytearray()

    def proxy():
        client, _ = listener.accept()
        upstream = socket.create_connection(("127.0.0.1", port))
        for sock in (client, upstream):
            sock.setblocking(False)
        while True:
            ready, _, _ = select.select([client, upstream], [], [], 5)
            if not ready:
                return
            for sock in ready:
                data = sock.recv(65536)
                if not data:
                    client.close()
                    upstream.close()
                    return
                if sock is client:
                    recorded.extend(data)
                (upstream if sock is client else client).sendall(data)

    thread = threading.Thread(target=proxy, daemon=True)
    thread.start()
    # A real client's handshake through the proxy: an observer, as the pytest controller is.
    ch = wire.Channel.connect("127.0.0.1", proxy_port, timeout=5)
    ch.handshake({"t": "hello", "kind": "observer"}, token, 10)
    ch.send({"t": "state"})
    assert "joined" in json.dumps(ch.recv(10))
    ch.close()
    thread.join(10)
    listener.close()
    frames = wire.FrameBuffer(limit=wire.DEFAULT_MESSAGE_LIMIT).feed(bytes(recorded))
    assert [f["t"] for f in frames[:2]] == ["hello", "auth"]
    replay = socket.create_connection(("127.0.0.1", port), timeout=5)
    replay.sendall(bytes(recorded))
    got = wire.FrameBuffer(limit=wire.DEFAULT_MESSAGE_LIMIT)
    answers: list[dict] = []
    replay.settimeout(10)
    while True:
        data = replay.recv(65536)
        if not data:
            break
        answers.extend(got.feed(data))
    replay.close()
    kinds = [a["t"] for a in answers]
    assert kinds[0] == "challenge" and "refused" in kinds and "welcome" not in kinds, kinds
    stop.touch()
    job = msrun.finish(popen, timeout=120)
    assert job.returncode == 0, job.stderr
    record("a recorded handshake replayed", "refused, job exit 0", "")


def msrun_token(pid: int) -> str:
    """The job's token, from a rank's environment (this test runs as the job's user)."""
    for child in psutil.Process(pid).children(recursive=True):
        try:
            env = child.environ()
        except psutil.Error:
            continue
        if env.get("MSRUN_JOB_TOKEN"):
            return env["MSRUN_JOB_TOKEN"]
    raise AssertionError("no process of the job has MSRUN_JOB_TOKEN")


STRANGER_AT_THE_DOOR = """
import os, socket

import psutil
import pytest

KEEP = []
if os.environ.get("RANK_ID") == "0":  # a stranger knocks on every port the controller listens on
    ports = set()
    for proc in psutil.Process().parents():
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        ports |= {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"}
    open(os.environ["KNOCKED"], "w").write(str(len(ports)))
    for port in ports:
        for payload in (b"[" * 5000 + b"\\n", b"x" * 100_000, b'{"rank": 0, "token": "guess"}\\n', b""):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(payload)
            KEEP.append(s)  # held open, silent: the door must not wait for it


@pytest.mark.msrun(worker_num=2)
@pytest.mark.parametrize("i", range(3))
def test_warm(msrun, rank, i):
    assert msrun.all_gather(rank) == [0, 1]
"""


def test_strangers_at_a_warm_worlds_door_cost_its_tests_nothing(pytester, monkeypatch):
    """Deep nesting, an endless line, a wrong token and a silent connection, sent to the
    controller's world port before the ranks connect: every test passes, at once."""
    import uuid

    from conftest import MARK, wait_gone

    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    knocked = pytester.path / "knocked"
    monkeypatch.setenv("KNOCKED", str(knocked))
    pytester.makepyfile(test_door=STRANGER_AT_THE_DOOR)
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=240)
    took = time.monotonic() - started
    assert not wait_gone(mark)
    result.assert_outcomes(passed=3)
    assert int(knocked.read_text()) >= 1  # the world's door was among the ports knocked on
    # counted by the door's words, summed up once per address at the session's end
    said = [line for line in result.outlines if line.startswith("msrun: strangers at the worlds' doors: ")]
    assert len(said) == 1 and "from 127.0.0.1" in said[0], result.outlines[-15:]
    record("strangers at a warm world's door", "3 passed", f"session {took:.1f} s")


call_fields = st.dictionaries(
    st.sampled_from(["t", "test", "state", "outcome", "when", "op", "seq", "src", "data"]),
    st.one_of(values, st.sampled_from(["in", "out", "call", "setup", "teardown", "t.py::x"]), st.text(max_size=5000)),
    max_size=6,
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), call_fields), max_size=12))
def test_call_notices_and_collective_tags_are_parsed_totally(frames):
    """What an authenticated rank sends as a call notice or a collective's test tag: a valid value
    or None/False (its connection is then dropped) - never an exception, in the parsers or in the
    group that acts on what they accept."""
    group = RankGroup(3)
    for rank in range(3):
        group.join(rank)
    for rank, msg in frames:
        notice = calls.parse_notice(msg)
        if notice is not None:
            state, test, outcome = notice
            assert state in ("in", "out") and 0 < len(test) <= calls.MAX_TEST and len(outcome) <= calls.MAX_OUTCOME
            group.call_notice(rank, *notice)
        where = calls.parse_where(msg)
        if isinstance(where, tuple):
            assert where[1] in calls.PHASES and 0 < len(where[0]) <= calls.MAX_TEST
            group.contribute(rank, "barrier", 1 + rank, 0, None, where)
        else:
            assert where is None or where is False
