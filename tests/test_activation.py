"""Cost-aware activation: exact vs brute force, greedy quality, hysteresis, infeasibility."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2.bench.activation import make_fleet
from echo2.learner_hub.activation import NodeOffer, lp_bound, reselect, solve


def brute(nodes: list[NodeOffer], required: float) -> float | None:
    best: float | None = None
    for k in range(len(nodes) + 1):
        for combo in itertools.combinations(nodes, k):
            if sum(n.rate for n in combo) >= required - 1e-9 * max(1.0, required):
                c = sum(n.price for n in combo)
                if best is None or c < best:
                    best = c
    return best


node_lists = st.lists(
    st.tuples(
        st.integers(0, 3000),  # price in $0.001 units (on the marketplace grid)
        st.one_of(st.just(0.0), st.floats(0.05, 50.0, allow_nan=False)),
    ),
    min_size=1,
    max_size=12,
)


def _mk(raw: list[tuple[int, float]]) -> list[NodeOffer]:
    return [NodeOffer(f"n{i}", p / 1000, r) for i, (p, r) in enumerate(raw)]


@settings(max_examples=150, deadline=None)
@given(node_lists, st.floats(0.01, 1.2))
def test_exact_matches_brute_force_and_greedy_is_feasible(raw: list[tuple[int, float]], frac: float) -> None:
    nodes = _mk(raw)
    total = sum(n.rate for n in nodes)
    required = frac * total if total > 0 else 1.0
    opt = brute(nodes, required)
    ex = solve(nodes, required, "exact")
    gr = solve(nodes, required, "greedy")
    au = solve(nodes, required, "auto")
    if opt is None:
        for a in (ex, gr, au):
            assert a.method == "all" and not a.feasible and a.shortfall > 0
        return
    assert ex.exact
    assert ex.cost == pytest.approx(opt, abs=1e-9)
    by_id = {n.node_id: n for n in nodes}
    for a in (ex, gr, au):
        assert a.feasible
        assert sum(by_id[i].rate for i in a.selected) >= required - 1e-9 * max(1.0, required)
        assert a.cost >= opt - 1e-9  # never cheaper than the optimum
        assert a.lower_bound is not None and a.lower_bound <= opt + 1e-9
        assert all(by_id[i].rate > 0 for i in a.selected)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.05, 50.0)), min_size=1, max_size=10),
    st.floats(0.05, 1.0),
)
def test_off_grid_prices_give_honest_bounds(raw: list[tuple[float, float]], frac: float) -> None:
    nodes = [NodeOffer(f"n{i}", p, r) for i, (p, r) in enumerate(raw)]
    required = frac * sum(n.rate for n in nodes)
    opt = brute(nodes, required)
    assert opt is not None
    ex = solve(nodes, required, "exact", quantum=0.01)
    assert ex.lower_bound is not None
    assert ex.lower_bound <= opt + 1e-9 <= ex.cost + 2e-9
    # the DP guarantee: at most one quantum per selected node above the bound
    assert ex.cost - ex.lower_bound <= 0.01 * len(ex.selected) + 1e-6


def test_repair_finds_single_node_cover() -> None:
    # price-per-rate order takes a then b; repair drops a, which b alone makes redundant
    nodes = [NodeOffer("a", 1.0, 10.0), NodeOffer("b", 1.5, 11.0)]
    for m in ("greedy", "exact", "auto"):
        a = solve(nodes, 11.0, m)
        assert a.selected == ("b",) and a.cost == pytest.approx(1.5)


def test_lp_bound_is_fractional_greedy() -> None:
    nodes = [NodeOffer("a", 1.0, 10.0), NodeOffer("b", 3.0, 10.0)]
    import numpy as np

    value, lam = lp_bound(np.array([1.0, 3.0]), np.array([10.0, 10.0]), 15.0)
    assert value == pytest.approx(1.0 + 0.5 * 3.0) and lam == pytest.approx(0.3)
    assert solve(nodes, 15.0).cost == pytest.approx(4.0)


def test_infeasible_activates_all_positive_rate_nodes() -> None:
    nodes = [NodeOffer("a", 1.0, 3.0), NodeOffer("b", 2.0, 4.0), NodeOffer("z", 0.0, 0.0)]
    a = solve(nodes, 10.0)
    assert a.method == "all" and set(a.selected) == {"a", "b"}
    assert not a.feasible and a.shortfall == pytest.approx(3.0)
    assert a.lower_bound is None and a.gap_bound is None


def test_zero_requirement_and_free_nodes() -> None:
    nodes = [NodeOffer("a", 1.0, 3.0), NodeOffer("free", 0.0, 2.0)]
    assert solve(nodes, 0.0).selected == ()
    a = solve(nodes, 2.0, "exact")
    assert a.selected == ("free",) and a.cost == 0.0 and a.exact


def test_invalid_input() -> None:
    with pytest.raises(ValueError):
        solve([NodeOffer("a", 1.0, 1.0), NodeOffer("a", 2.0, 1.0)], 1.0)
    with pytest.raises(ValueError):
        NodeOffer("a", -1.0, 1.0)
    with pytest.raises(ValueError):
        NodeOffer("a", 1.0, math.nan)
    with pytest.raises(ValueError):
        solve([NodeOffer("a", 1.0, 1.0)], 1.0, "magic")


def test_hysteresis_keeps_current_set_for_small_gain() -> None:
    nodes = [NodeOffer("a", 1.00, 10.0), NodeOffer("b", 0.97, 10.0), NodeOffer("c", 0.80, 10.0)]
    # current {a}: feasible; optimum {c} is 20% cheaper -> switch
    sw = reselect(["a"], nodes, 10.0, min_gain=0.05)
    assert sw.method != "kept" and sw.selected == ("c",)
    # without c, optimum {b} is only 3% cheaper -> keep {a}
    kept = reselect(["a"], nodes[:2], 10.0, min_gain=0.05)
    assert kept.method == "kept" and kept.selected == ("a",) and kept.cost == pytest.approx(1.0)
    assert not kept.exact and kept.lower_bound == pytest.approx(0.97)
    # min_gain 0 -> always take the cheaper optimum
    assert reselect(["a"], nodes[:2], 10.0, min_gain=0.0).selected == ("b",)


def test_hysteresis_switches_when_current_set_no_longer_covers() -> None:
    nodes = [NodeOffer("a", 1.0, 10.0), NodeOffer("b", 1.5, 10.0)]
    # "gone" left the fleet; {a} alone is below the new requirement
    a = reselect(["a", "gone"], nodes, 15.0, min_gain=0.5)
    assert a.method != "kept" and set(a.selected) == {"a", "b"}
    # rate drifted: the same set no longer covers -> re-solve
    drifted = [NodeOffer("a", 1.0, 4.0), NodeOffer("b", 1.5, 10.0)]
    assert reselect(["a"], drifted, 8.0, min_gain=0.5).selected == ("b",)


def test_bench_fleet_1000_greedy_within_one_percent_of_proven_optimum() -> None:
    fleet = make_fleet(1000, 7)
    required = 0.3 * sum(n.rate for n in fleet)
    ex = solve(fleet, required, "exact")
    gr = solve(fleet, required, "greedy")
    au = solve(fleet, required, "auto")
    assert ex.exact  # prices are on the $0.001 grid, so the DP proves optimality
    assert ex.cost <= gr.cost <= ex.cost * 1.01
    assert ex.cost <= au.cost <= gr.cost
    assert gr.gap_bound is not None and gr.gap_bound <= 0.01
