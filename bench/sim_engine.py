"""The one discrete-event engine behind both broadcast simulators (issue 18, review D1).

:mod:`echo2.bench.broadcast_sim` (uniform or given uploads, star or pipelined plans) and
:mod:`echo2.bench.wan_sim` (log-uniform uploads, NATed nodes, churn) only build a plan and the
inputs; this module runs it. The wide-area simulator with no NATed share and no churn is the
broadcast simulator: both reach the same loop with no :class:`Links` and no events.

Model (the data plane as the real node runs it):
- every node (and the hub) has an upload limit ``b`` shared fairly by its concurrent sends, as
  the token bucket does; one connection per (sender, receiver) carries one chunk at a time, in
  order; an optional per-node download cap is shared the same way by concurrent receives (a
  transfer runs at ``min(b_up / n_up, b_down / n_down)``; spare capacity is not redistributed);
- a chunk is forwarded only once it is completely received and verified: a hop costs
  ``latency_s`` (request/ack round trip, framing) plus ``size / verify_bps``;
- what a chunk costs its sender's upload: ``size · wire_overhead + per_chunk_s · b_sender`` bytes
  of link time. ``wire_overhead`` is what the shaper counts per payload byte (1 for the data
  plane's token bucket, which counts payload; :data:`TBF_WIRE_OVERHEAD` for the kernel's tbf,
  which counts whole frames); ``per_chunk_s`` the seconds of work per chunk (frame, hash, store,
  ack, relay bookkeeping) during which the sender's link idles, the ``h`` of
  :mod:`echo2.protocol.chunking`. Both default to no cost: each node on its own machine. On the
  shared 2-core machine a real netns run is CPU-bound (:data:`NETNS_2CORE_PER_CHUNK_S`);
- each node runs the real :class:`echo2.protocol.relay.Relay` on the plan (made by
  :mod:`echo2.learner_hub.planner` in the callers): sends come from its actions;
- optional ``links``: which pairs can connect at all (NAT) and how a plan is repaired around
  pairs that cannot; a Send or Request over an impossible pair goes unanswered, as on the wire;
- optional churn (:meth:`Engine.leave`, :meth:`Engine.join`): the hub repairs the plan at once
  (``planner.replan``), moved nodes tell their new parents what they hold (ChunkHave) and the
  nodes that lost a parent are ticked every ``tick_s`` so their relays pull what stalls.

Units: bytes and bytes/s (the callers convert from MB and MB/s).
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

from echo2.learner_hub.planner import HUB, NodeInfo, Plan, replan
from echo2.protocol.chunking import choose_chunk_size
from echo2.protocol.relay import Complete, Relay, Request, Send, bitmap_from_indices

MB = 1_000_000
DEFAULT_LATENCY_S = 0.002  # per hop: request/ack round trip and framing
DEFAULT_VERIFY_MBPS = 1000.0  # sha256 on one core here: about 950 MB/s (BRIEF section 9)
# tbf shapes whole Ethernet frames: 1514 bytes on the wire carry 1448 of TCP payload (MTU 1500,
# TCP timestamps); the simulator at this overhead matched a real netns run within 3% at N = 1
TBF_WIRE_OVERHEAD = 1514 / 1448
# Per-chunk work when N + 1 processes share this machine's 2 cores (N = 8, load 14-19): fitted to
# the netns runs of protocol/chunking.py (tbf at 8 MB/s, 32 MB: 128 KiB 2.34-3.21 x M/b, 256 KiB
# 1.89, 512 KiB 1.60, 1 MiB 1.60-1.82, 2 MiB 2.13). With it and TBF_WIRE_OVERHEAD the simulator
# gives 2.63, 1.89, 1.57, 1.45, 1.57 (without: 1.07, 1.09, 1.15, 1.22, 1.44, i.e. 28% under at
# the rule's 512 KiB); chunks of 1 MiB and more stay 10-25% under (a per-hop cost that grows with
# the chunk, not modelled). At N = 1 (2 processes, 1 MiB chunks) the simulator agreed within 3%
# with no per-chunk cost, so this is contention (runnable processes per core), not the protocol:
# uncontended it is at most ~4 ms (3% of a 1 MiB chunk's 0.13 s at 8 MB/s).
NETNS_2CORE_PER_CHUNK_S = 0.025


def chunk_sizes(total: int, n_nodes: int, chunk_bytes: int | None = None) -> tuple[int, list[int]]:
    """``(chunk size, size of each chunk)`` for ``total`` bytes: the publisher's rule
    (``protocol.chunking``) unless ``chunk_bytes`` is given; the last chunk takes the rest."""
    chunk = chunk_bytes or choose_chunk_size(total, n_nodes)
    k = max(1, -(-total // chunk))
    return chunk, [chunk] * (k - 1) + [total - chunk * (k - 1)]


class Links(Protocol):
    """Connectivity: whether two nodes can connect, and the repair of plan edges that cannot."""

    def feasible(self, a: str, b: str) -> bool: ...

    def fix_edges(self, plan: Plan, nodes: set[str]) -> tuple[int, set[str]]: ...


class _Transfer:
    __slots__ = ("snd", "rcv", "idx", "size", "remaining", "rate", "t_last", "ver")

    def __init__(self, snd: str, rcv: str, idx: int, size: int, now: float, wire: float) -> None:
        self.snd, self.rcv, self.idx, self.size = snd, rcv, idx, size  # size: payload bytes
        self.remaining = wire  # bytes of the sender's link time still to go
        self.rate = 0.0
        self.t_last = now
        self.ver = 0  # -1: broken off (a peer left)


def _changed(old: Plan, new: Plan) -> set[str]:
    """Nodes whose parent or children differ between two plans of the same stripes."""
    out: set[str] = set()
    for s in range(new.stripes):
        po, pn = old.parent[s], new.parent[s]
        for n in set(po) | set(pn):
            if po.get(n) != pn.get(n):
                out |= {n, po.get(n) or "", pn.get(n) or ""}
    out.discard("")
    return out


class Engine:
    """One broadcast of ``sizes`` (bytes per chunk) over ``plan``; ``up_bps`` per node and hub."""

    def __init__(
        self,
        plan: Plan,
        sizes: Sequence[int],
        up_bps: dict[str, float],
        nodes: Sequence[str],
        *,
        download_bps: float | None = None,
        latency_s: float,
        verify_bps: float,
        window: int = 2,
        links: Links | None = None,
        stall_timeout_s: float = 1.0,
        tick_s: float = 0.25,
        wire_overhead: float = 1.0,
        per_chunk_s: float = 0.0,
    ) -> None:
        if wire_overhead < 1.0 or per_chunk_s < 0.0:
            raise ValueError("wire_overhead must be >= 1 and per_chunk_s >= 0")
        self.plan = plan
        self.sizes = list(sizes)
        self.k = len(self.sizes)
        self.up_bps = up_bps
        self.dcap = download_bps or None
        self.latency_s, self.verify_bps, self.window = latency_s, verify_bps, window
        self.links = links
        self.stall_timeout_s, self.tick_s = stall_timeout_s, tick_s
        self.wire_overhead, self.per_chunk_s = wire_overhead, per_chunk_s
        self.hashes = [bytes(32)] * self.k  # contents are not simulated; only evidence needs hashes
        self.now = 0.0
        self.order = list(nodes)  # start order (ties between equal times follow it)
        self.present: set[str] = set(self.order)
        self.relays = {n: self._relay(n, plan) for n in self.order}
        self.relays[HUB] = self._relay(HUB, plan, range(self.k))
        self.up_active: dict[str, set[_Transfer]] = {HUB: set()}
        self.down_active: dict[str, set[_Transfer]] = {}
        self.conn_busy: set[tuple[str, str]] = set()
        self.conn_queue: dict[tuple[str, str], deque[int]] = {}
        # (time, seq, kind, transfer, its version, receiver, chunk): kind 0 = transfer end, 1 = verified
        self.heap: list[tuple[float, int, int, _Transfer | None, int, str, int]] = []
        self.seq = 0
        self.done_at: dict[str, float] = {}
        self.joined_at: dict[str, float] = {}
        self.sent_by: dict[str, int] = {}  # bytes uploaded per sender
        self.dirty: set[str] = set()
        self.watch: set[str] = set()  # nodes that lost a parent or joined: ticked until complete
        self.repair_moves = 0  # plan edges links.fix_edges moved during churn

    def _relay(self, name: str, plan: Plan, have: Iterable[int] = ()) -> Relay:
        return Relay(name, plan, self.hashes, have=have, window=self.window, now=self.now,
                     stall_timeout_s=self.stall_timeout_s, request_timeout_s=4 * self.stall_timeout_s)

    # -- data plane ------------------------------------------------------------------------------
    def _push(self, at: float, tr: _Transfer | None, ver: int = 0, rcv: str = "", idx: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, 0 if tr is not None else 1, tr, ver, rcv, idx))

    def _start(self, snd: str, rcv: str, idx: int) -> None:
        size = self.sizes[idx]
        t = _Transfer(snd, rcv, idx, size, self.now, size * self.wire_overhead + self.per_chunk_s * self.up_bps[snd])
        self.up_active.setdefault(snd, set()).add(t)
        self.conn_busy.add((snd, rcv))
        self.dirty.add(snd)
        if self.dcap:
            self.down_active.setdefault(rcv, set()).add(t)
            self.dirty.add(rcv)

    def handle(self, node: str, actions: list) -> None:
        links, present = self.links, self.present
        for a in actions:
            if type(a) is Send:
                if a.peer not in present or (links is not None and not links.feasible(node, a.peer)):
                    continue  # no connection: the slot stays taken, the peer is out of the plan
                key = (node, a.peer)
                if key in self.conn_busy:
                    self.conn_queue.setdefault(key, deque()).append(a.index)
                else:
                    self._start(node, a.peer, a.index)
            elif type(a) is Complete:
                self.done_at.setdefault(node, self.now)
                self.watch.discard(node)
            elif type(a) is Request:
                # a source we cannot reach (gone, or a NAT pair without a punch) leaves the request
                # unanswered: the relay retries elsewhere when it times out
                if a.peer == HUB or (a.peer in present and (links is None or links.feasible(node, a.peer))):
                    self.handle(a.peer, self.relays[a.peer].on_request(node, a.indices, now=self.now))

    def _reshape(self, node: str) -> None:
        up_active, up_bps, dcap, now = self.up_active, self.up_bps, self.dcap, self.now
        ts = list(up_active.get(node, ()))
        if dcap:
            ts += [t for t in self.down_active.get(node, ()) if t.snd != node]
        for t in ts:
            rate = up_bps[t.snd] / len(up_active[t.snd])
            if dcap:
                rate = min(rate, dcap / len(self.down_active[t.rcv]))
            if rate == t.rate:
                continue
            t.remaining -= t.rate * (now - t.t_last)
            t.t_last = now
            t.rate = rate
            t.ver += 1
            self._push(now + max(t.remaining, 0.0) / rate, t, t.ver)

    def _reshape_dirty(self) -> None:
        for n in self.dirty:
            self._reshape(n)
        self.dirty.clear()

    # -- churn -------------------------------------------------------------------------------------
    def _apply_plan(self, new: Plan, changed: set[str]) -> None:
        self.plan = new
        for n in sorted(changed):
            if n in self.relays and (n == HUB or n in self.present):
                r = self.relays[n]
                for c in [c for s in range(new.stripes) for c in new.children[s].get(n, [])]:
                    if c in self.relays:  # the child tells its (new) parent what it holds
                        r.on_have(c, bitmap_from_indices(self.relays[c].have, self.k), now=self.now)
                self.handle(n, r.on_plan(new, now=self.now))
                if n != HUB and n not in self.done_at:
                    self.watch.add(n)

    def _fix(self, new: Plan) -> set[str]:
        """Move the new plan's edges that ``links`` cannot carry; the nodes whose plan changed."""
        if self.links is None:
            return set()
        moves, touched = self.links.fix_edges(new, self.present)
        self.repair_moves += moves
        return touched

    def leave(self, x: str) -> None:
        """``x`` leaves: its transfers break off and the hub repairs the plan at once."""
        self.present.discard(x)
        for key in [kk for kk in self.conn_busy if x in kk]:
            self.conn_busy.discard(key)
            self.conn_queue.pop(key, None)
        for t in list(self.up_active.pop(x, ())):
            t.ver = -1
            if self.dcap:
                self.down_active.get(t.rcv, set()).discard(t)
                self.dirty.add(t.rcv)
        for snd, ts in self.up_active.items():
            for t in [t for t in ts if t.rcv == x]:
                ts.discard(t)
                t.ver = -1
                self.dirty.add(snd)
        self.down_active.pop(x, None)
        new = replan(self.plan, left=[x])
        touched = self._fix(new)
        self._apply_plan(new, (_changed(self.plan, new) | touched) - {x})

    def join(self, info: NodeInfo) -> None:
        """``info`` joins as a leaf; its time counts from now."""
        y = info.node_id
        self.present.add(y)
        self.joined_at[y] = self.now
        self.up_bps[y] = info.upload_Bps
        new = replan(self.plan, joined=[info])
        changed = (_changed(self.plan, new) | self._fix(new)) - {y}
        self.relays[y] = self._relay(y, new)
        self._apply_plan(new, changed)
        self.watch.add(y)
        self.handle(y, self.relays[y].start(now=self.now))

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, events: Sequence[tuple[float, NodeInfo | str]] = ()) -> dict[str, float]:
        """Run to the end; ``events`` are ``(time, NodeInfo)`` joins and ``(time, name)`` leaves.
        Returns when each node (and the hub, at 0) held every chunk."""
        self.handle(HUB, self.relays[HUB].start(now=0.0))
        for n in self.order:
            self.handle(n, self.relays[n].start(now=0.0))
        self._reshape_dirty()
        evs = sorted(events, key=lambda e: e[0])  # stable: equal times keep the caller's order
        # Millions of short-lived objects: the cyclic collector would rescan all relays each time.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._loop(evs)
        finally:
            if gc_was_enabled:
                gc.enable()
        missing = sorted(n for n in self.present if n not in self.done_at)
        if missing:
            raise RuntimeError(f"simulation ended with {len(missing)} nodes incomplete (e.g. {missing[0]})")
        return self.done_at

    def _loop(self, events: list[tuple[float, NodeInfo | str]]) -> None:
        heap, present, relays, sent_by = self.heap, self.present, self.relays, self.sent_by
        up_active, down_active, conn_busy, conn_queue = self.up_active, self.down_active, self.conn_busy, self.conn_queue
        dirty, dcap, handle = self.dirty, self.dcap, self.handle
        hop, verify_bps = self.latency_s, self.verify_bps
        ev_i, next_tick = 0, self.tick_s
        while True:
            t_heap = heap[0][0] if heap else math.inf
            t_ev = events[ev_i][0] if ev_i < len(events) else math.inf
            t_tick = max(next_tick, self.now) if self.watch else math.inf
            now = self.now = min(t_heap, t_ev, t_tick)
            if now == math.inf:
                break
            if now == t_ev:
                ev = events[ev_i][1]
                ev_i += 1
                self.leave(ev) if isinstance(ev, str) else self.join(ev)
            elif now == t_tick:
                next_tick = now + self.tick_s
                for n in sorted(self.watch):
                    if n in present:
                        handle(n, relays[n].on_tick(now))
                    else:
                        self.watch.discard(n)
            else:
                while heap and heap[0][0] <= now + 1e-12:
                    _, _, _, t, ver, rcv, idx = heapq.heappop(heap)
                    if t is not None:
                        if ver != t.ver:
                            continue
                        up_active[t.snd].discard(t)
                        dirty.add(t.snd)
                        if dcap:
                            down_active[t.rcv].discard(t)
                            dirty.add(t.rcv)
                        key = (t.snd, t.rcv)
                        conn_busy.discard(key)
                        sent_by[t.snd] = sent_by.get(t.snd, 0) + t.size
                        q = conn_queue.get(key)
                        if q:
                            self._start(t.snd, t.rcv, q.popleft())
                        self._push(now + hop + t.size / verify_bps, None, 0, t.rcv, t.idx)
                        handle(t.snd, relays[t.snd].on_child_ack(t.rcv, t.idx, now=now))
                    elif rcv in present:
                        handle(rcv, relays[rcv].on_chunk_verified(idx, now=now))
            self._reshape_dirty()
