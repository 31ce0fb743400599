"""Who sent a request: the TCP peer, and what ``X-Forwarded-For`` may say about it, trusted only as
the config's ``trusted_proxies`` allow.

Ray Serve's HTTP proxy runs uvicorn, whose ``proxy_headers`` (on by default) rewrite the client
address from ``X-Forwarded-For`` for peers in ``FORWARDED_ALLOW_IPS`` (127.0.0.1 and ::1 unless
set). kvnotes starts Serve with that set to trust nobody (:data:`SERVE_PROXY_ENV`, passed to the
Serve controller, whose proxies inherit it), so the address a replica sees is the TCP peer, and
this module decides the rest:

- a peer in ``trusted_proxies`` (addresses or networks) may set the tenant header
  (``cluster.http.auth``), and the client's address is the right-most ``X-Forwarded-For`` hop that
  is not itself a trusted proxy (each proxy appends the address it was connected from);
- any other peer is the client, whatever headers it sends.

Where Serve was started by someone else (a Serve instance already running keeps its proxies'
environment) uvicorn may still have rewritten the address. A peer address equal to the hop
uvicorn's default would have taken from the request's own ``X-Forwarded-For`` (the right-most
one not 127.0.0.1 or ::1) is therefore never trusted: a real proxy appends its client's address,
not its own, so that only refuses a forged header.
"""
from __future__ import annotations

import ipaddress

XFF_HEADER = "x-forwarded-for"
#: the Serve controller's (and so its proxies') environment: uvicorn trusts no peer's X-Forwarded-For
SERVE_PROXY_ENV = {"FORWARDED_ALLOW_IPS": ""}
_UVICORN_DEFAULT_TRUST = ("127.0.0.1", "::1")
MAX_HOPS = 32                    # hops read from the right; a longer header is cut from the left


def parse_networks(entries) -> tuple:
    """``trusted_proxies`` entries as ``ipaddress`` networks (an address is its own /32 or /128);
    ``ValueError`` naming the first entry that is neither."""
    nets = []
    for e in entries:
        try:
            nets.append(ipaddress.ip_network(e.strip(), strict=False) if isinstance(e, str) else None)
        except ValueError:
            nets.append(None)
        if nets[-1] is None:
            raise ValueError(f"trusted_proxies: {e!r} is not an IP address or network (e.g. 10.0.0.7, 10.0.0.0/24)")
    return tuple(nets)


def _addr(host: str | None):
    if not host:
        return None
    host = host.strip()
    if host.startswith("[") and "]" in host:          # [v6]:port
        host = host[1:host.index("]")]
    elif host.count(":") == 1:                         # v4:port
        host = host.partition(":")[0]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _in(host: str | None, networks) -> bool:
    a = _addr(host)
    return a is not None and any(a in n for n in networks)


def hops(values) -> list[str]:
    """The hops of every ``X-Forwarded-For`` header, left to right (at most :data:`MAX_HOPS`)."""
    out = [h.strip() for v in values for h in str(v).split(",") if h.strip()]
    return out[-MAX_HOPS:]


def uvicorn_rewrite(values) -> str | None:
    """The address uvicorn's default ``proxy_headers`` would have made of these headers."""
    hs = hops(values)
    for h in reversed(hs):
        if h not in _UVICORN_DEFAULT_TRUST:
            return h
    return hs[0] if hs else None


class Forwarding:
    """The config's ``trusted_proxies``, applied to one request's peer and headers."""

    def __init__(self, trusted_proxies=()):
        self.networks = parse_networks(trusted_proxies)

    def peer_trusted(self, peer: str | None, xff_values=()) -> bool:
        """Whether ``peer`` is a trusted proxy (and not an address uvicorn made from the request's
        own ``X-Forwarded-For``; see the module doc)."""
        if not self.networks or not _in(peer, self.networks):
            return False
        made = uvicorn_rewrite(xff_values)
        return made is None or _addr(made) != _addr(peer)

    def client(self, peer: str | None, xff_values=()) -> str:
        """The client's address: the peer's own, or behind a trusted proxy the right-most
        forwarded hop that is not a trusted proxy ("unknown" when there is none to tell)."""
        if not self.peer_trusted(peer, xff_values):
            return peer or "unknown"
        for h in reversed(hops(xff_values)):
            if not _in(h, self.networks):
                a = _addr(h)
                return str(a) if a is not None else "unknown"
        return peer or "unknown"
