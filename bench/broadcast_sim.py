"""Broadcast simulator: star or pipelined plans over given uploads, against the floor M/B.

It builds the plan with the real planner (:mod:`echo2.learner_hub.planner`, or the star plan)
and the chunks with the publisher's rule (:mod:`echo2.protocol.chunking`), then runs the shared
event engine (:mod:`echo2.bench.sim_engine`, which states the model) with every node reachable
from every other and no churn; :mod:`echo2.bench.wan_sim` runs the same engine on a wide area.

Units: ``mbytes`` is in MB = 10**6 bytes, bandwidths in MB/s = 10**6 bytes/s, chunk sizes in
bytes. ``ideal_seconds = M / B``: the floor, every node must receive M bytes over links of B.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from echo2.bench.sim_engine import DEFAULT_LATENCY_S, DEFAULT_VERIFY_MBPS, MB, Engine, chunk_sizes
from echo2.learner_hub.planner import HUB, NodeInfo, Plan, plan_broadcast, star_plan
from echo2.protocol.chunking import choose_chunk_size

# the chunk size before issue 18 (now: protocol.chunking.choose_chunk_size, as the publisher)
LEGACY_CHUNK_BYTES = 4 * 1024 * 1024
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
    wire_overhead: float = 1.0,
    per_chunk_s: float = 0.0,
) -> SimResult:
    """Simulate broadcasting ``mbytes`` MB to ``n_nodes`` nodes; ``mode`` is ``star`` or
    ``pipelined``. ``upload_MBps``/``reachable`` give per-node values (default: all ``link_MBps``,
    all reachable); the hub uploads at ``hub_MBps`` (default ``link_MBps``). ``wire_overhead`` and
    ``per_chunk_s``: what a chunk costs its sender's link beyond its payload (``sim_engine``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if n_nodes < 1 or mbytes <= 0 or link_MBps <= 0 or (chunk_bytes is not None and chunk_bytes <= 0):
        raise ValueError("n_nodes, mbytes, link_MBps and chunk_bytes must be positive")
    total = int(round(mbytes * MB))
    chunk_bytes, sizes = chunk_sizes(total, n_nodes, chunk_bytes)
    k = len(sizes)
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
    engine = Engine(plan, sizes, up_bps, names, download_bps=download_MBps * MB if download_MBps else None,
                    latency_s=latency_s, verify_bps=verify_MBps * MB, window=window,
                    wire_overhead=wire_overhead, per_chunk_s=per_chunk_s)
    done_at = engine.run()
    sent_by = engine.sent_by
    times = sorted(done_at[n] for n in names)
    return SimResult(
        mode=mode,
        n_nodes=n_nodes,
        seconds=times[-1],
        median_seconds=statistics.median(times),
        first_seconds=times[0],
        hub_sent_bytes=sent_by.get(HUB, 0),
        peer_sent_bytes=sum(b for n, b in sent_by.items() if n != HUB),
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
