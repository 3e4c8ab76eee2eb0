"""One driver for :class:`echo2.protocol.relay.Relay` over data-plane connections.

The relay rules are a pure state machine (events in, actions out). Both sides of the pipelined
broadcast run them: a node (``echo2.node.relay_runtime.RelayNode``) and the hub
(``echo2.learner_hub.broadcast.PipelinedSender``; ``StarWithHolds`` uses the link queue and
sender to answer pulls). This module is what they share: a :class:`RelayLink` per connection
(a deduplicated, bounded send queue and the chunks in flight on it), the sender loop that turns
queued items into frames, the receive loop, the answer to ``have`` and ``get`` requests, and the
dispatch of the relay's actions. Where a chunk's bytes come from is a :class:`ChunkSource`: the
hub's packed version, or a node's chunk store. What only one side does (a node's manifests,
verification and storage; the hub's plans, repair and demotion) stays with that side, reached
through the hooks given to :class:`RelayDriver`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from echo2.protocol.dataframe import Frame, FrameType
from echo2.protocol.errors import ChunkMismatch, Echo2Error, SchemaError
from echo2.protocol.messages import ChunkHave, ChunkRequest
from echo2.protocol.relay import Action, Complete, Evidence, Relay, Report, Request, Send
from echo2.protocol.wire import CHUNK_HEADER_SIZE, ENC_FULL, pack_chunk_frame

from .connection import DataConnection, duplex

log = logging.getLogger(__name__)

# Items a link's queue holds: ("chunk" | "full", version, index), or ("msg" | "manifest", version,
# envelope) for a MESSAGE frame, or ("req", version, payload) for a REQUEST frame.
Item = tuple[str, int, Any]
# Why this bound: chunk items are deduplicated, so an honest queue holds at most two items per
# chunk of the version (its encoding and its full encoding) plus a few messages; a peer that asks
# for more than this is flooding, and what does not fit is refused (the relay is told the send
# failed, and an honest peer pulls it again).
DEFAULT_MAX_QUEUE = 65536
# TCP_NOTSENT_LOWAT of relay links: 64 KiB is 8 ms of an 8 MB/s link, and the sender writes the
# next chunk (queued: the relay's window is 2) as soon as a send returns
UNSENT_LOWAT = 64 * 1024


class ChunkSource(Protocol):
    """Where a chunk's bytes come from (the hub's packed version, a node's chunk store)."""

    async def encoded(self, version: int, index: int) -> tuple[int, bytes]:
        """``(flag, bytes)`` to send for chunk ``index``: ``ENC_MANIFEST`` and the manifest's
        encoding, or ``ENC_FULL`` and the full encoding. KeyError when it is not (or no longer)
        available."""
        ...

    async def full(self, version: int, index: int) -> bytes:
        """The full (non-delta) encoding of chunk ``index``; KeyError when not available."""
        ...


class RelayLink:
    """One connection: a send queue whose chunk items are deduplicated and whose length is
    bounded, items of older versions pruned when a version starts (``prune``), so the queue stays
    bounded even when the peer stops reading."""

    def __init__(self, conn: DataConnection, *, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        self.conn = conn
        self.peer = conn.peer_id
        self.max_queue = max_queue
        self.queue: deque[Item] = deque()
        self._queued: set[tuple[str, int, int]] = set()
        self._wake = trio.Event()
        self.inflight: set[tuple[int, int]] = set()
        self.sending_since: float | None = None  # trio clock when the current send began
        self.connected_at = trio.current_time()
        self.manifest_sent: tuple[int, float] = (-1, 0.0)  # (version, trio clock) of the last one written

    def put(self, item: Item) -> bool:
        """Queue ``item``; False when it was already queued or the queue is full."""
        kind, ver, x = item
        if kind in ("chunk", "full"):
            key = (kind, ver, x)
            if key in self._queued:
                return False
            if len(self.queue) >= self.max_queue:
                return False
            self._queued.add(key)
        self.queue.append(item)
        self._wake.set()
        return True

    def prune(self, version: int) -> None:
        if self.queue:
            self.queue = deque(it for it in self.queue if it[1] >= version)
            self._queued = {k for k in self._queued if k[1] >= version}

    async def get(self) -> Item:
        while not self.queue:
            self._wake = trio.Event()
            await self._wake.wait()
        item = self.queue.popleft()
        if item[0] in ("chunk", "full"):
            self._queued.discard((item[0], item[1], item[2]))
        return item


#: ``(version, index)`` -> a CHUNK frame ready to send as it is: ``(payload, key)``, the payload
#: exactly as :func:`pack_chunk_frame` makes it for the chunk's manifest encoding and ``key`` its
#: blake3 (a relay's copy of the frame it received and verified), or None to pack it afresh.
ReadyFrame = Callable[[int, int], "tuple[bytes | bytearray, bytes] | None"]
OnSent = Callable[[int, int], None]  # (version, bytes) after a chunk frame was written
OnUnlinked = Callable[[str, int, int], None]  # (peer, version, index): a Send to a peer without a link
OnRequest = Callable[[int, Request], None]
OnReport = Callable[[int, Evidence], None]
FrameHandler = Callable[[RelayLink, Frame], Awaitable[None]]


class RelayDriver:
    """Runs the current version's :class:`Relay` over the registered links (see the module doc).

    ``start(version, relay)`` makes a version current (``relay`` may be None: the star sender has
    no relay rules, only pulls to answer). Hooks: ``on_unlinked`` for a Send to a peer with no
    link (default: the send failed), ``on_request`` for the relay's pulls, ``on_report`` for its
    evidence of a corrupt chunk, ``on_sent`` after each chunk frame; ``ready_frame`` for chunk
    frames that need neither packing nor hashing (a relay forwards the frame it received: no
    copy of the chunk and no blake3 pass per child).
    """

    def __init__(
        self,
        source: ChunkSource,
        *,
        on_unlinked: OnUnlinked | None = None,
        on_request: OnRequest | None = None,
        on_report: OnReport | None = None,
        on_sent: OnSent | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        ready_frame: ReadyFrame | None = None,
    ) -> None:
        self.source = source
        self.ready_frame = ready_frame
        self.on_unlinked = on_unlinked
        self.on_request = on_request
        self.on_report = on_report
        self.on_sent = on_sent
        self.max_queue = max_queue
        self.links: dict[str, RelayLink] = {}
        self.version = -1
        self.relay: Relay | None = None
        self.bytes_sent = 0

    # --- the current version ---------------------------------------------------------------
    def start(self, version: int, relay: Relay | None) -> None:
        """Make ``version`` current; queued items of older versions are dropped."""
        self.version = version
        self.relay = relay
        for link in self.links.values():
            link.prune(version)

    def act(self, actions: list[Action]) -> None:
        relay, version = self.relay, self.version
        for a in actions:
            if isinstance(a, Send):
                link = self.links.get(a.peer)
                if link is not None:
                    # The relay keeps at most ``window`` sends per peer outstanding, so a full
                    # queue means a flood of other items; the slot stays taken (nothing more
                    # is pushed to that peer) until the link ends.
                    if not link.put(("chunk", version, a.index)) and len(link.queue) >= link.max_queue:
                        log.warning("send queue to %s full: chunk %d of v%d not queued", a.peer, a.index, version)
                elif self.on_unlinked is not None:
                    self.on_unlinked(a.peer, version, a.index)
                elif relay is not None:
                    self.act(relay.on_send_failed(a.peer, a.index))
            elif isinstance(a, Request):
                if self.on_request is not None:
                    self.on_request(version, a)
                else:
                    log.debug("relay asked to pull %s", a)
            elif isinstance(a, Report):
                if self.on_report is not None:
                    self.on_report(version, a.evidence)
            elif isinstance(a, Complete):
                log.debug("version %d: every chunk verified (encoded)", version)

    # --- links -----------------------------------------------------------------------------
    def link_up(self, conn: DataConnection) -> RelayLink:
        link = RelayLink(conn, max_queue=self.max_queue)
        if UNSENT_LOWAT:
            # a chunk counts as sent (the relay's acknowledgement, which its sibling rule weighs)
            # when it is mostly on the wire, not when it sits in a socket buffer of megabytes
            conn.limit_unsent(UNSENT_LOWAT)
        self.links[link.peer] = link
        return link

    def link_down(self, link: RelayLink) -> bool:
        """``link`` ended: its chunks in flight failed. True if it was the peer's current link."""
        current = self.links.get(link.peer) is link
        if current:
            del self.links[link.peer]
        relay = self.relay
        if relay is not None:
            for ver, i in list(link.inflight):
                if ver == self.version:
                    self.act(relay.on_send_failed(link.peer, i))
        link.inflight.clear()
        return current

    async def run_link(self, link: RelayLink, handle: FrameHandler) -> None:
        """Send and receive on ``link`` until either side ends."""
        await duplex(self.sender(link), self.receive_loop(link, handle))

    async def receive_loop(self, link: RelayLink, handle: FrameHandler) -> None:
        conn = link.conn
        while True:
            try:
                frame = await conn.receive()
            except ChunkMismatch as exc:  # frame body did not match its own key: still in sync
                log.warning("damaged frame from %s: %s", link.peer, exc)
                continue
            if frame.type is FrameType.BYE:
                return
            try:
                await handle(link, frame)
            except Echo2Error as exc:
                log.warning("refused %s frame from %s: %s", frame.type.name, link.peer, exc)

    async def sender(self, link: RelayLink) -> None:
        conn = link.conn
        while True:
            kind, ver, x = await link.get()
            if kind == "req":
                await conn.send_request(x)
                continue
            if kind in ("msg", "manifest"):
                link.sending_since = trio.current_time()
                try:
                    await conn.send_message(x)
                finally:
                    link.sending_since = None
                if kind == "manifest":
                    link.manifest_sent = (ver, trio.current_time())
                continue
            relay = self.relay
            if ver != self.version:
                continue
            i: int = x
            link.inflight.add((ver, i))
            link.sending_since = trio.current_time()
            try:
                ready = self.ready_frame(ver, i) if kind == "chunk" and self.ready_frame is not None else None
                if ready is not None:
                    await conn.send_chunk(ready[0], key=ready[1])
                    n_data = len(ready[0]) - CHUNK_HEADER_SIZE
                else:
                    if kind == "full":
                        flag, data = ENC_FULL, await self.source.full(ver, i)
                    else:
                        flag, data = await self.source.encoded(ver, i)
                    await conn.send_chunk(pack_chunk_frame(ver, i, flag, data))
                    n_data = len(data)
            except (Echo2Error, KeyError) as exc:
                log.info("sending chunk %d to %s failed: %s", i, link.peer, exc)
                link.inflight.discard((ver, i))
                if kind == "chunk" and self.relay is relay and relay is not None:
                    self.act(relay.on_send_failed(link.peer, i))
                if not conn.usable:
                    raise
                continue
            finally:
                link.sending_since = None
            link.inflight.discard((ver, i))
            self.bytes_sent += n_data
            if self.on_sent is not None:
                self.on_sent(ver, n_data)
            if kind == "chunk" and self.relay is relay and relay is not None:
                self.act(relay.on_child_ack(link.peer, i, now=trio.current_time()))

    # --- requests every relay answers --------------------------------------------------------
    def on_have(self, peer: str, h: ChunkHave) -> bool:
        """A peer's holdings; True if they are of the current version (and were given to the relay)."""
        if h.peer_id != peer:
            raise SchemaError("ChunkHave names another peer")
        if self.relay is None or h.version != self.version:
            return False
        self.act(self.relay.on_have(peer, h.have, now=trio.current_time()))
        return True

    def on_get(self, peer: str, r: ChunkRequest) -> bool:
        """A peer pulls chunks; True if they are of the current version (and were given to the relay)."""
        if self.relay is None or r.version != self.version:
            return False
        self.act(self.relay.on_request(peer, r.indices, now=trio.current_time()))
        return True


__all__ = ["ChunkSource", "RelayDriver", "RelayLink", "DEFAULT_MAX_QUEUE"]
