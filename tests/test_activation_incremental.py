"""The fleet's active set kept by events (activation.ActiveSet) equals the full decision
(activation.choose_active) re-run after every event, on random sequences of joins, leaves,
pauses, price and rate changes and periodic full solves (issue 20: admission re-ran the full
decision over every node, 2-4 ms at 10,000 nodes)."""

from __future__ import annotations

import random

import pytest

from echo2.learner_hub.activation import ActiveSet, Offer, choose_active


def _offer(rng: random.Random) -> Offer:
    price = 0.0 if rng.random() < 0.2 else round(rng.uniform(0.01, 3.0), 3)
    rate = None if rng.random() < 0.4 else round(rng.uniform(0.5, 20.0), 2)
    return price, rate


@pytest.mark.parametrize("seed", range(60))
def test_incremental_equals_full_after_every_event(seed: int) -> None:
    rng = random.Random(seed)
    inc = ActiveSet()
    offers: dict[str, Offer] = {}  # the reference's view: the available nodes
    ref_paid: set[str] = set()
    cost_aware, need = False, 0.0
    solves_by_event = 0
    for step in range(400):
        before = set(inc.active)
        r = rng.random()
        peer = f"n{rng.randrange(25)}"
        if r < 0.45:  # admitted, resumed, or re-admitted with a new offer
            o = _offer(rng)
            offers[peer] = o
            solves0 = inc.solves
            added, removed = inc.join(peer, o)
            solves_by_event += inc.solves - solves0
        elif r < 0.8:  # paused, dropped or banned (or a node not there: nothing)
            offers.pop(peer, None)
            solves0 = inc.solves
            added, removed = inc.leave(peer)
            solves_by_event += inc.solves - solves0
        else:  # the periodic full decision: rates measured, R* and the mode may have moved
            for p in list(offers):
                if rng.random() < 0.3:
                    price, rate = offers[p]
                    offers[p] = (price, None if rate is None and rng.random() < 0.5 else round(rng.uniform(0.5, 20.0), 2))
            cost_aware = rng.random() < 0.8
            need = rng.uniform(0.0, 60.0)
            added, removed = inc.solve(offers, cost_aware, need)
        want, ref_paid, _ = choose_active(offers, cost_aware, need, ref_paid)
        assert inc.active == want, f"step {step}"
        assert inc.paid == ref_paid
        assert added == inc.active - before and removed == before - inc.active
    # events that could not change the paid cover did not re-solve it (what makes them O(1))
    assert solves_by_event < 400


def test_untimed_joins_and_leaves_never_resolve() -> None:
    inc = ActiveSet()
    paid = {f"p{i}": (1.0 + i / 100, 5.0) for i in range(200)}
    inc.solve(paid, cost_aware=True, need=50.0)
    chosen = set(inc.active)
    assert 10 <= len(chosen) < 200 and inc.solves == 1
    for i in range(1000):  # nodes on probation come and go: active while available, no solve
        assert inc.join(f"new{i}", (0.5, None)) == ({f"new{i}"}, set())
        if i % 2:
            assert inc.leave(f"new{i}") == (set(), {f"new{i}"})
    assert inc.solves == 1 and chosen <= inc.active and len(inc.active) == len(chosen) + 500
    # a chosen paid node leaves: the cover is re-solved, as the full decision would
    gone = sorted(chosen)[0]
    added, removed = inc.leave(gone)
    assert inc.solves == 2 and gone in removed and added
    assert inc.active == choose_active(inc.offers, True, 50.0, chosen - {gone})[0]


def test_not_cost_aware_is_every_available_node() -> None:
    inc = ActiveSet()
    inc.solve({"a": (1.0, 2.0), "b": (0.0, None)}, cost_aware=False, need=100.0)
    inc.join("c", (5.0, 3.0))
    inc.leave("a")
    assert inc.active == {"b", "c"} and inc.solves == 1


@pytest.mark.parametrize("seed", range(40))
def test_a_decision_made_away_from_the_loop_is_the_full_one_with_the_events_since(seed: int) -> None:
    """The periodic decision is made in a worker thread on a snapshot of the offers
    (Fleet.reactivate) while joins and leaves go on: adopted, the set equals the full decision
    over the offers as they are now; discarded (None) when an event re-solved meanwhile."""
    rng = random.Random(seed)
    cost_aware = seed % 4 != 0  # fixed per sequence: the mode changes only at a solve
    inc = ActiveSet()
    offers = {f"n{i}": _offer(rng) for i in range(30)}
    inc.solve(offers, cost_aware, 30.0)
    adopted = 0
    for _ in range(40):
        for p in list(offers):  # rates measured since
            if rng.random() < 0.3 and offers[p][1] is not None:
                offers[p] = (offers[p][0], round(rng.uniform(0.5, 20.0), 2))
        need = rng.uniform(0.0, 60.0)
        snap, prev_paid, mark = dict(offers), set(inc.paid), inc.mark()
        decided = choose_active(snap, cost_aware, need, prev_paid)  # in the worker thread
        for _ in range(rng.randrange(5)):  # events while it runs
            peer = f"n{rng.randrange(40)}"
            if rng.random() < 0.5:
                o = (round(rng.uniform(0.01, 3.0), 3), None) if rng.random() < 0.7 else _offer(rng)
                offers[peer] = o
                inc.join(peer, o)
            else:
                offers.pop(peer, None)
                inc.leave(peer)
        before = set(inc.active)
        changed = inc.adopt(snap, cost_aware, need, decided, mark)
        if changed is None:
            assert inc.solves > mark[0]  # an event re-solved on the loop: fresher than the thread's
            inc.solve(offers, cost_aware, need)
            continue
        adopted += 1
        assert inc.active == choose_active(offers, cost_aware, need, prev_paid)[0]
        assert changed == (inc.active - before, before - inc.active) and set(inc.offers) == set(offers)
    assert adopted >= 10
