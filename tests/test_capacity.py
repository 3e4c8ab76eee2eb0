"""Capacity model (BRIEF section 5) against hand-computed figures."""

from __future__ import annotations

import math

import pytest

from echo2.learner_hub.capacity import (
    NodeCapacity,
    capacity_report,
    eligible,
    min_busy_staleness,
    predicted_utilization,
    required_rate,
    task_seconds,
)

# T_train = 4 s, B = 64 rollouts -> R* = 16/s
A = NodeCapacity("a", load_s=2.0, task_s=3.0, rate=8.0)  # D+G = 5  -> needs S >= 2
Bn = NodeCapacity("b", load_s=1.0, task_s=2.0, rate=6.0)  # D+G = 3 -> S >= 1
C = NodeCapacity("c", load_s=5.0, task_s=6.0, rate=10.0)  # D+G = 11 -> S >= 3
FLEET = [A, Bn, C]


def test_required_rate() -> None:
    assert required_rate(64, 4.0) == pytest.approx(16.0)
    assert required_rate(64, 4.0, margin=1.25) == pytest.approx(20.0)
    with pytest.raises(ValueError):
        required_rate(0, 4.0)


def test_task_seconds() -> None:
    assert task_seconds(32, 8.0) == pytest.approx(4.0)
    assert task_seconds(32, 0.0) == math.inf


def test_eligibility_by_staleness() -> None:
    assert [n.node_id for n in eligible(FLEET, 1, 4.0)] == ["b"]
    assert [n.node_id for n in eligible(FLEET, 2, 4.0)] == ["a", "b"]
    assert [n.node_id for n in eligible(FLEET, 3, 4.0)] == ["a", "b", "c"]
    # synchronous: everyone is eligible, the learner pays D + G instead
    assert len(eligible(FLEET, 0, 4.0)) == 3


def test_freshness_boundary_is_inclusive() -> None:
    edge = NodeCapacity("e", load_s=1.5, task_s=2.5, rate=1.0)  # D+G = 4 = 1 * T_train
    assert eligible([edge], 1, 4.0) == [edge]
    assert eligible([NodeCapacity("f", 1.5, 2.5001, 1.0)], 1, 4.0) == []


def test_utilization_pipelined() -> None:
    # step time tau = max(T, B / sum r, (rate-weighted D+G) / S); sum r = 24, B / sum r = 2.667,
    # rate-weighted D+G = (8*5 + 6*3 + 10*11) / 24 = 7.0
    # S=1: tau = max(4, 2.667, 7) = 7 -> 4/7; S=2: tau = max(4, 2.667, 3.5) = 4 -> 1; S=3 -> 1
    assert predicted_utilization(64, 4.0, 1, FLEET) == pytest.approx(4 / 7)
    assert predicted_utilization(64, 4.0, 2, FLEET) == pytest.approx(1.0)
    assert predicted_utilization(64, 4.0, 3, FLEET) == pytest.approx(1.0)
    # throughput-bound fleet: only b, always fresh at S=2: 6*4/64 = 0.375
    assert predicted_utilization(64, 4.0, 2, [Bn]) == pytest.approx(0.375)


def test_utilization_synchronous() -> None:
    # 4 / (4 + max D (5) + 64/24) = 4 / 11.6667
    assert predicted_utilization(64, 4.0, 0, FLEET) == pytest.approx(4.0 / (4.0 + 5.0 + 64.0 / 24.0))
    assert predicted_utilization(64, 4.0, 0, [NodeCapacity("z", 0, 0, 0.0)]) == 0.0


def test_min_busy_staleness() -> None:
    # cumulative rate by needed S: S=1 -> 6, S=2 -> 14, S=3 -> 24
    assert min_busy_staleness(64, 4.0, FLEET) == 3  # needs 16
    assert min_busy_staleness(56, 4.0, FLEET) == 2  # needs 14 (exactly reached)
    assert min_busy_staleness(24, 4.0, FLEET) == 1  # needs 6
    assert min_busy_staleness(64, 4.0, FLEET, margin=1.5) == 3  # needs 24 = the whole fleet
    assert min_busy_staleness(64, 4.0, FLEET, margin=1.6) is None  # needs 25.6 > 24


def test_min_busy_staleness_none_when_fleet_too_slow() -> None:
    assert min_busy_staleness(200, 4.0, FLEET) is None  # needs 50/s, fleet has 24/s


def test_report() -> None:
    rep = capacity_report(64, 4.0, 2, FLEET, margin=1.25)
    assert rep.required_rate == pytest.approx(20.0)
    assert rep.eligible_ids == ("a", "b") and rep.eligible_rate == pytest.approx(14.0)
    assert rep.ineligible == {"c": pytest.approx(11.0)}
    assert not rep.meets_throughput and not rep.synchronous
    # whole fleet at S=2: tau = max(4, 64/24, 7/2) = 4 -> 1.0 (c stretches nothing at S=2)
    assert rep.predicted_utilization == pytest.approx(1.0)
    assert rep.min_busy_staleness == 3
    text = rep.format()
    assert "R* = 20" in text and "BELOW" in text and "100.0%" in text and "c (D+G=11s)" in text
    sync = capacity_report(64, 4.0, 0, FLEET)
    assert sync.synchronous and sync.meets_throughput and "synchronous" in str(sync)
