"""Request/response over libp2p streams: one length-prefixed frame each way, under limits.

Frames are :mod:`echo2.protocol.framing`. A dead peer mid-read looks like a clean EOF in
py-libp2p: every message is length-prefixed and a short read is reported as a truncated frame
(:class:`TransportError`), never as a short message. Every stream open and request runs under a
deadline and becomes :class:`Timeout`. A stream handler that raises would kill the host, so each
one we register is wrapped (:meth:`RequestResponse._serve_stream`): it catches ``Exception`` (not
``BaseException``, so trio cancellation still works), replies with an error frame where it still
can, logs with the peer ID and counts the refusal.

Limits on what a remote peer may ask (:class:`~echo2.protocol.net.control.RequestLimits`): a token
bucket per peer and protocol (``rate_limited``, before a byte of the request is read), a cap on
the streams a peer holds open (``too_many_streams``; for peers the owner has not admitted, per IP
too), byte budgets charged as the body actually arrives (``busy``) and a minimum body rate
(``too_slow``). An announced length costs its announcer nothing: a stream that announces 64 MiB
and sends nothing holds no budget and is cut once it falls below the minimum rate. A peer refused
for rate (by the bucket, or by a handler raising :class:`RateLimited`) is not read again until it
may ask again (:func:`~echo2.protocol.net.yamux_guard.hold_reads`).

Whom the owner trusts (its admitted peers; for a node, its hub) is :attr:`is_trusted`. A trusted
peer's bytes count against its own per-peer budget and a pool of trusted peers; anyone else's
against a small budget per peer ID, per IP and over all strangers together. The two pools share
nothing, so no number of strangers can make an admitted peer's request ``busy``.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.peerinfo import PeerInfo

from ..errors import Echo2Error, RateLimited, Timeout, TooLarge, TransportError
from ..framing import (
    HEADER_SIZE,
    MAX_ERROR_PAYLOAD,
    STATUS_OK,
    decode_header,
    decode_response,
    encode_error,
    encode_frame,
    encode_ok,
)
from ..peerlimit import ByteBudget, Charge, ConcurrencyLimiter, KeyedRateLimiter, LogThrottle, address_key
from .libp2p_host import parse_peer_addr, parse_peer_id, peer_str, remote_ip_of
from .names import resolve_addr
from .yamux_guard import END_POLL_S, discard_unread, forget_stream, hold_reads, peer_ended

if TYPE_CHECKING:
    from .control import RequestLimits

logger = logging.getLogger(__name__)

PING_PROTOCOL = "/ipfs/ping/1.0.0"
_PING_LENGTH = 32

Handler = Callable[[str, bytes], Awaitable[bytes]]
TrustPredicate = Callable[[str], bool]

_REMOTE_IP: contextvars.ContextVar[str | None] = contextvars.ContextVar("echo2_remote_ip", default=None)


def remote_ip() -> str | None:
    """The IP address of the peer whose request the calling handler is serving (None outside one).

    A context lookup rather than a handler argument, so handlers that need no address keep their
    (peer, data) signature.
    """
    return _REMOTE_IP.get()


class _Refused(Echo2Error):
    """A request body refused while it arrived (over budget, too slow); the reply names the code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def read_exactly(stream: INetStream, n: int) -> bytes:
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


async def read_frame(stream: INetStream, *, max_size: int) -> bytes:
    length = decode_header(await read_exactly(stream, HEADER_SIZE), max_size=max_size)
    return await read_exactly(stream, length) if length else b""


# One write to a py-libp2p stream must never be cancelled halfway: Yamux hands each chunk to
# the Noise connection, and a Noise frame cut by a cancelled send corrupts the whole connection
# (every stream on it, not just ours). So bodies go out in chunks, each shielded from
# cancellation but bounded by its own grace period, with cancellation honoured between chunks.
# A chunk that cannot be written within the grace period means the connection is stuck; it is
# then cut mid-frame anyway and reported, and the caller drops that connection.
_WRITE_CHUNK = 64 * 1024


#: How long a body read that starts behind the minimum rate may still wait for bytes.
_BEHIND_READ_S = 0.5


class StalledWrite(TransportError):
    """A shielded chunk write did not finish within its grace period."""


async def write_chunked(
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
            raise StalledWrite(f"stream write stalled for {grace_s:g} s")


async def quiet_close(stream: INetStream, *, reset: bool = False) -> None:
    # Shielded: cleanup must run even when the caller's deadline has expired.
    with trio.CancelScope(shield=True), trio.move_on_after(2.0):
        try:
            if reset:
                await stream.reset()
            else:
                await stream.close()
        except Exception as exc:
            logger.debug("stream cleanup failed: %r", exc)


class RequestResponse:
    """Serving and sending requests, mixed into :class:`~echo2.protocol.net.control.ControlHost`
    (which owns the host, the dialling and the counters used here)."""

    dial_timeout_s: float
    request_timeout_s: float
    handler_timeout_s: float
    limits: RequestLimits
    refusals: collections.Counter[str]
    _rate: dict[str, KeyedRateLimiter]
    _streams: ConcurrencyLimiter
    _stranger_streams: ConcurrencyLimiter
    _trusted_bytes: ByteBudget
    _stranger_peer_bytes: ByteBudget
    _stranger_ip_bytes: ByteBudget
    is_trusted: TrustPredicate | None
    _log: LogThrottle
    _host: IHost | None
    _handlers: dict[str, Callable[[INetStream], Awaitable[None]]]

    if TYPE_CHECKING:

        def _require_host(self) -> IHost: ...
        def is_connected(self, peer_id: str) -> bool: ...
        async def _dial(self, info: PeerInfo) -> None: ...
        async def disconnect(self, peer_id: str) -> None: ...
        def _refuse(self, code: str, peer: str, protocol_id: str, detail: str) -> None: ...

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


    def _rate_limiter(self, protocol_id: str) -> KeyedRateLimiter:
        lim = self._rate.get(protocol_id)
        if lim is None:
            rate, burst = self.limits.per_protocol.get(protocol_id, (self.limits.rate_per_s, self.limits.burst))
            lim = KeyedRateLimiter(rate, burst, max_keys=self.limits.max_tracked_peers)
            self._rate[protocol_id] = lim
        return lim

    @property
    def _inflight_bytes(self) -> int:
        """Request bytes held right now, trusted and strangers together."""
        return self._trusted_bytes.total_held + self._stranger_peer_bytes.total_held

    def trusts(self, peer: str) -> bool:
        """Whether ``peer`` gets a trusted peer's budgets (everyone, until an owner says otherwise)."""
        if self.is_trusted is None:
            return True
        try:
            return bool(self.is_trusted(peer))
        except Exception:
            logger.exception("trust predicate failed for %s; treating it as a stranger", peer)
            return False

    def _charge_for(self, peer: str, ip: str | None, trusted: bool) -> Charge:
        if trusted:
            return Charge([(self._trusted_bytes, peer)])
        # An address we cannot read is one more shared "unknown" address, never a free pass.
        return Charge([(self._stranger_peer_bytes, peer), (self._stranger_ip_bytes, address_key(ip or "?"))])

    def _admit_stream(self, peer: str, protocol_id: str, ip_key: str | None, conn: Any) -> bytes | None:
        """An error reply if ``peer`` may not open this stream now; None (stream counted) if it may.

        ``ip_key`` is the stranger's address, counted too (fresh peer IDs are free to make). A
        peer over its rate is not read again until its bucket has a token (yamux_guard).
        """
        limiter, now = self._rate_limiter(protocol_id), trio.current_time()
        if not limiter.allow(peer, now):
            msg = f"more than {limiter.rate_per_s:g} requests/s on {protocol_id}"
            self._refuse("rate_limited", peer, protocol_id, msg)
            hold_reads(conn, limiter.wait_s(peer, now))
            return encode_error("rate_limited", msg)
        if not self._streams.acquire(peer):
            msg = f"more than {self._streams.limit} concurrent streams"
            self._refuse("too_many_streams", peer, protocol_id, msg)
            return encode_error("too_many_streams", msg)
        if ip_key is not None and not self._stranger_streams.acquire(ip_key):
            self._streams.release(peer)
            msg = f"more than {self._stranger_streams.limit} concurrent streams from this address"
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
        ip_key: str | None = None
        try:
            peer = peer_str(stream.muxed_conn.peer_id)
            ip = remote_ip_of(stream.muxed_conn)
            trusted = self.trusts(peer)
            ip_key = None if trusted else address_key(ip or "?")
            reply: bytes | None = self._admit_stream(peer, protocol_id, ip_key, stream.muxed_conn)
            if reply is None:
                counted = True
                token = _REMOTE_IP.set(ip)
                try:
                    with trio.move_on_after(timeout_s) as scope:
                        reply = await self._answer(stream, peer, protocol_id, handler, max_request,
                                                   self._charge_for(peer, ip, trusted))
                finally:
                    _REMOTE_IP.reset(token)
                if scope.cancelled_caught:
                    self._refuse("timeout", peer, protocol_id, f"no reply within {timeout_s:g} s")
                    reply = encode_error("timeout", f"no reply within {timeout_s:g} s")
            if reply is None:
                await quiet_close(stream, reset=True)
                return
            try:
                await write_chunked(stream, encode_frame(reply), grace_s=self.dial_timeout_s)
            except StalledWrite:
                await self._drop_connection(stream)
                raise
            # close, not reset: py-libp2p's Yamux drops buffered data on a reset.
            await quiet_close(stream)
            await self._await_peer_end(stream)
        except Exception as exc:
            # Last line of defence: nothing may escape into the swarm (it would kill the host).
            self.refusals["transport"] += 1
            self._log.log(
                logging.WARNING, "transport", trio.current_time(), "stream %s from %s failed: %r", protocol_id, peer, exc
            )
            await quiet_close(stream, reset=True)
        finally:
            if counted:
                self._streams.release(peer)
                if ip_key is not None:
                    self._stranger_streams.release(ip_key)

    async def _await_peer_end(self, stream: INetStream) -> None:
        """Retire a served stream: drop what its requester sent beyond the request, wait up to
        ``end_grace_s`` for it to end its side, else reset it; then forget the stream.

        py-libp2p keeps a stream, and whatever unread bytes its window let in, until both sides
        have ended it and its buffer is drained, or for 60 s after. A requester refused from the
        header alone leaves up to a window (256 KiB) unread: measured, one stranger sending 4 MB
        frames refused as too large left 51 streams holding 15.9 MB after 30 s on one
        connection (the hub's RSS grew 85 MiB in a 60 s `bench attack` A2 window). An honest
        requester ends its side as soon as it has read the reply, so it is never reset here.
        """
        muxed = getattr(stream, "muxed_stream", None)
        discard_unread(muxed)
        deadline = trio.current_time() + self.limits.end_grace_s
        while not peer_ended(muxed):
            if trio.current_time() >= deadline:
                await quiet_close(stream, reset=True)
                break
            # woken by py-libp2p's event for this stream (data, FIN or RST), as its own reader is:
            # an honest requester's FIN frees the slot at once (a 20 ms poll held it measurably)
            events = getattr(getattr(muxed, "conn", None), "stream_events", None)
            sid = getattr(muxed, "stream_id", None)
            event = events.get(sid) if isinstance(events, dict) else None
            with trio.move_on_at(deadline if event is not None else trio.current_time() + END_POLL_S):
                await (event.wait() if event is not None else trio.sleep_forever())
            if event is not None and event.is_set() and isinstance(events, dict) and events.get(sid) is event:
                events[sid] = trio.Event()
            discard_unread(muxed)
        discard_unread(muxed)
        await forget_stream(muxed)

    async def _read_body(self, stream: INetStream, length: int, charge: Charge) -> bytes:
        """The request body, each chunk charged as it arrives, at no less than the minimum rate.

        The body must keep up with ``min_body_rate_Bps`` on average once ``body_grace_s`` has
        passed: a stream that trickles holds its slot no longer than that, whatever it announced.
        A read that starts already behind (our own loop was busy, not the sender slow) still gets
        :data:`_BEHIND_READ_S` to pick up what has arrived meanwhile.
        """
        limits = self.limits
        start = trio.current_time()
        buf = bytearray()
        while len(buf) < length:
            due = start + limits.body_grace_s + len(buf) / limits.min_body_rate_Bps
            deadline = max(due, trio.current_time() + _BEHIND_READ_S)
            chunk = b""
            with trio.move_on_at(deadline) as scope:
                try:
                    chunk = await stream.read(min(length - len(buf), _WRITE_CHUNK))
                except StreamEOF:
                    chunk = b""
                except Exception as exc:  # StreamReset, StreamError, muxer errors: all transport failures
                    raise TransportError(f"stream failed after {len(buf)} of {length} bytes: {exc!r}") from exc
            if scope.cancelled_caught:
                raise _Refused(
                    "too_slow",
                    f"request body slower than {limits.min_body_rate_Bps:g} B/s "
                    f"({len(buf)} of {length} bytes in {trio.current_time() - start:.1f} s)",
                )
            if not chunk:
                raise TransportError(f"truncated frame: stream ended after {len(buf)} of {length} bytes")
            if not charge.take(len(chunk)):
                raise _Refused("busy", f"too many request bytes in flight from this peer ({length} announced); retry later")
            buf += chunk
        return bytes(buf)

    async def _answer(
        self,
        stream: INetStream,
        peer: str,
        protocol_id: str,
        handler: Handler,
        max_request: int,
        charge: Charge,
    ) -> bytes | None:
        """The response body for one request, or None when the stream is beyond replying to."""
        try:
            length = decode_header(await read_exactly(stream, HEADER_SIZE), max_size=max_request)
        except TooLarge as exc:
            # Refused from the header alone; the requester reads while it writes, so it sees this.
            self._refuse(exc.code, peer, protocol_id, exc.message)
            return encode_error(exc.code, exc.message)
        except Echo2Error as exc:
            self._refuse(exc.code, peer, protocol_id, exc.message)
            return None
        cap = charge.cap
        if length > cap:
            # Could never fit this peer's budget, whatever else is in flight: not worth a retry.
            msg = f"request of {length} bytes exceeds this peer's budget of {cap}"
            self._refuse("too_large", peer, protocol_id, msg)
            return encode_error("too_large", msg)
        # Held until the handler is done with the body, not only while it arrives.
        try:
            try:
                request = await self._read_body(stream, length, charge) if length else b""
            except _Refused as exc:
                self._refuse(exc.code, peer, protocol_id, exc.message)
                return encode_error(exc.code, exc.message)
            except Echo2Error as exc:
                self._refuse(exc.code, peer, protocol_id, exc.message)
                return None
            try:
                return encode_ok(await handler(peer, request))
            except RateLimited as exc:
                self._refuse(exc.code, peer, protocol_id, exc.message)
                hold_reads(stream.muxed_conn, exc.retry_after_s)
                return encode_error(exc.code, exc.message)
            except Echo2Error as exc:
                self._refuse(exc.code, peer, protocol_id, exc.message)
                return encode_error(exc.code, exc.message)
            except Exception as exc:
                self.refusals["internal"] += 1
                logger.exception("handler for %s failed on a request from %s", protocol_id, peer)
                return encode_error("internal", f"internal error ({type(exc).__name__})")
        finally:
            charge.release()

    def _addrs_of(self, peer_id: Any) -> list[Any]:
        """Where to dial a peer known by its ID: the peerstore's addresses, else those we last
        dialled it at. py-libp2p's peerstore raises once a peer's addresses expire ("peer ID is
        expired", seen after a hub was down for a while): that killed a node in `bench crash`."""
        host = self._require_host()
        try:
            addrs = list(host.get_peerstore().addrs(peer_id)) if peer_id in host.get_peerstore().peer_ids() else []
        except Exception as exc:
            logger.debug("peerstore has no addresses for %s: %r", peer_str(peer_id), exc)
            addrs = []
        return addrs or list(getattr(self, "dialled_addrs", {}).get(peer_str(peer_id), []))

    async def _open_stream(self, peer: str, protocol_ids: list[str], deadline: float) -> INetStream:
        host = self._require_host()
        if peer.startswith("/"):
            info = parse_peer_addr(await resolve_addr(peer))
            peer_id = info.peer_id
            if not self.is_connected(peer_str(peer_id)):
                await self._dial(info)
        else:
            peer_id = parse_peer_id(peer)
            if not self.is_connected(peer):
                await self._dial(PeerInfo(peer_id, self._addrs_of(peer_id)))
        try:
            with trio.fail_at(min(deadline, trio.current_time() + self.dial_timeout_s)):
                return await host.new_stream(peer_id, [TProtocol(p) for p in protocol_ids])
        except trio.TooSlowError as exc:
            raise Timeout(f"opening {protocol_ids[0]} to {peer_str(peer_id)} timed out") from exc
        except Exception as exc:
            raise TransportError(f"opening {protocol_ids[0]} to {peer_str(peer_id)} failed: {exc}") from exc

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
                    await quiet_close(stream, reset=True)
                    raise
                await quiet_close(stream)
        except trio.TooSlowError as exc:
            raise Timeout(f"{protocol_id} request to {peer[:80]} timed out after {limit:g} s") from exc
        if body[:1] == bytes([STATUS_OK]) and len(body) - 1 > max_response:
            raise TooLarge(f"response of {len(body) - 1} bytes exceeds the limit of {max_response}")
        return decode_response(body)

    async def _exchange(self, stream: INetStream, frame: bytes, max_body: int) -> bytes:
        # Write and read concurrently: a peer that refuses an oversized request replies without
        # draining it, and a writer blocked on the Yamux window must not hide that reply. The
        # writer is stopped by resetting the stream (which wakes a window wait), never by
        # cancelling it mid-chunk (see write_chunked).
        write_error: list[TransportError] = []
        stop = trio.Event()
        written = trio.Event()

        async def writer() -> None:
            try:
                await write_chunked(stream, frame, grace_s=self.dial_timeout_s, stop=stop)
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
                body = await read_frame(stream, max_size=max_body)
            except Echo2Error as exc:
                # Raised outside the nursery so callers see it bare, not in an ExceptionGroup.
                read_error = exc
            finally:
                stop.set()
                if not written.is_set():
                    await quiet_close(stream, reset=True)
        if write_error and isinstance(write_error[0], StalledWrite):
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
            peer = peer_str(stream.muxed_conn.peer_id)
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
                    await write_chunked(stream, data)
                    echoed = await read_exactly(stream, _PING_LENGTH)
                    rtt = trio.current_time() - start
                finally:
                    await quiet_close(stream)
        except trio.TooSlowError as exc:
            raise Timeout(f"ping to {peer[:80]} timed out after {limit:g} s") from exc
        if echoed != data:
            raise TransportError(f"ping reply from {peer[:80]} does not match")
        return rtt
