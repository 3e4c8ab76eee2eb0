"""Inbound control connections gated per remote IP before the security handshake.

Measured on a ControlHost with gossip (session 9, a flood from another CPU, the host's CPU time
per operation): a stranger's new connection with one request cost the host ~20 ms (Noise,
identify, gossip negotiation), a request on a kept connection ~4 ms, a stream reset by the per-IP
stream gate ~2 ms, a raw TCP connection that never handshakes ~0.7 ms, a connection refused here
~0.3 ms. So an address may open only ``stranger_conns_per_ip_s`` new connections per second
(an honest newcomer opens one) and no address may hold more than ``max_pending_per_ip``
mid-handshake (A11's 600 silent sockets).

Admitted peers behind the address add to its allowance, but only for themselves. Session 9
exempted a whole address once one admitted peer was connected from it; under open admission an
attacker's own throwaway keys are admitted (the hub's per-IP bucket let 164 in within 33 s), so
its address was exempt and every further key cost the hub a full handshake, identify and gossip
(~20-23 ms each, ~12 % of the victims' core in bench attack A3). Now each admitted peer seen on
an address in the last ``member_memory_s`` (connected, or disconnected since) adds
``member_conns_burst`` connections at once and ``member_conns_per_s`` per second to the address's
member allowance (:class:`MemberAllowance`). A connection beyond the stranger allowance is let in
on the member allowance, and right after the Noise handshake (the first point where its peer ID
is known, before Yamux, identify or gossip) it is closed unless its peer is admitted: a stranger
riding the members' allowance costs the host one Noise handshake, not the whole ~20 ms.

What this costs an honest fleet behind one NAT address: nodes the hub still knows reconnect at
once (100 nodes: a burst of ``100 * member_conns_burst``); after a hub restart the hub knows
nobody, so they come in as strangers at ``stranger_conns_per_ip_s`` (20 at once, then 2/s: 100
nodes within ~40 s, plus their retry backoff).

A refused connection is held unread for ``refused_hold_s`` (at most ``max_held_per_ip`` of an
address; the rest are closed at once): closed at once, a refusal cost the host about 0.4 of what
the flooder spent dialling again; held, it costs a sleeping task while the flooder's dial waits
for its own timeout.

The hooks are py-libp2p 0.8.1 Swarm methods its interface does not name
(``_handle_inbound_connection``, which receives each accepted TCP connection, and
``upgrade_inbound_raw_conn``, which runs Noise and Yamux on it); a py-libp2p without them is
refused loudly rather than left ungated.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
from libp2p.abc import IHost
from libp2p.transport.exceptions import SecurityUpgradeFailure

from ..errors import TransportError
from ..peerlimit import ConcurrencyLimiter, KeyedRateLimiter, address_key

if TYPE_CHECKING:
    from .control import RequestLimits

__all__ = ["InboundGate", "MemberAllowance", "MemberBook"]

Refuse = Callable[[str, str, str, str], None]  # (code, peer, protocol, detail), ControlHost._refuse

#: Set while an inbound connection let in on its address's member allowance is being upgraded:
#: the Noise step then closes it unless its peer turns out to be admitted.
_ON_MEMBERS: contextvars.ContextVar[str | None] = contextvars.ContextVar("echo2_conngate_members", default=None)


def _ip_of(conn: Any) -> str:
    try:
        return address_key(str(conn.get_remote_address()[0]))
    except Exception:
        return "?"  # an address we cannot read is one more shared unknown address, never a free pass


class MemberAllowance:
    """New connections an address may open for its admitted peers: a token bucket per address
    whose size (``burst`` each) and refill (``per_s`` each) follow the number of admitted peers
    on it, read at each use (sans-IO; ``now`` is any monotonic clock). Bounded: the least
    recently used addresses are dropped above ``max_keys`` (a dropped one starts full again)."""

    def __init__(self, per_s: float, burst: float, *, max_keys: int = 100_000) -> None:
        if per_s < 0 or burst < 0:
            raise ValueError("member allowance figures must be >= 0")
        self.per_s, self.burst, self.max_keys = float(per_s), float(burst), int(max_keys)
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()  # ip -> (tokens, at)

    def allow(self, ip: str, members: int, now: float) -> bool:
        """Take one connection for ``ip``, which has ``members`` admitted peers; False if short."""
        cap = members * self.burst
        if cap < 1:
            return False
        tokens, at = self._state.pop(ip, (cap, now))
        tokens = min(cap, tokens + max(0.0, now - at) * members * self.per_s)
        ok = tokens >= 1
        self._state[ip] = (tokens - 1 if ok else tokens, max(at, now))
        while len(self._state) > self.max_keys:
            self._state.popitem(last=False)
        return ok


class MemberBook:
    """Which peers each address has connected now or had connected lately (sans-IO): what an
    address's member allowance counts. An admitted peer is remembered ``memory_s`` after its last
    connection from the address closed, at most ``per_ip`` peers an address (the most recent) and ``max_ips`` addresses, so a
    flood of keys or addresses only pushes out the oldest entries. Whether a remembered peer is
    admitted is asked at count time (``trusts``): admission can come after the connection and go
    (a ban, a silent node dropped). The count is cached per address for ``cache_s`` so that a
    flood of connections does not pay a scan each."""

    def __init__(self, trusts: Callable[[str], bool], *, memory_s: float = 600.0, per_ip: int = 1024,
                 max_ips: int = 100_000, cache_s: float = 1.0) -> None:
        self._trusts = trusts
        self.memory_s, self.per_ip, self.max_ips, self.cache_s = float(memory_s), int(per_ip), int(max_ips), float(cache_s)
        self._seen: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()
        self._connected: dict[str, dict[str, int]] = {}  # ip -> peer -> live connections
        self._cache: dict[str, tuple[int, float]] = {}

    def connected(self, ip: str, peer: str, now: float) -> None:
        conns = self._connected.setdefault(ip, {})
        conns[peer] = conns.get(peer, 0) + 1
        self._cache.pop(ip, None)

    def disconnected(self, ip: str, peer: str, now: float) -> None:
        conns = self._connected.get(ip)
        if conns is not None and peer in conns:
            conns[peer] -= 1
            if conns[peer] <= 0:
                del conns[peer]
            if not conns:
                del self._connected[ip]
        self._cache.pop(ip, None)
        if self._trusts(peer):  # only admitted peers are remembered: strangers' keys push out nobody
            self._touch(ip, peer, now)

    def _touch(self, ip: str, peer: str, now: float) -> None:
        peers = self._seen.pop(ip, None) or OrderedDict()
        peers.pop(peer, None)
        peers[peer] = now
        while len(peers) > self.per_ip:
            peers.popitem(last=False)
        self._seen[ip] = peers
        while len(self._seen) > self.max_ips:
            old, _ = self._seen.popitem(last=False)
            self._cache.pop(old, None)
        self._cache.pop(ip, None)

    def members(self, ip: str, now: float) -> int:
        """Admitted peers connected from ``ip`` now or within ``memory_s``."""
        hit = self._cache.get(ip)
        if hit is not None and now - hit[1] < self.cache_s:
            return hit[0]
        peers = self._seen.get(ip, OrderedDict())
        live = self._connected.get(ip, {})
        for p in [p for p, t in peers.items() if now - t > self.memory_s and p not in live]:
            del peers[p]
        n = sum(1 for p in set(peers) | set(live) if self._trusts(p))
        if len(self._cache) >= self.max_ips:
            self._cache.clear()
        self._cache[ip] = (n, now)
        return n


class InboundGate:
    """The per-IP connection rate, pending-handshake cap and refusal hold of one host."""

    def __init__(self, limits: RequestLimits, *, members: Callable[[str], int], trusts: Callable[[str], bool],
                 ip_conns: Callable[[str], int], refuse: Refuse) -> None:
        self.limits = limits
        self._members = members
        self._trusts = trusts
        self._ip_conns = ip_conns
        self._refuse = refuse
        self.rate = KeyedRateLimiter(limits.stranger_conns_per_ip_s, limits.stranger_conns_burst,
                                     max_keys=limits.max_tracked_peers)
        self.member_rate = MemberAllowance(limits.member_conns_per_s, limits.member_conns_burst,
                                           max_keys=limits.max_tracked_peers)
        self.pending = ConcurrencyLimiter(limits.max_pending_per_ip)
        self.held = ConcurrencyLimiter(limits.max_held_per_ip)
        self.cut_after_noise = 0  # connections on the member allowance whose peer was not admitted

    def admit(self, ip: str, now: float) -> tuple[bool, tuple[str, str] | None]:
        """Whether a new inbound connection from ``ip`` may start its handshake: (on the member
        allowance, None) or (False, (code, detail)) when it is refused."""
        lim = self.limits
        if self._ip_conns(ip) >= lim.max_connections_per_ip and self._members(ip) == 0:
            return False, ("too_many_connections", f"more than {lim.max_connections_per_ip} connections from {ip}")
        if self.rate.allow(ip, now):
            return False, None
        members = self._members(ip)
        if members and self.member_rate.allow(ip, members, now):
            return True, None
        return False, ("rate_limited", f"more than {lim.stranger_conns_per_ip_s:g} new connections/s from {ip} "
                                       f"({members} admitted peers seen there)")

    def refusal(self, ip: str, now: float) -> tuple[str, str] | None:
        """Why a new inbound connection from ``ip`` is refused before its handshake, or None."""
        return self.admit(ip, now)[1]

    async def _refuse_conn(self, conn: Any, ip: str, code: str, detail: str) -> None:
        self._refuse(code, "?", "connect", detail)
        try:
            if self.limits.refused_hold_s > 0 and self.held.acquire(ip):
                try:
                    await trio.sleep(self.limits.refused_hold_s)
                finally:
                    self.held.release(ip)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0), contextlib.suppress(Exception):
                await conn.close()

    def install(self, host: IHost) -> None:
        net = host.get_network()
        accept: Callable[..., Awaitable[Any]] | None = getattr(net, "_handle_inbound_connection", None)
        upgrade: Callable[..., Awaitable[Any]] | None = getattr(net, "upgrade_inbound_raw_conn", None)
        upgrader = getattr(net, "upgrader", None)
        secure: Callable[..., Awaitable[Any]] | None = getattr(upgrader, "upgrade_security", None)
        if accept is None or upgrade is None or secure is None:
            raise TransportError("py-libp2p's swarm has no inbound connection hooks: cannot gate connections")

        async def gated_accept(conn: Any, maddr: Any) -> None:
            # first thing after the accept: a refusal costs no multiaddr, no gate lookup, no handshake
            ip = _ip_of(conn)
            on_members, refusal = self.admit(ip, trio.current_time())
            if refusal is not None:
                await self._refuse_conn(conn, ip, *refusal)
                return
            token = _ON_MEMBERS.set(ip if on_members else None)  # the same task runs the upgrade
            try:
                await accept(conn, maddr)
            finally:
                _ON_MEMBERS.reset(token)

        async def gated_upgrade(raw_conn: Any, maddr: Any) -> Any:
            ip = _ip_of(raw_conn)
            if not self.pending.acquire(ip):
                detail = f"more than {self.limits.max_pending_per_ip} handshakes at once from {ip}"
                await self._refuse_conn(raw_conn, ip, "too_many_connections", detail)
                raise TransportError(f"inbound connection refused: {detail}")
            try:
                return await upgrade(raw_conn, maddr)
            finally:
                self.pending.release(ip)

        async def gated_secure(raw_conn: Any, is_initiator: bool, peer_id: Any = None) -> Any:
            secured = await secure(raw_conn, is_initiator, peer_id)
            ip = None if is_initiator else _ON_MEMBERS.get()
            if ip is not None:
                peer = str(secured.get_remote_peer())
                if not self._trusts(peer):
                    # in on the address's admitted peers' allowance, but not one of them: closed
                    # before Yamux, identify and gossip (the Noise handshake is all it cost)
                    self.cut_after_noise += 1
                    self._refuse("rate_limited", peer, "connect",
                                 f"more than {self.limits.stranger_conns_per_ip_s:g} new connections/s from {ip} "
                                 "and not admitted")
                    with trio.CancelScope(shield=True), trio.move_on_after(2.0), contextlib.suppress(Exception):
                        await secured.close()
                    raise SecurityUpgradeFailure(f"{peer} from {ip}: over the address's connection rate, not admitted")
            return secured

        setattr(net, "_handle_inbound_connection", gated_accept)  # noqa: B010 - instance override
        setattr(net, "upgrade_inbound_raw_conn", gated_upgrade)  # noqa: B010 - instance override
        setattr(upgrader, "upgrade_security", gated_secure)  # noqa: B010 - instance override (one per swarm)
