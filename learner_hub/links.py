"""What the hub itself knows of each admitted node's links, so that the broadcast planner never
plans on a node's word (issue 15, A10).

A node's Announce claims a data-plane address, reachability and an upload rate; all three are
free to lie about (a literal ``0.0.0.0`` or a third party's host as a parent, "reachable" behind
a NAT, 1e9 B/s to take every child). The hub plans instead on what it observed:

- the **address**: the IP the node's control connection comes from (the announced host is
  ignored; only its port is taken), and that address is a parent only after the hub dialled it
  back and the data-plane handshake proved the node's peer ID there (:meth:`LinkBook.verified`,
  recorded by the probe service);
- its **scope**: a loopback address serves only nodes on the hub's own host, a private one only
  the hub's LAN, so a node is a parent only when its scope reaches every node of the fleet; an
  unspecified, multicast, link-local or reserved address is never one;
- the **upload**: what the hub's bandwidth responder timed (:meth:`LinkBook.record_upload`),
  capped by the node's own announced cap (a claim that can only lower it); until measured,
  :data:`UNMEASURED_UPLOAD_Bps`, a home uplink, so an unmeasured node never outranks a
  measured one.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import IntEnum

from echo2.protocol.dataframe import parse_addr
from echo2.protocol.errors import Echo2Error

UNMEASURED_UPLOAD_Bps = 1e6
# A transfer this small mostly measures the round trip; smaller ones are not recorded.
MIN_MEASURED_BYTES = 256 * 1024
MAX_PEERS = 65_536


class Scope(IntEnum):
    """Where an address can be reached from (higher reaches more)."""

    LOOPBACK = 0
    PRIVATE = 1
    PUBLIC = 2


def ip_scope(ip: str) -> Scope | None:
    """The scope of a unicast address a peer may be dialled at; None for one that must never be
    planned (unspecified, multicast, link-local, reserved, malformed)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_unspecified or addr.is_multicast or addr.is_link_local:
        return None
    if addr.is_loopback:  # before is_reserved, which ::1 (in ::/8) also is
        return Scope.LOOPBACK
    if addr.is_reserved:  # 240/4 and 255.255.255.255 among them
        return None
    return Scope.PRIVATE if addr.is_private else Scope.PUBLIC


def join_addr(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def announced_port(data_addr: str) -> int | None:
    """The port of an announced ``host:port`` (its host is never used)."""
    if not data_addr:
        return None
    try:
        return parse_addr(data_addr)[1]
    except Echo2Error:
        return None


def punch_addr(observed_ip: str | None, observed_port: int | None, bound_port: int, listen_port: int | None) -> str:
    """Where a NAT-bound node can be punched to (node.punch), or "": the node's hub link left
    from its data-plane listen port (``bound_port``, its word, equal to the port it announced)
    and the hub saw it arrive from that same port, so its NAT keeps the port (Linux MASQUERADE
    does when it is free) and a peer punching to ``observed_ip:port`` meets the same mapping. A
    NAT that rewrote the port is likely to map each destination apart (the mapping the hub saw
    is not the one a peer would meet): not punched to."""
    if not observed_ip or ip_scope(observed_ip) is None or not bound_port or bound_port != listen_port:
        return ""
    return join_addr(observed_ip, bound_port) if observed_port == bound_port else ""


@dataclass
class Link:
    observed_ip: str = ""
    verified: str = ""  # "ip:port" where a dial-back handshake proved the peer ID
    upload_Bps: float = 0.0  # hub-measured; 0: not yet
    upload_bytes: int = 0  # size of the transfer it was measured on
    measured_at: float = 0.0
    wanted: str = ""  # "ip:port" the planner would use, to be proven by the hub's dial-back
    tried_at: float = -math.inf  # when the hub last dialled ``wanted`` (its own clock)


@dataclass(frozen=True)
class LinkView:
    """What the planner may use of a node: ``data_addr`` is "" when the hub knows no address."""

    data_addr: str
    upload_Bps: float
    reachable: bool
    measured: bool


class LinkBook:
    """Per admitted peer: observed IP, dial-back-verified data address, measured upload.

    ``observer(peer)`` (set by the hub once its control host runs) gives the IP the peer's
    control connection comes from now; a verification made at another IP no longer counts.
    Bounded: the least recently touched peers are forgotten above ``max_peers``.
    """

    def __init__(self, *, max_peers: int = MAX_PEERS) -> None:
        self.max_peers = max_peers
        self.observer: Callable[[str], str | None] | None = None
        self._links: OrderedDict[str, Link] = OrderedDict()
        self._scope_cache: tuple[int, frozenset[str], Scope | None] | None = None
        self._generation = 0  # bumped when an observed IP changes (invalidates the scope cache)

    def __len__(self) -> int:
        return len(self._links)

    def get(self, peer: str) -> Link | None:
        return self._links.get(peer)

    def _link(self, peer: str) -> Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = Link()
            while len(self._links) > self.max_peers:
                self._links.popitem(last=False)
        else:
            self._links.move_to_end(peer)
        return link

    def observed(self, peer: str, ip: str) -> None:
        link = self._link(peer)
        if link.observed_ip != ip:
            link.observed_ip = ip
            self._generation += 1

    def verified(self, peer: str, ip: str, port: int) -> None:
        """The hub dialled ``ip:port`` and the handshake there proved ``peer``'s key."""
        self.observed(peer, ip)
        self._link(peer).verified = join_addr(ip, port)

    def record_upload(self, peer: str, nbytes: int, seconds: float, now: float | None = None) -> None:
        """The hub timed ``nbytes`` from ``peer``. The largest transfer's rate is kept (small
        ones mostly measure the round trip)."""
        if nbytes < MIN_MEASURED_BYTES or not (math.isfinite(seconds) and seconds > 0):
            return
        link = self._link(peer)
        if nbytes >= link.upload_bytes:
            link.upload_Bps, link.upload_bytes = nbytes / seconds, nbytes
            link.measured_at = time.time() if now is None else now

    def unproven(self, now: float, retry_s: float, limit: int) -> list[tuple[str, str]]:
        """Up to ``limit`` ``(peer, "ip:port")`` the planner asked about that no dial-back has
        proven, each at most once per ``retry_s`` (so a NAT-bound node costs one dial per
        ``retry_s``); they are marked tried."""
        out: list[tuple[str, str]] = []
        for peer, link in self._links.items():
            if len(out) >= limit:
                break
            if link.wanted and link.wanted != link.verified and now - link.tried_at >= retry_s:
                link.tried_at = now
                out.append((peer, link.wanted))
        return out

    def forget(self, peer: str) -> None:
        if self._links.pop(peer, None) is not None:
            self._generation += 1

    def current_ip(self, peer: str) -> str:
        link = self._links.get(peer)
        ip = self.observer(peer) if self.observer is not None else None
        if ip:
            if link is None or link.observed_ip != ip:
                self.observed(peer, ip)
            return ip
        return link.observed_ip if link is not None else ""

    def _widest_scope(self, fleet: Collection[str]) -> Scope | None:
        key = frozenset(fleet)
        cached = self._scope_cache
        if cached is not None and cached[0] == self._generation and cached[1] == key:
            return cached[2]
        scopes = [s for p in key if (lk := self._links.get(p)) and (s := ip_scope(lk.observed_ip)) is not None]
        widest = max(scopes, default=None)
        self._scope_cache = (self._generation, key, widest)
        return widest

    def view(self, peer: str, data_addr: str, cap_Bps: float, fleet: Collection[str]) -> LinkView:
        """Planning input for ``peer``: its announced ``data_addr`` gives only the port; ``cap_Bps``
        is its own announced upload cap (0: none); ``fleet`` the admitted peers (for scope)."""
        ip = self.current_ip(peer)
        port = announced_port(data_addr)
        scope = ip_scope(ip) if ip else None
        addr = join_addr(ip, port) if port is not None and scope is not None else ""
        link = self._links.get(peer)
        if addr and (link is None or link.verified != addr):
            link = self._link(peer)
            link.wanted = addr  # the hub's verifier dials it back (probe_service.verify_loop)
        measured = link is not None and link.upload_Bps > 0
        up = link.upload_Bps if link is not None and measured else UNMEASURED_UPLOAD_Bps
        if cap_Bps > 0:
            up = min(up, cap_Bps)
        widest = self._widest_scope(fleet)
        reachable = (
            bool(addr)
            and link is not None
            and link.verified == addr
            and scope is not None
            and (widest is None or scope >= widest)
        )
        return LinkView(addr, up, reachable, measured)


__all__ = ["LinkBook", "LinkView", "Scope", "UNMEASURED_UPLOAD_Bps", "announced_port", "ip_scope", "join_addr",
           "punch_addr"]
