"""Discrete-event simulator of a version broadcast, driving the real planner and relay rules.

Model (the data plane as the real node runs it):
- every node (and the hub) has an upload limit ``b`` shared fairly by its concurrent sends, as
  the token bucket does; one connection per (sender, receiver) carries one chunk at a time, in
  order; an optional per-node download cap is shared the same way by concurrent receives (a
  transfer runs at ``min(b_up / n_up, b_down / n_down)``; spare capacity is not redistributed);
- a chunk is forwarded only once it is completely received and verified: a hop costs
  ``latency_s`` (request/ack round trip, framing) plus ``size / verify_Bps``;
- each node runs :class:`echo2.protocol.relay.Relay` on the plan made by
  :mod:`echo2.learner_hub.planner` (or the star plan): sends come from its actions.

Units: ``mbytes`` is in MB = 10**6 bytes, bandwidths in MB/s = 10**6 bytes/s, chunk sizes in
bytes. ``ideal_seconds = M / B``: the floor, every node must receive M bytes over links of B.
"""

from __future__ import annotations

import gc
import heapq
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from echo2.learner_hub.planner import HUB, NodeInfo, Plan, plan_broadcast, star_plan
from echo2.protocol.chunking import choose_chunk_size
from echo2.protocol.relay import Complete, Relay, Request, Send

MB = 1_000_000
# the chunk size before issue 18 (now: protocol.chunking.choose_chunk_size, as the publisher)
LEGACY_CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_LATENCY_S = 0.002
DEFAULT_VERIFY_MBPS = 1000.0
MODES = ("star", "pipelined")


@dataclass
class SimResult:
    mode: str
    n_nodes: int
    seconds: float  # last node holds every chunk
    median_seconds: float
    first_seconds: float
    hub_sent_bytes: int
    peer_sent_bytes: int
    ideal_seconds: float
    n_chunks: int
    chunk_bytes: int
    stripes: int
    depth: int
    node_seconds: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def ratio(self) -> float:
        return self.seconds / self.ideal_seconds if self.ideal_seconds > 0 else math.inf


def chunk_size_for(total_bytes: int, n_nodes: int) -> int:
    """The default chunk size: the publisher's rule (``protocol.chunking``)."""
    return choose_chunk_size(total_bytes, n_nodes)


def ideal_seconds(mbytes: float, link_MBps: float) -> float:
    return mbytes / link_MBps


class _Transfer:
    __slots__ = ("snd", "rcv", "idx", "size", "remaining", "rate", "t_last", "ver")

    def __init__(self, snd: str, rcv: str, idx: int, size: int, now: float) -> None:
        self.snd, self.rcv, self.idx, self.size = snd, rcv, idx, size
        self.remaining = float(size)
        self.rate = 0.0
        self.t_last = now
        self.ver = 0


def simulate(
    mode: str,
    n_nodes: int,
    mbytes: float,
    link_MBps: float,
    chunk_bytes: int | None = None,
    *,
    hub_MBps: float | None = None,
    upload_MBps: Sequence[float] | None = None,
    reachable: Sequence[bool] | None = None,
    download_MBps: float | None = None,
    latency_s: float = DEFAULT_LATENCY_S,
    verify_MBps: float = DEFAULT_VERIFY_MBPS,
    stripes: int | None = None,
    fanout: int | None = None,
    window: int = 2,
) -> SimResult:
    """Simulate broadcasting ``mbytes`` MB to ``n_nodes`` nodes; ``mode`` is ``star`` or
    ``pipelined``. ``upload_MBps``/``reachable`` give per-node values (default: all ``link_MBps``,
    all reachable); the hub uploads at ``hub_MBps`` (default ``link_MBps``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if n_nodes < 1 or mbytes <= 0 or link_MBps <= 0 or (chunk_bytes is not None and chunk_bytes <= 0):
        raise ValueError("n_nodes, mbytes, link_MBps and chunk_bytes must be positive")
    total = int(round(mbytes * MB))
    if chunk_bytes is None:
        chunk_bytes = chunk_size_for(total, n_nodes)
    k = max(1, -(-total // chunk_bytes))
    sizes = [chunk_bytes] * (k - 1) + [total - chunk_bytes * (k - 1)]
    names = [f"n{i}" for i in range(n_nodes)]
    ups = list(upload_MBps) if upload_MBps is not None else [link_MBps] * n_nodes
    reach = list(reachable) if reachable is not None else [True] * n_nodes
    if len(ups) != n_nodes or len(reach) != n_nodes:
        raise ValueError("upload_MBps and reachable need one value per node")
    hub_bps = (hub_MBps if hub_MBps is not None else link_MBps) * MB
    up_bps = {HUB: hub_bps, **{n: u * MB for n, u in zip(names, ups, strict=True)}}
    infos = [NodeInfo(n, u * MB, r) for n, u, r in zip(names, ups, reach, strict=True)]

    plan: Plan
    if mode == "star":
        plan = star_plan(0, infos)
    else:
        plan = plan_broadcast(0, hub_bps, infos, k, stripes=stripes, fanout=fanout)
    hashes = [bytes(32)] * k  # contents are not simulated; only the evidence path needs hashes
    relays = {n: Relay(n, plan, hashes, window=window) for n in names}
    relays[HUB] = Relay(HUB, plan, hashes, have=range(k), window=window)

    dcap = download_MBps * MB if download_MBps else None
    verify_bps = verify_MBps * MB
    up_active: dict[str, set[_Transfer]] = {n: set() for n in up_bps}
    down_active: dict[str, set[_Transfer]] = {n: set() for n in up_bps}
    conn_busy: set[tuple[str, str]] = set()
    conn_queue: dict[tuple[str, str], deque[int]] = {}
    # (time, seq, kind, transfer, its version, receiver, chunk): kind 0 = transfer end, 1 = verified
    heap: list[tuple[float, int, int, _Transfer | None, int, str, int]] = []
    seq = 0
    done_at: dict[str, float] = {}
    sent = {"hub": 0, "peer": 0}
    dirty: set[str] = set()
    now = 0.0

    def push(at: float, tr: _Transfer | None, ver: int = 0, rcv: str = "", idx: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (at, seq, 0 if tr is not None else 1, tr, ver, rcv, idx))

    def start(snd: str, rcv: str, idx: int) -> None:
        t = _Transfer(snd, rcv, idx, sizes[idx], now)
        up_active[snd].add(t)
        conn_busy.add((snd, rcv))
        dirty.add(snd)
        if dcap:
            down_active[rcv].add(t)
            dirty.add(rcv)

    def handle(node: str, actions: list) -> None:
        for a in actions:
            if type(a) is Send:
                key = (node, a.peer)
                if key in conn_busy:
                    conn_queue.setdefault(key, deque()).append(a.index)
                else:
                    start(node, a.peer, a.index)
            elif type(a) is Complete:
                done_at.setdefault(node, now)
            elif type(a) is Request:
                handle(a.peer, relays[a.peer].on_request(node, a.indices, now=now))

    def reshape(node: str) -> None:
        ts = list(up_active[node])
        if dcap:
            ts += [t for t in down_active[node] if t.snd != node]
        for t in ts:
            rate = up_bps[t.snd] / len(up_active[t.snd])
            if dcap:
                rate = min(rate, dcap / len(down_active[t.rcv]))
            if rate == t.rate:
                continue
            t.remaining -= t.rate * (now - t.t_last)
            t.t_last = now
            t.rate = rate
            t.ver += 1
            push(now + max(t.remaining, 0.0) / rate, t, t.ver)

    handle(HUB, relays[HUB].start(now=0.0))
    for n in names:
        handle(n, relays[n].start(now=0.0))
    for n in list(dirty):
        reshape(n)
    dirty.clear()
    hop_extra = latency_s
    def run_loop() -> None:
        nonlocal now
        while heap:
            now = heap[0][0]
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
                    sent["hub" if t.snd == HUB else "peer"] += t.size
                    q = conn_queue.get(key)
                    if q:
                        start(t.snd, t.rcv, q.popleft())
                    push(now + hop_extra + t.size / verify_bps, None, 0, t.rcv, t.idx)
                    handle(t.snd, relays[t.snd].on_child_ack(t.rcv, t.idx, now=now))
                else:
                    handle(rcv, relays[rcv].on_chunk_verified(idx, now=now))
            for n in dirty:
                reshape(n)
            dirty.clear()

    # Millions of short-lived objects: the cyclic collector would rescan all relays each time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        run_loop()
    finally:
        if gc_was_enabled:
            gc.enable()

    missing = [n for n in names if n not in done_at]
    if missing:
        raise RuntimeError(f"simulation ended with {len(missing)} nodes incomplete (e.g. {missing[0]})")
    times = sorted(done_at[n] for n in names)
    return SimResult(
        mode=mode,
        n_nodes=n_nodes,
        seconds=times[-1],
        median_seconds=statistics.median(times),
        first_seconds=times[0],
        hub_sent_bytes=sent["hub"],
        peer_sent_bytes=sent["peer"],
        ideal_seconds=total / hub_bps if hub_MBps is not None else ideal_seconds(mbytes, link_MBps),
        n_chunks=k,
        chunk_bytes=chunk_bytes,
        stripes=plan.stripes,
        depth=plan.max_depth(),
        node_seconds={n: done_at[n] for n in names},
    )


SCHEMES: dict[str, dict[str, int | None]] = {
    "chain": {"stripes": 1, "fanout": 1},
    "tree2": {"stripes": 1, "fanout": 2},
    "split2": {"stripes": 2, "fanout": None},
    "split3": {"stripes": 3, "fanout": None},
    "split4": {"stripes": 4, "fanout": None},
}


def scheme_table(
    n_list: Sequence[int], mbytes: float = 256.0, link_MBps: float = 10.0, chunk_bytes: int | None = LEGACY_CHUNK_BYTES
) -> list[dict[str, float | int | str]]:
    """The comparison that chose the planner's default (ratio = last node time / ideal)."""
    rows: list[dict[str, float | int | str]] = []
    for n in n_list:
        for name, kw in SCHEMES.items():
            if name == "chain" and n > 1000:
                continue  # N chunks deep: known to be hopeless, and slow to simulate
            r = simulate("pipelined", n, mbytes, link_MBps, chunk_bytes, **kw)  # type: ignore[arg-type]
            rows.append({"scheme": name, "nodes": n, "ratio": round(r.ratio, 3),
                         "median_ratio": round(r.median_seconds / r.ideal_seconds, 3), "depth": r.depth})
    return rows
