"""Addresses and ports: resolve ``--master_addr``, tell whether it is local, find free ports.

No shell-outs (the real msrun runs ``ip -j addr``): an address is local exactly when this
host can bind a socket to it, which also covers every ``127.0.0.0/8`` and ``::1``.
"""

from __future__ import annotations

# The C module, not :mod:`socket`: these helpers only open, bind and close sockets, and importing
# socket (its enums, selectors) is a cost on msrun's start path.
import _socket
from collections.abc import Mapping
from typing import Any


class AddressError(ValueError):
    """``--master_addr`` cannot be used."""


def strip_brackets(addr: str) -> str:
    """``[::1]`` -> ``::1`` (one pair of surrounding brackets, as msrun does)."""
    if addr.startswith("[") and addr.endswith("]"):
        return addr[1:-1]
    return addr


def resolve_master_addr(addr: str) -> str:
    """Canonical IP text for an IP literal or a hostname (first ``getaddrinfo`` result)."""
    host = strip_brackets(addr.strip())
    if not host:
        raise AddressError("the address is empty")
    literal = canonical_ip(host.split("%", 1)[0])
    if literal is not None:
        return literal + ("%" + host.split("%", 1)[1] if "%" in host else "")
    try:
        # an ASCII name as bytes: a str makes getaddrinfo import the IDNA codec (~1 ms)
        infos = _socket.getaddrinfo(
            host.encode() if host.isascii() else host, None, _socket.AF_UNSPEC, _socket.SOCK_STREAM
        )
    except (_socket.gaierror, UnicodeError) as exc:
        raise AddressError(f"cannot resolve host name {host!r}: {exc}") from None
    if not infos:
        raise AddressError(f"host name {host!r} resolved to no address")
    return str(infos[0][4][0])


def canonical_ip(text: str) -> str | None:
    """``text`` as the canonical form of the IPv4 or IPv6 literal it is, else None."""
    for family in (_socket.AF_INET, _socket.AF_INET6):
        try:
            return _socket.inet_ntop(family, _socket.inet_pton(family, text))
        except (OSError, ValueError):
            continue
    return None


def family_of(ip: str) -> int:
    return _socket.AF_INET6 if ":" in ip else _socket.AF_INET


def is_local_address(ip: str) -> bool:
    """True when a socket can be bound to ``ip`` on this host."""
    sock = _socket.socket(family_of(ip), _socket.SOCK_STREAM)
    try:
        sock.bind((ip, 0))
    except OSError:
        return False
    finally:
        sock.close()
    return True


def source_ip_towards(ip: str, port: int = 8117) -> str:
    """The local address the kernel would use to reach ``ip`` (no packet is sent)."""
    sock = _socket.socket(family_of(ip), _socket.SOCK_DGRAM)
    try:
        sock.connect((ip, port or 8117))
        return str(sock.getsockname()[0])
    except OSError:
        return ip if is_local_address(ip) else "127.0.0.1"
    finally:
        sock.close()


def port_is_free(ip: str, port: int) -> bool:
    """True when ``ip:port`` can be bound for listening right now."""
    sock = _socket.socket(family_of(ip), _socket.SOCK_STREAM)
    try:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
    except OSError:
        return False
    finally:
        sock.close()
    return True


def free_port(ip: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> int:
    """A port the kernel hands out as free on ``ip`` (ephemeral range), not in ``avoid``."""
    for _ in range(64):
        sock = _socket.socket(family_of(ip), _socket.SOCK_STREAM)
        try:
            sock.bind((ip, 0))
            port = int(sock.getsockname()[1])
        finally:
            sock.close()
        if port not in avoid:
            return port
    raise OSError("no free port found")


def listen_socket(ip: str, port: int, backlog: int = 4096) -> _socket.socket:
    """A listening TCP socket on ``ip:port`` (``port`` 0 = any free port); ``_socket``'s (accept
    with ``_accept()``, or wrap it: ``socket.socket(fileno=sock.detach())``)."""
    sock = _socket.socket(family_of(ip), _socket.SOCK_STREAM)
    try:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def format_hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _proc_net_addr(ip: str, port: int) -> str:
    """``ip:port`` as /proc/net/tcp{,6} writes it (hex, each 32-bit word in host byte order)."""
    import ipaddress  # only here: its import is a cost on msrun's start path
    import struct
    import sys

    packed = ipaddress.ip_address(ip.split("%", 1)[0]).packed
    order = "<" if sys.byteorder == "little" else ">"
    words = struct.unpack(f">{len(packed) // 4}I", packed)
    text = "".join(f"{struct.unpack(order + 'I', struct.pack('>I', w))[0]:08X}" for w in words)
    return f"{text}:{port:04X}"


def local_peer_uid(sock: _socket.socket) -> int | None:
    """The uid owning the other end of a connection from this host (None: not found or remote)."""
    import ipaddress  # only here: its import is a cost on msrun's start path

    try:
        peer = sock.getpeername()
        here = sock.getsockname()
    except OSError:
        return None
    candidates = [(peer[0], here[0])]
    try:
        mapped = ipaddress.ip_address(peer[0].split("%", 1)[0])
        if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
            own = ipaddress.ip_address(here[0].split("%", 1)[0])
            own_v4 = own.ipv4_mapped if isinstance(own, ipaddress.IPv6Address) else None
            candidates.append((str(mapped.ipv4_mapped), str(own_v4 or here[0])))
    except ValueError:
        pass
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for peer_ip, here_ip in candidates:
            if (":" in peer_ip) != table.endswith("6"):
                continue
            want_local = _proc_net_addr(peer_ip, peer[1])
            want_remote = _proc_net_addr(here_ip, here[1])
            for line in lines:
                fields = line.split()
                if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote:
                    return int(fields[7])
    return None


# The controller's host as a Slurm step's process must name it (in ``host:port`` values the
# controller hands its ranks): the address of the host that ran srun, as the node sees it.
LAUNCH_HOST = "slurm-launch-node"


def controller_address(value: str, env: Mapping[str, str]) -> tuple[str, int] | None:
    """``host:port`` -> (host, port); :data:`LAUNCH_HOST` read from ``SLURM_LAUNCH_NODE_IPADDR`` in
    ``env``. None when malformed or unresolved."""
    host, _, port = value.rpartition(":")
    if host == LAUNCH_HOST:
        host = env.get("SLURM_LAUNCH_NODE_IPADDR", "")
    return (host, int(port)) if host and port.isdigit() else None


def rank_listener(steps: bool, backlog: int | None = None) -> tuple[Any, str]:
    """A listening socket of the controller's for its ranks, and the ``host:port`` they are given:
    loopback, or - ranks in Slurm steps, on whichever nodes - every interface, named
    :data:`LAUNCH_HOST` (what a stranger may reach: the servers serve only their token's holders)."""
    import socket

    server = socket.create_server(("0.0.0.0" if steps else "127.0.0.1", 0), backlog=backlog)
    return server, f"{LAUNCH_HOST if steps else '127.0.0.1'}:{server.getsockname()[1]}"
