"""The hub's broadcast planner (pure, no I/O).

Scheme: interleaved trees in the style of SplitStream. The chunks of a version are striped over
``S`` stripes (chunk ``i`` belongs to stripe ``i % S``) and every stripe has its own tree that
spans all nodes. Each fast, directly reachable node is interior in exactly one stripe (where it
forwards to about ``S`` children) and a leaf in all the others; slow and NAT-bound nodes are
leaves everywhere. So every relay uploads about ``M`` bytes in total (``S`` children times ``M/S``),
the hub uploads ``M`` (one copy per stripe root), no link carries more than its share and the
pipeline depth is only ``log_S N``: time ≈ ``M/b · (1 + S·depth/k)`` for ``k`` chunks. A plain
fan-out tree (one stripe) would multiply the floor by the fan-out, a chain would be ``N`` chunks
deep; ``bench/broadcast_sim.py`` compares all three (see ``scheme_table`` there).

A node's fan-out follows its measured upload: a node with twice the stream rate gets twice the
children. The plan is repaired on leave/join by :func:`replan` (orphans move, with their subtree,
under the shallowest interior node of that stripe with spare capacity, else under the hub).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

HUB = "hub"
DEFAULT_STRIPES = 2
MAX_FANOUT = 16
# A node uploading less than this fraction of the stream rate would throttle everything below it.
SLOW_FRACTION = 0.5
# Far above any link; an upload beyond it (or not finite) is a bug or a lie, never a bigger share.
MAX_UPLOAD_Bps = 1e12


@dataclass(frozen=True)
class NodeInfo:
    """What the planner needs to know about an active node. The hub fills it from what it
    observed (``links``: a dial-back proved ``reachable``, it timed ``upload_Bps``), never from
    the node's announce; only reachable nodes are ever parents."""

    node_id: str
    upload_Bps: float
    reachable: bool = True
    # NAT-bound, but the hub saw it keep its listen port behind its NAT (the port it announced came
    # back as the source port of its hub link), so a hole can be punched to it (node/punch.py)
    punchable: bool = False


@dataclass
class Plan:
    """Per-stripe trees. ``parent[s][n]`` is ``n``'s parent in stripe ``s`` (``hub`` for roots);
    ``children[s][p]`` lists ``p``'s children in stripe ``s`` (the hub included as a key)."""

    version: int
    hub: str
    stripes: int
    parent: list[dict[str, str]]
    children: list[dict[str, list[str]]]
    interior: dict[str, int] = field(default_factory=dict)  # node -> its one interior stripe
    capacity: dict[str, int] = field(default_factory=dict)  # node -> max children there
    hub_capacity: int = 1  # hub children per stripe it aims for (may be exceeded by repairs)
    reachable: dict[str, bool] = field(default_factory=dict)
    # NAT-bound parent -> NAT-bound child edges joined by hole punching (plan_broadcast nat_punch)
    nat_punch: bool = False
    punchable: dict[str, bool] = field(default_factory=dict)
    no_punch: set[frozenset[str]] = field(default_factory=set)  # pairs whose punch failed: never again

    @property
    def nodes(self) -> list[str]:
        return sorted(self.parent[0]) if self.parent else []

    def stripe_of(self, index: int) -> int:
        return index % self.stripes

    def parents_of(self, node: str) -> list[str]:
        """Parent per stripe."""
        return [p[node] for p in self.parent]

    def children_of(self, node: str, stripe: int) -> list[str]:
        return self.children[stripe].get(node, [])

    def depth(self, stripe: int) -> dict[str, int]:
        """Hops from the hub in ``stripe`` for every node reachable from the hub."""
        return _depths(self.children[stripe], self.hub)

    def max_depth(self) -> int:
        return max((max(self.depth(s).values(), default=0) for s in range(self.stripes)), default=0)

    def can_punch(self, a: str, b: str) -> bool:
        """Whether an edge between NAT-bound ``a`` and ``b`` may be planned (both ends punch)."""
        return (self.nat_punch and self.punchable.get(a, False) and self.punchable.get(b, False)
                and frozenset((a, b)) not in self.no_punch)

    def punch_edges(self) -> list[tuple[int, str, str]]:
        """``(stripe, parent, child)`` of every edge between two NAT-bound nodes (to be punched)."""
        out = []
        for s in range(self.stripes):
            for c, p in sorted(self.parent[s].items()):
                if p != self.hub and not self.reachable.get(p, True) and not self.reachable.get(c, True):
                    out.append((s, p, c))
        return out

    def single_tree_maps(self) -> tuple[dict[str, str], dict[str, list[str]]]:
        """``parent_of``/``children`` of stripe 0, for a wire message that has one tree only."""
        return dict(self.parent[0]), {k: list(v) for k, v in self.children[0].items()}


def _depths(children: dict[str, list[str]], root: str) -> dict[str, int]:
    depth = {root: 0}
    queue = deque([root])
    while queue:
        p = queue.popleft()
        for c in children.get(p, ()):
            if c not in depth:
                depth[c] = depth[p] + 1
                queue.append(c)
    return depth


def star_plan(version: int, nodes: Iterable[NodeInfo | str], *, hub: str = HUB) -> Plan:
    """The hub sends everything to everybody (the baseline)."""
    ids = sorted(n if isinstance(n, str) else n.node_id for n in nodes)
    reach = {n.node_id: n.reachable for n in nodes if isinstance(n, NodeInfo)}
    return Plan(
        version=version,
        hub=hub,
        stripes=1,
        parent=[{n: hub for n in ids}],
        children=[{hub: list(ids)}],
        hub_capacity=max(1, len(ids)),
        reachable={n: reach.get(n, True) for n in ids},
    )


def plan_broadcast(
    version: int,
    hub_upload_Bps: float,
    nodes: Sequence[NodeInfo],
    n_chunks: int,
    *,
    hub: str = HUB,
    stripes: int | None = None,
    fanout: int | None = None,
    max_fanout: int = MAX_FANOUT,
    nat_relay: bool = False,
    nat_punch: bool = False,
    no_punch: Iterable[frozenset[str]] = (),
) -> Plan:
    """Plan the broadcast of one version.

    ``stripes`` defaults to :data:`DEFAULT_STRIPES` (chosen by simulation); it is cut to the
    number of chunks and of nodes fit to be interior. ``fanout`` forces every interior node's
    fan-out (for comparisons: ``stripes=1, fanout=1`` is a chain, ``stripes=1, fanout=f`` a plain
    tree); by default a node's fan-out is ``stripes · upload / stream_rate``.

    ``nat_relay``: NAT-bound nodes may be interior too, with reachable children only (the NATed
    parent dials its child and pushes: a reverse connection); a NAT-bound node's parent is always
    the hub or a reachable node. Without it NAT-bound nodes are leaves everywhere.

    ``nat_punch`` (implies ``nat_relay``): a NAT-bound node that finds no reachable slot goes under
    a NAT-bound relay before the hub, when both are ``punchable`` and the pair is not in
    ``no_punch`` (pairs whose punch failed before); both ends punch a hole for that edge
    (:meth:`Plan.punch_edges`, ``node/punch.py``), and the child falls back to a reachable parent
    (:func:`unpunch`) if the punch fails.
    """
    nat_relay = nat_relay or nat_punch
    if not (math.isfinite(hub_upload_Bps) and hub_upload_Bps > 0):
        raise ValueError("hub upload bandwidth must be positive and finite")
    seen: set[str] = set()
    for n in nodes:
        if n.node_id in seen or n.node_id == hub:
            raise ValueError(f"duplicate or reserved node id {n.node_id!r}")
        seen.add(n.node_id)
    if not nodes:
        return Plan(version, hub, 1, [{}], [{hub: []}])
    nodes = [_sane(n) for n in nodes]
    s_req = DEFAULT_STRIPES if stripes is None else stripes
    if s_req < 1:
        raise ValueError("stripes must be >= 1")

    reach_bw = sorted(n.upload_Bps for n in nodes if n.reachable and n.upload_Bps > 0)
    # The rate the whole version can flow at: no faster than the hub, and sized for the typical
    # relay so that it can feed `stripes` children at full stripe rate.
    median = reach_bw[len(reach_bw) // 2] if reach_bw else 0.0
    rate = min(hub_upload_Bps, median) if median > 0 else hub_upload_Bps
    eligible = sorted(
        (n for n in nodes if (n.reachable or nat_relay) and n.upload_Bps >= SLOW_FRACTION * rate),
        key=lambda n: (-n.upload_Bps, n.node_id),
    )
    n_stripes = max(1, min(s_req, n_chunks if n_chunks > 0 else 1, len(eligible) or 1))
    punchable = {n.node_id: not n.reachable and n.punchable for n in nodes}
    failed = {frozenset(pair) for pair in no_punch}

    def punch(p: str, c: str) -> bool:
        return nat_punch and punchable[p] and punchable[c] and frozenset((p, c)) not in failed

    stripe_rate = rate / n_stripes

    capacity: dict[str, int] = {}
    for n in eligible:
        cap = fanout if fanout is not None else int(n.upload_Bps / stripe_rate + 1e-9)
        capacity[n.node_id] = max(1, min(max_fanout, cap))
    hub_cap = max(1, min(max_fanout, int(hub_upload_Bps / rate + 1e-9)))
    if fanout is not None and n_stripes == 1:
        hub_cap = 1  # chain / plain-tree baselines start from one root

    # Interior groups: fastest first, each to the stripe with the least capacity so far.
    groups: list[list[NodeInfo]] = [[] for _ in range(n_stripes)]
    group_cap = [0] * n_stripes
    # With NAT-bound relays, reachable nodes are spread first: a stripe whose interior nodes were
    # all NAT-bound would have no reachable slot for its NAT-bound children, which then fell back
    # to the hub (bench --netns --nat 4 at N = 8: the hub sent 2 x M, ratio 2.2-2.6 against 1.3).
    spread = sorted(eligible, key=lambda n: (not n.reachable, -n.upload_Bps, n.node_id)) if nat_relay else eligible
    for n in spread:
        s = min(range(n_stripes), key=lambda j: (group_cap[j], j))
        groups[s].append(n)
        group_cap[s] += capacity[n.node_id]
    interior = {n.node_id: s for s, g in enumerate(groups) for n in g}

    order_rest = sorted(
        (n for n in nodes if n.node_id not in interior),
        key=lambda n: (not n.reachable, -n.upload_Bps, n.node_id),
    )
    total = len(nodes)
    parents: list[dict[str, str]] = []
    childs: list[dict[str, list[str]]] = []
    for s in range(n_stripes):
        inner = groups[s]
        # Enough slots for every node not under the hub; if not, widen the fastest nodes.
        need = total - min(hub_cap, total)
        have = sum(capacity[n.node_id] for n in inner)
        # Each extra slot goes to the relay whose children would then get the most upload each
        # (upload / (slots + 1)), not round-robin: on a log-uniform 2-125 MB/s fleet with 70%
        # NATed leaves, round-robin overloaded the 5 MB/s relays as much as the 100 MB/s ones.
        widen = [(-n.upload_Bps / (capacity[n.node_id] + 1), n.node_id, n.upload_Bps) for n in inner]
        heapq.heapify(widen)
        while widen and have < need:
            _, nid, up = heapq.heappop(widen)
            capacity[nid] += 1
            have += 1
            heapq.heappush(widen, (-up / (capacity[nid] + 1), nid, up))
        others = [n for n in eligible if interior[n.node_id] != s]
        if nat_relay:
            parent, children = _fill_nat(hub, hub_cap if inner else total, inner, others, order_rest, interior, capacity,
                                         s, punch)
        else:
            order = [n.node_id for n in inner] + [n.node_id for n in others] + [n.node_id for n in order_rest]
            parent, children = _fill(hub, hub_cap if inner else total, order, interior, capacity, s)
        parents.append(parent)
        childs.append(children)
    plan = Plan(
        version=version,
        hub=hub,
        stripes=n_stripes,
        parent=parents,
        children=childs,
        interior=interior,
        capacity=capacity,
        hub_capacity=hub_cap,
        reachable={n.node_id: n.reachable for n in nodes},
        nat_punch=nat_punch,
        punchable=punchable,
        no_punch=failed,
    )
    log.debug("plan v%d: %d nodes, %d stripes, depth %d", version, total, n_stripes, plan.max_depth())
    return plan


def _fill(hub: str, hub_slots: int, order: list[str], interior: dict[str, int], capacity: dict[str, int],
          s: int) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Breadth-first: each node in ``order`` takes the first open slot (the hub's, then each
    interior node's as it is placed)."""
    parent: dict[str, str] = {}
    children: dict[str, list[str]] = {hub: []}
    slots: deque[tuple[str, int]] = deque([(hub, hub_slots)])
    for nid in order:
        while slots and len(children[slots[0][0]]) >= slots[0][1]:
            slots.popleft()
        p = slots[0][0] if slots else hub
        parent[nid] = p
        children.setdefault(p, []).append(nid)
        if interior.get(nid) == s:
            children[nid] = []
            slots.append((nid, capacity[nid]))
    return parent, children


def _fill_nat(hub: str, hub_slots: int, inner: list[NodeInfo], others: list[NodeInfo], rest: list[NodeInfo],
              interior: dict[str, int], capacity: dict[str, int], s: int,
              punch: Callable[[str, str], bool]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Like :func:`_fill`, but a NAT-bound node only under the hub or a reachable node (two NATs
    need a hole punched: under a NAT-bound relay only where ``punch(parent, child)`` allows it,
    and only once no reachable slot is left: a punch may fail), and a reachable node under a NAT-bound one first, so that the
    reachable slots are kept for the nodes that need them. Order: the first reachable interior
    node (the root), the NAT-bound interior nodes (their slots open early for reachable nodes),
    the other interior nodes, reachable non-interior nodes, then NAT-bound ones."""
    reach = {n.node_id: n.reachable for n in [*inner, *others, *rest]}
    pub_inner = [n.node_id for n in inner if n.reachable]
    nat_inner = [n.node_id for n in inner if not n.reachable]
    order = pub_inner[:1] + nat_inner + pub_inner[1:]
    tail = [n.node_id for n in [*others, *rest]]
    order += [n for n in tail if reach[n]] + [n for n in tail if not reach[n]]
    parent: dict[str, str] = {}
    children: dict[str, list[str]] = {hub: []}
    pub_slots: deque[tuple[str, int]] = deque([(hub, hub_slots)])
    nat_slots: deque[tuple[str, int]] = deque()
    for nid in order:
        for q in (pub_slots, nat_slots):
            while q and len(children[q[0][0]]) >= q[0][1]:
                q.popleft()
        if reach[nid] and nat_slots:
            p = nat_slots[0][0]
        elif pub_slots:
            p = pub_slots[0][0]
        elif (np := next((r for r, cap in nat_slots if len(children[r]) < cap and punch(r, nid)), None)) is not None:
            p = np  # NAT under NAT: both ends punch a hole (node/punch.py)
        else:
            p = hub  # no reachable slot left: the hub takes one more
            log.debug("stripe %d: NAT-bound %s under the hub, no reachable slot", s, nid)
        parent[nid] = p
        children.setdefault(p, []).append(nid)
        if interior.get(nid) == s:
            children[nid] = []
            (pub_slots if reach[nid] else nat_slots).append((nid, capacity[nid]))
    return parent, children


def _sane(n: NodeInfo) -> NodeInfo:
    up = n.upload_Bps
    if not (math.isfinite(up) and up > 0):
        up = 0.0
    up = min(up, MAX_UPLOAD_Bps)
    return n if up == n.upload_Bps else dataclasses.replace(n, upload_Bps=up)


def check_plan(plan: Plan) -> None:
    """Raise ValueError unless the plan's invariants hold: in every stripe each node has one
    parent, is reachable from the hub, no cycles, parent/children agree; a node has children in
    at most one stripe (its interior one); a NAT-bound node's children are all reachable (it dials
    them), and its parent is the hub or a reachable node."""
    nodes = set(plan.parent[0]) if plan.parent else set()
    for s in range(plan.stripes):
        parent, children = plan.parent[s], plan.children[s]
        if set(parent) != nodes:
            raise ValueError(f"stripe {s}: node set differs")
        for p, cs in children.items():
            if p != plan.hub and p not in nodes:
                raise ValueError(f"stripe {s}: unknown parent {p}")
            for c in cs:
                if parent.get(c) != p:
                    raise ValueError(f"stripe {s}: {c} listed under {p} but parent is {parent.get(c)}")
        listed = sum(len(cs) for cs in children.values())
        if listed != len(nodes):
            raise ValueError(f"stripe {s}: {listed} child entries for {len(nodes)} nodes")
        depth = plan.depth(s)
        if set(depth) - {plan.hub} != nodes:
            raise ValueError(f"stripe {s}: nodes not reachable from the hub (cycle?)")
        for p, cs in children.items():
            if cs and p != plan.hub:
                if plan.interior.get(p) != s:
                    raise ValueError(f"stripe {s}: {p} has children but is interior in {plan.interior.get(p)}")
                if not plan.reachable.get(p, True):
                    nat = [c for c in cs if not plan.reachable.get(c, True) and not plan.can_punch(p, c)]
                    if nat:
                        raise ValueError(f"stripe {s}: NAT-bound {p} has NAT-bound children {nat} it cannot punch to")


def _attach(plan: Plan, s: int, node: str, depth: dict[str, int], exclude: set[str]) -> None:
    children = plan.children[s]
    best: tuple[int, str] | None = None
    # No spare slot anywhere: the least loaded relay (load = children per slot) takes one more
    # child rather than the hub. An extra hub child slows every node, an extra relay child only
    # that relay's subtree: with all slots used (the usual case, plan_broadcast fills them), the
    # WAN simulator's 10% churn put every orphan and joiner under the hub and took N = 200 from
    # 1.02 to 29 x the fluid bound.
    spill: tuple[float, int, str] | None = None
    for cand, st in plan.interior.items():
        if st != s or cand in exclude or cand not in depth:
            continue
        if not plan.reachable.get(node, True) and not plan.reachable.get(cand, True):
            continue  # NAT under NAT: no connection could exist
        n_children, cap = len(children.get(cand, ())), plan.capacity.get(cand, 0)
        if n_children < cap:
            key = (depth[cand], cand)
            if best is None or key < best:
                best = key
        elif best is None and cap > 0:
            skey = ((n_children + 1) / cap, depth[cand], cand)
            if spill is None or skey < spill:
                spill = skey
    if best is None and spill is not None:
        best = (spill[1], spill[2])
    p = plan.hub if best is None else best[1]
    plan.parent[s][node] = p
    children.setdefault(p, []).append(node)
    # The moved subtree's depths shift; later choices in this repair need them right.
    base = depth[p] + 1
    sub = _depths(children, node)
    for n, d in sub.items():
        depth[n] = base + d


def _subtree(children: dict[str, list[str]], root: str) -> set[str]:
    return set(_depths(children, root))


def _copy(plan: Plan) -> Plan:
    return Plan(
        version=plan.version,
        hub=plan.hub,
        stripes=plan.stripes,
        parent=[dict(p) for p in plan.parent],
        children=[{k: list(v) for k, v in c.items()} for c in plan.children],
        interior=dict(plan.interior),
        capacity=dict(plan.capacity),
        hub_capacity=plan.hub_capacity,
        reachable=dict(plan.reachable),
        nat_punch=plan.nat_punch,
        punchable=dict(plan.punchable),
        no_punch=set(plan.no_punch),
    )


def unpunch(plan: Plan, a: str, b: str) -> tuple[Plan, int]:
    """The hole punch between NAT-bound ``a`` and ``b`` failed: (a new plan, edges moved). In
    every stripe where one is the other's parent, the child moves with its subtree to another
    parent by the repair rule (:func:`_attach`: a reachable relay with a spare slot, else the
    least loaded one, else the hub; never a NAT-bound relay: a fallback punches no second hole),
    and the pair is never planned again (``no_punch``). Bulk data never goes through a relay: the
    child gets a direct parent or the hub."""
    new = _copy(plan)
    new.no_punch.add(frozenset((a, b)))
    moved = 0
    for s in range(new.stripes):
        for parent, child in ((a, b), (b, a)):
            if new.parent[s].get(child) != parent:
                continue
            children = new.children[s]
            children[parent].remove(child)
            _attach(new, s, child, new.depth(s), _subtree(children, child) | {parent})
            moved += 1
    if moved:
        log.info("plan v%d: punch %s <-> %s failed; %d edge(s) moved to other parents", new.version, a, b, moved)
    return new, moved


def replan(plan: Plan, left: Iterable[str] = (), joined: Iterable[NodeInfo] = ()) -> Plan:
    """Repair ``plan`` (a new object; the old one is untouched) when nodes leave or join during a
    broadcast. Orphans keep their subtrees; joined nodes become leaves in every stripe."""
    new = _copy(plan)
    gone = {n for n in left if n in new.reachable or (new.parent and n in new.parent[0])}
    for s in range(new.stripes):
        parent, children = new.parent[s], new.children[s]
        orphans: list[str] = []
        for g in gone:
            p = parent.pop(g, None)
            if p is not None and g in children.get(p, []):
                children[p].remove(g)
            orphans.extend(c for c in children.pop(g, []) if c not in gone)
        depth = _depths(children, new.hub)
        # Interior orphans first so that they take the shallow slots; then by id for determinism.
        orphans.sort(key=lambda n: (new.interior.get(n) != s, n))
        for o in orphans:
            _attach(new, s, o, depth, _subtree(children, o))
    for g in gone:
        new.interior.pop(g, None)
        new.capacity.pop(g, None)
        new.reachable.pop(g, None)
    for n in joined:
        if n.node_id == new.hub or (new.parent and n.node_id in new.parent[0]):
            continue
        new.reachable[n.node_id] = n.reachable
        for s in range(new.stripes):
            _attach(new, s, n.node_id, _depths(new.children[s], new.hub), set())
    log.debug("replan v%d: -%d +%d nodes", new.version, len(gone), len(new.reachable) - len(plan.reachable) + len(gone))
    return new
