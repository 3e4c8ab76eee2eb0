"""Construction of the py-libp2p host under the control plane, and its identifiers.

How the host is built is where most of py-libp2p 0.8.1's traps (BRIEF §9) are defused: Noise
alone as security (the default list also offers ``/plaintext/2.0.0``, secio and TLS), Yamux
alone as muxer (held to the receive windows it grants: :mod:`.yamux_guard`), connection limits sized for a fleet, every negotiation bounded by the dial
timeout, and the auto-connector never started.
"""

from __future__ import annotations

import math

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.rcmgr import ResourceLimits, new_resource_manager
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID

from ..errors import Echo2Error, IdentityError, TransportError
from ..identity import Identity
from .yamux_guard import WindowedYamux
from .yamux_guard import install as install_yamux_guard


def keypair_from_identity(identity: Identity) -> KeyPair:
    """Our persistent Ed25519 key as a libp2p KeyPair; its peer ID is ``identity.peer_id``."""
    private = Ed25519PrivateKey.from_bytes(identity.seed)
    pair = KeyPair(private, private.get_public_key())
    if ID.from_pubkey(pair.public_key).to_base58() != identity.peer_id:
        raise IdentityError("libp2p peer ID does not match the identity's peer ID")
    return pair



def build_host(
    keypair: KeyPair, listen: multiaddr.Multiaddr, *, max_connections: int, dial_timeout_s: float
) -> IHost:
    """A py-libp2p host with Noise alone, Yamux alone, and our connection limits and timeouts."""
    install_yamux_guard()
    # A fresh X25519 static key per run is what Noise XX expects: identity is proven by the
    # Ed25519 signature over it in the handshake payload, not by the static key itself.
    noise = NoiseTransport(keypair, noise_privkey=create_new_x25519_key_pair().private_key)
    # Connection manager: py-libp2p's defaults keep >= 50 connections by redialling every
    # peer in the peerstore (auto-connector) and prune above 200, both wrong for a hub with
    # a large fleet and for nodes that should talk only to whom they choose.
    limit = max_connections
    conn_cfg = ConnectionConfig(
        max_connections=limit,
        high_watermark=limit,
        low_watermark=0,
        min_connections=0,
        dial_timeout=dial_timeout_s,
        outbound_upgrade_timeout=dial_timeout_s,
        inbound_upgrade_timeout=dial_timeout_s,
        outbound_stream_protocol_negotiation_timeout=dial_timeout_s,
        inbound_stream_protocol_negotiation_timeout=dial_timeout_s,
    )
    rcmgr = new_resource_manager(
        limits=ResourceLimits(max_connections=limit, max_streams=max(10_000, 16 * limit))
    )
    host = new_host(
        key_pair=keypair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): WindowedYamux},
        listen_addrs=[listen],
        connection_config=conn_cfg,
        resource_manager=rcmgr,
        negotiate_timeout=max(1, math.ceil(dial_timeout_s)),
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


def peer_str(peer: ID) -> str:
    return peer.to_base58()


def remote_ip_of(muxed_conn: object) -> str | None:
    """The remote IP address of a muxed connection, or None where the transport cannot tell."""
    try:
        addr = muxed_conn.get_remote_address()  # type: ignore[attr-defined]
    except Exception:
        return None
    if not addr:
        return None
    return str(addr[0])


def parse_peer_addr(addr: str) -> PeerInfo:
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as exc:  # multiaddr and py-libp2p raise assorted types for bad input
        raise TransportError(f"not a multiaddr with /p2p/<peer id>: {addr[:200]!r} ({exc})") from exc


def parse_peer_id(peer: str) -> ID:
    try:
        return ID.from_base58(peer)
    except Exception as exc:
        raise TransportError(f"not a peer ID: {peer[:80]!r}") from exc


def is_handshake_failure(exc: BaseException) -> bool:
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


def find_echo2_error(exc: BaseException) -> Echo2Error | None:
    if isinstance(exc, Echo2Error):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = find_echo2_error(sub)
            if found is not None:
                return found
    return None
