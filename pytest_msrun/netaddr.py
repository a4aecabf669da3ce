"""Addresses and ports: resolve ``--master_addr``, tell whether it is local, find free ports.

No shell-outs (the real msrun runs ``ip -j addr``): an address is local exactly when this
host can bind a socket to it, which also covers every ``127.0.0.0/8`` and ``::1``.
"""

from __future__ import annotations

import ipaddress
import socket


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
    try:
        return str(ipaddress.ip_address(host.split("%", 1)[0])) + ("%" + host.split("%", 1)[1] if "%" in host else "")
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise AddressError(f"cannot resolve host name {host!r}: {exc}") from None
    if not infos:
        raise AddressError(f"host name {host!r} resolved to no address")
    return str(infos[0][4][0])


def family_of(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def is_local_address(ip: str) -> bool:
    """True when a socket can be bound to ``ip`` on this host."""
    sock = socket.socket(family_of(ip), socket.SOCK_STREAM)
    try:
        sock.bind((ip, 0))
    except OSError:
        return False
    finally:
        sock.close()
    return True


def source_ip_towards(ip: str, port: int = 8117) -> str:
    """The local address the kernel would use to reach ``ip`` (no packet is sent)."""
    sock = socket.socket(family_of(ip), socket.SOCK_DGRAM)
    try:
        sock.connect((ip, port or 8117))
        return str(sock.getsockname()[0])
    except OSError:
        return ip if is_local_address(ip) else "127.0.0.1"
    finally:
        sock.close()


def port_is_free(ip: str, port: int) -> bool:
    """True when ``ip:port`` can be bound for listening right now."""
    sock = socket.socket(family_of(ip), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
    except OSError:
        return False
    finally:
        sock.close()
    return True


def free_port(ip: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> int:
    """A port the kernel hands out as free on ``ip`` (ephemeral range), not in ``avoid``."""
    for _ in range(64):
        sock = socket.socket(family_of(ip), socket.SOCK_STREAM)
        try:
            sock.bind((ip, 0))
            port = int(sock.getsockname()[1])
        finally:
            sock.close()
        if port not in avoid:
            return port
    raise OSError("no free port found")


def listen_socket(ip: str, port: int, backlog: int = 512) -> socket.socket:
    """A listening TCP socket on ``ip:port`` (``port`` 0 = any free port)."""
    sock = socket.socket(family_of(ip), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def format_hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
