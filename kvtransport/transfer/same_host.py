"""Is a gRPC peer on this host? Decides the gRPC transport's checksum policy ``auto``.

A push between two processes of one host never leaves the kernel: TCP to any of the host's own
addresses goes through the loopback device, which copies memory to memory (Linux does not even
compute the TCP checksum there). Nothing on that path corrupts bytes that a CRC would catch,
so ``GrpcTransportConfig(checksum="auto")`` skips the CRC-32C passes for such peers; across
hosts (NICs, switches, middleboxes: the corruption TCP's 16-bit checksum misses) every block
is checked. Both ends decide for themselves: the sender from the address it dials, the
receiver from the connection's peer address, so an unchecked push from another host is refused.

"Local" means a loopback address or an address a socket of this host can bind (any of its
interfaces); a name is resolved first and is local only if every address it resolves to is.
A tunnel that makes both ends see a local peer (``ssh -L``, ``kubectl port-forward``, a VPN)
carries its own integrity check; ``checksum: "always"`` is for setups where that is not so.
Results are cached per host string (addresses do not move between a process's pushes; a stale
"local" costs one refused push: the receiver refuses an unchecked block from another host and
the sender re-sends it CRC'd, counted).
"""
from __future__ import annotations

import functools
import ipaddress
import socket


@functools.lru_cache(maxsize=256)
def is_local_host(host: str) -> bool:
    """Whether ``host`` (an IP literal, optionally ``[bracketed]``, or a name) is this host."""
    host = host.strip("[]")
    if not host or host == "localhost":
        return bool(host)
    try:
        ips = [ipaddress.ip_address(host.split("%", 1)[0])]
    except ValueError:
        try:
            ips = {ipaddress.ip_address(ai[4][0].split("%", 1)[0]) for ai in socket.getaddrinfo(host, None)}
        except (OSError, ValueError):        # unresolvable: not provably local, so checked
            return False
    return bool(ips) and all(_bindable(ip) for ip in ips)


def _bindable(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if ip.is_loopback:
        return True
    if ip.is_unspecified or ip.is_multicast:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))             # EADDRNOTAVAIL unless one of this host's interfaces has it
        return True
    except OSError:
        return False


def address_host(address: str) -> str:
    """The host part of a gRPC target ``host:port`` / ``[v6]:port`` (``unix:`` paths: ``localhost``)."""
    if address.startswith("unix:"):
        return "localhost"
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host


def peer_host(peer: str) -> str | None:
    """The host of a gRPC server context's ``peer()`` (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``,
    ``unix:...``); None for anything else (treated as another host)."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return "localhost"
    if kind in ("ipv4", "ipv6"):
        try:
            return address_host(rest)
        except ValueError:
            return None
    return None
