"""Wide-area broadcast simulator: heterogeneous uploads, NATed nodes, churn (issue 18, item 4).

The same discrete-event engine as :mod:`echo2.bench.broadcast_sim` (:mod:`echo2.bench.sim_engine`:
each sender's upload shared fairly by its concurrent sends, one chunk at a time per connection, a
chunk forwarded once it is received and verified, every node running the real
:class:`~echo2.protocol.relay.Relay` on a plan of the real planner, default chunk size from
:mod:`echo2.protocol.chunking`); with no NATed share and no churn it is the broadcast simulator.
This module adds:

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

import math
import random
import statistics
import zlib
from dataclasses import dataclass

from echo2.bench.sim_engine import DEFAULT_LATENCY_S, DEFAULT_VERIFY_MBPS, MB, Engine, chunk_sizes
from echo2.learner_hub.planner import HUB, NodeInfo, Plan, _attach, _subtree, plan_broadcast


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
        """Move every child whose parent it cannot connect to; (moves, nodes whose plan changed).
        The planner's own repair (``planner._attach``: the shallowest relay with a spare slot,
        else the least loaded one, the hub only if no relay can take it) picks the new parent,
        with the relays the child cannot reach (or that are gone) excluded."""
        moves, touched = 0, set()
        for s in range(plan.stripes):
            children, parent = plan.children[s], plan.parent[s]
            bad = [(p, c) for p, cs in children.items() if p != plan.hub for c in cs if not self.feasible(p, c)]
            for p, c in bad:
                children[p].remove(c)
                blocked = {q for q in plan.interior if q not in nodes or not self.feasible(q, c)}
                _attach(plan, s, c, plan.depth(s), _subtree(children, c) | blocked)
                moves += 1
                touched |= {p, c, parent[c]}
        return moves, touched


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
    latency_s: float = DEFAULT_LATENCY_S,
    verify_MBps: float = DEFAULT_VERIFY_MBPS,
    window: int = 2,
    stall_timeout_s: float = 1.0,
    tick_s: float = 0.25,
    wire_overhead: float = 1.0,
    per_chunk_s: float = 0.0,
) -> WanResult:
    if n_nodes < 1 or mbytes <= 0 or hub_MBps <= 0 or rate_lo <= 0 or rate_hi < rate_lo:
        raise ValueError("need n_nodes >= 1 and positive sizes and rates (rate_lo <= rate_hi)")
    if not (0 <= nat_share <= 1 and 0 <= punch_p <= 1 and 0 <= churn < 1):
        raise ValueError("nat_share and punch_p in [0, 1], churn in [0, 1)")
    rng = random.Random(seed)
    total = int(round(mbytes * MB))
    chunk, sizes = chunk_sizes(total, n_nodes, chunk_bytes)
    k = len(sizes)
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
    # leaves first, then joins, each at a uniform time in [0, M/b_hub] (the order of the draws)
    events: list[tuple[float, NodeInfo | str]] = [(rng.uniform(0, hub_floor), name) for name in sorted(leavers)]
    events += [(rng.uniform(0, hub_floor), info) for info in joiners]

    plan = plan_broadcast(0, up_bps[HUB], infos, k)
    present = {i.node_id for i in infos}
    punch_failures, _ = wan.fix_edges(plan, present)
    depth = plan.max_depth()
    engine = Engine(plan, sizes, up_bps, sorted(present), latency_s=latency_s, verify_bps=verify_MBps * MB,
                    window=window, links=wan, stall_timeout_s=stall_timeout_s, tick_s=tick_s,
                    wire_overhead=wire_overhead, per_chunk_s=per_chunk_s)
    done_at = engine.run(events)
    punch_failures += engine.repair_moves
    sent_by = engine.sent_by
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
        joiner_max_seconds=max((done_at[j] - t for j, t in engine.joined_at.items()), default=0.0),
        hub_sent_bytes=sent_by.get(HUB, 0), peer_sent_bytes=sum(b for n, b in sent_by.items() if n != HUB),
        nat_sent_bytes=sum(b for n, b in sent_by.items() if wan.nat.get(n)),
    )
