"""The control-plane wire format: length-prefixed JSON frames with hard size limits.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON encoding one
object with a string field ``t`` (the message type). Before a peer has authenticated, frames
are limited to :data:`HELLO_LIMIT` bytes; afterwards to :func:`message_limit`.

Authentication is a challenge-response over the listener's token, which never crosses the wire,
served by the one door of every listener (:mod:`.door`): the client's ``hello`` carries a nonce;
the server answers ``challenge`` with its own nonce - and nothing computed from the token; the
client answers ``auth`` with its proof over both nonces; only then does the server prove it knows
the token too, in its ``welcome``. A stranger who connects never sees a value it could test guesses
of the token against offline; a recorded conversation does not let anyone open another connection;
and a client knows it is in - not merely that it has spoken - before it relies on the connection
(one dropped before the ``welcome`` is tried again).
"""

from __future__ import annotations

import _socket  # not socket: msrun's start path reads and writes frames without its import
import os
import struct
import time

from pytest_msrun import boundedjson

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from typing_extensions import Self, TypeGuard

try:  # constant-time comparison without importing hmac/hashlib (OpenSSL) on the start-up path
    from _operator import _compare_digest as compare_digest
except ImportError:  # pragma: no cover
    from hmac import compare_digest  # type: ignore[no-redef]

AGENT_FD_ENV = "MSRUN_AGENT_FD"  # the scheduler's end of a socketpair to the msrun that forked it
HEADER = struct.Struct(">I")
HELLO_LIMIT = 16 * 1024  # the largest frame a client may send before it authenticated
HELLO_DEPTH = 4  # the deepest nesting of arrays and objects in a frame before it authenticated
DEFAULT_MESSAGE_LIMIT = 64 * 1024 * 1024
LIMIT_ENV = "MSRUN_MAX_MESSAGE_BYTES"  # what sets the message limit (read by every process of a job)


class ProtocolError(Exception):
    """A peer sent something that is not a valid frame or message."""


class PeerClosed(ConnectionError):
    """The peer closed the connection."""


def is_int(value: Any, low: int, high: int) -> TypeGuard[int]:
    """Whether a field a peer sent is an integer (not a bool) from ``low`` to ``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def message_limit() -> int:
    try:
        return max(HELLO_LIMIT, int(os.environ.get(LIMIT_ENV, DEFAULT_MESSAGE_LIMIT)))
    except ValueError:
        return DEFAULT_MESSAGE_LIMIT


_dumps: Any = None  # one encoder (json.dumps with options builds one per call), json imported
# (with re) at the first frame, not on msrun's start path


def load_json() -> None:
    """Import json (with re) for the frames, once: msrun does it before it forks its control plane."""
    global _dumps
    import json

    boundedjson.loads(b"{}", max_depth=1)  # its parser and patterns, made now
    _dumps = json.JSONEncoder(separators=(",", ":")).encode


def dumps(obj: Any) -> str:
    """``obj`` as compact JSON (the frames', the trace's)."""
    if _dumps is None:
        load_json()
    return _dumps(obj)


def encode(msg: dict[str, Any]) -> bytes:
    body = dumps(msg).encode("utf-8")
    return HEADER.pack(len(body)) + body


def decode(body: bytes, strict: bool = False) -> dict[str, Any]:
    """One frame's message, or :class:`ProtocolError` - never another exception, whatever ``body``
    holds. ``strict`` (a peer that has not authenticated): nesting at most :data:`HELLO_DEPTH`,
    number literals bounded, no ``NaN``/``Infinity`` (:mod:`pytest_msrun.boundedjson`)."""
    try:
        msg = boundedjson.loads(body, max_depth=HELLO_DEPTH if strict else None, strict=strict)
    except boundedjson.Rejected as exc:
        raise ProtocolError(f"frame is not acceptable JSON: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("frame is not an object with a string field 't'")
    return msg


class FrameBuffer:
    """Accumulates bytes from a non-blocking socket and yields complete messages.

    ``strict`` for a peer that has not authenticated (a server's view of a new client): frames are
    parsed as a stranger's (:func:`decode`)."""

    def __init__(self, limit: int = HELLO_LIMIT, strict: bool = False) -> None:
        self.buf = bytearray()
        self.limit = limit
        self.strict = strict

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out: list[dict[str, Any]] = []
        start, end = 0, len(self.buf)
        try:
            while end - start >= HEADER.size:
                (size,) = HEADER.unpack_from(self.buf, start)
                if size > self.limit:
                    raise ProtocolError(f"frame of {size} bytes exceeds the limit of {self.limit}")
                if end - start < HEADER.size + size:
                    break
                body = bytes(self.buf[start + HEADER.size : start + HEADER.size + size])
                start += HEADER.size + size
                out.append(decode(body, self.strict))
        finally:
            del self.buf[:start]  # once per read, not per frame: many small frames stay O(n)
        return out


def token_ok(given: Any, expected: str) -> bool:
    return isinstance(given, str) and given.isascii() and compare_digest(given.encode(), expected.encode())


def new_nonce() -> str:
    return os.urandom(16).hex()


def _sha256() -> Any:
    """SHA-256 from CPython's own implementation: loading OpenSSL (``hashlib``) costs milliseconds
    on the start path of every process that authenticates; the digest is the same."""
    for name in ("_sha2", "_sha256"):  # Python >= 3.12, before
        try:
            return __import__(name).sha256
        except ImportError:
            continue
    from hashlib import sha256  # pragma: no cover - a build without them

    return sha256


def hmac_sha256(key: bytes, msg: bytes) -> bytes:
    """HMAC-SHA256 (RFC 2104), as ``hmac.digest(key, msg, "sha256")``."""
    sha256 = _sha256()
    if len(key) > 64:
        key = sha256(key).digest()
    key = key.ljust(64, b"\0")
    inner = sha256(bytes(b ^ 0x36 for b in key) + msg).digest()
    return sha256(bytes(b ^ 0x5C for b in key) + inner).digest()


SECRET_MIN_CHARS = 16
SECRET_MIN_DISTINCT = 8
STRETCH_ROUNDS = 200_000  # PBKDF2-HMAC-SHA256 rounds turning a passphrase into a job's key
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")  # of a nonce, of a random key


def weakness(secret: str) -> str:
    """Why ``secret`` is too weak to be a job's token or the secret it comes from ("" when it is
    not): fewer than 16 characters, fewer than 8 different ones, or one short part repeated."""
    if len(secret) < SECRET_MIN_CHARS:
        return f"holds {len(secret)} characters, fewer than {SECRET_MIN_CHARS}"
    distinct = len(set(secret))
    if distinct < SECRET_MIN_DISTINCT:
        return f"uses only {distinct} different characters"
    for period in range(1, len(secret) // 2 + 1):
        if secret == (secret[:period] * (len(secret) // period + 1))[: len(secret)]:
            return f"repeats {secret[:period]!r}"
    return ""


def strengthen(secret: str) -> str:
    """The key a secret stands for: a random key - 32 hex digits or more, as msrun makes them - as it
    is; anything else, a passphrase, stretched (PBKDF2-HMAC-SHA256, :data:`STRETCH_ROUNDS` rounds;
    ~0.1 s once per msrun), so that a handshake an eavesdropper recorded costs that much per guess."""
    if len(secret) >= 32 and HEX_DIGITS.issuperset(secret):
        return secret
    import hashlib

    raw = secret.encode("utf-8", "surrogatepass")
    return hashlib.pbkdf2_hmac("sha256", raw, b"msrun-passphrase-v1", STRETCH_ROUNDS).hex()


def proof(token: str, role: str, client_nonce: str, server_nonce: str) -> str:
    """HMAC-SHA256 of both nonces under the token, bound to who proves it (a client's ``kind``, or
    ``"server"``). Text that is not UTF-8 (a lone surrogate) is encoded as it is, never an error."""
    msg = "\0".join(("msrun-auth-v2", role, client_nonce, server_nonce)).encode("utf-8", "surrogatepass")
    return hmac_sha256(token.encode("utf-8", "surrogatepass"), msg).hex()


class AuthError(ConnectionError):
    """The other side does not know this job's token (or did not prove it)."""


class Unreachable(ConnectionError):
    """No connection to the server could be opened in time (``__cause__``: the last attempt's error)."""


def pack_data(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode("ascii")


def unpack_data(text: Any) -> bytes:
    import base64

    if not isinstance(text, str):
        raise ProtocolError("data field is not a string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise ProtocolError(f"data field is not base64: {exc}") from None


class Channel:
    """A blocking, message-oriented client connection (used by agents and ranks)."""

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.frames = FrameBuffer(message_limit())
        self.pending: list[dict[str, Any]] = []
        self.eof = False

    @classmethod
    def connect(cls, host: str, port: int, timeout: float) -> Self:
        # an ASCII host as bytes: a str host makes getaddrinfo import the IDNA codec (~1 ms)
        address: Any = (host.encode() if host.isascii() else host, port)  # getaddrinfo takes bytes too
        import socket

        sock = socket.create_connection(address, timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock)

    @classmethod
    def join(cls, host: str, port: int, hello: dict[str, Any], token: str, deadline: float) -> Self:
        """:meth:`connect` and :meth:`handshake`, tried again while the server cannot be reached or
        drops this client before its welcome (strangers may crowd its door; a loaded server may not
        run for a while) - backing off - until ``deadline`` (``time.monotonic()``); then the last
        error (:class:`Unreachable` when it could not connect). :class:`AuthError` at once."""
        backoff = 0.05
        while True:
            try:
                channel = cls.connect(host, port, max(0.1, min(5.0, deadline - time.monotonic())))
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise Unreachable(f"cannot reach {host}:{port}: {exc}") from exc
                time.sleep(0.05)
                continue
            try:
                channel.handshake(hello, token, max(0.1, deadline - time.monotonic()))
                return channel
            except (OSError, ProtocolError) as exc:
                channel.close()
                if isinstance(exc, AuthError) or time.monotonic() >= deadline:
                    raise
            import random

            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())) * (0.5 + random.random()))
            backoff = min(2.0, backoff * 2)

    def fileno(self) -> int:
        return self.sock.fileno()

    def handshake(self, hello: dict[str, Any], token: str, timeout: float) -> dict[str, Any]:
        """Send ``hello``, answer the server's challenge with this client's proof (when it has a
        token), and check the proof in its ``welcome``, which is returned.

        Raises :class:`AuthError` if the server refuses this client's proof (another token) or
        cannot prove it knows the token (someone else listens at that address); ``socket.timeout``
        or :class:`PeerClosed` if it does not answer (a client dropped before its welcome may try
        again).
        """
        deadline = time.monotonic() + timeout
        nonce = new_nonce()
        self.send({**hello, "nonce": nonce})
        reply = self._reply(deadline)
        if not token:
            if reply.get("t") != "welcome":
                raise AuthError("the server asks for a token this client does not have (MSRUN_JOB_TOKEN is unset)")
            return reply
        server_nonce = reply.get("nonce")
        if reply.get("t") != "challenge" or not isinstance(server_nonce, str):
            raise AuthError("the server did not challenge this client (is it this job's?)")
        self.send({"t": "auth", "proof": proof(token, str(hello.get("kind")), nonce, server_nonce)})
        welcome = self._reply(deadline)
        if welcome.get("t") != "welcome":
            raise AuthError(f"the server answered {welcome.get('t')!r} instead of welcoming this client")
        if not token_ok(welcome.get("proof"), proof(token, "server", nonce, server_nonce)):
            raise AuthError(
                "bad job token: the server at this address has a different one (MSRUN_JOB_TOKEN, "
                "MSRUN_JOB_TOKEN_FILE or the msrun secret differ) - another job, or other secrets"
            )
        return welcome

    def _reply(self, deadline: float) -> dict[str, Any]:
        reply = self.recv(max(0.0, deadline - time.monotonic()))
        if reply.get("t") == "refused":
            raise AuthError(str(reply.get("reason")))
        return reply

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.settimeout(None)
        self.sock.sendall(encode(msg))

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        """Next message; ``socket.timeout`` if none arrives in time, :class:`PeerClosed` on EOF."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.pending:
            if self.eof:
                raise PeerClosed("connection closed by peer")
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if remaining == 0.0 and deadline is not None:
                raise _socket.timeout("timed out")
            self.sock.settimeout(remaining)
            self._take(self.sock.recv(1 << 20))
        return self.pending.pop(0)

    def _take(self, data: bytes) -> None:
        """Bytes read: the messages they complete, or the end of the connection."""
        if data:
            self.pending.extend(self.frames.feed(data))
        else:
            self.eof = True

    def poll(self) -> list[dict[str, Any]]:
        """Messages available right now without blocking.

        Raises :class:`PeerClosed` once the peer closed and every message it sent was returned.
        """
        self.sock.setblocking(False)
        try:
            while not self.eof:
                try:
                    self._take(self.sock.recv(1 << 20))
                except (BlockingIOError, InterruptedError):
                    break
        finally:
            self.sock.setblocking(True)
        if self.eof and not self.pending:
            raise PeerClosed("connection closed by peer")
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
