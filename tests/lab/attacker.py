"""The attacker's tool box: what another local user runs against a victim's msrun and pytest sessions.

Run as the attacker account (tests/lab/users.py), never by the test process itself:

    python attacker.py listening UID                          # the victim's listening TCP ports (JSON)
    python attacker.py plant-pool VICTIM TARGET [--ahead N] [--hostile]
    python attacker.py plant-links DIR NAME=TARGET ... [--ahead N]   # NAME may hold {pid}
    python attacker.py hold HOST PORT --connections N --status FILE [--junk FRACTION]
    python attacker.py spam HOST PORT --count N --kinds garbage,wrong_token,surrogate,rpc
    python attacker.py hello HOST PORT                        # the server's answer to a hello (JSON)
    python attacker.py fuzz --status FILE --examples N --silent N HOST:PORT ...

Everything here uses what any user has: /proc/net/tcp (whose ``uid`` column names every socket's
owner), /proc/sys/kernel/ns_last_pid (the last pid handed out), /tmp, and connect(). ``hold``,
``spam`` and ``fuzz`` print one JSON line of counts at the end; ``hold`` and ``fuzz`` also rewrite
``--status`` while they run (the test waits for it), and stop on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import struct
import sys
import threading

FRAME = struct.Struct(">I")
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def frame(body: bytes) -> bytes:
    return FRAME.pack(len(body)) + body


def listening(uid: int) -> list[dict]:
    """Every listening TCP socket owned by ``uid``: what anyone on the host can read."""
    out = []
    for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        try:
            with open(table) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 8 or f[3] != LISTEN or int(f[7]) != uid:
                continue
            addr, port = f[1].rsplit(":", 1)
            if family == 4:
                host = socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1])
            else:
                raw = bytes.fromhex(addr)
                host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
            out.append({"host": host, "port": int(port, 16), "family": family})
    return out


def pid_window(ahead: int) -> list[int]:
    """The pids the next ``ahead`` processes on this host will get (wrapping at pid_max)."""
    with open("/proc/sys/kernel/ns_last_pid") as fh:
        last = int(fh.read())
    with open("/proc/sys/kernel/pid_max") as fh:
        pid_max = int(fh.read())
    out = []
    pid = last
    for _ in range(ahead):
        pid += 1
        if pid >= pid_max:
            pid = 300  # the kernel wraps to RESERVED_PIDS
        out.append(pid)
    return out


def plant(path: str, target: str) -> bool:
    try:
        os.symlink(target, path)
        return True
    except FileExistsError:
        return False


# ---------------------------------------------------------------- planting
def plant_pool(victim: str, target: str, ahead: int, hostile: bool) -> dict:
    """Take pytest's per-user temp root of ``victim`` before it does: /tmp/pytest-of-<victim>
    (mode 0777) with msrun's pool directory in it, its temporary state files planted as links to
    ``target``, and (``hostile``) a state file of the attacker's choosing."""
    import tempfile

    root = os.path.join(tempfile.gettempdir(), f"pytest-of-{victim}")
    pool = os.path.join(root, "msrun-pool")
    for d in (root, pool):
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o777)
    planted = sum(plant(os.path.join(pool, f"pool.json.{pid}.tmp"), target) for pid in pid_window(ahead))
    if hostile:
        every_port = list(range(1024, 65536))
        state = {
            "leases": {"not-an-object": "x", "every-port": {"pid": 1, "ports": every_port, "devices": []}},
            "waiting": {"also-not": 7},
        }
        with open(os.path.join(pool, "pool.json"), "w") as fh:
            json.dump(state, fh)
        os.chmod(os.path.join(pool, "pool.json"), 0o666)
    else:
        planted += plant(os.path.join(pool, "pool.json"), target)
    return {"root": root, "pool": pool, "planted": planted}


def plant_links(directory: str, pairs: list[str], ahead: int) -> dict:
    """``NAME=TARGET``: a link at DIR/NAME to TARGET; a NAME with ``{pid}`` is planted for the next
    ``ahead`` pids."""
    window = pid_window(ahead)
    planted = 0
    for pair in pairs:
        name, _, target = pair.partition("=")
        names = [name.format(pid=p) for p in window] if "{pid}" in name else [name]
        for n in names:
            path = os.path.join(directory, n)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            planted += plant(path, target)
    return {"planted": planted}


# ---------------------------------------------------------------- connections
class Counts:
    def __init__(self) -> None:
        self.attempts = 0  # connect() calls made
        self.connected = 0  # connections established
        self.open = 0  # open now
        self.max_open = 0
        self.closed_by_server = 0
        self.failed = 0  # connect() failed or timed out
        self.replies = 0  # connections the server wrote anything to
        self.examples = 0

    def opened(self) -> None:
        self.connected += 1
        self.open += 1
        self.max_open = max(self.max_open, self.open)

    def json(self) -> str:
        return json.dumps(vars(self))


def write_status(path: str, counts: Counts) -> None:
    if not path:
        return
    tmp = f"{path}.part"
    with open(tmp, "w") as fh:
        fh.write(counts.json())
    os.replace(tmp, path)


JUNK = [
    lambda: os.urandom(random.randint(1, 4096)),
    lambda: b"x" * random.randint(100, 8000),
    lambda: b"[" * 3000,
    lambda: b'{"rank": 0, "token": "' + os.urandom(8).hex().encode() + b'"',
    lambda: frame(b'{"t":"hello","kind":"rank","nonce":"' + os.urandom(8).hex().encode() + b'"}'),
    lambda: FRAME.pack(2**31) + b"{",
]


async def hold(host: str, port: int, connections: int, junk: float, status: str, stop: asyncio.Event) -> Counts:
    """Keep ``connections`` connections open to host:port - silent, or (a ``junk`` fraction of them)
    having sent junk with no end of line - and open a new one for each the server closes."""
    counts = Counts()

    async def one(index: int) -> None:
        while not stop.is_set():
            counts.attempts += 1
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            except (OSError, asyncio.TimeoutError):
                counts.failed += 1
                await asyncio.sleep(0.2)
                continue
            counts.opened()
            try:
                if index < connections * junk:
                    writer.write(random.choice(JUNK)())
                    await writer.drain()
                while not stop.is_set():  # until the server closes it (or we stop)
                    try:
                        data = await asyncio.wait_for(reader.read(65536), 0.5)
                    except asyncio.TimeoutError:
                        continue
                    if not data:
                        counts.closed_by_server += 1
                        break
                    counts.replies += 1
            except OSError:
                counts.closed_by_server += 1
            finally:
                counts.open -= 1
                writer.close()
            await asyncio.sleep(0.05)

    async def report() -> None:
        while not stop.is_set():
            write_status(status, counts)
            await asyncio.sleep(0.2)

    reporter = asyncio.ensure_future(report())
    await asyncio.gather(*(one(i) for i in range(connections)))
    reporter.cancel()
    write_status(status, counts)
    return counts


def hello_frame(nonce: str | None = None) -> bytes:
    return frame(json.dumps({"t": "hello", "kind": "rank", "nonce": nonce or os.urandom(16).hex()}).encode())


# a hello whose nonce is a lone surrogate: valid JSON text ("\ud800" escaped), not valid Unicode
SURROGATE_HELLO = frame(b'{"t":"hello","kind":"rank","nonce":"\\ud800"}')


async def _read_frame(reader: asyncio.StreamReader, timeout: float) -> dict | None:
    try:
        head = await asyncio.wait_for(reader.readexactly(4), timeout)
        (size,) = FRAME.unpack(head)
        if size > 1 << 20:
            return None
        body = await asyncio.wait_for(reader.readexactly(size), timeout)
        return json.loads(body)
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError):
        return None


async def spam(host: str, port: int, count: int, kinds: list[str], concurrency: int) -> Counts:
    """``count`` connections, each sending one of ``kinds`` and waiting (at most 5 s) for the server
    to close it; ``concurrency`` at once."""
    counts = Counts()
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        kind = kinds[i % len(kinds)]
        async with gate:
            counts.attempts += 1
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            except (OSError, asyncio.TimeoutError):
                counts.failed += 1
                return
            counts.opened()
            try:
                if kind == "garbage":
                    writer.write(random.choice(JUNK[:3])())
                elif kind == "surrogate":
                    writer.write(SURROGATE_HELLO)
                elif kind == "rpc":
                    writer.write(random.choice([b"RPC", b"RPC" + os.urandom(random.randint(1, 200)), b"RPC0" * 16]))
                elif kind == "wrong_token":
                    writer.write(hello_frame())
                    await writer.drain()
                    challenge = await _read_frame(reader, 5)
                    if challenge is not None:
                        counts.replies += 1
                        writer.write(frame(json.dumps({"t": "auth", "proof": os.urandom(32).hex()}).encode()))
                await writer.drain()
                try:
                    while await asyncio.wait_for(reader.read(65536), 5):
                        pass
                    counts.closed_by_server += 1
                except asyncio.TimeoutError:
                    pass
            except OSError:
                counts.closed_by_server += 1
            finally:
                counts.open -= 1
                writer.close()

    await asyncio.gather(*(one(i) for i in range(count)))
    return counts


def hello(host: str, port: int) -> dict:
    """Send a rank's hello; what the server answers (its first frame), and the nonce sent."""
    nonce = os.urandom(16).hex()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(hello_frame(nonce))
        s.settimeout(10)
        data = b""
        while len(data) < 4 or len(data) < 4 + FRAME.unpack_from(data)[0]:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data[4 : 4 + FRAME.unpack_from(data)[0]]) if len(data) >= 4 else None
    return {"nonce": nonce, "reply": reply}


# ---------------------------------------------------------------- fuzzing (hypothesis)
def fuzz(targets: list[tuple[str, int]], examples: int, silent: int, status: str) -> Counts:
    """Hold ``silent`` silent connections to each target while hypothesis-generated streams (the
    strategies of tests/test_hostile_input.py: frames and lines, nesting, sizes, encodings, lying
    lengths, fragmentation, hostile hellos, messages out of order) go to each target in turn."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(here), here]
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from test_hostile_input import bodies, streams

    counts = Counts()
    stop = threading.Event()

    def keep_silent() -> None:
        held: dict[tuple[str, int], list[socket.socket]] = {t: [] for t in targets}
        try:
            while not stop.is_set():
                for target, socks in held.items():
                    while len(socks) < silent and not stop.is_set():
                        counts.attempts += 1
                        try:
                            socks.append(socket.create_connection(target, timeout=1))
                            counts.opened()
                        except OSError:
                            counts.failed += 1
                            break
                    for s in list(socks):  # forget what the server closed
                        try:
                            s.setblocking(False)
                            if s.recv(65536):
                                continue
                        except BlockingIOError:
                            continue
                        except OSError:
                            pass
                        socks.remove(s)
                        s.close()
                        counts.open -= 1
                        counts.closed_by_server += 1
                write_status(status, counts)
                stop.wait(0.2)
        finally:
            for socks in held.values():
                for s in socks:
                    s.close()

    keeper = threading.Thread(target=keep_silent, daemon=True)
    keeper.start()
    lines = st.lists(bodies, min_size=1, max_size=3).map(lambda bs: [b + b"\n" for b in bs])

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(pieces=st.one_of(streams(), lines), target=st.sampled_from(targets))
    def send(pieces: list[bytes], target: tuple[str, int]) -> None:
        counts.examples += 1
        counts.attempts += 1
        try:
            s = socket.create_connection(target, timeout=1)
        except OSError:
            counts.failed += 1
            return
        counts.connected += 1
        try:
            for piece in pieces:
                s.sendall(piece)
            s.shutdown(socket.SHUT_WR)
            s.setblocking(False)  # not waiting for the server's close: the next stranger comes at once
            if s.recv(65536):
                counts.replies += 1
        except OSError:
            pass
        finally:
            s.close()

    try:
        send()
    finally:
        stop.set()
        keeper.join(5)
        write_status(status, counts)
    return counts


# ---------------------------------------------------------------- the command line
def _run(coro_factory) -> Counts:
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        return loop.run_until_complete(coro_factory(stop))
    finally:
        loop.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("listening")
    a.add_argument("uid", type=int)
    a = sub.add_parser("plant-pool")
    a.add_argument("victim")
    a.add_argument("target")
    a.add_argument("--ahead", type=int, default=5000)
    a.add_argument("--hostile", action="store_true")
    a = sub.add_parser("plant-links")
    a.add_argument("directory")
    a.add_argument("pairs", nargs="+")
    a.add_argument("--ahead", type=int, default=5000)
    a = sub.add_parser("hold")
    a.add_argument("host")
    a.add_argument("port", type=int)
    a.add_argument("--connections", type=int, default=1500)
    a.add_argument("--junk", type=float, default=0.3)
    a.add_argument("--status", default="")
    a = sub.add_parser("spam")
    a.add_argument("host")
    a.add_argument("port", type=int)
    a.add_argument("--count", type=int, default=1000)
    a.add_argument("--kinds", default="garbage")
    a.add_argument("--concurrency", type=int, default=64)
    a = sub.add_parser("hello")
    a.add_argument("host")
    a.add_argument("port", type=int)
    a = sub.add_parser("fuzz")
    a.add_argument("targets", nargs="+", help="HOST:PORT")
    a.add_argument("--examples", type=int, default=300)
    a.add_argument("--silent", type=int, default=100)
    a.add_argument("--status", default="")
    args = p.parse_args(argv)
    if args.cmd == "listening":
        out: object = listening(args.uid)
    elif args.cmd == "plant-pool":
        out = plant_pool(args.victim, args.target, args.ahead, args.hostile)
    elif args.cmd == "plant-links":
        out = plant_links(args.directory, args.pairs, args.ahead)
    elif args.cmd == "hold":
        out = vars(_run(lambda stop: hold(args.host, args.port, args.connections, args.junk, args.status, stop)))
    elif args.cmd == "spam":
        kinds = args.kinds.split(",")
        out = vars(_run(lambda stop: spam(args.host, args.port, args.count, kinds, args.concurrency)))
    elif args.cmd == "hello":
        out = hello(args.host, args.port)
    else:
        targets = [(t.rpartition(":")[0], int(t.rpartition(":")[2])) for t in args.targets]
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            out = vars(fuzz(targets, args.examples, args.silent, args.status))
        except KeyboardInterrupt:
            out = {"stopped": True}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
