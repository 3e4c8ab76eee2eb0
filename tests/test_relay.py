"""Relay state machine: cut-through, windows, stalls, corrupt chunks, plan changes."""

from __future__ import annotations

from echo2.learner_hub.planner import Plan
from echo2.protocol.relay import (
    Complete,
    Evidence,
    Relay,
    Report,
    Request,
    Send,
    bitmap_from_indices,
    indices_from_bitmap,
)

N = 8
HASHES = [bytes([i]) * 32 for i in range(N)]


def two_stripe_plan() -> Plan:
    # me: child of p0 in stripe 0 (and interior there, feeding c1, c2), child of p1 in stripe 1
    return Plan(
        version=1,
        hub="hub",
        stripes=2,
        parent=[
            {"p0": "hub", "p1": "p0", "me": "p0", "c1": "me", "c2": "me", "x": "p0"},
            {"p1": "hub", "p0": "p1", "me": "p1", "c1": "p1", "c2": "x", "x": "p1"},
        ],
        children=[
            {"hub": ["p0"], "p0": ["p1", "me", "x"], "me": ["c1", "c2"]},
            {"hub": ["p1"], "p1": ["p0", "me", "c1", "x"], "x": ["c2"]},
        ],
        interior={"p0": 0, "me": 0, "p1": 1, "x": 1},
        capacity={"p0": 3, "me": 2, "p1": 4, "x": 1},
    )


def sends(actions: list) -> list[tuple[str, int]]:
    return [(a.peer, a.index) for a in actions if isinstance(a, Send)]


def requests(actions: list) -> dict[str, tuple[int, ...]]:
    return {a.peer: a.indices for a in actions if isinstance(a, Request)}


def test_cut_through_forwards_only_verified_and_only_own_stripe() -> None:
    # lead 8: the window alone (the sibling rule is tested below)
    r = Relay("me", two_stripe_plan(), HASHES, window=2, lead=8)
    assert r.start(now=0.0) == []
    assert sends(r.on_chunk_verified(0, now=0.1)) == [("c1", 0), ("c2", 0)]
    assert sends(r.on_chunk_verified(1, now=0.2)) == []  # stripe 1: I am a leaf there
    assert sends(r.on_chunk_verified(2, now=0.3)) == [("c1", 2), ("c2", 2)]
    # window of 2 per child: chunk 4 waits until an ack frees a slot, then goes in order
    assert sends(r.on_chunk_verified(4, now=0.4)) == []
    assert sends(r.on_chunk_verified(6, now=0.5)) == []
    assert sends(r.on_child_ack("c1", 0)) == [("c1", 4)]
    assert sends(r.on_child_ack("c1", 2)) == [("c1", 6)]
    assert sends(r.on_child_ack("c2", 2)) == [("c2", 4)]
    # duplicates and out-of-range chunks do nothing
    assert r.on_chunk_verified(2, now=0.6) == []
    assert r.on_chunk_verified(99, now=0.6) == []
    assert r.on_chunk_verified(-1, now=0.6) == []


def test_child_that_has_a_chunk_is_not_sent_it_and_complete_once() -> None:
    r = Relay("me", two_stripe_plan(), HASHES, window=8)
    r.on_have("c2", bitmap_from_indices([0, 2], N))
    out = r.on_chunk_verified(0, now=0.0)
    assert sends(out) == [("c1", 0)]
    completes = 0
    for i in range(1, N):
        completes += sum(isinstance(a, Complete) for a in r.on_chunk_verified(i, now=float(i)))
    assert completes == 1
    assert r.on_tick(100.0) == []  # complete: nothing to pull


def test_hub_relay_starts_with_everything() -> None:
    r = Relay("hub", two_stripe_plan(), HASHES, have=range(N), window=1)
    out = r.start(now=0.0)
    assert sends(out) == [("p0", 0), ("p1", 1)]
    assert any(isinstance(a, Complete) for a in out)


def test_stall_pulls_from_a_peer_that_has_it_then_from_hub() -> None:
    r = Relay("me", two_stripe_plan(), HASHES, stall_timeout_s=5.0, request_timeout_s=3.0)
    r.on_chunk_verified(0, now=1.0)
    r.on_chunk_verified(1, now=1.0)
    r.on_have("x", bitmap_from_indices([2, 3, 4, 5], N))
    r.on_have("c1", bitmap_from_indices([2], N))
    r.on_have("p0", bitmap_from_indices(range(N), N))  # the stalled parent itself: not asked
    assert r.on_tick(4.0) == []  # not stalled yet
    reqs = requests(r.on_tick(6.5))
    # x advertises most of the missing chunks; chunks 6 and 7 nobody (but p0) has -> hub
    assert reqs == {"x": (2, 3, 4, 5), "hub": (6, 7)}
    assert "p0" not in reqs and "p1" not in reqs
    # nothing re-requested while the requests are outstanding
    assert requests(r.on_tick(7.0)) == {}
    r.on_chunk_verified(2, now=7.5)
    # x never answers the rest: after the request timeout they go elsewhere (not to x again)
    again = requests(r.on_tick(10.0))
    assert again and "x" not in again
    assert sorted(i for ix in again.values() for i in ix) == [3, 4, 5, 6, 7]


def test_corrupt_chunk_reported_and_fetched_elsewhere() -> None:
    r = Relay("me", two_stripe_plan(), HASHES)
    r.on_have("x", bitmap_from_indices([0, 2], N))
    r.on_have("c1", bitmap_from_indices([0], N))
    out = r.on_chunk_corrupt(0, "p0", b"\xff" * 32, now=1.0)
    reports = [a for a in out if isinstance(a, Report)]
    assert reports == [Report(Evidence("p0", 0, HASHES[0], b"\xff" * 32))]
    reqs = requests(out)
    # the corrupting parent is routed around right away for its whole stripe
    assert "p0" not in reqs
    assert 0 in reqs.get("x", ()) and 2 in reqs.get("x", ())
    assert set(reqs.get("hub", ())) == {4, 6}
    assert "p0" in r.bad_peers
    # later pulls never go to the bad peer even if it advertises
    r.on_have("p0", bitmap_from_indices(range(N), N))
    later = requests(r.on_tick(50.0))
    assert "p0" not in later and later


def test_corrupt_from_a_pull_source_retries_another_source() -> None:
    r = Relay("me", two_stripe_plan(), HASHES, stall_timeout_s=1.0)
    r.on_have("x", bitmap_from_indices([1], N))
    r.on_have("c1", bitmap_from_indices([1], N))
    first = requests(r.on_tick(2.0))
    src = next(p for p, ix in first.items() if 1 in ix)
    assert src in ("x", "c1")
    out = r.on_chunk_corrupt(1, src, b"\x00" * 32, now=2.5)
    retry = requests(out)
    other = {"x": "c1", "c1": "x"}[src]
    assert 1 in retry.get(other, ())


def test_serve_requests_and_new_children_on_replan() -> None:
    r = Relay("me", two_stripe_plan(), HASHES, window=4)
    r.on_chunk_verified(0, now=0.0)
    assert sends(r.on_request("stranger", [0, 3, 999])) == [("stranger", 0)]
    assert sends(r.on_chunk_verified(3, now=0.1)) == [("stranger", 3)]
    plan = two_stripe_plan()
    plan.children[0]["me"].append("new")
    plan.parent[0]["new"] = "me"
    assert sends(r.on_plan(plan, now=0.2)) == [("new", 0)]


def test_bitmap_roundtrip_and_hostile_bitmaps() -> None:
    idx = {0, 7, 8, 13, 99}
    bm = bitmap_from_indices(idx, 100)
    assert len(bm) == 13
    assert bm[0] == 0b1000_0001
    assert indices_from_bitmap(bm, 100) == idx
    assert indices_from_bitmap(b"\xff" * 1000, 10) == set(range(10))
    assert indices_from_bitmap(b"", 10) == set()


def test_request_for_a_pushed_chunk_the_child_does_not_advertise_is_served_again() -> None:
    """A push counted as delivered can be lost (it came before the child had the manifest, or the
    connection broke after the write): the child's explicit pull must get it; an advertised chunk not."""
    r = Relay("me", two_stripe_plan(), HASHES, have=range(N), window=2)
    assert sends(r.start(now=0.0)) == [("c1", 0), ("c1", 2), ("c2", 0), ("c2", 2)]
    for i in (0, 2, 4, 6):
        r.on_child_ack("c1", i)
    assert sends(r.on_request("c1", [0], now=1.0)) == [("c1", 0)]
    r.on_have("c2", bitmap_from_indices([0], N))
    for i in (0, 2, 4, 6):
        r.on_child_ack("c2", i)
    assert sends(r.on_request("c2", [0], now=1.0)) == []  # it says it holds it
    assert sends(r.on_request("c2", [2], now=1.0)) == [("c2", 2)]


def test_siblings_share_the_upload_a_child_ahead_waits_for_the_one_behind() -> None:
    """A child whose sends complete faster than its sibling's (TCP split the relay's upload
    unevenly) gets no more than ``lead`` chunks ahead: it waits, so the link is the lagger's."""
    r = Relay("me", two_stripe_plan(), HASHES, window=2, lead=1)
    for i in (0, 2, 4, 6):
        r.on_chunk_verified(i, now=0.1)
    # both children have 0 and 2 in flight, 4 and 6 queued (owed 4 each)
    assert sends(r.on_child_ack("c1", 0, now=0.2)) == [("c1", 4)]  # c1 owes 3, c2 4: within the lead
    assert sends(r.on_child_ack("c1", 2, now=0.3)) == []  # c1 owes 2, c2 still 4: c1 waits
    assert sends(r.on_child_ack("c1", 4, now=0.3)) == []  # still waits (its window is free)
    # c2 catches up: each of its acks lets c1 go on again once c2 is within the lead
    assert sends(r.on_child_ack("c2", 0, now=0.4)) == [("c2", 4)]
    assert sends(r.on_child_ack("c2", 2, now=0.5)) == [("c2", 6), ("c1", 6)]
    assert r.on_child_ack("c1", 6, now=0.6) == [] and r.on_child_ack("c2", 4, now=0.6) == []
    assert r.on_child_ack("c2", 6, now=0.7) == []


def test_a_stalled_or_far_behind_sibling_holds_nobody() -> None:
    r = Relay("me", two_stripe_plan(), HASHES, window=2, lead=1, hold_max=3, sibling_stall_s=1.0)
    for i in (0, 2, 4, 6):
        r.on_chunk_verified(i, now=0.0)
    r.on_child_ack("c1", 0, now=0.1)
    assert sends(r.on_child_ack("c1", 2, now=0.2)) == []  # held by c2 (owes 4 against 2... 1)
    # c2 acknowledges nothing for a second: a tick lets c1 go on without it
    assert sends(r.on_tick(0.9)) == []
    assert sends(r.on_tick(1.1)) == [("c1", 6)]
    # far behind: with hold_max 1, a sibling more than 1 chunk behind is slower than its stripe
    # (its stall pull is its remedy): it holds nobody
    r2 = Relay("me", two_stripe_plan(), HASHES, window=2, lead=0, hold_max=1)
    for i in (0, 2, 4, 6):
        r2.on_chunk_verified(i, now=0.0)
    assert sends(r2.on_child_ack("c1", 0, now=0.1)) == []  # c2 one behind: held (lead 0)
    assert sends(r2.on_child_ack("c1", 2, now=0.1)) == [("c1", 4), ("c1", 6)]  # two behind: not held
    # a sibling whose send failed is idle (its link broke; it will pull): it holds nobody
    r3 = Relay("me", two_stripe_plan(), HASHES, window=1, lead=0, hold_max=1)
    for i in (0, 2, 4, 6):
        r3.on_chunk_verified(i, now=0.0)
    assert sends(r3.on_child_ack("c1", 0, now=0.1)) == []  # c2 owes 4, c1 3: held
    assert sends(r3.on_send_failed("c2", 0, now=0.1)) == [("c2", 2), ("c1", 2)]


def test_sibling_rule_counts_per_stripe_taken_and_spares_pulling_peers() -> None:
    # c1 takes stripes 0 and 1 from "me", c2 only stripe 0: c1 owes twice as many chunks at the
    # same progress, and is not held for it
    plan = Plan(
        version=1, hub="hub", stripes=2,
        parent=[{"me": "hub", "c1": "me", "c2": "me"}, {"me": "hub", "c1": "me", "c2": "hub"}],
        children=[{"hub": ["me"], "me": ["c1", "c2"]}, {"hub": ["me", "c2"], "me": ["c1"]}],
    )
    r = Relay("me", plan, HASHES, window=1, lead=0, have=range(N))
    out = sends(r.start(now=0.0))
    assert out == [("c1", 0), ("c2", 0)]
    # c1 now owes 7/2 = 3.5 per stripe, c2 4: c1 is ahead (lead 0) and waits for c2
    assert sends(r.on_child_ack("c1", 0, now=0.1)) == []
    assert sends(r.on_child_ack("c2", 0, now=0.2)) == [("c2", 2), ("c1", 1)]
    # a peer that pulls is served at once, whatever the children owe
    assert sends(r.on_request("x", [5], now=0.1)) == [("x", 5)]


def test_a_child_given_by_a_repaired_plan_holds_nobody_until_it_caught_up() -> None:
    # c1 and c2 from the start; c3 (was x's child) moves under "me" with the whole backlog: it is
    # behind by arrival, not by the link's split, and must not slow c1 and c2 while it catches up
    base = two_stripe_plan()
    r = Relay("me", base, HASHES, window=1, lead=1, hold_max=8)
    for i in (0, 2, 4):
        r.on_chunk_verified(i, now=0.0)
    assert sends(r.on_child_ack("c1", 0, now=0.1)) == [("c1", 2)]
    assert sends(r.on_child_ack("c2", 0, now=0.1)) == [("c2", 2)]
    moved = Plan(
        version=1, hub="hub", stripes=2,
        parent=[dict(base.parent[0], c3="me"), dict(base.parent[1], c3="p1")],
        children=[dict(base.children[0], me=["c1", "c2", "c3"]), dict(base.children[1], p1=[*base.children[1]["p1"], "c3"])],
    )
    assert sends(r.on_plan(moved, now=0.2)) == [("c3", 0)]
    # c3 owes 3, c1 1 after its ack: 2 > lead behind, yet c1 goes on (and c2 after it)
    assert sends(r.on_child_ack("c1", 2, now=0.3)) == [("c1", 4)]
    assert sends(r.on_child_ack("c2", 2, now=0.3)) == [("c2", 4)]
    # once c3 caught up (owes nothing), it is a sibling like the others again
    for i in (0, 2, 4):
        r.on_child_ack("c3", i, now=0.4)
    assert "c3" not in r._catching_up
