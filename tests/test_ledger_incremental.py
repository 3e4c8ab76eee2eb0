"""The ledger's running sums (issue 20): :meth:`Ledger.totals` from them equals
:func:`totals_of` over every row, after any sequence of operations; the save set names exactly
the accounts a save must write; a frozen copy is not moved by later changes."""

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


def test_save_set_is_changed_and_active_accounts() -> None:
    led = Ledger()
    led.activate("a", 0.0, price=1.0)
    led.accept("b", 1, 10)
    led.refuse("c", "stale")
    assert sorted(led.save_set()) == ["a", "b", "c"]
    assert led.save_set() == ["a"]  # only the active one's billed time moved since
    led.deactivate("a", 10.0)
    assert led.save_set() == ["a"]  # its closing interval is saved once
    assert led.save_set() == []


def test_frozen_rows_are_those_of_the_moment_taken() -> None:
    led = Ledger()
    led.activate("a", 0.0, price=3.6)
    led.refuse("a", "stale")
    frozen = led.frozen(100.0, ["a", "unknown"])
    want = led.rows(100.0)
    led.refuse("a", "stale")
    led.set_price("a", 9.0, 50.0)
    led.accept("a", 2, 20)
    assert len(frozen) == 1 and frozen.rows() == want
    assert want[0].refused_by_reason == {"stale": 1} and want[0].cost_micro == 100_000
