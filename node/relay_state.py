"""What a node knows of a policy version's broadcast: its configuration, the hub-signed plan in the
shape the relay rules want, one version's transfer state, and which manifests count as news."""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from echo2.protocol.errors import SchemaError
from echo2.protocol.messages import BroadcastPlan, Manifest
from echo2.protocol.relay import Evidence, Relay


@dataclass
class RelayConfig:
    upload_MBps: float = 0.0  # token-bucket cap on everything this node uploads (0 = none)
    # upload told the hub's planner (0: upload_MBps); a link shaped outside (bench --netns) has no bucket
    announce_MBps: float = 0.0
    stall_timeout_s: float = 3.0
    request_timeout_s: float = 6.0
    window: int = 2  # chunks in flight per child
    # ChunkHave rounds (to every link) at most this often while chunks arrive (and at once when the
    # version is complete): 10 a second per link were a fifth of a relay's CPU at N = 8, and pulls
    # wait seconds (stall_timeout_s) before they use them
    have_interval_s: float = 0.5
    tick_s: float = 0.1
    connect_timeout_s: float = 5.0
    keep_versions: int = 3
    corrupt_sends: bool = False  # fault injection, tests/benches only
    # What one version may cost this node (A7); 0: half the machine's memory. A version is held
    # about twice in memory (the encoded chunks kept for forwarding while it arrives, then the
    # raw chunks and the assembled buffer when it is loaded).
    max_memory_bytes: int = 0
    disk_reserve_bytes: int = 256 * 1024**2  # left free on the store's disk
    max_disk_bytes: int = 0  # what the chunk store may hold (the volunteer's disk cap; 0 = none)
    # hole punching (node.punch): the listen port is shared (SO_REUSEPORT), the hub link leaves
    # from it (so the hub sees its NAT mapping), and plan edges to NAT-bound peers are punched
    punch: bool = False
    punch_window_s: float = 4.0  # a failed punch is reported after it (the child then moves)


@dataclass
class WirePlan:
    """A verified ``BroadcastPlan`` in the shape :class:`echo2.protocol.relay.PlanView` wants."""

    hub: str
    stripes: int
    parent: list[dict[str, str]]
    children: list[dict[str, list[str]]]
    data_addrs: dict[str, str] = field(default_factory=dict)
    # NAT-bound ends of punched edges: the public ip:port their NAT maps their listen port to
    punch_addrs: dict[str, str] = field(default_factory=dict)

    def peers(self) -> set[str]:
        """Every node the plan names (parents and children of this node, and the rest)."""
        out: set[str] = set()
        for ps in self.parent:
            out.update(ps)
            out.update(ps.values())
        for cs in self.children:
            out.update(cs)
            for v in cs.values():
                out.update(v)
        return out

    def dial_targets(self, me: str) -> set[str]:
        """The peers this node dials for the plan's edges (pure; both ends decide alike): an
        edge's child dials its parent when the parent has an address in the plan (it is
        reachable), else the parent dials the child when the child has one (a reverse
        connection: a NAT-bound parent pushes to a reachable child). The hub is not dialled here
        (the hub link is kept apart)."""
        out: set[str] = set()
        for s in range(self.stripes):
            p = self.parent[s].get(me)
            if p is not None and p != self.hub and p in self.data_addrs:
                out.add(p)
            if me not in self.data_addrs:
                out.update(c for c in self.children[s].get(me, ()) if c in self.data_addrs)
        out.discard(me)
        return out

    def punch_targets(self, me: str) -> dict[str, PunchEdge]:
        """The peers this node punches a hole to (pure; both ends decide alike): an edge whose
        ends both lack a data address (both NAT-bound: nobody can dial the other) and both have a
        punch address. Each end connects from its listen port to the other's punch address at
        once (TCP simultaneous open, :mod:`echo2.node.punch`); the handshake roles follow the
        peer IDs (the lower one speaks as the dialer), so an edge used in both directions (in two
        stripes) is one connection and both ends agree on the roles."""
        if me in self.data_addrs or me not in self.punch_addrs:
            return {}
        ends: set[str] = set()
        for s in range(self.stripes):
            p = self.parent[s].get(me)
            if p is not None and p != self.hub:
                ends.add(p)
            ends.update(self.children[s].get(me, ()))
        ends.discard(me)
        return {
            peer: PunchEdge(peer, self.punch_addrs[peer], dialer=me < peer)
            for peer in sorted(ends)
            if peer not in self.data_addrs and peer in self.punch_addrs
        }


@dataclass(frozen=True)
class PunchEdge:
    """One hole to punch: ``peer``'s public ``addr`` and this end's role in the handshake."""

    peer: str
    addr: str
    dialer: bool  # speak as the dialer (name the peer we expect); else as the listener (the gate admits it)


def plan_from_message(msg: BroadcastPlan, hub: str) -> WirePlan:
    s = msg.stripes
    parent: list[dict[str, str]] = [{} for _ in range(s)]
    children: list[dict[str, list[str]]] = [{} for _ in range(s)]
    for node, ps in msg.parents.items():
        if len(ps) != s:
            raise SchemaError(f"plan v{msg.version}: {node} has {len(ps)} parents for {s} stripes")
        for i, p in enumerate(ps):
            parent[i][node] = p
    for p, per_stripe in msg.children.items():
        if len(per_stripe) != s:
            raise SchemaError(f"plan v{msg.version}: {p} has children for {len(per_stripe)} of {s} stripes")
        for i, cs in enumerate(per_stripe):
            if cs:
                children[i][p] = list(cs)
    return WirePlan(hub, s, parent, children, dict(msg.data_addrs), dict(msg.punch_addrs))


def star_view(me: str, hub: str) -> WirePlan:
    """Before (or without) a plan: everything comes from the hub."""
    return WirePlan(hub, 1, [{me: hub}], [{hub: [me]}])


@dataclass
class HeldInfo:
    version: int
    manifest: Manifest
    seconds: float  # manifest arrival to complete and verified on disk


@dataclass
class Broadcast:
    """One version on its way in (and out to this node's children)."""

    manifest: Manifest
    envelope: bytes
    plan: WirePlan
    relay: Relay
    t0: float
    encoded: dict[int, bytes | memoryview] = field(default_factory=dict)
    # the CHUNK frames (payload, key) these encodings came in, verified: forwarded as they are
    frames: dict[int, tuple[bytearray, bytes]] = field(default_factory=dict)
    need_full: set[int] = field(default_factory=set)
    full_queued: set[int] = field(default_factory=set)  # full encodings waiting to be decoded
    full_asked_at: float = -math.inf
    done: bool = False
    have_sent: int = -1
    have_at: float = -math.inf  # trio clock of the last ChunkHave round
    bytes_sent: int = 0
    bytes_received: int = 0
    stats_sent: int = -1

    @property
    def version(self) -> int:
        return self.manifest.version


def same_content(a: Manifest, b: Manifest) -> bool:
    return a.version == b.version and [c.raw_hash for c in a.chunks] == [c.raw_hash for c in b.chunks]


def is_news(new: Manifest, old: Manifest | None) -> bool:
    """Publications only move forward (A13): other content signed later than ``old``. Signing
    time, not the version number, orders them: a hub restarted from a checkpoint re-publishes
    the version it resumed at (maybe a lower number than it reached before) and its later word
    wins; a replayed manifest (they stay valid for days) was signed earlier, whatever its number,
    so it can neither roll a node back nor, from a hub's earlier run, jump it to stale weights."""
    if old is None:
        return True
    return not same_content(new, old) and new.created > old.created


def memory_budget(cfg: RelayConfig) -> int:
    if cfg.max_memory_bytes > 0:
        return cfg.max_memory_bytes
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 8 * 1024**3


def budget_refusal(m: Manifest, cfg: RelayConfig, *, missing_bytes: int, free_disk: int, stored_bytes: int = 0) -> str | None:
    """Why this node cannot take version ``m`` (its sizes against the memory and disk budget),
    or None. Checked before anything of the version is allocated: a manifest's sizes are claims."""
    mem = memory_budget(cfg)
    if 2 * m.total_bytes > mem:
        return f"{m.total_bytes} bytes need about {2 * m.total_bytes} of memory; the budget is {mem}"
    if missing_bytes > free_disk - cfg.disk_reserve_bytes:
        return f"{missing_bytes} bytes to store; {free_disk} free on disk, {cfg.disk_reserve_bytes} kept free"
    if cfg.max_disk_bytes and stored_bytes + missing_bytes > cfg.max_disk_bytes:
        return (f"{missing_bytes} bytes to store beside the {stored_bytes} the chunk store holds: over its disk cap "
                f"of {cfg.max_disk_bytes} bytes")
    return None


# Verified chunks waiting for the decode-and-store worker: a link whose chunks come faster than
# the disk takes them waits (backpressure), instead of queueing without bound (A4).
STORE_QUEUE = 16
MAX_EVIDENCE = 1024  # evidence kept for inspection (each report goes to on_evidence as it comes)

OnHolds = Callable[["HeldInfo"], Awaitable[None] | None]
OnEvidence = Callable[[int, Evidence], Awaitable[None] | None]
