"""Ledger accounting against hand-computed figures."""

from __future__ import annotations

import csv
import io

import pytest

from echo2.learner_hub.ledger import (
    Ledger,
    NodeRow,
    hardware_summary,
    ledger_csv,
    render_ledger,
    render_nodes,
)


def test_costs_by_hand() -> None:
    led = Ledger()
    # Node a: $2/h active 0..1800 s (0.5 h -> $1), paused, then 3600..5400 at $4/h after a price change
    # at 4500: 900 s at $2/h ($0.5) + 900 s at $4/h ($1). Total $2.5 for 3600 s.
    led.activate("a", 0.0, price=2.0)
    led.deactivate("a", 1800.0)
    led.activate("a", 3600.0)
    led.set_price("a", 4.0, 4500.0)
    led.deactivate("a", 5400.0)
    # Node b: $0.36/h active from 1000 and still active at 4600: 3600 s -> $0.36.
    led.activate("b", 1000.0, price=0.36)
    led.accept("a", rollouts=64, tokens=10_000)
    led.accept("a", rollouts=64, tokens=15_000)
    led.accept("b", rollouts=32, tokens=5_000)
    led.refuse("b", "logprob_mismatch")
    led.refuse("b", "stale")
    led.refuse("a", "stale")

    ra, rb = led.rows(6000.0)
    assert ra.peer_id == "a" and rb.peer_id == "b"
    assert ra.active_s == pytest.approx(3600.0) and ra.cost_usd == pytest.approx(2.5) and not ra.active
    assert rb.active_s == pytest.approx(5000.0) and rb.cost_usd == pytest.approx(0.5) and rb.active
    assert (ra.accepted_results, ra.accepted_rollouts, ra.accepted_tokens, ra.refused) == (2, 128, 25_000, 1)
    assert ra.usd_per_token == pytest.approx(2.5 / 25_000)
    t = led.totals(6000.0)
    assert t.cost_usd == pytest.approx(3.0)
    assert t.accepted_tokens == 30_000 and t.accepted_rollouts == 160 and t.refused == 3
    assert t.refused_by_reason == {"stale": 2, "logprob_mismatch": 1}
    assert t.usd_per_token == pytest.approx(1e-4) and t.usd_per_million_tokens == pytest.approx(100.0)
    assert (t.nodes, t.active_nodes) == (2, 1)


def test_activate_idempotent_and_clock_never_negative() -> None:
    led = Ledger()
    led.activate("a", 100.0, price=3.6)
    led.activate("a", 200.0)  # already active: the interval still starts at 100
    assert led.row("a", 1100.0).cost_usd == pytest.approx(1.0)  # type: ignore[union-attr]
    assert led.row("a", 50.0).active_s == 0.0  # type: ignore[union-attr]
    led.deactivate("zz", 5.0)  # unknown: no-op
    assert "zz" not in led
    with pytest.raises(ValueError):
        led.set_price("a", -1.0, 0.0)
    with pytest.raises(ValueError):
        led.set_price("a", float("nan"), 0.0)
    with pytest.raises(ValueError):
        led.accept("a", -1, 0)


def test_restore_does_not_bill_downtime() -> None:
    led = Ledger()
    led.activate("a", 0.0, price=1.0)
    snap = led.snapshot(3600.0)
    led2 = Ledger.restore(snap)
    assert not led2.is_active("a")
    assert led2.row("a", 99999.0).cost_usd == pytest.approx(1.0)  # type: ignore[union-attr]
    led2.activate("a", 10_000.0)
    assert led2.row("a", 13_600.0).cost_usd == pytest.approx(2.0)  # type: ignore[union-attr]


def test_no_tokens_no_ratio() -> None:
    led = Ledger()
    led.activate("a", 0.0, price=1.0)
    assert led.totals(10.0).usd_per_token is None
    assert "$ per accepted token: -" in render_ledger(led.rows(10.0))


def test_csv_and_table() -> None:
    led = Ledger()
    led.activate("a", 0.0, price=3.6)
    led.accept("a", 4, 1000)
    rows = led.rows(1000.0)
    text = ledger_csv(rows)
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert parsed[0]["peer_id"] == "a" and float(parsed[0]["cost_usd"]) == pytest.approx(1.0)
    assert float(parsed[0]["usd_per_token"]) == pytest.approx(1e-3)
    assert parsed[-1]["peer_id"] == "TOTAL" and int(parsed[-1]["accepted_tokens"]) == 1000
    table = render_ledger(rows)
    assert "0:16:40" in table and "1.0000" in table and "1000.00" in table  # $/Mtok = 1e-3 * 1e6
    nodes = render_nodes([NodeRow("12D3KooWx", "1x H200 141GiB", 2.5, None, 0.73, "active", 1.25)])
    assert "12D3KooWx" in nodes and "0.73" in nodes and "1.2500" in nodes and " - " in nodes


def test_hardware_summary() -> None:
    assert hardware_summary(None) == "?"
    assert hardware_summary({"accelerator": "H200", "accelerator_count": 2, "accelerator_memory_bytes": 141 * 2**30}) == "2x H200 141GiB"
    assert hardware_summary({"accelerator": "", "cpu_cores": 16, "cpu_model": "EPYC"}) == "cpu 16c EPYC"
