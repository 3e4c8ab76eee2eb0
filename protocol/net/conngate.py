"""Inbound control connections gated per remote IP before the security handshake.

Measured on a ControlHost with gossip (session 9, a flood from another CPU, the host's CPU time
per operation): a stranger's new connection with one request cost the host ~20 ms (Noise,
identify, gossip negotiation), a request on a kept connection ~4 ms, a stream reset by the per-IP
stream gate ~2 ms, a raw TCP connection that never handshakes ~0.7 ms, a connection refused here
~0.3 ms. So an address none of whose connected peers is admitted may open only
``stranger_conns_per_ip_s`` connections per second (an honest newcomer opens one) and no address
may hold more than ``max_pending_per_ip`` mid-handshake (A11's 600 silent sockets). An address with
an admitted peer connected is not rate-limited here (a NAT'd fleet reconnecting after a hub
restart); its strangers still meet the per-IP caps after the handshake.

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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
from libp2p.abc import IHost

from ..errors import TransportError
from ..peerlimit import ConcurrencyLimiter, KeyedRateLimiter, address_key

if TYPE_CHECKING:
    from .control import RequestLimits

__all__ = ["InboundGate"]

Refuse = Callable[[str, str, str, str], None]  # (code, peer, protocol, detail), ControlHost._refuse


def _ip_of(conn: Any) -> str:
    try:
        return address_key(str(conn.get_remote_address()[0]))
    except Exception:
        return "?"  # an address we cannot read is one more shared unknown address, never a free pass


class InboundGate:
    """The per-IP connection rate, pending-handshake cap and refusal hold of one host."""

    def __init__(self, limits: RequestLimits, *, trusted_ip: Callable[[str], bool], ip_conns: Callable[[str], int],
                 refuse: Refuse) -> None:
        self.limits = limits
        self._trusted_ip = trusted_ip
        self._ip_conns = ip_conns
        self._refuse = refuse
        self.rate = KeyedRateLimiter(limits.stranger_conns_per_ip_s, limits.stranger_conns_burst,
                                     max_keys=limits.max_tracked_peers)
        self.pending = ConcurrencyLimiter(limits.max_pending_per_ip)
        self.held = ConcurrencyLimiter(limits.max_held_per_ip)

    def refusal(self, ip: str, now: float) -> tuple[str, str] | None:
        """Why a new inbound connection from ``ip`` is refused before its handshake, or None."""
        lim = self.limits
        if self._trusted_ip(ip):
            return None
        if self._ip_conns(ip) >= lim.max_connections_per_ip:
            return "too_many_connections", f"more than {lim.max_connections_per_ip} connections from {ip}"
        if not self.rate.allow(ip, now):
            return "rate_limited", f"more than {lim.stranger_conns_per_ip_s:g} new connections/s from {ip} (not admitted)"
        return None

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
        if accept is None or upgrade is None:
            raise TransportError("py-libp2p's swarm has no inbound connection hooks: cannot gate connections")

        async def gated_accept(conn: Any, maddr: Any) -> None:
            # first thing after the accept: a refusal costs no multiaddr, no gate lookup, no handshake
            ip = _ip_of(conn)
            refusal = self.refusal(ip, trio.current_time())
            if refusal is not None:
                await self._refuse_conn(conn, ip, *refusal)
                return
            await accept(conn, maddr)

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

        setattr(net, "_handle_inbound_connection", gated_accept)  # noqa: B010 - instance override
        setattr(net, "upgrade_inbound_raw_conn", gated_upgrade)  # noqa: B010 - instance override
