"""Who dials whom for a plan's edges (node.relay_state.WirePlan.dial_targets, pure): the child
dials a reachable parent; a NAT-bound parent (no address in the plan) dials its reachable
children; the two ends of every edge agree, so every edge of a plan the hub checked has exactly one
dialer. Two NAT-bound ends punch a hole (WirePlan.punch_targets, planner nat_punch): both ends
agree with one handshake dialer, and a failed punch moves the child to a direct parent (unpunch)."""

from __future__ import annotations

import pytest

from echo2.learner_hub.links import punch_addr
from echo2.learner_hub.planner import NodeInfo, Plan, check_plan, plan_broadcast, unpunch
from echo2.node.relay_state import WirePlan
from echo2.protocol.errors import SchemaError
from echo2.protocol.wire import REQ_HELLO, REQ_PUNCH, decode_request, encode_request

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


# --- hole punching between two NAT-bound nodes (node.punch) ----------------------------------------


def _nat_fleet(pub: int, nat: int, *, punchable: bool = True) -> list[NodeInfo]:
    return ([NodeInfo(f"p{i}", 8 * MBPS, True) for i in range(pub)]
            + [NodeInfo(f"n{i}", 8 * MBPS, False, punchable=punchable) for i in range(nat)])


def _wire(plan: Plan, nodes: list[NodeInfo]) -> WirePlan:
    addrs = {n.node_id: f"10.0.0.{i}:1" for i, n in enumerate(nodes) if n.reachable}
    ends = {x for _s, p, c in plan.punch_edges() for x in (p, c)}
    punch = {n: f"10.9.0.{i}:4001" for i, n in enumerate(sorted(ends))}
    return WirePlan("hub", plan.stripes, plan.parent, plan.children, addrs, punch)


def test_nat_punch_plans_nat_under_nat_only_for_punchable_pairs() -> None:
    # only NAT-bound nodes: without punching every one of them hangs under the hub
    nodes = _nat_fleet(0, 4)
    plain = plan_broadcast(1, 8 * MBPS, nodes, 64, hub="hub", nat_relay=True)
    check_plan(plain)
    assert plain.punch_edges() == [] and all(p == "hub" for s in range(plain.stripes) for p in plain.parent[s].values())
    punched = plan_broadcast(1, 8 * MBPS, nodes, 64, hub="hub", nat_punch=True)
    check_plan(punched)
    edges = punched.punch_edges()
    assert edges and sum(p == "hub" for p in punched.parent[0].values()) < 4  # the hub sends less
    # not punchable (the hub saw the NAT rewrite the port): no NAT under NAT
    never = plan_broadcast(1, 8 * MBPS, _nat_fleet(0, 4, punchable=False), 64, hub="hub", nat_punch=True)
    check_plan(never)
    assert never.punch_edges() == []
    # a pair whose punch failed is never planned again
    failed = {frozenset((p, c)) for _s, p, c in edges}
    again = plan_broadcast(2, 8 * MBPS, nodes, 64, hub="hub", nat_punch=True, no_punch=failed)
    check_plan(again)
    assert not {frozenset((p, c)) for _s, p, c in again.punch_edges()} & failed


def test_reachable_slots_first_then_punch_then_the_hub() -> None:
    # with reachable parents to spare, NAT-bound children take those (a punch may fail)
    nodes = _nat_fleet(4, 4)
    plan = plan_broadcast(1, 8 * MBPS, nodes, 64, hub="hub", nat_punch=True)
    check_plan(plan)
    for s, p, c in plan.punch_edges():
        reach_slots = [q for q, st in plan.interior.items() if st == s and plan.reachable[q]
                       and len(plan.children[s].get(q, [])) < plan.capacity[q]]
        assert not reach_slots, (s, p, c, reach_slots)


def test_check_plan_refuses_nat_under_nat_without_punch() -> None:
    plan = plan_broadcast(1, 8 * MBPS, _nat_fleet(0, 2), 64, hub="hub", nat_punch=True)
    assert plan.punch_edges()
    check_plan(plan)
    plan.nat_punch = False
    with pytest.raises(ValueError, match="cannot punch"):
        check_plan(plan)


def test_punch_targets_agree_on_both_ends_with_one_dialer() -> None:
    for pub, nat in ((0, 2), (0, 5), (2, 6), (3, 9)):
        nodes = _nat_fleet(pub, nat)
        plan = plan_broadcast(1, 8 * MBPS, nodes, 64, hub="hub", nat_punch=True)
        check_plan(plan)
        wire = _wire(plan, nodes)
        targets = {n.node_id: wire.punch_targets(n.node_id) for n in nodes}
        pairs = {frozenset((p, c)) for _s, p, c in plan.punch_edges()}
        seen = {frozenset((a, b)) for a, ts in targets.items() for b in ts}
        assert seen == pairs  # exactly the plan's NAT<->NAT edges, nothing else
        for a, ts in targets.items():
            for b, edge in ts.items():
                back = targets[b][a]  # the other end punches to us too ...
                assert edge.dialer != back.dialer  # ... and exactly one of us speaks as the dialer
                assert edge.addr == wire.punch_addrs[b]
        # a punched edge is never also dialled (neither end has a data address)
        dials = {n.node_id: wire.dial_targets(n.node_id) for n in nodes}
        assert all(b not in dials[a] for a, ts in targets.items() for b in ts)
    # an end with a data address (reachable) never punches: it is dialled
    w = WirePlan("hub", 1, [{"a": "hub", "b": "a"}], [{"hub": ["a"], "a": ["b"]}], {"a": "x:1"}, {"a": "x:1", "b": "y:1"})
    assert w.punch_targets("a") == {} and w.punch_targets("b") == {}


def test_unpunch_moves_the_child_to_a_reachable_parent_or_the_hub() -> None:
    for pub, nat in ((0, 3), (2, 6), (4, 12)):
        nodes = _nat_fleet(pub, nat)
        plan = plan_broadcast(1, 8 * MBPS, nodes, 64, hub="hub", nat_punch=True)
        edges = plan.punch_edges()
        assert edges, (pub, nat)
        s, p, c = edges[0]
        new, moved = unpunch(plan, p, c)
        check_plan(new)
        assert moved >= 1 and frozenset((p, c)) in new.no_punch
        for st in range(new.stripes):
            for x, y in ((p, c), (c, p)):  # the pair may be an edge in both directions (two stripes)
                if plan.parent[st][y] == x:
                    q = new.parent[st][y]
                    assert q == "hub" or new.reachable[q]  # a direct parent, never a second punch, never a relay
        assert {frozenset((x, y)) for _s, x, y in new.punch_edges()} <= {frozenset((x, y)) for _s, x, y in edges}
        assert frozenset((p, c)) not in {frozenset((x, y)) for _s, x, y in new.punch_edges()}
        assert plan.parent[s][c] == p  # the old plan is untouched
        assert unpunch(new, c, p)[1] == 0  # a second report (from the other end) moves nothing


def test_punch_addr_needs_the_listen_port_kept_by_the_nat() -> None:
    assert punch_addr("10.213.0.3", 4001, 4001, 4001) == "10.213.0.3:4001"  # MASQUERADE kept the port
    assert punch_addr("10.213.0.3", 61234, 4001, 4001) == ""  # the NAT rewrote it: no punch
    assert punch_addr("10.213.0.3", 4001, 0, 4001) == ""  # the hub link did not leave from the listen port
    assert punch_addr("10.213.0.3", 4001, 4001, 4002) == ""  # bound another port than the one announced
    assert punch_addr("0.0.0.0", 4001, 4001, 4001) == "" and punch_addr(None, 4001, 4001, 4001) == ""


def test_punch_report_wire() -> None:
    kind, d = decode_request(encode_request(REQ_PUNCH, v=3, peer="12D3KooWx", ok=True, s=0.25))
    assert kind == REQ_PUNCH and d["ok"] is True and d["peer"] == "12D3KooWx"
    for bad in (dict(v=-1, peer="x", ok=True, s=0.1), dict(v=1, peer="", ok=True, s=0.1),
                dict(v=1, peer="x" * 129, ok=True, s=0.1), dict(v=1, peer="x", ok=1, s=0.1),
                dict(v=1, peer="x", ok=True, s=-1.0), dict(v=1, peer="x", ok=True)):
        with pytest.raises(SchemaError):
            decode_request(encode_request(REQ_PUNCH, **bad))
    assert decode_request(encode_request(REQ_HELLO, addr="a:1", up=1.0, lport=4001))[1]["lport"] == 4001
    with pytest.raises(SchemaError):
        decode_request(encode_request(REQ_HELLO, addr="a:1", up=1.0, lport=70000))


def test_random_fleets_with_punching_keep_the_plan_invariants_through_repairs() -> None:
    import random

    from echo2.learner_hub.planner import replan

    punched = 0
    for seed in range(30):
        rng = random.Random(seed)
        nodes = [NodeInfo(f"x{i:02d}", rng.choice([2, 8, 20, 60]) * MBPS, rng.random() < 0.4,
                          punchable=rng.random() < 0.8) for i in range(rng.randint(2, 40))]
        plan = plan_broadcast(1, 10 * MBPS, nodes, rng.choice([4, 64, 300]), hub="hub", nat_punch=True,
                              stripes=rng.choice([None, 1, 3]))
        check_plan(plan)
        for _s, p, c in plan.punch_edges():
            assert plan.can_punch(p, c)
        edges = plan.punch_edges()
        punched += bool(edges)
        if edges:
            _s, p, c = edges[rng.randrange(len(edges))]
            plan, _ = unpunch(plan, p, c)
            check_plan(plan)
        left = rng.sample([n.node_id for n in nodes], k=min(3, len(nodes) - 1))
        joined = [NodeInfo("j1", 8 * MBPS, False, punchable=True), NodeInfo("j2", 8 * MBPS, True)]
        plan = replan(plan, left=left, joined=joined)
        check_plan(plan)
    assert punched >= 5  # the fleets did make NAT<->NAT edges
