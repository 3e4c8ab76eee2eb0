"""Wide-area broadcast simulator: heterogeneous uploads, NATed nodes, churn (issue 18, item 4).

The same discrete-event model as :mod:`echo2.bench.broadcast_sim` (each sender's upload shared
fairly by its concurrent sends, one chunk at a time per connection, a chunk forwarded once it is
received and verified, every node running the real :class:`~echo2.protocol.relay.Relay` on a plan
of the real planner, default chunk size from :mod:`echo2.protocol.chunking`), plus:

- upload rates drawn log-uniform in ``[rate_lo, rate_hi]`` MB/s (``seed``); the hub at ``hub_MBps``;
- a share ``nat_share`` of NATed nodes. A connection between two nodes exists if either is public
  (a NATed node dials out to a public parent, or a NATed parent dials out to its public child and
  pushes); two NATed nodes connect only by hole punching, which succeeds with probability
  ``punch_p`` per pair (drawn once), else not at all. Today's planner keeps NATed nodes at the
  leaves (``nat_relay=False``), so every edge has a public end. ``nat_relay=True`` plans them as
  relays, as issue 18 item 1 will: a plan edge between two NATed nodes whose punch fails is moved
  to another parent with spare capacity that the child can reach, else to the hub;
- churn: ``round(churn·N)`` nodes leave and as many join at uniform times in ``[0, M/b_hub]``.
  A leaver's transfers break off; the hub repairs the plan (``planner.replan``) at once, moved
  nodes send their new parents a ChunkHave (so held chunks are not sent again) and pull what a
  stalled stripe lacks after ``stall_timeout_s``. Joiners are leaves; their time counts from
  their join.

Figures: ``seconds`` is the last of the nodes present from start to end to hold every chunk.
``fluid_seconds`` is the fluid lower bound for upload-limited links (Kumar and Ross):
``max(M/b_hub, N·M/(b_hub + Σ b_i))`` over those nodes (every node must download M, all uploads
together move at most ``b_hub + Σ b_i``). The issue's form also has ``M/min b_i``, reported as
``issue_bound_seconds``; with download unlimited that term is no bound (a 2 MB/s node can receive
from faster ones at their rate), so ratios are reported against the Kumar-Ross bound.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import statistics
import zlib
from collections import deque
from dataclasses import dataclass

from echo2.bench.broadcast_sim import MB, _Transfer
from echo2.learner_hub.planner import HUB, NodeInfo, Plan, plan_broadcast, replan
from echo2.protocol.chunking import choose_chunk_size
from echo2.protocol.relay import Complete, Relay, Request, Send, bitmap_from_indices


@dataclass
class WanResult:
    n_nodes: int
    seconds: float  # last node present throughout holds every chunk
    median_seconds: float
    first_seconds: float
    fluid_seconds: float
    hub_floor_seconds: float  # M / b_hub
    issue_bound_seconds: float
    n_chunks: int
    chunk_bytes: int
    stripes: int
    depth: int
    nat_nodes: int
    punch_failures: int  # NAT-NAT plan edges that had to move
    left: int
    joined: int
    joiner_max_seconds: float  # since their join
    hub_sent_bytes: int
    peer_sent_bytes: int
    nat_sent_bytes: int  # uploaded by NATed nodes

    @property
    def ratio_fluid(self) -> float:
        return self.seconds / self.fluid_seconds

    @property
    def ratio_hub(self) -> float:
        return self.seconds / self.hub_floor_seconds


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return lo if hi <= lo else math.exp(rng.uniform(math.log(lo), math.log(hi)))


class _Wan:
    def __init__(self, seed: int, punch_p: float) -> None:
        self.seed, self.punch_p = seed, punch_p
        self.nat: dict[str, bool] = {HUB: False}

    def feasible(self, a: str, b: str) -> bool:
        if not (self.nat.get(a) and self.nat.get(b)):
            return True
        x, y = sorted((a, b))
        h = zlib.crc32(f"{self.seed}:{x}:{y}".encode()) / 2**32
        return h < self.punch_p

    def fix_edges(self, plan: Plan, nodes: set[str]) -> tuple[int, set[str]]:
        """Move every child whose parent it cannot connect to; (moves, nodes whose plan changed)."""
        moves, touched = 0, set()
        for s in range(plan.stripes):
            children, parent = plan.children[s], plan.parent[s]
            bad = [(p, c) for p, cs in children.items() if p != plan.hub for c in cs if not self.feasible(p, c)]
            for p, c in bad:
                children[p].remove(c)
                depth = plan.depth(s)
                sub = _subtree(children, c)
                # as planner._attach: the shallowest reachable relay with a spare slot, else the
                # least loaded reachable relay, the hub only if no relay can take it
                best: tuple[float, int, str] | None = None
                for q, st in plan.interior.items():
                    if st != s or q in sub or q not in depth or q not in nodes or not self.feasible(q, c):
                        continue
                    n_ch, cap = len(children.get(q, ())), plan.capacity.get(q, 0)
                    if cap <= 0:
                        continue
                    key = (max(0.0, (n_ch + 1) / cap - 1.0), depth[q], q)
                    if best is None or key < best:
                        best = key
                q = plan.hub if best is None else best[2]
                parent[c] = q
                children.setdefault(q, []).append(c)
                moves += 1
                touched |= {p, c, q}
        return moves, touched


def _subtree(children: dict[str, list[str]], root: str) -> set[str]:
    out, stack = {root}, [root]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


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


def simulate_wan(
    n_nodes: int,
    mbytes: float,
    *,
    hub_MBps: float = 10.0,
    rate_lo: float = 2.0,
    rate_hi: float = 125.0,
    nat_share: float = 0.0,
    punch_p: float = 0.6,
    churn: float = 0.0,
    nat_relay: bool = False,
    seed: int = 0,
    chunk_bytes: int | None = None,
    latency_s: float = 0.002,
    verify_MBps: float = 1000.0,
    window: int = 2,
    stall_timeout_s: float = 1.0,
    tick_s: float = 0.25,
) -> WanResult:
    if n_nodes < 1 or mbytes <= 0 or hub_MBps <= 0 or rate_lo <= 0 or rate_hi < rate_lo:
        raise ValueError("need n_nodes >= 1 and positive sizes and rates (rate_lo <= rate_hi)")
    if not (0 <= nat_share <= 1 and 0 <= punch_p <= 1 and 0 <= churn < 1):
        raise ValueError("nat_share and punch_p in [0, 1], churn in [0, 1)")
    rng = random.Random(seed)
    total = int(round(mbytes * MB))
    chunk = chunk_bytes or choose_chunk_size(total, n_nodes)
    k = max(1, -(-total // chunk))
    sizes = [chunk] * (k - 1) + [total - chunk * (k - 1)]
    hashes = [bytes(32)] * k
    wan = _Wan(seed, punch_p)
    up_bps: dict[str, float] = {HUB: hub_MBps * MB}

    def new_node(name: str) -> NodeInfo:
        up_bps[name] = log_uniform(rng, rate_lo, rate_hi) * MB
        wan.nat[name] = rng.random() < nat_share
        return NodeInfo(name, up_bps[name], nat_relay or not wan.nat[name])

    infos = [new_node(f"n{i}") for i in range(n_nodes)]
    hub_floor = total / up_bps[HUB]
    n_churn = round(churn * n_nodes)
    leavers = set(rng.sample([i.node_id for i in infos], n_churn))
    joiners = [new_node(f"j{i}") for i in range(n_churn)]
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, node)
    for i, name in enumerate(sorted(leavers)):
        events.append((rng.uniform(0, hub_floor), i, "leave", name))
    for i, info in enumerate(joiners):
        events.append((rng.uniform(0, hub_floor), n_churn + i, "join", info.node_id))
    joiner_info = {j.node_id: j for j in joiners}

    plan = plan_broadcast(0, up_bps[HUB], infos, k)
    present = {i.node_id for i in infos}
    punch_failures, _ = wan.fix_edges(plan, present)
    depth = plan.max_depth()

    def mk_relay(name: str, have: range | tuple[()] = ()) -> Relay:
        return Relay(name, plan, hashes, have=have, window=window, now=now,
                     stall_timeout_s=stall_timeout_s, request_timeout_s=4 * stall_timeout_s)

    now = 0.0
    relays = {n: mk_relay(n) for n in present}
    relays[HUB] = mk_relay(HUB, range(k))
    verify_bps = verify_MBps * MB
    up_active: dict[str, set[_Transfer]] = {HUB: set()}
    conn_busy: set[tuple[str, str]] = set()
    conn_queue: dict[tuple[str, str], deque[int]] = {}
    heap: list[tuple[float, int, int, _Transfer | None, int, str, int]] = []
    seq = 0
    done_at: dict[str, float] = {}
    joined_at: dict[str, float] = {}
    sent = {"hub": 0, "peer": 0, "nat": 0}
    dirty: set[str] = set()
    watch: set[str] = set()  # nodes that lost a parent or joined: ticked until complete

    def push(at: float, tr: _Transfer | None, ver: int = 0, rcv: str = "", idx: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (at, seq, 0 if tr is not None else 1, tr, ver, rcv, idx))

    def start(snd: str, rcv: str, idx: int) -> None:
        t = _Transfer(snd, rcv, idx, sizes[idx], now)
        up_active.setdefault(snd, set()).add(t)
        conn_busy.add((snd, rcv))
        dirty.add(snd)

    def handle(node: str, actions: list) -> None:
        for a in actions:
            if type(a) is Send:
                if a.peer not in present or not wan.feasible(node, a.peer):
                    continue  # no connection: the slot stays taken, the peer is out of the plan
                key = (node, a.peer)
                if key in conn_busy:
                    conn_queue.setdefault(key, deque()).append(a.index)
                else:
                    start(node, a.peer, a.index)
            elif type(a) is Complete:
                done_at.setdefault(node, now)
                watch.discard(node)
            elif type(a) is Request:
                # a source we cannot reach (gone, or a NAT pair without a punch) leaves the request
                # unanswered: the relay retries elsewhere when it times out
                if a.peer == HUB or (a.peer in present and wan.feasible(node, a.peer)):
                    handle(a.peer, relays[a.peer].on_request(node, a.indices, now=now))

    def reshape(node: str) -> None:
        for t in up_active.get(node, ()):
            rate = up_bps[node] / len(up_active[node])
            if rate == t.rate:
                continue
            t.remaining -= t.rate * (now - t.t_last)
            t.t_last = now
            t.rate = rate
            t.ver += 1
            push(now + max(t.remaining, 0.0) / rate, t, t.ver)

    def apply_plan(new: Plan, changed: set[str]) -> None:
        nonlocal plan
        plan = new
        for n in sorted(changed):
            if n in relays and (n == HUB or n in present):
                r = relays[n]
                for c in new.children[0].get(n, []) + [c for s in range(1, new.stripes) for c in new.children[s].get(n, [])]:
                    if c in relays:  # the child tells its (new) parent what it holds
                        r.on_have(c, bitmap_from_indices(relays[c].have, k), now=now)
                handle(n, r.on_plan(new, now=now))
                if n != HUB and n not in done_at:
                    watch.add(n)

    def leave(x: str) -> None:
        nonlocal punch_failures
        present.discard(x)
        for key in [kk for kk in conn_busy if x in kk]:
            conn_busy.discard(key)
            conn_queue.pop(key, None)
        for t in list(up_active.pop(x, ())):
            t.ver = -1
        for snd, ts in up_active.items():
            for t in [t for t in ts if t.rcv == x]:
                ts.discard(t)
                t.ver = -1
                dirty.add(snd)
        new = replan(plan, left=[x])
        moves, touched = wan.fix_edges(new, present)
        punch_failures += moves
        apply_plan(new, (_changed(plan, new) | touched) - {x})

    def join(y: str) -> None:
        nonlocal punch_failures
        present.add(y)
        joined_at[y] = now
        new = replan(plan, joined=[joiner_info[y]])
        moves, touched = wan.fix_edges(new, present)
        punch_failures += moves
        changed = (_changed(plan, new) | touched) - {y}
        relays[y] = Relay(y, new, hashes, window=window, now=now,
                          stall_timeout_s=stall_timeout_s, request_timeout_s=4 * stall_timeout_s)
        apply_plan(new, changed)
        watch.add(y)
        handle(y, relays[y].start(now=now))

    handle(HUB, relays[HUB].start(now=0.0))
    for n in sorted(present):
        handle(n, relays[n].start(now=0.0))
    for n in dirty:
        reshape(n)
    dirty.clear()
    events.sort()
    ev_i = 0
    next_tick = tick_s

    def run_loop() -> None:
        nonlocal now, ev_i, next_tick
        while True:
            t_heap = heap[0][0] if heap else math.inf
            t_ev = events[ev_i][0] if ev_i < len(events) else math.inf
            t_tick = max(next_tick, now) if watch else math.inf
            now = min(t_heap, t_ev, t_tick)
            if now == math.inf:
                break
            if now == t_ev:
                _, _, kind, name = events[ev_i]
                ev_i += 1
                leave(name) if kind == "leave" else join(name)
            elif now == t_tick:
                next_tick = now + tick_s
                for n in sorted(watch):
                    if n in present:
                        handle(n, relays[n].on_tick(now))
                    else:
                        watch.discard(n)
            else:
                while heap and heap[0][0] <= now + 1e-12:
                    _, _, _, t, ver, rcv, idx = heapq.heappop(heap)
                    if t is not None:
                        if ver != t.ver:
                            continue
                        up_active[t.snd].discard(t)
                        dirty.add(t.snd)
                        key = (t.snd, t.rcv)
                        conn_busy.discard(key)
                        sent["hub" if t.snd == HUB else "peer"] += t.size
                        if wan.nat.get(t.snd):
                            sent["nat"] += t.size
                        q = conn_queue.get(key)
                        if q:
                            start(t.snd, t.rcv, q.popleft())
                        push(now + latency_s + t.size / verify_bps, None, 0, t.rcv, t.idx)
                        handle(t.snd, relays[t.snd].on_child_ack(t.rcv, t.idx, now=now))
                    elif rcv in present:
                        handle(rcv, relays[rcv].on_chunk_verified(idx, now=now))
            for n in dirty:
                reshape(n)
            dirty.clear()

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        run_loop()
    finally:
        if gc_was_enabled:
            gc.enable()

    missing = sorted(n for n in present if n not in done_at)
    if missing:
        raise RuntimeError(f"simulation ended with {len(missing)} nodes incomplete (e.g. {missing[0]})")
    stayers = [i.node_id for i in infos if i.node_id not in leavers]
    times = sorted(done_at[n] for n in stayers)
    b_sum = sum(up_bps[n] for n in stayers)
    fluid = max(hub_floor, len(stayers) * total / (up_bps[HUB] + b_sum))
    issue = max(hub_floor, len(stayers) * total / b_sum, total / min(up_bps[n] for n in stayers))
    return WanResult(
        n_nodes=n_nodes, seconds=times[-1], median_seconds=statistics.median(times), first_seconds=times[0],
        fluid_seconds=fluid, hub_floor_seconds=hub_floor, issue_bound_seconds=issue, n_chunks=k, chunk_bytes=chunk,
        stripes=plan.stripes, depth=depth, nat_nodes=sum(1 for n in stayers if wan.nat[n]),
        punch_failures=punch_failures, left=len(leavers), joined=len(joiners),
        joiner_max_seconds=max((done_at[j] - joined_at[j] for j in joined_at), default=0.0),
        hub_sent_bytes=sent["hub"], peer_sent_bytes=sent["peer"], nat_sent_bytes=sent["nat"],
    )
