"""Yamux that holds its peer to the receive window it granted, and can stop reading a peer for a while.

py-libp2p 0.8.1's Yamux counts a stream's receive window but does not enforce it: data beyond
the window is appended to the stream's buffer anyway, with a warning (``peer exceeded receive
window``). A peer that ignores flow control can therefore make us buffer without bound in a
stream nobody reads: up to a 16 MiB DATA frame at a time, frame after frame. go-yamux treats
the same thing as a protocol error and closes the session (``ErrRecvWindowExceeded``); so do we.

A stream's buffer can then never hold more than the window we granted it: 256 KiB unless our own
reads grew it (at most 16 MiB, py-libp2p's ``MAX_WINDOW_SIZE``). The check runs where py-libp2p
appends a DATA frame to a stream's buffer, so it costs one comparison per frame and sits before
the bytes are kept.

**Held reads.** A peer refused for rate may be held: its connection is not read at all until a
given moment (:meth:`WindowedYamux.hold_reads`), so whatever it sends meanwhile waits in the
kernel's buffers and then its own, as TCP flow control has it, and costs us nothing. The
alternative, refusing every further request as it comes, still pays for each one: measured in
``bench attack`` A3, 16 admitted throwaway keys asking for admission again as fast as they were
answered made ~38 streams/s on the hub, each ~3 ms of its CPU (Yamux, multistream-select, Noise),
and took 29 % of the honest nodes' rate although every one was refused before its signature was
checked; closing such a connection instead was worse (the flooders reconnected at once, each a
Noise handshake). This is nginx ``limit_req`` without ``nodelay``: excess requests are delayed to
the allowed rate rather than served a refusal each. Only the read side stops: replies, pings and
window updates we send go on, and a held stream's requester sees its refusal at once.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.stream_muxer.yamux.yamux import Yamux

logger = logging.getLogger(__name__)

#: Tolerance beyond the granted window. Honest senders never need it; it keeps a rounding
#: difference in another implementation's accounting from costing a good connection.
WINDOW_SLACK = 64 * 1024

#: The longest a connection is held unread at once: long enough to bring a flood down to the
#: bucket rates that ask for it (admission: one per 2 s a key), short enough that an honest peer
#: held by mistake, or a ping from it, is late rather than lost (libp2p pings time out after 10 s+).
MAX_HOLD_S = 5.0


class WindowExceeded(Exception):
    """A peer sent more on a stream than the receive window we granted it."""


class _GuardedBuffer(bytearray):
    """One stream's receive buffer; refuses an append beyond the stream's granted window."""

    def __init__(self, conn: WindowedYamux, stream_id: int, initial: Any = b"") -> None:
        super().__init__(initial)
        self._conn = conn
        self._sid = stream_id

    def extend(self, data: Any) -> None:
        # py-libp2p appends first and subtracts from recv_window after, so recv_window here is
        # the credit left before this frame.
        stream = self._conn.streams.get(self._sid)
        if stream is not None and len(data) > max(stream.recv_window, 0) + WINDOW_SLACK:
            self._conn.window_exceeded(self._sid, len(data), stream.recv_window)
            raise WindowExceeded(
                f"stream {self._sid}: {len(data)} bytes against a receive window of {stream.recv_window}"
            )
        super().extend(data)


class _GuardedBuffers(dict[int, bytearray]):
    """The connection's stream buffers; every buffer put in is a guarded one."""

    def __init__(self, conn: WindowedYamux) -> None:
        super().__init__()
        self._conn = conn

    def __setitem__(self, stream_id: int, value: bytearray) -> None:
        if not isinstance(value, _GuardedBuffer):
            value = _GuardedBuffer(self._conn, stream_id, value)
        super().__setitem__(stream_id, value)


class _HeldReader:
    """The secured connection as the read loop sees it: a read waits out a hold first.

    py-libp2p's read loop reads its frames with ``read_exactly(self.secured_conn, n)`` and does
    nothing else with this object that the wrapped connection does not answer itself.
    """

    def __init__(self, inner: Any, conn: WindowedYamux) -> None:
        self._inner = inner
        self._conn = conn

    async def read(self, n: int | None = None) -> bytes:
        if self._conn.held_until:
            await self._conn.wait_hold()
        return await self._inner.read(n)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class WindowedYamux(Yamux):
    """py-libp2p's Yamux, closing the connection of a peer that overruns a receive window and
    holding reads of a peer refused for rate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_buffers = _GuardedBuffers(self)
        self.window_violation: str | None = None
        self.held_until = 0.0  # trio clock; 0: not held
        self.holds = 0
        self.secured_conn = _HeldReader(self.secured_conn, self)  # type: ignore[assignment]

    def hold_reads(self, seconds: float) -> float:
        """Read nothing more from this peer for ``seconds`` (at most :data:`MAX_HOLD_S`, never
        shortening a hold already set); the read in progress, if any, still completes.
        Returns the seconds held from now."""
        now = trio.current_time()
        until = now + min(max(0.0, seconds), MAX_HOLD_S)
        if until > self.held_until:
            self.held_until = until
            self.holds += 1
        return max(0.0, self.held_until - now)

    async def wait_hold(self) -> None:
        while self.held_until:
            left = self.held_until - trio.current_time()
            if left <= 0:
                self.held_until = 0.0
                return
            await trio.sleep(left)

    def window_exceeded(self, stream_id: int, size: int, window: int) -> None:
        """Called from the read loop: stop reading this connection; it is closed when the loop ends."""
        if self.window_violation is None:
            self.window_violation = f"stream {stream_id}: {size} bytes against a window of {window}"
            logger.warning("closing the connection to %s: it overran a Yamux receive window (%s)",
                           self.peer_id, self.window_violation)
        # handle_incoming's loop ends at its next turn; its own error paths close the connection
        # only for transport errors, so handle_incoming below does it.
        self.event_shutting_down.set()

    async def handle_incoming(self) -> None:
        await super().handle_incoming()
        if self.window_violation is not None and not self.event_closed.is_set():
            await self._cleanup_on_error()


# --- retiring a served stream (used by reqresp): py-libp2p's own bookkeeping of a stream ---

#: How often a stream with no event of its own is polled for its requester's end.
END_POLL_S = 0.02


def peer_ended(muxed: Any) -> bool:
    """Whether the remote side of a Yamux stream has closed or reset it (or it is gone)."""
    if muxed is None:
        return True
    conn = getattr(muxed, "conn", None)
    streams = getattr(conn, "streams", None)
    if isinstance(streams, dict) and streams.get(getattr(muxed, "stream_id", None)) is not muxed:
        return True
    return bool(getattr(muxed, "recv_closed", True) or getattr(muxed, "reset_received", False))


def discard_unread(muxed: Any) -> None:
    """Empty the receive buffer of a stream we will not read again (py-libp2p keeps it otherwise)."""
    conn = getattr(muxed, "conn", None)
    buffers = getattr(conn, "stream_buffers", None)
    if isinstance(buffers, dict):
        buf = buffers.get(getattr(muxed, "stream_id", None))
        if buf:
            del buf[:]


async def forget_stream(muxed: Any) -> None:
    """Drop py-libp2p's bookkeeping of a stream both sides have ended (its buffer is empty now)."""
    finalize = getattr(getattr(muxed, "conn", None), "_finalize_stream", None)
    if finalize is None or not getattr(muxed, "send_closed", False):
        return
    with trio.CancelScope(shield=True):
        try:
            await finalize(muxed, fully_closed=True)
        except Exception as exc:
            logger.debug("stream cleanup failed: %r", exc)


def install() -> None:
    """Make py-libp2p build :class:`WindowedYamux` for every Yamux connection in this process.

    py-libp2p 0.8.1 ignores the class given in ``muxer_opt`` for ``/yamux/1.0.0``: its
    ``MuxerMultistream.new_conn`` constructs ``Yamux`` by name. So the name is rebound there
    (idempotent; a py-libp2p without that name keeps its own Yamux, and this is logged).
    """
    from libp2p.stream_muxer import muxer_multistream

    current = getattr(muxer_multistream, "Yamux", None)
    if current is WindowedYamux:
        return
    if current is not Yamux:
        logger.warning("py-libp2p's muxer does not build Yamux by name (%r): receive windows are not enforced", current)
        return
    muxer_multistream.Yamux = WindowedYamux  # type: ignore[misc]


def hold_reads(muxed_conn: Any, seconds: float) -> float:
    """Hold reads of ``muxed_conn`` (a :class:`WindowedYamux`) for ``seconds``; the seconds held,
    0 for a connection of another kind (another muxer: not held, the refusal still stands)."""
    if isinstance(muxed_conn, WindowedYamux) and seconds > 0:
        return muxed_conn.hold_reads(seconds)
    return 0.0
