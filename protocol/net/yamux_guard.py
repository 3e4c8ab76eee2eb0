"""Yamux that holds its peer to the receive window it granted.

py-libp2p 0.8.1's Yamux counts a stream's receive window but does not enforce it: data beyond
the window is appended to the stream's buffer anyway, with a warning (``peer exceeded receive
window``). A peer that ignores flow control can therefore make us buffer without bound in a
stream nobody reads: up to a 16 MiB DATA frame at a time, frame after frame. go-yamux treats
the same thing as a protocol error and closes the session (``ErrRecvWindowExceeded``); so do we.

A stream's buffer can then never hold more than the window we granted it: 256 KiB unless our own
reads grew it (at most 16 MiB, py-libp2p's ``MAX_WINDOW_SIZE``). The check runs where py-libp2p
appends a DATA frame to a stream's buffer, so it costs one comparison per frame and sits before
the bytes are kept.
"""

from __future__ import annotations

import logging
from typing import Any

from libp2p.stream_muxer.yamux.yamux import Yamux

logger = logging.getLogger(__name__)

#: Tolerance beyond the granted window. Honest senders never need it; it keeps a rounding
#: difference in another implementation's accounting from costing a good connection.
WINDOW_SLACK = 64 * 1024


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


class WindowedYamux(Yamux):
    """py-libp2p's Yamux, closing the connection of a peer that overruns a receive window."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_buffers = _GuardedBuffers(self)
        self.window_violation: str | None = None

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
