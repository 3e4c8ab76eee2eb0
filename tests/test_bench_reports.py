"""The demo's JSON report carries the hub's loop-lag figures (null from a hub without them)."""

from __future__ import annotations

import json

from echo2.bench.demo import summarize

HIST = [{"step": i, "t": 0.1 * i, "reward": 0.1 * i, "train_s": 0.05} for i in range(1, 21)]


def test_demo_report_has_hub_loop_lag() -> None:
    st = {"history": HIST, "loop_lag_p99_ms": 3.5, "loop_lag_max_ms": 41.0}
    rep = summarize(st, 2, 20, 1, "copy", 12.345)
    assert rep["loop_lag_p99_ms"] == 3.5 and rep["loop_lag_max_ms"] == 41.0
    assert rep["wall_s"] == 12.35 and rep["reward_first"] < rep["reward_last"]


def test_demo_report_loop_lag_is_null_when_the_hub_has_none() -> None:
    rep = json.loads(json.dumps(summarize({"history": HIST}, 2, 20, 1, "copy", 1.0)))
    assert rep["loop_lag_p99_ms"] is None and rep["loop_lag_max_ms"] is None
