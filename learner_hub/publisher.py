"""Publishing policy versions: packing, the signed manifest, and the sender behind an interface.

``PolicyPublisher`` packs each new version (deltas against the previous one, a full snapshot
every K versions) and keeps broadcast metrics. A ``Sender`` moves a published version to nodes;
``StarSender`` is the simple one: the hub streams manifest and chunks to every connected node over
its data-plane connection. The pipelined relay is another Sender.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from echo2.models import statedict
from echo2.protocol import chunking, envelope, packing
from echo2.protocol.errors import Echo2Error
from echo2.protocol.identity import Identity
from echo2.protocol.wire import ENC_FULL, ENC_MANIFEST, pack_chunk_frame

log = logging.getLogger(__name__)


@dataclass
class Published:
    version: int
    packed: Any  # packing.PackedVersion
    manifest_envelope: bytes
    published_at: float
    full_cache: dict[int, bytes] = field(default_factory=dict)
    holds: dict[str, float] = field(default_factory=dict)  # peer -> seconds after publication

    def full_encoding(self, index: int) -> bytes:
        """The zstd (non-delta) encoding of a chunk, for a node lacking the delta's parent."""
        enc = self.full_cache.get(index)
        if enc is None:
            m = self.packed.manifest
            enc = packing.encode_chunk(self.packed.raw_chunks[index], bf16_split=m.bf16_split)
            self.full_cache[index] = enc
        return enc

    def shed(self) -> None:
        """Drop the chunk bytes, keep the figures: an old version stays for late holds reports
        only. (Keeping 16 versions of SmolLM2-135M whole, 325 MB raw each plus their encodings,
        took the hub to 20 GB and the OOM killer within 30 steps.)"""
        self.packed = packing.PackedVersion(self.packed.manifest, raw_chunks=[], encoded=[])
        self.full_cache.clear()

    @property
    def has_data(self) -> bool:
        return bool(self.packed.raw_chunks)


#: versions whose figures are kept for late holds reports
KEEP_RECENT = 16


class PolicyPublisher:
    def __init__(self, identity: Identity, model_config: str, artifacts: dict[str, bytes], cfg: Any) -> None:
        self.identity = identity
        self.model_config = model_config
        self.artifacts = artifacts
        # 0: each version's chunk size comes from its size and the fleet (protocol.chunking);
        # nodes take any size the signed manifest names within packing's limits
        self.fixed_chunk_size = int(cfg.chunk_bytes)
        self.chunk_size = self.fixed_chunk_size or packing.DEFAULT_CHUNK_SIZE
        #: how many nodes a version goes to (the pipelined sender sets it; None: one node)
        self.fleet_size: Callable[[], int] | None = None
        self.full_every = int(cfg.full_every)
        # a LoRA policy's base chunks never change: snapshots keep them as zero deltas (packing)
        lo = getattr(cfg, "lora", None)
        self.keep_unchanged = bool(lo is not None and lo.enabled)
        # chunk bytes are kept for the versions still in use: verification of stale rows reads
        # versions t-S..t, and nodes may still be fetching the one before the latest
        self.keep_data = max(2, int(getattr(cfg, "staleness", 1)) + 2)
        self.latest: Published | None = None
        self.history: list[dict[str, Any]] = []
        self.load_s: dict[str, float] = {}  # D_i: EWMA of publication -> node holds it, per node
        self.recent: dict[int, Published] = {}  # the last few versions, for late holds reports
        self._first_seen: set[str] = set()
        #: told of each version's broadcast figures when it leaves ``recent`` (the hub stores them)
        self.on_closed: Callable[[dict[str, Any]], None] | None = None

    @property
    def latest_version(self) -> int:
        return self.latest.version if self.latest else -1

    def chunk_size_for(self, total_bytes: int) -> int:
        """The chunk size of the next version of ``total_bytes`` raw bytes."""
        if self.fixed_chunk_size:
            return self.fixed_chunk_size
        n = max(1, self.fleet_size()) if self.fleet_size is not None else 1
        chosen = chunking.choose_chunk_size(max(1, total_bytes), n)
        prev = self.latest.packed.manifest.chunk_size if self.latest else None
        return chunking.stable_chunk_size(prev, chosen)

    async def publish(self, version: int, state_dict: dict[str, Any]) -> Published:
        parent = self.latest.packed if self.latest else None
        total = sum(int(t.numel()) * int(t.element_size()) for t in state_dict.values())
        self.chunk_size = self.chunk_size_for(total)

        def pack() -> Any:
            return statedict.pack_version(
                state_dict,
                version=version,
                parent=parent,
                chunk_size=self.chunk_size,
                model_config=self.model_config,
                artifacts=self.artifacts,
                full_every=self.full_every,
                keep_unchanged=self.keep_unchanged,
            )

        t0 = time.time()
        packed = await trio.to_thread.run_sync(pack)
        env = envelope.seal(self.identity, packed.manifest, ttl_s=7 * 24 * 3600.0)
        pub = Published(version, packed, env, time.time())
        self.latest = pub
        self.recent[version] = pub
        for old in sorted(self.recent)[:-KEEP_RECENT]:
            self._close_metrics(self.recent.pop(old))
        for old in sorted(self.recent)[:-self.keep_data]:
            self.recent[old].shed()
        enc = sum(len(e) for e in packed.encoded)
        log.info(
            "published version %d: %d chunks, %.2f MB raw, %.2f MB encoded (%.1fs to pack)",
            version, len(packed.encoded), packed.manifest.total_bytes / 1e6, enc / 1e6, time.time() - t0,
        )
        return pub

    def record_holds(self, peer: str, version: int) -> None:
        pub = self.recent.get(version)
        if pub is None or peer in pub.holds:
            return
        d = time.time() - pub.published_at
        pub.holds[peer] = d
        if peer not in self._first_seen:
            # the first version a node gets includes its own start-up and admission: not D_i
            self._first_seen.add(peer)
            return
        prev = self.load_s.get(peer)
        self.load_s[peer] = d if prev is None else 0.7 * prev + 0.3 * d

    @staticmethod
    def _figures(pub: Published) -> dict[str, Any]:
        times = sorted(pub.holds.values())
        return {
            "version": pub.version,
            "nodes": len(times),
            "first_s": times[0] if times else None,
            "median_s": statistics.median(times) if times else None,
            "last_s": times[-1] if times else None,
        }

    def open_metrics(self) -> list[dict[str, Any]]:
        """The broadcast figures so far of the versions still in the window (not yet in history)."""
        return [self._figures(pub) for _, pub in sorted(self.recent.items())]

    def _close_metrics(self, pub: Published) -> None:
        self.history.append(self._figures(pub))
        del self.history[:-1000]
        if self.on_closed is not None:
            self.on_closed(self.history[-1])

    def broadcast_metrics(self) -> dict[str, Any]:
        lasts = [h["last_s"] for h in self.history if h["last_s"] is not None]
        return {
            "versions": len(self.history),
            "last_node_s_median": statistics.median(lasts) if lasts else None,
            "recent": self.history[-5:],
        }


class Sender(Protocol):
    def notify(self) -> None: ...

    async def serve_connection(self, conn: Any) -> None: ...


class StarSender:
    """The hub streams every new version to each connected node (time ≈ N·M / b_hub)."""

    def __init__(self, publisher: PolicyPublisher) -> None:
        self.publisher = publisher
        self._new_version = trio.Event()
        self.bytes_sent = 0

    def notify(self) -> None:
        self._new_version.set()
        self._new_version = trio.Event()

    async def serve_connection(self, conn: Any) -> None:
        sent = -1
        peer = conn.peer_id
        log.info("policy downlink open to %s", peer)
        while True:
            pub = self.publisher.latest
            if pub is None or pub.version <= sent:
                await self._new_version.wait()
                continue
            manifest = pub.packed.manifest
            # The node holds `sent` verified (same TCP stream, in order), so deltas against it work.
            have_parent = manifest.parent is not None and manifest.parent == sent
            await conn.send_message(pub.manifest_envelope)
            for entry, enc in zip(manifest.chunks, pub.packed.encoded, strict=True):
                if entry.encoding == "delta" and not have_parent:
                    data = await trio.to_thread.run_sync(pub.full_encoding, entry.index)
                    payload = pack_chunk_frame(pub.version, entry.index, ENC_FULL, data)
                else:
                    payload = pack_chunk_frame(pub.version, entry.index, ENC_MANIFEST, enc)
                await conn.send_chunk(payload)
                self.bytes_sent += len(payload)
            sent = pub.version


__all__ = ["PolicyPublisher", "Published", "Sender", "StarSender", "Echo2Error"]
