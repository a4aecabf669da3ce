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


NAME_FIX = "give an IP address or a resolvable host name"


def resolve_master_addr(addr: str) -> str:
    """Canonical IP text for an IP literal or a hostname (first ``getaddrinfo`` result). An IPv6
    literal keeps its ``%zone`` (the interface it is reached through), which must name an interface
    of this host through which the address can be bound or reached; :class:`AddressError` says
    why not and what to give instead."""
    host = addr.strip()
    if host.startswith("[") and host.endswith("]"):  # [::1]: one pair of brackets goes, as msrun does
        host = host[1:-1]
    if not host:
        raise AddressError(f"the address is empty; {NAME_FIX}")
    ip, sep, zone = host.partition("%")
    literal = canonical_ip(ip)
    if literal is not None:
        if sep:
            return check_zone(literal, zone)
        if ":" in literal and int(literal.split(":")[0] or "0", 16) & 0xFFC0 == 0xFE80:  # link-local: fe80::/10
            raise AddressError(
                f"a link-local address is reached through one interface, which it does not name; give "
                f"{literal}%<interface> ({link_local_hint()})"
            )
        return literal
    try:
        # an ASCII name as bytes: a str makes getaddrinfo import the IDNA codec (~1 ms)
        infos = _socket.getaddrinfo(
            host.encode() if host.isascii() else host, None, _socket.AF_UNSPEC, _socket.SOCK_STREAM
        )
    except (_socket.gaierror, UnicodeError) as exc:
        raise AddressError(f"cannot resolve host name {host!r}: {exc}; {NAME_FIX}") from None
    if not infos:
        raise AddressError(f"host name {host!r} resolved to no address; {NAME_FIX}")
    return str(infos[0][4][0])


def check_zone(ip: str, zone: str) -> str:
    """``ip%zone`` when this host can bind it or reach it through that interface, else
    :class:`AddressError` (why; what to give instead)."""
    if ":" not in ip:
        raise AddressError(f"an IPv4 address has no zone ('%{zone}' belongs to IPv6 link-local ones); give {ip}")
    if not zone:
        raise AddressError(f"the zone after '%' is empty; name the interface ({link_local_hint()}) or drop the '%'")
    scoped = f"{ip}%{zone}"
    try:
        zone_index(zone)
    except OSError:
        raise AddressError(
            f"this host has no network interface {zone!r} (it has {', '.join(interface_names()) or 'none'}); "
            "name one of them"
        ) from None
    problem = reach_problem(scoped)
    if problem:
        raise AddressError(
            f"it can be neither bound nor reached through {zone} ({problem}); name the interface the address is on "
            f"or reached through ({link_local_hint()})"
        )
    return scoped


def zone_index(zone: str) -> int:
    """The index of the interface a zone names (its name, or its index); OSError when there is none."""
    try:
        if zone.isdigit() and len(zone) < 10:
            _socket.if_indextoname(int(zone))
            return int(zone)
        return int(_socket.if_nametoindex(zone))
    except (ValueError, UnicodeError, OverflowError):
        raise OSError(f"no interface {zone!r}") from None


def interface_names() -> list[str]:
    try:
        return [str(name) for _, name in _socket.if_nameindex()]
    except OSError:
        return []


def link_local_hint() -> str:
    """This host's link-local addresses with their zones, for a message (from /proc/net/if_inet6)."""
    found = []
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) == 6 and fields[3] == "20":  # scope: link
                    text = ":".join(fields[0][i : i + 4] for i in range(0, 32, 4))
                    found.append(f"{canonical_ip(text)}%{fields[5]}")
    except (OSError, ValueError):
        pass
    return f"this host's link-local addresses: {', '.join(found[:4])}" if found else "this host has no link-local one"


def reach_problem(ip: str) -> str:
    """Why this host can neither bind ``ip`` nor route to it ("" when it can do either)."""
    try:
        if is_local_address(ip):
            return ""
        sock = _socket.socket(family_of(ip), _socket.SOCK_DGRAM)
    except OSError as exc:  # no IPv6 here at all
        return exc.strerror or str(exc)
    try:
        sock.connect(sockaddr(ip, 8117))  # a route, no packet
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        sock.close()
    return ""


def sockaddr(ip: str, port: int) -> tuple[Any, ...]:
    """``(ip, port)`` as bind and connect take it: an IPv6 ``%zone`` becomes the scope id (Python
    drops it from a 2-tuple, and a link-local address then fails with EINVAL)."""
    host, sep, zone = ip.partition("%")
    if not sep or ":" not in host:
        return (ip, port)
    try:
        return (host, port, 0, zone_index(zone))
    except OSError:
        return (ip, port)  # the kernel says why


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
    return port_is_free(ip, 0)


def source_ip_towards(ip: str, port: int = 8117) -> str:
    """The local address the kernel would use to reach ``ip`` (no packet is sent)."""
    sock = _socket.socket(family_of(ip), _socket.SOCK_DGRAM)
    try:
        sock.connect(sockaddr(ip, port or 8117))
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
        sock.bind(sockaddr(ip, port))
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
            sock.bind(sockaddr(ip, 0))
            port = int(sock.getsockname()[1])
        finally:
            sock.close()
        if port not in avoid:
            return port
    raise OSError("no free port found")


def listen_socket(ip: str, port: int) -> _socket.socket:
    """A listening TCP socket on ``ip:port`` (``port`` 0 = any free port); ``_socket``'s (accept
    with ``_accept()``, or wrap it: ``socket.socket(fileno=sock.detach())``)."""
    sock = _socket.socket(family_of(ip), _socket.SOCK_STREAM)
    try:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr(ip, port))
        sock.listen(4096)
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
    for peer_ip, here_ip in candidates:
        found = tcp_socket((peer_ip, peer[1]), (here_ip, here[1]))
        if found is not None:
            return found[0]
    return None


def tcp_socket(local: tuple[str, int], remote: tuple[str, int]) -> tuple[int, int] | None:
    """(uid, inode) of this host's TCP socket from ``local`` to ``remote`` (``/proc/net/tcp{,6}``),
    or None when there is none (or the addresses are not IP literals)."""
    table = "/proc/net/tcp6" if ":" in local[0] else "/proc/net/tcp"
    try:
        want_local = _proc_net_addr(local[0], local[1])
        want_remote = _proc_net_addr(remote[0], remote[1])
    except (ValueError, OverflowError):
        return None
    try:
        with open(table, encoding="ascii") as fh:
            lines = fh.readlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 9 and fields[1] == want_local and fields[2] == want_remote:
            return int(fields[7]), int(fields[9])
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
