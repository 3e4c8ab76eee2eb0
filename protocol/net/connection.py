"""A data-plane connection: frames in both directions over an authenticated TCP stream.

Frames and their limits are :mod:`echo2.protocol.dataframe`; the handshake that makes a
connection and the server that accepts them are :mod:`.dataplane`. The length of a frame is
checked against a per-type limit before any of the body is read, and a large body is allocated
as it arrives, so a peer cannot make us reserve memory it does not send. A CHUNK whose body does
not hash to its key raises ``ChunkMismatch``. A connection that ends (EOF) without BYE, or in the
middle of a frame, is a dead peer: ``TransportError``, never a clean end.

Memory budgets: a server hands each connection the budgets its peer's frames are charged to
(``rx_accounts``: per peer, per server). Each piece of a body buffer is charged before it is
allocated and the charge is given back when the frame is handed on, so what one peer pins with
half-sent frames over all its connections is bounded by its own budget (``frame.over_budget``
drops the connection), never by what it announces.

Rate limits: sends can be throttled by a per-connection and a per-process
:class:`~echo2.protocol.net.ratelimit.UploadLimiter` (MB/s, 1 MB = 10**6 bytes), applied in
64 KiB slices so the rate is smooth.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import trio

from ..dataframe import (
    DEFAULT_MAX_SIZES,
    HEADER,
    HEADER_SIZE,
    KEY_SIZE,
    ZERO_KEY,
    Frame,
    FrameType,
    MiB,
    chunk_key,
    encode_error,
)
from ..errors import ChunkMismatch, DecodeError, Echo2Error, Timeout, TooLarge, TransportError
from ..hashing import Hasher, new_hasher
from ..peerlimit import ByteBudget, Charge
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
from .sockopts import set_notsent_lowat

log = logging.getLogger(__name__)

_ALLOC_STEP = 8 * MiB  # bodies up to this: one buffer up front; larger ones grow as bytes arrive
#: Large single reads: fewer syscalls and trio checkpoints per byte.
_RECV_MAX = 4 * MiB
#: Payloads go to the kernel in slices: one 4 MiB send() mostly returns short on loopback and
#: costs an extra wait for writability each time (measured: 256 KiB slices ~2.2 GB/s end to
#: end, whole 4 MiB sends ~1.5 GB/s, before receiving moved to a worker thread).
_SEND_SLICE = 256 * 1024
_JOIN_MAX = 16 * 1024  # frames up to this go out in one send() (issue 20): a copy costs less than a syscall


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


@dataclass
class DataPlaneStats:
    """Counters, per process (:data:`STATS`) and per server."""

    bytes_sent: int = 0
    bytes_received: int = 0
    connections: int = 0
    refusals: Counter[str] = field(default_factory=Counter)


#: Process-wide counters over every data-plane connection.
STATS = DataPlaneStats()


def count_refusal(key: str, server_stats: DataPlaneStats | None = None) -> None:
    STATS.refusals[key] += 1
    if server_stats is not None:
        server_stats.refusals[key] += 1


# --- connection -------------------------------------------------------------------------------


class DataConnection:
    """An authenticated data-plane connection. Made by :func:`~echo2.protocol.net.dataplane.connect`
    or handed to a :class:`~echo2.protocol.net.dataplane.DataPlaneServer` handler; not constructed
    directly.

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
        rx_accounts: list[tuple[ByteBudget, str]] | None = None,
    ) -> None:
        self._stream = stream
        self._rx_accounts = rx_accounts or []
        self._rx_charge: Charge | None = None  # what the frame being received holds
        self._sock = self.socket = stream.socket  # public: a server may peek at what has arrived
        self.peer_id = peer_id
        self.peer_public_key = peer_public_key
        self.local_peer_id = local_peer_id
        self.is_dialer = is_dialer
        self._limiters = tuple(lim for lim in limiters if lim is not None)
        self.max_sizes: dict[FrameType, int] = {**DEFAULT_MAX_SIZES, **(max_sizes or {})}
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

    def remote_ip(self) -> str | None:
        """The IP this connection comes from as seen here (an observed address, A10), or None."""
        try:
            return str(self._sock.getpeername()[0])
        except OSError:
            return None

    def remote_port(self) -> int | None:
        """The port this connection comes from as seen here (a NAT's mapping, for hole punching)."""
        try:
            return int(self._sock.getpeername()[1])
        except (OSError, IndexError, TypeError, ValueError):
            return None

    def limit_unsent(self, nbytes: int) -> None:
        set_notsent_lowat(self._sock, nbytes)  # a send that returned is then mostly on the wire

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

    async def send_keyed(self, ftype: FrameType, key: bytes, payload: bytes | bytearray | memoryview) -> None:
        """A REQUEST or MESSAGE frame whose key names it (the hub channel's request ids,
        :mod:`echo2.protocol.channel`); a CHUNK's key is its hash, so use :meth:`send_chunk`."""
        if ftype is FrameType.CHUNK:
            raise ValueError("a chunk's key is its hash: use send_chunk")
        await self._send_frame(ftype, key, payload)

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
        # what we send is held to the protocol's limits, not to what we accept (a channel server
        # taking only small REQUEST frames refused to send any MESSAGE reply: its limit was 0)
        n, limit = len(payload), max(self.max_sizes[ftype], DEFAULT_MAX_SIZES[ftype])
        if n > limit:
            raise TooLarge(f"{ftype.name} frame of {n} bytes exceeds the limit {limit}")
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
                    # a small frame in one send(): a channel request or reply is 1 syscall, not 2
                    await self._stream.send_all(header + bytes(payload) if n <= _JOIN_MAX else header)
                    sent += HEADER_SIZE + (n if n <= _JOIN_MAX else 0)
                    if n > _JOIN_MAX:
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
            if self._rx_accounts:
                self._rx_charge = Charge(self._rx_accounts)
                if length > self._rx_charge.cap:
                    self._refuse_desync("frame.over_budget")
                    raise TooLarge(f"{ftype.name} frame of {length} bytes from {self.peer_id} exceeds its "
                                   f"budget of {self._rx_charge.cap}") from None
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
            if self._rx_charge is not None:
                self._rx_charge.release()
                self._rx_charge = None
        if ftype is FrameType.CHUNK and digest != key:
            self.refusals["chunk_mismatch"] += 1
            count_refusal("chunk_mismatch", self._server_stats)
            log.warning("chunk from %s does not match its key %s", self.peer_id, key.hex()[:16])
            raise ChunkMismatch(f"chunk from {self.peer_id} does not hash to its key {key.hex()[:16]}...")
        if ftype is FrameType.BYE:
            self._got_bye = True
        return Frame(ftype, bytes(key), body)

    def _refuse_desync(self, reason: str) -> None:
        self._broken = reason
        self.refusals[reason] += 1
        count_refusal(reason, self._server_stats)
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

    def _alloc(self, n: int) -> bytearray:
        """A body buffer of ``n`` bytes, charged to the peer's budgets first."""
        if self._rx_charge is not None and not self._rx_charge.take(n):
            self._refuse_desync("frame.over_budget")
            raise TooLarge(f"frames from {self.peer_id} hold more than their budget; dropping the connection")
        return _new_buffer(n)

    async def _recv_body(
        self, length: int, on_piece: Callable[[memoryview], object] | None = None
    ) -> bytearray:
        if length <= _ALLOC_STEP:
            buf = self._alloc(length)
            if length:
                await self._recv_into(memoryview(buf), on_piece=on_piece)
            return buf
        pieces = []
        remaining = length
        while remaining:
            piece = self._alloc(min(remaining, _ALLOC_STEP))
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
                piece = self._alloc(min(remaining, _ALLOC_STEP))
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
