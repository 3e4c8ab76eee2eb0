"""What a node knows of a policy version's broadcast: its configuration, the hub-signed plan in the
shape the relay rules want, one version's transfer state, and which manifests count as news."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from echo2.protocol.errors import SchemaError
from echo2.protocol.messages import BroadcastPlan, Manifest
from echo2.protocol.relay import Relay


@dataclass
class RelayConfig:
    upload_MBps: float = 0.0  # token-bucket cap on everything this node uploads (0 = none)
    stall_timeout_s: float = 3.0
    request_timeout_s: float = 6.0
    window: int = 2  # chunks in flight per child
    tick_s: float = 0.1
    connect_timeout_s: float = 5.0
    keep_versions: int = 3
    corrupt_sends: bool = False  # fault injection, tests/benches only


@dataclass
class WirePlan:
    """A verified ``BroadcastPlan`` in the shape :class:`echo2.protocol.relay.PlanView` wants."""

    hub: str
    stripes: int
    parent: list[dict[str, str]]
    children: list[dict[str, list[str]]]
    data_addrs: dict[str, str] = field(default_factory=dict)

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
    return WirePlan(hub, s, parent, children, dict(msg.data_addrs))


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
    encoded: dict[int, bytes] = field(default_factory=dict)
    need_full: set[int] = field(default_factory=set)
    full_asked_at: float = -math.inf
    done: bool = False
    have_sent: int = -1
    bytes_sent: int = 0
    bytes_received: int = 0
    stats_sent: int = -1

    @property
    def version(self) -> int:
        return self.manifest.version


def is_news(new: Manifest, old: Manifest | None) -> bool:
    """Newer than ``old``, or the same or an older number with other content: a hub restarted
    from a checkpoint re-publishes versions, and its word on the current policy wins."""
    if old is None or new.version > old.version:
        return True
    return [c.raw_hash for c in new.chunks] != [c.raw_hash for c in old.chunks]
