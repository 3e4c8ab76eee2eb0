"""The bulk data plane: plain TCP between peers, authenticated with their libp2p keys.

Why not libp2p: one py-libp2p Noise/Yamux stream moves about 75 MB/s and pins a core, while
plain trio TCP moves over a GB/s on the same loopback. Policy chunks therefore travel here; the
address (``host:port``) is announced over the libp2p control plane (``Announce.data_addr``).

Connection = handshake, then frames in both directions. The handshake's bytes and rules are
:mod:`echo2.protocol.handshake` (mutual, signed transcript of both nonces and keys plus a role
byte, then the listener's verdict byte); the exchange runs here. Frames are
:mod:`echo2.protocol.dataframe`, moved by :class:`~echo2.protocol.net.connection.DataConnection`.

The dialer names the peer it expects (``expected_peer_id``, learnt from the control plane) and
refuses any other key; the listener may apply ``allow(peer_id)``.

What the handshake does *not* give: confidentiality, or integrity against an on-path attacker
who can inject into the TCP stream. Neither is needed for what travels here: chunk frames carry
their blake3 hash, which the receiver checks before handing the bytes on (and the layer above
checks against the hub-signed manifest), and messages are signed envelopes. The handshake serves
accounting, allow-lists and the choice of who to serve.

Hostile peers (:class:`DataPlaneServer`): a global cap on connections, a cap per remote IP
(``too_many_connections.ip``, checked before the handshake, so it costs no signature), a
token bucket of handshake attempts per IP (``handshake.rate_limited``), and a cap per
authenticated peer ID (refused in the handshake verdict, ``too_many_connections.peer``), and
memory budgets for frames being received: per peer ID over all its connections, per remote IP
(fresh identities are free) and over the server (``frame.over_budget`` drops the connection).
Nothing but the handshake is read from a peer that has not authenticated. Refusal log lines are
thinned under a flood; every refusal is counted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from ..dataframe import FrameType, parse_addr
from ..errors import BadSignature, Echo2Error, IdentityError, Timeout, TransportError
from ..handshake import (
    ACCEPTED,
    HELLO,
    REFUSED,
    ROLE_DIALER,
    ROLE_LISTENER,
    SIG_SIZE,
    HandshakeRefused,
    encode_hello,
    parse_hello,
    transcript,
)
from ..identity import Identity, peer_id_from_public_key, verify_signature
from ..peerlimit import ByteBudget, ConcurrencyLimiter, KeyedRateLimiter, LogThrottle, address_key
from .connection import STATS, DataConnection, DataPlaneStats, count_refusal
from .ratelimit import UploadLimiter

log = logging.getLogger(__name__)


# --- handshake --------------------------------------------------------------------------------


async def _recv_exact(stream: trio.SocketStream, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            data = await stream.receive_some(n - len(buf))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise HandshakeRefused("eof", f"connection lost during handshake ({what}): {exc!r}") from exc
        if not data:
            raise HandshakeRefused("eof", f"peer closed the connection during handshake ({what})")
        buf += data
    return bytes(buf)


async def _send(stream: trio.SocketStream, data: bytes) -> None:
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise HandshakeRefused("eof", f"connection lost during handshake: {exc!r}") from exc


class _NoTurn:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_TURN = _NoTurn()


async def _handshake(
    stream: trio.SocketStream,
    identity: Identity,
    *,
    dialer: bool,
    expected_peer_id: str | None,
    allow: Callable[[str], bool] | None,
    turns: trio.Semaphore | None = None,
) -> tuple[str, bytes]:
    """Run the mutual handshake; returns the peer's ``(peer_id, public_key)``. ``turns``: the
    signature and its check (~100 us) each on a turn of it (never held while the peer is awaited)."""
    my_key = identity.public_bytes
    my_nonce = os.urandom(32)
    await _send(stream, encode_hello(my_key, my_nonce))
    peer_key, peer_nonce = parse_hello(await _recv_exact(stream, HELLO.size, "hello"))
    if peer_nonce == my_nonce:
        raise HandshakeRefused("reflection", "peer echoed our own hello")
    try:
        peer_id = peer_id_from_public_key(peer_key)
    except IdentityError as exc:  # cannot happen for 32 bytes, kept for hostile-input hygiene
        raise HandshakeRefused("bad_hello", str(exc)) from exc
    if expected_peer_id is not None and peer_id != expected_peer_id:
        raise HandshakeRefused("wrong_peer", f"expected peer {expected_peer_id}, the listener is {peer_id}")
    if dialer:
        signed = transcript(my_nonce, peer_nonce, my_key, peer_key)
    else:
        signed = transcript(peer_nonce, my_nonce, peer_key, my_key)
    my_role, peer_role = (ROLE_DIALER, ROLE_LISTENER) if dialer else (ROLE_LISTENER, ROLE_DIALER)
    async with turns or _NO_TURN:
        mine = identity.sign(signed + my_role)
    await _send(stream, mine)
    peer_sig = await _recv_exact(stream, SIG_SIZE, "signature")
    try:
        async with turns or _NO_TURN:
            verify_signature(peer_key, peer_sig, signed + peer_role)
    except BadSignature as exc:
        raise HandshakeRefused("bad_signature", f"peer claiming to be {peer_id} did not prove it") from exc
    if dialer:
        verdict = await _recv_exact(stream, 1, "verdict")
        if verdict != ACCEPTED:
            raise HandshakeRefused("not_allowed", f"listener {peer_id} refused us")
    else:
        allowed = True
        if allow is not None:
            try:
                allowed = bool(allow(peer_id))
            except Exception:
                log.exception("allow() check failed for %s; refusing", peer_id)
                allowed = False
        await _send(stream, ACCEPTED if allowed else REFUSED)
        if not allowed:
            raise HandshakeRefused("not_allowed", f"peer {peer_id} is not allowed")
    return peer_id, peer_key


async def connect(
    addr: str,
    identity: Identity,
    expected_peer_id: str,
    *,
    timeout_s: float = 10.0,
    upload_limit_MBps: float | None = None,
    upload_limiter: UploadLimiter | None = None,
    max_sizes: Mapping[FrameType, int] | None = None,
    stream: trio.SocketStream | None = None,
) -> DataConnection:
    """Dial ``addr`` (``"host:port"``) and authenticate both ways.

    ``stream``: a TCP connection to ``addr`` opened elsewhere (a punched hole, or one bound to our
    listen port: :mod:`echo2.node.punch`); only the handshake runs here, as the dialer.

    Raises ``HandshakeRefused`` (a ``HandshakeError``) if the listener is not
    ``expected_peer_id``, fails to prove its key, or refuses us; ``Timeout`` if the TCP connect
    plus handshake take longer than ``timeout_s``; ``TransportError`` if it cannot connect.
    ``upload_limit_MBps`` caps this connection; ``upload_limiter`` is a shared (per-process) cap.
    """
    host, port = parse_addr(addr)
    try:
        with trio.fail_after(timeout_s):
            if stream is None:
                try:
                    stream = await trio.open_tcp_stream(host, port)
                except OSError as exc:
                    raise TransportError(f"cannot connect to {addr}: {exc}") from exc
            peer_id, peer_key = await _handshake(
                stream, identity, dialer=True, expected_peer_id=expected_peer_id, allow=None
            )
    except trio.TooSlowError as exc:
        count_refusal("handshake.timeout")
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise Timeout(f"connect + handshake to {addr} took longer than {timeout_s:g} s") from exc
    except HandshakeRefused as exc:
        count_refusal(f"handshake.{exc.reason}")
        log.warning("data-plane handshake with %s (%s) failed: %s", addr, expected_peer_id, exc)
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise
    except BaseException:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise
    STATS.connections += 1
    own = UploadLimiter(upload_limit_MBps) if upload_limit_MBps else None
    return DataConnection(
        stream,
        peer_id=peer_id,
        peer_public_key=peer_key,
        local_peer_id=identity.peer_id,
        is_dialer=True,
        limiters=(own, upload_limiter),
        max_sizes=max_sizes,
    )


# --- server -----------------------------------------------------------------------------------

Handler = Callable[[DataConnection], Awaitable[Any]]


class DataPlaneServer:
    """Accepts data-plane connections and runs ``handler(conn)`` for each authenticated peer.

    A handler error is logged with the peer id and counted; it never stops the server. When the
    handler returns, the connection is closed cleanly (BYE); when it raises, it is aborted.
    ``upload_limit_MBps`` caps each connection; ``upload_limiter`` (shared with ``connect`` calls
    of the same process, if wanted) caps them all together.

    Limits on hostile peers: ``max_connections`` in all; ``max_connections_per_ip`` from one
    remote address (default: a quarter of ``max_connections``, so no single address can take the
    whole server, while a loopback bench whose nodes all share 127.0.0.1 still fits when it
    sizes ``max_connections`` for them); ``max_connections_per_peer`` per authenticated peer ID;
    ``handshakes_per_ip_per_s`` / ``handshake_burst`` attempts per address (None: unlimited);
    ``max_buffered_per_peer`` bytes of half-received frames per peer ID over all its
    connections (enough for one largest frame), ``max_buffered_per_ip`` per address,
    ``max_buffered_total`` over the server.
    """

    def __init__(
        self,
        identity: Identity,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        allow: Callable[[str], bool] | None = None,
        upload_limit_MBps: float | None = None,
        upload_limiter: UploadLimiter | None = None,
        handshake_timeout_s: float = 10.0,
        max_connections: int = 256,
        max_sizes: Mapping[FrameType, int] | None = None,
        max_connections_per_ip: int | None = None,
        max_connections_per_peer: int = 8,
        handshakes_per_ip_per_s: float | None = 20.0,
        handshake_burst: float = 40.0,
        max_buffered_per_peer: int = 80 * 1024 * 1024,
        max_buffered_per_ip: int = 256 * 1024 * 1024,
        max_buffered_total: int = 512 * 1024 * 1024,
        reuse_port: bool = False,
        handshake_turns: trio.Semaphore | None = None,
    ) -> None:
        self.identity = identity
        self.handshake_turns = handshake_turns  # bounds the handshakes' signatures per pass of the loop
        self.handler = handler
        self.host = host
        self.port = port
        self.allow = allow
        self.upload_limit_MBps = upload_limit_MBps
        self.upload_limiter = upload_limiter
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.max_sizes = max_sizes
        self.stats = DataPlaneStats()
        self.active = 0
        self.listeners: list[trio.SocketListener] = []
        per_ip = max_connections_per_ip if max_connections_per_ip is not None else max(1, max_connections // 4)
        self.per_ip = ConcurrencyLimiter(per_ip)
        self.per_peer = ConcurrencyLimiter(max_connections_per_peer)
        self.handshake_rate = (
            KeyedRateLimiter(handshakes_per_ip_per_s, handshake_burst, max_keys=65536)
            if handshakes_per_ip_per_s
            else None
        )
        self.rx_peer = ByteBudget(max_buffered_per_peer, max_buffered_total)
        self.rx_ip = ByteBudget(max_buffered_per_ip, max_buffered_total)
        self._log = LogThrottle(log)
        # SO_REUSEPORT on the listener, so that connections can leave from the listen port too
        # (a NAT then maps that port, which hole punching needs: echo2.node.punch)
        self.reuse_port = reuse_port

    @property
    def buffered_bytes(self) -> int:
        """Bytes of frames being received right now, over every connection."""
        return self.rx_peer.total_held

    @property
    def addr(self) -> str:
        """``host:port`` to announce (``Announce.data_addr``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; ``nursery.start(server.serve)`` returns once the
        port is bound (``server.port`` is then the real port)."""
        if self.reuse_port:
            self.listeners = [await _reuse_port_listener(self.host, self.port)]
        else:
            self.listeners = list(await trio.open_tcp_listeners(self.port, host=self.host))
        self.port = self.listeners[0].socket.getsockname()[1]
        log.info("data plane of %s listening on %s", self.identity.peer_id, self.addr)
        task_status.started(self)
        await trio.serve_listeners(self._handle, self.listeners)

    async def adopt(self, stream: trio.SocketStream) -> None:
        """Serve a TCP connection made elsewhere (one end of a punched hole) as if it had been
        accepted here: the same limits, the listener's side of the handshake (``allow`` and the
        handler's gate apply), then the handler."""
        await self._handle(stream)

    def _refuse(self, key: str, msg: str = "", *args: object) -> None:
        count_refusal(key, self.stats)
        if msg:
            self._log.log(logging.WARNING, key, trio.current_time(), msg, *args)

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            ip = str(stream.socket.getpeername()[0])
        except (OSError, IndexError, TypeError):
            ip = "?"
        if self.active >= self.max_connections:
            self._refuse("too_many_connections", "data plane full (%d connections): refused %s", self.active, ip)
            await trio.aclose_forcefully(stream)
            return
        if self.handshake_rate is not None and not self.handshake_rate.allow(ip, trio.current_time()):
            self._refuse("handshake.rate_limited", "data-plane handshakes from %s above the per-address rate", ip)
            await trio.aclose_forcefully(stream)
            return
        if not self.per_ip.acquire(ip):
            self._refuse("too_many_connections.ip", "more than %d data-plane connections from %s", self.per_ip.limit, ip)
            await trio.aclose_forcefully(stream)
            return
        self.active += 1
        try:
            await self._handle_inner(stream, ip)
        finally:
            self.active -= 1
            self.per_ip.release(ip)

    async def _handle_inner(self, stream: trio.SocketStream, remote: str) -> None:
        held: list[str] = []  # the peer ID counted against per_peer, once the handshake took it
        over_limit: list[str] = []

        def allow(peer_id: str) -> bool:
            # Runs inside the handshake, after the peer proved its key: a refusal here reaches
            # the dialer as the handshake verdict, and the slot is taken before any await.
            if not self.per_peer.acquire(peer_id):
                over_limit.append(peer_id)
                return False
            held.append(peer_id)
            return self.allow is None or bool(self.allow(peer_id))

        try:
            await self._handshake_and_serve(stream, remote, allow, over_limit)
        finally:
            for peer_id in held:
                self.per_peer.release(peer_id)

    async def _handshake_and_serve(
        self, stream: trio.SocketStream, remote: str, allow: Callable[[str], bool], over_limit: list[str]
    ) -> None:
        try:
            with trio.fail_after(self.handshake_timeout_s):
                peer_id, peer_key = await _handshake(
                    stream, self.identity, dialer=False, expected_peer_id=None, allow=allow, turns=self.handshake_turns
                )
        except trio.TooSlowError:
            self._refuse("handshake.timeout", "data-plane handshake from %s timed out", remote)
            await trio.aclose_forcefully(stream)
            return
        except HandshakeRefused as exc:
            if over_limit:
                self._refuse(
                    "too_many_connections.peer",
                    "more than %d data-plane connections from peer %s",
                    self.per_peer.limit,
                    over_limit[0],
                )
            else:
                self._refuse(f"handshake.{exc.reason}", "data-plane handshake from %s refused: %s", remote, exc)
            await trio.aclose_forcefully(stream)
            return
        except Exception:
            self._refuse("handshake.error")
            log.exception("data-plane handshake from %s failed", remote)
            await trio.aclose_forcefully(stream)
            return
        self.stats.connections += 1
        STATS.connections += 1
        own = UploadLimiter(self.upload_limit_MBps) if self.upload_limit_MBps else None
        conn = DataConnection(
            stream,
            peer_id=peer_id,
            peer_public_key=peer_key,
            local_peer_id=self.identity.peer_id,
            is_dialer=False,
            limiters=(own, self.upload_limiter),
            max_sizes=self.max_sizes,
            server_stats=self.stats,
            rx_accounts=[(self.rx_peer, peer_id), (self.rx_ip, address_key(remote))],
        )
        try:
            await self.handler(conn)
        except Echo2Error as exc:
            self._refuse(f"handler.{exc.code}", "data-plane connection with %s ended: %s", peer_id, exc)
            await conn.abort()
            return
        except Exception:
            self._refuse("handler.crash")
            log.exception("data-plane handler for %s crashed", peer_id)
            await conn.abort()
            return
        except BaseException:  # server shutting down: do not leave the socket open
            await conn.abort()
            raise
        await conn.aclose()


async def _reuse_port_listener(host: str, port: int) -> trio.SocketListener:
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
        await sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
