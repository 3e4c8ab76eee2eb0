"""Planner invariants, for fresh plans and after repairs."""

from __future__ import annotations

import math
import random

import pytest

from echo2.learner_hub.planner import HUB, NodeInfo, Plan, check_plan, plan_broadcast, replan, star_plan

MBPS = 1_000_000


def homogeneous(n: int, bw: float = 10 * MBPS) -> list[NodeInfo]:
    return [NodeInfo(f"n{i}", bw) for i in range(n)]


def fanout_ok(plan: Plan) -> None:
    for s in range(plan.stripes):
        for p, cs in plan.children[s].items():
            if p != HUB and cs:
                assert len(cs) <= plan.capacity[p]


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64, 1000])
def test_fresh_plan_invariants(n: int) -> None:
    plan = plan_broadcast(3, 10 * MBPS, homogeneous(n), 64)
    check_plan(plan)
    fanout_ok(plan)
    assert plan.version == 3
    assert plan.stripes == min(2, n)
    assert sorted(plan.nodes) == sorted(f"n{i}" for i in range(n))
    # each node is interior in at most one stripe: check_plan enforces it, count it here too
    for node in plan.nodes:
        with_children = [s for s in range(plan.stripes) if plan.children_of(node, s)]
        assert len(with_children) <= 1
    # pipeline depth stays logarithmic
    assert plan.max_depth() <= math.ceil(math.log2(max(n, 2))) + 2
    # every relay uploads about one copy: children in its one stripe == stripes (homogeneous)
    if n >= 8:
        full = [len(plan.children_of(x, plan.interior[x])) for x in plan.interior]
        assert max(full) <= plan.stripes + 1


def test_nat_and_slow_nodes_are_leaves_fast_nodes_high() -> None:
    rng = random.Random(1)
    nodes = []
    for i in range(300):
        kind = rng.random()
        if kind < 0.2:
            nodes.append(NodeInfo(f"nat{i}", 10 * MBPS, reachable=False))
        elif kind < 0.35:
            nodes.append(NodeInfo(f"slow{i}", 1 * MBPS))
        else:
            nodes.append(NodeInfo(f"fast{i}", rng.uniform(8, 30) * MBPS))
    plan = plan_broadcast(0, 10 * MBPS, nodes, 100)
    check_plan(plan)
    for s in range(plan.stripes):
        for p, cs in plan.children[s].items():
            if cs and p != HUB:
                assert p.startswith("fast"), p
        d = plan.depth(s)
        fast = [d[n.node_id] for n in nodes if n.node_id.startswith("fast")]
        other = [d[n.node_id] for n in nodes if not n.node_id.startswith("fast")]
        assert sum(fast) / len(fast) < sum(other) / len(other)


def test_fanout_follows_bandwidth() -> None:
    nodes = homogeneous(20) + [NodeInfo("big", 40 * MBPS)]
    plan = plan_broadcast(0, 10 * MBPS, nodes, 50)
    check_plan(plan)
    assert plan.capacity["big"] > plan.capacity["n0"]
    # fastest node sits right under the hub in its stripe
    assert plan.parent[plan.interior["big"]]["big"] == HUB


def test_all_nat_falls_back_to_hub() -> None:
    nodes = [NodeInfo(f"n{i}", 10 * MBPS, reachable=False) for i in range(5)]
    plan = plan_broadcast(0, 10 * MBPS, nodes, 10)
    check_plan(plan)
    assert plan.stripes == 1
    assert sorted(plan.children[0][HUB]) == sorted(n.node_id for n in nodes)


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        plan_broadcast(0, 10 * MBPS, [NodeInfo("a", 1.0), NodeInfo("a", 2.0)], 4)
    with pytest.raises(ValueError):
        plan_broadcast(0, 10 * MBPS, [NodeInfo(HUB, 1.0)], 4)
    with pytest.raises(ValueError):
        plan_broadcast(0, 0, homogeneous(3), 4)


def test_check_plan_catches_cycle_and_nat_relay() -> None:
    plan = plan_broadcast(0, 10 * MBPS, homogeneous(8), 16)
    # make two nodes each other's parent in stripe 0
    a, b = plan.children[0][HUB][0], plan.children[0][plan.children[0][HUB][0]][0]
    bad = replan(plan)
    bad.children[0][HUB].remove(a)
    bad.children[0][b].append(a)
    bad.parent[0][a] = b
    with pytest.raises(ValueError):
        check_plan(bad)
    nat = replan(plan)
    nat.reachable[a] = False
    check_plan(nat)  # a NAT-bound parent of reachable children: it dials them (reverse connection)
    nat.reachable[b] = False
    with pytest.raises(ValueError):  # NAT under NAT: no connection could exist without a punch
        check_plan(nat)


def test_nat_relay_plans_nat_bound_parents_of_reachable_children_only() -> None:
    nodes = [NodeInfo(f"p{i}", 8 * MBPS, True) for i in range(4)] + [NodeInfo(f"n{i}", 8 * MBPS, False) for i in range(4)]
    leaves = plan_broadcast(1, 8 * MBPS, nodes, 64)
    check_plan(leaves)
    assert not any(leaves.children[s].get(f"n{i}") for s in range(leaves.stripes) for i in range(4))
    plan = plan_broadcast(1, 8 * MBPS, nodes, 64, nat_relay=True)
    check_plan(plan)
    nat_parents = {p for s in range(plan.stripes) for p, cs in plan.children[s].items() if cs and p.startswith("n")}
    assert len(nat_parents) == 4  # every NAT-bound node relays
    for s in range(plan.stripes):
        assert len(plan.children[s][HUB]) <= plan.hub_capacity  # nobody spilled onto the hub
    # whatever the ids (they order the interior groups), no stripe is left without a reachable relay
    # (before the planner spread reachable nodes first, 10 of these 20 fleets overflowed the hub)
    for seed in range(20):
        rng = random.Random(seed)
        mixed = [NodeInfo(f"x{rng.random():.6f}", 8 * MBPS, i < 4) for i in range(8)]
        s_plan = plan_broadcast(1, 8 * MBPS, mixed, 64, nat_relay=True)
        check_plan(s_plan)
        assert all(len(s_plan.children[s][HUB]) <= s_plan.hub_capacity for s in range(s_plan.stripes))
    # a repair keeps NAT-bound orphans under reachable parents
    p0 = next(p for p in plan.children[0][HUB])
    check_plan(replan(plan, left=[p0]))


def test_star_plan() -> None:
    plan = star_plan(1, ["x", "y", "z"])
    check_plan(plan)
    assert plan.children[0][HUB] == ["x", "y", "z"]


def test_replan_after_interior_leave_keeps_invariants() -> None:
    plan = plan_broadcast(0, 10 * MBPS, homogeneous(100), 64)
    before = {s: dict(plan.parent[s]) for s in range(plan.stripes)}
    # the busiest relays leave: one root and one mid-tree node per stripe
    leave = []
    for s in range(plan.stripes):
        root = plan.children[s][HUB][0]
        leave += [root, plan.children[s][root][0]]
    new = replan(plan, left=leave)
    check_plan(new)
    fanout_ok_relaxed = all(
        len(cs) <= new.capacity.get(p, 0) or p == HUB
        for s in range(new.stripes) for p, cs in new.children[s].items() if cs
    )
    assert fanout_ok_relaxed
    assert not set(leave) & set(new.nodes)
    assert len(new.nodes) == 100 - len(leave)
    assert {s: dict(plan.parent[s]) for s in range(plan.stripes)} == before  # old plan untouched
    # nodes whose parent stayed keep it (repair is local)
    moved = sum(
        1 for s in range(new.stripes) for n, p in new.parent[s].items() if before[s][n] != p
    )
    assert moved <= 4 * len(leave)


def test_replan_join_and_random_churn() -> None:
    rng = random.Random(7)
    plan = plan_broadcast(0, 10 * MBPS, homogeneous(60), 64)
    next_id = 1000
    for _ in range(30):
        nodes = plan.nodes
        left = rng.sample(nodes, k=min(len(nodes), rng.randint(0, 4)))
        joined = [
            NodeInfo(f"j{next_id + j}", rng.uniform(1, 20) * MBPS, reachable=rng.random() > 0.3)
            for j in range(rng.randint(0, 4))
        ]
        next_id += 10
        plan = replan(plan, left=left, joined=joined)
        check_plan(plan)
        for j in joined:
            assert all(not plan.children_of(j.node_id, s) for s in range(plan.stripes))
    assert plan.nodes


def test_replan_everyone_leaves() -> None:
    plan = plan_broadcast(0, 10 * MBPS, homogeneous(10), 8)
    new = replan(plan, left=plan.nodes)
    check_plan(new)
    assert new.nodes == []
    back = replan(new, joined=homogeneous(3))
    check_plan(back)
    assert sorted(back.children[0][HUB]) == ["n0", "n1", "n2"]


def test_a10_absurd_uploads_neither_crash_the_planner_nor_buy_a_bigger_share() -> None:
    """An upload that is not finite, negative or astronomical (a bug or a lie that slipped past
    the hub's own measurement) is planned as no upload or as the cap: never a crash, never more
    than ``MAX_FANOUT`` children."""
    nodes = homogeneous(6) + [
        NodeInfo("inf", math.inf), NodeInfo("nan", math.nan), NodeInfo("neg", -5.0), NodeInfo("huge", 1e308),
    ]
    plan = plan_broadcast(1, 10 * MBPS, nodes, 64)
    check_plan(plan)
    fanout_ok(plan)
    for bad in ("inf", "nan", "neg"):
        assert bad not in plan.interior
    assert plan.capacity.get("huge", 0) <= 16
    for hub_up in (math.inf, math.nan, 0.0):
        with pytest.raises(ValueError):
            plan_broadcast(1, hub_up, nodes, 64)
