"""The ledger's running sums (issue 20): :meth:`Ledger.totals` from them equals
:func:`totals_of` over every row, after any sequence of operations; the save set names exactly
the accounts a save must write; a save's view reads whole accounts."""

from __future__ import annotations

import random

import pytest

from echo2.learner_hub.ledger import Ledger, totals_of


def _random_ops(led: Ledger, rng: random.Random, n_ops: int, t: float) -> float:
    peers = [f"p{i}" for i in range(12)]
    for _ in range(n_ops):
        t += rng.choice([0.0, 0.001, 0.37, 5.0, 61.3])
        p = rng.choice(peers)
        op = rng.randrange(5)
        if op == 0:
            led.activate(p, t, price=rng.choice([None, 0.0, 0.5, 1.7]))
        elif op == 1:
            led.deactivate(p, t)
        elif op == 2:
            led.set_price(p, rng.choice([0.0, 0.25, 3.0, 0.0001]), t)
        elif op == 3:
            led.accept(p, rng.randrange(9), rng.randrange(600))
        else:
            led.refuse(p, rng.choice(["stale", "bad_logprobs", "late"]))
    return t


@pytest.mark.parametrize("seed", range(8))
def test_totals_equal_the_sum_of_rows(seed: int) -> None:
    rng = random.Random(seed)
    led = Ledger()
    t = 1000.0
    for _ in range(20):
        t = _random_ops(led, rng, 15, t)
        for later in (t, t + 0.4, t + 3600.0):
            assert led.totals(later) == totals_of(led.rows(later))
    # restored: every account inactive, the sums rebuilt from the rows
    back = Ledger.restore(led.snapshot(t))
    assert back.totals(t + 10) == totals_of(back.rows(t + 10)) and back.changed == set()


def test_totals_when_the_clock_steps_back() -> None:
    led = Ledger()
    led.activate("a", 100.0, price=2.0)
    led.activate("b", 50.0, price=1.0)
    assert led.totals(60.0) == totals_of(led.rows(60.0))  # "a"'s open interval clips at 0


def test_save_due_is_changed_accounts_and_active_ones_by_deadline() -> None:
    led = Ledger()
    led.activate("a", 0.0, price=1.0)
    led.accept("b", 1, 10)
    led.refuse("c", "stale")
    assert sorted(led.save_due(0.0, 10.0)) == ["a", "b", "c"]
    assert led.save_due(5.0, 10.0) == []  # nothing changed, "a" was saved 5 s ago
    assert led.save_due(10.0, 10.0) == ["a"]  # the active one's billed time, every 10 s
    led.accept("b", 1, 10)
    assert led.save_due(12.0, 10.0) == ["b"]
    led.deactivate("a", 15.0)
    assert led.save_due(15.0, 10.0) == ["a"]  # its closing interval, once
    assert led.save_due(40.0, 10.0) == []  # inactive and unchanged: never again


def test_save_due_spreads_a_burst_of_active_accounts() -> None:
    """1,000 accounts activated at once: at most 1.1 x 1,000 / 10 s per save afterwards, each
    saved again within twice the period, and the saves of later periods spread out."""
    led = Ledger()
    for i in range(1000):
        led.activate(f"p{i:04}", 0.0)
    assert len(led.save_due(0.0, 10.0)) == 1000  # changed: all of them, at once
    last = {f"p{i:04}": 0.0 for i in range(1000)}
    per_save = []
    for t in range(1, 61):
        due = led.save_due(float(t), 10.0)
        per_save.append(len(due))
        for p in due:
            assert t - last[p] >= 10.0
            last[p] = float(t)
        assert all(t - v <= 20.0 for v in last.values())  # none waits more than twice the period
    assert max(per_save) <= 110 and min(per_save[-20:]) >= 1  # ~100 a second, no second idle
    assert 900 <= sum(per_save[-10:]) <= 1100  # each account about once per period


def test_view_reads_each_account_when_its_rows_are_built() -> None:
    """A save's view is read in the store's thread: the rows at its ``now`` of the accounts as
    they are then (one whole account each), of the peers it names that have one."""
    led = Ledger()
    led.activate("a", 0.0, price=3.6)
    led.refuse("a", "stale")
    view = led.view(100.0, ["a", "unknown"])
    led.refuse("a", "stale")
    led.set_price("a", 7.2, 50.0)
    rows = view.rows()
    assert len(view) == 2 and rows == [r for r in led.rows(100.0) if r.peer_id == "a"]
    assert rows[0].refused_by_reason == {"stale": 2} and rows[0].cost_micro == 50_000 + 100_000
