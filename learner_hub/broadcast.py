"""The hub side of the pipelined broadcast: :class:`PipelinedSender` (a ``Sender`` like StarSender).

Same interface as :class:`echo2.learner_hub.publisher.StarSender`: the hub runs
``DataPlaneServer(identity, sender.serve_connection, upload_limiter=...)`` and calls
``sender.notify()`` after each ``publisher.publish``. Every node keeps one data-plane connection to
the hub (it dials; see :mod:`echo2.node.relay_runtime` for the whole wire protocol). On it the hub:

- learns the node's data-plane address and upload limit (``hello`` request; a ``node_info``
  callback, e.g. from the node's signed Announce, overrides it);
- on each new version plans the broadcast with :func:`echo2.learner_hub.planner.plan_broadcast`
  over the connected nodes (interleaved stripe trees, fast reachable nodes inside), and sends the
  signed ``BroadcastPlan`` and then the signed ``Manifest`` to every node;
- pushes each stripe's chunks to that stripe's first-level children (the hub runs the same
  :class:`~echo2.protocol.relay.Relay` rules, holding every chunk), serves pulls (``get``) and full
  encodings of delta chunks for nodes without the parent chunk (``full``);
- repairs the plan when a node's connection ends (leave) or a node connects mid-broadcast (join):
  :func:`~echo2.learner_hub.planner.replan`, re-signed, sent to every node;
- demotes a relay that makes no progress to a leaf (repair now, and a leaf in later plans): one
  that sent no ``have`` for the current version within ``progress_timeout_s`` of its plan (every
  live node announces its holdings as soon as the manifest comes, so silence means it does not
  read the hub link), or whose children pull its stripe from the hub. Its children would otherwise
  wait out their stall timer on every version. It is promoted again once it reports holding a
  version published after its demotion;
- keeps each connection's send queue bounded: items of superseded versions are dropped when a new
  version starts, so a peer that stops reading costs the hub neither memory nor other links' time
  (every link has its own sender task; nothing else awaits a send);
- records per version: seconds from publication to the first / median / last node holding it
  verified (from the nodes' signed ``HoldsVersion``), bytes sent by the hub, bytes sent by peers
  (their ``stats`` reports; informative, not verified).

:class:`StarWithHolds` wraps a StarSender with the same hello/holds bookkeeping, so the bench
measures both modes the same way.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from echo2.protocol import envelope
from echo2.protocol.dataframe import FrameType
from echo2.protocol.errors import ChunkMismatch, DecodeError, Echo2Error, SchemaError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import BroadcastPlan, ChunkHave, ChunkRequest, HoldsVersion
from echo2.protocol.net.connection import DataConnection, duplex
from echo2.protocol.relay import Relay, Request, Send
from echo2.protocol.wire import (
    ENC_FULL,
    ENC_MANIFEST,
    REQ_FULL,
    REQ_GET,
    REQ_HAVE,
    REQ_HELLO,
    REQ_STATS,
    decode_request,
    pack_chunk_frame,
)

from .planner import NodeInfo, Plan, plan_broadcast, replan
from .publisher import PolicyPublisher, Published, StarSender

log = logging.getLogger(__name__)

STAR_MAX_PENDING_PULLS = 4096
UNLIMITED_BPS = 1e9  # "no upload limit" as the planner sees it (about loopback speed here)




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
        }


class _HubSide:
    """The node->hub half shared by both senders: hello, holds reports, stats, metrics."""

    def __init__(self, publisher: PolicyPublisher, node_info: Callable[[str], PeerInfo | None] | None) -> None:
        self.publisher = publisher
        self.node_info = node_info
        self.hello: dict[str, PeerInfo] = {}
        self.metrics: dict[int, VersionMetrics] = {}
        self.changed = trio.Event()  # set (and replaced) on every join/leave/holds

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def distrust(self, peer: str, why: str) -> None:
        """Never use ``peer`` as a relay again (it was reported relaying corrupt chunks). The
        star sender has no relays: nothing to do."""

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


class _Link:
    """One node's connection. Its send queue holds ``(kind, version, ...)`` items; those of older
    versions are pruned when a version starts (``prune``), so it stays bounded even when the peer
    stops reading: only the newest version's plan, manifest and chunks wait there."""

    def __init__(self, conn: DataConnection) -> None:
        self.conn = conn
        self.peer = conn.peer_id
        self.queue: deque[tuple[Any, ...]] = deque()
        self._wake = trio.Event()
        self.inflight: set[tuple[int, int]] = set()
        self.sending_since: float | None = None  # trio clock when the current send began
        self.connected_at = trio.current_time()
        self.manifest_sent: tuple[int, float] = (-1, 0.0)  # (version, trio clock) of the last one written

    def put(self, item: tuple[Any, ...]) -> None:
        self.queue.append(item)
        self._wake.set()

    def prune(self, version: int) -> None:
        if self.queue:
            self.queue = deque(it for it in self.queue if it[1] >= version)

    async def get(self) -> tuple[Any, ...]:
        while not self.queue:
            self._wake = trio.Event()
            await self._wake.wait()
        return self.queue.popleft()


@dataclass
class _Current:
    pub: Published
    plan: Plan
    relay: Relay
    plan_env: bytes
    metrics: VersionMetrics


class PipelinedSender(_HubSide):
    """Peer-assisted pipelined broadcast, hub side (see the module doc).

    ``hub_upload_MBps``: the hub's upload for planning (0 = unlimited); ``data_addr``: the hub's
    own data-plane address put into plans (nodes know it already; informative); ``node_info``:
    optional better knowledge of a node (measured upload, reachability) than its ``hello``.
    """

    def __init__(
        self,
        publisher: PolicyPublisher,
        identity: Identity,
        *,
        hub_upload_MBps: float = 0.0,
        data_addr: str = "",
        node_info: Callable[[str], PeerInfo | None] | None = None,
        stripes: int | None = None,
        window: int = 2,
        plan_ttl_s: float = 24 * 3600.0,
        progress_timeout_s: float = 1.0,
    ) -> None:
        super().__init__(publisher, node_info)
        self.identity = identity
        self.hub = identity.peer_id
        self.hub_upload_Bps = hub_upload_MBps * 1e6 if hub_upload_MBps > 0 else UNLIMITED_BPS
        self.data_addr = data_addr
        self.stripes = stripes
        self.window = window
        self.plan_ttl_s = plan_ttl_s
        self.progress_timeout_s = progress_timeout_s
        self.links: dict[str, _Link] = {}
        self.cur: _Current | None = None
        self.bytes_sent = 0
        # peer -> the version current when it was demoted; a leaf in every plan until it reports
        # holding a later one
        self.demoted: dict[str, int] = {}
        # peers reported relaying corrupt chunks: leaves in every plan, for good
        self.distrusted: set[str] = set()
        # version -> (node, stripe) -> every parent a plan (or repair) of it gave the node
        self._parents: dict[int, dict[tuple[str, int], set[str]]] = {}
        self._stripes: dict[int, int] = {}
        self._started_at = 0.0  # trio clock when the current version's broadcast began

    # --- planning ------------------------------------------------------------------------------
    def _node_infos(self) -> list[NodeInfo]:
        out = []
        for peer in sorted(self.links):
            info = self.info(peer)
            if info is None or peer in self.demoted or peer in self.distrusted:
                out.append(NodeInfo(peer, 0.0, False))  # unknown or untrusted: a leaf everywhere
            else:
                out.append(NodeInfo(peer, info.upload_Bps, info.reachable and bool(info.data_addr)))
        return out

    def _plan_message(self, plan: Plan) -> bytes:
        nodes = plan.nodes
        addrs = {n: a.data_addr for n in nodes if (a := self.info(n)) is not None and a.data_addr}
        if self.data_addr:
            addrs[self.hub] = self.data_addr
        keys = set(nodes) | {self.hub}
        msg = BroadcastPlan(
            version=plan.version,
            stripes=plan.stripes,
            parents={n: [plan.parent[s][n] for s in range(plan.stripes)] for n in nodes},
            children={
                p: [list(plan.children[s].get(p, [])) for s in range(plan.stripes)]
                for p in sorted(keys)
                if any(plan.children[s].get(p) for s in range(plan.stripes))
            },
            data_addrs=addrs,
            created=time.time(),
        )
        return envelope.seal(self.identity, msg, ttl_s=self.plan_ttl_s)

    def notify(self) -> None:
        """A version was just published: plan over the connected nodes and start pushing."""
        pub = self.publisher.latest
        if pub is None or (self.cur is not None and self.cur.pub.version >= pub.version):
            return
        # a peer that left and came back starts afresh (and the map stays bounded)
        self.demoted = {p: v for p, v in self.demoted.items() if p in self.links}
        m = pub.packed.manifest
        plan = plan_broadcast(
            pub.version, self.hub_upload_Bps, self._node_infos(), len(m.chunks), hub=self.hub, stripes=self.stripes
        )
        relay = Relay(self.hub, plan, [c.enc_hash for c in m.chunks], have=range(len(m.chunks)),
                      now=trio.current_time(), window=self.window)
        metrics = self._metrics_for(pub)
        metrics.nodes = len(plan.nodes)
        self.cur = _Current(pub, plan, relay, self._plan_message(plan), metrics)
        self._remember(plan)
        self._started_at = trio.current_time()
        log.info("broadcast v%d: %d nodes, %d stripes, depth %d", pub.version, len(plan.nodes), plan.stripes, plan.max_depth())
        for link in self.links.values():
            link.prune(pub.version)
            link.put(("msg", pub.version, self.cur.plan_env))
            link.put(("manifest", pub.version, pub.manifest_envelope))
        self._act(self.cur, relay.start(now=trio.current_time()))

    def _repair(self, left: Sequence[str] = (), joined: Sequence[NodeInfo] = (), *, joiner: _Link | None = None) -> None:
        cur = self.cur
        if cur is None:
            return
        cur.plan = replan(cur.plan, left=left, joined=joined)
        self._remember(cur.plan)
        cur.plan_env = self._plan_message(cur.plan)
        cur.metrics.replans += 1
        log.info("broadcast v%d repaired: -%s +%s", cur.pub.version, list(left), [j.node_id for j in joined])
        for link in self.links.values():
            link.put(("msg", cur.pub.version, cur.plan_env))
        if joiner is not None:
            # The manifest must reach the joiner before the chunks the repair pushes to it: a node
            # drops chunks of a version it has no manifest for.
            joiner.put(("manifest", cur.pub.version, cur.pub.manifest_envelope))
        self._act(cur, cur.relay.on_plan(cur.plan, now=trio.current_time()))

    # --- relays that make no progress ----------------------------------------------------------
    def _is_interior(self, cur: _Current, peer: str) -> bool:
        return any(cur.plan.children[s].get(peer) for s in range(cur.plan.stripes))

    def _demote(self, peer: str, why: str) -> None:
        cur = self.cur
        if cur is None or peer in self.demoted:
            return
        self.demoted[peer] = cur.pub.version
        log.warning("broadcast v%d: relay %s makes no progress (%s); a leaf until it holds a newer version",
                    cur.pub.version, peer, why)
        if self._is_interior(cur, peer):
            # Out and back in as a leaf: its children move, with their subtrees, to live parents.
            self._repair(left=[peer], joined=[NodeInfo(peer, 0.0, False)])

    def _remember(self, plan: Plan) -> None:
        seen = self._parents.setdefault(plan.version, {})
        self._stripes[plan.version] = plan.stripes
        for stripe, parents in enumerate(plan.parent):
            for node, parent in parents.items():
                seen.setdefault((node, stripe), set()).add(parent)
        for old in sorted(self._parents)[:-16]:  # as many versions as the publisher keeps
            del self._parents[old]
            self._stripes.pop(old, None)

    def was_parent(self, version: int, node: str, index: int, parent: str) -> bool:
        seen = self._parents.get(version)
        stripes = self._stripes.get(version, 0)
        if not seen or stripes < 1:
            return False
        return parent in seen.get((node, index % stripes), ())

    def distrust(self, peer: str, why: str) -> None:
        if peer in self.distrusted:
            return
        self.distrusted.add(peer)
        cur = self.cur
        log.warning("relay %s distrusted (%s): a leaf in every plan from now on", peer, why)
        if cur is not None and peer in self.links and self._is_interior(cur, peer):
            # Out and back in as a leaf: its children move, with their subtrees, to other parents.
            self._repair(left=[peer], joined=[NodeInfo(peer, 0.0, False)])

    def _check_progress(self, link: _Link) -> None:
        """Demote ``link``'s peer if it is a relay in the current plan and shows no sign of reading
        the current version: no ``have`` for it ``progress_timeout_s`` after its manifest was
        written (or while a write to it has been blocked that long)."""
        cur = self.cur
        peer = link.peer
        if cur is None or peer in self.demoted or self.links.get(peer) is not link or not self._is_interior(cur, peer):
            return
        if peer in cur.relay.peer_have:
            return
        now = trio.current_time()
        t = self.progress_timeout_s
        if now - max(self._started_at, link.connected_at) < t:
            return
        ver, at = link.manifest_sent
        if ver == cur.pub.version and now - at >= t:
            self._demote(peer, f"no have {now - at:.1f}s after its manifest")
        elif link.sending_since is not None and now - link.sending_since >= t:
            self._demote(peer, f"a send to it blocked for {now - link.sending_since:.1f}s")

    async def _watch(self, link: _Link) -> None:
        while True:
            await trio.sleep(self.progress_timeout_s / 4)
            self._check_progress(link)

    def _on_message(self, peer: str, payload: bytearray) -> None:
        super()._on_message(peer, payload)
        since = self.demoted.get(peer)
        pub = self.publisher.latest
        if since is not None and pub is not None and pub.version > since and peer in self._metrics_for(pub).holds:
            del self.demoted[peer]
            log.info("relay %s holds v%d again: eligible as a relay in the next plan", peer, pub.version)

    # --- actions -------------------------------------------------------------------------------
    def _act(self, cur: _Current, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                link = self.links.get(a.peer)
                if link is not None:
                    link.put(("chunk", cur.pub.version, a.index))
                else:
                    self._act(cur, cur.relay.on_send_failed(a.peer, a.index))
            elif isinstance(a, Request):  # the hub holds everything; never happens
                log.debug("hub relay asked to pull %s", a)

    # --- connections ---------------------------------------------------------------------------
    async def serve_connection(self, conn: DataConnection) -> None:
        link = _Link(conn)
        peer = link.peer
        self.links[peer] = link
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, link)
                try:
                    await duplex(self._sender(link), self._receive_loop(link))
                except (Echo2Error, OSError) as exc:
                    failed: BaseException | None = exc
                else:
                    failed = None
                nursery.cancel_scope.cancel()
            if failed is not None:
                raise failed
        finally:
            if self.links.get(peer) is link:
                del self.links[peer]
                cur = self.cur
                if cur is not None:
                    for ver, i in list(link.inflight):
                        if ver == cur.pub.version:
                            self._act(cur, cur.relay.on_send_failed(peer, i))
                    if peer in cur.plan.reachable or (cur.plan.parent and peer in cur.plan.parent[0]):
                        self._repair(left=[peer])
                self._changed()

    async def _receive_loop(self, link: _Link) -> None:
        while True:
            try:
                frame = await link.conn.receive()
            except ChunkMismatch:
                continue
            if frame.type is FrameType.BYE:
                return
            try:
                if frame.type is FrameType.REQUEST:
                    self._on_request(link, frame.payload)
                elif frame.type is FrameType.MESSAGE:
                    self._on_message(link.peer, frame.payload)
            except (SchemaError, DecodeError) as exc:
                log.warning("refused %s frame from %s: %s", frame.type.name, link.peer, exc)
            except Echo2Error as exc:
                log.warning("refused %s frame from %s: %s", frame.type.name, link.peer, exc)

    def _on_request(self, link: _Link, payload: bytearray) -> None:
        kind, d = decode_request(payload)
        peer = link.peer
        cur = self.cur
        now = trio.current_time()
        if kind == REQ_HELLO:
            self._on_hello(peer, d)
            if cur is not None:
                if peer in cur.plan.reachable or (cur.plan.parent and peer in cur.plan.parent[0]):
                    link.put(("msg", cur.pub.version, cur.plan_env))  # a reconnect: same place in the plan
                    link.put(("manifest", cur.pub.version, cur.pub.manifest_envelope))
                else:
                    info = self.info(peer)
                    node = NodeInfo(peer, info.upload_Bps if info else 0.0, bool(info and info.reachable))
                    self._repair(joined=[node], joiner=link)
        elif kind == REQ_STATS:
            self._on_stats(peer, d)
        elif cur is None:
            return
        elif kind == REQ_HAVE:
            h: ChunkHave = d["m"]
            if h.peer_id == peer and h.version == cur.pub.version:
                self._act(cur, cur.relay.on_have(peer, h.have, now=now))
        elif kind == REQ_GET:
            r: ChunkRequest = d["m"]
            if r.version == cur.pub.version:
                # A child pulls from the hub what its parent should have pushed: that parent
                # stalled (the child waited out its stall timer) or sent it a corrupt chunk.
                stalled = {
                    p for i in set(r.indices[:4096])
                    if 0 <= i < cur.relay.n and (p := cur.plan.parent[cur.plan.stripe_of(i)].get(peer)) not in (None, self.hub, peer)
                }
                for p in sorted(stalled):
                    self._demote(p, f"{peer} pulls its stripe from the hub")
                self._act(cur, cur.relay.on_request(peer, r.indices, now=now))
        elif kind == REQ_FULL:
            r = d["m"]
            if r.version == cur.pub.version:
                n = len(cur.pub.packed.encoded)
                for i in sorted(set(r.indices))[:4096]:
                    if 0 <= i < n:
                        link.put(("full", r.version, i))

    async def _sender(self, link: _Link) -> None:
        while True:
            item = await link.get()
            kind = item[0]
            if kind in ("msg", "manifest"):
                link.sending_since = trio.current_time()
                try:
                    await link.conn.send_message(item[2])
                finally:
                    link.sending_since = None
                if kind == "manifest":
                    link.manifest_sent = (item[1], trio.current_time())
                continue
            ver, i = item[1], item[2]
            cur = self.cur
            if cur is None or cur.pub.version != ver:
                continue
            pub = cur.pub
            if kind == "full":
                data = await trio.to_thread.run_sync(pub.full_encoding, i)
                flag = ENC_FULL
            else:
                data = pub.packed.encoded[i]
                flag = ENC_MANIFEST
            link.inflight.add((ver, i))
            link.sending_since = trio.current_time()
            try:
                await link.conn.send_chunk(pack_chunk_frame(ver, i, flag, data))
            finally:
                link.inflight.discard((ver, i))
                link.sending_since = None
            self.bytes_sent += len(data)
            cur.metrics.hub_sent_bytes += len(data)
            if kind == "chunk" and self.cur is cur:
                self._act(cur, cur.relay.on_child_ack(link.peer, i, now=trio.current_time()))


class StarWithHolds(_HubSide):
    """A :class:`StarSender` that also reads the node->hub half of the connection (hello, signed
    holds reports), so star broadcasts get the same per-version metrics."""

    def __init__(self, star: StarSender, *, node_info: Callable[[str], PeerInfo | None] | None = None) -> None:
        super().__init__(star.publisher, node_info)
        self.star = star
        self.connected: set[str] = set()

    @property
    def bytes_sent(self) -> int:
        return self.star.bytes_sent

    def notify(self) -> None:
        pub = self.publisher.latest
        if pub is not None:
            self._metrics_for(pub).nodes = len(self.connected)
        self.star.notify()

    async def serve_connection(self, conn: DataConnection) -> None:
        peer = conn.peer_id
        self.connected.add(peer)
        try:
            await duplex(self.star.serve_connection(conn), self._receive_and_answer(conn))
        finally:
            self.connected.discard(peer)
            self._changed()

    async def _receive_and_answer(self, conn: DataConnection) -> None:
        # Pulls are answered too: a node that got the next manifest before finishing the previous
        # version cannot decode the star's deltas against it and asks for those chunks in full
        # ('full'); one whose push stalled pulls ('get'). Unanswered, it would never hold a
        # version again. Answers go through a bounded queue (a flood is cut, never buffered).
        tx, rx = trio.open_memory_channel[tuple[int, int, bool]](STAR_MAX_PENDING_PULLS)
        failed: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._answer_pulls, conn, rx)
            try:
                await self._receive_loop(conn, tx)
            except (Echo2Error, OSError) as exc:
                failed = exc
            nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def _answer_pulls(self, conn: DataConnection, rx: trio.MemoryReceiveChannel[tuple[int, int, bool]]) -> None:
        async for ver, i, full in rx:
            pub = self.publisher.latest
            if pub is None or pub.version != ver or not 0 <= i < len(pub.packed.encoded):
                continue
            if full:
                data = await trio.to_thread.run_sync(pub.full_encoding, i)
                flag = ENC_FULL
            else:
                data = pub.packed.encoded[i]
                flag = ENC_MANIFEST
            await conn.send_chunk(pack_chunk_frame(ver, i, flag, data))
            self.star.bytes_sent += len(data)

    async def _receive_loop(self, conn: DataConnection, pulls: trio.MemorySendChannel[tuple[int, int, bool]]) -> None:
        while True:
            try:
                frame = await conn.receive()
            except ChunkMismatch:
                continue
            if frame.type is FrameType.BYE:
                return
            try:
                if frame.type is FrameType.REQUEST:
                    kind, d = decode_request(frame.payload)
                    if kind == REQ_HELLO:
                        self._on_hello(conn.peer_id, d)
                    elif kind == REQ_STATS:
                        self._on_stats(conn.peer_id, d)
                    elif kind in (REQ_GET, REQ_FULL):
                        r: ChunkRequest = d["m"]
                        pub = self.publisher.latest
                        if pub is not None and r.version == pub.version:
                            for i in sorted(set(r.indices))[:STAR_MAX_PENDING_PULLS]:
                                try:
                                    pulls.send_nowait((r.version, i, kind == REQ_FULL))
                                except trio.WouldBlock:
                                    break
                elif frame.type is FrameType.MESSAGE:
                    self._on_message(conn.peer_id, frame.payload)
            except Echo2Error as exc:
                log.warning("refused %s frame from %s: %s", frame.type.name, conn.peer_id, exc)


__all__ = ["PeerInfo", "PipelinedSender", "StarWithHolds", "VersionMetrics"]
