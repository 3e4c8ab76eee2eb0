"""The ledger's running sums (issue 20): :meth:`Ledger.totals` from them equals
:func:`totals_of` over every row, after any sequence of operations; the save set names exactly
the accounts a save must write (the changed ones, never every billed one); a save's view reads
whole accounts."""

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


def test_a_save_takes_only_the_changed_accounts() -> None:
    """Billed accounts are not rewritten as their time grows (the store bills an open interval up
    to the hub's alive mark): with 1,000 accounts billed and nothing changing, a save writes none
    (it wrote ~110 a second before, 1,000 every 10 s)."""
    led = Ledger()
    for i in range(1000):
        led.activate(f"p{i:04}", 0.0, price=1.0)
    assert len(led.take_changed()) == 1000  # activated: each once
    assert all(led.take_changed() == [] for _ in range(60))
    led.accept("p0001", 1, 10)
    led.deactivate("p0002", 30.0)
    assert sorted(led.take_changed()) == ["p0001", "p0002"]
    assert led.take_changed() == []


def test_a_burst_of_changes_is_spread_over_saves() -> None:
    """1,000 accounts changed at once: ``limit`` a save, each taken exactly once, and one that
    changes again while waiting is still taken once."""
    led = Ledger()
    for i in range(1000):
        led.activate(f"p{i:04}", 0.0)
    taken: list[str] = []
    for k in range(10):
        batch = led.take_changed(100)
        assert len(batch) == 100
        taken += batch
        if k == 0:
            led.refuse("p0999" if "p0999" not in taken else "p0998", "stale")
    assert led.take_changed(100) == [] and sorted(taken) == [f"p{i:04}" for i in range(1000)]


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
