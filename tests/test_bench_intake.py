"""``echo2 bench intake`` on a small fleet: every measured result is accepted by a real hub, and
each figure it reports was measured (not a default)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from echo2.bench import intake as bench_intake


def test_bench_intake_small_fleet(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_intake.add_arguments(parser)
    out = tmp_path / "i.json"
    args = parser.parse_args(["--nodes", "4", "--results", "4", "--holds", "2", "--status", "1", "--json", str(out)])
    assert bench_intake.run(args) == 0
    rep = json.loads(out.read_text())
    assert [r["nodes"] for r in rep["rows"]] == [4]
    for row in rep["rows"]:
        assert row["accepted"] == 4  # each measured result was accepted: the hub judged real work
        assert row["result"]["loop_cpu_ms"]["n"] == 4 and row["result"]["loop_cpu_ms"]["median"] > 0
        assert row["holds"]["loop_cpu_ms"]["n"] == 2
        assert row["status"]["bytes"] > 0 and row["result_bytes"] > 8 * 64
        assert row["admission"]["loop_cpu_ms"]["n"] == 20 and row["admission"]["loop_cpu_ms"]["median"] > 0
        # the HTTP server sent the status the hub wrote (then 20 more nodes joined: it is no larger)
        assert row["http_status"]["loop_cpu_ms"]["n"] == 1 and row["http_status"]["bytes"] == row["status"]["bytes"]


def test_bench_intake_with_intake_workers(tmp_path: Path) -> None:
    """``--workers 0,1``: the same small fleet with the checks in the hub and in one intake
    worker; both accept every result, and the hub process's CPU ratio is reported."""
    parser = argparse.ArgumentParser()
    bench_intake.add_arguments(parser)
    out = tmp_path / "i.json"
    args = parser.parse_args(["--nodes", "4", "--results", "4", "--holds", "1", "--status", "1", "--workers", "0,1",
                              "--packed", "--json", str(out)])
    assert bench_intake.run(args) == 0
    rep = json.loads(out.read_text())
    assert [(r["nodes"], r["workers"]) for r in rep["rows"]] == [(4, 0), (4, 1)]
    for row in rep["rows"]:
        assert row["accepted"] == 4 and row["packed"] is True
        assert row["result"]["process_cpu_ms"]["n"] == 4 and "loop_lag_p99_ms" in row["loop_lag_during_results"]
    assert rep["ratio_result_process_cpu_by_workers"]["4:1/0"] > 0
