"""What a node's data plane admits from peers, and what it keeps for them (A4).

A volunteer's data plane faces anyone who can reach it. It accepts the hub and the peers of a
hub-signed plan for a recent version, and nobody else: a stranger is refused with a log line (a
peer dialing a moment before the plan naming it reaches us waits, briefly, for that plan). What
one peer can make the node buffer is bounded: a frame is at most a chunk of the current version
plus its header (a control frame far less; MESSAGE frames only from the hub carry anything), so a
connection pins at most one such frame; chunks and holdings that come before their manifest are
kept per peer within small budgets and dropped when their version is superseded.
"""

from __future__ import annotations

import logging

import trio

from echo2.protocol import packing
from echo2.protocol.dataframe import DEFAULT_MAX_SIZES, FrameType
from echo2.protocol.messages import ChunkHave

from .relay_state import WirePlan

log = logging.getLogger(__name__)

CHUNK_HEADER = 13  # wire.pack_chunk_frame: version (8), index (4), encoding flag (1)
PEER_MESSAGE_MAX = 4096  # MESSAGE frames from a peer other than the hub (none is expected)
CONTROL_BASE = 4096
CONTROL_PER_CHUNK = 10  # a ChunkRequest index, canonically encoded, is at most 9 bytes
CONTROL_MIN_CHUNKS = 8192  # before any manifest: room for a ChunkHave/ChunkRequest this long
MAX_EARLY_BYTES = 64 * 1024 * 1024
MAX_EARLY_BYTES_PER_PEER = 16 * 1024 * 1024
MAX_EARLY_VERSIONS = 4
MAX_EARLY_HAVE = 256
PLAN_VERSIONS = 3  # plans kept: the newest and the two before it


class PeerGate:
    """The allow-list (peers of recent hub-signed plans), per-connection frame limits, and the
    bounded buffers of what came before its manifest."""

    def __init__(self, me: str, hub: str, *, plan_wait_s: float = 2.0) -> None:
        self.me = me
        self.hub = hub
        self.plan_wait_s = plan_wait_s
        self.plans: dict[int, WirePlan] = {}
        self._peers: dict[int, frozenset[str]] = {}
        self._plan_event = trio.Event()
        self.early_have: dict[str, ChunkHave] = {}
        self._early_chunks: dict[int, list[tuple[str, bytes]]] = {}
        self._early_by_peer: dict[str, int] = {}
        self.refused = 0

    # --- who may connect -----------------------------------------------------------------------
    def add_plan(self, version: int, plan: WirePlan) -> None:
        newest = max([version, *self.plans])
        self.plans[version] = plan
        self._peers[version] = frozenset(plan.peers())
        for v in [v for v in self.plans if v <= newest - PLAN_VERSIONS]:
            del self.plans[v]
            self._peers.pop(v, None)
        self._plan_event.set()
        self._plan_event = trio.Event()

    def allowed(self, peer: str) -> bool:
        return peer == self.hub or any(peer in ps for ps in self._peers.values())

    async def admit(self, peer: str) -> bool:
        """True if ``peer`` may use our data plane; waits up to ``plan_wait_s`` for a plan naming
        it (its plan may have reached it before ours reaches us). We read nothing from it meanwhile."""
        if self.allowed(peer):
            return True
        with trio.move_on_after(self.plan_wait_s):
            while not self.allowed(peer):
                await self._plan_event.wait()
        if self.allowed(peer):
            return True
        self.refused += 1
        log.warning("data-plane peer %s is in no current plan: refused", peer)
        return False

    # --- how big a frame may be ----------------------------------------------------------------
    def frame_limits(self, peer: str, chunk_size: int | None, n_chunks: int | None) -> dict[FrameType, int]:
        """Per-connection frame limits for ``peer`` given the current version's chunk size and
        count (None before any manifest: the data plane's defaults for chunks)."""
        chunk = (
            packing.max_encoded_size(chunk_size) + CHUNK_HEADER
            if chunk_size
            else DEFAULT_MAX_SIZES[FrameType.CHUNK]
        )
        control = CONTROL_BASE + CONTROL_PER_CHUNK * max(n_chunks or 0, CONTROL_MIN_CHUNKS)
        message = DEFAULT_MAX_SIZES[FrameType.MESSAGE] if peer == self.hub else PEER_MESSAGE_MAX
        return {FrameType.CHUNK: chunk, FrameType.REQUEST: control, FrameType.MESSAGE: message}

    # --- what came before its manifest ---------------------------------------------------------
    def keep_have(self, peer: str, h: ChunkHave) -> None:
        if peer in self.early_have or len(self.early_have) < MAX_EARLY_HAVE:
            self.early_have[peer] = h

    def take_haves(self, version: int) -> list[tuple[str, ChunkHave]]:
        """The holdings of ``version`` kept so far; older and these are dropped."""
        mine = [(p, h) for p, h in self.early_have.items() if h.version == version]
        self.early_have = {p: h for p, h in self.early_have.items() if h.version > version}
        return mine

    def forget(self, peer: str) -> None:
        """``peer``'s link ended: what it advertised is no longer worth keeping."""
        self.early_have.pop(peer, None)

    def buffer_chunk(self, peer: str, version: int, payload: bytes) -> bool:
        if version not in self._early_chunks and len(self._early_chunks) >= MAX_EARLY_VERSIONS:
            return False
        n = len(payload)
        if self.early_bytes + n > MAX_EARLY_BYTES or self._early_by_peer.get(peer, 0) + n > MAX_EARLY_BYTES_PER_PEER:
            return False  # the relay's pull path fetches it once the manifest is here
        self._early_chunks.setdefault(version, []).append((peer, payload))
        self._early_by_peer[peer] = self._early_by_peer.get(peer, 0) + n
        return True

    def take_chunks(self, version: int) -> list[tuple[str, bytes]]:
        """The chunks of ``version`` buffered so far; older versions' are dropped."""
        mine = self._early_chunks.pop(version, [])
        for v in [v for v in self._early_chunks if v < version]:
            del self._early_chunks[v]
        self._early_by_peer = {}
        for items in self._early_chunks.values():
            for p, payload in items:
                self._early_by_peer[p] = self._early_by_peer.get(p, 0) + len(payload)
        return mine

    @property
    def early_bytes(self) -> int:
        return sum(self._early_by_peer.values())
