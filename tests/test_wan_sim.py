"""Wide-area simulator (bench/wan_sim.py): it agrees with the LAN simulator where they overlap,
honours the NAT connection rule, survives churn, and the CLI exposes it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from echo2.bench import broadcast
from echo2.bench.broadcast_sim import simulate
from echo2.bench.wan_sim import _Wan, simulate_wan
from echo2.learner_hub.planner import HUB

MB = 1_000_000


def test_uniform_fleet_matches_the_lan_simulator() -> None:
    wan = simulate_wan(64, 16, hub_MBps=10, rate_lo=10, rate_hi=10)
    lan = simulate("pipelined", 64, 16, 10)
    assert wan.chunk_bytes == lan.chunk_bytes and wan.n_chunks == lan.n_chunks
    assert wan.seconds == pytest.approx(lan.seconds, rel=0.02)
    # equal uploads, hub included: the hub's own floor is the fluid bound
    assert wan.fluid_seconds == pytest.approx(16 / 10) == pytest.approx(wan.hub_floor_seconds)
    assert wan.ratio_fluid <= 1.25  # the fill S·D/k = 14/62 of the rule's 256 KiB chunks


def test_fluid_bound_when_uploads_are_scarce() -> None:
    # nodes upload 1 MB/s, the hub 100: N*M/(b_hub + sum b) binds, not M/b_hub
    r = simulate_wan(20, 8, hub_MBps=100, rate_lo=1, rate_hi=1)
    assert r.fluid_seconds == pytest.approx(20 * 8 / (100 + 20))
    assert r.seconds >= r.fluid_seconds * 0.999
    assert r.issue_bound_seconds >= r.fluid_seconds


def test_nat_rule() -> None:
    w = _Wan(seed=3, punch_p=0.5)
    w.nat.update({"a": True, "b": True, "c": False})
    assert w.feasible("a", "c") and w.feasible("c", "a") and w.feasible(HUB, "a")
    pairs = [(f"x{i}", f"y{i}") for i in range(400)]
    for x, y in pairs:
        w.nat[x] = w.nat[y] = True
    ok = sum(w.feasible(x, y) for x, y in pairs)
    assert 150 <= ok <= 250  # about punch_p of the NAT pairs
    assert all(w.feasible(x, y) == w.feasible(y, x) for x, y in pairs)  # drawn once per pair


@pytest.mark.parametrize("punch_p", [0.0, 0.6])
def test_nated_relays_only_over_possible_connections(punch_p: float) -> None:
    r = simulate_wan(120, 8, rate_lo=2, rate_hi=125, nat_share=0.7, punch_p=punch_p, nat_relay=True, seed=1)
    assert r.nat_nodes > 60
    assert r.nat_sent_bytes > 0  # NATed nodes relay (to public children, or punched peers)
    if punch_p == 0.0:
        assert r.punch_failures > 0  # NAT-NAT edges of the plan all had to move
    assert r.ratio_fluid < 1.5  # measured 1.22 (no punch) and 1.08 (p = 0.6)


def test_nat_leaves_upload_nothing() -> None:
    r = simulate_wan(120, 8, rate_lo=2, rate_hi=125, nat_share=0.7, seed=2)
    assert r.nat_sent_bytes == 0 and r.punch_failures == 0


def test_churn_every_present_node_completes() -> None:
    r = simulate_wan(150, 16, rate_lo=2, rate_hi=125, nat_share=0.5, churn=0.1, seed=4)
    assert r.left == r.joined == 15
    assert r.joiner_max_seconds > 0
    # repairs never send the hub every orphan (it would be ~N x): measured 1.3 here
    assert r.ratio_fluid < 2.0


def test_cli_wide_area(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.json"
    p = argparse.ArgumentParser()
    broadcast.add_arguments(p)
    args = p.parse_args(["--simulate", "--nodes", "60", "--mbytes", "8", "--rates", "2:125", "--nat-share", "0.7",
                         "--churn", "0.1", "--json", str(out)])
    assert broadcast.run(args) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["wide_area"] and row["nodes"] == 60 and row["left"] == row["joined"] == 6
    assert row["ratio_fluid"] == pytest.approx(row["seconds"] / row["fluid_seconds"])
    assert "fluid bound" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        broadcast.run(p.parse_args(["--nat-share", "0.5"]))  # wide area is simulated only


@pytest.mark.parametrize(("n", "hub"), [(1, 10.0), (50, 25.0)])
def test_no_nat_no_churn_is_the_broadcast_simulator(n: int, hub: float) -> None:
    # one engine (bench/sim_engine.py): with equal uploads, no NATed share and no churn the
    # wide-area simulator runs exactly what the broadcast simulator runs
    wan = simulate_wan(n, 8, hub_MBps=hub, rate_lo=10, rate_hi=10, nat_share=0.0, churn=0.0)
    lan = simulate("pipelined", n, 8, 10, hub_MBps=hub)
    assert (wan.seconds, wan.median_seconds, wan.first_seconds) == (lan.seconds, lan.median_seconds, lan.first_seconds)
    assert (wan.hub_sent_bytes, wan.peer_sent_bytes) == (lan.hub_sent_bytes, lan.peer_sent_bytes)
    assert wan.nat_sent_bytes == wan.punch_failures == wan.left == wan.joined == 0
