"""Hub addresses a person can type (issue 19 item 5): ``/dns4/NAME/tcp/PORT/p2p/ID`` (and ``/dns6``,
``/dns``), resolved to an ``/ip4`` or ``/ip6`` multiaddr just before each dial.

Resolution is ours, not py-libp2p's: its TCP transport resolves DNS multiaddrs with a DNS-only
resolver that ignores ``/etc/hosts`` and retries on its own schedule inside the dial, and when it
fails it says only "retries exhausted". ``trio.socket.getaddrinfo`` asks the system resolver (hosts
file, search domains, the same answer ``ping NAME`` gets) in a worker thread of trio's, so the loop
never blocks on it and a cancelled dial abandons it; each failure names the name and the reason.
"""

from __future__ import annotations

import socket

import trio

from ..errors import Timeout, TransportError

#: multiaddr protocol -> address family getaddrinfo is asked for
DNS_FAMILIES = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6, "dns": socket.AF_UNSPEC}
RESOLVE_TIMEOUT_S = 10.0


def dns_parts(addr: str) -> tuple[str, str, int, str] | None:
    """(protocol, name, TCP port, the rest from ``/tcp``) of a DNS multiaddr; None for any other
    address. TransportError for a DNS multiaddr without a name or a TCP port."""
    parts = addr.split("/")
    if len(parts) < 2 or parts[0] != "" or parts[1] not in DNS_FAMILIES:
        return None
    if len(parts) < 5 or not parts[2] or parts[3] != "tcp" or not parts[4].isdigit() or not 0 < int(parts[4]) < 65536:
        raise TransportError(f"a {parts[1]} address is /{parts[1]}/NAME/tcp/PORT/p2p/PEER_ID, got {addr[:200]!r}")
    return parts[1], parts[2], int(parts[4]), "/" + "/".join(parts[3:])


async def resolve_addr(addr: str, *, timeout_s: float = RESOLVE_TIMEOUT_S) -> str:
    """``addr`` with a DNS name replaced by the first address the system resolver gives for it
    (of the family ``dns4``/``dns6`` ask for); any other address unchanged."""
    parts = dns_parts(addr)
    if parts is None:
        return addr
    proto, name, port, rest = parts
    try:
        with trio.fail_after(timeout_s):
            infos = await trio.socket.getaddrinfo(name, port, family=DNS_FAMILIES[proto], type=socket.SOCK_STREAM)
    except trio.TooSlowError as exc:
        raise Timeout(f"resolving {name!r} ({proto}) took more than {timeout_s:g} s") from exc
    except OSError as exc:  # socket.gaierror: no such name, no address of that family, no resolver
        raise TransportError(f"cannot resolve {name!r} ({proto}): {exc.strerror or exc}") from exc
    for family, _type, _proto, _canon, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            return f"/{'ip6' if family == socket.AF_INET6 else 'ip4'}/{sockaddr[0]}{rest}"
    raise TransportError(f"cannot resolve {name!r} ({proto}): no IPv4 or IPv6 address")


_UNSPECIFIED = {"", "0.0.0.0", "::", "[::]"}


def reachable_data_addr(data_addr: str, hub_ip: str | None) -> str:
    """The hub's data-plane address (``host:port``) as a node can dial it: a hub listening on every
    interface (``0.0.0.0:PORT``) names no host, and a node that found the hub by name would dial
    its own machine; the IP its control connection reached the hub at is the one to use."""
    host, sep, port = data_addr.rpartition(":")
    if not sep or host not in _UNSPECIFIED or not hub_ip:
        return data_addr
    return f"[{hub_ip}]:{port}" if ":" in hub_ip else f"{hub_ip}:{port}"
