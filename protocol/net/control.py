"""The libp2p control plane: one host wrapper that nodes and the hub both use.

Standard stack only, so any libp2p implementation can talk to us: TCP, Noise (XX, Ed25519
identity), Yamux, identify, ping (``/ipfs/ping/1.0.0``) and GossipSub v1.1 (``/meshsub/1.1.0``,
with ``/meshsub/1.0.0`` as fallback). Request/response protocols carry one length-prefixed frame
each way (see :mod:`echo2.protocol.framing`); the payloads are the foundation's signed
envelopes, opaque here.

This module holds the host's lifecycle, connections and bootstrap peers; the host is built in
:mod:`.libp2p_host`, requests are served and sent in :mod:`.reqresp`, gossip runs in
:mod:`.gossip`. How the py-libp2p 0.8.1 traps (BRIEF §9) are handled:

* The default security list also offers ``/plaintext/2.0.0``, secio and TLS: we pass ``sec_opt``
  with Noise alone, so multistream-select answers ``na`` to anything else and the upgrade fails.
  ``muxer_opt`` holds Yamux alone (the default also offers Mplex).
* A stream handler that raises kills the host: every handler we register is wrapped by
  :meth:`~echo2.protocol.net.reqresp.RequestResponse._serve_stream`, which catches ``Exception`` (not ``BaseException``, so trio
  cancellation still works), replies with an error frame where it still can, logs with the
  peer ID and counts the refusal.
* A dead peer mid-read looks like a clean EOF: every message is length-prefixed and a short read
  is reported as a truncated frame (:class:`TransportError`), never as a short message.
* A connect to a silent listener hangs about 120 s: every dial, stream open and request runs
  under ``trio.fail_after`` and becomes :class:`Timeout`.
* GossipSub defaults (120 s heartbeat, 10 msgs/s per peer and topic, a 32-deep subscription
  queue that drops silently, a 1 MiB limit that drops silently): heartbeat 1 s, a rate limit
  sized for a large fleet's announcements, adaptive gossip off (it can stretch the heartbeat to
  30-60 s), a reader task per subscription that drains the queue at once, and our own size limit
  checked before publishing (TooLarge) and on receipt (counted refusal).
* The listener keeps accepting until ``await host.close()``: exit calls it explicitly, inside
  the ``host.run`` context, after our own tasks are cancelled.
* Errors out of ``host.run()`` arrive as nested ExceptionGroups: they are left to propagate
  (after shutdown) rather than swallowed, since they mean a bug, not a hostile peer.

Hostile peers (:class:`RequestLimits`): each remote peer ID has a token bucket per protocol
(refused with ``rate_limited`` before a byte of the request is read), a cap on the streams it
holds open at once (``too_many_streams``), request bodies are charged as they arrive against byte
budgets per peer (trusted peers, as :attr:`ControlHost.is_trusted` says) or per peer, per IP and
over all strangers (``busy``), a body slower than a minimum rate is cut (``too_slow``), each
remote IP may hold a bounded number of connections (the excess is closed), a remote IP whose
peers are not admitted may open only so many new connections per second and hold only so many
mid-handshake (the excess is closed before the Noise handshake; admitted peers widen their own
address's allowance, :mod:`.conngate`) and only so many new streams per
second (the excess is reset before its protocol is even negotiated, and its connection closed),
and gossip is
rate-limited per origin and topic. Refusals are counted in ``refusals`` by code; their log lines
are thinned under a flood (:class:`LogThrottle`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.pubsub import Pubsub

from ..backoff import backoff_delay
from ..errors import Echo2Error, HandshakeError, Timeout, TransportError
from ..identity import Identity
from ..peerlimit import ByteBudget, ConcurrencyLimiter, KeyedRateLimiter, LogThrottle, address_key
from .conngate import InboundGate, MemberBook
from .gossip import Gossip, GossipConfig, start_gossip
from .libp2p_host import (
    build_host,
    find_echo2_error,
    is_handshake_failure,
    keypair_from_identity,
    parse_peer_addr,
    parse_peer_id,
    peer_str,
    remote_ip_of,
)
from .names import resolve_addr
from .reqresp import RequestResponse, TrustPredicate, quiet_close, remote_ip

__all__ = ["ANNOUNCE_TOPIC", "ControlHost", "RequestLimits", "address_key", "remote_ip"]

logger = logging.getLogger(__name__)

ANNOUNCE_TOPIC = "echo2/announce/1"
#: peers whose dialled addresses are remembered (the hub dials back admitted nodes, a node its hub)
MAX_DIALLED = 16_384

PeerCallback = Callable[[str], None]


@dataclass(frozen=True)
class RequestLimits:
    """What one remote peer may ask of this host; every figure is per remote peer ID or IP.

    The defaults are an order of magnitude above what an honest node does (one work long-poll,
    a result every task, a holds report per version: a few requests per second at most) and far
    below what a single core can answer, so a hostile peer cannot crowd out the rest. A
    protocol that needs other figures gets them in ``per_protocol`` (protocol ID -> (rate,
    burst)).

    Request bytes are charged as they arrive. A trusted (admitted) peer may hold
    ``max_inflight_per_peer`` and all of them together ``max_inflight_bytes``. Fresh identities
    are free to make, so strangers share nothing with them: each holds at most
    ``stranger_inflight_per_peer``, each IP ``stranger_inflight_per_ip`` and ``max_stranger_streams_per_ip``
    streams, all strangers ``stranger_inflight_bytes``. A body must arrive at
    ``min_body_rate_Bps`` on average once ``body_grace_s`` has passed (a slow honest uplink of
    32 KiB/s still passes). ``max_connections_per_ip`` bounds the control connections one address
    holds (admitted peers behind it are never closed for it).
    """

    rate_per_s: float = 50.0
    burst: float = 100.0
    per_protocol: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    max_streams_per_peer: int = 32
    max_inflight_bytes: int = 512 * 1024 * 1024
    max_inflight_per_peer: int = 96 * 1024 * 1024
    # A stranger asks for admission (an AdmissionRequest is at most 72 KiB) or a probe (64 KiB).
    stranger_inflight_per_peer: int = 256 * 1024
    stranger_inflight_per_ip: int = 2 * 1024 * 1024
    stranger_inflight_bytes: int = 32 * 1024 * 1024
    max_stranger_streams_per_ip: int = 64
    min_body_rate_Bps: float = 32 * 1024
    body_grace_s: float = 5.0
    # How long a served stream waits for its requester to end its side before resetting it
    # (py-libp2p keeps a stream and its unread window until both sides end it).
    end_grace_s: float = 2.0
    max_connections_per_ip: int = 64
    # New inbound streams per second of an address's peers not admitted (all protocols, identify
    # and gossip included), counted before the protocol is negotiated: fresh peer IDs are free, so
    # the per-peer rate does not bound a flood of them, and multistream negotiation, the body and
    # the signature check were most of what such a stream cost the hub (A3/A11). 5/s (was 20/s):
    # a joining node opens a handful (identify, admission, gossip), then is admitted and exempt;
    # each stranger stream served cost the host ~4 ms of CPU, the most of a flood's bill.
    stranger_streams_per_ip_s: float = 5.0
    stranger_streams_burst: float = 40.0
    # Inbound connections, gated per IP before the security handshake (:mod:`.conngate`, with the
    # measured costs): a stranger connection whose streams break the per-IP stream rate is also
    # closed, so a flood's next connection meets that gate.
    stranger_conns_per_ip_s: float = 2.0
    stranger_conns_burst: float = 20.0
    # Each admitted peer seen on an address within member_memory_s adds this to the address's
    # allowance; a connection on it whose peer is not admitted is closed right after Noise. An
    # honest node reconnects when its link breaks: a burst of 4 and one a minute covers a flapping
    # link, and a whole NAT'd fleet whose link broke at once (100 nodes: 400 at once).
    member_conns_per_s: float = 1 / 60
    member_conns_burst: float = 4.0
    member_memory_s: float = 600.0
    max_pending_per_ip: int = 16
    refused_hold_s: float = 5.0
    max_held_per_ip: int = 64
    gossip_rate_per_s: float = 10.0  # messages per origin and topic handed to the handler
    gossip_burst: float = 30.0
    max_tracked_peers: int = 100_000
    log_lines_per_s: int = 10


class _ConnNotifee(INotifee):
    """Relays swarm connect/disconnect events to the host's callbacks."""

    def __init__(self, owner: ControlHost) -> None:
        self._owner = owner

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        peer = peer_str(conn.muxed_conn.peer_id)
        if not self._owner._count_connection(conn, peer):
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                try:
                    await conn.close()
                except Exception as exc:
                    logger.debug("closing an excess connection from %s failed: %r", peer, exc)
            return
        self._owner._fire(self._owner._on_connect, peer, "connect")

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._owner._uncount_connection(conn)
        peer = peer_str(conn.muxed_conn.peer_id)
        self._owner._fire(self._owner._on_disconnect, peer, "disconnect")

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


class ControlHost(RequestResponse, Gossip):
    """A py-libp2p host restricted to TCP/Noise/Yamux with guarded handlers and GossipSub.

    Use as ``async with ControlHost(identity) as host:``; on entry the host is listening, on
    exit every task is cancelled, the host is closed and the port is released.
    """

    def __init__(
        self,
        identity: Identity,
        listen_port: int = 0,
        listen_host: str = "127.0.0.1",
        dial_timeout_s: float = 10.0,
        gossip: bool = True,
        *,
        request_timeout_s: float = 30.0,
        handler_timeout_s: float = 30.0,
        gossip_config: GossipConfig | None = None,
        bootstrap_check_s: float = 1.0,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        max_connections: int = 4096,
        limits: RequestLimits | None = None,
    ) -> None:
        self.identity = identity
        self.peer_id = identity.peer_id
        self.listen_port = listen_port
        self.listen_host = listen_host
        self.dial_timeout_s = dial_timeout_s
        self.request_timeout_s = request_timeout_s
        self.handler_timeout_s = handler_timeout_s
        self.gossip_enabled = gossip
        self.gossip_config = gossip_config or GossipConfig()
        self.bootstrap_check_s = bootstrap_check_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.max_connections = max_connections
        self.refusals: collections.Counter[str] = collections.Counter()
        self.limits = limits or RequestLimits()
        self._rate: dict[str, KeyedRateLimiter] = {}
        self._gossip_rate = KeyedRateLimiter(
            self.limits.gossip_rate_per_s, self.limits.gossip_burst, max_keys=self.limits.max_tracked_peers
        )
        lim = self.limits
        self._streams = ConcurrencyLimiter(lim.max_streams_per_peer)
        self._stranger_streams = ConcurrencyLimiter(lim.max_stranger_streams_per_ip)
        self._stranger_stream_rate = KeyedRateLimiter(
            lim.stranger_streams_per_ip_s, lim.stranger_streams_burst, max_keys=lim.max_tracked_peers
        )
        self._members = MemberBook(self.trusts, memory_s=lim.member_memory_s, max_ips=lim.max_tracked_peers)
        self._inbound = InboundGate(lim, members=lambda ip: self._members.members(ip, trio.current_time()),
                                    trusts=self.trusts, ip_conns=lambda ip: self._ip_conns[ip], refuse=self._refuse)
        self._closing: set[int] = set()  # id(muxed conn) of stranger connections being closed
        self._trusted_bytes = ByteBudget(lim.max_inflight_per_peer, lim.max_inflight_bytes)
        self._stranger_peer_bytes = ByteBudget(lim.stranger_inflight_per_peer, lim.stranger_inflight_bytes)
        self._stranger_ip_bytes = ByteBudget(lim.stranger_inflight_per_ip, lim.stranger_inflight_bytes)
        #: Whom the owner has admitted (the hub: its nodes; a node: its hub); None trusts everyone.
        self.is_trusted: TrustPredicate | None = None
        self._conn_ips: dict[int, tuple[str, str]] = {}  # id(conn) -> (remote IP, peer), connections we counted
        self._ip_conns: collections.Counter[str] = collections.Counter()
        self._log = LogThrottle(logger, self.limits.log_lines_per_s)
        self._keypair = keypair_from_identity(identity)
        self._host: IHost | None = None
        self._pubsub: Pubsub | None = None
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._bootstrap: list[str] = []
        self.dialled_addrs: dict[str, list[Any]] = {}  # peer -> the addresses we last dialled it at
        self._subscriptions: dict[str, Any] = {}
        self._handlers: dict[str, Callable[[INetStream], Awaitable[None]]] = {}
        self._on_connect: list[PeerCallback] = []
        self._on_disconnect: list[PeerCallback] = []
        self._rng = random.Random()

    # ----------------------------------------------------------------- lifecycle

    def _listen_multiaddr(self) -> multiaddr.Multiaddr:
        family = "ip6" if ":" in self.listen_host else "ip4"
        return multiaddr.Multiaddr(f"/{family}/{self.listen_host}/tcp/{self.listen_port}")

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[ControlHost]:
        listen = self._listen_multiaddr()
        host = build_host(
            self._keypair, listen, max_connections=self.max_connections, dial_timeout_s=self.dial_timeout_s
        )
        self._host = host
        host.get_network().register_notifee(_ConnNotifee(self))
        self._inbound.install(host)
        self._gate_streams(host)
        try:
            async with host.run([listen]):
                # py-libp2p only logs a failed listen (port in use, bad address) and runs on
                # without addresses; a control host that cannot be reached is an error.
                if not host.get_transport_addrs():
                    raise TransportError(f"could not listen on {listen}")
                for protocol_id, stream_handler in self._handlers.items():
                    host.set_stream_handler(TProtocol(protocol_id), stream_handler)
                try:
                    async with contextlib.AsyncExitStack() as services:
                        if self.gossip_enabled:
                            self._pubsub = await start_gossip(host, services, self.gossip_config)
                        async with trio.open_nursery() as nursery:
                            self._nursery = nursery
                            for addr in self._bootstrap:
                                nursery.start_soon(self._bootstrap_loop, addr)
                            logger.info("control host %s listening on %s", self.peer_id, self.addrs)
                            try:
                                yield self
                            finally:
                                self._nursery = None
                                nursery.cancel_scope.cancel()
                finally:
                    self._pubsub = None
                    self._subscriptions.clear()
                    with trio.CancelScope(shield=True):
                        await host.close()
        finally:
            self._host = None
            logger.info("control host %s closed", self.peer_id)

    async def __aenter__(self) -> ControlHost:
        if self._stack is not None:
            raise RuntimeError("ControlHost is already running")
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            await stack.enter_async_context(self._running())
        except BaseException as exc:
            await stack.__aexit__(None, None, None)
            # host.run() nests errors in ExceptionGroups; surface our own error bare.
            ours = find_echo2_error(exc)
            if ours is not None and ours is not exc:
                raise ours from exc
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        if stack is None:
            return None
        return await stack.__aexit__(*exc_info)

    def _require_host(self) -> IHost:
        if self._host is None:
            raise TransportError("control host is not running")
        return self._host

    @property
    def libp2p_host(self) -> IHost:
        """The underlying py-libp2p host, for protocols built directly on it (e.g. a DHT)."""
        return self._require_host()

    @property
    def running(self) -> bool:
        return self._host is not None

    @property
    def addrs(self) -> list[str]:
        """Full multiaddrs (``.../tcp/<port>/p2p/<peer id>``) others can dial."""
        host = self._require_host()
        return [str(a) for a in host.get_addrs()]

    @property
    def listen_addr(self) -> tuple[str, int]:
        """(host, port) actually bound, e.g. after ``listen_port=0``."""
        for addr in self._require_host().get_transport_addrs():
            port = addr.value_for_protocol("tcp")
            if port:
                return self.listen_host, int(port)
        raise TransportError("control host has no TCP listen address")

    # ----------------------------------------------------------------- connections

    def on_connect(self, callback: PeerCallback) -> None:
        self._on_connect.append(callback)

    def on_disconnect(self, callback: PeerCallback) -> None:
        self._on_disconnect.append(callback)

    def _fire(self, callbacks: list[PeerCallback], peer: str, what: str) -> None:
        for cb in list(callbacks):
            try:
                cb(peer)
            except Exception:
                logger.exception("%s callback failed for peer %s", what, peer)

    def _gate_streams(self, host: IHost) -> None:
        """Put the per-IP rate of strangers' new streams in front of protocol negotiation."""
        net = host.get_network()
        # the host's own handler: multistream-select, then the protocol's handler (py-libp2p's
        # Swarm keeps it here; the interface does not name it)
        negotiate: Callable[[INetStream], Awaitable[None]] | None = getattr(net, "common_stream_handler", None)
        if negotiate is None:
            raise TransportError("py-libp2p's swarm has no common_stream_handler: cannot gate strangers' streams")

        async def gate(stream: INetStream) -> None:
            if self._stream_allowed(stream):
                await negotiate(stream)
            else:
                await quiet_close(stream, reset=True)
                await self._close_stranger(stream.muxed_conn)

        net.set_stream_handler(gate)

    async def _close_stranger(self, muxed_conn: Any) -> None:
        """Close a stranger's connection whose streams broke its address's rate: on a kept
        connection each further stream, even reset unnegotiated, cost ~2 ms (A3/A11); a new one
        must pass the accept gate first."""
        key = id(muxed_conn)
        if key in self._closing:
            return
        self._closing.add(key)
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await muxed_conn.close()
        except Exception as exc:
            logger.debug("closing a stranger's connection failed: %r", exc)
        finally:
            self._closing.discard(key)

    def _stream_allowed(self, stream: INetStream) -> bool:
        try:
            peer = peer_str(stream.muxed_conn.peer_id)
            ip = address_key(remote_ip_of(stream.muxed_conn) or "?")
        except Exception:
            return False  # a stream we cannot place is not served
        if self.trusts(peer) or self._stranger_stream_rate.allow(ip, trio.current_time()):
            return True
        self._refuse("rate_limited", peer, "stream",
                     f"more than {self.limits.stranger_streams_per_ip_s:g} new streams/s from {ip} (not admitted)")
        return False

    def _count_connection(self, conn: INetConn, peer: str) -> bool:
        """Count a new connection against its IP; False if it is one too many (close it)."""
        ip = address_key(remote_ip_of(conn.muxed_conn) or "?")
        if self._ip_conns[ip] >= self.limits.max_connections_per_ip and not self.trusts(peer):
            self._refuse("too_many_connections", peer, "connect",
                         f"more than {self.limits.max_connections_per_ip} connections from {ip}")
            return False
        self._conn_ips[id(conn)] = (ip, peer)
        self._ip_conns[ip] += 1
        self._members.connected(ip, peer, trio.current_time())
        return True

    def _uncount_connection(self, conn: INetConn) -> None:
        counted = self._conn_ips.pop(id(conn), None)
        if counted is None:
            return
        ip, peer = counted
        self._members.disconnected(ip, peer, trio.current_time())
        left = self._ip_conns[ip] - 1
        if left > 0:
            self._ip_conns[ip] = left
        else:
            self._ip_conns.pop(ip, None)

    def remote_ip(self, peer_id: str) -> str | None:
        """The IP address ``peer_id`` is connected from (its first live connection), if any."""
        if self._host is None:
            return None
        try:
            conns = self._host.get_network().get_connections(parse_peer_id(peer_id))
        except Exception:
            return None
        for conn in conns:
            ip = remote_ip_of(conn.muxed_conn)
            if ip:
                return ip
        return None

    def connected_peers(self) -> list[str]:
        if self._host is None:
            return []
        return [peer_str(p) for p in self._host.get_connected_peers()]

    def is_connected(self, peer_id: str) -> bool:
        return peer_id in self.connected_peers()

    async def _dial(self, info: PeerInfo) -> None:
        host = self._require_host()
        peer = peer_str(info.peer_id)
        if peer == self.peer_id:
            raise TransportError("refusing to dial ourselves")
        # py-libp2p keeps a peer whose addresses all failed in a 60 s negative cache. Every caller
        # of _dial retries with its own capped backoff (5 s for a node's hub), so the cache only
        # turned a hub restart into a minute of silence (measured: nodes back 57 s after the hub).
        unblock = getattr(host.get_network(), "unblock_peer", None)
        if unblock is not None:
            unblock(info.peer_id)
        if info.addrs:  # for a later dial by ID after the peerstore forgot them (see _addrs_of)
            self.dialled_addrs.pop(peer, None)
            self.dialled_addrs[peer] = list(info.addrs)
            while len(self.dialled_addrs) > MAX_DIALLED:
                del self.dialled_addrs[next(iter(self.dialled_addrs))]
        try:
            with trio.fail_after(self.dial_timeout_s):
                await host.connect(info)
        except trio.TooSlowError as exc:
            raise Timeout(f"dial to {peer} timed out after {self.dial_timeout_s:g} s") from exc
        except Exception as exc:
            if is_handshake_failure(exc):
                raise HandshakeError(f"security handshake with {peer} failed: {exc}") from exc
            raise TransportError(f"dial to {peer} failed: {exc}") from exc

    async def connect(self, addr: str) -> str:
        """Dial ``/ip4/.../tcp/.../p2p/<id>`` (bounded by ``dial_timeout_s``); returns the peer ID.
        ``/dns4/NAME/...``, ``/dns6/NAME/...`` are resolved first (:mod:`.names`)."""
        info = parse_peer_addr(await resolve_addr(addr))
        await self._dial(info)
        return peer_str(info.peer_id)

    async def disconnect(self, peer_id: str) -> None:
        host = self._require_host()
        with trio.move_on_after(self.dial_timeout_s):
            try:
                await host.disconnect(parse_peer_id(peer_id))
            except Exception as exc:
                logger.debug("disconnect from %s failed: %r", peer_id, exc)

    def add_bootstrap(self, addr: str) -> None:
        """Keep a connection to ``addr`` while the host runs (reconnect with capped backoff)."""
        parse_peer_addr(addr)  # refuse a malformed address now, not in the background
        if addr in self._bootstrap:
            return
        self._bootstrap.append(addr)
        if self._nursery is not None:
            self._nursery.start_soon(self._bootstrap_loop, addr)

    async def _bootstrap_loop(self, addr: str) -> None:
        info = parse_peer_addr(addr)
        peer = peer_str(info.peer_id)
        failures = 0
        while True:
            if not self.is_connected(peer):
                try:
                    await self._dial(info)
                    if failures:
                        logger.info("bootstrap peer %s reconnected after %d failures", peer, failures)
                    failures = 0
                except Echo2Error as exc:
                    failures += 1
                    delay = backoff_delay(
                        failures, base_s=self.backoff_base_s, cap_s=self.backoff_cap_s, rng=self._rng
                    )
                    logger.warning(
                        "bootstrap dial to %s failed (%s); retry %d in %.1f s", peer, exc, failures, delay
                    )
                    await trio.sleep(delay)
                    continue
            await trio.sleep(self.bootstrap_check_s)

    def _refuse(self, code: str, peer: str, protocol_id: str, detail: str) -> None:
        self.refusals[code] += 1
        self._log.log(
            logging.WARNING, code, trio.current_time(), "refused %s from %s: [%s] %s", protocol_id, peer, code, detail
        )
