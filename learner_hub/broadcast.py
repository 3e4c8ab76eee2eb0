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
  read the hub link), or a send to which has been blocked that long: what the hub saw itself,
  never another node's word (a child's pull from the hub is not held against its parent, A9). Its
  children would otherwise wait out their stall timer on every version. It is promoted again once
  it reports holding a version published after its demotion;
- distrusts a relay (a leaf for good) only on evidence: an accused relay is asked to serve the
  hub a chunk, and distrusted if that chunk is corrupt (:mod:`.relay_challenge`), and then
  ``on_convicted`` (the fleet bans it);
- keeps each connection's send queue bounded: items of superseded versions are dropped when a new
  version starts, so a peer that stops reading costs the hub neither memory nor other links' time
  (every link has its own sender task; nothing else awaits a send);
- records per version: seconds from publication to the first / median / last node holding it
  verified (from the nodes' signed ``HoldsVersion``), bytes sent by the hub, bytes sent by peers
  (their ``stats`` reports; informative, not verified).

:class:`StarWithHolds` wraps a StarSender with the same hello/holds bookkeeping (in
:mod:`.broadcast_book`), so the bench measures both modes the same way. Links, send queues, the
sender and receive loops and the relay's action dispatch are the shared
:class:`echo2.protocol.net.relaydriver.RelayDriver` (nodes run the same one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from echo2.protocol import envelope
from echo2.protocol.dataframe import Frame, FrameType
from echo2.protocol.errors import Echo2Error
from echo2.protocol.identity import Identity
from echo2.protocol.messages import BroadcastPlan, ChunkHave, ChunkRequest
from echo2.protocol.net.connection import DataConnection, duplex
from echo2.protocol.net.relaydriver import RelayDriver, RelayLink
from echo2.protocol.relay import Relay
from echo2.protocol.wire import (
    REQ_FULL,
    REQ_GET,
    REQ_HAVE,
    REQ_HELLO,
    REQ_PUNCH,
    REQ_STATS,
    decode_request,
    encode_request,
    unpack_chunk_frame,
)

from .broadcast_book import UNLIMITED_BPS, HubSide, PeerInfo, PublishedSource, VersionMetrics
from .links import announced_port, punch_addr
from .planner import NodeInfo, Plan, plan_broadcast, replan, unpunch
from .publisher import PolicyPublisher, Published, StarSender
from .relay_challenge import Challenges, intact

log = logging.getLogger(__name__)

STAR_MAX_PENDING_PULLS = 4096


@dataclass
class _Current:
    pub: Published
    plan: Plan
    relay: Relay
    plan_env: bytes
    metrics: VersionMetrics


class PipelinedSender(HubSide):
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
        nat_relay: bool = False,
        nat_punch: bool = False,
        window: int = 2,
        plan_ttl_s: float = 24 * 3600.0,
        progress_timeout_s: float = 1.0,
    ) -> None:
        super().__init__(publisher, node_info)
        self.identity = identity
        self.hub = identity.peer_id
        # the chunk size of each version follows the fleet it is planned over (protocol.chunking)
        publisher.fleet_size = lambda: len(self.links)
        self.hub_upload_Bps = hub_upload_MBps * 1e6 if hub_upload_MBps > 0 else UNLIMITED_BPS
        self.data_addr = data_addr
        self.stripes = stripes
        self.nat_relay = nat_relay  # NAT-bound nodes relay to reachable children (planner)
        # NAT-bound nodes relay to NAT-bound children too, over holes both ends punch (node.punch)
        self.nat_punch = nat_punch
        self.no_punch: set[frozenset[str]] = set()  # pairs whose punch failed: never planned again
        self.window = window
        self.plan_ttl_s = plan_ttl_s
        self.progress_timeout_s = progress_timeout_s
        self.driver = RelayDriver(PublishedSource(publisher), on_sent=self._on_sent)
        self.cur: _Current | None = None
        # peer -> the version current when it was demoted; a leaf in every plan until it reports
        # holding a later one
        self.demoted: dict[str, int] = {}
        # peers reported relaying corrupt chunks: leaves in every plan, for good
        self.distrusted: set[str] = set()
        self.challenges = Challenges()
        # version -> (node, stripe) -> every parent a plan (or repair) of it gave the node
        self._parents: dict[int, dict[tuple[str, int], set[str]]] = {}
        self._stripes: dict[int, int] = {}
        self._started_at = 0.0  # trio clock when the current version's broadcast began

    @property
    def links(self) -> dict[str, RelayLink]:
        return self.driver.links

    @property
    def bytes_sent(self) -> int:
        return self.driver.bytes_sent

    def _on_sent(self, version: int, n: int) -> None:
        cur = self.cur
        if cur is not None and cur.pub.version == version:
            cur.metrics.hub_sent_bytes += n

    # --- planning ------------------------------------------------------------------------------
    def _node_infos(self) -> list[NodeInfo]:
        out = []
        for peer in sorted(self.links):
            info = self.info(peer)
            if info is None or peer in self.demoted or peer in self.distrusted:
                out.append(NodeInfo(peer, 0.0, False))  # unknown or untrusted: a leaf everywhere
            else:
                reach = info.reachable and bool(info.data_addr)
                out.append(NodeInfo(peer, info.upload_Bps, reach, punchable=not reach and bool(self.punch_addr_of(peer))))
        return out

    def punch_addr_of(self, peer: str) -> str:
        """The public ip:port a hole can be punched to at ``peer`` (links.punch_addr), or ""."""
        link, hello = self.links.get(peer), self.hello.get(peer)
        if not self.nat_punch or link is None or hello is None:
            return ""
        return punch_addr(link.conn.remote_ip(), link.conn.remote_port(), self.lport.get(peer, 0),
                          announced_port(hello.data_addr))

    def _plan_message(self, plan: Plan) -> bytes:
        nodes = plan.nodes
        # Only reachable nodes get an address: an edge whose parent has one is dialled by the
        # child, one whose parent has none by the parent (a reverse connection to a reachable
        # child), so a NAT-bound node's unreachable address is never given out (node.relay_state).
        addrs = {n: a.data_addr for n in nodes if (a := self.info(n)) is not None and a.data_addr and a.reachable}
        if self.data_addr:
            addrs[self.hub] = self.data_addr
        # the two ends of every NAT<->NAT edge: where the other end punches to (node.punch)
        ends = {n for _s, p, c in plan.punch_edges() for n in (p, c)}
        punch = {n: pa for n in sorted(ends) if (pa := self.punch_addr_of(n))}
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
            punch_addrs=punch,
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
        self.no_punch = {pair for pair in self.no_punch if pair <= self.links.keys()}  # bounded by the fleet
        plan = plan_broadcast(
            pub.version, self.hub_upload_Bps, self._node_infos(), len(m.chunks), hub=self.hub, stripes=self.stripes,
            nat_relay=self.nat_relay, nat_punch=self.nat_punch, no_punch=self.no_punch,
        )
        relay = Relay(self.hub, plan, [c.enc_hash for c in m.chunks], have=range(len(m.chunks)),
                      now=trio.current_time(), window=self.window)
        metrics = self._metrics_for(pub)
        metrics.nodes = len(plan.nodes)
        metrics.punch_planned |= {frozenset((p, c)) for _s, p, c in plan.punch_edges()}
        self.cur = _Current(pub, plan, relay, self._plan_message(plan), metrics)
        self._remember(plan)
        self._started_at = trio.current_time()
        log.info("broadcast v%d: %d nodes, %d stripes, depth %d", pub.version, len(plan.nodes), plan.stripes, plan.max_depth())
        self.driver.start(pub.version, relay)
        for link in self.links.values():
            link.put(("msg", pub.version, self.cur.plan_env))
            link.put(("manifest", pub.version, pub.manifest_envelope))
        self.driver.act(relay.start(now=trio.current_time()))

    def _on_punch(self, peer: str, d: dict[str, object]) -> None:
        """A node's word on a punch to ``d["peer"]`` (node.punch): counted if that pair is an
        edge of the current plan; a failure moves the edge's child to another parent (planner
        ``unpunch``: a reachable relay or the hub, never a relay for bulk data) and the pair is
        not planned again. A node can only move its own edges this way."""
        cur = self.cur
        other = d["peer"]
        if cur is None or d["v"] != cur.pub.version or not isinstance(other, str):
            return
        pair = frozenset((peer, other))
        if not any(frozenset((p, c)) == pair for _s, p, c in cur.plan.punch_edges()):
            return
        m = cur.metrics
        if d["ok"]:
            m.punched.add(pair)
            return
        m.punch_failed.add(pair)
        self.no_punch.add(pair)
        plan, moved = unpunch(cur.plan, peer, other)
        log.warning("broadcast v%d: punch %s <-> %s failed; %d edge(s) fall back to other parents",
                    cur.pub.version, peer, other, moved)
        self._install(plan)

    def _repair(self, left: Sequence[str] = (), joined: Sequence[NodeInfo] = (), *, joiner: RelayLink | None = None) -> None:
        cur = self.cur
        if cur is None:
            return
        log.info("broadcast v%d repaired: -%s +%s", cur.pub.version, list(left), [j.node_id for j in joined])
        self._install(replan(cur.plan, left=left, joined=joined), joiner=joiner)

    def _install(self, plan: Plan, *, joiner: RelayLink | None = None) -> None:
        """A repaired plan of the current version: signed, sent to every node, followed here."""
        cur = self.cur
        assert cur is not None
        cur.plan = plan
        self._remember(cur.plan)
        cur.plan_env = self._plan_message(cur.plan)
        cur.metrics.replans += 1
        for link in self.links.values():
            link.put(("msg", cur.pub.version, cur.plan_env))
        if joiner is not None:
            # The manifest must reach the joiner before the chunks the repair pushes to it: a node
            # drops chunks of a version it has no manifest for.
            joiner.put(("manifest", cur.pub.version, cur.pub.manifest_envelope))
        self.driver.act(cur.relay.on_plan(cur.plan, now=trio.current_time()))

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

    @property
    def suspects(self) -> dict[str, tuple[str, int | None]]:
        return self.challenges.suspects

    def accuse(self, peer: str, why: str, index: int | None = None) -> None:
        """An accusation (a node's relay report, or one restored after a restart): ``peer`` is
        asked to serve the hub a chunk and distrusted only if that chunk is corrupt (A9)."""
        if peer in self.distrusted or not self.challenges.accuse(peer, why, index):
            return
        log.warning("relay %s accused (%s): asked to serve the hub a chunk; distrusted only if it is corrupt", peer, why)
        self._challenge(peer)

    def _challenge(self, peer: str) -> None:
        cur, link = self.cur, self.links.get(peer)
        if cur is None or link is None:
            return  # asked once it is connected during a broadcast (_watch, or its next have)
        ch = self.challenges.next(peer, cur.pub.version, cur.relay.peer_have.get(peer, set()), trio.current_time())
        if ch is not None:
            req = ChunkRequest(version=ch.version, indices=[ch.index])
            link.put(("req", ch.version, encode_request(REQ_GET, m=req.to_wire())))

    async def _on_chunk(self, peer: str, payload: bytearray) -> None:
        """A chunk frame from a node: the answer to a challenge, or ignored (nothing else is asked)."""
        cf = unpack_chunk_frame(payload)
        ch = self.challenges.answer(peer, cf.version, cf.index)
        pub = self.publisher.recent.get(cf.version)
        if ch is None or pub is None:
            return
        m = pub.packed.manifest
        data = bytes(cf.data)
        ok = await trio.to_thread.run_sync(
            lambda: intact(m.chunks[ch.index], cf.encoding, data, bf16_split=m.bf16_split)
        )
        why, _ = self.challenges.suspects.get(peer, ("", None))
        self.challenges.clear(peer)
        if ok:
            log.info("relay %s served chunk %d of v%d intact: accusation (%s) not substantiated", peer, ch.index, ch.version, why)
        else:
            why = f"served the hub a corrupt chunk {ch.index} of v{ch.version}; accused: {why}"
            self._distrust_now(peer, why)
            self.on_convicted(peer, why)

    def _distrust_now(self, peer: str, why: str) -> None:
        if peer in self.distrusted:
            return
        self.distrusted.add(peer)
        cur = self.cur
        log.warning("relay %s distrusted (%s): a leaf in every plan from now on", peer, why)
        if cur is not None and peer in self.links and self._is_interior(cur, peer):
            # Out and back in as a leaf: its children move, with their subtrees, to other parents.
            self._repair(left=[peer], joined=[NodeInfo(peer, 0.0, False)])

    def _is_current(self, link: RelayLink) -> bool:
        return self.links.get(link.peer) is link

    def _check_progress(self, link: RelayLink) -> None:
        """Demote ``link``'s peer if it is a relay in the current plan and shows no sign of reading
        the current version: no ``have`` for it ``progress_timeout_s`` after its manifest was
        written (or while a write to it has been blocked that long)."""
        cur = self.cur
        peer = link.peer
        if cur is None or peer in self.demoted or not self._is_current(link) or not self._is_interior(cur, peer):
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

    async def _watch(self, link: RelayLink) -> None:
        while True:
            await trio.sleep(self.progress_timeout_s / 4)
            cur = self.cur
            if cur is not None:  # a child held for a sibling that stalled since goes on
                self.driver.act(cur.relay.on_tick(trio.current_time()))
            self._check_progress(link)
            if link.peer in self.challenges.suspects:
                self._challenge(link.peer)

    def _on_message(self, peer: str, payload: bytearray) -> None:
        super()._on_message(peer, payload)
        since = self.demoted.get(peer)
        pub = self.publisher.latest
        if since is not None and pub is not None and pub.version > since and peer in self._metrics_for(pub).holds:
            del self.demoted[peer]
            log.info("relay %s holds v%d again: eligible as a relay in the next plan", peer, pub.version)

    # --- connections ---------------------------------------------------------------------------
    async def serve_connection(self, conn: DataConnection) -> None:
        link = self.driver.link_up(conn)
        peer = link.peer
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, link)
                try:
                    await self.driver.run_link(link, self._on_frame)
                except (Echo2Error, OSError) as exc:
                    failed: BaseException | None = exc
                else:
                    failed = None
                nursery.cancel_scope.cancel()
            if failed is not None:
                raise failed
        finally:
            if self.driver.link_down(link):
                cur = self.cur
                if cur is not None and (peer in cur.plan.reachable or (cur.plan.parent and peer in cur.plan.parent[0])):
                    self._repair(left=[peer])
                self._changed()

    async def _on_frame(self, link: RelayLink, frame: Frame) -> None:
        if frame.type is FrameType.REQUEST:
            self._on_request(link, frame.payload)
        elif frame.type is FrameType.MESSAGE:
            self._on_message(link.peer, frame.payload)
        elif frame.type is FrameType.CHUNK:
            await self._on_chunk(link.peer, frame.payload)

    def _on_request(self, link: RelayLink, payload: bytearray) -> None:
        kind, d = decode_request(payload)
        peer = link.peer
        cur = self.cur
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
            self.driver.on_have(peer, h)
            if peer in self.challenges.suspects:
                self._challenge(peer)
        elif kind == REQ_GET:
            r: ChunkRequest = d["m"]
            # Answered, and never held against the pulling node's parent: a child's pull is its
            # word, not evidence (A9); a relay that stops reading is caught by _check_progress.
            self.driver.on_get(peer, r)
        elif kind == REQ_PUNCH:
            self._on_punch(peer, d)
        elif kind == REQ_FULL:
            r = d["m"]
            if r.version == cur.pub.version:
                n = len(cur.pub.packed.encoded)
                for i in sorted(set(r.indices))[:4096]:
                    if 0 <= i < n:
                        link.put(("full", r.version, i))


class StarWithHolds(HubSide):
    """A :class:`StarSender` that also reads the node->hub half of the connection (hello, signed
    holds reports), so star broadcasts get the same per-version metrics.

    Pulls are answered too: a node that got the next manifest before finishing the previous
    version cannot decode the star's deltas against it and asks for those chunks in full
    ('full'); one whose push stalled pulls ('get'). Unanswered, it would never hold a version
    again. Answers go through the shared driver's link queue (deduplicated and bounded: a flood
    is cut, never buffered) and sender; there are no relay rules, every chunk is the hub's."""

    def __init__(self, star: StarSender, *, node_info: Callable[[str], PeerInfo | None] | None = None) -> None:
        super().__init__(star.publisher, node_info)
        self.star = star
        self.connected: set[str] = set()
        self.driver = RelayDriver(
            PublishedSource(star.publisher), on_sent=self._on_sent, max_queue=STAR_MAX_PENDING_PULLS
        )

    @property
    def bytes_sent(self) -> int:
        return self.star.bytes_sent

    def _on_sent(self, version: int, n: int) -> None:
        self.star.bytes_sent += n

    def notify(self) -> None:
        pub = self.publisher.latest
        if pub is not None:
            self._metrics_for(pub).nodes = len(self.connected)
            self.driver.start(pub.version, None)
        self.star.notify()

    async def serve_connection(self, conn: DataConnection) -> None:
        peer = conn.peer_id
        self.connected.add(peer)
        link = self.driver.link_up(conn)
        try:
            await duplex(self.star.serve_connection(conn), self.driver.run_link(link, self._on_frame))
        finally:
            self.driver.link_down(link)
            self.connected.discard(peer)
            self._changed()

    async def _on_frame(self, link: RelayLink, frame: Frame) -> None:
        peer = link.peer
        if frame.type is FrameType.MESSAGE:
            self._on_message(peer, frame.payload)
            return
        if frame.type is not FrameType.REQUEST:
            return
        kind, d = decode_request(frame.payload)
        if kind == REQ_HELLO:
            self._on_hello(peer, d)
        elif kind == REQ_STATS:
            self._on_stats(peer, d)
        elif kind in (REQ_GET, REQ_FULL):
            r: ChunkRequest = d["m"]
            pub = self.publisher.latest
            if pub is None or r.version != pub.version:
                return
            if self.driver.version != pub.version:
                self.driver.start(pub.version, None)
            item = "full" if kind == REQ_FULL else "chunk"
            for i in sorted(set(r.indices))[:STAR_MAX_PENDING_PULLS]:
                if 0 <= i < len(pub.packed.encoded) and not link.put((item, r.version, i)):
                    if len(link.queue) >= link.max_queue:
                        break

__all__ = ["PeerInfo", "PipelinedSender", "StarWithHolds", "UNLIMITED_BPS", "VersionMetrics"]
