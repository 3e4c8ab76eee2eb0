"""The libp2p control plane: one host wrapper that nodes and the hub both use.

Standard stack only, so any libp2p implementation can talk to us: TCP, Noise (XX, Ed25519
identity), Yamux, identify, ping (``/ipfs/ping/1.0.0``) and GossipSub v1.1 (``/meshsub/1.1.0``,
with ``/meshsub/1.0.0`` as fallback). Request/response protocols carry one length-prefixed frame
each way (see :mod:`.framing`); the payloads are the foundation's signed envelopes, opaque here.

How the py-libp2p 0.8.1 traps (BRIEF §9) are handled:

* The default security list also offers ``/plaintext/2.0.0``, secio and TLS: we pass ``sec_opt``
  with Noise alone, so multistream-select answers ``na`` to anything else and the upgrade fails.
  ``muxer_opt`` holds Yamux alone (the default also offers Mplex).
* A stream handler that raises kills the host: every handler we register is wrapped by
  :meth:`ControlHost._serve_stream`, which catches ``Exception`` (not ``BaseException``, so trio
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
holds open at once (``too_many_streams``), request bodies being received count against a
budget over all peers (``busy``), and gossip is rate-limited per origin and topic. Refusals are
counted in ``refusals`` by code; their log lines are thinned under a flood (:class:`LogThrottle`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import random
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID as GOSSIPSUB_V10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as GOSSIPSUB_V11
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.rcmgr import ResourceLimits, new_resource_manager
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from ..errors import (
    Echo2Error,
    HandshakeError,
    IdentityError,
    Timeout,
    TooLarge,
    TransportError,
)
from ..framing import (
    HEADER_SIZE,
    MAX_ERROR_PAYLOAD,
    STATUS_OK,
    RemoteError,
    decode_header,
    decode_response,
    encode_error,
    encode_frame,
    encode_ok,
)
from ..identity import Identity
from ..peerlimit import ConcurrencyLimiter, KeyedRateLimiter, LogThrottle

__all__ = [
    "ANNOUNCE_TOPIC",
    "PING_PROTOCOL",
    "ControlHost",
    "RequestLimits",
    "GossipConfig",
    "Handler",
    "RemoteError",
    "TopicHandler",
    "backoff_delay",
    "keypair_from_identity",
]

logger = logging.getLogger(__name__)

ANNOUNCE_TOPIC = "echo2/announce/1"
PING_PROTOCOL = "/ipfs/ping/1.0.0"
_PING_LENGTH = 32

Handler = Callable[[str, bytes], Awaitable[bytes]]
TopicHandler = Callable[[str, bytes], Awaitable[None]]
PeerCallback = Callable[[str], None]


@dataclass(frozen=True)
class GossipConfig:
    """GossipSub settings sized for announcements, not py-libp2p's defaults.

    Announcements are a few KiB (an Announce with 16 addresses is < 4 KiB), sent on join and
    every tens of seconds per node. A relaying peer forwards the whole fleet's announcements, so
    the per-peer, per-topic rate limit must cover fleet size / announce period with margin:
    1000 nodes every 10 s is 100 msgs/s.
    """

    heartbeat_s: int = 1  # GossipSub's heartbeat_interval is an int (trio.sleep of it)
    degree: int = 6  # D, D_lo, D_hi: the GossipSub v1.1 spec defaults
    degree_low: int = 4
    degree_high: int = 12
    max_message_size: int = 64 * 1024  # per published message, checked before publishing
    max_rpc_size: int = 1024 * 1024  # one inbound pubsub RPC may batch several messages
    max_messages_per_topic_per_second: float = 200.0
    seen_ttl_s: int = 120
    handler_timeout_s: float = 10.0


@dataclass(frozen=True)
class RequestLimits:
    """What one remote peer may ask of this host; every figure is per remote peer ID.

    The defaults are an order of magnitude above what an honest node does (one work long-poll,
    a result every task, a holds report per version: a few requests per second at most) and far
    below what a single core can answer, so a hostile peer cannot crowd out the rest. A
    protocol that needs other figures gets them in ``per_protocol`` (protocol ID -> (rate,
    burst)). Fresh identities are free to make, so ``max_inflight_bytes`` bounds the memory all
    peers together can pin with request bodies, whatever their number.
    """

    rate_per_s: float = 50.0
    burst: float = 100.0
    per_protocol: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    max_streams_per_peer: int = 32
    max_inflight_bytes: int = 512 * 1024 * 1024
    gossip_rate_per_s: float = 10.0  # messages per origin and topic handed to the handler
    gossip_burst: float = 30.0
    max_tracked_peers: int = 100_000
    log_lines_per_s: int = 10


def keypair_from_identity(identity: Identity) -> KeyPair:
    """Our persistent Ed25519 key as a libp2p KeyPair; its peer ID is ``identity.peer_id``."""
    private = Ed25519PrivateKey.from_bytes(identity.seed)
    pair = KeyPair(private, private.get_public_key())
    if ID.from_pubkey(pair.public_key).to_base58() != identity.peer_id:
        raise IdentityError("libp2p peer ID does not match the identity's peer ID")
    return pair


def backoff_delay(
    failures: int,
    *,
    base_s: float = 0.5,
    cap_s: float = 30.0,
    rng: random.Random | None = None,
) -> float:
    """Capped exponential backoff with jitter (half to full of the step) after ``failures`` >= 1.

    Jitter keeps a fleet that lost its bootstrap peer at once from redialling in lockstep.
    """
    step = min(cap_s, base_s * 2.0 ** min(max(failures - 1, 0), 60))
    return step * (0.5 + 0.5 * (rng or random).random())


def _peer_str(peer: ID) -> str:
    return peer.to_base58()


def _parse_peer_addr(addr: str) -> PeerInfo:
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as exc:  # multiaddr and py-libp2p raise assorted types for bad input
        raise TransportError(f"not a multiaddr with /p2p/<peer id>: {addr[:200]!r} ({exc})") from exc


def _parse_peer_id(peer: str) -> ID:
    try:
        return ID.from_base58(peer)
    except Exception as exc:
        raise TransportError(f"not a peer ID: {peer[:80]!r}") from exc


def _is_handshake_failure(exc: BaseException) -> bool:
    """Whether a dial failed in the security upgrade (wrong peer, no common security protocol)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        cur = todo.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if type(cur).__name__ in {"SecurityUpgradeFailure", "HandshakeFailure", "SecurityError"}:
            return True
        if isinstance(cur, BaseExceptionGroup):
            todo.extend(cur.exceptions)
        for nxt in (cur.__cause__, cur.__context__):
            if nxt is not None:
                todo.append(nxt)
        for attr in ("exceptions", "errors"):  # ExceptionGroup-likes, libp2p's MultiError
            for sub in getattr(cur, attr, None) or []:
                if isinstance(sub, BaseException):
                    todo.append(sub)
    return False


def _find_echo2_error(exc: BaseException) -> Echo2Error | None:
    if isinstance(exc, Echo2Error):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _find_echo2_error(sub)
            if found is not None:
                return found
    return None


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except StreamEOF:
            chunk = b""
        except Exception as exc:  # StreamReset, StreamError, muxer errors: all transport failures
            raise TransportError(f"stream failed after {len(buf)} of {n} bytes: {exc!r}") from exc
        if not chunk:
            # A peer that died mid-transfer looks exactly like this: a clean EOF.
            raise TransportError(f"truncated frame: stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def _read_frame(stream: INetStream, *, max_size: int) -> bytes:
    length = decode_header(await _read_exactly(stream, HEADER_SIZE), max_size=max_size)
    return await _read_exactly(stream, length) if length else b""


# One write to a py-libp2p stream must never be cancelled halfway: Yamux hands each chunk to
# the Noise connection, and a Noise frame cut by a cancelled send corrupts the whole connection
# (every stream on it, not just ours). So bodies go out in chunks, each shielded from
# cancellation but bounded by its own grace period, with cancellation honoured between chunks.
# A chunk that cannot be written within the grace period means the connection is stuck; it is
# then cut mid-frame anyway and reported, and the caller drops that connection.
_WRITE_CHUNK = 64 * 1024


class _StalledWrite(TransportError):
    """A shielded chunk write did not finish within its grace period."""


async def _write(
    stream: INetStream,
    data: bytes,
    *,
    grace_s: float = 10.0,
    stop: trio.Event | None = None,
) -> None:
    for offset in range(0, max(len(data), 1), _WRITE_CHUNK):
        if stop is not None and stop.is_set():
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(grace_s) as scope:
                try:
                    await stream.write(data[offset : offset + _WRITE_CHUNK])
                except Exception as exc:
                    raise TransportError(f"stream write failed: {exc!r}") from exc
        if scope.cancelled_caught:
            raise _StalledWrite(f"stream write stalled for {grace_s:g} s")


async def _quiet_close(stream: INetStream, *, reset: bool = False) -> None:
    # Shielded: cleanup must run even when the caller's deadline has expired.
    with trio.CancelScope(shield=True), trio.move_on_after(2.0):
        try:
            if reset:
                await stream.reset()
            else:
                await stream.close()
        except Exception as exc:
            logger.debug("stream cleanup failed: %r", exc)


class _ConnNotifee(INotifee):
    """Relays swarm connect/disconnect events to the host's callbacks."""

    def __init__(self, owner: ControlHost) -> None:
        self._owner = owner

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._owner._fire(self._owner._on_connect, _peer_str(conn.muxed_conn.peer_id), "connect")

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        peer = _peer_str(conn.muxed_conn.peer_id)
        self._owner._fire(self._owner._on_disconnect, peer, "disconnect")

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


class ControlHost:
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
        self._streams = ConcurrencyLimiter(self.limits.max_streams_per_peer)
        self._inflight_bytes = 0
        self._log = LogThrottle(logger, self.limits.log_lines_per_s)
        self._keypair = keypair_from_identity(identity)
        self._host: IHost | None = None
        self._pubsub: Pubsub | None = None
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._bootstrap: list[str] = []
        self._subscriptions: dict[str, Any] = {}
        self._handlers: dict[str, Callable[[INetStream], Awaitable[None]]] = {}
        self._on_connect: list[PeerCallback] = []
        self._on_disconnect: list[PeerCallback] = []
        self._rng = random.Random()

    # ----------------------------------------------------------------- lifecycle

    def _listen_multiaddr(self) -> multiaddr.Multiaddr:
        family = "ip6" if ":" in self.listen_host else "ip4"
        return multiaddr.Multiaddr(f"/{family}/{self.listen_host}/tcp/{self.listen_port}")

    def _build_host(self, listen: multiaddr.Multiaddr) -> IHost:
        # A fresh X25519 static key per run is what Noise XX expects: identity is proven by the
        # Ed25519 signature over it in the handshake payload, not by the static key itself.
        noise = NoiseTransport(self._keypair, noise_privkey=create_new_x25519_key_pair().private_key)
        # Connection manager: py-libp2p's defaults keep >= 50 connections by redialling every
        # peer in the peerstore (auto-connector) and prune above 200, both wrong for a hub with
        # a large fleet and for nodes that should talk only to whom they choose.
        limit = self.max_connections
        conn_cfg = ConnectionConfig(
            max_connections=limit,
            high_watermark=limit,
            low_watermark=0,
            min_connections=0,
            dial_timeout=self.dial_timeout_s,
            outbound_upgrade_timeout=self.dial_timeout_s,
            inbound_upgrade_timeout=self.dial_timeout_s,
            outbound_stream_protocol_negotiation_timeout=self.dial_timeout_s,
            inbound_stream_protocol_negotiation_timeout=self.dial_timeout_s,
        )
        rcmgr = new_resource_manager(
            limits=ResourceLimits(max_connections=limit, max_streams=max(10_000, 16 * limit))
        )
        host = new_host(
            key_pair=self._keypair,
            sec_opt={NOISE_PROTOCOL_ID: noise},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            listen_addrs=[listen],
            connection_config=conn_cfg,
            resource_manager=rcmgr,
            negotiate_timeout=max(1, math.ceil(self.dial_timeout_s)),
        )
        # The auto-connector aims at (low + high watermark) / 2 connections whatever the
        # watermarks, dialling every peer in the peerstore; whom we connect to is our decision
        # (bootstrap peers, requests), so it must never start. The swarm calls start() when it
        # runs, hence the no-op replacement before that, rather than a stop() that could race.
        auto_connector = getattr(host.get_network(), "auto_connector", None)
        if auto_connector is not None:

            async def _never_start() -> None:
                return None

            setattr(auto_connector, "start", _never_start)  # noqa: B010 - instance override
        return host

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[ControlHost]:
        listen = self._listen_multiaddr()
        host = self._build_host(listen)
        self._host = host
        host.get_network().register_notifee(_ConnNotifee(self))
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
                            self._pubsub = await self._start_gossip(host, services)
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

    async def _start_gossip(self, host: IHost, services: contextlib.AsyncExitStack) -> Pubsub:
        cfg = self.gossip_config
        router = GossipSub(
            protocols=[GOSSIPSUB_V11, GOSSIPSUB_V10],
            degree=cfg.degree,
            degree_low=cfg.degree_low,
            degree_high=cfg.degree_high,
            heartbeat_initial_delay=0.1,
            heartbeat_interval=cfg.heartbeat_s,
            adaptive_gossip_enabled=False,
            max_messages_per_topic_per_second=cfg.max_messages_per_topic_per_second,
        )
        pubsub = Pubsub(
            host,
            router,
            seen_ttl=cfg.seen_ttl_s,
            strict_signing=True,  # messages signed by their origin's libp2p key (spec default)
            max_inbound_rpc_size=cfg.max_rpc_size,
        )
        await services.enter_async_context(background_trio_service(pubsub))
        await services.enter_async_context(background_trio_service(router))
        with trio.fail_after(10):
            await pubsub.wait_until_ready()
        return pubsub

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
            ours = _find_echo2_error(exc)
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

    def connected_peers(self) -> list[str]:
        if self._host is None:
            return []
        return [_peer_str(p) for p in self._host.get_connected_peers()]

    def is_connected(self, peer_id: str) -> bool:
        return peer_id in self.connected_peers()

    async def _dial(self, info: PeerInfo) -> None:
        host = self._require_host()
        peer = _peer_str(info.peer_id)
        if peer == self.peer_id:
            raise TransportError("refusing to dial ourselves")
        try:
            with trio.fail_after(self.dial_timeout_s):
                await host.connect(info)
        except trio.TooSlowError as exc:
            raise Timeout(f"dial to {peer} timed out after {self.dial_timeout_s:g} s") from exc
        except Exception as exc:
            if _is_handshake_failure(exc):
                raise HandshakeError(f"security handshake with {peer} failed: {exc}") from exc
            raise TransportError(f"dial to {peer} failed: {exc}") from exc

    async def connect(self, addr: str) -> str:
        """Dial ``/ip4/.../tcp/.../p2p/<id>`` (bounded by ``dial_timeout_s``); returns the peer ID."""
        info = _parse_peer_addr(addr)
        await self._dial(info)
        return _peer_str(info.peer_id)

    async def disconnect(self, peer_id: str) -> None:
        host = self._require_host()
        with trio.move_on_after(self.dial_timeout_s):
            try:
                await host.disconnect(_parse_peer_id(peer_id))
            except Exception as exc:
                logger.debug("disconnect from %s failed: %r", peer_id, exc)

    def add_bootstrap(self, addr: str) -> None:
        """Keep a connection to ``addr`` while the host runs (reconnect with capped backoff)."""
        _parse_peer_addr(addr)  # refuse a malformed address now, not in the background
        if addr in self._bootstrap:
            return
        self._bootstrap.append(addr)
        if self._nursery is not None:
            self._nursery.start_soon(self._bootstrap_loop, addr)

    async def _bootstrap_loop(self, addr: str) -> None:
        info = _parse_peer_addr(addr)
        peer = _peer_str(info.peer_id)
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

    # ----------------------------------------------------------------- request / response

    def set_handler(
        self,
        protocol_id: str,
        handler: Handler,
        max_request: int,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Serve ``protocol_id``: one request frame in, one response frame out.

        The handler gets (peer ID, request bytes) and returns the reply payload. An Echo2Error
        it raises becomes an error reply with that code; anything else becomes ``internal``.
        May be called before the host runs (registered on start) or while it runs.
        """
        limit = self.handler_timeout_s if timeout_s is None else timeout_s

        async def stream_handler(stream: INetStream) -> None:
            await self._serve_stream(stream, protocol_id, handler, max_request, limit)

        self._handlers[protocol_id] = stream_handler
        if self._host is not None:
            self._host.set_stream_handler(TProtocol(protocol_id), stream_handler)

    def remove_handler(self, protocol_id: str) -> None:
        self._handlers.pop(protocol_id, None)
        if self._host is not None:
            self._host.remove_stream_handler(TProtocol(protocol_id))

    def _refuse(self, code: str, peer: str, protocol_id: str, detail: str) -> None:
        self.refusals[code] += 1
        self._log.log(
            logging.WARNING, code, trio.current_time(), "refused %s from %s: [%s] %s", protocol_id, peer, code, detail
        )

    def _rate_limiter(self, protocol_id: str) -> KeyedRateLimiter:
        lim = self._rate.get(protocol_id)
        if lim is None:
            rate, burst = self.limits.per_protocol.get(protocol_id, (self.limits.rate_per_s, self.limits.burst))
            lim = KeyedRateLimiter(rate, burst, max_keys=self.limits.max_tracked_peers)
            self._rate[protocol_id] = lim
        return lim

    def _admit_stream(self, peer: str, protocol_id: str) -> bytes | None:
        """An error reply if ``peer`` may not open this stream now; None (stream counted) if it may."""
        if not self._rate_limiter(protocol_id).allow(peer, trio.current_time()):
            msg = f"more than {self._rate_limiter(protocol_id).rate_per_s:g} requests/s on {protocol_id}"
            self._refuse("rate_limited", peer, protocol_id, msg)
            return encode_error("rate_limited", msg)
        if not self._streams.acquire(peer):
            msg = f"more than {self._streams.limit} concurrent streams"
            self._refuse("too_many_streams", peer, protocol_id, msg)
            return encode_error("too_many_streams", msg)
        return None

    async def _serve_stream(
        self,
        stream: INetStream,
        protocol_id: str,
        handler: Handler,
        max_request: int,
        timeout_s: float,
    ) -> None:
        peer = "?"
        counted = False
        try:
            peer = _peer_str(stream.muxed_conn.peer_id)
            reply: bytes | None = self._admit_stream(peer, protocol_id)
            if reply is None:
                counted = True
                with trio.move_on_after(timeout_s) as scope:
                    reply = await self._answer(stream, peer, protocol_id, handler, max_request)
                if scope.cancelled_caught:
                    self._refuse("timeout", peer, protocol_id, f"no reply within {timeout_s:g} s")
                    reply = encode_error("timeout", f"no reply within {timeout_s:g} s")
            if reply is None:
                await _quiet_close(stream, reset=True)
                return
            try:
                await _write(stream, encode_frame(reply), grace_s=self.dial_timeout_s)
            except _StalledWrite:
                await self._drop_connection(stream)
                raise
            # close, not reset: py-libp2p's Yamux drops buffered data on a reset.
            await _quiet_close(stream)
        except Exception as exc:
            # Last line of defence: nothing may escape into the swarm (it would kill the host).
            self.refusals["transport"] += 1
            self._log.log(
                logging.WARNING, "transport", trio.current_time(), "stream %s from %s failed: %r", protocol_id, peer, exc
            )
            await _quiet_close(stream, reset=True)
        finally:
            if counted:
                self._streams.release(peer)

    async def _answer(
        self,
        stream: INetStream,
        peer: str,
        protocol_id: str,
        handler: Handler,
        max_request: int,
    ) -> bytes | None:
        """The response body for one request, or None when the stream is beyond replying to."""
        try:
            length = decode_header(await _read_exactly(stream, HEADER_SIZE), max_size=max_request)
        except TooLarge as exc:
            # Refused from the header alone; the requester reads while it writes, so it sees this.
            self._refuse(exc.code, peer, protocol_id, exc.message)
            return encode_error(exc.code, exc.message)
        except Echo2Error as exc:
            self._refuse(exc.code, peer, protocol_id, exc.message)
            return None
        budget = self.limits.max_inflight_bytes
        if self._inflight_bytes + length > budget:
            msg = f"too many request bytes in flight ({self._inflight_bytes} + {length} > {budget}); retry later"
            self._refuse("busy", peer, protocol_id, msg)
            return encode_error("busy", msg)
        # Held until the handler is done with the body, not only while it arrives.
        self._inflight_bytes += length
        try:
            try:
                request = await _read_exactly(stream, length) if length else b""
            except Echo2Error as exc:
                self._refuse(exc.code, peer, protocol_id, exc.message)
                return None
            try:
                return encode_ok(await handler(peer, request))
            except Echo2Error as exc:
                self._refuse(exc.code, peer, protocol_id, exc.message)
                return encode_error(exc.code, exc.message)
            except Exception as exc:
                self.refusals["internal"] += 1
                logger.exception("handler for %s failed on a request from %s", protocol_id, peer)
                return encode_error("internal", f"internal error ({type(exc).__name__})")
        finally:
            self._inflight_bytes -= length

    async def _open_stream(self, peer: str, protocol_ids: list[str], deadline: float) -> INetStream:
        host = self._require_host()
        if peer.startswith("/"):
            info = _parse_peer_addr(peer)
            peer_id = info.peer_id
            if not self.is_connected(_peer_str(peer_id)):
                await self._dial(info)
        else:
            peer_id = _parse_peer_id(peer)
            if not self.is_connected(peer):
                addrs = (
                    host.get_peerstore().addrs(peer_id) if peer_id in host.get_peerstore().peer_ids() else []
                )
                await self._dial(PeerInfo(peer_id, addrs))
        try:
            with trio.fail_at(min(deadline, trio.current_time() + self.dial_timeout_s)):
                return await host.new_stream(peer_id, [TProtocol(p) for p in protocol_ids])
        except trio.TooSlowError as exc:
            raise Timeout(f"opening {protocol_ids[0]} to {_peer_str(peer_id)} timed out") from exc
        except Exception as exc:
            raise TransportError(f"opening {protocol_ids[0]} to {_peer_str(peer_id)} failed: {exc}") from exc

    async def request(
        self,
        peer: str,
        protocol_id: str,
        payload: bytes,
        *,
        max_response: int,
        timeout_s: float | None = None,
    ) -> bytes:
        """Send one request frame to ``peer`` (peer ID or full multiaddr) and return the reply.

        Raises RemoteError for an error reply, Timeout / TransportError for transport failures
        (a peer that vanishes mid-reply gives a truncated frame), TooLarge if the reply exceeds
        ``max_response`` (+1 status byte), DecodeError for a malformed reply.
        """
        limit = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = trio.current_time() + limit
        try:
            with trio.fail_at(deadline):
                stream = await self._open_stream(peer, [protocol_id], deadline)
                try:
                    # An error reply may exceed a tiny max_response; it has its own limit.
                    max_body = max(max_response + 1, 1 + MAX_ERROR_PAYLOAD)
                    body = await self._exchange(stream, encode_frame(payload), max_body)
                except BaseException:
                    await _quiet_close(stream, reset=True)
                    raise
                await _quiet_close(stream)
        except trio.TooSlowError as exc:
            raise Timeout(f"{protocol_id} request to {peer[:80]} timed out after {limit:g} s") from exc
        if body[:1] == bytes([STATUS_OK]) and len(body) - 1 > max_response:
            raise TooLarge(f"response of {len(body) - 1} bytes exceeds the limit of {max_response}")
        return decode_response(body)

    async def _exchange(self, stream: INetStream, frame: bytes, max_body: int) -> bytes:
        # Write and read concurrently: a peer that refuses an oversized request replies without
        # draining it, and a writer blocked on the Yamux window must not hide that reply. The
        # writer is stopped by resetting the stream (which wakes a window wait), never by
        # cancelling it mid-chunk (see _write).
        write_error: list[TransportError] = []
        stop = trio.Event()
        written = trio.Event()

        async def writer() -> None:
            try:
                await _write(stream, frame, grace_s=self.dial_timeout_s, stop=stop)
            except TransportError as exc:
                if not stop.is_set():
                    write_error.append(exc)
            finally:
                written.set()

        body = b""
        read_error: Echo2Error | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            try:
                body = await _read_frame(stream, max_size=max_body)
            except Echo2Error as exc:
                # Raised outside the nursery so callers see it bare, not in an ExceptionGroup.
                read_error = exc
            finally:
                stop.set()
                if not written.is_set():
                    await _quiet_close(stream, reset=True)
        if write_error and isinstance(write_error[0], _StalledWrite):
            await self._drop_connection(stream)
        if read_error is not None:
            if isinstance(read_error, TransportError) and write_error:
                raise TransportError(
                    f"{read_error.message}; write failed too: {write_error[0]}"
                ) from read_error
            raise read_error
        return body

    async def _drop_connection(self, stream: INetStream) -> None:
        try:
            peer = _peer_str(stream.muxed_conn.peer_id)
        except Exception:
            return
        logger.warning("dropping the connection to %s after a stalled write", peer)
        with trio.CancelScope(shield=True):
            await self.disconnect(peer)

    async def ping(self, peer: str, *, timeout_s: float | None = None) -> float:
        """Round-trip time in seconds over the standard ping protocol."""
        limit = self.dial_timeout_s if timeout_s is None else timeout_s
        deadline = trio.current_time() + limit
        try:
            with trio.fail_at(deadline):
                stream = await self._open_stream(peer, [PING_PROTOCOL], deadline)
                try:
                    data = secrets.token_bytes(_PING_LENGTH)
                    start = trio.current_time()
                    await _write(stream, data)
                    echoed = await _read_exactly(stream, _PING_LENGTH)
                    rtt = trio.current_time() - start
                finally:
                    await _quiet_close(stream)
        except trio.TooSlowError as exc:
            raise Timeout(f"ping to {peer[:80]} timed out after {limit:g} s") from exc
        if echoed != data:
            raise TransportError(f"ping reply from {peer[:80]} does not match")
        return rtt

    # ----------------------------------------------------------------- gossip

    def _require_pubsub(self) -> Pubsub:
        if self._pubsub is None:
            raise TransportError("gossip is not running on this host")
        return self._pubsub

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish to a GossipSub topic; TooLarge (before anything is sent) above the limit."""
        limit = self.gossip_config.max_message_size
        if len(data) > limit:
            self.refusals["too_large"] += 1
            raise TooLarge(f"gossip message of {len(data)} bytes exceeds the limit of {limit}")
        pubsub = self._require_pubsub()
        try:
            await pubsub.publish(topic, data)
        except Exception as exc:
            raise TransportError(f"publish to {topic} failed: {exc}") from exc

    async def subscribe(self, topic: str, handler: TopicHandler) -> None:
        """Deliver every message on ``topic`` from other peers to ``handler(origin peer, data)``.

        One reader task per topic drains py-libp2p's 32-deep queue at once; each call is bounded
        by ``gossip_config.handler_timeout_s`` and guarded (an exception is logged, not raised).
        Our own messages are not delivered.
        """
        pubsub = self._require_pubsub()
        if self._nursery is None:
            raise TransportError("control host is not running")
        if topic in self._subscriptions:
            raise ValueError(f"already subscribed to {topic}")
        subscription = await pubsub.subscribe(topic)
        self._subscriptions[topic] = subscription
        self._nursery.start_soon(self._topic_reader, topic, subscription, handler)

    async def unsubscribe(self, topic: str) -> None:
        if self._subscriptions.pop(topic, None) is not None and self._pubsub is not None:
            await self._pubsub.unsubscribe(topic)

    async def _topic_reader(self, topic: str, subscription: Any, handler: TopicHandler) -> None:
        cfg = self.gossip_config
        while True:
            try:
                msg = await subscription.get()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return
            origin = "?"
            try:
                origin = ID(msg.from_id).to_base58()
                if origin == self.peer_id:
                    continue
                if not self._gossip_rate.allow((topic, origin), trio.current_time()):
                    self._refuse("rate_limited", origin, topic, "gossip messages above the per-origin rate")
                    continue
                data = bytes(msg.data)
                if len(data) > cfg.max_message_size:
                    self._refuse("too_large", origin, topic, f"gossip message of {len(data)} bytes")
                    continue
                with trio.move_on_after(cfg.handler_timeout_s) as scope:
                    await handler(origin, data)
                if scope.cancelled_caught:
                    self._refuse("timeout", origin, topic, "gossip handler timed out")
            except Echo2Error as exc:
                self._refuse(exc.code, origin, topic, exc.message)
            except Exception:
                self.refusals["internal"] += 1
                logger.exception("gossip handler for %s failed on a message from %s", topic, origin)

    def topic_peers(self, topic: str) -> list[str]:
        """Peers known to be subscribed to ``topic`` (from their subscription announcements)."""
        if self._pubsub is None:
            return []
        return [_peer_str(p) for p in self._pubsub.peer_topics.get(topic, set())]

    async def wait_topic_peers(self, topic: str, count: int, *, timeout_s: float = 10.0) -> None:
        """Wait until at least ``count`` peers announced a subscription to ``topic``."""
        try:
            with trio.fail_after(timeout_s):
                while len(self.topic_peers(topic)) < count:
                    await trio.sleep(0.05)
        except trio.TooSlowError as exc:
            raise Timeout(f"fewer than {count} peers on {topic} after {timeout_s:g} s") from exc
