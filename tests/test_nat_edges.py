"""Who dials whom for a plan's edges (node.relay_state.WirePlan.dial_targets, pure): the child
dials a reachable parent; a NAT-bound parent (no address in the plan) dials its reachable
children; the two ends of every edge agree, so every edge of a plan the hub checked has exactly one
dialer."""

from __future__ import annotations

from echo2.learner_hub.planner import NodeInfo, check_plan, plan_broadcast
from echo2.node.relay_state import WirePlan

MBPS = 1e6


def test_every_edge_has_exactly_one_dialer_with_nat_relays() -> None:
    nodes = [NodeInfo(f"p{i}", 8 * MBPS, True) for i in range(5)] + [NodeInfo(f"n{i}", 8 * MBPS, False) for i in range(5)]
    plan = plan_broadcast(1, 8 * MBPS, nodes, 64, hub="hub", nat_relay=True)
    check_plan(plan)
    addrs = {n.node_id: f"10.0.0.{i}:1" for i, n in enumerate(nodes) if n.reachable}
    wire = WirePlan("hub", plan.stripes, plan.parent, plan.children, addrs)
    dials = {n.node_id: wire.dial_targets(n.node_id) for n in nodes}
    reverse = 0
    for s in range(plan.stripes):
        for child, parent in plan.parent[s].items():
            if parent == "hub":
                continue
            by_child, by_parent = parent in dials[child], child in dials[parent]
            assert by_child != by_parent, (s, parent, child)
            reverse += by_parent
            assert child in addrs if by_parent else parent in addrs  # nobody dials an address-less node
    assert reverse > 0  # NAT-bound parents dial out
    assert all(t in addrs for ts in dials.values() for t in ts)


def test_reachable_parent_is_dialled_by_its_child_only() -> None:
    wire = WirePlan("hub", 1, [{"a": "hub", "b": "a"}], [{"hub": ["a"], "a": ["b"]}], {"a": "x:1", "b": "y:1"})
    assert wire.dial_targets("b") == {"a"} and wire.dial_targets("a") == set()
    nat = WirePlan("hub", 1, [{"a": "hub", "b": "a"}], [{"hub": ["a"], "a": ["b"]}], {"b": "y:1"})
    assert nat.dial_targets("a") == {"b"} and nat.dial_targets("b") == set()
