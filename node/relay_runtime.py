"""The node side of the pipelined broadcast: :class:`echo2.protocol.relay.Relay` over real sockets.
One :class:`RelayNode` per node process:

- a :class:`~echo2.protocol.net.dataplane.DataPlaneServer` that children and pulling peers dial;
- a connection to the hub (always: the hub sends the signed ``BroadcastPlan`` and ``Manifest`` on
  it, pushes the chunks of the stripes whose root this node is, and answers pulls);
- a connection to its parent in every stripe: **the child dials the parent** and the parent pushes
  that stripe's chunks back on the same connection as it verifies them. Why this direction: only
  the parent has to be reachable, and a child that lost its parent simply dials the new one named
  by the repaired plan. A NAT-bound parent (no address in the plan; the hub plans it so only with
  ``nat_relay``) dials its reachable children instead and pushes on that connection (a reverse
  connection, :meth:`WirePlan.dial_targets`); the child's gate admits it as a peer of the plan.

Every connection carries frames both ways. Chunk frames are :func:`echo2.protocol.wire.pack_chunk_frame`
payloads (version, index, encoding flag, bytes). Small requests are canonical maps in REQUEST
frames (see :func:`encode_request`): ``have`` (a ``ChunkHave``; sent on connect and whenever our
holdings grow, so a parent never pushes what we hold and children/peers know whom to pull from),
``get`` (a ``ChunkRequest``: pull), ``full`` (a ``ChunkRequest`` for the full encoding of delta
chunks whose parent chunk we lack; the hub answers it), ``hello`` (to the hub: our data-plane
address and upload limit, for the planner) and ``stats`` (to the hub: bytes we sent per version).
Signed envelopes travel in MESSAGE frames: the hub's plan and manifest, our ``HoldsVersion``.

Rules: a chunk is checked against the hub-signed manifest (encoded size and hash) before it is
forwarded or stored; it is decoded (raw hash checked) and written to the :class:`ChunkStore` in a
worker thread while the next chunk arrives, and forwarded to the children at once (cut-through).
A corrupt chunk produces a ``Report`` (``on_evidence``, sent to the hub) and its sender is avoided
from then on. A parent that dies or stalls is routed around: its stripes are pulled from peers
that advertised them, or from the hub. A complete version calls ``on_holds`` and a signed
``HoldsVersion`` goes to the hub on the data plane.

Link queues, sender, receive loops and action dispatch: the shared :class:`echo2.protocol.net.relaydriver.RelayDriver`
(the hub runs it too); chunks sent: :mod:`.relay_source`; punched links: :mod:`.punch`; bench entry
:mod:`.relay_main`. Tests and benches only: ``RelayConfig.corrupt_sends`` flips a byte of each chunk sent.
"""

from __future__ import annotations

import logging
import math
import shutil
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from echo2.protocol import envelope, packing
from echo2.protocol.backoff import Backoff
from echo2.protocol.dataframe import Frame, FrameType
from echo2.protocol.errors import ChunkMismatch, Echo2Error, ManifestError, SchemaError, SignerNotAllowed
from echo2.protocol.hashing import digest
from echo2.protocol.identity import Identity
from echo2.protocol.messages import BroadcastPlan, ChunkHave, ChunkRequest, HoldsVersion, Manifest
from echo2.protocol.net.connection import DataConnection, duplex
from echo2.protocol.net.dataplane import DataPlaneServer, connect
from echo2.protocol.net.ratelimit import UploadLimiter
from echo2.protocol.net.relaydriver import RelayDriver, RelayLink
from echo2.protocol.relay import Evidence, Relay, Request, bitmap_from_indices
from echo2.protocol.wire import (
    ENC_FULL,
    ENC_MANIFEST,
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

from . import punch
from .chunkstore import ChunkStore
from .relay_guard import PeerGate
from .relay_source import StoreSource
from .relay_state import (
    MAX_EVIDENCE,
    STORE_QUEUE,
    Broadcast,
    HeldInfo,
    OnEvidence,
    OnHolds,
    PunchEdge,
    RelayConfig,
    budget_refusal,
    is_news,
    plan_from_message,
    same_content,
    star_view,
)

log = logging.getLogger(__name__)


class RelayNode:
    """The broadcast side of one node (see the module doc). ``await run()`` serves until cancelled."""

    def __init__(
        self,
        identity: Identity,
        store: ChunkStore,
        hub_peer: str,
        hub_addr: str,
        cfg: RelayConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        on_holds: OnHolds | None = None,
        on_evidence: OnEvidence | None = None,
        on_same_version: Callable[[int], Awaitable[None] | None] | None = None,
    ) -> None:
        self.identity = identity
        self.me = identity.peer_id
        self.store = store
        self.hub_peer = hub_peer
        self.hub_addr = hub_addr
        self.cfg = cfg or RelayConfig()
        self.on_holds = on_holds
        self.on_evidence = on_evidence
        self.on_same_version = on_same_version
        #: a version this node cannot store (its disk cap or free disk): (version, why)
        self.on_refused: Callable[[int, str], None] | None = None
        self.limiter = UploadLimiter(self.cfg.upload_MBps) if self.cfg.upload_MBps > 0 else None
        self.server = DataPlaneServer(identity, self._serve, host=host, port=port, upload_limiter=self.limiter,
                                      reuse_port=self.cfg.punch)
        source = StoreSource(self)
        self.driver = RelayDriver(
            source, on_unlinked=self._on_unlinked, on_request=self._on_pull,
            on_report=self._on_report, on_sent=self._on_sent, ready_frame=source.ready,
        )
        self._dialing: dict[str, trio.Event] = {}
        self._punching: set[str] = set()
        self.punches: deque[punch.PunchOutcome] = deque(maxlen=256)  # the latest outcomes, for inspection
        self._pending: dict[str, dict[tuple[int, int], None]] = {}  # peer -> sends waiting for its link
        self.gate = PeerGate(self.me, hub_peer)
        self.bc: Broadcast | None = None
        self.held: HeldInfo | None = None
        self.evidence: deque[tuple[int, Evidence]] = deque(maxlen=MAX_EVIDENCE)
        self._store_tx, self._store_rx = trio.open_memory_channel[tuple[int, int, int, memoryview, str]](STORE_QUEUE)
        self._nursery: trio.Nursery | None = None
        self.holds_event = trio.Event()
        self.bytes_in = self.bytes_out = 0  # chunk bytes received and sent, all versions
        self.public_addr, self._hub_lport = "", 0  # node.portmap's mapped data port, said in the hello

    @property
    def data_addr(self) -> str:
        return self.server.addr

    @property
    def links(self) -> dict[str, RelayLink]:
        return self.driver.links

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.server.serve)
            nursery.start_soon(self._store_worker)
            nursery.start_soon(self._ticker)
            nursery.start_soon(self._hub_loop)
            task_status.started(self)

    def _spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    async def _hub_loop(self) -> None:
        backoff = Backoff(base_s=0.2, cap_s=5.0)
        while True:
            try:
                stream, lport = await self._hub_stream()
                conn = await connect(
                    self.hub_addr, self.identity, self.hub_peer,
                    timeout_s=self.cfg.connect_timeout_s, upload_limiter=self.limiter, stream=stream,
                )
                backoff.reset()
                async with conn:
                    self._hub_lport = lport
                    await conn.send_request(self._hello())
                    await self._link_main(conn)
                delay = backoff.failed()  # a link that ended is retried soon, then less often
            except (Echo2Error, OSError) as exc:
                delay = backoff.failed()
                log.warning("hub data link lost (%s); reconnecting in %.1fs", exc, delay)
            await trio.sleep(delay)

    def _hello(self) -> bytes:  # the hub believes a mapped address only once its dial-back reached it
        return encode_request(REQ_HELLO, addr=self.public_addr or self.data_addr,
                              up=float(self.cfg.announce_MBps or self.cfg.upload_MBps), lport=self._hub_lport)

    async def set_public_addr(self, addr: str) -> None:
        """A port mapping (node.portmap) came or went: tell the hub again (a second hello)."""
        if addr != self.public_addr:
            self.public_addr = addr
            await self._tell_hub(self._hello(), "hello", logging.INFO)

    async def _hub_stream(self) -> tuple[trio.SocketStream | None, int]:
        if not self.cfg.punch:
            return None, 0
        return await punch.hub_stream(self.server.host, self.server.port, self.hub_addr, self.cfg.connect_timeout_s)

    async def _punch(self, version: int, edge: PunchEdge) -> None:
        """Punch a hole to a NAT-bound plan peer (node.punch) and tell the hub how it went: on a
        failure it moves the child of that edge to another parent."""
        self._punching.add(edge.peer)
        try:
            assert self._nursery is not None
            res = await punch.punch_link(
                self.server, self.identity, edge, nursery=self._nursery, on_dialed=self._link_main_dialed,
                linked=lambda p: p in self.links, window_s=self.cfg.punch_window_s,
                handshake_timeout_s=self.cfg.connect_timeout_s, upload_limiter=self.limiter,
            )
        finally:
            self._punching.discard(edge.peer)
        self.punches.append(res)
        await self._tell_hub(encode_request(REQ_PUNCH, v=version, peer=edge.peer, ok=res.ok, s=res.seconds), "punch report")

    async def _tell_hub(self, request: bytes, what: str, level: int = logging.DEBUG) -> bool:
        """Send one request frame to the hub on its data link; False when there is no link."""
        hub = self.links.get(self.hub_peer)
        if hub is None:
            return False
        try:
            await hub.conn.send_request(request)
        except Echo2Error as exc:
            log.log(level, "%s to the hub failed: %s", what, exc)
        return True

    async def _serve(self, conn: DataConnection) -> None:
        if not await self.gate.admit(conn.peer_id):
            # raised, not returned: the server then aborts the connection (RST) instead of a clean
            # close that drains what the stranger sends for up to 2 s (bench attack A4: 384 MiB)
            raise SignerNotAllowed(f"data-plane peer {conn.peer_id} is in no current plan")
        await self._link_main(conn)

    async def _link_main(self, conn: DataConnection, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        link = self.driver.link_up(conn)
        self._limit_frames(link)
        for ver, i in self._pending.pop(link.peer, {}):
            link.put(("chunk", ver, i))
        task_status.started(link)
        try:
            await self._send_have(link)
            if link.peer == self.hub_peer and self.held is not None:
                await self._report_holds(self.held)
            await duplex(self.driver.sender(link), self._receive_loop(link))
        finally:
            self._link_gone(link)

    def _limit_frames(self, link: RelayLink) -> None:
        m = self.bc.manifest if self.bc is not None else self.held.manifest if self.held is not None else None
        chunk, n = (m.chunk_size, len(m.chunks)) if m is not None else (None, None)
        link.conn.max_sizes.update(self.gate.frame_limits(link.peer, chunk, n))

    def _link_gone(self, link: RelayLink) -> None:
        self.driver.link_down(link)
        b = self.bc
        if link.peer in self.links:
            return
        self.gate.forget(link.peer)
        if b is None:
            return
        b.relay.peer_have.pop(link.peer, None)  # it can no longer serve what it advertised
        if link.peer in b.relay.parents:
            # A dead parent: pull its stripes at the next tick instead of waiting for the stall timer.
            for s, p in enumerate(b.relay.parents):
                if p == link.peer:
                    b.relay.last_progress[s] = -math.inf
            log.info("parent %s is gone; pulling its stripes elsewhere", link.peer)

    # --- the driver's hooks --------------------------------------------------------------------
    def _on_unlinked(self, peer: str, version: int, index: int) -> None:
        # A child that has not dialed us yet: its sends wait for its link (deduplicated; only
        # the current version's are kept when a version starts).
        self._pending.setdefault(peer, {})[(version, index)] = None

    def _on_pull(self, version: int, a: Request) -> None:
        self._spawn(self._request, version, a.peer, a.indices, REQ_GET)

    def _on_report(self, version: int, ev: Evidence) -> None:
        self.evidence.append((version, ev))
        log.warning("evidence: chunk %d of v%d from %s is corrupt", ev.index, version, ev.peer)
        if self.on_evidence is not None:
            res = self.on_evidence(version, ev)
            if res is not None:
                self._spawn(_await, res)

    def _on_sent(self, version: int, n: int) -> None:
        self.bytes_out += n  # every version, for the node's transfer caps
        b = self.bc
        if b is not None and b.version == version:
            b.bytes_sent += n

    def _act(self, b: Broadcast, actions: list[Any]) -> None:
        if self.bc is b:
            self.driver.act(actions)

    # --- receiving -----------------------------------------------------------------------------
    async def _receive_loop(self, link: RelayLink) -> None:
        await self.driver.receive_loop(link, self._on_frame)

    async def _on_frame(self, link: RelayLink, frame: Frame) -> None:
        if frame.type is FrameType.CHUNK:
            await self._on_chunk(link.peer, frame.payload, frame.key)
        elif frame.type is FrameType.REQUEST:
            self._on_request(link, frame.payload)
        elif frame.type is FrameType.MESSAGE and link.peer == self.hub_peer:
            await self._on_hub_message(frame.payload)

    async def _on_hub_message(self, payload: bytearray) -> None:
        v = envelope.open_envelope(
            bytes(payload), (Manifest, BroadcastPlan), replay=None,
            allowed=lambda signer, _t: signer == self.hub_peer,
        )
        msg = v.message
        if isinstance(msg, BroadcastPlan):
            plan = plan_from_message(msg, self.hub_peer)
            self.gate.add_plan(msg.version, plan)
            b = self.bc
            if b is not None and b.version == msg.version:
                b.plan = plan
                self._act(b, b.relay.on_plan(plan, now=trio.current_time()))
                self._dial_parents(b)
        elif isinstance(msg, Manifest):
            await self._on_manifest(msg, v.raw)

    async def _on_manifest(self, m: Manifest, raw: bytes) -> None:
        held = self.held
        if held is not None and same_content(m, held.manifest):
            # The hub (re)sent the very version we hold: a hub resumed from a checkpoint that
            # retrained the same results re-publishes it identically. It may not know we hold
            # it (it restarted): say so, or it would never give us work.
            await self._report_holds(held)
            if self.on_same_version is not None:
                res = self.on_same_version(held.version)
                if res is not None:
                    await res
            return
        for known in (self.bc.manifest if self.bc is not None else None, held.manifest if held is not None else None):
            if not is_news(m, known):
                if known is not None and not same_content(m, known):
                    log.warning("manifest v%d refused: signed before that of v%d (a replay)", m.version, known.version)
                return
        packing.verify_manifest_consistency(m)
        missing = set(await trio.to_thread.run_sync(self.store.missing, m))
        free = (await trio.to_thread.run_sync(shutil.disk_usage, self.store.root)).free
        missing_bytes = sum(m.chunks[i].raw_size for i in missing)
        stored = 0
        if self.cfg.max_disk_bytes:
            # a disk cap: versions beyond the one held go first (they are only kept for deltas)
            if await trio.to_thread.run_sync(self.store.stored_bytes) + missing_bytes > self.cfg.max_disk_bytes:
                held_v = [self.held.version] if self.held is not None else []
                await trio.to_thread.run_sync(lambda: self.store.gc(protect=held_v, keep=1))
            stored = await trio.to_thread.run_sync(self.store.stored_bytes)
        refusal = budget_refusal(m, self.cfg, missing_bytes=missing_bytes, free_disk=free, stored_bytes=stored)
        if refusal is not None:
            log.warning("manifest v%d refused: %s", m.version, refusal)
            if self.on_refused is not None:
                self.on_refused(m.version, refusal)
            return
        await trio.to_thread.run_sync(self.store.save_version, m, raw)
        have = [c.index for c in m.chunks if c.index not in missing]
        plan = self.gate.plans.get(m.version) or star_view(self.me, self.hub_peer)
        now = trio.current_time()
        relay = Relay(
            self.me, plan, [c.enc_hash for c in m.chunks], have=have, now=now,
            stall_timeout_s=self.cfg.stall_timeout_s, request_timeout_s=self.cfg.request_timeout_s,
            window=self.cfg.window,
        )
        b = Broadcast(m, raw, plan, relay, now)
        self.bc = b
        self.driver.start(m.version, relay)
        log.info("version %d: %d chunks, %d already held", m.version, len(m.chunks), len(have))
        for peer, h in self.gate.take_haves(m.version):
            relay.on_have(peer, h.have, now=now)
        for link in self.links.values():
            self._limit_frames(link)
        self._pending = {p: {it: None for it in items if it[0] >= m.version} for p, items in self._pending.items()}
        self._act(b, relay.start(now=now))
        self._dial_parents(b)
        await self._replay_early(b)
        await self._send_have_all()
        if not missing:
            await self._complete(b)

    async def _replay_early(self, b: Broadcast) -> None:
        for peer, payload in self.gate.take_chunks(b.version):
            if self.bc is not b:
                return
            try:
                await self._on_chunk(peer, payload)
            except Echo2Error as exc:
                log.warning("refused early chunk from %s: %s", peer, exc)

    def _dial_parents(self, b: Broadcast) -> None:
        # our reachable parents, and (when we are NAT-bound: no address of ours in the plan) our
        # reachable children, whom we push to over the connection we open (WirePlan.dial_targets)
        for p in b.plan.dial_targets(self.me) | {p for p in b.relay.parents if p in b.plan.data_addrs}:
            if p not in (self.me, self.hub_peer) and p not in self.links:
                self._spawn(self._ensure_link, p)
        if self.cfg.punch:  # NAT-bound peers of ours, when we are NAT-bound too (WirePlan.punch_targets)
            for peer, edge in b.plan.punch_targets(self.me).items():
                if peer not in self.links and peer not in self._punching:
                    self._spawn(self._punch, b.version, edge)

    async def _on_chunk(self, peer: str, payload: bytes | bytearray, key: bytes | None = None) -> None:
        # key: the frame's blake3 (checked on receipt): forwarded as it came, no copy or hash per child
        cf = unpack_chunk_frame(payload)
        self.bytes_in += len(payload)
        b = self.bc
        if b is None or cf.version > b.version:
            if self.held is None or cf.version > self.held.version:
                self.gate.buffer_chunk(peer, cf.version, bytes(payload))
            return
        if cf.version != b.version:
            return
        i = cf.index
        if not 0 <= i < len(b.manifest.chunks):
            raise SchemaError(f"chunk index {i} outside version {b.version}")
        b.bytes_received += len(cf.data)
        entry = b.manifest.chunks[i]
        now = trio.current_time()
        if cf.encoding == ENC_MANIFEST:
            if i in b.encoded:
                return
            try:
                packing.verify_encoded(entry, cf.data)
            except ChunkMismatch:
                self._act(b, b.relay.on_chunk_corrupt(i, peer, digest(cf.data), now=now))
                return
            data = cf.data
            b.encoded[i] = data
            if key is not None and isinstance(payload, bytearray):  # cf.data is a view into it
                b.frames[i] = (payload, key)
            self._act(b, b.relay.on_chunk_verified(i, now=now))  # forward before decoding: cut-through
            await self._store_tx.send((b.version, i, ENC_MANIFEST, data, peer))
        else:
            if (i in b.relay.have and i not in b.need_full) or i in b.full_queued:
                return  # one full encoding of a chunk at a time waits to be decoded
            b.full_queued.add(i)
            await self._store_tx.send((b.version, i, ENC_FULL, cf.data, peer))

    def _on_request(self, link: RelayLink, payload: bytearray) -> None:
        kind, d = decode_request(payload)
        b = self.bc
        if kind == REQ_HAVE:
            h: ChunkHave = d["m"]
            if not self.driver.on_have(link.peer, h) and (b is None or h.version > b.version):
                self.gate.keep_have(link.peer, h)
        elif kind == REQ_GET:
            self.driver.on_get(link.peer, d["m"])
        # hello/stats/full are for the hub; a node ignores them

    # --- storing -------------------------------------------------------------------------------
    async def _store_worker(self) -> None:
        async for version, i, flag, data, peer in self._store_rx:
            b = self.bc
            if b is None or b.version != version or b.done:
                continue
            try:
                outcome = await trio.to_thread.run_sync(self.store.decode_and_put, b.manifest, i, flag, data)
            except (ChunkMismatch, ManifestError) as exc:
                log.warning("chunk %d of version %d does not decode (%s); asking the hub for it in full", i, version, exc)
                if flag == ENC_FULL:
                    self._act(b, b.relay.on_chunk_corrupt(i, peer, digest(data)))
                outcome = "need_full"
            if flag == ENC_FULL:
                b.full_queued.discard(i)
            if self.bc is not b:
                continue
            if outcome == "need_full":
                b.need_full.add(i)
                b.full_asked_at = -math.inf  # ask at the next tick
                continue
            b.need_full.discard(i)
            if flag == ENC_FULL and i not in b.relay.have:
                self._act(b, b.relay.on_chunk_verified(i, now=trio.current_time()))
            if not b.done and len(b.relay.have) == len(b.manifest.chunks) and not b.need_full:
                if not await trio.to_thread.run_sync(self.store.missing, b.manifest):
                    await self._complete(b)

    async def _complete(self, b: Broadcast) -> None:
        b.done = True
        held = HeldInfo(b.version, b.manifest, trio.current_time() - b.t0)
        self.held = held
        log.info("holds version %d verified (%.2fs)", b.version, held.seconds)
        await self._report_holds(held)
        self.holds_event.set()
        self.holds_event = trio.Event()
        if self.on_holds is not None:
            res = self.on_holds(held)
            if res is not None:
                await res

    async def _report_holds(self, held: HeldInfo) -> None:
        link = self.links.get(self.hub_peer)
        if link is None:
            return
        msg = HoldsVersion(peer_id=self.me, version=held.version, seconds=max(0.0, held.seconds))
        try:
            await link.conn.send_message(envelope.seal(self.identity, msg, ttl_s=600))
        except Echo2Error as exc:
            log.debug("holds report to the hub failed: %s", exc)

    # --- pulling and announcing ----------------------------------------------------------------
    async def _ensure_link(self, peer: str) -> RelayLink | None:
        if peer in self.links:
            return self.links[peer]
        if peer == self.hub_peer:
            return None  # the hub link is kept by _hub_loop
        ev = self._dialing.get(peer)
        if ev is not None:
            await ev.wait()
            return self.links.get(peer)
        b = self.bc
        addr = b.plan.data_addrs.get(peer) if b is not None else None
        if not addr:
            return None
        ev = self._dialing[peer] = trio.Event()
        try:
            conn = await connect(addr, self.identity, peer, timeout_s=self.cfg.connect_timeout_s, upload_limiter=self.limiter)
            assert self._nursery is not None
            link: RelayLink = await self._nursery.start(self._link_main_dialed, conn)
            return link
        except (Echo2Error, OSError) as exc:
            log.info("cannot reach peer %s at %s: %s", peer, addr, exc)
            return None
        finally:
            del self._dialing[peer]
            ev.set()

    async def _link_main_dialed(self, conn: DataConnection, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._link_main(conn, task_status=task_status)
        except (Echo2Error, OSError) as exc:
            log.info("link to %s ended: %s", conn.peer_id, exc)
        finally:
            if conn.usable:
                await conn.aclose()
            else:
                await conn.abort()

    async def _request(self, version: int, peer: str, indices: tuple[int, ...], kind: str) -> None:
        link = await self._ensure_link(peer)
        if link is None:
            return  # the relay's request timer moves the chunks to another source
        try:
            await link.conn.send_request(encode_request(kind, m=ChunkRequest(version=version, indices=list(indices)).to_wire()))
        except Echo2Error as exc:
            log.info("request to %s failed: %s", peer, exc)

    async def _send_have(self, link: RelayLink) -> None:
        b = self.bc
        if b is None:
            return
        bitmap = bitmap_from_indices(b.relay.have, len(b.manifest.chunks))
        msg = ChunkHave(peer_id=self.me, version=b.version, have=bitmap)
        try:
            await link.conn.send_request(encode_request(REQ_HAVE, m=msg.to_wire()))
        except Echo2Error as exc:
            log.debug("have to %s failed: %s", link.peer, exc)

    async def _send_have_all(self) -> None:
        b = self.bc
        if b is None:
            return
        b.have_sent, b.have_at = len(b.relay.have), trio.current_time()
        for link in list(self.links.values()):
            self._spawn(self._send_have, link)

    async def _ticker(self) -> None:
        last_stats = 0.0
        while True:
            await trio.sleep(self.cfg.tick_s)
            b = self.bc
            if b is None:
                continue
            now = trio.current_time()
            self._act(b, b.relay.on_tick(now))  # stall pulls while chunks are missing; held children
            if len(b.relay.have) != b.have_sent and (now - b.have_at >= self.cfg.have_interval_s or b.relay.complete_sent):
                await self._send_have_all()
            if b.need_full and now - b.full_asked_at > self.cfg.request_timeout_s:
                b.full_asked_at = now
                self._spawn(self._request_full, b.version, tuple(sorted(b.need_full)))
            if b.bytes_sent != b.stats_sent and now - last_stats > 0.5:
                sent = b.bytes_sent
                if await self._tell_hub(encode_request(REQ_STATS, v=b.version, sent=sent, recv=b.bytes_received), "stats"):
                    b.stats_sent, last_stats = sent, now

    async def _request_full(self, version: int, indices: tuple[int, ...]) -> None:
        m = ChunkRequest(version=version, indices=list(indices)).to_wire()
        await self._tell_hub(encode_request(REQ_FULL, m=m), "full request", logging.INFO)


async def _await(x: Awaitable[None]) -> None:
    await x


__all__ = ["HeldInfo", "RelayConfig", "RelayNode", "decode_request", "encode_request"]
