"""The bulk data plane: plain TCP between peers, authenticated with their libp2p keys.

Why not libp2p: one py-libp2p Noise/Yamux stream moves about 75 MB/s and pins a core, while
plain trio TCP moves over a GB/s on the same loopback. Policy chunks therefore travel here; the
address (``host:port``) is announced over the libp2p control plane (``Announce.data_addr``).

Connection = handshake, then frames in both directions.

Handshake (mutual, both sides send at once, so it costs two round trips):

1. each side sends ``HELLO`` = magic ``b"echo2dp\\x00"`` | version u16 | Ed25519 public key (32)
   | fresh random nonce (32);
2. each side sends its signature over ``b"echo2-dataplane-v1" | dialer nonce | listener nonce |
   dialer key | listener key | role`` where role is ``b"D"`` (dialer) or ``b"L"`` (listener): both
   nonces make the proof fresh, both keys bind it to this pair, the role byte makes a reflected
   signature useless;
3. the listener answers one byte: accepted (1) or refused (0), so a dialer that is not allowed
   learns it from ``connect`` rather than from its first read.

The dialer names the peer it expects (``expected_peer_id``, learnt from the control plane) and
refuses any other key; the listener may apply ``allow(peer_id)``.

What the handshake does *not* give: confidentiality, or integrity against an on-path attacker
who can inject into the TCP stream. Neither is needed for what travels here: chunk frames carry
their blake3 hash, which the receiver checks before handing the bytes on (and the layer above
checks against the hub-signed manifest), and messages are signed envelopes. The handshake serves
accounting, allow-lists and the choice of who to serve.

Frame = header ``type u8 | key 32 bytes | length u64`` (big endian) + body. The length is checked
against a per-type limit before any of the body is read, and a large body is allocated as it
arrives, so a peer cannot make us reserve memory it does not send. Types:

- ``CHUNK``: key = blake3 digest of the body as carried (for policy chunks: the encoded bytes,
  i.e. ``ManifestChunk.enc_hash``); verified on arrival, a mismatch raises ``ChunkMismatch``.
- ``REQUEST``: small canonical payload (e.g. a ``ChunkRequest``).
- ``MESSAGE``: a signed envelope (e.g. a ``Manifest``), opened by the layer above.
- ``ERROR``: ``code`` and ``message`` as UTF-8, separated by a newline (see :func:`parse_error`).
- ``BYE``: clean end. A connection that ends (EOF) without BYE, or in the middle of a frame, is a
  dead peer: ``TransportError``, never a clean end.

Hostile peers (:class:`DataPlaneServer`): a global cap on connections, a cap per remote IP
(``too_many_connections.ip``, checked before the handshake, so it costs no signature), a
token bucket of handshake attempts per IP (``handshake.rate_limited``), and a cap per
authenticated peer ID (refused in the handshake verdict, ``too_many_connections.peer``).
Refusal log lines are thinned under a flood; every refusal is counted.

Rate limits: sends can be throttled by a per-connection and a per-process
:class:`~echo2.protocol.net.ratelimit.UploadLimiter` (MB/s, 1 MB = 10**6 bytes), applied in
64 KiB slices so the rate is smooth.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import (
    BadSignature,
    ChunkMismatch,
    DecodeError,
    Echo2Error,
    HandshakeError,
    IdentityError,
    Timeout,
    TooLarge,
    TransportError,
)
from ..hashing import Hasher, digest, new_hasher
from ..identity import Identity, peer_id_from_public_key, verify_signature
from .peerlimit import ConcurrencyLimiter, KeyedRateLimiter, LogThrottle
from .ratelimit import DEFAULT_SLICE_BYTES, UploadLimiter, acquire_all
from .rxthread import (
    THREAD_MIN_BYTES,
    PeerClosed,
    Stopped,
    ThreadedReceive,
    release_worker,
    supported,
    try_take_worker,
)

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
HELLO_MAGIC = b"echo2dp\x00"
SIG_DOMAIN = b"echo2-dataplane-v1"
_HELLO = struct.Struct(">8sH32s32s")
_SIG_SIZE = 64
_ACCEPTED = b"\x01"
_REFUSED = b"\x00"

HEADER = struct.Struct(">B32sQ")
HEADER_SIZE = HEADER.size
KEY_SIZE = 32
ZERO_KEY = bytes(KEY_SIZE)

MiB = 1024 * 1024
#: Bodies up to this size are received into one buffer allocated up front; larger ones grow
#: piece by piece as bytes arrive.
_ALLOC_STEP = 8 * MiB
#: Large single reads: fewer syscalls and trio checkpoints per byte.
_RECV_MAX = 4 * MiB
#: Payloads go to the kernel in slices: one 4 MiB send() mostly returns short on loopback and
#: costs an extra wait for writability each time (measured: 256 KiB slices ~2.2 GB/s end to
#: end, whole 4 MiB sends ~1.5 GB/s, before receiving moved to a worker thread).
_SEND_SLICE = 256 * 1024


def _uninitialised_bytearray_factory() -> Callable[[int], bytearray]:
    # ``bytearray(n)`` zero-fills (calloc: ~150 us per 4 MiB here, ~7 % of receiving), and a
    # body buffer is overwritten completely before anyone sees it (or dropped on error), so
    # the zeroing is pure waste. CPython's C API makes an uninitialised one; elsewhere we
    # fall back to the zeroed one.
    try:
        import ctypes

        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
        make.restype = ctypes.py_object
        make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
        probe = make(None, 16)
        if not isinstance(probe, bytearray) or len(probe) != 16:
            return bytearray
    except (ImportError, AttributeError, OSError):
        return bytearray

    def new(n: int) -> bytearray:
        buf = make(None, n)
        assert isinstance(buf, bytearray)
        return buf

    return new


#: Large bodies are received on a worker thread where that is possible (rxthread.py).
_THREADED_RX = supported()

#: A bytearray of ``n`` bytes whose content is undefined until written.
_new_buffer = _uninitialised_bytearray_factory()


class FrameType(enum.IntEnum):
    CHUNK = 1
    REQUEST = 2
    MESSAGE = 3
    ERROR = 4
    BYE = 5


DEFAULT_MAX_SIZES: Mapping[FrameType, int] = {
    FrameType.CHUNK: 32 * MiB,  # packing chunks are a few MiB; zstd never grows them much
    FrameType.REQUEST: 1 * MiB,  # a ChunkRequest of 100000 indices is < 600 KB
    FrameType.MESSAGE: 64 * MiB + 64 * 1024,  # Manifest.MAX_SIZE is 64 MiB
    FrameType.ERROR: 4096,
    FrameType.BYE: 0,
}


@dataclass(frozen=True, slots=True)
class Frame:
    """A received frame. ``payload`` is a bytearray (received in place, never copied)."""

    type: FrameType
    key: bytes
    payload: bytearray


@dataclass
class DataPlaneStats:
    """Counters, per process (:data:`STATS`) and per server."""

    bytes_sent: int = 0
    bytes_received: int = 0
    connections: int = 0
    refusals: Counter[str] = field(default_factory=Counter)


#: Process-wide counters over every data-plane connection.
STATS = DataPlaneStats()


class HandshakeRefused(HandshakeError):
    """Peer failed to prove its identity or was not allowed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        #: short machine-readable reason, counted in ``refusals`` as ``"handshake.<reason>"``
        self.reason = reason


def _count_refusal(key: str, server_stats: DataPlaneStats | None = None) -> None:
    STATS.refusals[key] += 1
    if server_stats is not None:
        server_stats.refusals[key] += 1


def chunk_key(data: bytes | bytearray | memoryview) -> bytes:
    """The key a CHUNK frame carries: the project's content hash (blake3) of the body."""
    return digest(data)


def encode_error(code: str, message: str) -> bytes:
    """ERROR frame payload."""
    body = code.encode()[:64] + b"\n" + message.encode()
    return body[: DEFAULT_MAX_SIZES[FrameType.ERROR]]


def parse_error(payload: bytes | bytearray) -> tuple[str, str]:
    """``(code, message)`` of an ERROR frame; undecodable bytes are replaced, never raised."""
    code, _, message = bytes(payload).partition(b"\n")
    return code.decode("utf-8", "replace")[:64], message.decode("utf-8", "replace")


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; ``TransportError`` if malformed."""
    host, sep, port_s = addr.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise TransportError(f"bad data-plane address {addr[:100]!r} (want host:port)")
    port = int(port_s)
    if not 0 < port < 65536:
        raise TransportError(f"bad data-plane port in {addr[:100]!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


# --- connection -------------------------------------------------------------------------------


class DataConnection:
    """An authenticated data-plane connection. Made by :func:`connect` or handed to a
    :class:`DataPlaneServer` handler; not constructed directly.

    One task may send while another receives; concurrent senders are serialised frame by frame.
    """

    def __init__(
        self,
        stream: trio.SocketStream,
        *,
        peer_id: str,
        peer_public_key: bytes,
        local_peer_id: str,
        is_dialer: bool,
        limiters: tuple[UploadLimiter | None, ...] = (),
        max_sizes: Mapping[FrameType, int] | None = None,
        server_stats: DataPlaneStats | None = None,
    ) -> None:
        self._stream = stream
        self._sock = stream.socket
        self.peer_id = peer_id
        self.peer_public_key = peer_public_key
        self.local_peer_id = local_peer_id
        self.is_dialer = is_dialer
        self._limiters = tuple(lim for lim in limiters if lim is not None)
        self.max_sizes: dict[FrameType, int] = dict(DEFAULT_MAX_SIZES)
        if max_sizes:
            self.max_sizes.update(max_sizes)
        self._server_stats = server_stats
        self.bytes_sent = 0
        self.bytes_received = 0
        self.refusals: Counter[str] = Counter()
        self._send_lock = trio.Lock()
        self._receiving = False
        self._broken: str | None = None  # why the byte stream can no longer be used
        self._sent_bye = False
        self._got_bye = False
        self._closed = False
        self._rx_partial = False  # some bytes of the current frame were read
        self._rx_thread: ThreadedReceive | None = None  # a body being received on a worker
        self._tx_started = False  # some bytes of the frame being sent may be out

    def __repr__(self) -> str:
        return f"DataConnection(peer={self.peer_id}, dialer={self.is_dialer})"

    @property
    def usable(self) -> bool:
        return self._broken is None and not self._closed

    # --- sending ---------------------------------------------------------------------------
    async def send_chunk(self, data: bytes | bytearray | memoryview, key: bytes | None = None) -> None:
        """Send a chunk; ``key`` is its blake3 digest (computed here when not given)."""
        if key is None:
            key = chunk_key(data)
        await self._send_frame(FrameType.CHUNK, key, data)

    async def send_request(self, payload: bytes) -> None:
        await self._send_frame(FrameType.REQUEST, ZERO_KEY, payload)

    async def send_message(self, payload: bytes) -> None:
        await self._send_frame(FrameType.MESSAGE, ZERO_KEY, payload)

    async def send_error(self, code: str, message: str) -> None:
        await self._send_frame(FrameType.ERROR, ZERO_KEY, encode_error(code, message))

    async def send_bye(self) -> None:
        if not self._sent_bye:
            await self._send_frame(FrameType.BYE, ZERO_KEY, b"")
            self._sent_bye = True

    async def _send_frame(
        self, ftype: FrameType, key: bytes, payload: bytes | bytearray | memoryview
    ) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError("frame key must be 32 bytes")
        n = len(payload)
        if n > self.max_sizes[ftype]:
            raise TooLarge(f"{ftype.name} frame of {n} bytes exceeds the limit {self.max_sizes[ftype]}")
        if self._sent_bye:
            raise TransportError(f"connection to {self.peer_id} already ended (BYE sent)")
        header = HEADER.pack(ftype, key, n)
        async with self._send_lock:
            self._check_usable()
            sent = 0
            self._tx_started = False
            try:
                if not self._limiters:
                    self._tx_started = True
                    await self._stream.send_all(header)
                    sent += HEADER_SIZE
                    if n:
                        with memoryview(payload) as mv:
                            for pos in range(0, n, _SEND_SLICE):
                                await self._stream.send_all(mv[pos : pos + _SEND_SLICE])
                        sent += n
                else:
                    await self._send_limited(header, payload)
                    sent += HEADER_SIZE + n
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._broken = f"send failed: {exc!r}"
                raise TransportError(f"peer {self.peer_id} is gone (send failed: {exc!r})") from exc
            except BaseException:
                # Cancelled half-way through a frame: the peer would misparse whatever follows.
                # (Cancelled while still waiting for the rate limiter is harmless.)
                if self._tx_started:
                    self._broken = "send interrupted mid-frame"
                raise
            finally:
                self._account_sent(sent)

    async def _send_limited(self, header: bytes, payload: bytes | bytearray | memoryview) -> None:
        # The header rides with the first slice so the limiter also pays for it.
        with memoryview(payload) as mv:
            first = mv[: DEFAULT_SLICE_BYTES - HEADER_SIZE]
            await acquire_all(self._limiters, HEADER_SIZE + len(first))
            self._tx_started = True
            await self._stream.send_all(header)
            if len(first):
                await self._stream.send_all(first)
            pos = len(first)
            while pos < len(mv):
                piece = mv[pos : pos + DEFAULT_SLICE_BYTES]
                await acquire_all(self._limiters, len(piece))
                await self._stream.send_all(piece)
                pos += len(piece)

    def _account_sent(self, n: int) -> None:
        self.bytes_sent += n
        STATS.bytes_sent += n
        if self._server_stats is not None:
            self._server_stats.bytes_sent += n

    def _account_received(self, n: int) -> None:
        self.bytes_received += n
        STATS.bytes_received += n
        if self._server_stats is not None:
            self._server_stats.bytes_received += n

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError(f"connection to {self.peer_id} is closed")
        if self._broken is not None:
            raise TransportError(f"connection to {self.peer_id} is unusable: {self._broken}")

    # --- receiving -------------------------------------------------------------------------
    async def receive(self, *, timeout_s: float | None = None) -> Frame:
        """The next frame, verified (a CHUNK's body matches its key).

        Raises ``TransportError`` on a dead peer (EOF without BYE, EOF or reset mid-frame),
        ``TooLarge`` / ``DecodeError`` on a malformed header (the connection is then unusable),
        ``ChunkMismatch`` on a corrupted chunk (the connection stays in sync), ``Timeout`` if no
        complete frame arrives within ``timeout_s``. A BYE frame is returned once; any call after
        it raises ``TransportError``.
        """
        self._check_usable()
        if self._got_bye:
            raise TransportError(f"peer {self.peer_id} already ended the connection (BYE)")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this connection")
        self._receiving = True
        try:
            if timeout_s is None:
                return await self._receive_frame()
            try:
                with trio.fail_after(timeout_s):
                    return await self._receive_frame()
            except trio.TooSlowError as exc:
                raise Timeout(f"no frame from {self.peer_id} within {timeout_s:g} s") from exc
        finally:
            self._receiving = False

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self._iter_frames()

    async def _iter_frames(self) -> AsyncIterator[Frame]:
        """Frames until the peer's BYE (which ends the iteration cleanly)."""
        while True:
            frame = await self.receive()
            if frame.type is FrameType.BYE:
                return
            yield frame

    async def _receive_frame(self) -> Frame:
        hdr = bytearray(HEADER_SIZE)
        try:
            got = await self._recv_into(memoryview(hdr), at_boundary=True)
            if got == 0:
                self._broken = "peer closed without BYE"
                raise TransportError(f"peer {self.peer_id} closed the connection without BYE (dead peer?)")
            ftype_raw, key, length = HEADER.unpack(hdr)
            try:
                ftype = FrameType(ftype_raw)
            except ValueError:
                self._refuse_desync("frame.bad_type")
                raise DecodeError(f"unknown frame type {ftype_raw} from {self.peer_id}") from None
            limit = self.max_sizes[ftype]
            if length > limit:
                self._refuse_desync("frame.too_large")
                raise TooLarge(
                    f"{ftype.name} frame of {length} bytes from {self.peer_id} exceeds the limit {limit}"
                ) from None
            if ftype is FrameType.CHUNK:
                body, digest = await self._recv_body_hashed(length)
            else:
                body = await self._recv_body(length)
        except BaseException:
            # Whatever stopped us mid-frame (dead peer, cancellation, timeout) leaves the byte
            # stream out of sync: nothing after it can be trusted to start at a frame boundary.
            if self._broken is None and self._rx_partial:
                self._broken = "receive interrupted mid-frame"
            raise
        finally:
            self._rx_partial = False
        if ftype is FrameType.CHUNK and digest != key:
            self.refusals["chunk_mismatch"] += 1
            _count_refusal("chunk_mismatch", self._server_stats)
            log.warning("chunk from %s does not match its key %s", self.peer_id, key.hex()[:16])
            raise ChunkMismatch(f"chunk from {self.peer_id} does not hash to its key {key.hex()[:16]}...")
        if ftype is FrameType.BYE:
            self._got_bye = True
        return Frame(ftype, bytes(key), body)

    def _refuse_desync(self, reason: str) -> None:
        self._broken = reason
        self.refusals[reason] += 1
        _count_refusal(reason, self._server_stats)
        log.warning("refused frame from %s: %s; dropping the connection", self.peer_id, reason)

    async def _recv_into(
        self,
        view: memoryview,
        *,
        at_boundary: bool = False,
        on_piece: Callable[[memoryview], object] | None = None,
    ) -> int:
        """Fill ``view`` completely. Returns 0 only for a clean EOF before the first byte of a
        frame (``at_boundary``); EOF anywhere else raises ``TransportError``. ``on_piece`` sees
        each piece as soon as it lands (to hash it while it is still in the CPU cache)."""
        got = 0
        total = len(view)
        while got < total:
            try:
                n = await self._sock.recv_into(view[got : got + _RECV_MAX])
            except (OSError, trio.ClosedResourceError) as exc:  # ECONNRESET, closed by another task
                self._broken = f"receive failed: {exc!r}"
                raise TransportError(f"peer {self.peer_id} is gone (receive failed: {exc!r})") from exc
            if n == 0:
                if at_boundary and got == 0 and not self._rx_partial:
                    return 0
                self._broken = "EOF mid-frame"
                raise TransportError(f"peer {self.peer_id} closed the connection in the middle of a frame")
            if on_piece is not None:
                on_piece(view[got : got + n])
            got += n
            self._rx_partial = True
            self._account_received(n)
        return got

    async def _recv_body(
        self, length: int, on_piece: Callable[[memoryview], object] | None = None
    ) -> bytearray:
        if length <= _ALLOC_STEP:
            buf = _new_buffer(length)
            if length:
                await self._recv_into(memoryview(buf), on_piece=on_piece)
            return buf
        pieces = []
        remaining = length
        while remaining:
            piece = _new_buffer(min(remaining, _ALLOC_STEP))
            await self._recv_into(memoryview(piece), on_piece=on_piece)
            pieces.append(piece)
            remaining -= len(piece)
        return bytearray().join(pieces)

    async def _recv_body_hashed(self, length: int) -> tuple[bytearray, bytes]:
        # Hashed piece by piece as the bytes land, so verification is never a second pass over
        # the chunk. Small bodies: in the trio thread. Large ones: received and hashed on a
        # worker thread (rxthread.py), so that a relay's sends keep the trio thread.
        hasher = new_hasher()
        if length < THREAD_MIN_BYTES or not _THREADED_RX or not try_take_worker():
            return await self._recv_body(length, hasher.update), hasher.digest()
        try:
            pieces = []
            remaining = length
            while remaining:
                piece = _new_buffer(min(remaining, _ALLOC_STEP))
                view = memoryview(piece)
                if not await self._recv_in_thread(view, hasher):
                    await self._recv_into(view, on_piece=hasher.update)
                pieces.append(piece)
                remaining -= len(piece)
        finally:
            release_worker()
        body = pieces[0] if len(pieces) == 1 else bytearray().join(pieces)
        return body, hasher.digest()

    async def _recv_in_thread(self, view: memoryview, hasher: Hasher) -> bool:
        """Fill ``view`` on a worker thread. ``False`` (nothing read) when no worker could be
        started: the caller then receives in the trio thread."""
        try:
            rx = ThreadedReceive(self._sock.fileno(), view, _RECV_MAX, hasher)
            rx.start()
        except (OSError, RuntimeError) as exc:  # EMFILE, no thread: nothing was read
            log.debug("receiving from %s in the trio thread: %r", self.peer_id, exc)
            return False
        self._rx_thread = rx
        self._rx_partial = True
        try:
            await rx.wait()
        except OSError as exc:
            self._broken = f"receive failed: {exc!r}"
            raise TransportError(f"peer {self.peer_id} is gone (receive failed: {exc!r})") from exc
        except PeerClosed:
            self._broken = "EOF mid-frame"
            raise TransportError(
                f"peer {self.peer_id} closed the connection in the middle of a frame"
            ) from None
        except Stopped:
            self._broken = self._broken or "connection closed while receiving"
            raise TransportError(f"connection to {self.peer_id} was closed while receiving") from None
        finally:
            self._rx_thread = None
            self._account_received(rx.received)
        return True

    # --- closing ---------------------------------------------------------------------------
    async def aclose(self, *, grace_s: float = 2.0) -> None:
        """Clean end: send BYE, half-close, and wait (at most ``grace_s``) for the peer to finish,
        so that closing never resets data the peer has not read yet."""
        if self._closed:
            return
        try:
            if self._broken is None:
                with trio.move_on_after(grace_s):
                    await self.send_bye()
                    await self._stream.send_eof()
                    if not self._receiving:
                        await self._drain()
        except (Echo2Error, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("closing %s: %r", self.peer_id, exc)
        finally:
            self._closed = True
            self._stop_rx_thread()
            await self._stream.aclose()

    def _stop_rx_thread(self) -> None:
        # A body still arriving on a worker: it holds its own descriptor, so tell it to stop
        # (within POLL_SLICE_MS) rather than let it read on after the close.
        if self._rx_thread is not None:
            self._rx_thread.stop.set()

    async def _drain(self) -> None:
        # Read (and discard) whatever the peer still sends until its EOF; bounded by the caller.
        buf = bytearray(64 * 1024)
        while True:
            try:
                n = await self._sock.recv_into(buf)
            except OSError:
                return
            if n == 0:
                return
            self._account_received(n)

    async def abort(self) -> None:
        """Close at once, without BYE: the peer sees a dead connection."""
        if self._closed:
            return
        self._closed = True
        self._stop_rx_thread()
        try:
            # SO_LINGER 0 makes the close send RST, so the peer notices at once.
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        await self._stream.aclose()

    async def __aenter__(self) -> DataConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is None:
            await self.aclose()
        else:
            await self.abort()


# --- handshake --------------------------------------------------------------------------------


def _transcript(dialer_nonce: bytes, listener_nonce: bytes, dialer_key: bytes, listener_key: bytes) -> bytes:
    return SIG_DOMAIN + dialer_nonce + listener_nonce + dialer_key + listener_key


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


def _parse_hello(data: bytes) -> tuple[bytes, bytes]:
    magic, version, key, nonce = _HELLO.unpack(data)
    if magic != HELLO_MAGIC:
        raise HandshakeRefused("bad_hello", "peer does not speak the echo2 data plane")
    if version != PROTOCOL_VERSION:
        raise HandshakeRefused(
            "version", f"peer speaks data-plane version {version}, we speak {PROTOCOL_VERSION}"
        )
    return key, nonce


async def _handshake(
    stream: trio.SocketStream,
    identity: Identity,
    *,
    dialer: bool,
    expected_peer_id: str | None,
    allow: Callable[[str], bool] | None,
) -> tuple[str, bytes]:
    """Run the mutual handshake; returns the peer's ``(peer_id, public_key)``."""
    my_key = identity.public_bytes
    my_nonce = os.urandom(32)
    await _send(stream, _HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, my_key, my_nonce))
    peer_key, peer_nonce = _parse_hello(await _recv_exact(stream, _HELLO.size, "hello"))
    if peer_nonce == my_nonce:
        raise HandshakeRefused("reflection", "peer echoed our own hello")
    try:
        peer_id = peer_id_from_public_key(peer_key)
    except IdentityError as exc:  # cannot happen for 32 bytes, kept for hostile-input hygiene
        raise HandshakeRefused("bad_hello", str(exc)) from exc
    if expected_peer_id is not None and peer_id != expected_peer_id:
        raise HandshakeRefused("wrong_peer", f"expected peer {expected_peer_id}, the listener is {peer_id}")
    if dialer:
        transcript = _transcript(my_nonce, peer_nonce, my_key, peer_key)
    else:
        transcript = _transcript(peer_nonce, my_nonce, peer_key, my_key)
    my_role, peer_role = (b"D", b"L") if dialer else (b"L", b"D")
    await _send(stream, identity.sign(transcript + my_role))
    peer_sig = await _recv_exact(stream, _SIG_SIZE, "signature")
    try:
        verify_signature(peer_key, peer_sig, transcript + peer_role)
    except BadSignature as exc:
        raise HandshakeRefused("bad_signature", f"peer claiming to be {peer_id} did not prove it") from exc
    if dialer:
        verdict = await _recv_exact(stream, 1, "verdict")
        if verdict != _ACCEPTED:
            raise HandshakeRefused("not_allowed", f"listener {peer_id} refused us")
    else:
        allowed = True
        if allow is not None:
            try:
                allowed = bool(allow(peer_id))
            except Exception:
                log.exception("allow() check failed for %s; refusing", peer_id)
                allowed = False
        await _send(stream, _ACCEPTED if allowed else _REFUSED)
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
) -> DataConnection:
    """Dial ``addr`` (``"host:port"``) and authenticate both ways.

    Raises ``HandshakeRefused`` (a ``HandshakeError``) if the listener is not
    ``expected_peer_id``, fails to prove its key, or refuses us; ``Timeout`` if the TCP connect
    plus handshake take longer than ``timeout_s``; ``TransportError`` if it cannot connect.
    ``upload_limit_MBps`` caps this connection; ``upload_limiter`` is a shared (per-process) cap.
    """
    host, port = parse_addr(addr)
    stream: trio.SocketStream | None = None
    try:
        with trio.fail_after(timeout_s):
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                raise TransportError(f"cannot connect to {addr}: {exc}") from exc
            peer_id, peer_key = await _handshake(
                stream, identity, dialer=True, expected_peer_id=expected_peer_id, allow=None
            )
    except trio.TooSlowError as exc:
        _count_refusal("handshake.timeout")
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise Timeout(f"connect + handshake to {addr} took longer than {timeout_s:g} s") from exc
    except HandshakeRefused as exc:
        _count_refusal(f"handshake.{exc.reason}")
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
    ``handshakes_per_ip_per_s`` / ``handshake_burst`` attempts per address (None: unlimited).
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
    ) -> None:
        self.identity = identity
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
        self._log = LogThrottle(log)

    @property
    def addr(self) -> str:
        """``host:port`` to announce (``Announce.data_addr``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; ``nursery.start(server.serve)`` returns once the
        port is bound (``server.port`` is then the real port)."""
        self.listeners = list(await trio.open_tcp_listeners(self.port, host=self.host))
        self.port = self.listeners[0].socket.getsockname()[1]
        log.info("data plane of %s listening on %s", self.identity.peer_id, self.addr)
        task_status.started(self)
        await trio.serve_listeners(self._handle, self.listeners)

    def _refuse(self, key: str, msg: str = "", *args: object) -> None:
        _count_refusal(key, self.stats)
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
                    stream, self.identity, dialer=False, expected_peer_id=None, allow=allow
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


async def duplex(sending: Awaitable[None], receiving: Awaitable[None]) -> None:
    """Run a connection's sender and receiver until either ends; re-raise the first transport
    error as itself (not wrapped in an ExceptionGroup, which ``except Echo2Error`` would miss)."""
    errors: list[BaseException] = []

    async def guard(aw: Awaitable[None], scope: trio.CancelScope) -> None:
        try:
            await aw
        except (Echo2Error, OSError) as exc:
            errors.append(exc)
        finally:
            scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guard, sending, nursery.cancel_scope)
        nursery.start_soon(guard, receiving, nursery.cancel_scope)
    if errors:
        raise errors[0]


_FILLER_SLICE = 1 * MiB
_filler: bytes | None = None


async def send_filler(conn: DataConnection, n: int) -> None:
    """Send ``n`` random bytes as CHUNK frames of at most 1 MiB (bandwidth probes). Random, so
    nothing on the path can compress them into a flattering figure; the full slice's key is
    computed once."""
    global _filler
    if _filler is None:
        _filler = os.urandom(_FILLER_SLICE)
    full_key = chunk_key(_filler)
    left = n
    while left > 0:
        if left >= _FILLER_SLICE:
            await conn.send_chunk(_filler, key=full_key)
            left -= _FILLER_SLICE
        else:
            await conn.send_chunk(_filler[:left])
            left = 0
