"""The hub's bookkeeping of a policy broadcast, shared by the pipelined and the star sender:
what each node said of itself (``hello``), its signed holds reports, its byte counters, and per
version figures; and where the hub's chunk bytes come from (:class:`PublishedSource`)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from echo2.protocol import envelope
from echo2.protocol.errors import SchemaError
from echo2.protocol.messages import HoldsVersion
from echo2.protocol.wire import ENC_MANIFEST

from .publisher import PolicyPublisher, Published

log = logging.getLogger(__name__)

UNLIMITED_BPS = 1e9  # "no upload limit" as the planner sees it (about loopback speed here)


class PublishedSource:
    """The hub's :class:`~echo2.protocol.net.relaydriver.ChunkSource`: a published version's
    packed chunks, and their full encodings (made in a worker thread, cached by the version)."""

    def __init__(self, publisher: PolicyPublisher) -> None:
        self.publisher = publisher

    def _pub(self, version: int, index: int) -> Published:
        pub = self.publisher.latest
        if pub is None or pub.version != version:
            pub = self.publisher.recent.get(version)
        if pub is None or not 0 <= index < len(pub.packed.encoded):
            raise KeyError((version, index))
        return pub

    async def encoded(self, version: int, index: int) -> tuple[int, bytes]:
        return ENC_MANIFEST, self._pub(version, index).packed.encoded[index]

    async def full(self, version: int, index: int) -> bytes:
        pub = self._pub(version, index)
        return await trio.to_thread.run_sync(pub.full_encoding, index)


@dataclass(frozen=True)
class PeerInfo:
    """What the planner needs about a node: where its data plane listens, its upload, reachability."""

    data_addr: str
    upload_Bps: float
    reachable: bool = True


@dataclass
class VersionMetrics:
    version: int
    published_at: float  # wall clock
    nodes: int = 0  # nodes in the plan when it was made
    holds: dict[str, float] = field(default_factory=dict)  # peer -> seconds after publication
    hub_sent_bytes: int = 0
    peer_sent: dict[str, int] = field(default_factory=dict)
    replans: int = 0
    # hole punching (node.punch): NAT<->NAT node pairs the plans joined by a punch, those both
    # ends (or one) reported connected, and those whose punch failed (the child moved elsewhere)
    punch_planned: set[frozenset[str]] = field(default_factory=set)
    punched: set[frozenset[str]] = field(default_factory=set)
    punch_failed: set[frozenset[str]] = field(default_factory=set)

    def summary(self) -> dict[str, Any]:
        times = sorted(self.holds.values())
        return {
            "version": self.version,
            "nodes": len(times),
            "planned_nodes": self.nodes,
            "first_s": times[0] if times else None,
            "median_s": statistics.median(times) if times else None,
            "last_s": times[-1] if times else None,
            "hub_sent_bytes": self.hub_sent_bytes,
            "peer_sent_bytes": sum(self.peer_sent.values()),
            "replans": self.replans,
            "punch_planned": len(self.punch_planned),
            "punched": len(self.punched),
            "punch_fallbacks": len(self.punch_failed),
        }


class HubSide:
    """The node->hub half shared by both senders: hello, holds reports, stats, metrics."""

    def __init__(self, publisher: PolicyPublisher, node_info: Callable[[str], PeerInfo | None] | None) -> None:
        self.publisher = publisher
        self.node_info = node_info
        self.hello: dict[str, PeerInfo] = {}
        self.lport: dict[str, int] = {}  # peer -> the local port its hub link left from (its hello; 0: any)
        self.metrics: dict[int, VersionMetrics] = {}
        self.changed = trio.Event()  # set (and replaced) on every join/leave/holds
        # told (peer, why) when a relay served the hub itself a corrupt chunk: the only evidence
        # a relay is punished on (A9); the fleet bans it
        self.on_convicted: Callable[[str, str], None] = lambda _peer, _why: None

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def accuse(self, peer: str, why: str, index: int | None = None) -> None:
        """``peer`` was reported relaying a corrupt chunk: an accusation to check. The star
        sender has no relays: nothing to do."""

    def was_parent(self, version: int, node: str, index: int, parent: str) -> bool:
        """Did a plan of ``version`` make ``parent`` the node's parent for chunk ``index``? (The
        only peers whose corrupt chunks a node can report; the star sender has none.)"""
        return False

    def info(self, peer: str) -> PeerInfo | None:
        if self.node_info is not None:
            got = self.node_info(peer)
            if got is not None:
                return got
        return self.hello.get(peer)

    def _metrics_for(self, pub: Published) -> VersionMetrics:
        m = self.metrics.get(pub.version)
        if m is None:
            m = self.metrics[pub.version] = VersionMetrics(pub.version, pub.published_at)
            for old in sorted(self.metrics)[:-100]:
                del self.metrics[old]
        return m

    def version_metrics(self, version: int) -> dict[str, Any] | None:
        m = self.metrics.get(version)
        return m.summary() if m is not None else None

    def holders(self, version: int) -> int:
        m = self.metrics.get(version)
        return len(m.holds) if m else 0

    def _on_hello(self, peer: str, d: dict[str, Any]) -> None:
        up = float(d["up"])
        self.hello[peer] = PeerInfo(d["addr"], up * 1e6 if up > 0 else UNLIMITED_BPS, bool(d["addr"]))
        self.lport[peer] = int(d.get("lport", 0))
        self._changed()

    def _on_stats(self, peer: str, d: dict[str, Any]) -> None:
        m = self.metrics.get(d["v"])
        if m is not None:
            m.peer_sent[peer] = d["sent"]

    def _on_message(self, peer: str, payload: bytearray) -> None:
        v = envelope.open_envelope(bytes(payload), HoldsVersion, replay=None, allowed=lambda s, _t: s == peer)
        msg = v.message
        if msg.peer_id != peer:
            raise SchemaError("HoldsVersion names another peer")
        pub = self.publisher.latest
        if pub is not None and pub.version == msg.version:
            m = self._metrics_for(pub)
            if peer not in m.holds:
                m.holds[peer] = time.time() - pub.published_at
                self.publisher.record_holds(peer, msg.version)
                self._changed()


__all__ = ["HubSide", "PeerInfo", "PublishedSource", "UNLIMITED_BPS", "VersionMetrics"]
