"""``echo2 bench attack``: the pure parts (rows, the ``blocked`` rule, the summary) and one slow
end-to-end run of two cheap attacks against a live swarm."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from echo2.bench.attack_rows import (
    Window,
    build_row,
    counter_delta,
    error_row,
    growth,
    is_blocked,
    outcome,
    rate,
    rate_ratio,
    summary,
    table,
)

ROW_KEYS = {"id", "honest_rate_ratio", "hub_rss_growth_mib", "node_rss_growth_mib", "hosts_alive", "effect", "blocked",
            "refusals"}


def test_blocked_needs_a_measured_prevention_on_live_hosts() -> None:
    assert is_blocked(True, True)
    assert not is_blocked(True, False)  # a host died: never a block
    assert not is_blocked(False, True)  # the effect was measured as achieved
    assert not is_blocked(None, True)  # the effect could not be measured


def test_rates_and_ratio() -> None:
    assert rate(100, 300, 10.0) == 20.0
    assert rate(None, 300, 10.0) is None
    assert rate(300, 100, 10.0) == 0.0  # a counter that went back (hub restarted) is no negative rate
    assert rate_ratio(20.0, 10.0) == 0.5
    assert rate_ratio(0.0, 10.0) is None  # no baseline, nothing to compare
    assert rate_ratio(None, 10.0) is None
    assert rate_ratio(math.inf, 10.0) is None


def test_growth_is_the_peak_above_the_first_sample() -> None:
    assert growth([100.0, 180.0, 120.0]) == 80.0
    assert growth([100.0, 90.0]) == 0.0
    assert growth([]) == 0.0


def test_counter_delta_keeps_what_rose() -> None:
    assert counter_delta({"busy": 3, "replay": 1}, {"busy": 10, "replay": 1, "new": 2}) == {"busy": 7, "new": 2}


def _window(**kw: object) -> Window:
    base: dict[str, object] = dict(baseline_rate=100.0, attack_rate=90.0, hub_rss=[500.0, 520.0],
                                   node_rss=[[300.0, 310.0], [300.0, 400.0]], hosts_alive=True)
    base.update(kw)
    return Window(**base)  # type: ignore[arg-type]


def test_row_has_the_issue_fields_and_is_json() -> None:
    row = build_row("A1", _window(refusals={"hub_status": {"control.busy": 4}}), {"busy": 0}, True)
    assert ROW_KEYS <= set(row)
    assert row["honest_rate_ratio"] == 0.9
    assert row["hub_rss_growth_mib"] == 20.0
    assert row["node_rss_growth_mib"] == 100.0  # the worst node
    assert row["blocked"] is True
    assert row["refusals"] == {"hub_status": {"control.busy": 4}}
    json.dumps(row)


def test_row_of_a_dead_host_is_not_blocked_and_says_crashed() -> None:
    row = build_row("A7", _window(hosts_alive=False, dead=["node0"]), {"node_survived": False}, True)
    assert row["blocked"] is False
    assert outcome(row) == "crashed"


def test_outcomes() -> None:
    assert outcome(build_row("A1", _window(attack_rate=10.0), {}, True)) == "stalled"
    assert outcome(build_row("A1", _window(), {}, False)) == "open"
    assert outcome(build_row("A1", _window(), {}, None)) == "open"
    assert outcome(build_row("A1", _window(attack_rate=70.0), {}, True)) == "degraded"  # ratio 0.7 < 0.8
    assert outcome(build_row("A1", _window(hub_rss=[500.0, 700.0]), {}, True)) == "degraded"  # 200 MiB > 128
    assert outcome(build_row("A1", _window(), {}, True)) == "blocked"
    err = error_row("A3", "swarm did not come up")
    assert ROW_KEYS <= set(err) and err["blocked"] is False and outcome(err) == "crashed"
    rows = [build_row("A1", _window(), {}, True), build_row("A2", _window(attack_rate=1.0), {}, False)]
    assert summary(rows) == {"blocked": ["A1"], "stalled": ["A2"]}
    assert len(table(rows).splitlines()) == 3


def test_a3_verdict_counts_only_requests_that_reached_a_guard() -> None:
    from echo2.bench.attack_hub import A3_RATE_LIMITED, _a3_outcome, a3_prevented
    from echo2.protocol.framing import RemoteError

    # session 6's run: 87 answered, 922 refused by the per-IP bucket before their envelope was
    # opened, the strangers' pool grew by 101 (+ the honest probe's own admissions)
    guards = {"replay_guards": {"admitted": {"entries": 475, "max_entries": 1 << 20},
                                "unadmitted_admission": {"entries": 103, "max_entries": 10_000}}}
    assert _a3_outcome(RemoteError("meaning", A3_RATE_LIMITED + " right now; retry later")) == "rate_limited"
    assert _a3_outcome(RemoteError("meaning", "admission request names another peer")) == "meaning"
    assert a3_prevented({"admitted": 87, "rate_limited": 922}, guards, 101.0, 0)
    # the same counts with the bucket's refusals not told apart: the old rule called this a miss
    assert not a3_prevented({"admitted": 87, "meaning": 922}, guards, 101.0, 0)
    # nonces that reached a guard but not the strangers' pool: achieved
    assert not a3_prevented({"admitted": 87, "refused": 300, "rate_limited": 922}, guards, 101.0, 0)
    # an honest message refused as a replay is never a block
    assert not a3_prevented({"admitted": 87, "rate_limited": 922}, guards, 101.0, 1)
    # a full strangers' pool evicts: bounded by design, whatever its growth
    full = {"replay_guards": {"unadmitted_admission": {"entries": 10_000, "max_entries": 10_000}}}
    assert a3_prevented({"admitted": 90_000}, full, 0.0, 0)


def test_registry_covers_a1_to_a12_and_the_cli_knows_it() -> None:
    import argparse

    from echo2.bench import cli
    from echo2.bench.attack import registry

    assert list(registry()) == [f"A{i}" for i in range(1, 13)]
    p = argparse.ArgumentParser()
    cli.register(p)
    args = p.parse_args(["attack", "--only", "A1,A12", "--seconds", "3", "--json", "x.json"])
    assert args.only == "A1,A12" and args.seconds == 3.0


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_attack_bench_runs_cheap_ids_end_to_end(tmp_path: Path) -> None:
    from echo2.bench.attack import attack_swarm

    report = attack_swarm(tmp_path / "swarm", ["A12", "A4"], seconds=5.0, baseline_s=3.0, startup_timeout_s=240)
    rows = {r["id"]: r for r in report["rows"]}
    assert set(rows) == {"A12", "A4"}
    for r in rows.values():
        assert ROW_KEYS <= set(r), r
        assert isinstance(r["effect"], dict), r["effect"]  # measured, not "not measured: ..."
        d = r["detail"]
        assert d["baseline_rollouts_per_s"] and d["baseline_rollouts_per_s"] > 0
        # the baseline is pooled from a window before and one after the attack (same length each)
        lo, hi = sorted([d["baseline_before_per_s"], d["baseline_after_per_s"]])
        assert lo - 0.01 <= d["baseline_rollouts_per_s"] <= hi + 0.01
        assert set(d["victim_cpu_per_s"]) == {"before", "attack", "after"}
    assert "bytes_served_to_stranger" in rows["A12"]["effect"]
    assert "node_rss_peak_growth_mib" in rows["A4"]["effect"]
    json.dumps(report)
